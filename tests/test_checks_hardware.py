"""Hardware checks: bf16 without native bf16, FlashAttention on fp32 weights, 4-bit layers computing in fp32."""

from __future__ import annotations

import pytest
import torch
from setups import batch, tiny_gemma3, tiny_llama, tiny_trainer, train_step
from setups_precision import accelerate_snapshot, assert_same_snapshot, one_torch_thread, tensor_snapshot  # noqa: F401 (one_torch_thread: autouse)

import mpdoctor
from mpdoctor.knowledge import FP16_OVERFLOW_MODEL_TYPES

# -- bf16-unsupported ---------------------------------------------------------------------------------------


def test_bf16_model_on_a_t4_target_is_reported_and_the_fp32_master_weight_fix_keeps_the_parameters():
    model = tiny_llama(torch.bfloat16, use_cache=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    before = tensor_snapshot(model, opt)
    params = list(model.parameters())
    report = mpdoctor.diagnose(namespace={"model": model, "opt": opt}, target="T4")
    (finding,) = report.findings_for("bf16-unsupported")
    assert finding.severity == "warning" and "T4" in finding.message and "torch.float16" in finding.message
    (fix,) = finding.fixes
    assert not fix.safe
    fix.apply()
    assert all(p.dtype == torch.float32 for p in model.parameters()) and list(model.parameters()) == params
    assert not report.refresh().findings_for("bf16-unsupported")
    fix.undo()
    assert_same_snapshot(before, tensor_snapshot(model, opt))
    fix.apply()
    assert torch.isfinite(torch.tensor(train_step(model, opt)))


def test_bf16_fix_code_is_pasteable_and_casts_the_same_parameters():
    model, twin = tiny_llama(torch.bfloat16), tiny_llama(torch.bfloat16)
    (fix,) = mpdoctor.diagnose(namespace={"model": model}, target="V100").findings_for("bf16-unsupported")[0].fixes
    fix.apply()
    exec(fix.code, {"model": twin})
    for p, q in zip(model.parameters(), twin.parameters()):
        assert p.dtype == q.dtype == torch.float32 and torch.equal(p, q)


def test_bf16_trainer_on_a_t4_target_is_an_error_whose_fix_switches_to_fp16_amp():
    trainer = tiny_trainer(tiny_llama(torch.bfloat16, use_cache=False), bf16=True)
    before_state = accelerate_snapshot(trainer)
    before_tensors = tensor_snapshot(trainer.model)
    report = mpdoctor.diagnose(namespace={"trainer": trainer}, target="T4")
    (finding,) = report.findings_for("bf16-unsupported")
    assert finding.severity == "error" and "doesn't support bf16/gpu" in finding.message
    (fix,) = finding.fixes
    fix.apply()
    assert (trainer.args.bf16, trainer.args.fp16, trainer.args.mixed_precision) == (False, True, "fp16")
    assert trainer.accelerator.mixed_precision == "fp16"
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    refreshed = report.refresh()
    assert not refreshed.findings_for("bf16-unsupported")
    assert not refreshed.findings_for("precision-override")  # on the T4, fp16 args autocast fp16
    fix.undo()
    assert accelerate_snapshot(trainer) == before_state
    assert_same_snapshot(before_tensors, tensor_snapshot(trainer.model))
    fix.apply()
    assert torch.isfinite(torch.tensor(trainer.train().training_loss))  # on this CPU: fp16 args run fp32


def test_models_that_overflow_fp16_get_fp32_instead_of_fp16_amp():
    assert {"t5", "gemma2", "gemma3", "gemma3_text", "qwen3_moe", "gpt_oss"} <= FP16_OVERFLOW_MODEL_TYPES
    model = tiny_gemma3(torch.bfloat16, text_use_cache=False)
    (finding,) = mpdoctor.diagnose(namespace={"model": model}, target="T4").findings_for("bf16-unsupported")
    assert "gemma3 overflows in fp16" in finding.message and "torch.float16" not in finding.fixes[0].code
    trainer = tiny_trainer(tiny_gemma3(torch.bfloat16, text_use_cache=False), bf16=True)
    (finding,) = mpdoctor.diagnose(namespace={"trainer": trainer}, target="T4").findings_for("bf16-unsupported")
    finding.fixes[0].apply()
    assert (trainer.args.bf16, trainer.args.fp16, trainer.args.mixed_precision) == (False, False, "no")
    assert trainer.accelerator.mixed_precision == "no"


@pytest.mark.parametrize("target", [None, "A100", "L4", "H100", "cpu"])
def test_bf16_is_fine_where_the_device_has_native_bf16(target):
    trainer = tiny_trainer(tiny_llama(torch.bfloat16, use_cache=False), bf16=True)
    assert not mpdoctor.diagnose(namespace={"trainer": trainer}, target=target).findings_for("bf16-unsupported")


def test_fp32_models_on_a_t4_are_not_bf16_findings():
    assert not mpdoctor.diagnose(tiny_llama(), target="T4").findings_for("bf16-unsupported")


# -- flash-attention-fp32 -----------------------------------------------------------------------------------


def _flash(model):
    model.config._attn_implementation = "flash_attention_2"  # the setter also reaches sub-configs
    return model


def test_flash_attention_with_fp32_weights_is_reported_and_switched_to_sdpa_in_place():
    model = _flash(tiny_llama(use_cache=False))
    report = mpdoctor.diagnose(namespace={"model": model})
    (finding,) = report.findings_for("flash-attention-fp32")
    assert finding.severity == "warning"  # a bare model: a loop we cannot see may autocast
    assert finding.subject == "model.config._attn_implementation"
    (fix,) = finding.fixes
    assert fix.safe
    fix.apply()
    assert model.config._attn_implementation == "sdpa"
    assert torch.isfinite(model(**batch()).loss)  # runs in fp32 now
    assert not report.refresh().findings_for("flash-attention-fp32")
    fix.undo()
    assert model.config._attn_implementation == "flash_attention_2"


def test_flash_attention_in_an_fp32_trainer_is_an_error_but_fine_under_bf16_autocast():
    fp32 = tiny_trainer(_flash(tiny_llama(use_cache=False)))
    (finding,) = mpdoctor.diagnose(namespace={"trainer": fp32}).findings_for("flash-attention-fp32")
    assert finding.severity == "error"
    bf16 = tiny_trainer(_flash(tiny_llama(use_cache=False)), bf16=True)
    assert not mpdoctor.diagnose(namespace={"trainer": bf16}).findings_for("flash-attention-fp32")
    assert not mpdoctor.diagnose(_flash(tiny_llama(torch.bfloat16))).findings_for("flash-attention-fp32")


def test_flash_attention_fix_reaches_nested_sub_configs():
    model = _flash(tiny_gemma3(text_use_cache=False))
    (finding,) = mpdoctor.diagnose(namespace={"model": model}).findings_for("flash-attention-fp32")
    finding.fixes[0].apply()
    configs = (model.config, model.config.text_config, model.config.vision_config)
    assert all(c._attn_implementation == "sdpa" for c in configs)
    exec_model = _flash(tiny_gemma3(text_use_cache=False))
    exec(finding.fixes[0].code, {"model": exec_model})  # pasteable: transformers' own setter
    assert exec_model.config.text_config._attn_implementation == "sdpa"


# -- bnb-compute-dtype-fp32 ---------------------------------------------------------------------------------


def _quantized(dtype: torch.dtype, **bnb):
    from transformers import BitsAndBytesConfig  # constructing the config needs no bitsandbytes

    model = tiny_llama(dtype, use_cache=False)
    model.config.quantization_config = BitsAndBytesConfig(**bnb)
    return model


def test_4bit_compute_dtype_fp32_on_a_bf16_model_is_a_warning_fixed_on_the_config():
    model = _quantized(torch.bfloat16, load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    report = mpdoctor.diagnose(namespace={"model": model})
    (finding,) = report.findings_for("bnb-compute-dtype-fp32")
    assert finding.severity == "warning" and finding.evidence["half_dtype"] == "bfloat16"
    (fix,) = finding.fixes
    assert not fix.safe
    fix.apply()
    fix.apply()
    assert model.config.quantization_config.bnb_4bit_compute_dtype is torch.bfloat16
    assert not report.refresh().findings_for("bnb-compute-dtype-fp32")
    fix.undo()
    assert model.config.quantization_config.bnb_4bit_compute_dtype is torch.float32
    exec(fix.code, {"model": model, "torch": torch})
    assert model.config.quantization_config.bnb_4bit_compute_dtype is torch.bfloat16


def test_4bit_compute_dtype_fp32_under_a_bf16_trainer_is_a_warning():
    trainer = tiny_trainer(_quantized(torch.float32, load_in_4bit=True), bf16=True)
    (finding,) = mpdoctor.diagnose(namespace={"trainer": trainer}).findings_for("bnb-compute-dtype-fp32")
    assert finding.evidence["half_dtype"] == "bfloat16"


@pytest.mark.parametrize(
    ("dtype", "bnb"),
    [
        (torch.bfloat16, {"load_in_4bit": True, "bnb_4bit_compute_dtype": torch.bfloat16}),
        (torch.bfloat16, {"load_in_8bit": True}),  # 8-bit ignores bnb_4bit_compute_dtype
        (torch.float32, {"load_in_4bit": True}),  # an fp32 run computing in fp32: consistent
    ],
    ids=["bf16-compute", "8bit", "fp32-run"],
)
def test_4bit_compute_dtype_is_not_reported_when_it_matches_the_run(dtype, bnb):
    assert not mpdoctor.diagnose(_quantized(dtype, **bnb)).findings_for("bnb-compute-dtype-fp32")
