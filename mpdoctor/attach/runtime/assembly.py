"""The one place a final report is put together, then proven.

A report starts as the diagnosis of the live objects (:func:`mpdoctor.diagnose`, a crash's :func:`explain`, the
probe). Beside the objects, mpdoctor observes the run: the code of the cells or the script (read, never run), the
loop watcher, the crash hook, the GradScaler's scale per step. :func:`assemble` folds all of that into the report
once, in one order: the code's findings, then what the watcher and the crash hook saw (one mistake seen by several
observers is one finding, a crash's cause comes first), then the scale history. Last, the plan of the assembled
report is proven on the step that failed, when one is held: nothing joins the report after the proof, so what the
proof labels is what the user applies.

Every front end calls :func:`assemble`, then renders: ``%mpdoctor``, ``watch()`` (before the first step, at a crash,
and ``w.report``), the crash hook, ``mpdoctor run``, the training callbacks. A report evolved after its proof with
another plan holds no proof (:meth:`mpdoctor.diagnosis.report.Report.evolve`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from ...rules.engine.findings import Finding


@dataclasses.dataclass(frozen=True)
class Observed:
    """What was seen of the run beside its objects, for :func:`assemble`.

    Attributes
    ----------
    code : tuple of Finding
        What the code of the cells (or the script) says, read and never run (:mod:`mpdoctor.attach.runtime.history`).
    watched : tuple of Finding
        What the loop watcher saw as the loop ran (the GradScaler protocol, the accumulation counter).
    crashes : tuple of Report
        The crash hook's reports, oldest first: each holds the ``cause`` of its exception and the fixes bound to
        the objects it saw (its batch).
    scale_history : tuple or None
        Per GradScaler and real step: scale, skipped, loss (None: keep the report's own).
    in_users_loop : callable or None
        Gives watcher findings the corrected lines of the user's own loop, read from the cells that ran.
    ignore : tuple of str
        Check slugs the user hides.
    try_code : callable or None
        Runs a code fix on copies of the user's objects before it is shown (:func:`mpdoctor.attach.runtime.twins.try_on_twins`
        bound to the namespace); None: code fixes are shown unrun.
    explained_by : callable or None
        The check slugs whose findings explain a crash, by the slug of the crash's own cause note (its pattern's
        checks, :func:`mpdoctor.attach.crash.patterns.checks_explaining`): a finding of one of them, held now, becomes the
        cause in the note's place.
    """

    code: tuple = ()
    watched: tuple = ()
    crashes: tuple = ()
    scale_history: tuple | None = None
    in_users_loop: Callable[[list], list] | None = None
    ignore: tuple = ()
    explained_by: Callable[[str], tuple] | None = None
    try_code: Callable[[str], Any] | None = None


def assemble(report: Any, observed: Observed | None = None, step: Any = None, before: Any = None) -> Any:
    """The final report: ``report`` (a diagnosis) with everything ``observed`` folded in once, then its plan, and its
    safe plan as one action, proven on ``step`` (a :class:`~mpdoctor.diagnosis.proof.HeldStep` or a function of no
    arguments; None: no step is held, and the fixes say "not verified"). ``before``: what the step did as it was,
    when the caller already ran it (the probe's own forward and backward). ``report`` None stays None.
    """
    if report is None:
        return None
    observed = observed or Observed()
    report = _with_code(report, observed)
    report = _with_watched_and_crashes(report, observed)
    if observed.scale_history is not None:
        report = report.evolve(scale_history=observed.scale_history)
    report = _without_fixes_in_place(report)
    if step is not None and any(fx.changes for fx in report.fixes):
        from ...diagnosis.proof import proven_report, step_as_held

        report = proven_report(report, step_as_held(step), before=before)
    return _with_trials(report, observed)


#: Code fixes run on copies per report at most (each copies the objects its code names).
_MAX_TRIALS = 4


def _with_trials(report: Any, observed: Observed) -> Any:
    """``report`` with what its code fixes did on copies of the user's objects: the corrected lines of the user's own
    AMP loop (a loop mistake's display-only fix) replace the loop as the user will paste them, and a crashing cell
    corrected (:data:`~.op_rewrite.CORRECTED_CELL`: its op with no half kernel on fp32 copies; or the cell where a NaN
    was born with the op's argument clamped into its domain, :mod:`.domain_rewrite`) is the whole cell, so both run as
    they are. Other display-only code (a launcher's flag, a rebuild, a line of advice) is not run."""
    if observed.try_code is None:
        return report
    from ...rules.engine.fixes import Applicability
    from .op_rewrite import CORRECTED_CELL
    from .protocol_rules import RULES

    trials: list = []
    for finding in report.findings:
        if finding.severity not in ("error", "warning"):
            continue
        for fx in finding.fixes:
            runs = finding.check in RULES or fx.recipe == CORRECTED_CELL
            if (runs and fx.applicability is Applicability.DISPLAY_ONLY and fx.code.strip()
                    and len(trials) < _MAX_TRIALS):  # fmt: skip
                trials.append((fx, observed.try_code(fx.code)))
    return report.evolve(trials=trials) if trials else report


def _without_fixes_in_place(report: Any) -> Any:
    """``report`` with no fix in its plans whose change the live objects already hold (the user changed the
    object in a cell, or applied it from an earlier report, while the finding still stands: a crash of a cell
    not run again since). Applying one would change nothing: its finding shows it as already in place
    (:func:`mpdoctor.diagnosis.view_builder.report_dict`), and it is neither planned nor proven."""
    held = [fx for fx in report.fixes if fx.in_place]
    safe = [fx for fx in report.safe_fixes if fx.in_place]
    if not held and not safe:
        return report
    return report.evolve(plan=[fx for fx in report.fixes if fx not in held],
                         safe_plan=[fx for fx in report.safe_fixes if fx not in safe])  # fmt: skip


def _with_code(report: Any, observed: Observed) -> Any:
    if not observed.code:
        return report
    from .history import add_to_report

    return add_to_report(report, list(observed.code), observed.ignore)


def _with_watched_and_crashes(report: Any, observed: Observed) -> Any:
    """The watcher's and the crash hook's findings folded into ``report``: a crash's cause first (the report then
    reads as the explanation of that exception); one mistake seen by several observers is one finding; the fixes a
    crash bound to the objects it saw join the plans (they are not re-diagnosable at rest)."""
    from ...rules.engine.merge import merged

    skip = set(observed.ignore)
    extra = _in_users_loop(observed, [f for f in observed.watched if f.check not in skip])
    cause = exception = raised_by = None
    held = list(report.findings)
    own_cause = report.cause is not None
    if own_cause:  # a crash's own report: its watcher findings in the user's own loop
        held, cause = _own_findings_in_users_loop(observed, held, report.cause)
    for crash in observed.crashes:
        if crash.cause is not None and crash.cause.check not in skip:
            cause, exception, raised_by = crash.cause, crash.exception, crash.raised_by
            explained = _explained_now(held, crash.cause, observed.explained_by)
            if explained is not None:  # the note gives way: the report now holds what it asked for
                cause = explained
            elif not _fold_into_setup_finding(held, crash.cause):
                extra.append(crash.cause)
    if not extra and cause is None:
        return report
    if not extra and own_cause and not observed.crashes:
        return report.evolve(findings=held, cause=cause)
    findings, cause = _cause_first(merged([*held, *extra]), cause)
    changes: dict = {"findings": findings, "cause": cause, **_plans_with_bound_fixes(report, extra)}
    if observed.crashes:
        changes.update(exception=exception, raised_by=raised_by)
    return report.evolve(**changes)


def _in_users_loop(observed: Observed, findings: list) -> list:
    if observed.in_users_loop is None or not findings:
        return findings
    try:
        return observed.in_users_loop(findings)
    except Exception:  # the watcher's own lines stand
        return findings


def _own_findings_in_users_loop(observed: Observed, findings: list, cause: Finding) -> tuple[list, Finding]:
    """A crash report's findings with its watcher findings given the user's own loop (and its cause, when it is
    one of them)."""
    from .protocol_rules import RULES

    watched = [f for f in findings if f.check in RULES]
    if not watched or observed.in_users_loop is None:
        return findings, cause
    mine = dict(zip(map(id, watched), _in_users_loop(observed, watched)))
    return [mine.get(id(f), f) for f in findings], mine.get(id(cause), cause)


def _explained_now(findings: list, cause: Finding, explained_by: Callable[[str], tuple] | None) -> Finding | None:
    """The finding in ``findings`` that explains a crash whose cause was only its pattern's note, or None.

    At the crash no check's finding explained the exception (:func:`mpdoctor.attach.crash.cause.mark_cause`): the note says
    what the message means and what to run (sampling from NaN probabilities: the generation probe). When the report
    now holds a finding of one of the pattern's checks (the probe the note asked for names the module and carries
    the fixes), that finding is the cause. A note with fixes of its own (a cast of the failing op's operands, bound
    to the objects the crash saw) stays the cause."""
    evidence = cause.evidence if isinstance(cause.evidence, dict) else {}
    if explained_by is None or cause.fixes or evidence.get("pattern") != cause.check:
        return None
    rank = {slug: i for i, slug in enumerate(explained_by(cause.check))}
    return min((f for f in findings if f.check in rank), key=lambda f: (rank[f.check], f.rank), default=None)


def _fold_into_setup_finding(findings: list, cause: Finding) -> bool:
    """Fold a crash's cause into the diagnosis's finding of the same rule on the same object, in place in
    ``findings``: the mixed model the crash raised on is the mixed model the diagnosis names, one mistake. The kept
    finding (its planned fixes) gains the crash's evidence keys it lacks. Returns whether it was folded."""
    for i, f in enumerate(findings):
        if (f.check, f.subject) == (cause.check, cause.subject):
            evidence = dict(f.evidence) if isinstance(f.evidence, dict) else {}
            if isinstance(cause.evidence, dict):
                for k, v in cause.evidence.items():
                    evidence.setdefault(k, v)
            severity = min((f, cause), key=lambda x: x.rank).severity
            findings[i] = dataclasses.replace(f, evidence=evidence, severity=severity)
            return True
    return False


def _cause_first(findings: list, cause: Finding | None) -> tuple[list, Finding | None]:
    """The findings with the crash's cause first (found again when another observer's finding absorbed it)."""
    from ...rules.engine.merge import mistake_key

    if cause is None:
        return sorted(findings, key=lambda f: f.rank), None
    key = mistake_key(cause)  # the cause may have been folded into a finding another observer made first
    cause = next((f for f in findings if (f.check, f.subject) == (cause.check, cause.subject)
                  or (key is not None and mistake_key(f) == key)), cause)  # fmt: skip
    return [cause, *(f for f in findings if f is not cause)], cause


def _plans_with_bound_fixes(report: Any, extra: Iterable[Finding]) -> dict:
    """A crash's in-place fixes stay bound to the objects it saw (its batch): they join the plans to apply."""
    bound = [f.fixes[0] for f in extra if f.fixes and f.fixes[0].changes and f.fixes[0].bound_where_seen]
    plan = [*report.fixes, *(fx for fx in bound if fx not in report.fixes)]
    safe = [*report.safe_fixes, *(fx for fx in bound if fx.safe and fx not in report.safe_fixes)]
    return {"plan": plan, "safe_plan": safe}
