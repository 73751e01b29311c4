"""Field case 5: fp32 weights beside bf16 weights in a compute path that does not cast (Unsloth #1260, #212).

The failure is reproduced first (the real RuntimeError), then diagnosed, fixed in
place and followed by a real training step with a finite loss.
"""

from __future__ import annotations

import types

import pytest
import torch
from setups import batch, tiny_llama
from setups_dtypes import assert_same_state, finite, tensor_state

import mpdoctor

SAME_DTYPE = r"(mat1|self|m1) and (mat2|m2).*same dtype"


class BackboneWithHead(torch.nn.Module):
    """A frozen backbone whose output feeds a small trainable head: a LoRA-like split."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def head_step(model, opt, x, target, autocast: bool = False) -> float:
    """One real AdamW step on the head."""
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = torch.nn.functional.mse_loss(model(x).float(), target)
    loss.backward()
    opt.step()
    return loss.item()


@pytest.fixture
def bf16_backbone_fp32_head():
    """The broken state: one step trained under autocast (fp32 AdamW state exists), backbone cast to bf16."""
    model = BackboneWithHead()
    model.backbone.requires_grad_(False)
    opt = torch.optim.AdamW(model.head.parameters(), lr=1e-2)
    x, target = torch.randn(8, 16), torch.randn(8, 4)
    head_step(model, opt, x, target, autocast=True)
    model.backbone.to(torch.bfloat16)
    return model, opt, x.bfloat16(), target


def test_a_bf16_layer_feeding_an_fp32_layer_without_autocast_raises_the_real_error(bf16_backbone_fp32_head):
    model, opt, x, target = bf16_backbone_fp32_head
    with pytest.raises(RuntimeError, match="mat1 and mat2 must have the same dtype, but got BFloat16 and Float"):
        head_step(model, opt, x, target)


def test_mixed_param_dtypes_is_an_error_naming_the_fp32_head(bf16_backbone_fp32_head):
    model, opt, _, _ = bf16_backbone_fp32_head
    (finding,) = mpdoctor.diagnose(model, opt).findings_for("mixed-param-dtypes")
    assert finding.severity == "error"
    assert finding.evidence["compute_dtype"] == "bfloat16"
    assert finding.evidence["modules"] == {"head": ["float32"]}
    assert finding.evidence["autocast"] is None
    assert "mat1 and mat2 must have the same dtype" in finding.message


def test_the_fix_casts_the_head_and_its_adamw_state_in_place_and_training_works(bf16_backbone_fp32_head):
    model, opt, x, target = bf16_backbone_fp32_head
    params = list(model.head.parameters())
    report = mpdoctor.diagnose(model, opt)
    (fix,) = report.findings_for("mixed-param-dtypes")[0].fixes
    assert not fix.safe  # fp32 -> bf16 narrows
    assert "model.get_submodule(path)" in fix.code and "'head'" in fix.code

    fix.apply()
    assert [p is q for p, q in zip(model.head.parameters(), params)] == [True, True]  # same Parameter objects
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {v.dtype for st in opt.state.values() for k, v in st.items() if k != "step"} == {torch.bfloat16}
    assert not report.refresh().findings_for("mixed-param-dtypes")

    fix.apply()  # idempotent
    assert fix.applied and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert finite(head_step(model, opt, x, target))  # the very next step, without autocast
    assert {v.dtype for st in opt.state.values() for k, v in st.items() if k != "step"} == {torch.bfloat16}


def test_undo_restores_parameters_grads_and_state_bit_for_bit(bf16_backbone_fp32_head):
    model, opt, _, _ = bf16_backbone_fp32_head
    fix = mpdoctor.diagnose(model, opt).findings_for("mixed-param-dtypes")[0].fixes[0]
    before = tensor_state(model, opt)
    fix.apply().undo()
    assert_same_state(before, tensor_state(model, opt), same_objects=True)


# -- Unsloth's shape of the failure: a fused LoRA autograd Function under gradient checkpointing ------------------


class FusedLoRAMatmul(torch.autograd.Function):
    """``Y = X W^T + s (X A^T) B^T``, written as Unsloth's fused LoRA kernels were: A and B are never cast.

    ``custom_fwd`` without ``cast_inputs``: autocast stays as it is around the
    forward; its out-of-place matmuls are autocast, but the backward's in-place
    ``addmm_`` is not, so it meets the fp32 adapter weights.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, X, W, A, B, s):
        ctx.save_for_backward(X, W, A, B)
        ctx.s = s
        return X @ W.t() + s * ((X @ A.t()) @ B.t())

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, dY):
        X, W, A, B = ctx.saved_tensors
        s = ctx.s
        X2, dY2 = X.reshape(-1, X.shape[-1]), dY.reshape(-1, dY.shape[-1])
        dYB = dY2 @ B
        dX = dY2 @ W
        dX.addmm_(dYB, A, alpha=s)  # in-place: autocast does not cast A
        dA = s * dYB.t() @ X2
        dB = s * dY2.t() @ (X2 @ A.t())
        return dX.reshape(X.shape), None, dA, dB, None


def fused_lora_mlp_forward(self, x):
    """A LlamaMLP forward patched in as Unsloth patches it: reads base and adapter weights itself, checkpointed."""

    def lora(layer, X):
        return FusedLoRAMatmul.apply(
            X, layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight,
            layer.scaling["default"],
        )

    def body(x):
        return lora(self.down_proj, self.act_fn(lora(self.gate_proj, x)) * lora(self.up_proj, x))

    return torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False)


def lora_mlp_model():
    """PEFT LoRA on the MLP of a bf16 tiny Llama; PEFT keeps the adapters fp32 (autocast_adapter_dtype=True)."""
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(torch.bfloat16, use_cache=False)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], lora_dropout=0.0)
    model = get_peft_model(base, config)
    for n, p in model.named_parameters():
        if "lora_B" in n:  # PEFT starts B at zero; a nonzero B makes the adapter path carry gradient
            torch.nn.init.normal_(p, std=0.02)
    return model


def patch_like_unsloth(model) -> None:
    for layer in model.base_model.model.model.layers:
        layer.mlp.forward = types.MethodType(fused_lora_mlp_forward, layer.mlp)


def test_peft_lora_with_fp32_adapters_is_healthy_until_a_fused_kernel_reads_the_adapters():
    model = lora_mlp_model()
    loss = model(**batch()).loss
    loss.backward()  # PEFT's own layers cast the input to the adapter dtype: this works
    assert torch.isfinite(loss)
    assert not mpdoctor.diagnose(model).findings_for("mixed-param-dtypes")

    patch_like_unsloth(model)
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch()).loss  # forward is fine: autocast casts the out-of-place matmuls
        with pytest.raises(RuntimeError, match=SAME_DTYPE):
            loss.backward()  # checkpoint recomputes, then the fused backward's addmm_ meets fp32 A

    with torch.autocast("cpu", dtype=torch.bfloat16):
        (warned,) = mpdoctor.diagnose(model).findings_for("mixed-param-dtypes")
    assert warned.severity == "warning"
    assert warned.evidence["patched_forwards"] == [f"{__name__}.fused_lora_mlp_forward"]
    assert all(role == "adapter" for role in warned.evidence["roles"].values())
    assert len(warned.evidence["modules"]) == 2 * 3 * 2  # layers x projections x (lora_A, lora_B)

    (error,) = mpdoctor.diagnose(model).findings_for("mixed-param-dtypes")  # no autocast: the forward fails too
    assert error.severity == "error"
    with pytest.raises(RuntimeError, match=SAME_DTYPE):
        model(**batch())


def test_casting_the_adapters_read_by_the_fused_kernel_makes_a_checkpointed_training_step_work():
    model = lora_mlp_model()
    patch_like_unsloth(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    report = mpdoctor.diagnose(model, opt)
    (fix,) = report.findings_for("mixed-param-dtypes")[0].fixes
    assert not fix.safe
    fix.apply()
    lora = {n: p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert set(lora.values()) == {torch.bfloat16}
    assert not report.refresh().findings_for("mixed-param-dtypes")

    for autocast in (True, False):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch()).loss
        loss.backward()
        opt.step()
        assert finite(loss.item())
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_A" in n)
