"""Small inline SVG pictures from plain data: the per-layer dtype strip and the probe's activation chart.

No plotting library: a few rects, lines and texts. Text is drawn in the
theme's font colour (JupyterLab's CSS variable, with a light-theme
fallback) on a background the SVG paints itself, so it reads in light and
dark themes and where no ``--jp-*`` variable exists. Every name in the
picture comes from a user object and goes through :func:`~mpdoctor.render.html.e`.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any, NamedTuple

from .formatting import BF16_MAX, FP16_MAX, LayerStrip, ProbeBar, dtype_word, format_number

#: Cell colours by dtype: the same hues as the dtype histogram, never used for text.
DTYPE_FILL = {"float32": "#1976d2", "bfloat16": "#8e24aa", "float16": "#f57c00", "float64": "#00897b"}
OTHER_FILL = "#9e9e9e"
TEXT = "fill:var(--jp-content-font-color1,#1f2328)"
PANEL = "fill:var(--jp-layout-color0,#fff)"
RULE = "stroke:var(--jp-content-font-color1,#1f2328)"
LIMIT_FP16 = "#c62828"
LIMIT_BF16 = "#6a1b9a"


def _e(value: Any) -> str:
    return escape(str(value), quote=True)


def _svg(width: float, height: float, body: str, label: str) -> str:
    # width="100%" with a max-width keeps it whole in a narrow window: it scales down instead of being cut.
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' role='img' aria-label='{_e(label)}' viewBox='0 0 {width:.0f} {height:.0f}' "
        f"width='100%' style='max-width:{width:.0f}px;height:auto;display:block;font-family:system-ui,sans-serif;font-size:11px'>"
        f"<rect x='0' y='0' width='{width:.0f}' height='{height:.0f}' style='{PANEL}'/>{body}</svg>"
    )


def layer_strip_svg(strip: LayerStrip) -> str:
    """Layer index (columns) x module kind (rows), each cell coloured by its parameters' dtype.

    A cell holding two dtypes is split in two; layers whose row differs from
    the most common one are marked with a triangle under their column.
    """
    cell = 12 if len(strip.layers) <= 48 else 8
    label_w = min(190, 7 * max(len(k) for k in strip.kinds) + 10)
    top = 18
    width = label_w + cell * len(strip.layers) + 10
    grid_h = cell * len(strip.kinds)
    legend_y = top + grid_h + 26
    height = legend_y + 10
    parts = [f"<text x='0' y='11' style='{TEXT}'>{_e(strip.model)}: layer</text>"]
    step = max(1, math.ceil(len(strip.layers) / 16))
    for i, layer in enumerate(strip.layers):
        if i % step == 0:
            parts.append(
                f"<text x='{label_w + i * cell + cell / 2:.1f}' y='{top - 3}' text-anchor='middle' style='{TEXT};font-size:9px'>{layer}</text>"
            )
    for row, kind in enumerate(strip.kinds):
        y = top + row * cell
        parts.append(
            f"<text x='{label_w - 6}' y='{y + cell - 2}' text-anchor='end' style='{TEXT};font-size:{min(11, cell)}px'>{_e(kind)}</text>"
        )
        for i, layer in enumerate(strip.layers):
            dtypes = strip.cells.get((layer, kind), ())
            x = label_w + i * cell
            if not dtypes:
                continue
            w = (cell - 1) / len(dtypes)
            tip = f"layer {layer} {kind}: {', '.join(dtype_word(d) for d in dtypes)}"
            for j, d in enumerate(dtypes):
                parts.append(
                    f"<rect x='{x + j * w:.1f}' y='{y}' width='{w:.1f}' height='{cell - 1}' fill='{DTYPE_FILL.get(d, OTHER_FILL)}'>"
                    f"<title>{_e(tip)}</title></rect>"
                )
    differing = set(strip.differing)
    for i, layer in enumerate(strip.layers):
        if layer in differing:
            cx = label_w + i * cell + cell / 2
            yb = top + grid_h + 2
            parts.append(
                f"<path d='M{cx:.1f} {yb} l{cell / 2 - 1:.1f} {cell - 3} h{-(cell - 2):.1f} z' style='{TEXT}'>"
                f"<title>layer {layer} differs from most layers</title></path>"
            )
    x = 0.0
    used = sorted({d for ds in strip.cells.values() for d in ds})
    for d in used:
        parts.append(f"<rect x='{x}' y='{legend_y - 9}' width='10' height='10' fill='{DTYPE_FILL.get(d, OTHER_FILL)}'/>")
        parts.append(f"<text x='{x + 14}' y='{legend_y}' style='{TEXT}'>{_e(dtype_word(d))}</text>")
        x += 24 + 7 * len(dtype_word(d))
    if differing:
        parts.append(f"<text x='{x + 6}' y='{legend_y}' style='{TEXT}'>\u25b2 differs from most layers</text>")
    return _svg(width, height, "".join(parts), f"dtype of every layer of {strip.model}")


#: The probe chart shows at most this many modules (the rest stay in ``report.probe_table``).
PROBE_CHART_ROWS = 60


class _ProbeAxes(NamedTuple):
    """Where the probe chart draws: the label column, the log10 range and the rows."""

    label_w: float
    plot_w: float
    lo: int
    hi: int
    top: int
    row: int

    def x(self, v: float) -> float:
        return self.label_w + self.plot_w * (math.log10(max(v, 10.0**self.lo)) - self.lo) / (self.hi - self.lo)


def probe_chart_svg(bars: list[ProbeBar]) -> str:
    """Per module, its largest forward output (and backward gradient) on a log scale, with fp16's and bf16's limits.

    A NaN or inf is drawn to the right edge and labelled; modules that saw
    no floating tensor are left out.
    """
    bars = [b for b in bars if b.out_absmax is not None or b.grad_absmax is not None][:PROBE_CHART_ROWS]
    if not bars:
        return ""
    seen = [v for b in bars for v in (b.out_absmax, b.grad_absmax) if v is not None and math.isfinite(v) and v > 0]
    lo = min(math.floor(math.log10(min(seen))) if seen else -3, 0)
    axes = _ProbeAxes(min(240, 6.5 * max(len(b.module) for b in bars) + 10), 420, lo, math.ceil(math.log10(BF16_MAX)), 30, 14)
    parts = [
        f"<text x='0' y='11' style='{TEXT}'>largest |value| per module (log scale): "
        f"<tspan style='font-weight:bold'>\u25a0</tspan> forward output, \u25ad gradient</text>"
    ]
    parts += _probe_limits(axes, len(bars))
    largest = max(seen or [0])
    for i, b in enumerate(bars):
        parts += _probe_row(axes, i, b, largest)
    parts += _probe_axis(axes, len(bars))
    width = axes.label_w + axes.plot_w + 70
    height = axes.top + axes.row * len(bars) + 30
    return _svg(width, height, "".join(parts), "largest activation per module")


def _probe_limits(axes: _ProbeAxes, rows: int) -> list[str]:
    """fp16's and bf16's largest finite values, as dashed vertical lines."""
    parts = []
    for value, color, name in ((FP16_MAX, LIMIT_FP16, "fp16 max 65504"), (BF16_MAX, LIMIT_BF16, "bf16 max 3.4e38")):
        x = axes.x(value)
        parts.append(
            f"<line x1='{x:.1f}' y1='{axes.top - 4}' x2='{x:.1f}' y2='{axes.top + axes.row * rows}' stroke='{color}' stroke-width='1.5' stroke-dasharray='4 2'/>"
        )
        anchor = "end" if value == BF16_MAX else "middle"
        parts.append(f"<text x='{x:.1f}' y='{axes.top - 8}' text-anchor='{anchor}' style='{TEXT};font-size:10px'>{name}</text>")
    return parts


def _probe_row(axes: _ProbeAxes, i: int, b: ProbeBar, largest: float) -> list[str]:
    """One module: its name, its output bar (filled) and gradient bar (outlined), past-fp16 values in red."""
    y = axes.top + i * axes.row
    parts = [f"<text x='{axes.label_w - 6}' y='{y + axes.row - 4}' text-anchor='end' style='{TEXT};font-size:10px'>{_e(b.module)}</text>"]
    for value, filled in ((b.out_absmax, True), (b.grad_absmax, False)):
        if value is None:
            continue
        bad = not math.isfinite(value)
        end = axes.label_w + axes.plot_w if bad else axes.x(value)
        over = bad or value > FP16_MAX
        color = LIMIT_FP16 if over else "#1976d2"
        h, yy = (6, y + 1) if filled else (4, y + 8)
        style = f"fill='{color}'" if filled else f"fill='none' stroke='{color}'"
        tip = f"{b.module} {'output' if filled else 'gradient'}: {format_number(value)}"
        parts.append(
            f"<rect x='{axes.label_w}' y='{yy}' width='{max(1.0, end - axes.label_w):.1f}' height='{h}' {style}><title>{_e(tip)}</title></rect>"
        )
        if filled and (over or i == 0 or value == largest):
            parts.append(f"<text x='{end + 3:.1f}' y='{y + axes.row - 4}' style='{TEXT};font-size:10px'>{_e(format_number(value))}</text>")
    return parts


def _probe_axis(axes: _ProbeAxes, rows: int) -> list[str]:
    """The log10 axis under the rows, labelled at 1e0, 1e5 and every tenth power from the low end."""
    axis_y = axes.top + axes.row * rows + 2
    parts = [f"<line x1='{axes.label_w}' y1='{axis_y}' x2='{axes.label_w + axes.plot_w}' y2='{axis_y}' style='{RULE}'/>"]
    for p in range(axes.lo, axes.hi + 1):
        if (p - axes.lo) % 10 and p not in (0, 5):
            continue
        parts.append(f"<text x='{axes.x(10.0**p):.1f}' y='{axis_y + 13}' text-anchor='middle' style='{TEXT};font-size:10px'>1e{p}</text>")
    return parts


#: Points drawn per series; longer histories are thinned, skipped steps always kept.
SCALE_POINTS = 400
SKIP_MARK = "var(--jp-error-color1,#d32f2f)"  # text: the theme's error red reads on both panels


def _thin(rows: list[dict]) -> list[dict]:
    if len(rows) <= SCALE_POINTS:
        return rows
    every = math.ceil(len(rows) / SCALE_POINTS)
    return [r for i, r in enumerate(rows) if i % every == 0 or r.get("skipped") or i == len(rows) - 1]


class _StepAxes(NamedTuple):
    """The two panels of a scale history: steps across, ``pw`` x ``ph`` each, the loss panel at ``loss_x``."""

    pw: int
    ph: int
    left: int
    top: int
    s0: float
    s1: float
    loss_x: int

    def x(self, step: float, origin: float) -> float:
        return origin + self.pw * (step - self.s0) / (self.s1 - self.s0)


def scale_history_svg(rows: list[dict], scaler: str = "scaler") -> str:
    """One GradScaler over its steps: the loss scale on a log2 axis with skipped steps marked, beside the loss.

    ``rows`` are ``ScaleRecord.to_dict()`` rows of one scaler (step, scale, skipped, loss), in step order.
    """
    rows = _thin([r for r in rows if isinstance(r.get("scale"), (int, float)) and r["scale"] > 0])
    if not rows:
        return ""
    pw, ph, left, top, gap = 250, 110, 44, 22, 60
    ax = _StepAxes(pw, ph, left, top, rows[0]["step"], max(rows[-1]["step"], rows[0]["step"] + 1), left + pw + gap + left)
    parts = _scale_panel(ax, rows, scaler) + _loss_panel(ax, rows)
    width, height = left + pw + gap + left + pw + 10, top + ph + 34
    return _svg(width, height, "".join(parts), f"loss scale and loss over steps of {scaler}")


def _scale_panel(ax: _StepAxes, rows: list[dict], scaler: str) -> list[str]:
    """The loss scale on a log2 axis, skipped steps marked (and counted in the title only when there are any)."""
    exps = [math.log2(r["scale"]) for r in rows]
    e_lo, e_hi = math.floor(min(exps)), math.ceil(max(exps))
    e_hi = e_hi if e_hi > e_lo else e_lo + 1

    def ys(scale: float) -> float:
        return ax.top + ax.ph * (1 - (math.log2(scale) - e_lo) / (e_hi - e_lo))

    skips = sum(1 for r in rows if r.get("skipped"))
    skip_note = (
        f"<tspan style='fill:{SKIP_MARK}'>\u2715 {skips} skipped step{'s' if skips != 1 else ''}</tspan>" if skips
        else "no skipped step"
    )
    left, top, ph, pw = ax.left, ax.top, ax.ph, ax.pw
    parts = [
        f"<text x='0' y='12' style='{TEXT}'>{_e(scaler)}: loss scale (log2 axis), {skip_note}</text>",
        f"<line x1='{left}' y1='{top + ph}' x2='{left + pw}' y2='{top + ph}' style='{RULE}'/>",
        f"<line x1='{left}' y1='{top}' x2='{left}' y2='{top + ph}' style='{RULE}'/>",
    ]
    for ex in sorted({e_lo, e_hi, (e_lo + e_hi) // 2}):
        parts.append(f"<text x='{left - 4}' y='{ys(2.0**ex) + 4:.1f}' text-anchor='end' style='{TEXT};font-size:10px'>2^{ex}</text>")
    path = " ".join(f"{'M' if i == 0 else 'L'}{ax.x(r['step'], left):.1f},{ys(r['scale']):.1f}" for i, r in enumerate(rows))
    parts.append(f"<path d='{path}' fill='none' stroke='#1976d2' stroke-width='1.5'/>")
    for r in rows:
        if r.get("skipped"):
            cx, cy = ax.x(r["step"], left), ys(r["scale"])
            parts.append(f"<text x='{cx:.1f}' y='{cy + 4:.1f}' text-anchor='middle' style='fill:{SKIP_MARK};font-size:10px'>"
                         f"\u2715<title>step {_e(r['step'])}: skipped at scale {_e(format_number(r['scale']))}</title></text>")  # fmt: skip
    return parts + _step_labels(ax, left, rows)


def _step_labels(ax: _StepAxes, origin: float, rows: list[dict]) -> list[str]:
    return [
        f"<text x='{origin}' y='{ax.top + ax.ph + 14}' style='{TEXT};font-size:10px'>step {_e(ax.s0)}</text>",
        f"<text x='{origin + ax.pw}' y='{ax.top + ax.ph + 14}' text-anchor='end' style='{TEXT};font-size:10px'>{_e(rows[-1]['step'])}</text>",
    ]


def _loss_panel(ax: _StepAxes, rows: list[dict]) -> list[str]:
    """The finite losses over the same steps, skipped steps as faint red lines."""
    losses = [(r["step"], r["loss"]) for r in rows if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])]
    lx, top, ph, pw = ax.loss_x, ax.top, ax.ph, ax.pw
    parts = [
        f"<text x='{lx - ax.left}' y='12' style='{TEXT}'>loss</text>",
        f"<line x1='{lx}' y1='{top + ph}' x2='{lx + pw}' y2='{top + ph}' style='{RULE}'/>",
        f"<line x1='{lx}' y1='{top}' x2='{lx}' y2='{top + ph}' style='{RULE}'/>",
    ]
    if not losses:
        parts.append(f"<text x='{lx + 6}' y='{top + ph / 2:.0f}' style='{TEXT};font-size:10px'>no finite loss recorded</text>")
        return parts + _step_labels(ax, lx, rows)
    l_lo, l_hi = min(v for _, v in losses), max(v for _, v in losses)
    l_hi = l_hi if l_hi > l_lo else l_lo + 1.0

    def yl(v: float) -> float:
        return top + ph * (1 - (v - l_lo) / (l_hi - l_lo))

    for v in (l_lo, l_hi):
        parts.append(f"<text x='{lx - 4}' y='{yl(v) + 4:.1f}' text-anchor='end' style='{TEXT};font-size:10px'>{_e(format_number(v))}</text>")
    path = " ".join(f"{'M' if i == 0 else 'L'}{ax.x(s, lx):.1f},{yl(v):.1f}" for i, (s, v) in enumerate(losses))
    parts.append(f"<path d='{path}' fill='none' stroke='#00897b' stroke-width='1.5'/>")
    for r in rows:
        if r.get("skipped"):
            cx = ax.x(r["step"], lx)
            parts.append(f"<line x1='{cx:.1f}' y1='{top}' x2='{cx:.1f}' y2='{top + ph}' stroke='{SKIP_MARK}' stroke-opacity='0.35'/>")
    return parts + _step_labels(ax, lx, rows)


def scale_series(history: list[dict]) -> dict[str, list[dict]]:
    """History rows grouped per scaler (its series), each in step order, labelled by the scaler's name.

    Two scalers known by one name (a notebook that rebuilt ``scaler``) are two series, never merged step by step:
    the last one is the scaler the name holds now and is labelled by the name alone; each earlier one is
    ``scaler, an earlier one (discarded; ran in cell [3])``.
    """
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in history:
        groups.setdefault((str(r.get("scaler", "scaler")), int(r.get("series", 1) or 1)), []).append(r)
    latest = {name: series for name, series in groups}  # the series first seen last, per name
    for name, series in groups:
        latest[name] = max(latest[name], series)
    return {
        (name if series == latest[name] else f"{name}, an earlier one (discarded; {_ran_in(rows)})"):
            sorted(rows, key=lambda r: r.get("step", 0))
        for (name, series), rows in groups.items()
    }  # fmt: skip


def _ran_in(rows: list[dict]) -> str:
    """``ran in cell [3]`` / ``ran in cells [2], [3]``: where a series' steps ran (said plainly when unknown)."""
    places = list(dict.fromkeys(str(r["place"]) for r in rows if r.get("place")))
    if not places:
        return "ran before the scaler the name holds now"
    if len(places) == 1:
        return f"ran in {places[0]}"
    return "ran in cells " + ", ".join(p.removeprefix("cell ") for p in places)
