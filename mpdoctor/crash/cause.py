"""Explain one exception: diagnose the objects of its frames and mark the finding that caused it.

This module imports no torch at import time: the renderers read
:func:`cause_label` from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

from ..render.evidence import cause_label  # noqa: F401  (the renderers' view of a cause; re-exported)

#: Longest exception summary shown in a report heading.
SUMMARY_CHARS = 240


def exception_summary(exc: BaseException) -> str:
    """``"RuntimeError: first line of the message"``, shortened and redacted; never calls ``__str__``."""
    from ..redact import redact
    from .frames import _TYPE_QUALNAME
    from .patterns import exception_message

    try:
        name = _TYPE_QUALNAME(type(exc))
    except Exception:
        name = "Exception"
    message = exception_message(exc)
    if not message:
        return redact(str(name))
    first = message.strip().splitlines()[0] if message.strip() else ""
    if len(first) > SUMMARY_CHARS:
        first = first[: SUMMARY_CHARS - 3] + "..."
    return redact(f"{name}: {first}")


def explain(
    exc: BaseException,
    tb: TracebackType | None = None,
    *objects: Any,
    namespace: Mapping[str, Any] | None = None,
    names: Mapping[int, str] | None = None,
    target: str | None = None,
    scan: bool | None = None,
    ignore: Iterable[str] = (),
) -> Any:
    """Diagnose the objects around a known mixed-precision exception, the finding that explains it first.

    Parameters
    ----------
    exc : BaseException
        The exception raised.
    tb : traceback, optional
        Its traceback (default: ``exc.__traceback__``); the locals of its user
        frames are inspected, innermost :data:`~mpdoctor.crash.frames.MAX_FRAMES` at most.
    *objects
        Objects to inspect as well (the watched model and optimizer).
    namespace : mapping, optional
        A namespace to inspect first (IPython's ``user_ns``): its names win
        over the frames' local names for the same object.
    names, target, ignore
        As for :func:`mpdoctor.diagnose`.
    scan : bool, optional
        Scan values; default: only for failures about values (NaN/Inf).

    Returns
    -------
    Report or None
        None when ``exc`` is not a known mixed-precision failure. Otherwise the
        report, with ``report.cause`` (the explaining finding, first in
        ``report.findings``) and ``report.exception`` (a one-line summary).
    """
    from .. import diagnose
    from .frames import frame_namespace, traceback_frames
    from .patterns import match_exception

    matched = match_exception(exc)
    if matched is None:
        return None
    pattern, link = matched
    if tb is None:
        tb = BaseException.__dict__["__traceback__"].__get__(exc)
    frames = traceback_frames(tb)
    inner_tb = BaseException.__dict__["__traceback__"].__get__(link)
    if link is not exc and inner_tb is not None:
        frames = frames + traceback_frames(inner_tb)
    merged = frame_namespace(frames, namespace)
    report = diagnose(
        *objects,
        namespace=merged,
        names=names,
        target=target,
        scan=pattern.scan if scan is None else scan,
        ignore=ignore,
    )
    mark_cause(report, pattern, link, frames)
    return report


def _raiser(report: Any, frames: list) -> tuple[str, str, str] | None:
    """(name, kind, where) of the innermost inspected object whose method is on the failing stack, or None."""
    from .frames import raising_objects

    try:
        raisers = raising_objects(frames)
    except Exception:  # the cause is still marked, without naming the raiser
        return None
    by_id: dict[int, Any] = {}
    for s in report.subjects:
        by_id.setdefault(id(s.obj), s)
        by_id.setdefault(id(getattr(s, "inner", s.obj)), s)
    for r in raisers:
        s = by_id.get(id(r.obj))
        if s is not None:
            return s.name, s.kind, r.where
    return None


def _mentions(text: str, name: str) -> bool:
    import re

    return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", text) is not None


def _concerns(finding: Any, raiser: tuple[str, str, str] | None) -> bool:
    """True when the finding is about the object that raised (its subject, or named in its evidence)."""
    if raiser is None:
        return False
    name = raiser[0]
    if finding.subject == name:
        return True
    evidence = finding.evidence if isinstance(finding.evidence, dict) else {}
    return any(v == name or (isinstance(v, (list, tuple)) and name in v) for v in evidence.values())


def _name_the_raiser(cause: Any, raiser: tuple[str, str, str], report: Any) -> None:
    """Make the cause name the object that raised: its evidence says so, and a message written at rest about
    another object of the same kind (``scaler`` of two enabled GradScalers) names the one that raised."""
    import re

    name, kind, where = raiser
    if isinstance(cause.evidence, dict):
        cause.evidence = {"raised_by": f"{name} ({where})", **cause.evidence}
    if _mentions(cause.message, name):
        return
    others = [s.name for s in report.subjects if s.kind == kind and s.name != name and _mentions(cause.message, s.name)]
    if len(others) == 1:
        cause.message = re.sub(rf"(?<![\w.]){re.escape(others[0])}(?![\w])", name, cause.message)


def mark_cause(report: Any, pattern: Any, exc: BaseException, frames: list) -> Any:
    """Put the finding that explains ``exc`` first and set ``report.cause`` / ``report.exception``.

    When no finding of the pattern's checks is in the report (the objects are
    out of reach, or no check covers them), a cause note built from the
    pattern takes its place: what the message means and the generic fix, with
    the dtypes of the tensors in the innermost frames as evidence.
    """
    from ..findings import Finding
    from ..redact import redact
    from .frames import tensor_locals

    summary = exception_summary(exc)
    report.exception = summary
    raiser = _raiser(report, frames)
    report.raised_by = raiser[0] if raiser else None
    rank = {slug: i for i, slug in enumerate(pattern.checks)}
    candidates = [f for f in report.findings if f.check in rank]
    if candidates:
        # The finding about the object that raised first: of two GradScalers, the one whose unscale_ failed.
        cause = min(candidates, key=lambda f: (rank[f.check], not _concerns(f, raiser), f.rank))
        if raiser:
            _name_the_raiser(cause, raiser, report)
    else:
        try:
            tensors = tensor_locals(frames)
        except Exception:  # evidence is a bonus; the note stands without it
            tensors = []
        where = next((f for f in reversed(frames) if f.user), frames[-1] if frames else None)
        subject = f"{where.function} ({where.filename}:{where.lineno})" if where is not None else summary.split(":")[0]
        evidence: dict[str, Any] = {"exception": summary, "pattern": pattern.slug}
        if tensors:
            evidence["tensors in the failing frames"] = [redact(t) for t in tensors]
        seen = f" In the failing frames: {'; '.join(tensors[:4])}." if tensors else ""
        cause = Finding(
            check=pattern.slug,
            severity="error",
            subject=redact(subject),
            message=redact(f"{pattern.meaning}{seen} Fix: {pattern.fix}"),
            evidence=evidence,
        )
    report.findings[:] = [cause] + [f for f in report.findings if f is not cause]
    report.cause = cause
    return report
