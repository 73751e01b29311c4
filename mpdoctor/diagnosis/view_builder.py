"""Build the one plain view of a Report (:class:`mpdoctor.render.view.ReportView`) that every renderer reads.

Everything a renderer shows is computed here, from the report's facts and findings, once per report and state of
its fixes: the JSON-serialisable dict, the value scan's rows, the probe's rows, the layer strips, the cause's
heading. The renderers below never reach the facts, a live object or torch.
"""

from __future__ import annotations

from typing import Any

from ..redact import redact
from ..render.formatting import ParamRow, cause_label, layer_strips, rst_to_plain
from ..render.view import ReportView
from ..rules.engine.findings import _jsonable

#: How many views were built in this process: a display builds one (the tests count them).
BUILDS = 0


def build_view(report: Any) -> ReportView:
    """The plain view of ``report``: what every renderer reads."""
    global BUILDS
    BUILDS += 1
    data = report_dict(report)
    return ReportView(
        data=data,
        counts=report.counts(),
        device_label=report.facts.hardware.label,
        elapsed=report.elapsed,
        cause_label=cause_label(report),
        layer_strips=tuple(layer_strips(layer_rows(report.facts))),
        pending_safe_fixes=sum(1 for fx in report.safe_fixes if not fx.applied),
    )


def fix_state(report: Any) -> tuple:
    """What can change in a report's fixes after it is made (applied, failed, notes, its change made some other
    way): a view is built per state."""
    return tuple((fx.applied, fx.error, fx.note, fx.planned, fx.in_place) for f in report.findings
                 for fx in f.fixes) + tuple(  # fmt: skip
        fx.applied for fx in report.safe_fixes
    )


def subjects_view(facts: Any) -> list[dict]:
    """Name, kind and class of every subject."""
    return [{"name": s.name, "kind": s.kind, "class": s.class_name, "aliases": list(s.aliases)} for s in facts.subjects]


def precision_view(facts: Any) -> list[dict]:
    """Requested vs effective precision of every setup."""
    hw = facts.hardware
    return [
        {
            "setup": p.name,
            "requested": p.requested,
            "args.mixed_precision": p.args.get("mixed_precision"),
            "ACCELERATE_MIXED_PRECISION": p.env_mixed_precision,
            "accelerator.mixed_precision": p.accelerator_mixed_precision,
            "native_amp": p.native_amp,
            "scaler": p.scaler_enabled,
            "effective": p.effective,
            "device bf16": hw.bf16_native,
        }
        for p in facts.precisions
    ]


def cache_view(facts: Any) -> list[dict]:
    """Every config and sub-config with its cache flag."""
    return [
        {
            "path": f"{c.path}.use_cache",
            "use_cache": c.use_cache if c.has_use_cache else "(absent)",
            "model_type": c.model_type,
            "training": m.training,
        }
        for m in facts.models
        for c in m.configs
    ]


def scaler_view(facts: Any) -> list[dict]:
    """State of every GradScaler."""
    return [
        {
            "name": s.name,
            "enabled": s.enabled,
            "device": s.device,
            "scale": s.scale if s.scale is not None else s.init_scale,
            "scale_initialized": s.scale is not None,
            "growth_tracker": s.growth_tracker,
            "growth_interval": s.growth_interval,
        }
        for s in facts.scalers
    ]


def hardware_view(facts: Any) -> dict:
    """The device or what-if profile."""
    hw = facts.hardware
    return {
        "name": hw.name,
        "label": hw.label,
        "kind": hw.kind,
        "capability": ".".join(map(str, hw.capability)) if hw.capability else None,
        "bf16_native": hw.bf16_native,
        "fp16_tensor_cores": hw.fp16_tensor_cores,
        "tf32": hw.tf32,
        "memory_gib": hw.memory_gib,
        "live": hw.live,
        "unscale_dtypes": list(hw.unscale_dtypes) if hw.unscale_dtypes is not None else None,
    }


def probe_view(report: Any) -> list[dict]:
    """The one-batch probe table as rows; empty for reports that did not probe."""
    table = report.probe_table
    if table is None:
        return []
    try:
        return table.to_dict(orient="records")
    except Exception:  # a table that cannot be read is left out, never a failed render
        return []


def layer_rows(facts: Any) -> list[ParamRow]:
    """Every parameter of every inspected model as ``(model, name, dtype, numel)``."""
    rows = []
    for m in getattr(facts, "models", ()) or ():
        tensors = getattr(m, "tensors", None)
        for p in getattr(tensors, "params", ()) or ():
            rows.append(ParamRow(m.name, p.name, p.dtype, int(p.numel)))
    return rows


def _proof_view(report: Any) -> dict | None:
    """What the report says of its fixes and the user's step: verified, tried, or no step held."""
    proof = report.proof
    if proof is not None:
        return {"summary": proof.summary(), "verified": proof.verified, "cured": proof.cured, "checked": proof.checked,
                "safe_verified": proof.safe_verified, "stand_in": proof.stand_in,
                "dropped": list(proof.dropped), "step": proof.step, "refused": proof.refused}  # fmt: skip
    if not any(fx.changes for fx in report.fixes):
        return None
    # No function of the user's is named here: the report does not know one, and a made-up name would not exist.
    return {"summary": "Fixes not verified (no step held): give a function of yours that runs one training step "
                       "and takes no arguments (diagnose(..., step=...) or %mpdoctor --step NAME); it runs before "
                       "and after each fix.", "verified": False, "dropped": []}


def _why(finding: Any) -> str:
    """The rule's "Why is this bad?", for findings of every kind: checks, runtime rules, crash families; the
    GradScaler and the optimizer called by the names the finding's evidence gives them."""
    import re

    from ..rules.engine.rules import rule_for

    rule = rule_for(finding.check)
    if rule is None:
        return ""
    why = rst_to_plain(rule.why)
    evidence = finding.evidence if isinstance(finding.evidence, dict) else {}
    names = {k: evidence[k] for k in ("scaler", "optimizer") if isinstance(evidence.get(k), str) and evidence[k]}
    # One pass: a user's optimizer called ``scaler`` is not renamed twice.
    return re.sub(r"\b(scaler|optimizer)\b", lambda m: names.get(m.group(1), m.group(1)), why) if names else why


def code_fixes(report: Any) -> list:
    """The report's fixes that are code to write (display-only: the user's corrected loop, the code that builds an
    object anew), numbered from 1 in this order: ``%mpdoctor insert N`` puts fix N's code in a new cell below."""
    return [fx for fx in report.all_fixes if fx.applicability.value == "display-only" and fx.code.strip()]


def _finding_view(report: Any, finding: Any) -> dict:
    """A finding as data, each fix with what this report's proof says of it: the label is the proof's record,
    kept by the report that holds the proof, never written onto the fix (a fix in two reports has two records)."""
    data = dict(finding.to_dict(), why=_why(finding))
    proof = report.proof
    numbered = report._cache.get("code_fixes")
    if numbered is None:
        numbered = report._cache["code_fixes"] = code_fixes(report)
    for fx, fix_data in zip(finding.fixes, data["fixes"]):
        number = next((i for i, c in enumerate(numbered, 1) if c is fx), None)
        fix_data["insert"] = f"%mpdoctor insert {number}" if number is not None else ""
        fix_data["proof"] = proof.label(fx) if proof is not None else ""
        # What applying it applies besides it: the fixes it was verified with (its label names them).
        fix_data["applies_with"] = [o.title for o in proof.prerequisites(fx) if o is not fx] if proof is not None else []
        taken_out = proof.not_planned(fx) if proof is not None else ""
        trial = next((t for f, t in report.trials if f is fx), None)
        fix_data["trial"] = trial.sentence() if trial is not None else ""
        fix_data["in_place"] = fx.in_place
        if fix_data["in_place"]:
            fix_data["planned"], fix_data["proof"] = False, ""
            fix_data["note"] = ("already in place: the live objects hold this change, so there is nothing to apply; "
                                "run the failing code again")  # fmt: skip
        elif taken_out:
            fix_data["planned"], fix_data["note"] = False, taken_out
    return data


def report_dict(report: Any) -> dict:
    """The whole report as a JSON-serialisable, redacted dict."""
    facts = report.facts
    rt = facts.runtime
    data = {
        "summary": report.counts(),
        "hidden": dict(report.hidden),
        "plan": [fx.title for fx in report.fixes],
        "elapsed_seconds": round(report.elapsed, 4),
        "target": report.target,
        "device": hardware_view(facts),
        "subjects": subjects_view(facts),
        "notes": list(report.notes),
        # What was watched rather than inspected (a notebook cell's AMP loop), shown when no object was.
        "watched": report.watched,
        # The plan checked on the user's step, or why it was not.
        "proof": _proof_view(report),
        "findings": [_finding_view(report, f) for f in report.findings],
        # Since the last report (after refresh()): each finding that left, and why (fixed, superseded, code only).
        "departed": [dict(d) for d in report.departed],
        "histogram": [_jsonable(r._asdict()) for r in facts.tallies],
        "precision": precision_view(facts),
        "caches": cache_view(facts),
        "scalers": scaler_view(facts),
        "scan": report.scan_rows(),
        "probe": probe_view(report),
        # Per GradScaler and watched step (mpdoctor.facts.scale_history.ScaleRecord): scale, skipped, loss.
        "scale_history": [r.to_dict() if hasattr(r, "to_dict") else dict(r) for r in report.scale_history],
        "runtime": {
            "autocast": rt.autocast,
            "matmul_tf32": rt.matmul_tf32,
            "cudnn_tf32": rt.cudnn_tf32,
            "float32_matmul_precision": rt.float32_matmul_precision,
            "env": rt.env,
            "versions": rt.versions,
        },
    }
    return _redact_all(_jsonable(data))


def _redact_all(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: _redact_all(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_all(v) for v in value]
    return value
