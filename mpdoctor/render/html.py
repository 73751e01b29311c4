"""Static HTML rendering: the same content as the widget, without buttons.

Every string that may come from a user object is passed through
``html.escape``; the structure is built here, never from user text.
"""

from __future__ import annotations

from html import escape
from typing import Any

from ..facts.tensors import SHORT_DTYPE
from .data import cache_view, humanize_bytes, humanize_count, precision_view, report_dict, scaler_view
from .text import header

COLORS = {"error": "#c62828", "warning": "#ef6c00", "info": "#1565c0"}
DTYPE_COLORS = {"float32": "#1976d2", "bfloat16": "#8e24aa", "float16": "#f57c00", "float64": "#00897b"}


def e(value: Any) -> str:
    """Escape anything for HTML text and attributes."""
    return escape(str(value), quote=True)


def _table(rows: list[dict], columns: list[str]) -> str:
    head = "".join(f"<th style='text-align:left;padding:2px 8px'>{e(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td style='padding:2px 8px'>{e(r.get(c, ''))}</td>" for c in columns) + "</tr>" for r in rows
    )
    return f"<table style='border-collapse:collapse;font-size:12px'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def histogram_html(hist: list[dict]) -> str:
    """Horizontal bars of bytes per object x kind x dtype, with counts written out."""
    if not hist:
        return "<p>No tensors.</p>"
    biggest = max(r["bytes"] for r in hist) or 1
    rows = []
    for r in hist:
        pct = max(1.0, 100.0 * r["bytes"] / biggest) if r["bytes"] else 0.0
        color = DTYPE_COLORS.get(r["dtype"], "#757575")
        label = (
            f"{e(r['object'])} &middot; {e(r['kind'])} &middot; <b>{e(SHORT_DTYPE.get(r['dtype'], r['dtype']))}</b>"
            f" &middot; {'trainable' if r['trainable'] else 'frozen'}"
        )
        figures = f"{r['tensors']} tensors, {humanize_count(r['elements'])} elems, {humanize_bytes(r['bytes'])}"
        rows.append(
            "<div style='display:flex;align-items:center;gap:8px;font-size:12px;margin:1px 0'>"
            f"<div style='width:320px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap'>{label}</div>"
            f"<div style='width:240px;background:#eee'><div style='width:{pct:.1f}%;background:{color};height:12px'></div></div>"
            f"<div>{e(figures)}</div></div>"
        )
    return "".join(rows)


def finding_html(f: dict, buttons: bool = False) -> str:
    """One finding as HTML (no buttons: the widget adds its own)."""
    color = COLORS[f["severity"]]
    fixes = "".join(
        f"<li>{'safe' if fx['safe'] else '<b>unsafe</b>'} fix: {e(fx['title'])}"
        f"{' (applied)' if fx['applied'] else ''}<pre style='margin:2px 0;font-size:11px'>{e(fx['code'])}</pre></li>"
        for fx in f["fixes"]
    )
    evidence = ", ".join(f"{e(k)}={e(v)}" for k, v in f["evidence"].items())
    return (
        f"<div style='border-left:4px solid {color};padding:4px 8px;margin:4px 0'>"
        f"<div><b style='color:{color}'>{e(f['severity'].upper())}</b> <code>{e(f['check'])}</code> "
        f"<code>{e(f['subject'])}</code></div><div>{e(f['message'])}</div>"
        f"<details><summary>why</summary><div style='font-size:12px'>{e(f.get('why', ''))}</div>"
        f"<div style='font-size:11px;color:#555'>evidence: {evidence}</div></details>"
        f"{'<ul style=margin:2px>' + fixes + '</ul>' if fixes else ''}</div>"
    )


def render_html(report: Any) -> str:
    """Render a report as a self-contained HTML fragment."""
    data = report_dict(report)
    c = data["summary"]
    verdict_color = COLORS["error"] if c["error"] else COLORS["warning"] if c["warning"] else "#2e7d32"
    parts = [
        "<div class='mpdoctor-report' style='font-family:sans-serif;font-size:13px'>",
        f"<div style='font-weight:bold;color:{verdict_color}'>{e(header(report))}</div>",
        "<div>inspected: "
        + (", ".join(f"<code>{e(s['name'])}</code> ({e(s['class'])})" for s in data["subjects"]) or "nothing")
        + "</div>",
    ]
    parts += [finding_html(f) for f in data["findings"]] or ["<p>No problems found.</p>"]
    parts.append("<h4 style='margin:8px 0 2px'>dtypes</h4>" + histogram_html(data["histogram"]))
    prec = precision_view(report)
    if prec:
        parts.append("<h4 style='margin:8px 0 2px'>precision: requested vs effective</h4>" + _table(prec, list(prec[0])))
    caches = cache_view(report)
    if caches:
        parts.append("<h4 style='margin:8px 0 2px'>caches</h4>" + _table(caches, list(caches[0])))
    scalers = scaler_view(report)
    if scalers:
        parts.append("<h4 style='margin:8px 0 2px'>scalers</h4>" + _table(scalers, list(scalers[0])))
    parts.append("</div>")
    return "".join(parts)
