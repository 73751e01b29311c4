"""Compact text rendering, for terminals, nbconvert and ``print(report)``."""

from __future__ import annotations

import textwrap

from .data import humanize_bytes, humanize_count
from .formatting import (
    also_found_label,
    cause_layout,
    dtype_word,
    fix_kind,
    precision_word,
    singular_counts,
    summarize_evidence,
)
from .svg import scale_series
from .view import ReportView

_LABEL = {"error": "ERROR", "warning": "WARN", "info": "INFO"}


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def header(view: ReportView) -> str:
    """The verdict line."""
    c = view.counts
    parts = [
        "mpdoctor",
        _plural(c["error"], "error"),
        _plural(c["warning"], "warning"),
        f"{c['info']} info",
        view.device_label,
        f"{view.elapsed * 1000:.0f} ms",
    ]
    return " | ".join(parts)


def render_text(view: ReportView, width: int = 100) -> str:
    """Render a report's view as plain text."""
    data = view.data
    lines = [header(view), *_inspected_lines(data, width)]
    lines += departed_lines(data.get("departed") or [], width)
    lines += _findings_lines(data, view.cause_label, width)
    if data.get("proof"):
        lines += [""] + textwrap.wrap(data["proof"]["summary"], width, subsequent_indent="  ")
    lines += _histogram_lines(data["histogram"])
    lines += _precision_lines(data["precision"])
    lines += _cache_lines(data["caches"])
    lines += _scaler_lines(data["scalers"])
    lines += _scan_lines(data["scan"])
    lines += scale_history_lines(data.get("scale_history") or [])
    return "\n".join(lines)


#: How each reason a finding left reads in a sentence (the reasons are mpdoctor.diagnosis.treatment's).
LEFT_AS = {
    "fixed": "fixed",
    "superseded": "superseded by another fix",
    "changed outside": "no longer found (changed outside mpdoctor, no fix applied)",
}


def departures_sentence(departed: list[dict]) -> str:
    """One sentence per reason, saying why the findings of the last report left (empty when none did).

    The widget's status line after a fix and the "since the last report" section of a refreshed report both say it.
    """

    def listed(rows: list[dict]) -> str:
        return ", ".join(f"{d['check']} on {d['subject']}" for d in rows)

    left = [f"{label}: {listed(rows)}" for why, label in LEFT_AS.items() if (rows := [d for d in departed if d["why"] == why])]
    sentences = [f"Left the report: {'; '.join(left)}."] if left else []
    code_only = [d for d in departed if d["why"] not in LEFT_AS]
    if code_only:
        sentences.append(f"Only fixable in code, still shown with the code: {listed(code_only)}.")
    return " ".join(sentences)


def departed_lines(departed: list[dict], width: int) -> list[str]:
    """The "since the last report" section of a refreshed report: each finding that left, and why."""
    if not departed:
        return []
    lines = ["", "since the last report:"]
    for d in departed:
        lines += textwrap.wrap(f"{LEFT_AS.get(d['why'], d['why'])}: {d['check']}  {d['subject']}", width,
                               initial_indent="  ", subsequent_indent="    ")  # fmt: skip
    return lines


def _inspected_lines(data: dict, width: int) -> list[str]:
    """What was inspected (or watched), and the notes on what was given but is nothing to inspect."""
    subj = ", ".join(f"{s['name']} ({s['class']})" for s in data["subjects"])
    if subj or not data.get("watched"):
        subj = subj or "nothing (no model, optimizer, scaler, trainer or accelerator found)"
        lines = textwrap.wrap(f"inspected: {subj}", width, subsequent_indent="  ")
    else:
        lines = textwrap.wrap(f"watched: {data['watched']}", width, subsequent_indent="  ")
    for note in data["notes"]:  # what the caller gave that is nothing to inspect
        lines += textwrap.wrap(f"note: {note}", width, subsequent_indent="  ")
    return lines


def _findings_lines(data: dict, label: str | None, width: int) -> list[str]:
    """Every finding with its evidence and fixes; the cause of an exception first, under its heading."""
    findings = data["findings"]
    if not findings:
        return ["no problems found"]
    lines = [""]
    if label:  # the finding that explains an exception comes first, under this heading
        lines += textwrap.wrap(f">> {label}", width, subsequent_indent="   ")
    wrap = dict(width=width, initial_indent="        ", subsequent_indent="        ")
    shown, folded = cause_layout(findings) if label else (list(range(len(findings))), [])
    for i in [*shown, *folded]:
        f = findings[i]
        if folded and i == folded[0]:  # the cause (and its planned fix) first; the others under their own heading
            lines += ["", also_found_label(len(folded))]
        lines.append(f"{_LABEL[f['severity']]:<7} {f['check']}  {f['subject']}")
        lines += textwrap.wrap(f["message"], **wrap)
        items = summarize_evidence(f["evidence"]) if f["evidence"] else []
        if items:  # long lists summarised (the full lists are in report.to_dict())
            facts = "; ".join(f"{item.key}={item.summary}" for item in items)
            lines += textwrap.wrap(f"evidence: {facts}", **wrap)
        for fx in f["fixes"]:
            lines += _fix_lines(fx, f["fixes"], width)
    return lines


def _fix_lines(fx: dict, siblings: list[dict], width: int) -> list[str]:
    """One fix: its kind, title and state, cost, what the user's step did after it (or why it is not planned),
    and its code."""
    state = (" [applied]" if fx["applied"] else " [already in place]" if fx.get("in_place")
             else f" [failed: {fx['error']}]" if fx["error"] else "")  # fmt: skip
    lines = [f"        fix ({fix_kind(fx, siblings)}): {singular_counts(fx['title'])}{state}"]
    if fx["cost"]:
        lines.append(f"            cost: {fx['cost']}")
    indent = dict(width=width, initial_indent="            ", subsequent_indent="              ")
    if fx.get("proof") and fx["planned"]:
        lines += textwrap.wrap(fx["proof"], **indent)
    if fx.get("trial"):
        lines += textwrap.wrap(fx["trial"], **indent)
    if fx["note"] and not fx["planned"]:
        lines += textwrap.wrap(f"note: {fx['note']}", **indent)
    lines += [f"            {code_line}" for code_line in fx["code"].splitlines()]
    if fx.get("insert"):
        lines.append(f"            ({fx['insert']} puts this code in a new cell below, unrun: JupyterLab, Notebook 7)")
    return lines


def _histogram_lines(hist: list[dict]) -> list[str]:
    if not hist:
        return []
    lines = ["", "dtypes"]
    name_w = max(len(r["object"]) for r in hist)
    for r in hist:
        lines.append(
            f"  {r['object']:<{name_w}}  {r['kind']:<15} {dtype_word(r['dtype']):<6}"
            f" {r['tensors']:>4} tensor{'s' if r['tensors'] != 1 else ' '} {humanize_count(r['elements']):>6} elems"
            f" {humanize_bytes(r['bytes']):>10}"
            f"  {'trainable' if r['trainable'] else 'frozen'}{'  meta' if r['meta'] else ''}"
        )
    return lines


def _precision_lines(prec: list[dict]) -> list[str]:
    if not prec:
        return []
    lines = ["", "precision (requested -> effective)"]
    for p in prec:
        lines.append(
            f"  {p['setup']}: requested {precision_word(p['requested'])} | ACCELERATE_MIXED_PRECISION={p['ACCELERATE_MIXED_PRECISION']}"
            f" | accelerator {precision_word(p['accelerator.mixed_precision'])} (native amp {p['native_amp']})"
            f" | scaler {p['scaler']} | effective {precision_word(p['effective'])}"
        )
    return lines


def _cache_lines(caches: list[dict]) -> list[str]:
    if not caches:
        return []
    return ["", "caches"] + [f"  {c['path']} = {c['use_cache']}  ({'training' if c['training'] else 'eval'})" for c in caches]


def _scaler_lines(scalers: list[dict]) -> list[str]:
    if not scalers:
        return []
    lines = ["", "scalers"]
    for s in scalers:
        scale = f"{s['scale']:g}" + ("" if s["scale_initialized"] else " (initial, no step yet)")
        tracker = "-" if s["growth_tracker"] is None else s["growth_tracker"]
        lines.append(
            f"  {s['name']}: {'enabled' if s['enabled'] else 'disabled'} on {s['device']} | scale {scale}"
            f" | growth tracker {tracker}"
        )
    return lines


_BARS = "\u2581\u2582\u2583\u2584\u2585\u2586\u2587\u2588"
#: Characters of a sparkline: longer histories are bucketed (a bucket with a skip shows the skip).
SPARK_WIDTH = 60


def sparkline(values: list[float]) -> str:
    """``values`` as block characters between their min and max (a flat series is a flat line)."""
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = hi - lo
    return "".join(_BARS[0 if span == 0 else min(7, int((v - lo) / span * 7 + 0.5))] for v in values)


def scale_history_lines(history: list[dict]) -> list[str]:
    """Per watched GradScaler: the log2 scale and the loss as sparklines, skipped steps marked ``x``."""
    series = scale_series(history)
    if not series:
        return []
    lines = ["", "loss scale and loss over steps"]
    for name, rows in series.items():
        lines += _series_lines(name, rows)
    return lines


def _series_lines(name: str, rows: list[dict]) -> list[str]:
    """One scaler's steps, bucketed to :data:`SPARK_WIDTH` characters (a bucket with a skip shows the skip)."""
    import math

    size = max(1, math.ceil(len(rows) / SPARK_WIDTH))
    buckets = [rows[i : i + size] for i in range(0, len(rows), size)]
    scales = [math.log2(max(min(r["scale"] for r in b), 1e-30)) for b in buckets]
    marks = "".join("x" if any(r.get("skipped") for r in b) else " " for b in buckets)
    losses = [[r["loss"] for r in b if _finite_number(r.get("loss"))] for b in buckets]
    skipped = sum(1 for r in rows if r.get("skipped"))
    first, last = rows[0], rows[-1]
    lines = [
        f"  {name}: {len(rows)} steps ({first.get('step')}..{last.get('step')}), {skipped} skipped;"
        f" scale {first['scale']:g} -> {last['scale']:g}",
        f"    scale (log2) {sparkline(scales)}",
        f"    skipped      {marks.rstrip() or '(none)'}",
    ]
    if any(losses):
        loss_line = "".join(sparkline([sum(x) / len(x) for x in losses if x]))
        finite = [v for x in losses for v in x]
        lines.append(f"    loss         {loss_line}  ({finite[0]:.4g} -> {finite[-1]:.4g})")
    return lines


def _finite_number(value: object) -> bool:
    import math

    return isinstance(value, (int, float)) and math.isfinite(value)


#: Scan rows shown in text: the ones with something wrong, at most this many.
SCAN_ROWS_SHOWN = 12


def _scan_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    bad = [r for r in rows if r["nan"] or r["inf"] or r["fp16_overflow"]]
    total = sum(r["elements"] for r in rows)
    out = ["", f"value scan: {len(rows)} module rows, {humanize_count(total)} values, {len(bad)} with NaN/Inf or past fp16's 65504"]
    for r in bad[:SCAN_ROWS_SHOWN]:
        out.append(
            f"  {r['object']}.{r['module'] or '(root)'} {r['kind']}: nan {r['nan']}, inf {r['inf']},"
            f" > 65504: {r['fp16_overflow']}, abs max {r['absmax']:.4g}"
        )
    if len(bad) > SCAN_ROWS_SHOWN:
        out.append(f"  ... {len(bad) - SCAN_ROWS_SHOWN} more rows in report.scan_table")
    return out
