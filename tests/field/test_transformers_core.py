"""Field cases from the transformers trackers: buffers, activations and masks in half precision, and what a GPU
refuses that this CPU accepts.

Each case reproduces the reported failure on this CPU first (the real error, or the measured harm) or says
plainly that it is GPU-only and stands in for it, then asserts the diagnosis, applies the treatment through
the report and runs a step.
"""

from __future__ import annotations

import math

import torch
from setups import VOCAB, batch, tiny_llama
from setups_dtypes import finite
from steps import trained_step

import mpdoctor
from mpdoctor.attach.numerics.probe_facts import ForwardCall


def rope_phase_error(rotary, positions: int, reference: torch.Tensor) -> float:
    """Largest cos/sin table error (radians of phase) at ``positions`` against ``reference`` frequencies.

    The reference is independent of mpdoctor: the ``inv_freq`` of a fresh fp32 model built from the same config
    (checked against RoPE's closed form ``1 / theta ** (2i / d)`` where the test builds it).
    """
    pos = torch.arange(positions, dtype=torch.float32)
    return float((pos[:, None] * (rotary.inv_freq.float() - reference.float())[None]).abs().max())


def closed_form_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """RoPE's frequencies as the paper defines them, in float64: ``theta ** (-2i / dim)`` for ``i < dim / 2``."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def long_context_llama():
    """A Llama whose heads are 32 wide with 4096 positions (real Llama heads are 128 wide, contexts longer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=VOCAB, max_position_embeddings=4096, use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def test_model_to_bf16_rounds_the_rope_frequencies_and_the_fix_recomputes_them_in_fp32():
    """huggingface/transformers#29496 ("inv_freq tensor will be in bf16 ... large model quality issues") and PR #29285
    (Unsloth: RoPE loses precision in bf16); NVIDIA/Megatron-LM#744.

    https://github.com/huggingface/transformers/issues/29496 -- https://github.com/huggingface/transformers/pull/29285
    """
    fresh = long_context_llama().model.rotary_emb.inv_freq  # the fp32 frequencies, before any cast
    assert fresh.dtype == torch.float32
    assert torch.allclose(fresh.double(), closed_form_inv_freq(10000.0, 32), rtol=1e-6, atol=0)  # head_dim 32
    model = long_context_llama().to(torch.bfloat16)
    rotary = model.model.rotary_emb
    assert rotary.inv_freq.dtype == torch.bfloat16  # model.to(dtype) casts buffers too
    measured = rope_phase_error(rotary, 4096, fresh)
    assert measured > 0.5  # radians of phase at the last position: positions there are encoded wrongly

    report = mpdoctor.diagnose(model)
    (finding,) = report.findings_for("half-precision-rope-buffers")
    assert finding.severity == "warning" and math.isclose(finding.evidence["phase_error_rad"], measured, rel_tol=1e-3)
    (fix,) = [f for f in report.fixes if f.slug == "half-precision-rope-buffers"]
    assert fix.safe and fix.recipe == "fp32-rope-buffers"
    old = rotary.inv_freq
    fix.apply()
    assert rotary.inv_freq.dtype == torch.float32 and rope_phase_error(rotary, 4096, fresh) == 0.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert finite(trained_step(model, opt, autocast_dtype=torch.bfloat16))
    fix.undo()
    assert rotary.inv_freq is old


def test_from_pretrained_in_bf16_keeps_the_frequencies_fp32_and_draws_nothing(tmp_path):
    """The treatment the finding recommends for next time: load in the dtype rather than cast after loading."""
    from transformers import LlamaForCausalLM

    long_context_llama().to(torch.bfloat16).save_pretrained(tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert not mpdoctor.diagnose(model).findings_for("half-precision-rope-buffers")


def test_gpt_neox_half_rope_error_is_measured_and_reported_at_its_size():
    """EleutherAI/gpt-neox#1003 (RotaryEmbedding wrong in fp16 and bf16 for large positions).

    transformers' GPT-NeoX computes the phase in fp32 from the (now fp16) frequencies, so the error is smaller
    than in the report (which did all of it in fp16): 0.32 rad at 2048 positions with Pythia's rotary width,
    an info here; the same model at 8192 positions is a warning.

    https://github.com/EleutherAI/gpt-neox/issues/1003
    """
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    def neox(positions: int):
        config = GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=256, num_hidden_layers=1, num_attention_heads=1, intermediate_size=32,
            max_position_embeddings=positions, rotary_pct=0.25, use_cache=False,
        )  # fmt: skip
        return GPTNeoXForCausalLM(config).half()

    torch.manual_seed(0)
    fresh = GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=1, num_attention_heads=1, intermediate_size=32,
        max_position_embeddings=2048, rotary_pct=0.25, use_cache=False,
    )).gpt_neox.rotary_emb.inv_freq  # fmt: skip
    assert torch.allclose(fresh.double(), closed_form_inv_freq(10000.0, 64), rtol=1e-6, atol=0)  # 256 * 0.25
    short = neox(2048)
    measured = rope_phase_error(short.gpt_neox.rotary_emb, 2048, fresh)
    assert 0.2 < measured < 0.5
    (finding,) = mpdoctor.diagnose(short).findings_for("half-precision-rope-buffers")
    assert finding.severity == "info" and finding.evidence["class"] == "GPTNeoXRotaryEmbedding"
    long = neox(8192)
    report = mpdoctor.diagnose(long)
    (finding,) = report.findings_for("half-precision-rope-buffers")
    assert finding.severity == "warning"
    # Fixed in place: the frequencies recomputed in fp32, equal to a fresh fp32 model's; then an fp16 step trains.
    (fix,) = [f for f in report.fixes if f.slug == "half-precision-rope-buffers"]
    fix.apply()
    rotary = long.gpt_neox.rotary_emb
    assert rotary.inv_freq.dtype == torch.float32 and rope_phase_error(rotary, 8192, fresh) == 0.0
    assert not mpdoctor.diagnose(long).findings_for("half-precision-rope-buffers")
    trained_step(long, torch.optim.SGD(long.parameters(), lr=1e-3))


def test_t5_in_fp16_overflows_in_its_feed_forward_and_the_probe_names_wo_and_treats_it_with_bf16():
    """huggingface/transformers#4586 and #14189 (T5 fp16 forward/loss NaN); #5651 (T5DenseReluDense output 66246).

    Tiny random T5 weights never reach 65504, so the feed-forward is scaled (wi 1.0, wo 3000.0) until its
    output does, as the real checkpoints' activations do.

    https://github.com/huggingface/transformers/issues/4586 -- https://github.com/huggingface/transformers/issues/14189
    """
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, use_cache=False,
    )  # fmt: skip
    t5 = T5ForConditionalGeneration(config)
    ff = t5.encoder.block[0].layer[1].DenseReluDense
    with torch.no_grad():
        ff.wi.weight.fill_(1.0)
        ff.wo.weight.fill_(3000.0)
    g = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(1, VOCAB, (2, 8), generator=g), "labels": torch.randint(1, VOCAB, (2, 8), generator=g)}
    assert finite(t5(**inputs).loss.item())
    t5.half()
    assert not finite(t5(**inputs).loss.item())

    (static,) = mpdoctor.diagnose(t5).findings_for("fp16-overflow-risk")
    assert static.severity == "error" and static.evidence["model_types"] == ["t5"]

    report = mpdoctor.probe(t5, inputs, name="t5")
    (finding,) = report.findings_for("probe-nonfinite")
    assert finding.subject == "t5.encoder.block.0.layer.1.DenseReluDense.wo"
    assert finding.evidence["cause"] == "activation-overflow-fp16"
    bf16 = finding.fixes[0]
    assert bf16.recipe == "bf16"
    bf16.apply()
    assert finite(t5(**inputs).loss.item())
    opt = torch.optim.AdamW(t5.parameters(), lr=1e-4)
    assert finite(trained_step(t5, opt, inputs=inputs))


def test_gemma2_in_fp16_is_an_error_before_it_runs_and_the_probe_finds_where_it_overflows():
    """google/gemma_pytorch#24 (loss NaN in fp16); unslothai/unsloth PR #5074 (Gemma fp16 NaN: "the only reliable
    fix is to keep the model in bfloat16"). Weights scaled as in the T5 case.

    https://github.com/google/gemma_pytorch/issues/24 -- https://github.com/unslothai/unsloth/pull/5074
    """
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, use_cache=False,
    )  # fmt: skip
    model = Gemma2ForCausalLM(config)
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        mlp.gate_proj.weight.fill_(1.0)
        mlp.up_proj.weight.fill_(1.0)
        mlp.down_proj.weight.fill_(300.0)
    assert finite(model(**batch()).loss.item())
    model.half()
    assert not finite(model(**batch()).loss.item())

    (static,) = mpdoctor.diagnose(model).findings_for("fp16-overflow-risk")
    assert static.severity == "error" and "gemma2" in static.message
    (finding,) = mpdoctor.probe(model, batch()).findings_for("probe-nonfinite")
    assert finding.subject == "model.model.layers.0.mlp.down_proj" and finding.evidence["cause"] == "activation-overflow-fp16"
    finding.fixes[0].apply()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert finite(trained_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4)))


def test_an_additive_mask_built_with_float32_min_becomes_minus_inf_in_fp16_and_a_padded_row_goes_nan():
    """huggingface/transformers PR #17306 ("finfo(float16).min + (-16.0) = -inf ... we get NaN after softmax") and
    PR #27114 (-inf in the padding mask).

    https://github.com/huggingface/transformers/pull/17306 -- https://github.com/huggingface/transformers/pull/27114
    """
    model = tiny_llama(torch.float16, use_cache=False)
    model.config._attn_implementation = "eager"  # the softmax path of the report
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    keep = torch.ones(2, 8)
    keep[0, :3] = 0  # left padding
    allowed = torch.tril(torch.ones(8, 8))[None, None] * keep[:, None, None, :]

    def additive(dtype):
        return ((1.0 - allowed) * torch.finfo(dtype).min).half()

    assert torch.isinf(additive(torch.float32)).any()  # -3.4e38 is -inf in fp16
    out = model(input_ids=ids, attention_mask=additive(torch.float32), labels=ids)
    assert torch.isnan(out.logits).any() and not finite(out.loss.item())

    mask = additive(torch.float32)  # the mask the user holds and passes
    report = mpdoctor.probe(model, ForwardCall(input_ids=ids, attention_mask=mask, labels=ids))
    (finding,) = report.findings_for("probe-nonfinite")
    assert finding.evidence["cause"] == "input-nonfinite" and "finfo.min" in finding.message
    clamp, code = finding.fixes
    assert clamp.recipe == "mask-dtype-min" and clamp.safe  # the batch's own mask, rebuilt in place
    assert code.recipe == "mask-in-compute-dtype" and "torch.finfo(dtype).min" in code.code  # how to build it so
    (mask_finding,) = report.findings_for("attention-mask-overflow")  # the probe reads the batch's mask too
    assert mask_finding.subject == "attention_mask" and mask_finding.evidence["dead_rows"] == 3
    (planned,) = [fx for fx in report.fixes if fx.recipe == "mask-dtype-min"]  # one clamp for both findings
    storage = mask.untyped_storage().data_ptr()
    planned.apply()
    assert planned.applied and not torch.isinf(mask).any() and mask.min() == torch.finfo(torch.float16).min
    out = model(input_ids=ids, attention_mask=mask, labels=ids)  # the user's call, with the same tensor
    assert not torch.isnan(out.logits).any() and finite(out.loss.item())
    planned.undo()
    assert mask.untyped_storage().data_ptr() == storage and torch.equal(mask, additive(torch.float32))

    # The same treatment as the code says: the compute dtype's finfo.min.
    out = model(input_ids=ids, attention_mask=additive(torch.float16), labels=ids)
    assert not torch.isnan(out.logits).any() and finite(out.loss.item())


def test_flash_attention_2_on_fp32_weights_is_named_before_the_gpu_refuses_it():
    """QwenLM/Qwen3#406 ("RuntimeError: FlashAttention only support fp16 and bf16 data type"); rllm-org/rllm#11.

    GPU-only: flash-attn is not installed on this CPU, where transformers refuses the kernel outright
    (ImportError). The stand-in is the config a GPU run would hold (``_attn_implementation`` set by hand).

    https://github.com/QwenLM/Qwen3/issues/406 -- https://github.com/rllm-org/rllm/issues/11
    """
    import pytest

    model = tiny_llama(use_cache=False)
    with pytest.raises(ImportError, match="FlashAttention2"):
        model.set_attn_implementation("flash_attention_2")
    model.config._attn_implementation = "flash_attention_2"

    report = mpdoctor.diagnose(model)
    (finding,) = report.findings_for("flash-attention-fp32")
    assert "only supports fp16 and bf16" in finding.message
    (fix,) = [f for f in report.fixes if f.slug == "flash-attention-fp32"]
    fix.apply()
    assert model.config._attn_implementation != "flash_attention_2"
    assert finite(trained_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3)))


def test_bf16_arguments_meant_for_a_v100_are_an_error_before_transformers_refuses_them():
    """tatsu-lab/stanford_alpaca#133 and lm-sys/FastChat#399 ("Your setup doesn't support bf16/gpu" on V100/T4).

    GPU-only: this CPU accepts ``bf16=True``; the V100 is a ``target=`` profile.

    https://github.com/tatsu-lab/stanford_alpaca/issues/133 -- https://github.com/lm-sys/FastChat/issues/399
    """
    from setups import TinyDataset, training_args
    from transformers import Trainer

    args = training_args(bf16=True)
    assert args.bf16  # accepted here; refused on a V100
    model = tiny_llama(use_cache=False)
    report = mpdoctor.diagnose(model, args, target="V100")
    (finding,) = report.findings_for("bf16-unsupported")
    assert finding.severity == "error" and "Your setup doesn't support bf16/gpu" in finding.message
    (fix,) = [f for f in report.fixes if f.slug == "bf16-unsupported"]
    assert fix.recipe == "fp32-master-fp16"
    fix.apply()
    assert args.fp16 and not args.bf16
    assert not mpdoctor.diagnose(model, args, target="V100").findings_for("bf16-unsupported")
    result = Trainer(model=model, args=args, train_dataset=TinyDataset()).train()
    assert finite(result.training_loss)


def test_an_fp32_lm_head_on_a_bf16_model_works_under_autocast_and_breaks_generate_outside_it():
    """huggingface/peft#1515 (QLoRA bf16 + ``model.generate()`` in a TrainerCallback: "expected mat1 and mat2 to have
    the same dtype, but got: float != c10::BFloat16"). The fp32 head is what ``prepare_model_for_kbit_training``
    leaves; the Trainer's autocast hides it during training, ``generate`` outside it does not.

    https://github.com/huggingface/peft/issues/1515
    """
    import pytest
    from setups import tiny_lora

    model = tiny_lora(torch.bfloat16)
    model.config.use_cache = False
    model.base_model.model.lm_head.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert finite(model(**batch()).loss.item())
    prompt = batch()["input_ids"][:, :4]
    with pytest.raises(RuntimeError, match="expected scalar type Float but found BFloat16|same dtype"):
        model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2)

    report = mpdoctor.diagnose(model)
    (finding,) = report.findings_for("mixed-param-dtypes")
    assert "lm_head" in finding.message and finding.severity == "error"
    (fix,) = [f for f in report.fixes if f.slug == "mixed-param-dtypes"]
    fix.apply()
    assert model.base_model.model.lm_head.weight.dtype == torch.bfloat16
    model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    assert finite(trained_step(model, opt))
