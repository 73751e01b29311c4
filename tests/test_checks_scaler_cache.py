"""Specifications of the scaler and cache neighbours: fp16 params under a scaler, a collapsed
loss scale, and gradient checkpointing beside a cache flag."""

from __future__ import annotations

import pytest
import torch
from setups import batch, tiny_llama, train_step
from setups_dtypes import assert_same_state, finite, tensor_state
from transformers import LlamaConfig

import mpdoctor

# -- fp16-trainable-params-with-scaler ---------------------------------------------------------------


@pytest.fixture
def fp16_llama_with_scaler():
    model = tiny_llama(torch.float16, use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, torch.amp.GradScaler("cpu")


def test_fp16_parameters_under_a_scaler_raise_at_the_first_step(fp16_llama_with_scaler):
    model, opt, scaler = fp16_llama_with_scaler
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        train_step(model, opt, scaler=scaler)


def test_casting_them_to_fp32_master_weights_makes_the_amp_recipe_step(fp16_llama_with_scaler):
    model, opt, scaler = fp16_llama_with_scaler
    params = list(model.parameters())
    report = mpdoctor.diagnose(model, opt, scaler)
    (finding,) = report.findings_for("fp16-trainable-params-with-scaler")
    assert finding.severity == "error"
    (fix,) = finding.fixes
    assert not fix.safe
    assert fix not in report.apply_safe_fixes()  # unsafe fixes wait for an explicit click

    before = tensor_state(model, opt)
    fix.apply()
    assert list(model.parameters()) == params and {p.dtype for p in params} == {torch.float32}
    assert not report.refresh().findings_for("fp16-trainable-params-with-scaler")
    fix.undo()
    assert_same_state(before, tensor_state(model, opt), same_objects=True)

    fix.apply().apply()
    loss = train_step(model, opt, scaler=scaler, autocast_dtype=torch.float16)
    assert finite(loss) and opt.state  # the optimizer really stepped
    assert {v.dtype for st in opt.state.values() for k, v in st.items() if k != "step"} == {torch.float32}


# -- scaler-scale-collapsed ---------------------------------------------------------------------------


def test_a_scale_driven_down_by_real_fp16_overflow_is_reported():
    model = torch.nn.Linear(16, 16)
    torch.nn.init.ones_(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.full((4, 16), 6e4)  # 16 * 6e4 is past fp16's 65504: the activations overflow to inf
    weight = model.weight.detach().clone()
    for _ in range(17):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        assert torch.isinf(out).all()
        loss = torch.nn.functional.mse_loss(out.float(), torch.zeros(4, 16))
        scaler.scale(loss).backward()  # d(loss)/d(out) is inf: so are the grads
        scaler.step(opt)  # skipped: the grads are not finite
        scaler.update()  # halves the scale
    assert scaler.get_scale() == 0.5  # 2**16 halved seventeen times
    assert torch.equal(model.weight, weight)  # seventeen steps and the model has not moved

    report = mpdoctor.diagnose(model, opt, scaler)
    (finding,) = report.findings_for("scaler-scale-collapsed")
    assert finding.severity == "warning" and finding.fixes == []
    assert finding.evidence["scale"] == 0.5 and finding.evidence["init_scale"] == 65536.0
    # The message and its evidence write the scale alike, in the text and in the HTML.
    assert "started at 65536" in finding.message
    for rendered in (report.to_text(), report.to_html()):
        assert "65,536" not in rendered and "init_scale" in rendered


def test_a_healthy_scale_is_not_reported():
    model = tiny_llama(use_cache=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    assert finite(train_step(model, opt, scaler=scaler, autocast_dtype=torch.float16))
    assert not mpdoctor.diagnose(model, opt, scaler).findings_for("scaler-scale-collapsed")


# -- gradient-checkpointing-with-cache ---------------------------------------------------------------


@pytest.mark.parametrize("enable", ["activation_checkpointing_enable", "gradient_checkpointing_enable"])
def test_transformers_5_checkpointing_sets_the_module_flag_the_fact_reads(enable):
    model = tiny_llama()
    assert not mpdoctor.diagnose(model).facts.models[0].tensors.gradient_checkpointing
    getattr(model, enable)()
    assert mpdoctor.diagnose(model).facts.models[0].tensors.gradient_checkpointing


def test_checkpointing_with_the_cache_on_is_info_for_transformers_which_drops_the_cache_itself():
    model = tiny_llama()  # use_cache=True, train mode
    model.activation_checkpointing_enable()
    assert model(**batch()).past_key_values is None  # transformers switched the cache off for this forward
    report = mpdoctor.diagnose(model)
    assert not report.findings_for("cache-in-training")  # no cache is built, so no waste to report
    (finding,) = report.findings_for("gradient-checkpointing-with-cache")
    assert finding.severity == "info" and finding.subject == "model.config.use_cache"
    (fix,) = finding.fixes
    fix.apply()
    assert model.config.use_cache is False and not report.refresh().findings_for("gradient-checkpointing-with-cache")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert finite(train_step(model, opt))
    fix.undo()
    assert model.config.use_cache is True


class CheckpointedBlock(torch.nn.Module):
    """A custom module carrying a transformers config and its own checkpointing flag."""

    def __init__(self) -> None:
        super().__init__()
        self.config = LlamaConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1, use_cache=True)
        self.gradient_checkpointing = True
        self.proj = torch.nn.Linear(8, 8)


def test_checkpointing_with_the_cache_on_in_a_custom_module_is_a_warning():
    (finding,) = mpdoctor.diagnose(CheckpointedBlock()).findings_for("gradient-checkpointing-with-cache")
    assert finding.severity == "warning"
    assert finding.subject == "model.config.use_cache"


def test_apply_all_safe_fixes_keeps_the_scaler_an_fp16_loop_needs_beside_an_unrelated_bf16_module():
    """An fp16 autocast loop over an fp32 net needs its GradScaler; an unrelated bf16 module in the run made
    "Disable scaler" a safe fix, and "Apply all safe fixes" turned the scaler off. It is unsafe now: the scaler
    stays on, and the fp16 loop keeps its loss scaling."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    side = torch.nn.Linear(4, 4).to(torch.bfloat16)  # trained elsewhere, in bf16
    opt = torch.optim.SGD([*net.parameters(), *side.parameters()], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    report = mpdoctor.diagnose(net, side, opt, scaler, names={id(net): "net", id(side): "side", id(opt): "opt",
                                                              id(scaler): "scaler"})  # fmt: skip
    (finding,) = report.findings_for("scaler-with-bf16")
    (fix,) = finding.fixes
    assert not fix.safe and "only if no fp16 autocast runs" in fix.title and "fp32 parameter elements" in finding.message
    report.apply_safe_fixes()
    assert scaler.is_enabled()
    x = torch.randn(4, 8)
    before = [p.detach().clone() for p in net.parameters()]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = net(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() in (1024.0, 2048.0, 512.0) and torch.isfinite(loss)
    assert any(not torch.equal(p.detach(), b) for p, b in zip(net.parameters(), before))
