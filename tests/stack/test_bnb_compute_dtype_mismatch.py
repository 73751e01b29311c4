"""bnb-compute-dtype-mismatch, reproduced with real bitsandbytes 4-bit layers on this CPU (bitsandbytes 0.50 runs
them here; ``bnb_4bit_compute_dtype`` decides the matmul dtype, docs/stack.md): a bf16 checkpoint loaded in 4-bit with
an fp16 compute dtype goes NaN where the same checkpoint with a bf16 compute dtype is finite.

A tiny random model never passes 65504 by itself: one row of ``up_proj`` is set to 30000 before saving (inside
both half precisions' range), so that row's matmul output passes fp16's range and stays inside bf16's."""

from __future__ import annotations

import bitsandbytes as bnb  # a plain import: tests/stack runs where the stack is pinned, a missing one must fail
import pytest
import torch
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

import mpdoctor

IDS = torch.tensor([[3, 14, 15, 9, 2, 6]])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0] = 30000.0
    path = tmp_path_factory.mktemp("bf16-checkpoint")
    model.save_pretrained(path)
    return path


def load_4bit(path, compute_dtype: torch.dtype, dtype: torch.dtype):
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype)
    return LlamaForCausalLM.from_pretrained(path, quantization_config=q, device_map="cpu", dtype=dtype)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def linear4bit(model) -> list:
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def test_fp16_compute_in_a_bf16_model_goes_nan_and_computing_in_bf16_makes_it_finite(checkpoint):
    model = load_4bit(checkpoint, torch.float16, torch.bfloat16)
    assert not torch.isfinite(logits(model)).all()
    assert torch.isfinite(logits(load_4bit(checkpoint, torch.bfloat16, torch.bfloat16))).all()  # the twin

    report = mpdoctor.diagnose(namespace={"model": model})
    (finding,) = report.findings_for("bnb-compute-dtype-mismatch")
    assert finding.severity == "warning" and "7 Linear4bit layers compute in fp16" in finding.message
    (fix,) = finding.fixes
    assert not fix.safe  # the 4-bit matmuls round differently: applied on an explicit request
    fix.apply()
    assert {m.compute_dtype for m in linear4bit(model)} == {torch.bfloat16}
    assert model.config.quantization_config.bnb_4bit_compute_dtype == torch.bfloat16
    assert torch.isfinite(logits(model)).all()
    assert not report.refresh().findings_for("bnb-compute-dtype-mismatch")
    fix.undo()
    assert {m.compute_dtype for m in linear4bit(model)} == {torch.float16}
    assert model.config.quantization_config.bnb_4bit_compute_dtype == torch.float16


def test_bf16_compute_in_an_fp16_model_is_info(checkpoint):
    model = load_4bit(checkpoint, torch.bfloat16, torch.float16)
    (finding,) = mpdoctor.diagnose(namespace={"model": model}).findings_for("bnb-compute-dtype-mismatch")
    assert finding.severity == "info"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_compute_dtype_matching_the_model_draws_no_alarm(checkpoint, dtype):
    report = mpdoctor.diagnose(namespace={"model": load_4bit(checkpoint, dtype, dtype)})
    assert not report.findings_for("bnb-compute-dtype-mismatch")
    assert [f.check for f in report.findings if f.severity in ("error", "warning")] == []
