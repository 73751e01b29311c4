"""The IPython exception handler: after ``%load_ext mpdoctor``, a known mixed-precision crash is explained.

``InteractiveShell.set_custom_exc`` replaces IPython's traceback display for
the exceptions it is given, so the handler first shows the traceback exactly
as IPython would have (same call, same arguments), and only then, for a known
mixed-precision failure, displays the report. It runs only when a cell raises:
successful cells cost nothing. Only ``Exception`` subclasses are routed here,
so ``KeyboardInterrupt`` and ``SystemExit`` keep IPython's own handling.
Nothing in the handler can raise into the cell: a failure after the traceback
is one ``mpdoctor: ...`` line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any

#: ``id(shell) -> the handler IPython stored`` while mpdoctor's hook is installed.
_INSTALLED: dict[int, Any] = {}


def install(shell: Any, enabled: Callable[[], bool] = lambda: True) -> bool:
    """Install the handler on ``shell``; False when another custom exception handler is already set.

    Parameters
    ----------
    shell : InteractiveShell
    enabled : callable
        Read at each exception (``MPDoctorMagics.on_error``), so ``%config`` takes effect at once.
    """
    if id(shell) in _INSTALLED and shell.CustomTB is _INSTALLED[id(shell)]:
        return True
    if tuple(shell.custom_exceptions):
        return False  # someone else's handler: replacing it would silently change their tracebacks

    def handler(self: Any, etype: type, value: BaseException, tb: TracebackType, tb_offset: int | None = None) -> None:
        handle_exception(self, etype, value, tb, tb_offset, enabled)
        return None  # IPython 7.34 and 9 both accept None ("nothing more to show")

    shell.set_custom_exc((Exception,), handler)
    _INSTALLED[id(shell)] = shell.CustomTB
    return True


def uninstall(shell: Any) -> None:
    """Remove the handler if it is still the one installed by :func:`install`."""
    stored = _INSTALLED.pop(id(shell), None)
    if stored is not None and shell.CustomTB is stored:
        shell.set_custom_exc((), None)


def installed(shell: Any) -> bool:
    """True while mpdoctor's handler is the shell's custom exception handler."""
    return id(shell) in _INSTALLED and shell.CustomTB is _INSTALLED[id(shell)]


def handle_exception(
    shell: Any,
    etype: type,
    value: BaseException,
    tb: TracebackType | None,
    tb_offset: int | None,
    enabled: Callable[[], bool],
) -> None:
    """Show the traceback as IPython would, then the diagnosis of a known mixed-precision failure."""
    try:
        from ..runtime.dispatch import hide_own_frames

        hide_own_frames(value)  # IPython 8+ honours __tracebackhide__ itself; IPython 7.34 (Colab's) does not
    except Exception:  # the traceback is shown as it is
        pass
    try:
        _show_traceback(shell, etype, value, tb, tb_offset)
    except BaseException:  # IPython's own display failed: still never lose the user's traceback
        import traceback

        traceback.print_exception(etype, value, tb)
    try:
        if not enabled() or not _from_running_code(tb):
            return
        from ...render.frontend import show
        from .cause import explain

        report = explain(value, tb, namespace=shell.user_ns)
        if report is not None:
            from ..runtime.assembly import Observed, assemble
            from ..runtime.session import remember_crash, users_loop_findings

            # Assembled as every report is: the corrected lines of the user's own loop. Its plan is proven by the
            # next %mpdoctor, which replays this cell (until then its fixes say "not verified").
            report = assemble(report, Observed(in_users_loop=lambda found: users_loop_findings(shell, found)))
            remember_crash(shell, report, _raising_cell(tb))
            show(report)
    except BaseException as exc:  # the traceback is already shown; the hook's failure is one line
        _print_failure(exc)


def _raising_cell(tb: TracebackType | None) -> tuple[str, str, int] | None:
    """``(filename, source, line)`` of the cell whose code raised: the frame ``run_code`` called, read back from the
    ``linecache`` entry IPython made when it compiled the cell (None when it is not there), and the cell's line
    that was running."""
    import linecache

    cell = tb.tb_next if tb is not None else None
    if cell is None:
        return None
    filename = cell.tb_frame.f_code.co_filename
    source = "".join(linecache.getlines(filename))
    return (filename, source, cell.tb_lineno) if source else None


def _from_running_code(tb: TracebackType | None) -> bool:
    # run_code catches exceptions of the cell's code; the other call site is the parser (syntax errors).
    return tb is not None and tb.tb_frame.f_code.co_name == "run_code"


def _show_traceback(shell: Any, etype: type, value: BaseException, tb: TracebackType | None, tb_offset: int | None) -> None:
    """What IPython runs for this exception without a custom handler (``run_code`` / ``run_cell``)."""
    if _from_running_code(tb):
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset, running_compiled_code=True)
    elif issubclass(etype, IndentationError):
        shell.showindentationerror()
    elif issubclass(etype, (OverflowError, SyntaxError, ValueError, TypeError, MemoryError)):
        shell.showsyntaxerror()
    else:
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)


def _print_failure(exc: BaseException) -> None:
    from ...redact import describe_exception

    try:
        detail = describe_exception(exc)
    except BaseException:
        detail = "unknown error"
    print(f"mpdoctor: could not diagnose this exception ({detail}); the traceback above is intact", file=sys.stdout)
