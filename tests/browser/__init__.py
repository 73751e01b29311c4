"""Helpers for the real-browser test: a throwaway JupyterLab server and the notebook it opens."""
