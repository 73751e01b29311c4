"""One coherent treatment per report: fixes planned together never undo each other.

Each broken setup of the corpus is diagnosed, and every fix of the report's plan
is applied in order (as a user looping over ``report.fixes`` would, or clicking
each button top to bottom); the setup must then train and re-diagnose without
errors. A property test builds random broken setups and checks that applying
the safe fixes never adds an error.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scenarios import FIELD_CASES, reset_accelerate, shared_diagnosis
from setups import batch, tiny_llama, train_step

import mpdoctor
from mpdoctor.rules.engine.fixes import Applicability
from mpdoctor.rules.engine.plan import score

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("scenario", FIELD_CASES, ids=lambda s: s.name)
def test_applying_every_planned_fix_in_order_leaves_a_setup_that_trains_without_errors(scenario):
    reset_accelerate()
    ns = scenario.build()
    report = mpdoctor.diagnose(namespace=ns)
    assert report.findings and report.fixes, "a broken setup draws a finding and a treatment"
    for fix in list(report.fixes):
        fix.apply(confirm=True)
    after = report.refresh()
    assert after.counts()["error"] == 0, [(f.check, f.message) for f in after.findings]
    assert score(after.findings) < score(report.findings)
    assert math.isfinite(scenario.step(ns))


@pytest.mark.parametrize("scenario", FIELD_CASES, ids=lambda s: s.name)
def test_the_plan_never_holds_two_fixes_that_set_one_thing_to_different_values(scenario):
    report = shared_diagnosis(scenario.name).report()  # read only: the plan's change specs are values
    seen: dict = {}
    for fix in report.fixes:
        for spec in fix.changes:
            for key, value in spec.targets().items():
                assert seen.setdefault(key, value) == value, f"{fix.title} sets {key} against an earlier fix"


def test_a_bf16_model_with_an_fp32_head_and_stock_adamw_gets_one_recipe_not_two_opposite_casts():
    """The demo's setup without adamw-bf16: cast the head to bf16, or everything to fp32, never both."""
    model = tiny_llama(torch.bfloat16, use_cache=False)
    model.lm_head.float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(RuntimeError, match="same dtype"):  # the real failure first
        train_step(model, opt, batch())
    opt.zero_grad(set_to_none=True)
    report = mpdoctor.diagnose(namespace={"model": model, "opt": opt})
    checks = {f.check for f in report.findings}
    assert {"mixed-param-dtypes", "pure-bf16-adamw"} <= checks
    (planned,) = [fx for fx in report.fixes if fx.changes]
    assert planned.recipe == "fp32-master-weights"
    mixed = report.findings_for("mixed-param-dtypes")[0]
    assert not mixed.fixes[0].planned and "already resolves" in mixed.fixes[0].note
    bf16_alternative = report.findings_for("pure-bf16-adamw")[0].fixes[1]
    assert bf16_alternative.applicability is Applicability.DISPLAY_ONLY and "MiB" not in bf16_alternative.cost
    for fix in report.fixes:
        fix.apply()
    assert report.refresh().ok
    assert math.isfinite(train_step(model, opt, batch()))


def test_a_stale_fix_superseded_by_an_earlier_one_does_nothing_and_says_why():
    model = tiny_llama(torch.bfloat16, use_cache=False)
    model.lm_head.float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report = mpdoctor.diagnose(namespace={"model": model, "opt": opt})
    head_cast = report.findings_for("mixed-param-dtypes")[0].fixes[0]
    report.fixes[0].apply()  # fp32 master weights: the head is fp32 like everything else now
    head_cast.apply()
    assert not head_cast.applied and "no longer needed" in head_cast.note
    assert model.lm_head.weight.dtype == torch.float32


def test_the_demo_without_adamw_bf16_ends_fixed():
    """A plain ``pip install mpdoctor[hf]`` has no adamw-bf16: the demo falls back to stock AdamW."""
    code = "import sys; sys.modules['adamw_bf16'] = None\nfrom mpdoctor.front.demo import run_demo\nsys.exit(run_demo())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert "optimizer (AdamW)" in proc.stdout  # the fallback really ran
    assert proc.returncode == 0 and "result: fixed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


# -- property: applying safe fixes never makes a setup worse -------------------------------------------------

setups = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
        "head": st.sampled_from([None, torch.float32, torch.bfloat16]),
        "optimizer": st.sampled_from(["adamw", "sgd", "adamw_bf16"]),
        "scaler": st.booleans(),
        "cache": st.booleans(),
        "stepped": st.booleans(),
        "train": st.booleans(),
    }
)


def _build(s: dict) -> dict:
    model = tiny_llama(s["dtype"], use_cache=s["cache"])
    if s["head"] is not None:
        model.lm_head.to(s["head"])
    model.train(s["train"])
    if s["optimizer"] == "adamw_bf16":
        from adamw_bf16 import AdamWBF16

        opt = AdamWBF16(model.parameters(), lr=1e-3)
    elif s["optimizer"] == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ns = {"model": model, "opt": opt}
    if s["scaler"]:
        ns["scaler"] = torch.amp.GradScaler("cpu")
    if s["stepped"]:
        try:
            train_step(model, opt, batch(), scaler=ns.get("scaler"))
        except Exception:  # a broken setup may not step: the grads it left are part of the setup
            pass
    return ns


@settings(max_examples=25, deadline=None, derandomize=bool(os.environ.get("CI")), suppress_health_check=list(HealthCheck))
@given(setups)
def test_applying_safe_fixes_never_increases_the_error_count(s):
    reset_accelerate()
    ns = _build(s)
    before = mpdoctor.diagnose(namespace=ns)
    before.apply_safe_fixes()
    after = before.refresh()
    assert after.counts()["error"] <= before.counts()["error"], (
        [(f.check, f.message) for f in before.findings],
        [(f.check, f.message) for f in after.findings],
    )


def test_apply_all_safe_fixes_disables_a_bf16_runs_scaler_even_when_the_plan_prefers_an_unsafe_cast():
    """bf16 model + stock AdamW + GradScaler: the plan casts to fp32 master weights (unsafe), which also
    resolves the scaler warning, so disabling the scaler is an alternative there; the safe plan still does it."""
    model = tiny_llama(torch.bfloat16, use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    report = mpdoctor.diagnose(namespace={"model": model, "opt": opt, "scaler": scaler})
    assert {"pure-bf16-adamw", "scaler-with-bf16"} <= {f.check for f in report.findings}
    assert [fx.recipe for fx in report.fixes if fx.changes] == ["fp32-master-weights"]  # unsafe, preferred
    disable = report.findings_for("scaler-with-bf16")[0].fixes[0]
    assert disable.safe and not disable.planned
    assert report.safe_fixes == [disable]
    assert "Apply all safe fixes applies it" in disable.note
    assert report.widget().apply_all_button.description == "Apply all safe fixes (1)"
    assert report.apply_safe_fixes() == [disable]
    assert not scaler.is_enabled()
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16  # nothing unsafe was applied
    after = report.refresh()
    assert not after.findings_for("scaler-with-bf16")
    assert not after.safe_fixes
    before = [p.detach().clone() for p in model.parameters()]
    assert math.isfinite(train_step(model, opt, batch(), scaler=scaler))
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


@settings(max_examples=25, deadline=None, derandomize=bool(os.environ.get("CI")), suppress_health_check=list(HealthCheck))
@given(setups)
def test_after_apply_safe_fixes_no_error_or_warning_still_has_a_safe_fix(s):
    reset_accelerate()
    ns = _build(s)
    before = mpdoctor.diagnose(namespace=ns)
    before.apply_safe_fixes()
    after = before.refresh()
    left = [
        (f.check, fx.title)
        for f in after.findings
        if f.severity in ("error", "warning")
        for fx in f.fixes
        if fx.safe
    ]
    assert not left, (s, left, [(f.check, f.message) for f in before.findings])


def test_the_widgets_apply_all_safe_fixes_button_applies_the_safe_plan():
    model = tiny_llama(torch.bfloat16, use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    widget = mpdoctor.diagnose(namespace={"model": model, "opt": opt, "scaler": scaler}).widget()
    assert widget.apply_all_button.description == "Apply all safe fixes (1)"
    widget.apply_all_button.click()
    assert not scaler.is_enabled() and model.lm_head.weight.dtype == torch.bfloat16
    assert widget.apply_all_button.layout.display == "none"  # nothing safe left to apply
