"""Markdown export: a report ready to paste into a bug report."""

from __future__ import annotations

from typing import Any

from .data import humanize_bytes
from .formatting import dtype_word, plural
from .text import LEFT_AS
from .view import ReportView


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def render_markdown(view: ReportView) -> str:
    """Render a report's view as GitHub-flavoured markdown."""
    data = view.data
    c = data["summary"]
    rt = data["runtime"]
    lines = [
        "## mpdoctor report",
        "",
        f"**{plural(c['error'], 'error')}, {plural(c['warning'], 'warning')}, {c['info']} info** on device `{data['device']['label']}`",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in rt["versions"].items()),
        "",
        "Inspected: " + (", ".join(f"`{s['name']}` ({s['class']})" for s in data["subjects"]) or "nothing"),
        "",
        *[f"Note: {n}\n" for n in data["notes"]],
    ]
    if data["findings"]:
        lines += ["| severity | check | subject | message |", "|---|---|---|---|"]
        for f in data["findings"]:
            lines.append(f"| {f['severity']} | `{f['check']}` | `{_cell(f['subject'])}` | {_cell(f['message'])} |")
        lines.append("")
    else:
        lines += ["No problems found.", ""]
    departed = data.get("departed") or []
    if departed:  # a refreshed report: what left since the last one, and why
        lines += ["Since the last report:", ""]
        lines += [f"- {LEFT_AS.get(d['why'], d['why'])}: `{d['check']}` on `{_cell(d['subject'])}`" for d in departed]
        lines.append("")
    if data["histogram"]:
        lines += ["| object | kind | dtype | tensors | bytes | trainable |", "|---|---|---|---|---|---|"]
        for r in data["histogram"]:
            lines.append(
                f"| `{_cell(r['object'])}` | {r['kind']} | {dtype_word(r['dtype'])} | {r['tensors']} "
                f"| {humanize_bytes(r['bytes'])} | {r['trainable']} |"
            )
        lines.append("")
    for p in data["precision"]:
        lines.append("- precision `" + _cell(p["setup"]) + "`: " + ", ".join(f"{k}={v}" for k, v in p.items() if k != "setup"))
    env = rt["env"]
    if env:
        lines.append("- environment: " + ", ".join(f"`{k}={v}`" for k, v in env.items()))
    lines.append(f"- autocast now: {rt['autocast'] or 'off'}; tf32 matmul: {rt['matmul_tf32']}")
    return "\n".join(lines) + "\n"
