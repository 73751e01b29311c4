"""No false alarms: recipes that train correctly get no error and no warning from any check.

Each recipe runs a real training step (or a real inference forward) first, so
"healthy" is proven rather than assumed, then the whole report is asserted clean.
Models meant for training are built with the cache off, as every trainer does
for a trainable model (a cache in training is a finding of its own).
"""

from __future__ import annotations

import torch
from setups import batch, tiny_llama, tiny_lora, tiny_trainer, train_step
from setups_dtypes import alarms, finite

import mpdoctor


def test_fp32_weights_with_bf16_autocast_and_adamw():
    model = tiny_llama(use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert finite(train_step(model, opt, autocast_dtype=torch.bfloat16))
    assert alarms(mpdoctor.diagnose(namespace={"model": model, "opt": opt})) == []


def test_fp32_weights_with_fp16_autocast_and_a_grad_scaler():
    model = tiny_llama(use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    assert finite(train_step(model, opt, scaler=scaler, autocast_dtype=torch.float16))
    assert alarms(mpdoctor.diagnose(namespace={"model": model, "opt": opt, "scaler": scaler})) == []


def test_bf16_weights_with_adamw_bf16():
    from adamw_bf16 import AdamWBF16

    model = tiny_llama(torch.bfloat16, use_cache=False)
    opt = AdamWBF16(model.parameters(), lr=1e-3)
    assert finite(train_step(model, opt))
    assert alarms(mpdoctor.diagnose(namespace={"model": model, "opt": opt})) == []


def test_a_model_in_eval_mode_with_the_cache_on():
    model = tiny_llama(train=False, use_cache=True)
    with torch.no_grad():
        assert model(**batch()).past_key_values is not None  # the cache is what generation wants
    assert alarms(mpdoctor.diagnose(namespace={"model": model})) == []


def test_serving_in_the_kernel_a_bf16_model_its_own_cache_and_a_mask_in_its_dtype():
    """After fine-tuning, generate in bf16: a cache the model filled itself, a 4D mask built with bf16's finfo.min
    (its left-padded rows fully masked, finite), and a generation probe."""
    model = tiny_llama(torch.bfloat16, train=False)
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    padding = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    allowed = torch.tril(torch.ones(5, 5, dtype=torch.bool))[None, None] & padding[:, None, None, :].bool()
    mask = torch.zeros(2, 1, 5, 5, dtype=torch.bfloat16).masked_fill(~allowed, torch.finfo(torch.bfloat16).min)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
    assert torch.isfinite(out.logits).all()
    cache = out.past_key_values
    assert alarms(mpdoctor.diagnose(namespace={"model": model, "cache": cache, "mask": mask})) == []
    assert alarms(mpdoctor.probe(model, {"input_ids": ids[1:]}, generate=True, max_new_tokens=3)) == []


def test_a_bf16_trainer_on_the_cpu_in_a_clean_environment():
    trainer = tiny_trainer(bf16=True)  # conftest clears ACCELERATE_* variables
    assert trainer.accelerator.mixed_precision == "bf16"
    result = trainer.train()
    assert finite(result.training_loss)
    assert alarms(mpdoctor.diagnose(namespace={"trainer": trainer})) == []


def test_a_peft_lora_model_with_fp32_adapters_on_a_bf16_base():
    model = tiny_lora()
    model.config.use_cache = False
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    assert finite(train_step(model, opt))  # PEFT casts the bf16 activations to the fp32 adapters and back
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert trainable == {torch.float32} and frozen == {torch.bfloat16}
    assert alarms(mpdoctor.diagnose(namespace={"model": model, "opt": opt})) == []
