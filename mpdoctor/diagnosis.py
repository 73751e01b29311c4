"""``diagnose()``: discover subjects, gather facts, run checks, return a Report.

Each stage has a fallback, so no user object can make ``diagnose()`` raise:
a subject whose facts cannot be gathered (even one failing with an exception
that cannot be printed) is dropped with an ``internal-error`` finding and the
others are still diagnosed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from typing import Any

from .checks import internal_error, run_checks
from .discover import Subject, discover
from .facts import Facts, gather
from .facts.hardware import DeviceProfile, profile_for
from .facts.precision import RuntimeFacts
from .findings import Finding
from .redact import describe_exception, redact_finding
from .report import Report


def diagnose(
    *objects: Any,
    namespace: Mapping[str, Any] | None = None,
    target: str | None = None,
    scan: bool = False,
    ignore: Iterable[str] = (),
    names: Mapping[int, str] | None = None,
    hidden: Iterable[str] = (),
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
        is inspected and named by its variable name.
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

    Returns
    -------
    Report
        Never raises on user objects: a failure inside mpdoctor becomes an
        ``internal-error`` finding. An unknown ``target`` raises ValueError.
    """
    if target is not None:
        profile_for(target)  # a typo in target is the caller's error, not a finding
    start = time.perf_counter()
    try:
        subjects = discover(objects, namespace=namespace, hidden=hidden, names=names)
    except Exception as exc:  # discovery is defensive; this is the last line
        subjects = []
        failure = _failure("discovery", exc)
    else:
        failure = None
    report = diagnose_subjects(subjects, target=target, scan=scan, ignore=ignore, start=start)
    if failure is not None:
        report.findings.insert(0, redact_finding(failure))
    return report


def diagnose_subjects(
    subjects: Iterable[Subject],
    target: str | None = None,
    scan: bool = False,
    ignore: Iterable[str] = (),
    start: float | None = None,
) -> Report:
    """Diagnose already-discovered subjects (what ``Report.refresh()`` calls)."""
    start = time.perf_counter() if start is None else start
    subjects = tuple(subjects)
    ignore = tuple(ignore)
    facts, failures = _gather(subjects, target)
    if scan:
        facts = _with_scan(facts)
    try:
        findings = run_checks(facts, ignore=ignore)
    except Exception as exc:  # run_checks isolates each check; this guards its own bookkeeping
        findings = [_failure("the checks", exc)]
    findings = [redact_finding(f) for f in failures + findings]
    return Report(findings, facts, target=target, scan=scan, ignore=ignore, elapsed=time.perf_counter() - start)


def _gather(subjects: tuple[Subject, ...], target: str | None) -> tuple[Facts, list[Finding]]:
    """Gather facts; when that fails as a whole, drop the subjects that make it fail and gather the rest."""
    try:
        return gather(subjects, target=target), []
    except Exception:
        pass
    try:
        gather((), target=target)
    except Exception as exc:  # the process-wide facts fail: no subject is to blame
        return _empty_facts(subjects, target), [_failure("the runtime facts", exc)]
    kept: list[Subject] = []
    failures: list[Finding] = []
    for s in subjects:
        try:
            gather((s,), target=target)
            kept.append(s)
        except Exception as exc:
            failures.append(_failure(s.name, exc))
    try:
        # The dropped subjects stay listed as inspected: their internal-error findings name them.
        return dataclasses.replace(gather(tuple(kept), target=target), subjects=subjects), failures
    except Exception as exc:
        failures.append(_failure("facts", exc))
        return _empty_facts(subjects, target), failures


def _empty_facts(subjects: tuple[Subject, ...], target: str | None) -> Facts:
    try:
        hardware = profile_for(target) if target is not None else DeviceProfile("unknown", "cpu", None, False, False, False, True)
    except Exception:
        hardware = DeviceProfile("unknown", "cpu", None, False, False, False, True)
    runtime = RuntimeFacts(autocast={}, matmul_tf32=False, cudnn_tf32=False, float32_matmul_precision="?", env={}, versions={})
    return Facts(
        subjects=subjects, models=(), optimizers=(), scalers=(), precisions=(), runtime=runtime, hardware=hardware
    )


def _failure(where: str, exc: BaseException) -> Finding:
    """An ``internal-error`` finding, even for an exception whose message cannot be printed."""
    try:
        return internal_error(where, exc)
    except Exception:
        detail = describe_exception(exc)
        return Finding(
            check="internal-error",
            severity="error",
            subject=where,
            message=f"mpdoctor could not complete {where}: {detail}. The rest of the report is unaffected.",
            evidence={"exception": detail.split(":", 1)[0], "detail": detail[:300]},
        )


def _with_scan(facts: Facts) -> Facts:
    try:
        from .numerics.scan import scan_facts
    except ModuleNotFoundError:
        return facts
    try:
        return scan_facts(facts)
    except Exception as exc:
        return Facts(**{**facts.__dict__, "errors": facts.errors + (("value scan", describe_exception(exc)),)})
