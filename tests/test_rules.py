"""One rule model: checks, runtime rules and crash families are rules of one type, in one registry, each
documented with ruff's sections; a finding takes its slug and severity from its rule."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scenarios import SCENARIOS, shared_diagnosis
from setups import tiny_llama

import mpdoctor
from mpdoctor.attach.crash.catalogue import FAMILIES
from mpdoctor.attach.runtime.protocol_rules import RULES
from mpdoctor.rules.checks import REGISTRY, load
from mpdoctor.rules.engine.findings import Severity
from mpdoctor.rules.engine.fixes import Applicability as FixesApplicability
from mpdoctor.rules.engine.rules import Applicability, Rule, RuleKind, load_rules, rule_for

ROOT = Path(__file__).resolve().parent.parent


def test_the_registry_holds_every_check_runtime_rule_and_crash_family_under_its_slug():
    rules = load_rules()
    assert {slug for slug in load()} <= set(rules)
    assert set(RULES) <= set(rules) and all(rules[slug] is rule for slug, rule in RULES.items())
    assert {f.slug for f in FAMILIES} <= set(rules) and all(rule_for(f.slug) is f.rule for f in FAMILIES)
    kinds = {kind: [r for r in rules.values() if r.kind is kind] for kind in RuleKind}
    assert len(kinds[RuleKind.CHECK]) >= 55 and len(kinds[RuleKind.RUNTIME]) >= 7
    assert len(kinds[RuleKind.CRASH_FAMILY]) == len([f for f in FAMILIES if not f.runtime_rule]) >= 25
    assert rule_for("no-such-rule") is None


@pytest.mark.parametrize("kind", list(RuleKind))
def test_every_rule_of_every_kind_has_every_section(kind):
    rules = [r for r in load_rules().values() if r.kind is kind]
    assert rules
    for rule in rules:
        assert rule.slug == rule.slug.lower() and " " not in rule.slug
        assert rule.title.strip(), rule.slug
        assert rule.severities and all(isinstance(s, Severity) for s in rule.severities), rule.slug
        assert all(isinstance(a, Applicability) for a in rule.fix_safety), rule.slug
        empty = [heading for heading, text in rule.sections().items() if not text.strip()]
        assert not empty, f"{rule.slug} lacks {empty}"


def _syntax_error(code: str) -> str:
    try:
        ast.parse(code)
    except SyntaxError as exc:
        return str(exc)
    return ""


def test_every_example_and_corrected_code_is_python():
    broken = [(r.slug, heading, _syntax_error(r.sections()[heading])) for r in load_rules().values()
              for heading in ("Example", "Use instead") if _syntax_error(r.sections()[heading])]  # fmt: skip
    assert broken == []


def test_the_example_differs_from_what_to_use_instead():
    same = [r.slug for r in load_rules().values() if r.example.strip() == r.use_instead.strip()]
    assert same == []


def test_a_finding_takes_its_slug_from_its_rule_and_only_a_severity_the_rule_declares():
    rule = REGISTRY["scaler-with-bf16"].rule
    finding = rule.finding("scaler", "an enabled scaler under bf16", {"scaler_enabled": True})
    assert finding.check == "scaler-with-bf16" and finding.severity == "error" and finding.evidence
    assert rule.finding("scaler", "wasted work", severity=Severity.WARNING).severity == "warning"
    with pytest.raises(ValueError, match="declares error or warning, not info"):
        rule.finding("scaler", "not a level this rule gives", severity="info")


def test_no_check_writes_its_slug_a_second_time():
    """Every finding of a check is built through its rule: no ``Finding(...)`` call is left in a check module."""
    built_by_hand = []
    for path in sorted((ROOT / "mpdoctor" / "checks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Finding":
                built_by_hand.append(f"{path.name}:{node.lineno}")
    assert built_by_hand == []


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_every_finding_has_a_severity_and_fixes_its_rule_declares(scenario):
    report = shared_diagnosis(scenario.name).report()  # read only: the session's one diagnosis of the scenario
    assert report.findings or scenario.healthy
    for finding in report.findings:
        rule = rule_for(finding.check)
        assert rule is not None, finding.check
        assert finding.severity in [s.value for s in rule.severities], (finding.check, finding.severity)
        for fix in finding.fixes:
            assert fix.applicability in rule.fix_safety, (finding.check, fix.title, fix.applicability)


def test_the_listed_severity_is_the_one_reports_show_first():
    """gradient-checkpointing-with-cache is info on a transformers model (it drops the cache itself): the
    listing says "info or warning", not "warning"."""
    model = tiny_llama()
    model.activation_checkpointing_enable()
    (finding,) = mpdoctor.diagnose(model).findings_for("gradient-checkpointing-with-cache")
    rule = rule_for("gradient-checkpointing-with-cache")
    assert finding.severity == rule.severity.value == "info"
    out = subprocess.run([sys.executable, "-m", "mpdoctor", "checks"], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, check=True).stdout  # fmt: skip
    line = next(x for x in out.splitlines() if x.startswith("gradient-checkpointing-with-cache "))
    assert line.split()[1:5] == ["check", "info", "or", "warning"]


def test_an_internal_error_is_one_finding_of_one_rule_from_every_place_that_fails():
    class Broken(torch.nn.Module):
        def named_modules(self, *args, **kwargs):
            raise RuntimeError("boom")

    report = mpdoctor.diagnose(namespace={"broken": Broken(), "model": tiny_llama()})
    (err,) = report.findings_for("internal-error")
    assert err.severity == "error" and "boom" in err.message and err.subject == "broken"
    assert rule_for("internal-error").kind is RuleKind.CHECK


def test_the_old_import_path_of_applicability_is_the_same_enum():
    assert FixesApplicability is Applicability


def test_a_rule_is_documented_in_ruffs_shape():
    doc = rule_for("amp-clip-before-unscale").doc_markdown()
    headings = [line for line in doc.splitlines() if line.startswith("#### ")]
    assert headings == ["#### What it does", "#### Why is this bad?", "#### Example", "#### Use instead",
                        "#### Fix safety (display-only)", "#### Severity", "#### Sources"]  # fmt: skip
    assert isinstance(rule_for("crash-matmul-dtype"), Rule)
