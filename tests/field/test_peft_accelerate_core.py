"""Field cases from the peft and accelerate trackers: fp16 adapters under a loss scaler."""

from __future__ import annotations

import pytest
import torch
from setups import batch, tiny_llama, tiny_trainer
from setups_dtypes import finite

import mpdoctor


def fp16_lora():
    """LoRA on an fp16 base with the adapters left in fp16 (``autocast_adapter_dtype=False``)."""
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(torch.float16, use_cache=False)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return get_peft_model(base, config, autocast_adapter_dtype=False)


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def test_fp16_lora_adapters_under_a_grad_scaler_raise_at_unscale_and_fp32_adapters_train():
    """oobabooga/textgen PR #5268 ("Attempting to unscale FP16 gradients" training LoRA on a V100,
    fixed with huggingface/peft PR #1336, which later became ``autocast_adapter_dtype=True``).

    https://github.com/oobabooga/textgen/pull/5268 -- https://github.com/huggingface/peft/pull/1706
    """
    model = fp16_lora()
    opt = torch.optim.AdamW(trainable(model), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(**batch()).loss
    scaler.scale(loss).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.step(opt)
    opt.zero_grad()

    report = mpdoctor.diagnose(model, opt, scaler)
    (finding,) = report.findings_for("fp16-trainable-params-with-scaler")
    assert finding.severity == "error" and "8 trainable parameters" in finding.message
    plan = [f for f in report.fixes if f.recipe == "fp32-master-weights"]
    assert len(plan) == 1  # the same cast also cures the fp16 Adam eps
    plan[0].apply()
    assert all(p.dtype == torch.float32 for p in trainable(model))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(**batch()).loss
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert finite(loss.item()) and scaler.get_scale() == 65536.0  # no overflow: the step was taken
    assert not mpdoctor.diagnose(model, opt, scaler).findings_for("fp16-trainable-params-with-scaler")


def test_accelerate_clip_grad_norm_unscales_fp16_adapters_and_raises():
    """huggingface/transformers#30559 (Idefics2 LoRA: ``accelerator.clip_grad_norm_`` -> ``unscale_gradients`` ->
    "Attempting to unscale FP16 gradients"); huggingface/accelerate#3269 (an fp16 model under fp16 mixed precision).

    GPU-only: on this CPU ``Accelerator(mixed_precision="fp16")`` runs without native AMP and creates no scaler.
    The stand-in gives the Accelerator the two things a CUDA one holds (``native_amp`` and a ``GradScaler``) before
    ``prepare``; the rest is accelerate's own code.

    https://github.com/huggingface/transformers/issues/30559 -- https://github.com/huggingface/accelerate/issues/3269
    """
    from accelerate import Accelerator

    acc = Accelerator(mixed_precision="fp16", cpu=True)
    acc.native_amp, acc.scaler = True, torch.amp.GradScaler("cpu")  # what a CUDA Accelerator holds
    model = fp16_lora()
    model, opt = acc.prepare(model, torch.optim.AdamW(trainable(model), lr=1e-3))
    acc.backward(model(**batch()).loss)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        acc.clip_grad_norm_(model.parameters(), 1.0)
    opt.zero_grad()

    report = mpdoctor.diagnose(model, opt, acc)
    (finding,) = report.findings_for("fp16-trainable-params-with-scaler")
    assert finding.severity == "error"
    (fix,) = [f for f in report.fixes if f.recipe == "fp32-master-weights"]
    fix.apply()
    loss = model(**batch()).loss
    acc.backward(loss)
    acc.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    assert finite(loss.item())


def test_prepare_for_kbit_training_on_an_unquantized_bf16_model_doubles_the_frozen_base_and_the_cast_back_trains():
    """huggingface/peft#1149 and bitsandbytes#1569 ("peft casts data from 16 to 32 bits"):
    ``prepare_model_for_kbit_training`` upcasts every non-4-bit parameter to fp32, so on a model that is not
    quantized the whole frozen base doubles; the maintainers' fix is not to call it without quantization.

    https://github.com/huggingface/peft/issues/1149 -- https://github.com/bitsandbytes-foundation/bitsandbytes/issues/1569
    """
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    base = tiny_llama(torch.bfloat16, use_cache=False)
    base.config.dtype = torch.bfloat16  # what from_pretrained(..., dtype=torch.bfloat16) records
    loaded = sum(p.numel() * p.element_size() for p in base.parameters())
    model = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    opt = torch.optim.AdamW(trainable(model), lr=1e-3)

    def frozen_bytes():
        return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)

    assert frozen_bytes() > 1.9 * loaded  # the measured harm: the frozen base in fp32

    report = mpdoctor.diagnose(model, opt)
    (finding,) = [f for f in report.findings_for("load-dtype-mismatch") if f.severity == "warning"]
    assert "frozen" in finding.message and "prepare_model_for_kbit_training" in finding.message
    fix = finding.fixes[0]
    adapters = {id(p): p.dtype for p in trainable(model)}
    fix.apply(confirm=True)
    assert frozen_bytes() <= loaded  # back to the checkpoint's bytes
    assert {id(p): p.dtype for p in trainable(model)} == adapters  # the trained adapters keep their master weights
    before = [p.detach().clone() for p in trainable(model)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch()).loss
    loss.backward()
    opt.step()
    assert finite(loss.item()) and all(not torch.equal(a, p) for a, p in zip(before, trainable(model)))
    fix.undo()
    assert frozen_bytes() > 1.9 * loaded


def test_a_model_trained_in_full_fp32_from_a_bf16_checkpoint_holds_master_weights_and_is_not_warned():
    """Every parameter trains: fp32 master weights under autocast are right, whatever the checkpoint's dtype."""
    model = tiny_llama(torch.float32, use_cache=False)
    model.config.dtype = torch.bfloat16
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    findings = mpdoctor.diagnose(model, opt).findings_for("load-dtype-mismatch")
    assert findings and all(f.severity == "info" for f in findings)


def test_fp32_norms_beside_bf16_layers_run_under_the_trainers_autocast_but_generate_raises_and_the_cast_cures_it():
    """huggingface/peft#1515 and trl#1398: TRL's ``peft_module_casting_to_bf16`` left the norms fp32 and the rest bf16;
    training works under the Trainer's autocast, ``model.generate`` in a callback (outside it) raises.

    https://github.com/huggingface/peft/issues/1515 -- https://github.com/huggingface/trl/issues/1398
    """
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(torch.bfloat16, use_cache=False),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))  # fmt: skip
    model.to(torch.bfloat16)
    for name, module in model.named_modules():
        if "norm" in name:
            module.to(torch.float32)  # TRL's cast at the time
    trainer = tiny_trainer(model, bf16=True)
    ids = batch()["input_ids"][:1, :4]
    with pytest.raises(RuntimeError, match="same dtype"):
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False)

    report = mpdoctor.diagnose(model, trainer)
    (finding,) = report.findings_for("mixed-param-dtypes")
    assert finding.severity == "warning" and "generate" in finding.message and "float32" in finding.message
    fix = finding.fixes[0]
    fix.apply(confirm=True)
    out = model.generate(input_ids=ids, max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 6)
    opt = torch.optim.AdamW(trainable(model), lr=1e-3)
    before = [p.detach().clone() for p in trainable(model)]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the Trainer's step still trains
        loss = model(**batch()).loss
    loss.backward()
    opt.step()
    changed = [n for (n, p), a in zip([(n, p) for n, p in model.named_parameters() if p.requires_grad], before)
               if not torch.equal(a, p)]  # fmt: skip
    assert finite(loss.item()) and changed and all("lora_B" in n for n in changed)  # B moves first: it starts at 0
    fix.undo()
    assert {p.dtype for n, p in model.named_parameters() if "norm" in n} == {torch.float32}


def test_fp32_norms_under_a_trainer_on_a_model_that_does_not_generate_are_not_warned():
    """A Trainer's autocast covers every call of a model that is only trained (no generate)."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)).to(torch.bfloat16)
    net[1].float()
    trainer = tiny_trainer(tiny_llama(torch.bfloat16), bf16=True)
    assert not [f for f in mpdoctor.diagnose(net, trainer).findings_for("mixed-param-dtypes")
                if f.severity in ("error", "warning") and "generate" in f.message]  # fmt: skip
