"""docs/field-cases.md is the corpus table the project publishes: it is generated, current, and names real checks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from mpdoctor.checks import REGISTRY, load
from mpdoctor.crash.patterns import PATTERNS
from mpdoctor.runtime.rules import RULES

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.fixture(scope="module")
def builder():
    spec = importlib.util.spec_from_file_location("build_field_cases", DOCS / "build_field_cases.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_published_table_is_regenerated_from_the_fragments(builder):
    current = (DOCS / "field-cases.md").read_text(encoding="utf-8")
    assert current == builder.build(), "docs/field-cases.md is stale: run python docs/build_field_cases.py"


def test_every_row_names_a_registered_check_or_crash_pattern(builder):
    load()
    # The GradScaler protocol's rules are findings of the runtime observer and the loop reader, not checks.
    known = set(REGISTRY) | {p.slug for p in PATTERNS} | set(RULES)
    rows = [row for name, text in builder.fragments() for row in builder.case_rows(name, text)]
    assert rows, "no case rows found in docs/field-cases/*.md"
    unknown = [(row.fragment, row.source[:60], s) for row in rows for s in row.slugs if s not in known]
    assert unknown == []
    assert all(row.slugs for row in rows), "a case row without a check slug"


def test_every_row_says_whether_it_is_fixed_in_place_or_advice_only(builder):
    rows = [row for name, text in builder.fragments() for row in builder.case_rows(name, text)]
    bad = [row.source[:60] for row in rows if not row.outcome.lower().startswith(("fixed", "advice"))]
    assert bad == []


def test_the_builder_reads_slugs_from_a_fragment_it_has_never_seen(builder):
    text = (
        "| source | symptom | check slug | fixed in place / advice only |\n|---|---|---|---|\n"
        "| [x#1](https://example.org) | NaN | `probe-nonfinite`, `scaler-scale-collapsed` | advice only |\n"
        "\n| recipe | source |\n|---|---|\n| not a case | docs |\n"
    )
    (row,) = builder.case_rows("other", text)
    assert row.slugs == ("probe-nonfinite", "scaler-scale-collapsed") and not row.fixed_in_place
