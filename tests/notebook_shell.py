"""A real IPython shell with mpdoctor loaded, as a notebook runs it (``store_history=True`` by the tests)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def loaded_shell(names: tuple[str, ...]) -> Iterator[object]:
    """``InteractiveShell.instance()`` after ``%load_ext mpdoctor``; unloaded, ``names`` removed and the history
    reset after."""
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "mpdoctor")
    try:
        yield sh
    finally:
        sh.run_line_magic("unload_ext", "mpdoctor")
        for name in names:
            sh.user_ns.pop(name, None)
        sh.reset(new_session=True)  # the next test's history starts empty: these cells hold mistakes on purpose
