"""Field cases from the torch trackers: optimizer arithmetic and loss scaling in half precision.

Each case reproduces the reported failure on this CPU first (the real error, or the measured harm), then
asserts the diagnosis names the root cause, applies the treatment through the report, and trains a step.
"""

from __future__ import annotations

import pytest
import torch
from setups import batch, tiny_llama, train_step
from setups_dtypes import finite
from steps import trained_step

import mpdoctor


def nan_rows(model) -> int:
    """Embedding rows holding a NaN."""
    return int(torch.isnan(model.model.embed_tokens.weight).any(dim=1).sum())


def fp16_llama_and_adamw(seed: int = 0):
    model = tiny_llama(torch.float16, use_cache=False, seed=seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_adam_eps_1e8_rounds_to_zero_in_fp16_and_writes_nan_into_unused_embedding_rows():
    """pytorch/pytorch#8860, afiaka87/glide-finetune#5 (PR #6: "the adam optimizer breaks in float16").

    https://github.com/pytorch/pytorch/issues/8860 -- https://github.com/afiaka87/glide-finetune/issues/5
    """
    model, opt = fp16_llama_and_adamw()
    assert finite(trained_step(model, opt))  # the loss of this step is fine ...
    assert nan_rows(model) > 0  # ... but every embedding row the batch did not use is now NaN (0/0)
    assert not finite(train_step(model, opt))  # and the next forward is NaN

    model, opt = fp16_llama_and_adamw()
    report = mpdoctor.diagnose(model, opt)
    (finding,) = report.findings_for("adam-eps-underflow")
    assert finding.severity == "error" and finding.evidence["eps"] == 1e-8 and "0/0 = NaN" in finding.message
    planned = [f for f in report.fixes if f.slug == "adam-eps-underflow"]
    assert [f.recipe for f in planned] == ["fp32-master-weights"]

    planned[0].apply()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(2):
        assert finite(trained_step(model, opt, scaler=scaler, autocast_dtype=torch.float16))
    assert nan_rows(model) == 0
    assert not mpdoctor.diagnose(model, opt).findings_for("adam-eps-underflow")


def test_raising_eps_is_the_alternative_that_keeps_fp16_weights_and_undo_restores_it():
    """Same reports: PR #6 of glide-finetune set ``eps=1e-4``; here that alternative is applied as data."""
    model, opt = fp16_llama_and_adamw()
    (finding,) = mpdoctor.diagnose(model, opt).findings_for("adam-eps-underflow")
    raise_eps = next(f for f in finding.fixes if f.recipe == "raise-eps")
    assert not raise_eps.planned and raise_eps.note  # an alternative, with the reason it was not planned
    raise_eps.apply()
    assert [g["eps"] for g in opt.param_groups] == [1e-4] and opt.defaults["eps"] == 1e-4
    for _ in range(2):
        assert finite(trained_step(model, opt))
    assert nan_rows(model) == 0 and model.model.embed_tokens.weight.dtype == torch.float16
    raise_eps.undo()
    assert opt.param_groups[0]["eps"] == 1e-8 and opt.defaults["eps"] == 1e-8


def test_fused_adam_computes_in_fp32_and_is_not_flagged():
    model = tiny_llama(torch.float16, use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    assert not mpdoctor.diagnose(model, opt).findings_for("adam-eps-underflow")


def test_casting_the_model_to_half_after_the_optimizer_stepped_breaks_the_next_step():
    """NVIDIA/apex#32 (mcarilli: "convert your network to half before you construct the optimizer ... [its]
    state buffers [become] inconsistent"); Lightning-AI/pytorch-lightning#16303 shows the same error class.

    https://github.com/NVIDIA/apex/issues/32
    """
    model = tiny_llama(use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt)
    model.half()
    with pytest.raises(RuntimeError, match="expected dtype float .* but got dtype c10::Half"):
        train_step(model, opt)

    report = mpdoctor.diagnose(model, opt)
    (state,) = report.findings_for("optimizer-state-dtype-mismatch")
    assert state.severity == "error" and "float32 state for float16 params" in state.message
    # Casting the state down to fp16 would hand it to an fp16 Adam whose eps is 0: the plan keeps fp32 master
    # weights instead, which cures both findings at once.
    assert report.findings_for("adam-eps-underflow")
    assert [f.recipe for f in report.fixes if f.slug in ("optimizer-state-dtype-mismatch", "adam-eps-underflow")] == [
        "fp32-master-weights"
    ]
    for fix in report.fixes:  # the plan, in order
        fix.apply()
    assert finite(trained_step(model, opt, scaler=torch.amp.GradScaler("cpu"), autocast_dtype=torch.float16))
    assert nan_rows(model) == 0


def overflowing_llama():
    """A Llama whose down projection, 1e9 too large, passes 65504 in fp16 (stands in for T5/Gemma activations)."""
    model = tiny_llama(use_cache=False)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1e9)
    return model


def test_a_loss_scale_driven_to_nothing_by_an_fp16_overflow_is_named_and_the_probe_says_why():
    """deepinsight/insightface#2262 ("Fp16 Grad Scale: 0", loss NaN whatever the lr); facebookresearch/fairseq#512.

    https://github.com/deepinsight/insightface/issues/2262 -- https://github.com/facebookresearch/fairseq/issues/512
    """
    model = overflowing_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    before = model.lm_head.weight.clone()
    losses = [train_step(model, opt, scaler=scaler, autocast_dtype=torch.float16) for _ in range(20)]
    assert not any(finite(x) for x in losses) and scaler.get_scale() < 1.0
    assert torch.equal(model.lm_head.weight, before)  # every step was skipped: nothing learned

    (collapsed,) = mpdoctor.diagnose(model, opt, scaler).findings_for("scaler-scale-collapsed")
    assert collapsed.severity == "warning"

    # The probe finds the layer, says why (activation, fp16 max) and offers the treatment.
    probed = mpdoctor.probe(model, batch(), scaler=scaler, autocast=torch.float16)
    (finding,) = probed.findings_for("probe-nonfinite")
    assert finding.subject == "model.model.layers.1.mlp.down_proj"
    assert finding.evidence["cause"] == "activation-overflow-fp16"
    assert "passed fp16's largest value 65504" in finding.message and "Linear output" in finding.message
    recipes = [f.recipe for f in finding.fixes]
    assert recipes == ["bf16", "fp32-module"]  # fp32 weights under autocast: bf16 is what the code says to use
    assert "dtype=torch.bfloat16" in finding.fixes[0].code

    # Following it: bf16 autocast, no scaler (bf16 has fp32's range).
    assert finite(trained_step(model, opt, autocast_dtype=torch.bfloat16))
    assert not torch.equal(model.lm_head.weight, before)


def test_fp16_weights_that_overflow_get_a_bf16_cast_as_data_from_the_probe():
    """The same overflow with the weights themselves in fp16 (``model.half()``): the treatment is a cast, in place.

    Weights stay finite in fp16 here (1.0 and 300.0); the down projection's output (about 5e5) does not.
    """
    model = tiny_llama(use_cache=False)
    mlp = model.model.layers[1].mlp
    with torch.no_grad():
        mlp.gate_proj.weight.fill_(1.0)
        mlp.up_proj.weight.fill_(1.0)
        mlp.down_proj.weight.fill_(300.0)
    assert finite(model(**batch()).loss.item())  # fp32: fine
    model.half()
    assert not finite(model(**batch()).loss.item())  # fp16: NaN
    probed = mpdoctor.probe(model, batch())
    (finding,) = probed.findings_for("probe-nonfinite")
    assert finding.subject == "model.model.layers.1.mlp.down_proj"
    assert finding.evidence["cause"] == "activation-overflow-fp16" and "its inputs were finite" in finding.message
    bf16 = finding.fixes[0]
    assert bf16.recipe == "bf16" and bf16.changes
    bf16.apply()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert finite(model(**batch()).loss.item())
    bf16.undo()
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    bf16.apply()  # fixed in place again: a training step in bf16 trains
    trained_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def test_pure_bf16_adamw_at_a_common_lr_leaves_weights_near_one_exactly_unchanged():
    """workofart/ml-by-hand PR #85 ("round_bf16(0.9994) = 1.0 ... after 100 times it's still 1.0");
    NVIDIA-NeMo/Automodel PR #2248 (AdamW EMA buffers in bf16 round small updates away).

    https://github.com/workofart/ml-by-hand/pull/85 -- https://github.com/NVIDIA-NeMo/Automodel/pull/2248
    """
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    opt = torch.optim.AdamW(lin.parameters(), lr=6e-4, weight_decay=0.0)
    start = lin.weight.detach().clone()

    def steps(n: int) -> None:
        for _ in range(n):
            opt.zero_grad()
            lin(torch.randn(4, 16).to(lin.weight.dtype)).float().pow(2).mean().backward()
            opt.step()

    steps(100)
    assert torch.equal(lin.weight, start)  # 100 Adam steps, not one weight moved

    report = mpdoctor.diagnose(lin, opt)
    (finding,) = report.findings_for("pure-bf16-adamw")
    assert finding.severity == "warning" and finding.evidence["lr"] == 6e-4
    (fix,) = [f for f in report.fixes if f.slug == "pure-bf16-adamw"]
    assert fix.recipe == "fp32-master-weights"
    fix.apply()
    steps(10)
    assert (lin.weight.float() - start.float()).abs().max() > 1e-3  # fp32 master weights move
