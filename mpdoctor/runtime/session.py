"""The protocol observer in a notebook: attached for each cell after ``%load_ext mpdoctor``.

``pre_run_cell`` attaches one session-long :class:`~mpdoctor.runtime.protocol.ProtocolObserver` (its state
and scale history carry over from cell to cell), ``post_run_cell`` detaches it. From the first cell run with
torch imported until ``%unload_ext``, one wrapper stays in torch: ``GradScaler.scale``, which only calls the
original when no cell is running. The attach is lazy: the first loss a scaler scales in a cell installs the
other wrappers and the optimizer hook, and the end of the cell removes them, so a cell that does not train
costs two list operations (``bench/bench_hook.py``). A cell that starts in the middle of a step (the previous
cell scaled a loss and did not ``update()``) gets every wrapper from its first line.

A protocol mistake is announced by one line on stderr at the call where it happens (a long loop shows it at
once, before GradScaler's own error if there is one); when the cell ends, its findings are displayed as a
report (the widget in a widget frontend, else text and HTML) with the corrected lines. ``%mpdoctor`` shows
them again with the objects' diagnosis and the scale history.

A cell run before torch is imported costs one dict lookup: this module imports torch only through the
observer, and only once torch is in ``sys.modules``. The event signatures (``pre_run_cell(info)``,
``post_run_cell(result)``) are those of IPython 7.34 and later.
"""

from __future__ import annotations

import sys
from typing import Any

#: ``id(shell) -> _Session`` while installed.
_SESSIONS: dict[int, _Session] = {}


class _Session:
    """One shell's observer and its cell events."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.observer: Any = None
        self.seen = 0  # findings already shown (the observer keeps the session's findings)

    def pre_run_cell(self, info: Any = None) -> None:
        if "torch" not in sys.modules:
            return
        try:
            obs = self.observer
            if obs is None:
                from .protocol import ProtocolObserver, arm

                obs = ProtocolObserver(on_finding=_announce)
                arm()
                self.observer = obs
            obs.attach(lazy=not obs.mid_step)
        except Exception as exc:  # never a traceback in the user's notebook
            print(f"mpdoctor: the loop watcher could not attach ({type(exc).__name__}: {exc})", file=sys.stderr)

    def post_run_cell(self, result: Any = None) -> None:
        obs = self.observer
        if obs is None:
            return
        obs.detach()
        if len(obs.findings) > self.seen:
            new = obs.findings[self.seen :]
            self.seen = len(obs.findings)
            show_findings(obs, new)


def _announce(finding: Any) -> None:
    """The line printed at the call where a rule breaks; the finding itself is shown when the cell ends."""
    where = finding.evidence.get("where")
    at = f" at {where}" if where else ""
    from .rules import RULES

    title = RULES[finding.check].title if finding.check in RULES else finding.check
    print(f"mpdoctor: {finding.severity} [{finding.check}]{at}: {title} (details when the cell ends)", file=sys.stderr)


def cell_report(observer: Any, findings: list) -> Any:
    """The report of a cell's protocol findings (with the session's scale history), labelled as watched."""
    from .protocol import protocol_report

    report = protocol_report(observer, findings=findings)
    cells = sorted({(f.evidence.get("where") or "").split(",")[0] for f in findings} - {""})
    report.watched = f"the AMP loop as it ran ({', '.join(cells) or 'this cell'}): GradScaler protocol"
    return report


def show_findings(observer: Any, findings: list) -> None:
    """Display a cell's protocol findings as a report; a display failure is one line, never a traceback."""
    try:
        from ..render.frontend import show

        show(cell_report(observer, findings))
    except Exception as exc:
        from ..redact import describe_exception

        print(f"mpdoctor: could not display the loop's findings ({describe_exception(exc)})", file=sys.stderr)


def install(shell: Any) -> None:
    """Register the cell events on ``shell`` (idempotent)."""
    if id(shell) in _SESSIONS:
        return
    session = _Session(shell)
    shell.events.register("pre_run_cell", session.pre_run_cell)
    shell.events.register("post_run_cell", session.post_run_cell)
    _SESSIONS[id(shell)] = session


def uninstall(shell: Any) -> None:
    """Unregister the cell events and detach the observer."""
    session = _SESSIONS.pop(id(shell), None)
    if session is None:
        return
    for name, callback in (("pre_run_cell", session.pre_run_cell), ("post_run_cell", session.post_run_cell)):
        try:
            shell.events.unregister(name, callback)
        except ValueError:  # already gone
            pass
    if session.observer is not None:
        from .protocol import disarm

        session.observer.detach()
        disarm()


def observer(shell: Any) -> Any:
    """The session's observer (findings, ``scale_history``), or None before the first cell with torch."""
    session = _SESSIONS.get(id(shell))
    return session.observer if session is not None else None
