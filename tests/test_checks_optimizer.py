"""Optimizer checks: dtype requirements, state/param dtype mismatches, orphaned parameters, pure-bf16 Adam."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
from adamw_bf16 import AdamWBF16
from setups import batch, tiny_llama, tiny_lora, train_step
from setups_precision import assert_same_snapshot, clean_optimizer_view, one_torch_thread, tensor_snapshot  # noqa: F401 (one_torch_thread: autouse)

import mpdoctor
from mpdoctor.rules.checks.optimizer import (
    optimizer_dtype_requirement,
    optimizer_state_dtype_mismatch,
    requirement_for,
)
from mpdoctor.rules.engine.fixes import Applicability, FixFailed


def _adamwbf16_over_fp32():
    model = tiny_llama(use_cache=False)
    opt = AdamWBF16(model.parameters(), lr=1e-3)
    model(**batch()).loss.backward()
    return model, opt


# -- optimizer-dtype-requirement --------------------------------------------------------------------------


def test_adamwbf16_with_fp32_params_is_an_error_that_the_cast_fix_resolves():
    model, opt = _adamwbf16_over_fp32()
    report = mpdoctor.diagnose(namespace={"model": model, "opt": opt})
    (finding,) = report.findings_for("optimizer-dtype-requirement")
    assert finding.severity == "error" and finding.subject == "opt"
    assert "only bfloat 16 is supported." in finding.message
    (fix,) = finding.fixes
    assert not fix.safe
    params = list(model.parameters())
    fix.apply()
    assert all(p.dtype == torch.bfloat16 and p.grad.dtype == torch.bfloat16 for p in params)
    assert list(model.parameters()) == params and clean_optimizer_view(opt) == [id(p) for p in params]
    assert not report.refresh().findings_for("optimizer-dtype-requirement")
    opt.step()  # the assertion is gone


def test_adamwbf16_cast_fix_undo_restores_bytes_dtypes_grads_and_identity():
    model, opt = _adamwbf16_over_fp32()
    before = tensor_snapshot(model, opt)
    (fix,) = mpdoctor.diagnose(model, opt).findings_for("optimizer-dtype-requirement")[0].fixes
    fix.apply()
    fix.apply()  # idempotent
    fix.undo()
    assert_same_snapshot(before, tensor_snapshot(model, opt))


def test_adamwbf16_cast_fix_is_atomic_when_an_allocation_fails(monkeypatch):
    import mpdoctor.objects.edits.steps as fixes_module

    model, opt = _adamwbf16_over_fp32()
    before = tensor_snapshot(model, opt)
    (fix,) = mpdoctor.diagnose(model, opt).findings_for("optimizer-dtype-requirement")[0].fixes
    calls = {"n": 0}
    real = fixes_module.cast_tensor

    def out_of_memory_on_the_tenth(tensor, dtype):
        calls["n"] += 1
        if calls["n"] == 10:
            raise RuntimeError("simulated out of memory")
        return real(tensor, dtype)

    monkeypatch.setattr(fixes_module, "cast_tensor", out_of_memory_on_the_tenth)
    with pytest.raises(FixFailed, match="simulated out of memory"):
        fix.apply()
    assert not fix.applied
    assert_same_snapshot(before, tensor_snapshot(model, opt))


def test_adamwbf16_fix_code_is_pasteable_and_does_what_the_fix_does():
    model, opt = _adamwbf16_over_fp32()
    twin_model, twin_opt = _adamwbf16_over_fp32()  # seeded: the same weights and grads
    (fix,) = mpdoctor.diagnose(namespace={"model": model, "opt": opt}).findings_for("optimizer-dtype-requirement")[0].fixes
    fix.apply()
    exec(fix.code, {"opt": twin_opt})
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q) and torch.equal(p.grad, q.grad)
    assert clean_optimizer_view(twin_opt) == [id(p) for p in twin_model.parameters()]


def test_bf16_weights_with_adamwbf16_is_healthy():
    model = tiny_llama(torch.bfloat16, use_cache=False)
    opt = AdamWBF16(model.parameters(), lr=1e-3)
    loss = train_step(model, opt)
    report = mpdoctor.diagnose(namespace={"model": model, "opt": opt})
    assert report.ok, report.findings
    assert loss == loss  # finite


def test_adamwbf16_accepts_fp32_gradients_on_bf16_params_so_they_are_not_flagged():
    model = tiny_llama(torch.bfloat16, use_cache=False)
    opt = AdamWBF16(model.parameters(), lr=1e-3)
    model(**batch()).loss.backward()
    for p in model.parameters():
        p.grad.data = p.grad.data.float()  # SimpleTuner's --gradient_precision=fp32
    assert not mpdoctor.diagnose(model, opt).findings_for("optimizer-dtype-requirement")
    opt.step()  # measured: runs (stochastic rounding accepts fp32 grads)


def test_frozen_fp32_params_in_adamwbf16_are_not_flagged_because_they_never_get_a_grad():
    model = tiny_llama(torch.bfloat16, use_cache=False)
    frozen = torch.nn.Parameter(torch.zeros(4), requires_grad=False)  # fp32, in the optimizer, never trained
    opt = AdamWBF16([*model.parameters(), frozen], lr=1e-3)
    assert not mpdoctor.diagnose(model, opt).findings_for("optimizer-dtype-requirement")
    train_step(model, opt)  # measured: the assertion only fires for parameters with a grad


@pytest.mark.parametrize(
    ("class_path", "name"),
    [
        ("adamw_bf16.AdamWBF16", "AdamWBF16"),
        ("helpers.training.adam_bfloat16.AdamWBF16", "AdamWBF16"),
        ("helpers.training.optimizers.adamw_bfloat16.AdamWBF16", "AdamWBF16"),
        ("optimi.adamw.AdamW", "optimi with kahan_sum=True"),
        ("bitsandbytes.optim.adamw.AdamW8bit", "bitsandbytes 8-bit optimizer"),
        ("bitsandbytes.optim.adamw.PagedAdamW8bit", "bitsandbytes 8-bit optimizer"),
        ("torch.optim.adamw.AdamW", None),
        ("bitsandbytes.optim.adamw.AdamW32bit", None),
    ],
)
def test_requirement_registry_matches_class_paths_including_simpletuners_vendored_copies(class_path, name):
    req = requirement_for(class_path)
    assert (req.name if req else None) == name


def _facts_as(model, opt, class_path: str, defaults: dict | None = None, params=None, target: str | None = None):
    """Real facts of ``(model, opt)`` with the optimizer's class path (and defaults / params) replaced.

    optimi is not installed, and bitsandbytes only in the main venv (this file also runs in the Colab venv):
    the registry logic is tested here on facts built by hand. The real ``bnb.optim.AdamW8bit`` (its real error,
    its uint8 / fp32 state) is tested in ``tests/stack/test_field_bnb_torchao.py``.
    """
    facts = mpdoctor.diagnose(namespace={"model": model, "opt": opt}, target=target).facts
    (o,) = facts.optimizers
    o = dataclasses.replace(
        o,
        class_path=class_path,
        class_name=class_path.rsplit(".", 1)[1],
        defaults={**o.defaults, **(defaults or {})},
        params=o.params if params is None else params(o.params),
    )
    return dataclasses.replace(facts, optimizers=(o,))


def test_optimi_with_kahan_sum_over_fp32_params_is_a_warning_and_only_then():
    model = tiny_llama(use_cache=False)
    opt = torch.optim.AdamW(model.parameters())
    (finding,) = optimizer_dtype_requirement(_facts_as(model, opt, "optimi.adamw.AdamW", {"kahan_sum": True}))
    assert finding.severity == "warning" and "Kahan" in finding.message
    assert finding.fixes and "torch.bfloat16" in finding.fixes[0].code
    assert not list(optimizer_dtype_requirement(_facts_as(model, opt, "optimi.adamw.AdamW", {"kahan_sum": None})))
    bf16 = tiny_llama(torch.bfloat16, use_cache=False)
    opt16 = torch.optim.AdamW(bf16.parameters())
    assert not list(optimizer_dtype_requirement(_facts_as(bf16, opt16, "optimi.adamw.AdamW", {"kahan_sum": True})))


def test_bnb_8bit_optimizer_with_grads_in_another_dtype_than_params_is_an_error_with_a_grad_cast_fix():
    model = tiny_llama(torch.bfloat16, use_cache=False)
    opt = torch.optim.AdamW(model.parameters())
    model(**batch()).loss.backward()
    for p in model.parameters():
        p.grad.data = p.grad.data.float()
    before = tensor_snapshot(model, opt)
    findings = list(optimizer_dtype_requirement(_facts_as(model, opt, "bitsandbytes.optim.adamw.AdamW8bit")))
    (finding,) = [f for f in findings if "gradients" in f.message]
    assert finding.severity == "error"
    (fix,) = finding.fixes
    # Findings are plain data: a fix acts on the objects of a live table (a report's, here).
    fix.bind(mpdoctor.diagnose(namespace={"model": model, "opt": opt}).live)
    fix.apply()
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
    fix.undo()
    assert_same_snapshot(before, tensor_snapshot(model, opt))


def test_bnb_8bit_optimizer_state_rules_from_hand_built_facts():
    model = torch.nn.Linear(128, 64)  # 8192 weights: above bitsandbytes' default min_8bit_size of 4096
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 128)).sum().backward()
    opt.step()  # fp32 exp_avg / exp_avg_sq: what a 32-bit state looks like

    # fp32 state on parameters of >= 4096 elements: 8-bit is not in effect there (info).
    facts = _facts_as(model, opt, "bitsandbytes.optim.adamw.AdamW8bit")
    (info,) = optimizer_dtype_requirement(facts)
    assert info.severity == "info" and info.evidence["params_with_32bit_state"] >= 1

    # 8-bit state (uint8, not a floating full-size tensor) everywhere: nothing to say.
    facts = _facts_as(model, opt, "bitsandbytes.optim.adamw.AdamW8bit", params=lambda ps: tuple(p._replace(state_dtypes=()) for p in ps))
    assert not list(optimizer_dtype_requirement(facts))

    # fp16 state and float64 params: the CUDA kernels have no such combination (errors, judged for a GPU).
    def odd(ps):
        return tuple(p._replace(dtype="float64", grad_dtype=None, state_dtypes=(("state1", "float16"),)) for p in ps)

    findings = list(optimizer_dtype_requirement(_facts_as(model, opt, "bitsandbytes.optim.adamw.AdamW8bit", params=odd, target="A100")))
    errors = [f for f in findings if f.severity == "error"]
    assert len(errors) == 2  # float64 params; fp16 state
    assert any("float64" in f.message for f in errors) and any("float16 state" in f.message for f in errors)
    # On this CPU the float64 parameters are no error: bitsandbytes' CPU backend steps them
    # (tests/stack/test_field_bnb_torchao.py steps a real AdamW8bit over float64 weights).
    findings = list(optimizer_dtype_requirement(_facts_as(model, opt, "bitsandbytes.optim.adamw.AdamW8bit", params=odd)))
    errors = [f for f in findings if f.severity == "error"]
    assert len(errors) == 1 and "float16 state" in errors[0].message


# -- optimizer-state-dtype-mismatch -----------------------------------------------------------------------


def _bf16_trained_then_cast_to_fp32():
    model = tiny_llama(torch.bfloat16, use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt)
    model.float()  # the parameters follow, the Adam moments stay bf16
    return model, opt


def test_bf16_adam_state_for_fp32_params_crashes_and_the_widening_state_cast_is_a_safe_fix():
    twin_model, twin_opt = copy.deepcopy(_bf16_trained_then_cast_to_fp32())
    with pytest.raises(RuntimeError, match="expected dtype"):
        train_step(twin_model, twin_opt)
    model, opt = _bf16_trained_then_cast_to_fp32()
    before = tensor_snapshot(model, opt)
    report = mpdoctor.diagnose(namespace={"model": model, "opt": opt})
    (finding,) = report.findings_for("optimizer-state-dtype-mismatch")
    assert finding.severity == "error" and ["float32", "bfloat16"] in finding.evidence["pairs"]
    (fix,) = finding.fixes
    assert fix.safe  # bf16 -> fp32 keeps every value
    fix.apply()
    assert not report.refresh().findings_for("optimizer-state-dtype-mismatch")
    fix.undo()
    assert_same_snapshot(before, tensor_snapshot(model, opt))
    report.refresh().findings_for("optimizer-state-dtype-mismatch")[0].fixes[0].apply()
    loss = train_step(model, opt)
    assert torch.isfinite(torch.tensor(loss))


def test_fp32_adam_state_for_bf16_params_is_an_error_whose_narrowing_fix_is_unsafe():
    model = tiny_llama(use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt)
    model.bfloat16()
    (finding,) = mpdoctor.diagnose(model, opt).findings_for("optimizer-state-dtype-mismatch")
    assert finding.severity == "error"
    (fix,) = finding.fixes
    assert not fix.safe
    twin = copy.deepcopy((model, opt))
    fix.apply()
    exec(fix.code, {"optimizer": twin[1]})
    for key, value in opt.state[next(model.parameters())].items():
        assert value.dtype == twin[1].state[next(twin[0].parameters())][key].dtype
    assert torch.isfinite(torch.tensor(train_step(model, opt)))


def test_wider_momentum_in_sgd_is_legitimate_and_not_reported():
    model = tiny_llama(use_cache=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    train_step(model, opt)
    model.bfloat16()  # fp32 momentum for bf16 params: SGD's update runs (measured)
    assert not mpdoctor.diagnose(model, opt).findings_for("optimizer-state-dtype-mismatch")


def test_third_party_optimizers_may_keep_wider_state_but_not_narrower():
    model = tiny_llama(torch.bfloat16, use_cache=False)
    opt = torch.optim.AdamW(model.parameters())
    train_step(model, opt)

    def with_state(dtype):
        return lambda ps: tuple(p._replace(state_dtypes=(("exp_avg", dtype),)) for p in ps)

    wide = _facts_as(model, opt, "somelib.optim.Adam", params=with_state("float32"))
    assert not list(optimizer_state_dtype_mismatch(wide))
    narrow = _facts_as(model, opt, "somelib.optim.Adam", params=with_state("float16"))
    (finding,) = optimizer_state_dtype_mismatch(narrow)
    assert finding.severity == "warning"


# -- optimizer-params-not-in-model ------------------------------------------------------------------------


def test_an_optimizer_left_on_a_recreated_model_is_an_error_and_the_live_model_never_learns():
    old = tiny_llama(use_cache=False)
    opt = torch.optim.AdamW(old.parameters(), lr=1e-2)
    model = tiny_llama(use_cache=False)  # the cell that builds the model was run again
    before = [p.detach().clone() for p in model.parameters()]
    train_step(model, opt)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # measured harm: no update
    report = mpdoctor.diagnose(namespace={"model": model, "opt": opt})
    (finding,) = report.findings_for("optimizer-params-not-in-model")
    (fix,) = finding.fixes  # nothing can be done in place: the code to run, display-only
    assert finding.severity == "error" and fix.applicability is Applicability.DISPLAY_ONLY
    assert "opt = torch.optim." in fix.code and "model.parameters()" in fix.code
    with pytest.raises(FixFailed, match="nothing can be changed in place"):
        fix.apply()
    assert "model.parameters()" in finding.evidence["suggested_code"]


def test_an_optimizer_over_a_cast_deepcopy_is_an_error():
    model = tiny_llama(use_cache=False)
    opt = torch.optim.AdamW(copy.deepcopy(model).to(torch.bfloat16).parameters())
    (finding,) = mpdoctor.diagnose(namespace={"model": model, "opt": opt}).findings_for("optimizer-params-not-in-model")
    assert finding.severity == "error"


def test_a_module_replaced_after_the_optimizer_was_built_is_an_error():
    model = tiny_llama(use_cache=False)
    opt = torch.optim.AdamW(model.parameters())
    model.lm_head = torch.nn.Linear(16, 64, bias=False)
    (finding,) = mpdoctor.diagnose(namespace={"model": model, "opt": opt}).findings_for("optimizer-params-not-in-model")
    assert finding.severity == "error" and "replaced" in finding.message


def test_an_extra_learnable_scalar_is_only_info_and_no_model_means_no_finding():
    model = tiny_llama(use_cache=False)
    temperature = torch.nn.Parameter(torch.ones(()))
    opt = torch.optim.AdamW([*model.parameters(), temperature])
    (finding,) = mpdoctor.diagnose(namespace={"model": model, "opt": opt}).findings_for("optimizer-params-not-in-model")
    assert finding.severity == "info"
    assert not mpdoctor.diagnose(namespace={"opt": opt}).findings_for("optimizer-params-not-in-model")


def test_an_optimizer_over_the_models_own_params_is_healthy():
    lora = tiny_lora(torch.bfloat16)
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-3)
    train_step(lora, opt)
    report = mpdoctor.diagnose(namespace={"model": lora, "opt": opt})
    assert not report.findings_for("optimizer-params-not-in-model")
    assert not report.findings_for("pure-bf16-adamw")  # fp32 adapters on a bf16 base: the healthy PEFT recipe


# -- pure-bf16-adamw --------------------------------------------------------------------------------------


def _pure_bf16_linear(lr: float = 1e-5):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).to(torch.bfloat16)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)


def _step_fraction_unchanged(model, opt) -> float:
    before = model.weight.detach().clone()
    opt.zero_grad()
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    model(x.to(model.weight.dtype)).float().pow(2).mean().backward()
    opt.step()
    return (model.weight.detach().to(before.dtype) == before).float().mean().item()


def test_pure_bf16_adamw_loses_most_updates_and_is_a_warning_whose_master_weight_fix_restores_them():
    twin = _pure_bf16_linear()
    assert _step_fraction_unchanged(*twin) > 0.95  # measured harm: the step rounds away
    model, opt = _pure_bf16_linear()
    before = tensor_snapshot(model, opt)
    report = mpdoctor.diagnose(namespace={"model": model, "opt": opt})
    (finding,) = report.findings_for("pure-bf16-adamw")
    assert finding.severity == "warning" and "lr=1e-05" in finding.message
    # Two recipes: fp32 master weights (planned, in place) or a bf16-safe optimizer (display-only).
    fix, alternative = finding.fixes
    assert not fix.safe and fix.planned and report.fixes == [fix]
    assert alternative.applicability is Applicability.DISPLAY_ONLY and "AdamWBF16" in alternative.code
    assert re.match(r"\+\d+\.\d [KMG]iB of weights", fix.cost) and "restarts" in alternative.cost
    fix.apply()
    assert model.weight.dtype == torch.float32
    assert not report.refresh().findings_for("pure-bf16-adamw")
    fix.undo()
    assert_same_snapshot(before, tensor_snapshot(model, opt))
    fix.apply()
    assert _step_fraction_unchanged(model, opt) < 0.05  # every weight moves with fp32 master weights


def test_fp32_weights_with_bf16_autocast_and_adamw_is_healthy():
    model = tiny_llama(use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt, autocast_dtype=torch.bfloat16)
    assert mpdoctor.diagnose(namespace={"model": model, "opt": opt}).ok
