"""Build ``docs/field-cases.md``, the one table of the field-case corpus, from ``docs/field-cases/*.md``.

Each fragment (one per area: ``core.md``, ``lightning-trl.md``, ...) holds one or more case tables whose
header names a ``check slug`` column, a ``fixed in place / advice only`` column and, after it, a
``verified on failing step`` column (``yes (API + widget): `case-name` `` where a test of the cure registry,
``tests/test_cures.py``, ``tests/stack/test_cures_stack.py`` or ``tests/stack/test_cures_deepspeed.py``, runs the user's failing step again after the fix
through ``fix.apply()`` and through the widget's button, and it trains; ``no: <why>`` otherwise), and optionally a
"Healthy recipes" section. This script concatenates the fragments in name order under a header with counts and
the cure rate: cases fixed in place whose failing step trains after the fix, out of cases fixed in place.

    python docs/build_field_cases.py          # rewrite docs/field-cases.md
    python docs/build_field_cases.py --check  # exit 1 when docs/field-cases.md is stale
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parent
FRAGMENTS = DOCS / "field-cases"
OUTPUT = DOCS / "field-cases.md"

_SLUG = re.compile(r"`([a-z0-9][a-z0-9-]*)`")


@dataclass(frozen=True)
class CaseRow:
    """One row of a case table: where it came from and what it says."""

    fragment: str
    source: str
    slugs: tuple[str, ...]
    outcome: str
    verified: str = ""

    @property
    def fixed_in_place(self) -> bool:
        return self.outcome.strip().lower().startswith("fixed")

    @property
    def corrected_code(self) -> bool:
        """Treated by code the user runs (the corrected lines of their own loop), which mpdoctor runs on copies of
        the user's objects before it shows it (:mod:`mpdoctor.attach.runtime.twins`), one action from a new cell."""
        return self.outcome.strip().lower().startswith("corrected code")

    @property
    def advice_only(self) -> bool:
        return not self.fixed_in_place and not self.corrected_code

    @property
    def cured(self) -> bool:
        """Fixed in place, and its failing step proven to train after the fix (API and widget)."""
        return self.fixed_in_place and self.verified.strip().lower().startswith("yes")

    @property
    def cure_names(self) -> tuple[str, ...]:
        """The cure registry's entries the ``verified`` cell names."""
        return tuple(_SLUG.findall(self.verified)) if self.verified.strip().lower().startswith("yes") else ()


def _cells(line: str) -> list[str]:
    # A pipe escaped as ``\|`` inside a cell (an error message quoting ``fp16|fp16_full_eval``) is text.
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def case_rows(name: str, text: str) -> list[CaseRow]:
    """The case rows of one fragment: rows of every table whose header has a "slug" column."""
    rows: list[CaseRow] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        header = lines[i]
        if header.lstrip().startswith("|") and i + 1 < len(lines) and set(lines[i + 1].replace("|", "").strip()) <= set("-: "):
            cols = [c.lower() for c in _cells(header)]
            slug_col = next((k for k, c in enumerate(cols) if "slug" in c), None)
            outcome_col = next((k for k, c in enumerate(cols) if "fixed" in c or "advice" in c), None)
            verified_col = next((k for k, c in enumerate(cols) if "verified" in c), None)
            i += 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                if slug_col is not None:
                    cells = _cells(lines[i])
                    slug_cell = cells[slug_col] if slug_col < len(cells) else ""
                    outcome = cells[outcome_col] if outcome_col is not None and outcome_col < len(cells) else ""
                    verified = cells[verified_col] if verified_col is not None and verified_col < len(cells) else ""
                    slugs = tuple(_SLUG.findall(slug_cell)) or tuple(s.strip() for s in slug_cell.split(",") if s.strip())
                    rows.append(CaseRow(name, cells[0], slugs, outcome, verified))
                i += 1
            continue
        i += 1
    return rows


def fragments() -> list[tuple[str, str]]:
    """``(name, text)`` of every fragment, in name order."""
    return [(p.stem, p.read_text(encoding="utf-8")) for p in sorted(FRAGMENTS.glob("*.md"))]


def build() -> str:
    """The text of ``docs/field-cases.md``."""
    parts = fragments()
    per = {name: case_rows(name, text) for name, text in parts}
    total = sum(len(r) for r in per.values())
    fixed = sum(1 for r in per.values() for row in r if row.fixed_in_place)
    corrected = sum(1 for r in per.values() for row in r if row.corrected_code)
    cured = sum(1 for r in per.values() for row in r if row.cured)
    slugs = sorted({s for r in per.values() for row in r for s in row.slugs})
    out = [
        "# Field cases: real mixed-precision failures, reproduced and treated",
        "",
        "<!-- Generated by docs/build_field_cases.py from docs/field-cases/*.md; edit the fragments, then run it. -->",
        "",
        "Every row is a failure reported on a public issue tracker, reproduced by a test on a CPU with tiny models "
        "(or stood in for, where it needs a GPU, as its test says), diagnosed by the check named in the row and "
        "treated: fixed in place by the report's fix; or by corrected code, the user's own loop with its mistake "
        "corrected, which mpdoctor runs on copies of the user's objects before it shows it (`%mpdoctor insert N` puts "
        "it in a new cell); or advice only where neither can be done.",
        "",
        f"**{total} cases** from {len(parts)} area{'' if len(parts) == 1 else 's'}: {fixed} fixed in place, "
        f"{corrected} by corrected code run on copies, {total - fixed - corrected} advice only; "
        f"{len(slugs)} distinct check slugs.",
        "",
        f"**Cure rate on the failing step: {cured} of {fixed}** cases fixed in place are proven cured: the user's "
        "own failing step (the very call that raised or did harm) is run again after the fix, applied through "
        "`fix.apply()` and through the widget's button, and it trains (the cure registry: `tests/test_cures.py`, "
        "`tests/stack/test_cures_stack.py`, `tests/stack/test_cures_deepspeed.py`; the areas added after it name "
        "the field tests that prove each cure). The column \"verified on failing step\" of each table says which, "
        "and why not for the others.",
        "",
        "| area | cases | fixed in place | corrected code | advice only | verified on failing step |",
        "|---|---|---|---|---|---|",
    ]
    for name, _ in parts:
        rows = per[name]
        n_fixed = sum(1 for row in rows if row.fixed_in_place)
        n_code = sum(1 for row in rows if row.corrected_code)
        n_cured = sum(1 for row in rows if row.cured)
        out.append(f"| {name} | {len(rows)} | {n_fixed} | {n_code} | {len(rows) - n_fixed - n_code} | {n_cured} of {n_fixed} |")
    out.append("")
    for _, text in parts:
        out.append(text.rstrip())
        out.append("")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    text = build()
    if "--check" in argv:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT} is stale: run python docs/build_field_cases.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
