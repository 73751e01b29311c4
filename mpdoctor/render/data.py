"""The one view of a Report every renderer and export reads: plain, JSON-serialisable data."""

from __future__ import annotations

from typing import Any

from ..redact import redact
from ..treatment.findings import _jsonable
from .formatting import rst_to_plain


def humanize_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def humanize_count(n: float) -> str:
    """``1234567`` -> ``"1.23M"``."""
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return str(int(n))


def subjects_view(report: Any) -> list[dict]:
    """Name, kind and class of every subject."""
    return [
        {"name": s.name, "kind": s.kind, "class": s.class_name, "aliases": list(s.aliases)}
        for s in report.facts.subjects
    ]


def precision_view(report: Any) -> list[dict]:
    """Requested vs effective precision of every setup."""
    hw = report.facts.hardware
    out = []
    for p in report.facts.precisions:
        out.append(
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
        )
    return out


def cache_view(report: Any) -> list[dict]:
    """Every config and sub-config with its cache flag."""
    out = []
    for m in report.facts.models:
        for c in m.configs:
            out.append(
                {
                    "path": f"{c.path}.use_cache",
                    "use_cache": c.use_cache if c.has_use_cache else "(absent)",
                    "model_type": c.model_type,
                    "training": m.training,
                }
            )
    return out


def scaler_view(report: Any) -> list[dict]:
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
        for s in report.facts.scalers
    ]


def hardware_view(report: Any) -> dict:
    """The device or what-if profile."""
    hw = report.facts.hardware
    return {
        "name": hw.name,
        "label": hw.label,
        "kind": hw.kind,
        "capability": ".".join(map(str, hw.capability)) if hw.capability else None,
        "bf16_native": hw.bf16_native,
        "fp16_tensor_cores": hw.fp16_tensor_cores,
        "tf32": hw.tf32,
        "live": hw.live,
        "unscale_dtypes": list(hw.unscale_dtypes) if hw.unscale_dtypes is not None else None,
    }


def scan_view(report: Any) -> list[dict]:
    """Per-module value-scan rows (only modules with something to say, plus totals); empty without a scan."""
    if not report.facts.scans:
        return []
    return report.scan_rows()


def probe_view(report: Any) -> list[dict]:
    """The one-batch probe table as rows; empty for reports that did not probe."""
    table = getattr(report, "probe_table", None)
    if table is None:
        return []
    try:
        return table.to_dict(orient="records")
    except Exception:
        return []


def report_dict(report: Any) -> dict:
    """The whole report as a JSON-serialisable dict."""
    from ..checks import REGISTRY

    rt = report.facts.runtime
    data = {
        "summary": report.counts(),
        "hidden": dict(getattr(report, "hidden", {}) or {}),
        "plan": [fx.title for fx in report.fixes],
        "elapsed_seconds": round(report.elapsed, 4),
        "target": report.target,
        "device": hardware_view(report),
        "subjects": subjects_view(report),
        "notes": list(getattr(report, "notes", ()) or ()),
        # What was watched rather than inspected (a notebook cell's AMP loop), shown when no object was.
        "watched": getattr(report, "watched", None),
        "findings": [dict(f.to_dict(), why=rst_to_plain(REGISTRY[f.check].why) if f.check in REGISTRY else "")
                     for f in report.findings],
        "histogram": [_jsonable(r._asdict()) for r in report.facts.tallies],
        "precision": precision_view(report),
        "caches": cache_view(report),
        "scalers": scaler_view(report),
        "scan": scan_view(report),
        "probe": probe_view(report),
        # Per GradScaler and watched step (mpdoctor.facts.scale_history.ScaleRecord): scale, skipped, loss.
        "scale_history": [r.to_dict() if hasattr(r, "to_dict") else dict(r) for r in getattr(report, "scale_history", None) or ()],
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
