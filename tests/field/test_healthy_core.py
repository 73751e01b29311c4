"""Healthy recipes from the torch, transformers, accelerate and peft docs: no error and no warning.

Complements ``tests/test_healthy_recipes.py`` with the recipes it does not cover. Each trains (or generates)
for real first, so "healthy" is measured, then the whole report is asserted free of errors and warnings.
"""

from __future__ import annotations

import torch
from setups import TinyDataset, batch, tiny_llama, train_step, training_args
from setups_dtypes import alarms, finite

import mpdoctor


def saved_bf16_llama(path):
    tiny_llama(torch.bfloat16).save_pretrained(path)
    return path


def test_torch_amp_fp16_with_unscale_before_gradient_clipping():
    """PyTorch AMP examples, "Gradient clipping": scale, backward, ``unscale_``, clip, ``step``, ``update``."""
    model = tiny_llama(use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(2):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**batch()).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    assert finite(loss.item()) and scaler.get_scale() == 65536.0
    assert alarms(mpdoctor.diagnose(namespace={"model": model, "opt": opt, "scaler": scaler})) == []


def test_accelerate_bf16_mixed_precision_on_fp32_weights():
    """accelerate quicktour: ``Accelerator(mixed_precision="bf16")``, ``prepare``, ``accelerator.backward``."""
    from accelerate import Accelerator

    acc = Accelerator(mixed_precision="bf16", cpu=True)
    model = tiny_llama(use_cache=False)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for _ in range(2):
        opt.zero_grad()
        loss = model(**batch()).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    assert finite(loss.item()) and acc.mixed_precision == "bf16"
    assert alarms(mpdoctor.diagnose(namespace={"accelerator": acc, "model": model, "opt": opt})) == []


def test_from_pretrained_in_bf16_then_lora_under_a_bf16_trainer(tmp_path):
    """PEFT quicktour + transformers "Efficient training": load in the checkpoint's dtype, ``get_peft_model`` (fp32
    adapters by default, ``autocast_adapter_dtype=True``), ``Trainer(bf16=True)``."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM, Trainer

    base = LlamaForCausalLM.from_pretrained(saved_bf16_llama(tmp_path), dtype=torch.bfloat16)
    base.config.use_cache = False
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainer = Trainer(model=model, args=training_args(bf16=True, max_steps=2), train_dataset=TinyDataset())
    assert finite(trainer.train().training_loss)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert model.base_model.model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert alarms(mpdoctor.diagnose(namespace={"trainer": trainer})) == []


def test_a_default_fp32_trainer_with_its_default_fused_adamw():
    """transformers Trainer defaults: fp32 weights, ``optim="adamw_torch_fused"`` (fp32 math in the kernel)."""
    from transformers import Trainer

    trainer = Trainer(model=tiny_llama(use_cache=False), args=training_args(max_steps=2), train_dataset=TinyDataset())
    assert finite(trainer.train().training_loss)
    assert alarms(mpdoctor.diagnose(namespace={"trainer": trainer})) == []


def test_fp16_inference_with_generate_loaded_in_fp16(tmp_path):
    """transformers "Instantiate a big model" / generation docs: ``from_pretrained(dtype=torch.float16)`` for
    inference, ``generate`` under ``no_grad``; no optimizer, no scaler."""
    from transformers import LlamaForCausalLM

    tiny_llama(torch.float16).save_pretrained(tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float16).eval()
    prompt = batch()["input_ids"][:, :4]
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3)
    assert out.shape[1] == 7
    assert alarms(mpdoctor.diagnose(namespace={"model": model})) == []


def test_fp16_weights_with_an_eps_fp16_can_hold_train_without_nan():
    """The fix of afiaka87/glide-finetune PR #6 kept as a setup: pure fp16 weights, Adam ``eps=1e-4`` (representable
    in fp16). Not a docs recipe: it proves the eps check stays quiet once the eps is representable."""
    model = tiny_llama(torch.float16, use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    for _ in range(2):
        assert finite(train_step(model, opt))
    assert not torch.isnan(model.model.embed_tokens.weight).any()
    assert alarms(mpdoctor.diagnose(namespace={"model": model, "opt": opt})) == []
