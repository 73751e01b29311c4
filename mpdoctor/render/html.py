"""Static HTML rendering: the same content as the widget, without buttons.

The widget builds its HTML pieces from the functions here, so the static
export (nbconvert, GitHub's notebook viewer) and the live widget show the same
thing. Every string that may come from a user object goes through :func:`e`;
the markup around it is built here, never from user text.
"""

from __future__ import annotations

from html import escape
from typing import Any

from ..crash.cause import cause_label
from ..facts.tensors import SHORT_DTYPE
from .data import humanize_bytes, humanize_count, report_dict

COLORS = {"error": "#c62828", "warning": "#e65100", "info": "#1565c0"}
OK_COLOR = "#2e7d32"
MUTED = "#666"
DTYPE_COLORS = {"float32": "#1976d2", "bfloat16": "#8e24aa", "float16": "#f57c00", "float64": "#00897b"}
KIND_LABELS = {"param": "params", "grad": "grads", "buffer": "buffers", "optimizer_state": "optimizer state"}
# Double quotes only inside styles: every style attribute here is single-quoted.
FONT = 'font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;font-size:13px;line-height:1.45'

CODE = "font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px"
PRE = f"{CODE};background:#f6f8fa;border:1px solid #e1e4e8;border-radius:4px;padding:4px 8px;margin:4px 0;white-space:pre-wrap"


def e(value: Any) -> str:
    """Escape anything for HTML text and attributes."""
    return escape(str(value), quote=True)


def code(value: Any) -> str:
    """Inline code, escaped."""
    return f"<code style='{CODE}'>{e(value)}</code>"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def badge(severity: str) -> str:
    """A coloured severity label."""
    return (
        f"<span style='background:{COLORS[severity]};color:#fff;border-radius:3px;padding:0 6px;"
        f"font-size:11px;font-weight:bold;letter-spacing:.03em'>{e(severity.upper())}</span>"
    )


def verdict_html(data: dict) -> str:
    """The header line: coloured counts, device or target profile, time taken."""
    c = data["summary"]
    if c["error"] == 0 and c["warning"] == 0:
        verdict = f"<b style='color:{OK_COLOR}'>&#10004; no mixed-precision problems found</b>"
        if c["info"]:
            verdict += f" <span style='color:{COLORS['info']}'>({e(_plural(c['info'], 'note'))})</span>"
    else:
        counts = [
            (c["error"], "error", "error"),
            (c["warning"], "warning", "warning"),
            (c["info"], "info", "info"),
        ]
        verdict = " &middot; ".join(
            f"<b style='color:{COLORS[sev] if n else MUTED}'>{e(_plural(n, word) if sev != 'info' else f'{n} info')}</b>"
            for n, word, sev in counts
        )
    device = data["device"]
    where = f"target {code(device['label'])}" if data.get("target") else f"device {code(device['label'])}"
    ms = f"{data['elapsed_seconds'] * 1000:.0f} ms"
    return (
        f"<div style='font-size:15px'><b>mpdoctor</b> &nbsp;{verdict}</div>"
        f"<div style='color:{MUTED};font-size:12px'>{where} &nbsp;&middot;&nbsp; diagnosed in {e(ms)}</div>"
    )


def subjects_html(data: dict) -> str:
    """What was inspected: names and classes."""
    subjects = data["subjects"]
    if not subjects:
        return f"<div style='color:{MUTED}'>inspected: nothing (no model, optimizer, scaler, trainer or accelerator found)</div>"
    items = ", ".join(
        f"{code(s['name'])} <span style='color:{MUTED}'>{e(s['class'])}</span>" for s in subjects
    )
    return f"<div>inspected: {items}</div>"


def evidence_html(evidence: dict) -> str:
    """The facts a finding rests on, as ``key = value`` pairs."""
    if not evidence:
        return ""
    pairs = " &nbsp; ".join(f"{e(k)}&nbsp;=&nbsp;{code(v)}" for k, v in evidence.items())
    return f"<div style='font-size:12px;color:#444;margin-top:2px'>evidence: {pairs}</div>"


def finding_body_html(f: dict) -> str:
    """A finding without its fixes: severity, check, subject, message, an expandable why, the evidence."""
    why = f.get("why") or ""
    why_block = (
        f"<details style='margin-top:2px'><summary style='cursor:pointer;color:{COLORS['info']}'>why it matters</summary>"
        f"<div style='font-size:12px;margin:2px 0 2px 12px'>{e(why)}</div></details>"
        if why
        else ""
    )
    return (
        f"<div style='{FONT}'>"
        f"<div>{badge(f['severity'])} {code(f['check'])} <span style='color:{MUTED}'>on</span> {code(f['subject'])}</div>"
        f"<div style='margin:3px 0'>{e(f['message'])}</div>"
        f"{why_block}{evidence_html(f['evidence'])}</div>"
    )


def fix_html(fx: dict) -> str:
    """A fix in the static rendering: its safety, title, state and the code that does the same."""
    safety = "safe fix" if fx["safe"] else "<b style='color:#b71c1c'>unsafe fix</b>"
    state = " <b style='color:#2e7d32'>(applied)</b>" if fx["applied"] else ""
    failed = f" <span style='color:#b71c1c'>failed: {e(fx['error'])}</span>" if fx.get("error") else ""
    return f"<li>{safety}: {e(fx['title'])}{state}{failed}<pre style='{PRE}'>{e(fx['code'])}</pre></li>"


def finding_html(f: dict) -> str:
    """One finding with its fixes listed (no buttons: the widget adds its own)."""
    fixes = "".join(fix_html(fx) for fx in f["fixes"])
    fixes_block = f"<ul style='margin:2px 0;padding-left:20px'>{fixes}</ul>" if fixes else ""
    return (
        f"<div style='border:1px solid #e0e0e0;border-left:4px solid {COLORS[f['severity']]};border-radius:3px;"
        f"padding:4px 8px;margin:4px 0'>{finding_body_html(f)}{fixes_block}</div>"
    )


def histogram_html(hist: list[dict]) -> str:
    """Horizontal bars of bytes per dtype, grouped by object.

    Each row names the tensor kind (params, grads, buffers, optimizer state),
    the dtype and trainable / frozen, and writes its count, elements and bytes
    out, so nothing needs hovering. Bars are scaled within each object.
    """
    if not hist:
        return f"<p style='color:{MUTED}'>No tensors.</p>"
    groups: dict[str, list[dict]] = {}
    for r in hist:
        groups.setdefault(r["object"], []).append(r)
    parts = [f"<div style='{FONT}'>"]
    for obj, rows in groups.items():
        total = sum(r["bytes"] for r in rows)
        biggest = max(r["bytes"] for r in rows) or 1
        parts.append(
            f"<div style='margin:6px 0 2px'>{code(obj)} <span style='color:{MUTED};font-size:12px'>"
            f"{e(_plural(sum(r['tensors'] for r in rows), 'tensor'))}, {e(humanize_bytes(total))}</span></div>"
        )
        for r in rows:
            pct = max(1.0, 100.0 * r["bytes"] / biggest) if r["bytes"] else 0.0
            color = DTYPE_COLORS.get(r["dtype"], "#757575")
            dtype = SHORT_DTYPE.get(r["dtype"], r["dtype"])
            kind = KIND_LABELS.get(r["kind"], r["kind"])
            state = "trainable" if r["trainable"] else "frozen"
            meta = f", {r['meta']} on meta" if r.get("meta") else ""
            figures = f"{_plural(r['tensors'], 'tensor')} · {humanize_count(r['elements'])} elements · {humanize_bytes(r['bytes'])}{meta}"
            parts.append(
                "<div style='display:flex;align-items:center;gap:8px;font-size:12px;margin:1px 0 1px 12px'>"
                f"<div style='width:110px;flex:none'>{e(kind)}</div>"
                f"<div style='width:56px;flex:none;font-weight:bold;color:{color}'>{e(dtype)}</div>"
                f"<div style='width:70px;flex:none;color:{MUTED}'>{state}</div>"
                f"<div style='width:200px;flex:none;background:#eee;border-radius:2px'>"
                f"<div style='width:{pct:.1f}%;background:{color};height:12px;border-radius:2px'></div></div>"
                f"<div style='white-space:nowrap'>{e(figures)}</div></div>"
            )
    parts.append("</div>")
    return "".join(parts)


def table_html(rows: list[dict], columns: list[str] | None = None, highlight: Any = None) -> str:
    """A small table; ``highlight(row, column)`` may return a CSS colour for a cell."""
    if not rows:
        return ""
    columns = columns or list(rows[0])
    head = "".join(
        f"<th style='text-align:left;padding:2px 10px 2px 0;border-bottom:1px solid #ddd'>{e(c)}</th>"
        for c in columns
    )
    body = []
    for r in rows:
        cells = []
        for c in columns:
            color = highlight(r, c) if highlight else None
            style = f"padding:2px 10px 2px 0;{f'color:{color};font-weight:bold' if color else ''}"
            value = r.get(c, "")
            cells.append(f"<td style='{style}'>{e('-' if value is None else value)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (
        f"<table style='border-collapse:collapse;{FONT};font-size:12px'><thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table>"
    )


def caches_html(caches: list[dict]) -> str:
    """Every config and sub-config with its cache flag; True in training mode is highlighted."""
    if not caches:
        return f"<p style='{FONT};color:{MUTED}'>No Hugging Face config among the inspected objects.</p>"

    def warn(row: dict, column: str) -> str | None:
        return (
            COLORS["warning"]
            if column == "use_cache" and row["use_cache"] is True and row["training"]
            else None
        )

    return table_html(caches, ["path", "use_cache", "model_type", "training"], warn)


def scalers_html(scalers: list[dict]) -> str:
    """GradScaler state: enabled, scale, growth tracker."""
    if not scalers:
        return f"<p style='{FONT};color:{MUTED}'>No GradScaler among the inspected objects.</p>"
    rows = [
        {
            "scaler": s["name"],
            "enabled": s["enabled"],
            "device": s["device"],
            "scale": f"{s['scale']:g}" + ("" if s["scale_initialized"] else " (initial, no step yet)"),
            "growth tracker": s["growth_tracker"],
            "growth interval": s["growth_interval"],
        }
        for s in scalers
    ]
    return table_html(rows)


def precision_html(data: dict) -> str:
    """Requested vs effective precision side by side, then what the process and device do now."""
    rt = data["runtime"]
    device = data["device"]
    autocast = ", ".join(f"{k}: {v}" for k, v in rt["autocast"].items()) or "off"
    parts = []
    if data["precision"]:
        rows = [
            {
                "setup": p["setup"],
                "requested (args)": p["requested"],
                "args.mixed_precision": p["args.mixed_precision"],
                "ACCELERATE_MIXED_PRECISION": p["ACCELERATE_MIXED_PRECISION"],
                "accelerator": p["accelerator.mixed_precision"],
                "native amp": p["native_amp"],
                "scaler": p["scaler"],
                "autocast now": autocast,
                "device bf16": p["device bf16"],
                "effective": p["effective"],
            }
            for p in data["precision"]
        ]

        def mismatch(row: dict, column: str) -> str | None:
            if column == "effective" and row["requested (args)"] not in (None, row["effective"]):
                return COLORS["error"]
            return None

        parts.append(table_html(rows, highlight=mismatch))
    else:
        parts.append(
            f"<p style='{FONT};color:{MUTED};margin:2px 0'>No Trainer, TrainingArguments or Accelerator inspected: "
            "the precision is what the tensors' dtypes (see dtypes) and autocast say.</p>"
        )
    env = ", ".join(f"{k}={v}" for k, v in rt["env"].items()) or "none set"
    facts = [
        {"process and device": "autocast now", "now": autocast},
        {"process and device": "device", "now": device["label"]},
        {"process and device": "bf16 native", "now": device["bf16_native"]},
        {"process and device": "fp16 tensor cores", "now": device["fp16_tensor_cores"]},
        {"process and device": "tf32 (matmul / cudnn)", "now": f"{rt['matmul_tf32']} / {rt['cudnn_tf32']}"},
        {
            "process and device": "GradScaler unscale kernel accepts",
            "now": ", ".join(device["unscale_dtypes"] or []) or "not probed",
        },
        {"process and device": "precision environment variables", "now": env},
    ]
    parts.append(f"<div style='margin-top:6px'>{table_html(facts)}</div>")
    return "".join(parts)


def section(title: str, body: str) -> str:
    """A titled block of the static rendering."""
    return f"<div style='margin-top:8px'><div style='font-weight:bold;margin-bottom:2px'>{e(title)}</div>{body}</div>"


def cause_html(label: str) -> str:
    """The heading above the finding that explains an exception (``cause of RuntimeError: ...``)."""
    return f"<div class='mpdoctor-cause' style='{FONT};font-weight:bold;color:{COLORS['error']};margin:6px 0 0'>{e(label)}</div>"


def render_html(report: Any) -> str:
    """Render a report as a self-contained HTML fragment."""
    data = report_dict(report)
    parts = [f"<div class='mpdoctor-report' style='{FONT}'>", verdict_html(data), subjects_html(data)]
    label = cause_label(report)
    if label:  # the finding that explains an exception comes first, under this heading
        parts.append(cause_html(label))
    parts += [finding_html(f) for f in data["findings"]]
    parts.append(section("dtypes", histogram_html(data["histogram"])))
    parts.append(section("precision: requested vs effective", precision_html(data)))
    parts.append(section("caches", caches_html(data["caches"])))
    parts.append(section("scalers", scalers_html(data["scalers"])))
    parts.append("</div>")
    return "".join(parts)
