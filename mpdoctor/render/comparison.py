"""Renderers of ``mpdoctor.compare``: a text table, a static HTML heatmap and an ipywidgets view.

They read the plain dict of :meth:`mpdoctor.attach.emulation.compare.Comparison.to_dict`
(never torch). The heatmap has one row per Linear layer and per attention matmul
(``path [q·kᵀ]``, ``path [p·v]``), in call order, and one column per precision; each cell is coloured by the layer's SQNR under that precision (red
at 0 dB, green from 50 dB up) and marked ``▼`` with the share when more of its
nonzero inputs or output gradients underflow to zero than the precision's limit.
The widget adds a selector for the metric shown (output SQNR, weight-gradient
SQNR, activation underflow, gradient underflow, saturation). An attention row's
"weight-gradient" cell is the gradient of the matmul's second operand (K, V): it
has no weight. Core ipywidgets only (7.7.1 on Colab and 8).
"""

from __future__ import annotations

import html as _html
import math
from typing import Any

from .html import BG, BORDER, ERROR_TEXT, FG, FONT, MUTED

#: Metrics the heatmap can show: key -> (title, unit, higher is better).
METRICS = {
    "out_sqnr_db": ("output SQNR", "dB", True),
    "wgrad_sqnr_db": ("weight-gradient SQNR", "dB", True),
    "act_underflow_pct": ("activations underflowing to zero", "%", False),
    "grad_underflow_pct": ("output gradients underflowing to zero", "%", False),
    "act_saturation_pct": ("activations saturating", "%", False),
}
#: SQNR at which the colour scale is fully green.
GOOD_DB = 50.0


def e(value: Any) -> str:
    """HTML-escape a user string."""
    return _html.escape(str(value), quote=True)


def _fmt(value: Any, unit: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "exact" if value > 0 else "-inf"
    if unit == "dB":
        return f"{value:.1f}"
    if value == 0:
        return "0"
    return f"{value:.2g}" if value < 1 else f"{value:.1f}"


def _grid(data: dict) -> tuple[list[str], list[str], dict[tuple[str, str], dict]]:
    # "modules": Linears and attention matmuls in call order; a dict from before attention rows has only "layers".
    layers = list(data.get("modules") or [row[0] for row in data.get("layers", [])])
    precisions = list(data.get("precisions", []))
    cells = {(r["module"], r["precision"]): r for r in data.get("rows", [])}
    return layers, precisions, cells


def _underflow_mark(row: dict, limit: float) -> str:
    share = max(row.get("act_underflow_pct", 0.0) or 0.0, row.get("grad_underflow_pct", 0.0) or 0.0)
    return f"▼{share:.0f}%" if share > limit else ""


def _limits(data: dict) -> dict:
    return dict(data.get("thresholds", {}).get("underflow_pct", {}))


def _sites(data: dict) -> str:
    """What the rows are: Linears, and attention matmuls when the comparison reached any."""
    return "Linear and attention matmul" if data.get("attention") else "Linear"


def _wgrad_name(row: dict) -> str:
    return "K/V grad (2nd operand)" if row.get("kind") == "attention" else "weight grad"


def _loss_line(data: dict) -> str:
    losses = data.get("losses", {})
    if not losses:
        return ""
    ref = data.get("reference", "fp32")
    parts = []
    for name, value in losses.items():
        shown = f"{value:.4g}" if isinstance(value, float) and math.isfinite(value) else str(value)
        parts.append(f"{name}{' (reference)' if name == ref else ''} {shown}")
    return "loss: " + ", ".join(parts)


# -- text ---------------------------------------------------------------------------------------


def _below_floor(row: dict, data: dict, p: str) -> bool:
    """Whether a cell's output or weight-gradient SQNR is under the precision's keep threshold."""
    floor = data.get("thresholds", {}).get("keep_below_db", {}).get(p)
    values = (row.get("out_sqnr_db"), row.get("wgrad_sqnr_db"))
    return floor is not None and any(isinstance(v, float) and not math.isnan(v) and v < floor for v in values)


def legend_lines(data: dict) -> list[str]:
    """What each column and mark of the heatmap means: every precision's column (its label, as ``mxfp8 [FLOOR]``,
    and what it emulates), the thresholds a layer is flagged at, and ``◆`` when a plan kept layers."""
    _layers, precisions, _cells = _grid(data)
    labels, summaries = data.get("labels", {}), data.get("summaries", {})
    th = data.get("thresholds", {})
    lines = [f"{labels.get(p, p)}: {summaries[p]}" for p in precisions if summaries.get(p)]
    floors, limits = th.get("keep_below_db", {}), th.get("underflow_pct", {})
    judged = [f"{labels.get(p, p)} below {floors[p]:g} dB or ▼ above {limits.get(p, 1.0):g}%" for p in precisions
              if p in floors]  # fmt: skip
    if judged:
        lines.append("a layer is flagged to keep in higher precision (recommend(), the underflow warning and every "
                     "plan use these thresholds) when its output or weight-gradient SQNR is " + "; ".join(judged))
    for plan in data.get("plans", {}).values():
        lines.append(f"{KEPT_MARK} = kept in {plan.get('keep_precision')} by the {plan.get('target')} plan: the flagged "
                     "layers, then the worst-ranked others until the verified loss gap is within the budget")
    if judged:
        lines.append("a cell outlined in red is flagged")
    return lines


def _text_notes(data: dict) -> list[str]:
    """The plans, the loss curves, the runs that raised and the findings, one line each, indented."""
    lines = []
    for plan in data.get("plans", {}).values():
        lines.extend("  " + x for x in plan_text(plan).splitlines())
    lines.extend("  " + x for x in curves_text(data.get("curves", {})))
    for p, msg in data.get("errors", {}).items():
        lines.append(f"  {p}: the run raised {msg}")
    for f in data.get("findings", []):
        lines.append(f"  [{f['severity']}] {f['check']}: {f['message']}")
    return lines


def _text_grid(data: dict, metric: str, unit: str) -> tuple[list[str], list[list[str]]]:
    """The table's header and one line of cells per layer (kept layers marked, underflow marked)."""
    layers, precisions, cells = _grid(data)
    limits = _limits(data)
    kept = _kept(data)
    body = []
    for layer in layers:
        line = [f"{layer} {KEPT_MARK}" if layer in kept else layer]
        for p in precisions:
            row = cells.get((layer, p))
            if row is None:
                line.append("-")
                continue
            mark = _underflow_mark(row, limits.get(p, 1.0))
            line.append(_fmt(row.get(metric), unit) + (f" {mark}" if mark else ""))
        body.append(line)
    return ["layer", *(data.get("labels", {}).get(p, p) for p in precisions)], body


def comparison_text(data: dict, metric: str = "out_sqnr_db") -> str:
    """A text table: one line per layer, one column per precision (``metric``, ``▼`` marking underflow)."""
    title, unit, _ = METRICS[metric]
    head = f"mpdoctor.compare: {data.get('model', 'model')} ({data.get('dtype', '?')}, {data.get('device', '?')}), reference {data.get('reference', 'fp32')}"
    if data.get("error"):
        return f"{head}\n  nothing compared: {data['error']}"
    header, body = _text_grid(data, metric, unit)
    widths = [max(len(str(r[i])) for r in [header, *body]) for i in range(len(header))]
    lines = [head, f"  {title} per {_sites(data)} ({unit}); ▼ = share of nonzero inputs or gradients underflowing to zero"]
    if data.get("attention") and metric == "wgrad_sqnr_db":
        lines.append("  attention rows: the gradient of the matmul's second operand (K for q·kᵀ, V for p·v)")
    lines.append("  " + "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))))
    lines.append("  " + "  ".join("-" * w for w in widths))
    for r in body:
        lines.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    loss = _loss_line(data)
    if loss:
        lines.append("  " + loss)
    lines.extend("  " + x for x in legend_lines(data))
    lines.extend(_text_notes(data))
    if not data.get("backward", True):
        lines.append("  note: nothing required grad; forward only")
    return "\n".join(lines)


# -- plans and curves ---------------------------------------------------------------------------

#: The mark of a layer a plan keeps in high precision.
KEPT_MARK = "◆"


def _kept(data: dict) -> dict[str, str]:
    """``layer -> "kept in bf16 by the fp8 plan"`` for every layer some plan keeps."""
    out: dict[str, str] = {}
    for plan in data.get("plans", {}).values():
        for layer in plan.get("kept", []):
            out[layer] = f"kept in {plan.get('keep_precision')} by the {plan.get('target')} plan: {plan.get('reasons', {}).get(layer, '')}"
    return out


def _gap(v: dict) -> str:
    gap = v.get("loss_gap")
    sqnr = v.get("grad_sqnr_db")
    g = f"{gap:.3g}" if isinstance(gap, float) and math.isfinite(gap) else str(gap)
    return f"loss gap {g}, gradient SQNR {_fmt(sqnr, 'dB')} dB"


#: What a plan's figures come from: mpdoctor's emulation, not low-precision kernels (``mpdoctor/attach/emulation``).
EMULATED = "emulated (the formats' rounding in fp32 on this CPU, one batch, forward and backward, no optimizer step)"
#: A gradient SQNR below this is mostly noise: said beside any verdict, bounded or not.
NOISY_GRAD_SQNR_DB = 0.0


def plan_verdict(plan: dict) -> str:
    """What a plan's check ran and found: "emulated ... : within the loss budget", never "verified" (no real
    low-precision kernel ran), and what was not bounded when it is bad (a gradient SQNR under 0 dB)."""
    runs = plan.get("runs", 0)
    bounded = [what for what, key in (("loss", "budget"), ("gradient", "min_grad_sqnr_db")) if plan.get(key) is not None]
    within = "within" if plan.get("within_budget") else "OVER"
    verdict = f"{EMULATED}, {runs} runs: " + (f"{within} the {' and '.join(bounded)} budget" if bounded else "no budget")
    sqnr = plan.get("planned", {}).get("grad_sqnr_db")
    if plan.get("min_grad_sqnr_db") is None and isinstance(sqnr, float) and sqnr < NOISY_GRAD_SQNR_DB:
        verdict += f"; its gradient SQNR is {sqnr:.1f} dB, not bounded: the gradients are more noise than signal"
    return verdict


def plan_text(plan: dict) -> str:
    """A plan in three lines: what is kept, its verified figures next to all-target and all-kept."""
    target, high = plan.get("target"), plan.get("keep_precision")
    kept, converted = plan.get("kept", []), plan.get("converted", [])
    budget = plan.get("budget")
    limit = f"budget {budget:.3g}" if isinstance(budget, float) else "no loss budget"
    if plan.get("max_kept") is not None:
        limit += f", at most {plan['max_kept']:.0%} of Linears kept"
    if plan.get("min_grad_sqnr_db") is not None:
        limit += f", gradient SQNR >= {plan['min_grad_sqnr_db']:g} dB"
    lines = [
        f"plan {plan.get('target_label', target)}: {len(kept)} of {len(kept) + len(converted)} Linears kept in {high} ({KEPT_MARK}), the rest in {target}; "
        f"{plan_verdict(plan)} ({limit})",
        f"  plan:        {_gap(plan.get('planned', {}))}",
        f"  all-{target}:{' ' * max(1, 7 - len(str(target)))}{_gap(plan.get('all_target', {}))}",
        f"  all-{high}:{' ' * max(1, 7 - len(str(high)))}{_gap(plan.get('all_kept', {}))}",
    ]
    if kept:
        lines.append(f"  kept: {', '.join(kept)}")
    return "\n".join(lines)


def curves_text(curves: dict) -> list[str]:
    """One line per precision: its loss at the first, middle and last of its steps."""
    out = []
    for name, losses in curves.items():
        if not losses:
            continue
        picks = sorted({0, len(losses) // 2, len(losses) - 1})
        shown = ", ".join(f"step {i + 1} {losses[i]:.4g}" if math.isfinite(losses[i]) else f"step {i + 1} {losses[i]}" for i in picks)
        out.append(f"loss over {len(losses)} steps, {name}: {shown}")
    return out


#: Line colours of the loss curves, one per precision in order.
_CURVE_COLOURS = ("#444", "#1b6ac9", "#c9561b", "#2e8b57", "#9b30c9", "#b3261e", "#8a6d00", "#008b8b")


def curves_svg(curves: dict, width: int = 420, height: int = 160) -> str:
    """The loss curves as an inline SVG (one polyline per precision, a legend beside)."""
    series = {k: [v for v in vs if isinstance(v, (int, float)) and math.isfinite(v)] for k, vs in curves.items()}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return ""
    lo = min(min(v) for v in series.values())
    hi = max(max(v) for v in series.values())
    span = (hi - lo) or 1.0
    steps = max(len(v) for v in series.values())
    plot_w = width - 130

    def xy(i: int, v: float) -> str:
        x = 30 + (plot_w - 40) * (i / max(steps - 1, 1))
        y = 10 + (height - 30) * (1 - (v - lo) / span)
        return f"{x:.1f},{y:.1f}"

    parts = [f"<svg width='{width}' height='{height}' role='img' aria-label='loss over steps'>"]
    # var() works in style, not in a presentation attribute: text takes its colour through style
    parts.append(f"<text x='2' y='12' font-size='10' style='fill:{FG}'>{e(f'{hi:.4g}')}</text>")
    parts.append(f"<text x='2' y='{height - 20}' font-size='10' style='fill:{FG}'>{e(f'{lo:.4g}')}</text>")
    for n, (name, values) in enumerate(series.items()):
        colour = _CURVE_COLOURS[n % len(_CURVE_COLOURS)]
        points = " ".join(xy(i, v) for i, v in enumerate(values))
        parts.append(f"<polyline fill='none' stroke='{colour}' stroke-width='1.5' points='{points}'/>")
        y = 14 + 13 * n  # a swatch of the curve's colour, the name in the theme's text colour
        parts.append(f"<line x1='{plot_w - 14}' y1='{y - 4}' x2='{plot_w - 3}' y2='{y - 4}' stroke='{colour}' stroke-width='3'/>")
        parts.append(f"<text x='{plot_w}' y='{y}' font-size='11' style='fill:{FG}'>{e(name)}</text>")
    parts.append(f"<text x='30' y='{height - 4}' font-size='10' style='fill:{FG}'>step 1 .. {steps}</text></svg>")
    return "".join(parts)


# -- html ---------------------------------------------------------------------------------------


def _colour(value: Any, unit: str, higher_better: bool, limit: float = 1.0) -> str:
    """A background colour from red (bad) to green (good); grey when unknown."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "hsl(0,0%,80%)"
    if unit == "dB":
        good = 1.0 if math.isinf(value) and value > 0 else max(0.0, min(1.0, value / GOOD_DB))
    else:
        good = 1.0 - max(0.0, min(1.0, value / max(limit * 10, 1e-9)))
    if not higher_better and unit == "dB":
        good = 1.0 - good
    return f"hsl({good * 120:.0f},65%,80%)"


def comparison_html(data: dict, metric: str = "out_sqnr_db") -> str:
    """A static HTML heatmap: layers x precisions, coloured by ``metric``, underflow marked ``▼``."""
    title, unit, higher = METRICS[metric]
    style = f"{FONT};color:{FG};background:{BG}"
    head = (
        f"<div class='mpdoctor-compare' style='{style}'>"
        f"<div style='font-weight:600;margin:4px 0'>mpdoctor.compare: {e(data.get('model', 'model'))} "
        f"<span style='font-weight:400;color:{MUTED}'>({e(data.get('dtype', '?'))} on {e(data.get('device', '?'))}, "
        f"reference {e(data.get('reference', 'fp32'))})</span></div>"
    )
    if data.get("error"):
        return head + f"<div>nothing compared: {e(data['error'])}</div></div>"
    layers, precisions, cells = _grid(data)
    limits = _limits(data)
    kept = _kept(data)
    cell = f"padding:2px 8px;border:1px solid {BORDER};text-align:right;color:#111;white-space:nowrap"
    rows = [
        "<table style='border-collapse:collapse;margin:4px 0'>",
        "<tr><th style='text-align:left;padding:2px 8px'>layer</th>"
        + "".join(f"<th style='padding:2px 8px' title='{e(data.get('summaries', {}).get(p, ''))}'>{e(data.get('labels', {}).get(p, p))}</th>" for p in precisions)
        + "</tr>",
    ]
    for layer in layers:
        tds = []
        for p in precisions:
            row = cells.get((layer, p))
            if row is None:
                tds.append(f"<td style='{cell};background:hsl(0,0%,80%)'>-</td>")
                continue
            value = row.get(metric)
            mark = _underflow_mark(row, limits.get(p, 1.0))
            tip = (
                f"{p} at {layer}: output {_fmt(row.get('out_sqnr_db'), 'dB')} dB, {_wgrad_name(row)} "
                f"{_fmt(row.get('wgrad_sqnr_db'), 'dB')} dB, activations underflowing {_fmt(row.get('act_underflow_pct'), '%')}%, "
                f"saturating {_fmt(row.get('act_saturation_pct'), '%')}%, output gradients underflowing "
                f"{_fmt(row.get('grad_underflow_pct'), '%')}%"
            )
            flagged = mark or _below_floor(row, data, p)  # what recommend(), the warning and the plan keep
            border = ";outline:2px solid #b3261e;outline-offset:-2px" if flagged else ""
            marker = f" <b>{e(mark)}</b>" if mark else ""  # the cell's dark text on its light heat colour
            bg = _colour(value, unit, higher, limits.get(p, 1.0))
            tds.append(f"<td style='{cell};background:{bg}{border}' title='{e(tip)}'>{e(_fmt(value, unit))}{marker}</td>")
        mark = f" <b title='{e(kept[layer])}'>{KEPT_MARK}</b>" if layer in kept else ""
        rows.append(f"<tr><td style='padding:2px 8px;font-family:monospace'>{e(layer)}{mark}</td>{''.join(tds)}</tr>")
    losses = data.get("losses", {})
    if losses:
        ref = data.get("reference", "fp32")
        tds = "".join(
            f"<td style='padding:2px 8px;text-align:right'>{e(_fmt(losses.get(p), 'loss') if not isinstance(losses.get(p), float) else f'{losses[p]:.4g}')}</td>"
            for p in precisions
        )
        ref_loss = losses.get(ref)
        ref_text = f"{ref_loss:.4g}" if isinstance(ref_loss, float) else "-"
        rows.append(f"<tr style='border-top:2px solid {BORDER}'><td style='padding:2px 8px'>loss (reference {e(ref)} {e(ref_text)})</td>{tds}</tr>")
    rows.append("</table>")
    rows.extend(_plans_html(data))
    legend = (
        f"<div style='color:{MUTED}'>{e(title)} ({e(unit)}) per {_sites(data)}, measured on the inputs each layer sees in that run; "
        f"colour from red (0 dB) to green ({GOOD_DB:g} dB and up); <b style='color:{ERROR_TEXT}'>▼</b> = share of nonzero inputs "
        f"or output gradients that underflow to zero, above the precision's limit."
        + (
            " Attention rows: q·kᵀ (scores) and p·v of each attention module; their weight-gradient cell is the "
            "gradient of the second operand (K, V)."
            if data.get("attention")
            else ""
        )
        + f" Emulated at: {e(data.get('reached', ''))}.</div>"
        + "".join(f"<div style='color:{MUTED}'>{e(line)}</div>" for line in legend_lines(data))
    )
    notes = "".join(f"<div>{e(p)}: the run raised {e(msg)}</div>" for p, msg in data.get("errors", {}).items())
    findings = "".join(
        f"<div style='margin-top:4px'><b>{e(f['severity'])}</b> <code>{e(f['check'])}</code>: {e(f['message'])}</div>"
        for f in data.get("findings", [])
    )
    curves = data.get("curves", {})
    chart = f"<div style='margin-top:6px'>{curves_svg(curves)}</div>" if curves else ""
    return head + "".join(rows) + chart + legend + notes + findings + "</div>"


def _plans_html(data: dict) -> list[str]:
    """Each plan: its loss gap and gradient SQNR beside all-target's and all-kept's; kept layers marked above."""
    out = []
    for plan in data.get("plans", {}).values():
        target, high = plan.get("target"), plan.get("keep_precision")
        verdict = plan_verdict(plan)
        cells = "".join(
            f"<td style='padding:2px 8px;text-align:right'>{e(label)}: {e(_gap(plan.get(key, {})))}</td>"
            for label, key in (("plan", "planned"), (f"all-{target}", "all_target"), (f"all-{high}", "all_kept"))
        )
        out.append(
            f"<table style='border-collapse:collapse;margin:4px 0'><tr><td style='padding:2px 8px'><b>{KEPT_MARK} plan {e(target)}</b>: "
            f"{len(plan.get('kept', []))} of {len(plan.get('kept', [])) + len(plan.get('converted', []))} Linears kept in {e(high)}, "
            f"{e(verdict)}</td>{cells}</tr></table>"
        )
    return out


# -- widget -------------------------------------------------------------------------------------


def comparison_widget(data: dict) -> Any:
    """An ipywidgets view: a metric selector above the heatmap (core widgets only)."""
    import ipywidgets as widgets

    options = [(f"{title} ({unit})", key) for key, (title, unit, _) in METRICS.items()]
    selector = widgets.Dropdown(options=options, value="out_sqnr_db", description="show")
    view = widgets.HTML(value=comparison_html(data, "out_sqnr_db"))

    def on_change(change: dict) -> None:
        view.value = comparison_html(data, change["new"])

    selector.observe(on_change, names="value")
    box = widgets.VBox([selector, view])
    box.add_class("mpdoctor-widget")
    return box


def show_comparison(comparison: Any) -> None:
    """Display a Comparison: the widget where a widget frontend exists (with the static heatmap for exports),
    else text and HTML. A comparison the magic already showed in this cell is not shown twice."""
    from IPython import get_ipython
    from IPython.display import display

    from .bundles import FALLBACK_STYLE, widget_frontend

    shell = get_ipython()
    count = getattr(shell, "execution_count", None)
    skip = getattr(comparison, "_skip_display_in", None)
    if skip is not None and skip == count:
        comparison._skip_display_in = None
        return
    data = comparison.to_dict()
    static = {"text/plain": comparison_text(data), "text/html": comparison_html(data)}
    if widget_frontend():
        try:
            widget = comparison_widget(data)
        except Exception:
            pass  # the static heatmap always shows
        else:
            display(widget)
            static["text/html"] = f"{FALLBACK_STYLE}<div class='mpdoctor-fallback'>{static['text/html']}</div>"
    display(static, raw=True)
