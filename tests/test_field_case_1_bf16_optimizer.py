"""Field case 1 (SimpleTuner #755): a bf16-only optimizer fed fp32 parameters.

``AdamWBF16`` asserts ``p.dtype == torch.bfloat16`` when it initialises the state of a parameter with a
grad, so the first ``step()`` raises ``AssertionError: only bfloat 16 is supported.``. mpdoctor names the
problem before the step, and its fix casts the parameters in place so that the same optimizer, holding the
same Parameter objects as the model, trains.
"""

from __future__ import annotations

import pytest
import torch
from adamw_bf16 import AdamWBF16
from setups import batch, tiny_llama, tiny_lora, train_step
from setups_precision import clean_optimizer_view, one_torch_thread  # noqa: F401 (one_torch_thread: autouse)

import mpdoctor


def _llama_under_adamwbf16():
    model = tiny_llama(use_cache=False)  # fp32, seeded: every call builds the same weights
    opt = AdamWBF16(model.parameters(), lr=1e-3)
    model(**batch()).loss.backward()
    return model, opt


def _lora_under_adamwbf16():
    model = tiny_lora(torch.bfloat16)  # PEFT keeps the adapters fp32 on the bf16 base
    opt = AdamWBF16([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model(**batch()).loss.backward()
    return model, opt


def _fix_and_train(model, opt) -> None:
    report = mpdoctor.diagnose(namespace={"model": model, "opt": opt})
    (finding,) = report.findings_for("optimizer-dtype-requirement")
    assert finding.severity == "error" and finding.subject == "opt"
    assert "only bfloat 16 is supported." in finding.message
    trainable = [p for p in model.parameters() if p.requires_grad]
    held = clean_optimizer_view(opt)
    (fix,) = finding.fixes
    fix.apply(confirm=False)
    assert not report.refresh().findings_for("optimizer-dtype-requirement")
    opt.step()  # the step that crashed before the fix
    losses = [train_step(model, opt) for _ in range(2)]
    assert all(torch.isfinite(torch.tensor(loss)) for loss in losses)
    # The optimizer still holds the very Parameter objects the model trains.
    assert clean_optimizer_view(opt) == held == [id(p) for p in trainable]
    assert all(p.dtype == torch.bfloat16 for p in trainable)


@pytest.mark.parametrize("build", [_llama_under_adamwbf16, _lora_under_adamwbf16], ids=["llama", "lora-fp32-adapters"])
def test_adamwbf16_over_fp32_params_asserts_and_the_cast_fix_lets_the_same_optimizer_train(build):
    _, fresh_opt = build()  # the model is the optimizer's: only its step is called
    with pytest.raises(AssertionError, match="only bfloat 16 is supported."):
        fresh_opt.step()
    _fix_and_train(*build())


def test_diagnosing_after_the_crash_fixes_the_objects_that_crashed():
    model, opt = _llama_under_adamwbf16()
    with pytest.raises(AssertionError, match="only bfloat 16 is supported."):
        opt.step()
    _fix_and_train(model, opt)


def test_bf16_weights_with_adamwbf16_is_the_healthy_recipe():
    model = tiny_lora(torch.bfloat16).to(torch.bfloat16)  # bf16 adapters on the bf16 base
    model.config.use_cache = False  # a training run (cache-in-training would rightly warn otherwise)
    opt = AdamWBF16([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    assert torch.isfinite(torch.tensor(train_step(model, opt)))
    report = mpdoctor.diagnose(namespace={"model": model, "opt": opt})
    assert report.ok, [f.message for f in report.findings if f.severity != "info"]
