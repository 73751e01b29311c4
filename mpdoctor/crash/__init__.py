"""mpdoctor at the crash: explain a known mixed-precision exception with the objects around it.

- :mod:`.patterns`: exception -> the checks that explain it (real messages).
- :mod:`.frames`: the user's objects in a traceback's frames, read without running user code.
- :mod:`.cause`: :func:`explain` diagnoses them and marks the cause.
- :mod:`.hook`: the IPython exception handler behind ``%load_ext mpdoctor``.
- :mod:`.runner`: ``python -m mpdoctor run script.py``.
- :mod:`.watch`: :func:`mpdoctor.watch` for hand-written training loops.
"""

from __future__ import annotations

from .cause import cause_label, explain

__all__ = ["cause_label", "explain"]
