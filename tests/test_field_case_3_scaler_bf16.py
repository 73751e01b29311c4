"""Field case 3: a GradScaler enabled over a bf16 backbone (H2O LLM Studio #628, PR #673).

On CUDA builds whose unscale kernel lacks bf16 the first ``scaler.step`` raises
``"_amp_foreach_non_finite_check_and_unscale_cuda" not implemented for 'BFloat16'``.
On this CPU torch's kernel accepts bf16: the probe proves it, so the scaler is
wasted work (a warning) here and an error on a T4.
"""

from __future__ import annotations

import pytest
import torch
from setups import batch, tiny_llama, train_step
from setups_dtypes import finite

import mpdoctor


def scaler_findings(report):
    return report.findings_for("scaler-with-bf16")


def test_the_cpu_unscale_kernel_accepts_bf16_as_the_real_probe_shows():
    grad = torch.full((1,), 4.0, dtype=torch.bfloat16)
    found_inf, inv_scale = torch.zeros(1), torch.full((1,), 0.25)
    torch._amp_foreach_non_finite_check_and_unscale_([grad], found_inf, inv_scale)
    assert grad.item() == 1.0 and found_inf.item() == 0.0
    assert "bfloat16" in mpdoctor.diagnose().facts.hardware.unscale_dtypes


def test_a_scaler_over_a_bf16_backbone_trains_here_but_scales_and_unscales_for_nothing():
    model = tiny_llama(torch.bfloat16, use_cache=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    assert finite(train_step(model, opt, scaler=scaler))
    assert scaler.get_scale() == 65536.0  # every grad was multiplied by 2**16 and divided back

    (finding,) = scaler_findings(mpdoctor.diagnose(model, opt, scaler))
    assert finding.severity == "warning"
    assert finding.evidence["unscale_kernel_bf16"] is True
    assert finding.evidence["trainable_bf16_elements"] == sum(p.numel() for p in model.parameters())
    assert "bf16 needs no loss scaling" in finding.message


def test_on_a_t4_the_same_scaler_is_an_error():
    model = tiny_llama(torch.bfloat16, use_cache=False)
    (finding,) = scaler_findings(mpdoctor.diagnose(model, torch.amp.GradScaler("cpu"), target="T4"))
    assert finding.severity == "error" and "will crash" in finding.message


def test_bf16_autocast_over_fp32_weights_with_a_scaler_is_only_wasted_work_even_on_a_t4():
    from accelerate import Accelerator

    acc = Accelerator(mixed_precision="bf16", cpu=True)
    acc.scaler = torch.amp.GradScaler("cpu")  # H2O created one unconditionally
    (finding,) = scaler_findings(mpdoctor.diagnose(tiny_llama(use_cache=False), acc, target="T4"))
    assert finding.severity == "warning" and finding.evidence["bf16_setups"] == ["accelerator"]


@pytest.fixture
def accelerated_bf16_run_with_a_scaler():
    """A bf16 model prepared by an Accelerator that holds a GradScaler; its AcceleratedOptimizer shares it."""
    from accelerate import Accelerator

    acc = Accelerator(mixed_precision="bf16", cpu=True)
    acc.scaler = torch.amp.GradScaler("cpu")
    model = tiny_llama(torch.bfloat16, use_cache=False)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    assert opt.scaler is acc.scaler
    return acc, model, opt


def accelerated_step(acc, model, opt) -> float:
    opt.zero_grad()
    loss = model(**batch()).loss
    acc.backward(loss)
    opt.step()
    return loss.item()


def test_the_fix_disables_the_one_scaler_an_accelerator_and_its_optimizer_share(accelerated_bf16_run_with_a_scaler):
    acc, model, opt = accelerated_bf16_run_with_a_scaler
    scaler = acc.scaler
    report = mpdoctor.diagnose(namespace={"acc": acc, "opt": opt, "model": model})
    (finding,) = scaler_findings(report)
    assert finding.subject == "acc.scaler"
    assert report.facts.scalers[0].owners == ("acc", "opt")
    (fix,) = finding.fixes
    assert fix.safe and "acc.scaler._enabled = False" in fix.code

    applied = report.apply_safe_fixes()
    assert fix in applied
    assert acc.scaler is scaler and opt.scaler is scaler and not scaler.is_enabled()  # mutated, not rebound
    assert not scaler_findings(report.refresh())
    fix.apply()  # idempotent
    assert not scaler.is_enabled()

    params_before = [p.detach().clone() for p in model.parameters()]
    assert finite(accelerated_step(acc, model, opt))
    assert any(not torch.equal(a, b) for a, b in zip(params_before, model.parameters()))  # the step happened

    fix.undo()
    assert scaler.is_enabled() and scaler.__dict__["_enabled"] is True
