"""``python -m mpdoctor run train.py [args...]``: run a script unchanged; explain a mixed-precision crash.

The script runs as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` as
``python train.py args...`` would set them. On an uncaught exception the
traceback is printed (without the runner's own frames), then, for a known
mixed-precision failure, the text report of the objects in the failing
frames; the exit code is the one Python would have given (1 for an
exception, the ``SystemExit`` code otherwise).
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from types import TracebackType
from typing import Any

#: Frames of these modules are the runner's, not the script's: left out of the printed traceback.
_RUNNER_MODULES = frozenset({"runpy", __name__})


def run_script(path: str, args: list[str], scan: bool = False, probe_on_nan: bool = False) -> int:
    """Run ``path`` as ``__main__`` with ``args``; return the exit code Python would have returned.

    Parameters
    ----------
    path : str
        The script.
    args : list of str
        Its arguments, untouched.
    scan : bool
        Scan values (NaN/Inf, fp16 range) in the crash report.
    probe_on_nan : bool
        Watch every top-level module forward: on the first non-finite loss,
        probe that batch and name the first layer that overflows (one finiteness
        check per forward, so only when asked).
    """
    if not os.path.exists(path):
        print(f"mpdoctor run: no such file: {path}", file=sys.stderr)
        return 2
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    sys.argv = [path, *args]
    script_dir = os.path.dirname(os.path.abspath(path))
    if sys.path:
        sys.path[0] = script_dir
    else:
        sys.path.insert(0, script_dir)
    shown: set = set()  # the mistakes already printed (merge.mistake_key): one mistake is shown once
    _read_loop(path, shown)
    watcher = _global_watcher() if probe_on_nan else None
    counter = _backward_counter()
    protocol = _protocol_observer(shown, counter)
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        return _exit_code(exc.code)
    except BaseException as exc:  # noqa: BLE001 - every uncaught exception is the script's failure
        from ..runtime.dispatch import hide_own_frames

        hide_own_frames(exc)
        tb = _script_traceback(exc.__traceback__)
        traceback.print_exception(type(exc), exc, tb)
        if not isinstance(exc, KeyboardInterrupt):
            _explain(exc, tb, scan, shown)
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        if protocol is not None:
            protocol.close()
        if counter is not None:
            counter.close()
        if watcher is not None:
            watcher.close()
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0
    return 0


def _exit_code(code: Any) -> int:
    # What the interpreter does with SystemExit(code): None is 0, an int is itself, anything else is printed and 1.
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _script_traceback(tb: TracebackType | None) -> TracebackType | None:
    while tb is not None and _frame_module(tb) in _RUNNER_MODULES:
        tb = tb.tb_next
    return tb


def _frame_module(tb: TracebackType) -> str:
    g = tb.tb_frame.f_globals
    name = dict.get(g, "__name__") if type(g) is dict else None
    return name if type(name) is str else "?"


def _explain(exc: BaseException, tb: TracebackType | None, scan: bool, shown: set) -> None:
    """Print the crash report; a crash whose cause is a mistake already printed is one line naming it."""
    try:
        from ..crash.cause import explain
        from ..runtime.assembly import assemble

        report = assemble(explain(exc, tb, scan=True if scan else None))  # no step to replay: a script's crash
        if report is None:
            return
        if _already_shown(report, shown):
            cause = report.cause
            where = cause.evidence.get("where") or cause.subject
            print(f"\nmpdoctor: this {type(exc).__name__} is the {cause.check} mistake at {where}, shown above.",
                  file=sys.stderr)  # fmt: skip
        else:
            print(f"\n{report.to_text()}", file=sys.stderr)
    except BaseException as failure:  # the traceback is printed; the report is a bonus
        from ...redact import describe_exception

        print(f"mpdoctor: could not diagnose this exception ({describe_exception(failure)})", file=sys.stderr)


def _already_shown(report: Any, shown: set) -> bool:
    """The crash is a mistake printed before it ran or as it happened, and the report has no other error or
    warning to add."""
    from ...rules.engine.merge import mistake_key

    if report.cause is None or mistake_key(report.cause) not in shown:
        return False
    return all(f is report.cause or f.severity == "info" or mistake_key(f) in shown for f in report.findings)


def _read_loop(path: str, shown: set) -> None:
    """Read the script for AMP loop mistakes before it runs (AST only); print what it finds to stderr."""
    try:
        from ...rules.engine.merge import mistake_key
        from ..runtime.history import format_findings, read_script

        findings = read_script(path)
        shown.update(mistake_key(f) for f in findings)
        with open(path, encoding="utf-8") as handle:
            script = handle.read()
        text = format_findings(findings, os.path.basename(path), script)
    except Exception as failure:  # the script still runs; the reading is a bonus
        from ...redact import describe_exception

        text = f"mpdoctor: could not read {os.path.basename(path)} ({describe_exception(failure)})"
    if text:
        print(text + "\n", file=sys.stderr, flush=True)


def _backward_counter() -> Any:
    """The script's gradient accumulation, counted as it runs (mpdoctor.attach.runtime.backward_count); None if unavailable."""
    try:
        from ..runtime.backward_count import BackwardCounter

        return BackwardCounter().attach()
    except Exception as exc:  # the script runs whatever happens here
        print(f"mpdoctor run: the accumulation counter is off ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None


def _protocol_observer(shown: set, counter: Any = None) -> Any:
    """The GradScaler protocol observer for the script's run (mpdoctor.attach.runtime.protocol); None if unavailable.

    It prints a mistake at the call where it happens, unless the reading of the script already printed it. A step
    a GradScaler skips tells ``counter`` that its ``backward()`` calls were not accumulation.
    """
    try:
        from ...rules.engine.merge import mistake_key
        from ..runtime.protocol import ProtocolObserver, print_finding

        def announce(finding: Any) -> None:
            key = mistake_key(finding)
            if key is None or key not in shown:
                shown.add(key)
                print_finding(finding)

        def stepped(record: Any) -> None:
            if counter is not None and record.skipped:
                counter.skipped()

        return ProtocolObserver(on_finding=announce, step_listener=stepped).attach()
    except Exception as exc:  # the script runs whatever happens here
        print(f"mpdoctor run: the loop watcher is off ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None


def _global_watcher() -> Any:
    from .watch import GlobalLossWatcher

    return GlobalLossWatcher()
