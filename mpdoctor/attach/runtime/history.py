"""The code this kernel has run, and the script ``mpdoctor run`` is about to run, read for AMP loop mistakes.

Cells come from IPython's history (``history_manager.input_hist_parsed``, the code IPython ran after
transforming its own syntax away; ``user_ns['In']`` when there is no history manager), numbered by execution
count. A cell that does not parse is transformed again from its raw text (``shell.transform_cell``), and
skipped when it still does not parse. Nothing is executed. Works on IPython 7.34 (Colab) and 8/9.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ...objects.readers.loop_source import Source, relevant, source_of
from ...rules.engine.findings import Finding
from .loop_findings import read_sources
from .protocol_rules import RULES


def cell_sources(shell: Any) -> list[Source]:
    """The cells ``shell`` has run, in execution order, as parsed :class:`Source` s of files ``In[n]``; a run that a
    later run of the same cell (the same cell id) replaced is skipped: the user has corrected that code.

    Parameters
    ----------
    shell : IPython.core.interactiveshell.InteractiveShell
        The running shell.
    """
    from .cells import replaced_runs

    parsed, raw = _history(shell)
    replaced = replaced_runs(shell)  # a cell run again follows its latest run: its old code is not the user's now
    sources = []
    for count, code in enumerate(parsed):
        if count in replaced or not isinstance(code, str) or not relevant(code):
            continue
        label = f"In[{count}]"  # Location reads the cell number from it: "cell [n], line 3"
        source = source_of(label, code)
        if source is None and count < len(raw) and isinstance(raw[count], str):
            source = _transformed(shell, label, raw[count])
        if source is not None:
            sources.append(source)
    return sources


def _history(shell: Any) -> tuple[list, list]:
    manager = getattr(shell, "history_manager", None)
    parsed = getattr(manager, "input_hist_parsed", None)
    raw = getattr(manager, "input_hist_raw", None)
    if not isinstance(parsed, list):
        ns = getattr(shell, "user_ns", None)
        parsed = ns.get("In") if isinstance(ns, dict) else None
        parsed = parsed if isinstance(parsed, list) else []
    return parsed, raw if isinstance(raw, list) else []


def _transformed(shell: Any, label: str, raw: str) -> Source | None:
    # The parsed history already holds transformed code; this covers a history that holds raw text.
    try:
        transform = getattr(shell, "transform_cell", None)
        if transform is None:
            from IPython.core.inputtransformer2 import TransformerManager

            transform = TransformerManager().transform_cell
        return source_of(label, transform(raw))
    except Exception:  # a cell IPython itself cannot transform is skipped, like one that does not parse
        return None


def read_history(shell: Any, ignore: Iterable[str] = ()) -> list[Finding]:
    """The AMP loop mistakes in the cells ``shell`` has run (never executed).

    Parameters
    ----------
    shell : InteractiveShell
        The running shell.
    ignore : iterable of str
        Rule slugs to leave out.

    Returns
    -------
    list of Finding
        Each names its cell and line (``cell [7], line 12``) and offers the corrected lines as a display-only fix.
    """
    skip = set(ignore)
    with gc_paused():
        return [f for f in read_sources(cell_sources(shell), scales=live_scales(shell.user_ns)) if f.check not in skip]


def live_scales(namespace: Any) -> dict[str, float]:
    """The scale of every GradScaler ``namespace`` holds by name (its ``init_scale`` before a step).

    Read from the scaler's own fields through ``type``'s descriptors: no method or property of a user object
    runs, whatever its class overrides.
    """
    from ...objects.live.introspect import mro_paths, own_dict

    out: dict[str, float] = {}
    items = dict.items(namespace) if type(namespace) is dict else ()
    for name, value in items:
        if type(name) is not str or name[:1] == "_" or not any(p.endswith(".GradScaler") for p in mro_paths(value)):
            continue
        fields = own_dict(value)
        scale = fields.get("_scale")
        try:
            out[name] = float(scale.item()) if scale is not None else float(fields.get("_init_scale", 65536.0))
        except Exception:  # a scaler whose scale cannot be read keeps the default's wording
            continue
    return out


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection while reading: the parse trees are young, many and acyclic (re-enabled after)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def read_script(path: str | Path, ignore: Iterable[str] = ()) -> list[Finding]:
    """The AMP loop mistakes in a script file (never executed); findings name ``train.py:12``."""
    path = Path(path)
    try:
        code = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    source = source_of(str(path), code)
    skip = set(ignore)
    return [f for f in read_sources([source]) if f.check not in skip] if source is not None else []


def add_to_report(report: Any, findings: list[Finding], ignore: Iterable[str] = ()) -> Any:
    """A new :class:`~mpdoctor.diagnosis.report.Report`: ``report`` with the loop findings (ignored slugs counted
    in its ``hidden``)."""
    skip = set(ignore)
    hidden = dict(report.hidden)
    kept = []
    for f in findings:
        if f.check in skip:
            hidden[f.check] = hidden.get(f.check, 0) + 1
            continue
        for fx in f.fixes:
            fx.bind(report.live, report.treatment)
        kept.append(f)
    if not kept and hidden == report.hidden:
        return report
    # sorted() is stable: the diagnosis keeps its order within a severity
    return report.evolve(findings=sorted([*report.findings, *kept], key=lambda f: f.rank), hidden=hidden)


def format_findings(findings: list[Finding], label: str, script: str | None = None) -> str:
    """Plain text for a terminal: what ``mpdoctor run`` prints before running the script. With the script's
    ``script`` text, a fix that rewrites the user's own lines is shown as a unified diff of the file, flush left
    (``git apply`` or ``patch -p1`` takes it as printed); otherwise as the corrected lines."""
    if not findings:
        return ""
    counts = {s: sum(f.severity == s for f in findings) for s in ("error", "warning", "info")}
    head = ", ".join(f"{n} {s}{'s' if n != 1 and s != 'info' else ''}" for s, n in counts.items() if n)
    lines = [f"mpdoctor read {label}: {head} in the AMP loop"]
    for f in findings:
        lines.append(f"{f.severity.upper():<7} {f.check}  {f.subject}")
        lines.append(f"        {f.message}")
        for fx in f.fixes:
            lines.append(f"        fix ({fx.applicability.value}): {fx.title}")
            diff = script_diff(script, f, fx.code, label) if script is not None else ""
            if diff:  # flush left, as git apply / patch -p1 read it
                lines += diff.rstrip("\n").splitlines()
            else:
                lines += [f"            {line}" for line in fx.code.rstrip().splitlines()]
    return "\n".join(lines)


def script_diff(script: str, finding: Finding, code: str, label: str) -> str:
    """The unified diff (``a/<label>`` to ``b/<label>``) that puts ``code``, a loop's corrected lines, in place of
    the lines it replaces in ``script`` (``finding.evidence["replaces lines"]``), at their indentation; "" when
    the finding does not say which lines."""
    import difflib

    span = finding.evidence.get("replaces lines") if isinstance(finding.evidence, dict) else None
    if not isinstance(span, str) or "-" not in span:
        return ""
    lo, hi = (int(x) for x in span.split("-", 1))
    original = script.splitlines(keepends=True)
    if not 1 <= lo <= hi <= len(original):
        return ""
    window = original[lo - 1 : hi]
    indent = min((len(x) - len(x.lstrip()) for x in window if x.strip()), default=0)
    pad = window[0][: len(window[0]) - len(window[0].lstrip())][:indent] if window else ""
    new = [f"{pad}{line}\n" if line.strip() else "\n" for line in code.rstrip("\n").split("\n")]
    fixed = [*original[: lo - 1], *new, *original[hi:]]
    return "".join(difflib.unified_diff(original, fixed, f"a/{label}", f"b/{label}"))


def known_slugs() -> frozenset[str]:
    """The rule slugs the loop reader can report (``--ignore`` accepts them)."""
    return frozenset(RULES)
