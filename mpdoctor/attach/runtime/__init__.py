"""The run as patient: what the training loop does with the objects.

Observers that attach for the length of a watch (or a kernel session) and leave nothing behind, readers of
cell history and scripts (AST, never exec), and findings that name the user's own line.
"""
