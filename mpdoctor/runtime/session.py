"""The protocol observer in a notebook: attached for each cell after ``%load_ext mpdoctor``.

``pre_run_cell`` attaches one session-long :class:`~mpdoctor.runtime.protocol.ProtocolObserver` (its state
and scale history carry over from cell to cell), ``post_run_cell`` detaches it, so between cells nothing of
mpdoctor's is installed in torch. A cell run before torch is imported costs one dict lookup: this module
imports torch only through the observer, and only once torch is in ``sys.modules``. The event signatures
(``pre_run_cell(info)``, ``post_run_cell(result)``) are those of IPython 7.34 and later.
"""

from __future__ import annotations

import sys
from typing import Any

#: ``id(shell) -> (shell, observer or None, pre_run_cell, post_run_cell)`` while installed.
_SESSIONS: dict[int, list] = {}


def install(shell: Any) -> None:
    """Register the cell events on ``shell`` (idempotent)."""
    if id(shell) in _SESSIONS:
        return
    entry: list = [shell, None, None, None]

    def pre_run_cell(info: Any = None) -> None:
        if "torch" not in sys.modules:
            return
        try:
            if entry[1] is None:
                from .protocol import ProtocolObserver

                entry[1] = ProtocolObserver()
            entry[1].attach()
        except Exception as exc:  # never a traceback in the user's notebook
            print(f"mpdoctor: the loop watcher could not attach ({type(exc).__name__}: {exc})", file=sys.stderr)

    def post_run_cell(result: Any = None) -> None:
        if entry[1] is not None:
            entry[1].detach()

    entry[2], entry[3] = pre_run_cell, post_run_cell
    shell.events.register("pre_run_cell", pre_run_cell)
    shell.events.register("post_run_cell", post_run_cell)
    _SESSIONS[id(shell)] = entry


def uninstall(shell: Any) -> None:
    """Unregister the cell events and detach the observer."""
    entry = _SESSIONS.pop(id(shell), None)
    if entry is None:
        return
    for name, callback in (("pre_run_cell", entry[2]), ("post_run_cell", entry[3])):
        try:
            shell.events.unregister(name, callback)
        except ValueError:  # already gone
            pass
    if entry[1] is not None:
        entry[1].detach()


def observer(shell: Any) -> Any:
    """The session's observer (findings, ``scale_history``), or None before the first cell with torch."""
    entry = _SESSIONS.get(id(shell))
    return entry[1] if entry is not None else None
