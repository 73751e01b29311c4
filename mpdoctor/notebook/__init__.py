"""The notebook front end: the ``%mpdoctor`` magic (IPython and Jupyter, Colab's IPython 7.34 included)."""
