"""docs/field-cases.md is the corpus table the project publishes: it is generated, current, and names real checks."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from mpdoctor.attach.crash.patterns import PATTERNS
from mpdoctor.attach.runtime.protocol_rules import RULES
from mpdoctor.rules.checks import REGISTRY, load

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
    bad = [row.source[:60] for row in rows if not row.outcome.lower().startswith(("fixed", "advice", "corrected code"))]
    assert bad == []


def test_the_builder_reads_slugs_from_a_fragment_it_has_never_seen(builder):
    text = (
        "| source | symptom | check slug | fixed in place / advice only |\n|---|---|---|---|\n"
        "| [x#1](https://example.org) | NaN | `probe-nonfinite`, `scaler-scale-collapsed` | advice only |\n"
        "\n| recipe | source |\n|---|---|\n| not a case | docs |\n"
    )
    (row,) = builder.case_rows("other", text)
    assert row.slugs == ("probe-nonfinite", "scaler-scale-collapsed") and not row.fixed_in_place


TESTS = Path(__file__).resolve().parent
REGISTRIES = (TESTS / "test_cures.py", TESTS / "stack" / "test_cures_stack.py", TESTS / "stack" / "test_cures_deepspeed.py")

# The fragments this column was added to; fragments of other areas may come without it.
VERIFIED_FRAGMENTS = (
    "core", "deepspeed", "diffusers-bnb-torchao", "exceptions", "lightning-trl", "low-precision",
    "runtime-batch-nan", "runtime-loop", "runtime-protocol",
)  # fmt: skip


def registered_cures() -> dict[str, str]:
    """``name -> source`` of every ``Case(...)`` in the cure registries, read from their source (the stack one
    imports libraries this venv may lack)."""
    import ast

    out: dict[str, str] = {}
    for path in REGISTRIES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        registry = [n.value for n in tree.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "CASES"]
        assert len(registry) == 1, f"{path.name}: no single `CASES: list[Case] = [...]`"
        for node in ast.walk(registry[0]):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Case":
                kw = {k.arg: k.value.value for k in node.keywords if isinstance(k.value, ast.Constant)}
                out[kw["name"]] = kw["source"]
    return out


def test_every_row_of_the_corpus_fragments_says_whether_its_failing_step_was_verified(builder):
    rows = [row for name, text in builder.fragments() if name in VERIFIED_FRAGMENTS for row in builder.case_rows(name, text)]
    assert rows
    bad = [(row.fragment, row.source[:50], row.verified) for row in rows if not row.verified.lower().startswith(("yes", "no: "))
           and not row.corrected_code]  # fmt: skip
    assert bad == []
    advice = [row for row in rows if row.advice_only]
    assert all(row.verified == "no: advice only" for row in advice), "an advice-only row cannot be verified as cured"


def test_a_row_verified_on_its_failing_step_names_a_case_of_the_cure_registry_from_the_same_source(builder):
    cures = registered_cures()
    assert len(cures) >= 15
    rows = [row for name, text in builder.fragments() if name in VERIFIED_FRAGMENTS for row in builder.case_rows(name, text)]
    yes = [row for row in rows if row.verified.lower().startswith("yes")]
    assert yes and all(row.fixed_in_place for row in yes)
    for row in yes:
        assert row.verified.startswith("yes (API + widget)"), row.verified
        (name,) = row.cure_names
        assert name in cures, f"{row.source[:50]}: no cure registered as {name!r}"
        assert cures[name] in row.source, f"{name} is registered for {cures[name]!r}, not this row"
    named = [n for row in yes for n in row.cure_names]
    assert sorted(named) == sorted(set(named)), "two rows name the same cure"
    # A GPU-only refusal cannot fail on this CPU: its row stays "no" and names its registered cure (API + widget).
    stand_ins = {n for row in rows if not row.cured and "API + widget" in row.verified for n in re.findall(r"`([a-z0-9-]+)`", row.verified)}
    assert stand_ins <= set(cures), f"a 'no' row names an unregistered cure: {stand_ins - set(cures)}"
    assert set(named) | stand_ins == set(cures), f"registered cures no row names: {set(cures) - set(named) - stand_ins}"


def test_the_header_gives_the_cure_rate_of_the_cases_fixed_in_place(builder):
    rows = [row for name, text in builder.fragments() for row in builder.case_rows(name, text)]
    fixed = sum(row.fixed_in_place for row in rows)
    cured = sum(row.cured for row in rows)
    assert 0 < cured <= fixed
    assert f"**Cure rate on the failing step: {cured} of {fixed}**" in builder.build()


def test_the_builder_reads_the_verified_column_after_the_outcome(builder):
    text = (
        "| source | symptom | check slug | fixed in place / advice only | verified on failing step |\n|---|---|---|---|---|\n"
        "| [x#1](https://example.org) | NaN | `probe-nonfinite` | fixed in place | yes (API + widget): `some-cure` |\n"
        "| [x#2](https://example.org) | NaN | `probe-nonfinite` | fixed in place | no: GPU-only |\n"
    )
    cured, not_cured = builder.case_rows("other", text)
    assert cured.cured and cured.cure_names == ("some-cure",)
    assert not not_cured.cured and not_cured.cure_names == () and not_cured.fixed_in_place


def test_a_row_of_a_newer_area_verified_on_its_failing_step_names_the_tests_that_prove_it(builder):
    """Areas added after the cure registry (between steps, whole chain) prove their cures in their own field tests:
    a "yes" names them, each a test that exists, and an advice-only row says so."""
    import re

    defined = {m for path in TESTS.rglob("test_*.py") for m in re.findall(r"^def (test_\w+)", path.read_text(encoding="utf-8"), re.M)}
    rows = [row for name, text in builder.fragments() if name not in VERIFIED_FRAGMENTS for row in builder.case_rows(name, text)]
    assert rows
    for row in rows:
        if row.advice_only:
            assert row.verified.startswith("no: advice only"), (row.source[:50], row.verified)
            continue
        if row.corrected_code:
            continue  # test_a_corrected_code_row_names_tests_that_run_it_on_copies_then_for_real
        if row.verified.lower().startswith("yes"):
            assert row.verified.startswith(("yes (API + widget)", "yes (widget)", "yes (API)")), row.verified
            named = re.findall(r"`(test_\w+)`", row.verified)
            assert named and set(named) <= defined, (row.source[:50], set(named) - defined)
        else:
            assert row.verified.startswith("no: "), (row.source[:50], row.verified)


def test_a_corrected_code_row_names_tests_that_run_it_on_copies_then_for_real(builder):
    """A row treated by corrected code says "on copies, then for real" and names field tests that exist, each of
    which runs the code on copies the way ``%mpdoctor`` does before showing it (``try_on_twins``, directly or through
    a helper of its file) and then runs it for real."""
    import re

    sources = {path: path.read_text(encoding="utf-8") for path in TESTS.rglob("test_*.py")}
    rows = [row for name, text in builder.fragments() for row in builder.case_rows(name, text) if row.corrected_code]
    assert rows
    for row in rows:
        assert row.verified.startswith("on copies, then for real: "), (row.source[:50], row.verified)
        named = re.findall(r"`(test_\w+)`", row.verified)
        assert named, row.verified
        for test in named:
            (source,) = [src for src in sources.values() if re.search(rf"^def {test}\(", src, re.M)]
            body = source[re.search(rf"^def {test}\(", source, re.M).start():]
            body = body[: (m.start() if (m := re.search(r"^def ", body[4:], re.M)) else len(body))]
            assert "try_on_twins" in source and re.search(r"try_on_twins|trains_on_copies", body), test
