"""``diagnose()``: discover subjects, gather facts, run checks, return a Report.

Each stage has a fallback, so no user object can make ``diagnose()`` raise:
a subject whose facts cannot be gathered (even one failing with an exception
that cannot be printed) is dropped with an ``internal-error`` finding and the
others are still diagnosed.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any, Callable

from ..facts import Facts
from ..facts.hardware import DeviceProfile, profile_for
from ..facts.precision import TorchStateFacts
from ..objects.discovery.subjects import Subject, discover, nothing_to_inspect, subject_kind
from ..objects.gathering import gather
from ..objects.live import Live
from ..redact import describe_exception, redact_finding
from ..rules.checks import internal_error, run_checks
from ..rules.engine.findings import Finding
from ..rules.engine.plan import plan as plan_treatment
from ..rules.engine.plan import plan_safe
from .report import Report
from .treatment import Treatment, bind_fixes


def diagnose(
    *objects: Any,
    namespace: Mapping[str, Any] | None = None,
    target: str | None = None,
    scan: bool = False,
    ignore: Iterable[str] = (),
    names: Mapping[int, str] | None = None,
    hidden: Iterable[str] = (),
    distributed: bool = False,
    timeout: float = 60.0,
    step: Callable[[], Any] | None = None,
) -> Report:
    """Diagnose live training objects for mixed-precision faults.

    Parameters
    ----------
    *objects
        Any mix of ``torch.nn.Module`` (including ``PreTrainedModel``,
        ``PeftModel``, DDP and compiled wrappers), ``torch.optim.Optimizer``
        (including accelerate's ``AcceleratedOptimizer``), ``GradScaler``,
        transformers ``Trainer`` / ``TrainingArguments`` and accelerate
        ``Accelerator``. A Trainer brings its model, optimizer, arguments,
        accelerator and scaler along.
    namespace : dict, optional
        A namespace such as IPython's ``user_ns``; everything relevant in it
        is inspected and named by its variable name. With no objects and no
        namespace, the caller's globals and locals are inspected (as
        ``%mpdoctor`` inspects the notebook's namespace).
    target : str, optional
        A device profile (``"T4"``, ``"V100"``, ``"A100"``, ...) to evaluate
        as a what-if instead of the live machine.
    scan : bool
        Also scan tensor values (NaN/Inf, fp16 range) in one pass over memory.
    ignore : iterable of str
        Check slugs to skip.
    names : dict, optional
        Display names for ``objects``, keyed by ``id``.
    hidden : iterable of str
        Namespace names to skip (IPython's ``user_ns_hidden``).
    distributed : bool
        A collective: every rank of the default process group calls it; the ranks
        exchange compact fingerprints and every rank's report says what they
        disagree on (``report.ranks``). No-op outside a process group.
    timeout : float
        Seconds to wait for the other ranks (``distributed=True``); ranks that do
        not answer are named in an error finding, and the call returns.
    step : callable, optional
        One training step of the user's (forward, backward, optimizer step), taking no argument and
        returning the loss or nothing. The plan is checked on it: the step runs before and after each planned
        fix, a fix after which it raises or stops training is taken out of the plan, and everything the step
        and the fixes changed is restored (:mod:`mpdoctor.diagnosis.proof`). The step should read its batch
        from a variable, not advance an iterator.

    Returns
    -------
    Report
        Never raises on user objects: a failure inside mpdoctor becomes an
        ``internal-error`` finding. An unknown ``target`` raises ValueError.
    """
    # The one place ``target`` is resolved: a typo is the caller's error, not a finding.
    profile = profile_for(target) if target is not None else None
    start = time.perf_counter()
    if not objects and namespace is None:
        namespace = _callers_namespace()
    _read_callers_script()
    try:
        subjects = discover(objects, namespace=namespace, hidden=hidden, names=names)
    except Exception as exc:  # discovery is defensive; this is the last line
        subjects = []
        failure = _failure("discovery", exc)
    else:
        failure = None
    return diagnose_subjects(
        subjects, target=target, profile=profile, scan=scan, ignore=ignore, start=start, distributed=distributed,
        timeout=timeout, failures=[failure] if failure is not None else [], notes=_not_inspected(objects, names),
        step=step,
    )


def _user_caller() -> Any:
    """The frame of the code that called ``diagnose()``, or None when that is mpdoctor itself (an internal call)
    or frames cannot be read (another interpreter)."""
    try:
        frame = sys._getframe(3)  # 0: this function, 1: its caller here, 2: diagnose(), 3: diagnose()'s caller
        return None if str(frame.f_globals.get("__name__", "")).split(".")[0] == __name__.split(".")[0] else frame
    except Exception:
        return None


def _callers_namespace() -> dict[str, Any] | None:
    """The globals and locals of the code that called ``diagnose()`` (locals win), or None when that is
    mpdoctor itself (an internal call with nothing to inspect inspects nothing)."""
    frame = _user_caller()
    try:
        return {**frame.f_globals, **frame.f_locals} if frame is not None else None
    except Exception:  # unreadable scopes: nothing to inspect
        return None


def _read_callers_script() -> None:
    """In a script (``python train.py``), the gradient accumulation of its hand-written loop, read from its code
    (:func:`~mpdoctor.objects.readers.loop_accumulation.record_script_loops`); nothing for mpdoctor's own calls."""
    frame = _user_caller()
    if frame is None:
        return
    from ..objects.readers.loop_accumulation import record_script_loops

    record_script_loops(frame)


def _not_inspected(objects: tuple, names: Mapping[int, str] | None) -> list[str]:
    """One sentence per object given that is nothing mpdoctor inspects (``diagnose(42)``)."""
    out = []
    for i, obj in enumerate(objects, 1):
        try:
            if subject_kind(obj) is None:
                name = (names or {}).get(id(obj)) or f"argument {i}"
                out.append(nothing_to_inspect(name, obj))
        except Exception:  # never raise on a user object
            continue
    return out


def diagnose_subjects(
    subjects: Iterable[Subject],
    target: str | None = None,
    scan: bool = False,
    ignore: Iterable[str] = (),
    start: float | None = None,
    distributed: bool = False,
    timeout: float = 60.0,
    ranks_from: Any = None,
    profile: DeviceProfile | None = None,
    failures: Iterable[Finding] = (),
    notes: Iterable[str] = (),
    treatment: Treatment | None = None,
    step: Callable[[], Any] | None = None,
) -> Report:
    """Diagnose already-discovered subjects (what ``Report.refresh()`` calls).

    ``profile`` is the device profile ``target`` was resolved to by the entrance (:func:`diagnose`); ``target``
    is then only the label the report shows. Given a ``target`` and no ``profile``, it is resolved here.
    """
    if profile is None and target is not None:
        profile = profile_for(target)
    start = time.perf_counter() if start is None else start
    subjects = tuple(subjects)
    ignore = tuple(ignore)
    live = Live()
    facts, gather_failures = _facts(subjects, profile, live, scan, distributed, timeout, ranks_from)
    failures = [*failures, *gather_failures]
    hidden: dict[str, int] = {}
    try:
        findings = run_checks(facts, ignore=ignore, hidden=hidden)
    except Exception as exc:  # run_checks isolates each check; this guards its own bookkeeping
        findings = [_failure("the checks", exc)]
    plan, safe_plan = _plans(facts, findings, ignore, failures)
    proof = None
    if step is not None:
        proof, plan, safe_plan = _proven(plan, safe_plan, step, subjects, findings, live, failures)
    findings = [redact_finding(f) for f in failures + findings]
    dist = getattr(facts, "distributed", None)
    # Re-planning and refresh() run on this rank alone: keep the other ranks' rows, recompute this one.
    ranks = dist if dist is not None and dist.exchanged else None
    if treatment is None:  # the first diagnosis of these objects; refresh() re-diagnoses into the same treatment
        treatment = Treatment()
        treatment.source = lambda: diagnose_subjects(
            subjects, target=target, profile=profile, scan=scan, ignore=ignore, ranks_from=ranks, treatment=treatment,
            step=step,
        )
    report = Report(
        findings,
        facts,
        target=target,
        scan=scan,
        ignore=ignore,
        elapsed=time.perf_counter() - start,
        discovered=subjects,
        live=live,
        plan=plan,
        hidden=hidden,
        safe_plan=safe_plan,
        notes=notes,
        treatment=treatment,
        proof=proof,
    )
    bind_fixes(report, live, treatment)
    return report


def _facts(subjects: tuple, profile: DeviceProfile | None, live: Live, scan: bool, distributed: bool,
           timeout: float, ranks_from: Any) -> tuple[Facts, list[Finding]]:  # fmt: skip
    """The facts of the subjects (scanned, exchanged across ranks or re-attached to them), and what failed."""
    facts, failures = _gather(subjects, profile, live)
    if scan:
        facts = _with_scan(facts, subjects)
    if distributed:
        from .exchange import exchange

        facts = exchange(facts, timeout=timeout)
    elif ranks_from is not None:
        from .exchange import reattach

        facts = reattach(facts, ranks_from)
    return facts, failures


def _simulated_checks(ignore: tuple) -> Callable[[Facts], list[Finding]]:
    """The checks the planner runs on simulated facts, this rank's row of a cross-rank exchange recomputed from them.

    A cast on this rank changes its fingerprint; without the new row ``ranks-disagree`` would outlive the cast
    that ends it, and the plan would drop that cast as "not healthier".
    """
    from .exchange import reattach

    def run(simulated: Facts) -> list[Finding]:
        dist = simulated.distributed
        if dist is not None and dist.exchanged:
            simulated = reattach(simulated, dist)
        return run_checks(simulated, ignore=ignore)

    return run


def _plans(facts: Facts, findings: list[Finding], ignore: tuple, failures: list[Finding]) -> tuple[list, list]:
    """The plan and the safe-only plan (each falls back, with a failure noted, if planning raises)."""
    try:
        plan = plan_treatment(facts, findings, _simulated_checks(ignore))
    except Exception as exc:  # a planning failure leaves every fix on offer, unplanned
        plan = [fx for f in findings for fx in f.fixes]
        failures.append(_failure("the treatment plan", exc))
    try:
        safe_plan = plan_safe(facts, findings, _simulated_checks(ignore), plan)
    except Exception as exc:  # the safe plan falls back to the safe fixes of the full plan
        safe_plan = [fx for fx in plan if fx.safe]
        failures.append(_failure("the safe-fixes plan", exc))
    for fx in safe_plan:
        if not fx.planned and fx.note.startswith("alternative"):  # the full plan prefers an unsafe fix
            fx.note += "; Apply all safe fixes applies it (the best plan without unsafe fixes)"
    return plan, safe_plan


def _proven(plan: list, safe_plan: list, step: Callable[[], Any], subjects: tuple, findings: list[Finding],
            live: Live, failures: list[Finding]) -> tuple[Any, list, list]:  # fmt: skip
    """The plan checked on the user's step: the proof, and both plans without the fixes it took out."""
    for f in findings:
        for fx in f.fixes:
            fx.bind(live)  # the proof applies them; the treatment is bound with the report
    try:
        proof = _prove(plan, safe_plan, step, subjects)
    except Exception as exc:  # the plan stands unproven; the report says so
        failures.append(_failure("the check of the fixes on your step", exc))
        return None, plan, safe_plan
    return (proof, *proof.plans(plan, safe_plan))


def _prove(plan: list, safe_plan: list, step: Callable[[], Any], subjects: tuple) -> Any:
    """Check the plan (and the safe plan, as one action) on the user's step; the models, optimizers and scalers
    among the subjects are restored after it."""
    from .proof import prove_held, step_as_held

    modules = [s.inner if s.inner is not None else s.obj for s in subjects if s.kind == "model"]
    optimizers = [s.inner if s.inner is not None else s.obj for s in subjects if s.kind == "optimizer"]
    scalers = [s.obj for s in subjects if s.kind == "scaler"]
    return prove_held(list(plan), step_as_held(step), modules, optimizers, scalers, safe_plan=safe_plan)


def _gather(subjects: tuple[Subject, ...], profile: DeviceProfile | None, live: Live) -> tuple[Facts, list[Finding]]:
    """Gather facts; when that fails as a whole, drop the subjects that make it fail and gather the rest."""
    try:
        return gather(subjects, profile, live), []
    except Exception:
        pass
    try:
        gather((), profile)
    except Exception as exc:  # the process-wide facts fail: no subject is to blame
        return _empty_facts(subjects, profile), [_failure("the runtime facts", exc)]
    kept: list[Subject] = []
    failures: list[Finding] = []
    for s in subjects:
        try:
            gather((s,), profile)
            kept.append(s)
        except Exception as exc:
            failures.append(_failure(s.name, exc))
    try:
        full = gather(tuple(kept), profile, live)
        # The dropped subjects stay listed as inspected: their internal-error findings name them.
        dropped = tuple(_plain(s) for s in subjects if s not in kept)
        return dataclasses.replace(full, subjects=full.subjects + dropped), failures
    except Exception as exc:
        failures.append(_failure("facts", exc))
        return _empty_facts(subjects, profile), failures


def _plain(s: Subject):
    from ..facts import SubjectFacts
    from ..objects.live.introspect import type_name

    return SubjectFacts(s.kind, s.name, id(s.obj), id(s.inner), s.inner_path, s.owner, type_name(s.obj), "?")


def _empty_facts(subjects: tuple[Subject, ...], profile: DeviceProfile | None) -> Facts:
    hardware = profile if profile is not None else DeviceProfile("unknown", "cpu", None, False, False, False, True)
    runtime = TorchStateFacts(autocast={}, matmul_tf32=False, cudnn_tf32=False, float32_matmul_precision="?", env={}, versions={})
    return Facts(
        subjects=tuple(_plain(s) for s in subjects),
        models=(),
        optimizers=(),
        scalers=(),
        precisions=(),
        runtime=runtime,
        hardware=hardware,
    )


def _failure(where: str, exc: BaseException) -> Finding:
    """An ``internal-error`` finding, even for an exception whose message cannot be printed."""
    return internal_error(where, exc)


def _with_scan(facts: Facts, subjects: tuple[Subject, ...]) -> Facts:
    try:
        from ..objects.gathering.scan import scan_facts
    except ModuleNotFoundError:
        return facts
    try:
        return scan_facts(facts, subjects)
    except Exception as exc:
        return Facts(**{**facts.__dict__, "errors": facts.errors + (("value scan", describe_exception(exc)),)})
