"""``diagnose()``: discover subjects, gather facts, run checks, return a Report."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from .checks import internal_error, run_checks
from .discover import Subject, discover
from .facts import Facts, gather
from .facts.hardware import profile_for
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
        failure = internal_error("discovery", exc)
    else:
        failure = None
    report = diagnose_subjects(subjects, target=target, scan=scan, ignore=ignore, start=start)
    if failure is not None:
        report.findings.insert(0, failure)
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
    facts = gather(subjects, target=target)
    if scan:
        facts = _with_scan(facts)
    findings = run_checks(facts, ignore=ignore)
    return Report(findings, facts, target=target, scan=scan, ignore=ignore, elapsed=time.perf_counter() - start)


def _with_scan(facts: Facts) -> Facts:
    try:
        from .numerics.scan import scan_facts
    except ModuleNotFoundError:
        return facts
    try:
        return scan_facts(facts)
    except Exception as exc:
        return Facts(**{**facts.__dict__, "errors": facts.errors + (("value scan", f"{type(exc).__name__}: {exc}"),)})
