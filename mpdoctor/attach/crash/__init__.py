"""mpdoctor at the crash: explain a known mixed-precision exception with the objects around it.

- :mod:`.patterns`: exception -> the checks that explain it (real messages).
- :mod:`.frames`: the user's objects in a traceback's frames, read without running user code.
- :mod:`.cause`: :func:`explain` diagnoses them and marks the cause.
- :mod:`.hook`: the IPython exception handler behind ``%load_ext mpdoctor``.

``watch()``, ``mpdoctor run`` and the training callbacks, which call :func:`explain`, live in
:mod:`mpdoctor.attach.training`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...render.formatting import cause_label
    from .cause import explain

__all__ = ["cause_label", "explain"]


def __getattr__(name: str) -> Any:
    # The exception hook imports this package with every %load_ext; the diagnosis it explains with
    # loads on the first exception.
    if name in __all__:
        from . import cause

        return getattr(cause, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
