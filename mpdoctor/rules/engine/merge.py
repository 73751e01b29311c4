"""One mistake, one finding: merge what several observers saw of the same mistake.

The loop watcher (as the loop ran), the cell reader (the cells' source), the crash hook (the exception) and the
diagnosis can each see one mistake of the user's loop. A report shows it once: findings of one rule at one line of
user code are one finding, which keeps the first one's message and fixes and gathers the others' evidence.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from .findings import Finding

#: A line of user code as the observers write it: ``cell [5], line 3``, ``In [5] line 3``, ``train.py:42``,
#: ``train.py, line 42``.
_CELL = re.compile(r"(?:cell \[?|In \[)(\d+)\]?,? line (\d+)")
_FILE = re.compile(r"([\w.\-/]+\.py)(?::|, line )(\d+)")

#: Evidence keys that hold where a finding's mistake is.
_WHERE_KEYS = ("where", "loop line", "line")


def location_key(finding: Finding) -> tuple[str, int] | None:
    """``("cell 5", 3)`` / ``("train.py", 42)`` for a finding about a line of user code, else None."""
    evidence = finding.evidence if isinstance(finding.evidence, dict) else {}
    texts = [str(evidence[k]) for k in _WHERE_KEYS if evidence.get(k)] + [finding.subject]
    for text in texts:
        m = _CELL.search(text)
        if m:
            return f"cell {m.group(1)}", int(m.group(2))
        m = _FILE.search(text)
        if m:
            return m.group(1).rsplit("/", 1)[-1], int(m.group(2))
    return None


def line_code(finding: Finding) -> str | None:
    """The source of the line a finding is about (``scaler.unscale_(opt)``), when its evidence says it."""
    evidence = finding.evidence if isinstance(finding.evidence, dict) else {}
    code = evidence.get("code")
    if not code and isinstance(evidence.get("loop line"), str) and ": " in evidence["loop line"]:
        code = evidence["loop line"].split(": ", 1)[1]
    return " ".join(str(code).split()) if code else None


def mistake_key(finding: Finding) -> tuple | None:
    """What makes two findings one mistake: the rule, and the line of user code.

    The line is known by its source when the evidence holds it, so a cell run again (``cell [3]`` after
    ``cell [2]``) or read below a cell magic (``%%time`` shifts the watcher's line numbers by one) is the same
    mistake; in notebooks by the source alone, in a script by the file and the source.
    """
    loc = location_key(finding)
    if loc is None:
        return None
    code = line_code(finding)
    if code is None:
        return (finding.check, loc)
    place = "cell" if loc[0].startswith("cell ") else loc[0]
    return (finding.check, place, code)


def merged(findings: Iterable[Finding]) -> list[Finding]:
    """``findings`` with every finding of a mistake already held (:func:`mistake_key`) folded into the first one.

    The kept finding (order kept) gathers the evidence keys it lacks and the fixes whose code it does not already
    offer. Findings that are not about a line of user code are kept as they are.
    """
    out: list[Finding] = []
    index: dict[tuple, int] = {}
    for f in findings:
        key = mistake_key(f)
        if key is None or key not in index:
            if key is not None:
                index[key] = len(out)
            out.append(f)
            continue
        first = out[index[key]]
        evidence = dict(first.evidence) if isinstance(first.evidence, dict) else {}
        if isinstance(f.evidence, dict):
            for k, v in f.evidence.items():
                evidence.setdefault(k, v)
        codes = {fx.code for fx in first.fixes}
        fixes = [*first.fixes, *(fx for fx in f.fixes if fx.code not in codes)]
        worst = min((first, f), key=lambda x: x.rank)
        out[index[key]] = dataclasses.replace(first, severity=worst.severity, evidence=evidence, fixes=fixes)
    return out
