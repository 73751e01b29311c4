"""The protocol observer in a notebook: watching every cell after ``%load_ext mpdoctor``.

From ``%load_ext`` (or the end of the first cell that imports torch) to ``%unload_ext``, one session-long
:class:`~mpdoctor.attach.runtime.protocol.ProtocolObserver` is attached lazily (its state and scale history carry over
from cell to cell) and one wrapper stays in torch: ``GradScaler.scale``, which only calls the original until a
scaler scales a loss. That first scaled loss installs the other wrappers and the optimizer hook; the cell's
``post_run_cell`` removes them again (:func:`~mpdoctor.attach.runtime.protocol.settle`), unless a step is still open
(a cell scaled a loss and did not ``update()``: the next cell is watched in full from its first line). A cell
that does not train runs none of mpdoctor's code but that one callback (``bench/bench_hook.py``).

A protocol mistake is announced by one line at the call where it happens (a long loop shows it at once, before
GradScaler's own error if there is one); when the cell ends, its findings are displayed as a report (the widget
in a widget frontend, else text and HTML) with the corrected lines. In a notebook the line is an output the
report replaces (so the finding is not said twice); in a terminal it is a line on stderr.

This module imports torch only through the observer, and only once torch is in ``sys.modules``. The event
signature (``post_run_cell(result)``) is IPython 7.34's and later's.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

#: ``id(shell) -> _Session`` while installed.
_SESSIONS: dict[int, _Session] = {}
#: The lines announced as outputs during the running cell (display handles): cleared when its report shows.
_BANNERS: list = []


class _Session:
    """One shell's observer and its cell event."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.observer: Any = None
        self.seen = 0  # findings already shown (the observer keeps the session's findings)
        self.steps_seen = 0  # scale-history records of earlier cells: a cell's report pictures its own steps
        self.reported = 0  # findings already included in a %mpdoctor report
        #: Reports the crash hook showed since the last %mpdoctor report (what it found is part of the next one).
        self.crashes: list = []
        #: ``(filename, source)`` of the cell that raised the latest of them: ``%mpdoctor`` checks its fixes on it.
        self.crash_cell: tuple[str, str, int] | None = None
        #: For each of :attr:`crashes`: the cell that raised, ``(cell id, source)`` (the id the front end gives a
        #: cell, None where it gives none), tagged when that cell's run ends.
        self.crash_tags: list[tuple[Any, str] | None] = []
        self.settle: Any = None  # mpdoctor.attach.runtime.dispatch.settle, bound at start(): no import per cell
        #: The last report shown in this shell (by %mpdoctor or the crash hook): ``%mpdoctor insert N`` numbers
        #: its code fixes.
        self.shown: Any = None

    def start(self) -> None:
        """Arm the resident wrapper and attach the session's observer, pending until its first event."""
        from .dispatch import _DISPATCH, arm, settle

        arm()
        pending = _Pending(self)
        _DISPATCH.add(pending, lazy=True)
        self.observer = pending
        self.settle = settle

    def materialize(self) -> Any:
        """The session's real observer, put in the pending one's place (imports the protocol module once)."""
        obs = self.observer
        if not isinstance(obs, _Pending):
            return obs
        from .dispatch import _DISPATCH
        from .protocol import ProtocolObserver

        real = ProtocolObserver(on_finding=_announce)
        real.lazy, real.attached = True, obs.attached
        observers = _DISPATCH.observers
        if obs in observers:
            observers[observers.index(obs)] = real
        self.observer = real
        return real

    def post_run_cell(self, result: Any = None) -> None:
        self._follow_cells(result)
        self._record_loop_accumulation()
        obs = self.observer
        if obs is None:
            if "torch" not in sys.modules:
                return
            try:
                self.start()
            except Exception as exc:  # never a traceback in the user's notebook
                print(f"mpdoctor: the loop watcher could not attach ({type(exc).__name__}: {exc})", file=sys.stderr)
            return
        try:
            self.settle()
        except Exception as exc:
            print(f"mpdoctor: the loop watcher could not settle ({type(exc).__name__}: {exc})", file=sys.stderr)
        steps = list(obs.scale_history[self.steps_seen :])
        self.steps_seen = len(obs.scale_history)
        if len(obs.findings) > self.seen:
            new = _not_yet_shown(obs.findings[self.seen :], self.crashes)
            self.seen = len(obs.findings)
            if new:
                self.shown = show_findings(obs, users_loop_findings(self.shell, new), steps) or self.shown
        _clear_banners()  # the report (this one, or the crash hook's) says what they said


    def _follow_cells(self, result: Any) -> None:
        """Keep what is current: the latest run of each cell (by the id the front end gives it), and the crashes of
        cells that have not run cleanly since. A crash is dropped when its cell runs again without raising: the
        same cell id (JupyterLab, Notebook 7, VS Code and Colab send one), or, with no id, the same code."""
        info = getattr(result, "info", None)
        cell_id, raw = getattr(info, "cell_id", None), getattr(info, "raw_cell", None)
        from . import cells

        cells.ran(self.shell, cell_id, getattr(result, "execution_count", None))
        if result is None:
            return
        if not getattr(result, "success", False):
            self.crash_tags = [tag if tag is not None else (cell_id, raw) for tag in self.crash_tags]
            return
        kept = [(report, tag) for report, tag in zip(self.crashes, self.crash_tags)
                if tag is None or not _same_cell(tag, cell_id, raw)]  # fmt: skip
        if len(kept) != len(self.crashes):
            self.crashes, self.crash_tags = [r for r, _t in kept], [t for _r, t in kept]
            if not self.crashes:
                self.crash_cell = None

    def _record_loop_accumulation(self) -> None:
        """After a cell that writes a hand-written training loop (``.backward(`` and ``.step(``), record its
        gradient accumulation against the optimizer it steps, so that ``mpdoctor.diagnose()`` in a later cell sees
        it as ``%mpdoctor`` does. Read from the cells' text, never run; the cells' parses are cached."""
        manager = getattr(self.shell, "history_manager", None)
        cells = getattr(manager, "input_hist_parsed", None)
        last = cells[-1] if isinstance(cells, list) and cells else None
        if not (isinstance(last, str) and ".backward(" in last and ".step(" in last):
            return
        from .cell_accumulation import record_cells

        record_cells(self.shell)  # never raises: a history it cannot read leaves the records as they are


class _Pending:
    """The session's observer until the first protocol event of the session (a scaler scaling a loss).

    ``%load_ext`` arms the resident wrapper through :mod:`mpdoctor.attach.runtime.dispatch` only; the observer, its
    rules and the facts it records are imported when an event first needs them (:meth:`_Session.materialize`).
    """

    lazy = True
    mid_step = False
    findings: tuple = ()
    scale_history: tuple = ()

    def __init__(self, session: _Session) -> None:
        self.session = session
        self.attached = True

    def detach(self) -> None:
        from .dispatch import _DISPATCH

        if self.attached:
            self.attached = False
            _DISPATCH.remove(self)

    def __getattr__(self, name: str) -> Any:
        if not name.startswith(("on_", "after_")):  # only the dispatch's events wake the real observer
            raise AttributeError(name)
        return getattr(self.session.materialize(), name)


def _announce(finding: Any) -> None:
    """The line printed at the call where a rule breaks; the finding itself is shown when the cell ends."""
    where = finding.evidence.get("where")
    at = f" at {where}" if where else ""
    from .protocol_rules import RULES, in_names

    title = RULES[finding.check].title if finding.check in RULES else finding.check
    evidence = finding.evidence if isinstance(finding.evidence, dict) else {}
    # The rule's title in the user's names: the subject is the scaler unless another object is at fault.
    about_scaler = finding.check not in ("amp-step-bypasses-scaler", "amp-scheduler-on-skipped-steps")
    title = in_names(title, evidence.get("scaler") or (finding.subject if about_scaler else ""),
                     evidence.get("optimizer") or "")  # fmt: skip
    line = f"mpdoctor: {finding.severity} [{finding.check}]{at}: {title} (details when the cell ends)"
    if not _banner(line):
        print(line, file=sys.stderr)


def _banner(line: str) -> bool:
    """Show ``line`` as an output the cell's report replaces when the cell ends; False where no frontend can
    replace an output (a terminal, a script)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if getattr(shell, "kernel", None) is None:
        return False
    try:
        from IPython.display import display

        from ...render.html import COLORS, FG, FONT, e

        html = f"<div style='{FONT};color:{FG};border-left:3px solid {COLORS['error']};padding:2px 6px'>{e(line)}</div>"
        _BANNERS.append(display({"text/plain": line, "text/html": html}, raw=True, display_id=True))
    except Exception:  # the line goes to stderr instead
        return False
    return True


def _clear_banners() -> None:
    """Empty the outputs the running cell's announcements took: its report now shows each finding."""
    while _BANNERS:
        handle = _BANNERS.pop()
        try:
            handle.update({"text/plain": ""}, raw=True)
        except Exception:  # a frontend gone: nothing to clear
            pass


def users_loop_findings(shell: Any, findings: list) -> list:
    """The watcher's findings with the corrected lines of the user's own loop, read from the cells that ran."""
    try:
        from .history import cell_sources
        from .loop_findings import in_the_users_loop

        return in_the_users_loop(findings, cell_sources(shell))
    except Exception:  # the watcher's own lines stand
        return findings


def cell_report(observer: Any, findings: list, steps: list | None = None) -> Any:
    """The report of a cell's protocol findings, labelled as watched, with ``steps``: the scale history of that
    cell (default: the session's)."""
    from .protocol import protocol_report

    report = protocol_report(observer, findings=findings, history=steps)
    cells = sorted({(f.evidence.get("where") or "").split(",")[0] for f in findings} - {""})
    return report.evolve(watched=f"the AMP loop as it ran ({', '.join(cells) or 'this cell'}): GradScaler protocol")


def show_findings(observer: Any, findings: list, steps: list | None = None) -> Any:
    """Display a cell's protocol findings as a report and return it; a display failure is one line, never a
    traceback (None is returned)."""
    try:
        from ...render.frontend import show

        report = cell_report(observer, findings, steps)
        show(report)
        return report
    except Exception as exc:
        from ...redact import describe_exception

        print(f"mpdoctor: could not display the loop's findings ({describe_exception(exc)})", file=sys.stderr)
        return None


def install(shell: Any) -> None:
    """Register the cell event on ``shell`` (idempotent); start watching at once when torch is imported."""
    if id(shell) in _SESSIONS:
        return
    session = _Session(shell)
    shell.events.register("post_run_cell", session.post_run_cell)
    _SESSIONS[id(shell)] = session
    if "torch" in sys.modules:
        try:
            session.start()
        except Exception as exc:  # %load_ext still registers the magic and the crash hook
            print(f"mpdoctor: the loop watcher could not attach ({type(exc).__name__}: {exc})", file=sys.stderr)


def uninstall(shell: Any) -> None:
    """Unregister the cell event, detach the observer and put ``GradScaler.scale`` back."""
    session = _SESSIONS.pop(id(shell), None)
    if session is None:
        return
    from .cells import forget

    forget(shell)
    try:
        shell.events.unregister("post_run_cell", session.post_run_cell)
    except ValueError:  # already gone
        pass
    if session.observer is not None:
        from .dispatch import disarm

        session.observer.detach()
        disarm()


def observer(shell: Any) -> Any:
    """The session's observer (findings, ``scale_history``), or None before the first cell with torch."""
    session = _SESSIONS.get(id(shell))
    return session.observer if session is not None else None


def _not_yet_shown(findings: list, crashes: list) -> list:
    """The watcher's findings that no crash report of this session already showed as its cause (one mistake,
    one display: the crash hook explained it when the cell raised)."""
    if not crashes:
        return list(findings)
    from ...rules.engine.merge import mistake_key

    shown = {mistake_key(c.cause) for c in crashes if c.cause is not None} - {None}
    return [f for f in findings if mistake_key(f) not in shown]


def unreported(shell: Any) -> tuple[list, list]:
    """What the kernel's watcher and crash hook found since the last ``%mpdoctor`` report: ``(findings, crash
    reports)``; both count as reported from now on."""
    sess = _SESSIONS.get(id(shell))
    if sess is None:
        return [], []
    obs = sess.observer
    findings = list(obs.findings[sess.reported :]) if obs is not None else []
    sess.reported = len(obs.findings) if obs is not None else 0
    crashes, sess.crashes, sess.crash_tags = sess.crashes, [], []
    sess.crash_cell = None
    from .cells import replaced_runs

    replaced = replaced_runs(shell)
    if replaced:  # what the watcher saw in a cell the user has replaced and run again is not current
        findings = [f for f in findings if _run_of(f) not in replaced]
    return findings, crashes


def observed(shell: Any, ignore: Iterable[str] = (), code: list | None = None,
             explained_by: Callable[[str], tuple] | None = None) -> Any:  # fmt: skip
    """What the kernel observed beside the objects since the last ``%mpdoctor`` report, for
    :func:`mpdoctor.attach.runtime.assembly.assemble`: ``code`` (the cells' findings, read by the caller; None: the code is
    not read), the watcher's findings and the crash hook's reports (both count as reported from now on), the scale
    history, and how to give watcher findings the user's own loop. ``explained_by``: the checks that explain a
    crash, by its cause note's slug (the crash patterns', which this layer does not import)."""
    from .assembly import Observed
    from .twins import try_on_twins

    watched, crashes = unreported(shell) if code is not None else ([], [])
    obs = observer(shell)
    return Observed(code=tuple(code or ()), watched=tuple(watched), crashes=tuple(crashes),
                    scale_history=tuple(obs.scale_history) if obs is not None and obs.scale_history else None,
                    in_users_loop=lambda findings: users_loop_findings(shell, findings), ignore=tuple(ignore),
                    try_code=lambda code: try_on_twins(code, shell.user_ns, around=observers_aside),
                    explained_by=explained_by)  # fmt: skip


def _same_cell(tag: tuple[Any, str], cell_id: Any, raw: Any) -> bool:
    """The cell a crash was tagged with is the cell that just ran: the same id, or (no id) the same code."""
    tagged_id, tagged_raw = tag
    if tagged_id is not None or cell_id is not None:
        return tagged_id == cell_id
    return isinstance(raw, str) and raw.strip() == (tagged_raw or "").strip()


def remember_shown(shell: Any, report: Any) -> None:
    """Keep ``report`` as the last one shown in ``shell`` (what ``%mpdoctor insert N`` numbers)."""
    sess = _SESSIONS.get(id(shell))
    if sess is not None and report is not None:
        sess.shown = report


def last_shown(shell: Any) -> Any:
    """The last report shown in ``shell``, or None."""
    sess = _SESSIONS.get(id(shell))
    return sess.shown if sess is not None else None


def remember_crash(shell: Any, report: Any, cell: tuple[str, str, int] | None = None) -> None:
    """Keep a report the crash hook showed, for the next ``%mpdoctor`` report of this shell, and ``cell``, the
    ``(filename, source, line that raised)`` of the cell that raised (None when the code that raised was not a
    cell's)."""
    sess = _SESSIONS.get(id(shell))
    if sess is not None:
        sess.crashes.append(report)
        sess.crash_tags.append(None)  # tagged with its cell when that cell's run ends
        sess.shown = report
        sess.crash_cell = cell


def crash_step(shell: Any) -> Any:
    """The cell that raised since the last ``%mpdoctor`` report, as a step its fixes are checked on
    (:func:`mpdoctor.diagnosis.replay.cell_step`); None when no cell raised (or it is not known)."""
    sess = _SESSIONS.get(id(shell))
    if sess is None or not sess.crashes or sess.crash_cell is None:
        return None
    import dataclasses

    from ...diagnosis.replay import cell_step
    from ...facts.location import cell_number

    filename, source, line = sess.crash_cell
    number = cell_number(filename)
    label = f"cell [{number}]" if number is not None else "the cell that raised"
    try:
        held = cell_step(source, shell.user_ns, label, filename, line)
    except Exception as exc:  # %mpdoctor still reports; its fixes are then not verified, and it says why
        from ...diagnosis.proof import HeldStep
        from ...redact import describe_exception

        return HeldStep(lambda: None, label, refused=f"the cell could not be prepared for a replay ({describe_exception(exc)})")
    return dataclasses.replace(held, around=_beside(held.around, observers_aside))


def _beside(first: Any, second: Any) -> Any:
    """One context of two (``first`` may be None)."""
    if first is None:
        return second

    @contextlib.contextmanager
    def both() -> Iterator[None]:
        with first(), second():
            yield

    return both


@contextlib.contextmanager
def observers_aside() -> Iterator[None]:
    """The protocol observers see nothing while mpdoctor runs a step of the user's again (a proof of a fix): the
    wrappers call the originals, and neither findings nor scale history gain what the replay did."""
    from .dispatch import _DISPATCH

    saved = _DISPATCH.observers
    _DISPATCH.observers = []
    try:
        yield
    finally:
        _DISPATCH.observers = saved


def _run_of(finding: Any) -> int | None:
    """The execution count of the cell a watcher finding is at (``"cell [4], line 3"``), or None."""
    import re

    evidence = finding.evidence if isinstance(finding.evidence, dict) else {}
    m = re.match(r"cell \[(\d+)\]", str(evidence.get("where") or ""))
    return int(m.group(1)) if m else None
