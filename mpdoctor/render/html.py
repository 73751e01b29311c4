"""Static HTML rendering: the same content as the widget, without buttons.

The widget builds its HTML pieces from the functions here, so the static
export (nbconvert, GitHub's notebook viewer) and the live widget show the same
thing. Every string that may come from a user object goes through :func:`e`;
the markup around it is built here, never from user text.

Colours: every colour is one of JupyterLab's CSS variables (also defined by Notebook 7, VS Code's renderer
and ipywidgets' own stylesheet), each with its light-theme value as the fallback for frontends without them
(classic Notebook, Colab). Text is the theme's text colour on the report's own panel, a code block or a tint
of a severity hue (``tint``: the hue mixed into the panel's background, so it is light in the light theme and
dark in the dark one); the only coloured text is the theme's error red (``ERROR_TEXT``), which reads on the
panel in both themes. ``tests/test_contrast.py`` measures every pair, WCAG contrast 4.5 or more, against
JupyterLab's light and dark theme values and the fallbacks.
"""

from __future__ import annotations

from html import escape
from typing import Any

from .data import humanize_bytes, humanize_count
from .formatting import (
    also_found_label,
    cause_layout,
    dtype_word,
    fix_kind,
    format_number,
    plural,
    precision_word,
    probe_bars,
    rst_to_plain,
    scan_summary,
    singular_counts,
    summarize_evidence,
)
from .svg import DTYPE_FILL, layer_strip_svg, probe_chart_svg, scale_history_svg, scale_series
from .view import ReportView

#: Severity hues (JupyterLab's ``*-color1``): borders, and badge backgrounds through :func:`tint`; never text.
COLORS = {
    "error": "var(--jp-error-color1,#d32f2f)",
    "warning": "var(--jp-warn-color1,#f57c00)",
    "info": "var(--jp-info-color1,#0097a7)",
}
OK_COLOR = "var(--jp-success-color1,#388e3c)"
#: A badge with no severity ("superseded"): the theme's border grey.
NEUTRAL = "var(--jp-border-color1,#bdbdbd)"
#: Text colours, from the theme, with light-theme fallbacks.
FG = "var(--jp-content-font-color1,#1f2328)"
# Secondary text: the theme's text colour at 75% (>= 5.5:1 on the panel and code backgrounds in both themes);
# where color-mix is unknown the declaration is dropped and the text inherits the full colour.
MUTED = "color-mix(in srgb,var(--jp-content-font-color1,#1f2328) 75%,transparent)"
LINK = "var(--jp-content-link-color,#0d47a1)"
#: The error hue as text (a skipped step, an underflow mark): JupyterLab's error-color1 reads on both panels.
ERROR_TEXT = COLORS["error"]
BG = "var(--jp-layout-color0,#fff)"
CODE_BG = "var(--jp-layout-color2,#eee)"
BORDER = "var(--jp-border-color1,#bdbdbd)"
#: Text of the widget's buttons and tab labels (ipywidgets' own choice), on ``CODE_BG``.
UI_FG = "var(--jp-ui-font-color1,#1f2328)"
UI_FG_STRONG = "var(--jp-ui-font-color0,#000)"


def tint(hue: str) -> str:
    """A background of ``hue`` mixed into the panel's: light in the light theme, dark in the dark one, so the
    theme's text colour reads on it (where color-mix is unknown, the panel shows through)."""
    return f"color-mix(in srgb,{hue} 22%,{BG})"


DTYPE_COLORS = DTYPE_FILL
KIND_LABELS = {"param": "params", "grad": "grads", "buffer": "buffers", "optimizer_state": "optimizer state"}
# Double quotes only inside styles: every style attribute here is single-quoted.
FONT = 'font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;font-size:13px;line-height:1.45'
#: The report's own panel: the colours every text inside is measured against.
PANEL = f"{FONT};color:{FG};background:{BG}"

CODE = f"font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px;color:{FG};background:{CODE_BG};border-radius:3px;padding:0 3px;overflow-wrap:anywhere"
PRE = f"{CODE};border:1px solid {BORDER};padding:4px 8px;margin:4px 0;white-space:pre-wrap;display:block"
SUMMARY = f"cursor:pointer;color:{LINK}"


def e(value: Any) -> str:
    """Escape anything for HTML text and attributes."""
    return escape(str(value), quote=True)


def code(value: Any) -> str:
    """Inline code, escaped."""
    return f"<code style='{CODE}'>{e(value)}</code>"


def muted(html: str, size: int = 12) -> str:
    """Secondary text (already escaped markup)."""
    return f"<span style='color:{MUTED};font-size:{size}px'>{html}</span>"


def pill(text: str, hue: str, size: int = 11) -> str:
    """A badge: the theme's text on a tint of ``hue``, edged in ``hue``: it reads in every theme."""
    return (
        f"<span style='background:{tint(hue)};color:{FG};border:1px solid {hue};border-radius:3px;padding:0 6px;"
        f"font-size:{size}px;font-weight:bold;letter-spacing:.03em;white-space:nowrap'>{e(text)}</span>"
    )


def badge(severity: str) -> str:
    """A coloured severity label."""
    return pill(severity.upper(), COLORS[severity])


def verdict_html(data: dict) -> str:
    """The header line: counts, device or target profile, time taken."""
    c = data["summary"]
    if c["error"] == 0 and c["warning"] == 0:
        verdict = pill("\u2714 no mixed-precision problems found", OK_COLOR, 12)
        if c["info"]:
            verdict += f" {muted(e('(' + plural(c['info'], 'note') + ')'))}"
    else:
        counts = [(c["error"], "error"), (c["warning"], "warning"), (c["info"], "info")]
        verdict = " ".join(
            pill(plural(n, word), COLORS[word], 12) if n else f"<b>{e(plural(n, word))}</b>" for n, word in counts
        )
    device = data["device"]
    where = f"target {code(device['label'])}" if data.get("target") else f"device {code(device['label'])}"
    ms = f"{data['elapsed_seconds'] * 1000:.0f} ms"
    return (
        f"<div style='font-size:15px'><b>mpdoctor</b> &nbsp;{verdict}</div>"
        f"<div style='font-size:12px;color:{MUTED}'>{where} &nbsp;&middot;&nbsp; diagnosed in {e(ms)}</div>"
    )


def subjects_html(data: dict) -> str:
    """What was inspected: names and classes."""
    subjects = data["subjects"]
    notes = "".join(f"<div style='color:{MUTED}'>note: {e(n)}</div>" for n in data.get("notes", ()))
    if not subjects and data.get("watched"):
        return f"<div>watched: {e(data['watched'])}</div>{notes}"
    if not subjects:
        return f"<div style='color:{MUTED}'>inspected: nothing (no model, optimizer, scaler, trainer or accelerator found)</div>{notes}"
    items = ", ".join(f"{code(s['name'])} {muted(e(s['class']), 13)}" for s in subjects)
    return f"<div>inspected: {items}</div>{notes}"


def evidence_html(evidence: dict) -> str:
    """The facts a finding rests on: short values inline, long lists summarised with the full list folded."""
    items = summarize_evidence(evidence) if evidence else []
    if not items:
        return ""
    inline, folded = [], []
    for item in items:
        inline.append(f"<span style='white-space:nowrap'>{e(item.key)}&nbsp;=</span> {code(item.summary)}")
        if item.full is not None:
            folded.append(
                f"<details style='margin:2px 0 0 12px'><summary style='{SUMMARY}'>all {e(item.key)} "
                f"({e(plural(item.full.count(chr(10)) + 1, 'line'))})</summary><pre style='{PRE}'>{e(item.full)}</pre></details>"
            )
    return f"<div style='font-size:12px;margin-top:2px'>evidence: {' &nbsp; '.join(inline)}{''.join(folded)}</div>"


def finding_body_html(f: dict) -> str:
    """A finding without its fixes: severity, check, subject, message, an expandable why, the evidence."""
    why = rst_to_plain(f.get("why") or "")
    why_block = (
        f"<details style='margin-top:2px'><summary style='{SUMMARY}'>why it matters</summary>"
        f"<div style='font-size:12px;margin:2px 0 2px 12px'>{e(why)}</div></details>"
        if why
        else ""
    )
    return (
        f"<div style='{FONT}'>"
        f"<div>{badge(f['severity'])} {code(f['check'])} on {code(f['subject'])}</div>"
        f"<div style='margin:3px 0;overflow-wrap:anywhere'>{e(f['message'])}</div>"
        f"{why_block}{evidence_html(f['evidence'])}</div>"
    )


def fix_html(fx: dict, siblings: list[dict] | None = None) -> str:
    """A fix in the static rendering: its kind (as the text and the widget label it), title, state and code."""
    kind = f"fix ({fix_kind(fx, siblings if siblings is not None else [fx])})"
    safety = pill(kind, COLORS["error"]) if "unsafe" in kind else e(kind)
    state = (f" {pill('applied', OK_COLOR)}" if fx["applied"]
             else f" {pill('already in place', OK_COLOR)}" if fx.get("in_place") else "")  # fmt: skip
    failed = f" {pill('failed', COLORS['error'])} {e(fx['error'])}" if fx.get("error") else ""
    proof = f"<div style='color:{MUTED}'>{e(fx['proof'])}</div>" if fx.get("proof") else ""
    proof += f"<div style='color:{MUTED}'>{e(fx['trial'])}</div>" if fx.get("trial") else ""
    return (f"<li>{safety}: {e(singular_counts(fx['title']))}{state}{failed}{proof}"
            f"<pre style='{PRE}'>{e(fx['code'])}</pre></li>")  # fmt: skip


def finding_html(f: dict) -> str:
    """One finding with its fixes listed (no buttons: the widget adds its own)."""
    fixes = "".join(fix_html(fx, f["fixes"]) for fx in f["fixes"])
    fixes_block = f"<ul style='margin:2px 0;padding-left:20px'>{fixes}</ul>" if fixes else ""
    return (
        f"<div style='border:1px solid {BORDER};border-left:4px solid {COLORS[f['severity']]};border-radius:3px;"
        f"padding:4px 8px;margin:4px 0'>{finding_body_html(f)}{fixes_block}</div>"
    )


def histogram_html(hist: list[dict], watcher_only: bool = False) -> str:
    """Horizontal bars of bytes per dtype, grouped by object.

    Each row names the tensor kind (params, grads, buffers, optimizer state),
    the dtype and trainable / frozen, and writes its count, elements and bytes
    out, so nothing needs hovering. Bars are scaled within each object; rows
    wrap in a narrow window.
    """
    if not hist and watcher_only:  # "No tensors." would deny the model the findings name
        return f"<p style='{FONT};color:{MUTED}'>{WATCHER_ONLY} Run %mpdoctor for the live objects' dtypes.</p>"
    if not hist:
        return f"<p style='{FONT};color:{MUTED}'>No tensors.</p>"
    groups: dict[str, list[dict]] = {}
    for r in hist:
        groups.setdefault(r["object"], []).append(r)
    parts = [f"<div style='{FONT}'>"]
    for obj, rows in groups.items():
        total = sum(r["bytes"] for r in rows)
        biggest = max(r["bytes"] for r in rows) or 1
        parts.append(
            f"<div style='margin:6px 0 2px'>{code(obj)} "
            f"{muted(e(plural(sum(r['tensors'] for r in rows), 'tensor') + ', ' + humanize_bytes(total)))}</div>"
        )
        for r in rows:
            pct = max(1.0, 100.0 * r["bytes"] / biggest) if r["bytes"] else 0.0
            color = DTYPE_COLORS.get(r["dtype"], "#757575")
            dtype = dtype_word(r["dtype"])  # the same word as the layer strip's legend
            kind = KIND_LABELS.get(r["kind"], r["kind"])
            state = "trainable" if r["trainable"] else "frozen"
            meta = f", {r['meta']} on meta" if r.get("meta") else ""
            figures = f"{plural(r['tensors'], 'tensor')} · {humanize_count(r['elements'])} elements · {humanize_bytes(r['bytes'])}{meta}"
            parts.append(
                "<div style='display:flex;flex-wrap:wrap;align-items:center;column-gap:8px;font-size:12px;margin:1px 0 1px 12px'>"
                f"<div style='width:110px;flex:none'>{e(kind)}</div>"
                f"<div style='width:56px;flex:none;font-weight:bold'><span style='display:inline-block;width:9px;height:9px;"
                f"background:{color};margin-right:4px'></span>{e(dtype)}</div>"
                f"<div style='width:70px;flex:none;color:{MUTED}'>{state}</div>"
                f"<div style='width:200px;flex:0 1 200px;min-width:60px;background:{CODE_BG};border-radius:2px'>"
                f"<div style='width:{pct:.1f}%;background:{color};height:12px;border-radius:2px'></div></div>"
                f"<div>{e(figures)}</div></div>"
            )
    parts.append("</div>")
    return "".join(parts)


def table_html(rows: list[dict], columns: list[str] | None = None, highlight: Any = None,
               explain: dict[str, str] | None = None) -> str:  # fmt: skip
    """A small table; ``highlight(row, column)`` may return a severity colour: that cell becomes a pill.
    ``explain``: ``column -> what it means``, said under the table (and on hover of the heading)."""
    if not rows:
        return ""
    columns = columns or list(rows[0])
    explain = explain or {}
    head = "".join(
        f"<th style='text-align:left;padding:2px 10px 2px 0;border-bottom:1px solid {BORDER}'"
        + (f" title='{e(explain[c])}'" if c in explain else "") + f">{e(c)}</th>"
        for c in columns
    )
    body = []
    for r in rows:
        cells = []
        for c in columns:
            color = highlight(r, c) if highlight else None
            value = r.get(c, "")
            text = "-" if value is None else value
            inner = pill(str(text), color, 12) if color else e(text)
            cells.append(f"<td style='padding:2px 10px 2px 0;overflow-wrap:anywhere{';font-weight:bold' if color else ''}'>{inner}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    legend = "".join(f"<div>{code(c)}: {e(explain[c])}</div>" for c in columns if c in explain)
    return (
        f"<div style='overflow-x:auto'><table style='border-collapse:collapse;{FONT};font-size:12px;color:{FG}'><thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table></div>"
        + (f"<div style='{FONT};font-size:12px;color:{MUTED};margin:2px 0'>{legend}</div>" if legend else "")
    )


def caches_html(caches: list[dict]) -> str:
    """Every config and sub-config with its cache flag; True in training mode is highlighted."""
    if not caches:
        return f"<p style='{FONT};color:{MUTED}'>No Hugging Face config among the inspected objects.</p>"

    def warn(row: dict, column: str) -> str | None:
        return COLORS["warning"] if column == "use_cache" and row["use_cache"] is True and row["training"] else None

    return table_html(caches, ["path", "use_cache", "model_type", "training"], warn)


def watcher_only(data: dict) -> bool:
    """Whether the report is only what the loop watcher saw as a cell ran (it inspected no object)."""
    return bool(data.get("watched")) and not data["subjects"]


#: Said in an empty panel of a watcher's report: its objects were not inspected, not absent.
WATCHER_ONLY = "This report holds what the loop watcher saw as the cell ran; it inspected no objects."


def scalers_html(scalers: list[dict], watched: bool = False, watcher_only: bool = False) -> str:
    """GradScaler state: enabled, scale, growth tracker. ``watched``: a scale history follows (say so instead of
    "no GradScaler" above its chart). ``watcher_only``: the report inspected no object, so the absence of a
    scaler here says nothing about the user's scaler (say that instead)."""
    if not scalers and watcher_only:
        seen = "The scale history below is what it recorded." if watched else "No scaler step or update ran in it."
        return f"<p style='{FONT};color:{MUTED}'>{WATCHER_ONLY} {seen} Run %mpdoctor for the live GradScaler's state.</p>"
    if not scalers:
        if watched:
            return (f"<p style='{FONT};color:{MUTED}'>The inspected objects hold no GradScaler; the scale history below "
                    "was watched while the cells ran.</p>")  # fmt: skip
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
    return table_html(rows, explain=SCALER_COLUMNS)


#: What the scaler table's columns mean (GradScaler's own state).
SCALER_COLUMNS = {
    "scale": "the loss scale the next step multiplies the loss by",
    "growth tracker": "steps in a row without inf/NaN gradients; the scale doubles when it reaches the growth interval",
    "growth interval": "how many clean steps in a row double the scale",
}
#: What the precision table's columns mean.
PRECISION_COLUMNS = {
    "requested (args)": "what TrainingArguments' bf16 / fp16 flags ask for",
    "args.mixed_precision": "the precision the arguments resolve to",
    "ACCELERATE_MIXED_PRECISION": "the environment variable accelerate reads",
    "accelerator": "what the Accelerator was built with",
    "native amp": "whether the Trainer runs torch.autocast itself",
    "scaler": "the GradScaler the setup steps through",
    "device bf16": "whether the device computes bf16 natively",
    "effective": "what the run computes in (highlighted when it is not what was requested)",
}


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
                "requested (args)": precision_word(p["requested"]),
                "args.mixed_precision": precision_word(p["args.mixed_precision"]),
                "ACCELERATE_MIXED_PRECISION": p["ACCELERATE_MIXED_PRECISION"],
                "accelerator": precision_word(p["accelerator.mixed_precision"]),
                "native amp": p["native_amp"],
                "scaler": p["scaler"],
                "autocast now": autocast,
                "device bf16": p["device bf16"],
                "effective": precision_word(p["effective"]),
            }
            for p in data["precision"]
        ]

        def mismatch(row: dict, column: str) -> str | None:
            if column == "effective" and row["requested (args)"] not in (None, row["effective"]):
                return COLORS["error"]
            return None

        parts.append(table_html(rows, highlight=mismatch, explain=PRECISION_COLUMNS))
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


def layers_html(view: ReportView) -> str:
    """The per-layer dtype strip of every model with many layers, or a line saying why there is none."""
    strips = view.layer_strips
    if not strips:
        return f"<p style='{FONT};color:{MUTED}'>No model with 4 or more numbered layers among the inspected objects.</p>"
    parts = [f"<div style='{FONT}'>"]
    for strip in strips:
        if strip.differing:
            note = f"{plural(len(strip.differing), 'layer')} differ from the rest: layers {', '.join(map(str, strip.differing[:12]))}" + (
                ", ..." if len(strip.differing) > 12 else ""
            )
        else:
            note = f"all {len(strip.layers)} layers hold the same dtypes"
        parts.append(f"<div style='margin:6px 0 2px'>{code(strip.model)} {muted(e(note))}</div>{layer_strip_svg(strip)}")
    parts.append("</div>")
    return "".join(parts)


def numerics_html(data: dict) -> str:
    """The value scan and the probe in numbers and a chart, shown whether or not a finding fired."""
    parts = [f"<div style='{FONT}'>"]
    scan = scan_summary(data.get("scan") or [])
    if scan:
        rows = [
            {
                "value scan": "values read",
                "": humanize_count(scan["values"]) + f" in {plural(scan['rows'], 'module row')}",
            },
            {"value scan": "NaN / Inf", "": f"{format_number(scan['nan'])} / {format_number(scan['inf'])}"},
            {"value scan": "largest |value|", "": format_number(scan["absmax"])},
            {"value scan": "past fp16's 65504", "": format_number(scan["fp16_overflow"])},
            {"value scan": "fp16 headroom", "": "no finite value" if scan["absmax"] == 0 else f"{format_number(scan['fp16_headroom'])}x"},
        ]

        def bad(row: dict, column: str) -> str | None:
            hot = row["value scan"] in ("NaN / Inf", "past fp16's 65504") and row[""] not in ("0 / 0", "0")
            return COLORS["error"] if column == "" and hot else None

        parts.append(table_html(rows, highlight=bad))
    probe = data.get("probe") or []
    if probe:
        parts.append(f"<div style='margin:8px 0 2px;font-weight:bold'>one-batch probe: {e(plural(len(probe), 'module'))}</div>")
        parts.append(probe_chart_svg(probe_bars(probe)))
    if not scan and not probe:
        parts.append(
            f"<p style='color:{MUTED}'>No values were read: <code style='{CODE}'>%mpdoctor --scan</code> scans "
            f"the tensors for NaN/Inf and fp16 headroom; <code style='{CODE}'>%mpdoctor model --probe batch</code> "
            "runs one batch and charts each module's largest activation.</p>"
        )
    parts.append("</div>")
    return "".join(parts)


def scale_history_html(data: dict) -> str:
    """Each watched GradScaler's scale over steps (skips marked) beside the loss; empty when nothing was watched."""
    series = scale_series(data.get("scale_history") or [])
    if not series:
        return ""
    parts = [f"<div style='{FONT};margin-top:6px'>"]
    for name, rows in series.items():
        skipped = sum(1 for r in rows if r.get("skipped"))
        note = f"{plural(len(rows), 'step')}, {skipped} skipped"
        parts.append(f"<div style='margin:4px 0 2px'>{code(name)} {muted(e(note))}</div>")
        parts.append(scale_history_svg(rows, name))
    parts.append("</div>")
    return "".join(parts)


def proof_html(data: dict) -> str:
    """The line that says whether the plan was checked on the user's step; empty when there is nothing to check."""
    proof = data.get("proof")
    if not proof:
        return ""
    hue, color = (OK_COLOR, FG) if proof["verified"] else (BORDER, MUTED)
    return (f"<div class='mpdoctor-proof' style='{FONT};color:{color};border-left:3px solid {hue};padding-left:6px;"
            f"margin:4px 0'>{e(proof['summary'])}</div>")  # fmt: skip


def section(title: str, body: str) -> str:
    """A titled block of the static rendering."""
    return f"<div style='margin-top:8px'><div style='font-weight:bold;margin-bottom:2px'>{e(title)}</div>{body}</div>"


def cause_html(label: str) -> str:
    """The heading above the finding that explains an exception (``cause of RuntimeError: ...``)."""
    # The pill says "cause": the label's own "cause of " would read "cause cause of RuntimeError".
    shown = label[len("cause of "):] if label.startswith("cause of ") else label
    return f"<div class='mpdoctor-cause' style='{FONT};font-weight:bold;margin:6px 0 0'>{pill('cause of', COLORS['error'])} {e(shown)}</div>"


def also_found_html(findings: list[dict]) -> str:
    """The findings beside an exception's cause, folded: the cause is what to read first."""
    body = "".join(finding_html(f) for f in findings)
    return (
        f"<details class='mpdoctor-also-found' style='margin-top:4px'><summary style='{SUMMARY}'>"
        f"{e(also_found_label(len(findings)))}</summary>{body}</details>"
    )


def departed_html(departed: list[dict]) -> str:
    """The "since the last report" section of a refreshed report: each finding that left, and why."""
    if not departed:
        return ""
    colors = {"fixed": OK_COLOR, "superseded": NEUTRAL, "changed outside": NEUTRAL}
    rows = "".join(
        f"<div class='mpdoctor-departed'>{pill(d['why'], colors.get(d['why'], COLORS['warning']))} "
        f"{code(d['check'])} on {code(d['subject'])}</div>"
        for d in departed
    )
    return section("since the last report", rows)


def render_html(view: ReportView) -> str:
    """Render a report's view as a self-contained HTML fragment."""
    data = view.data
    parts = [f"<div class='mpdoctor-report' style='{PANEL};padding:4px 8px'>", verdict_html(data), subjects_html(data)]
    parts.append(departed_html(data.get("departed") or []))
    label = view.cause_label
    if label and len(data["findings"]) > 1:  # the cause (and its planned fix) first; the others folded under it
        shown, folded = cause_layout(data["findings"])
        parts += [cause_html(label), *(finding_html(data["findings"][i]) for i in shown)]
        parts.append(also_found_html([data["findings"][i] for i in folded]) if folded else "")
    else:
        if label:  # the finding that explains an exception comes first, under this heading
            parts.append(cause_html(label))
        parts += [finding_html(f) for f in data["findings"]]
    parts.append(proof_html(data))
    parts.append(section("dtypes", histogram_html(data["histogram"], watcher_only=watcher_only(data))))
    if view.layer_strips:
        parts.append(section("dtypes per layer", layers_html(view)))
    if data.get("scan") or data.get("probe"):
        parts.append(section("numerics", numerics_html(data)))
    parts.append(section("precision: requested vs effective", precision_html(data)))
    parts.append(section("caches", caches_html(data["caches"])))
    parts.append(
        section(
            "scalers",
            scalers_html(data["scalers"], watched=bool(data.get("scale_history")), watcher_only=watcher_only(data)),
        )
    )
    if data.get("scale_history"):
        parts.append(section("loss scale and loss over steps", scale_history_html(data)))
    parts.append("</div>")
    return "".join(parts)

