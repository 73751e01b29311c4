"""Every fixed-in-place field case of the core corpus, cured on the user's own failing step: once through
``fix.apply()``, once through the fix's button in the widget (unsafe fixes with their confirming second click).

One entry per case (``tests/cure.py``: the builder of the user's objects, the failing step, what it did, the slug).
Each test first shows the real error or measured harm, then the diagnosis naming the slug, the planned fix applied
in place, and the very step that failed run again: it trains. Stack libraries' cases are in
``tests/stack/test_cures_stack.py``. The fragments of ``docs/field-cases/`` name these entries.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers as T
from amp_loops import checkpoint_after, resumed, scaled_step
from cure import Case, Namespace, assert_broken, cure_through_api, cure_through_widget
from setups import VOCAB, batch, tiny_llama, tiny_lora, train_step

import mpdoctor

sys.path.insert(0, str(Path(__file__).resolve().parent / "field"))  # the field tests' own builders

from test_exception_cases import Guided, Pooler, Router, TinyAttention  # noqa: E402
from test_peft_accelerate_core import fp16_lora, trainable  # noqa: E402
from test_runtime_batch_nan_cases import Encoder, normalized_head  # noqa: E402
from test_torch_core import fp16_llama_and_adamw, overflowing_llama  # noqa: E402
from test_transformers_core import closed_form_inv_freq, long_context_llama, rope_phase_error  # noqa: E402


def _model_and_adamw(model: torch.nn.Module, lr: float = 1e-3, **extra) -> Namespace:
    return {"model": model, "opt": torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr), **extra}


def _two_steps(ns: Namespace) -> float:
    # The user's loop: the first step's loss is fine, the second reads the NaN the first wrote.
    train_step(ns["model"], ns["opt"])
    return train_step(ns["model"], ns["opt"])


def _step(ns: Namespace) -> float:
    return train_step(ns["model"], ns["opt"], inputs=ns.get("inputs"))


# -- torch core ------------------------------------------------------------------------------------


def _adam_eps() -> Namespace:
    model, opt = fp16_llama_and_adamw()
    return {"model": model, "opt": opt}


def _half_after_step() -> Namespace:
    ns = _model_and_adamw(tiny_llama(use_cache=False))
    train_step(ns["model"], ns["opt"])
    ns["model"].half()  # NVIDIA/apex#32: the cast after the optimizer holds fp32 state
    return ns


def _pure_bf16_linear() -> Namespace:
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.fill_(1.0)
        lin.bias.fill_(1.0)  # every weight near one, where bf16's spacing is 2**-7
    return {"lin": lin, "opt": torch.optim.AdamW(lin.parameters(), lr=6e-4, weight_decay=0.0)}


def _bf16_linear_step(ns: Namespace) -> torch.Tensor:
    lin, opt = ns["lin"], ns["opt"]
    opt.zero_grad()
    g = torch.Generator().manual_seed(1)
    loss = lin(torch.randn(4, 16, generator=g).to(lin.weight.dtype)).float().pow(2).mean()
    loss.backward()
    opt.step()
    return loss


# -- transformers core ------------------------------------------------------------------------------


def _rope_bf16() -> Namespace:
    return _model_and_adamw(long_context_llama().to(torch.bfloat16))


def _rope_error(positions: int, theta: float, dim: int, rotary: str) -> tuple:
    def measure(ns: Namespace) -> float:
        module = ns["model"].get_submodule(rotary)
        return rope_phase_error(module, positions, closed_form_inv_freq(theta, dim).float())

    def harm(ns: Namespace) -> None:
        assert measure(ns) > 0.2, "the half-precision frequencies must put the far positions off by > 0.2 rad"

    def healed(ns: Namespace) -> None:
        assert measure(ns) < 1e-3

    return harm, healed


def _neox_fp16() -> Namespace:
    torch.manual_seed(0)
    config = T.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=1, num_attention_heads=1, intermediate_size=32,
        max_position_embeddings=8192, rotary_pct=0.25, use_cache=False,
    )  # fmt: skip
    model = T.GPTNeoXForCausalLM(config).half()
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=1e-3)}


def _t5_overflowing() -> Namespace:
    torch.manual_seed(0)
    config = T.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, use_cache=False,
    )  # fmt: skip
    t5 = T.T5ForConditionalGeneration(config)
    ff = t5.encoder.block[0].layer[1].DenseReluDense
    with torch.no_grad():
        ff.wi.weight.fill_(1.0)
        ff.wo.weight.fill_(3000.0)
    g = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(1, VOCAB, (2, 8), generator=g), "labels": torch.randint(1, VOCAB, (2, 8), generator=g)}
    return _model_and_adamw(t5.half(), lr=1e-4, inputs=inputs)


def _gemma2_overflowing() -> Namespace:
    torch.manual_seed(0)
    config = T.Gemma2Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, use_cache=False,
    )  # fmt: skip
    model = T.Gemma2ForCausalLM(config)
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        mlp.gate_proj.weight.fill_(1.0)
        mlp.up_proj.weight.fill_(1.0)
        mlp.down_proj.weight.fill_(300.0)
    return _model_and_adamw(model.half(), lr=1e-4, inputs=batch())


def _fp16_llama_with_a_float32_min_mask() -> Namespace:
    # transformers PR #17306: a 4D additive mask filled with float32's finfo.min, cast to the fp16 model's dtype.
    model = tiny_llama(torch.float16, use_cache=False)
    model.config._attn_implementation = "eager"  # the softmax path of the report
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    keep = torch.ones(2, 8)
    keep[0, :3] = 0  # left padding: its query rows allow no key
    allowed = torch.tril(torch.ones(8, 8))[None, None] * keep[:, None, None, :]
    mask = ((1.0 - allowed) * torch.finfo(torch.float32).min).half()  # -3.4e38 is -inf in fp16
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1),
            "inputs": {"input_ids": ids, "attention_mask": mask, "labels": ids}}  # fmt: skip


def _probe(ns: Namespace):
    return mpdoctor.probe(ns["model"], ns.get("inputs") or batch(), name="model")


def _flash_attention_fp32() -> Namespace:
    model = tiny_llama(use_cache=False)
    model.config._attn_implementation = "flash_attention_2"  # the config a GPU run holds (stand-in)
    return _model_and_adamw(model)


def _fp32_head_on_bf16_lora() -> Namespace:
    model = tiny_lora(torch.bfloat16)
    model.config.use_cache = False
    model.base_model.model.lm_head.float()  # what prepare_model_for_kbit_training leaves
    return _model_and_adamw(model)


def _train_under_autocast_then_generate(ns: Namespace) -> float:
    # peft#1515: the Trainer's bf16 autocast step, then generate() in a callback, outside autocast.
    loss = train_step(ns["model"], ns["opt"], autocast_dtype=torch.bfloat16)
    prompt = batch()["input_ids"][:, :4]
    ns["model"].generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2)
    return loss


def _bf16_arguments_for_a_v100() -> Namespace:
    from setups import training_args

    return {"model": tiny_llama(use_cache=False), "args": training_args(bf16=True)}  # alpaca's train.py flags


def _trainer_train(ns: Namespace) -> float:
    # stanford_alpaca's train.py: the Trainer built from the model and the arguments, then train().
    from setups import TinyDataset

    return T.Trainer(model=ns["model"], args=ns["args"], train_dataset=TinyDataset()).train().training_loss


def _v100_refusal(ns: Namespace) -> None:
    # The refusal itself is GPU-only; transformers' own test refuses bf16 here too once use_cpu is off.
    with pytest.raises(ValueError, match="Your setup doesn't support bf16/gpu"):
        T.TrainingArguments(output_dir=ns["args"].output_dir, bf16=True, report_to=[])


def _fp16_arguments(ns: Namespace) -> None:
    assert ns["args"].fp16 and not ns["args"].bf16  # what a V100 runs: fp16 autocast over fp32 master weights
    assert {p.dtype for p in ns["model"].parameters()} == {torch.float32}


def _collapsed_scaler() -> Namespace:
    # insightface#2262: fp16 autocast over an activation past 65504; 20 skipped steps drove the scale down.
    ns = _model_and_adamw(overflowing_llama())
    ns["scaler"] = torch.amp.GradScaler("cpu")
    for _ in range(20):
        train_step(ns["model"], ns["opt"], scaler=ns["scaler"], autocast_dtype=torch.float16)
    return ns


def _scaled_fp16_autocast_step(ns: Namespace) -> float:
    return train_step(ns["model"], ns["opt"], scaler=ns["scaler"], autocast_dtype=torch.float16)


def _scale_collapsed(ns: Namespace) -> None:
    assert ns["scaler"].get_scale() < 1.0, "the loss scale must have been driven below 1"


def _probe_with_scaler(ns: Namespace):
    return mpdoctor.probe(ns["model"], batch(), scaler=ns["scaler"], autocast=torch.float16, name="model")


# -- peft / accelerate core ------------------------------------------------------------------------


def _fp16_lora_with_scaler() -> Namespace:
    model = fp16_lora()
    return {"model": model, "opt": torch.optim.AdamW(trainable(model), lr=1e-3), "scaler": torch.amp.GradScaler("cpu")}


def _scaled_fp16_step(ns: Namespace) -> torch.Tensor:
    model, opt, scaler = ns["model"], ns["opt"], ns["scaler"]
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(**batch()).loss
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss


def _accelerate_fp16_lora() -> Namespace:
    from accelerate import Accelerator

    acc = Accelerator(mixed_precision="fp16", cpu=True)
    acc.native_amp, acc.scaler = True, torch.amp.GradScaler("cpu")  # what a CUDA Accelerator holds (stand-in)
    model = fp16_lora()
    model, opt = acc.prepare(model, torch.optim.AdamW(trainable(model), lr=1e-3))
    return {"acc": acc, "model": model, "opt": opt}


def _accelerate_clipped_step(ns: Namespace) -> torch.Tensor:
    acc, model, opt = ns["acc"], ns["model"], ns["opt"]
    opt.zero_grad()
    loss = model(**batch()).loss
    acc.backward(loss)
    acc.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


# -- the run as patient: the batch at the boundary, where a NaN is born ---------------------------


def _fp16_convnext() -> Namespace:
    torch.manual_seed(0)
    config = T.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1], num_labels=3)
    model = T.ConvNextForImageClassification(config).half()
    inputs = T.BatchFeature({"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([0, 1])})
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=1.0), "inputs": inputs}


def _bf16_llama_fed_fp32_embeds() -> Namespace:
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    model = T.LlamaForCausalLM(config).to(torch.bfloat16)
    inputs = {"inputs_embeds": torch.randn(2, 5, 32), "labels": torch.randint(0, 100, (2, 5))}
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=1.0), "inputs": inputs}


def _crash_inside_watch(ns: Namespace):
    # The user's step raises inside watch(); the crash report is the diagnosis they get.
    with pytest.raises(RuntimeError), mpdoctor.watch(ns["model"]) as w:
        _step(ns)
    return w.crash_report


def _routers_under_fp16_autocast() -> Namespace:
    torch.manual_seed(0)
    model = torch.nn.Sequential(Router(), Router())
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1),
            "x": torch.randn(4, 4), "rows": torch.tensor([0, 2])}  # fmt: skip


def _routers_step(ns: Namespace) -> torch.Tensor:
    ns["opt"].zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = sum(r(ns["x"], ns["rows"]) for r in ns["model"]).square().sum()
    loss.backward()
    ns["opt"].step()
    return loss


def _bf16_pooler() -> Namespace:
    torch.manual_seed(0)
    model = Pooler()
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "ids": torch.tensor([1, 2, 3, 4]),
            "sentence": torch.tensor([0, 0, 1, 1]), "mask": torch.tensor([1, 1, 1, 0])}  # fmt: skip


def _pooler_step(ns: Namespace) -> torch.Tensor:
    ns["opt"].zero_grad()
    loss = ns["model"](ns["ids"], ns["sentence"], ns["mask"]).float().square().sum()
    loss.backward()
    ns["opt"].step()
    return loss


def _fp8_guided() -> Namespace:
    torch.manual_seed(0)
    model = Guided()
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "latent": torch.randn(2, 4)}


def _guided_step(ns: Namespace) -> torch.Tensor:
    ns["opt"].zero_grad()
    loss = ns["model"](ns["latent"]).square().sum()
    loss.backward()
    ns["opt"].step()
    return loss


def _attention_with_int_mask() -> Namespace:
    torch.manual_seed(0)
    model = TinyAttention()
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "hidden": torch.randn(1, 3, 4),
            "attention_mask": torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0]])}  # fmt: skip


def _attention_step(ns: Namespace) -> torch.Tensor:
    ns["opt"].zero_grad()
    loss = ns["model"](ns["hidden"], ns["attention_mask"]).square().sum()
    loss.backward()
    ns["opt"].step()
    return loss


def _crash_of(step):
    """The crash report of ``step`` raised inside ``watch()``: the diagnosis the user gets."""

    def diagnose(ns: Namespace):
        with pytest.raises(RuntimeError), mpdoctor.watch(ns["model"], ns["opt"]) as w:
            step(ns)
        return w.crash_report

    return diagnose


def _fp16_encoder_eps_1e12() -> Namespace:
    torch.manual_seed(0)
    model = Encoder().half()
    ids = torch.tensor([[3, 4, 0, 0], [5, 6, 7, 0]])  # padding rows embed to zeros: zero variance
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=1.0), "ids": ids}


def _encoder_step(ns: Namespace) -> torch.Tensor:
    ns["opt"].zero_grad()
    loss = ns["model"](ns["ids"])
    loss.backward()
    ns["opt"].step()
    return loss


def _fp16_normalized_head() -> Namespace:
    model, x = normalized_head()
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=1.0), "x": x}


def _normalized_head_step(ns: Namespace) -> torch.Tensor:
    ns["opt"].zero_grad()
    loss = ns["model"](ns["x"]).float().sum()
    loss.backward()
    ns["opt"].step()
    return loss


def _t5_wo_past_65504() -> Namespace:
    torch.manual_seed(0)
    config = T.T5Config(vocab_size=100, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                        num_heads=2, decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    model = T.T5ForConditionalGeneration(config).half()
    with torch.no_grad():  # tiny random weights stay small: wo scaled until its output passes 65504
        model.encoder.block[0].layer[1].DenseReluDense.wo.weight.mul_(60000.0)
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=1e-2), "inputs": {"input_ids": ids, "labels": ids.clone()}}


_NEOX = _rope_error(8192, 10000.0, 64, "gpt_neox.rotary_emb")
_LLAMA_ROPE = _rope_error(4096, 10000.0, 32, "model.rotary_emb")

CASES: list[Case] = [
    Case(
        name="adam-eps-fp16-llama", source="pytorch/pytorch#8860", slug="adam-eps-underflow",
        build=_adam_eps, step=_two_steps, failure="loss is not finite",
    ),
    Case(
        name="half-after-optimizer-step", source="NVIDIA/apex#32", slug="optimizer-state-dtype-mismatch",
        build=_half_after_step, step=_step, failure=r"expected dtype float .* but got dtype c10::Half",
        fixed_by="adam-eps-underflow",  # one fp32-master-weights cast cures both findings
    ),
    Case(
        name="bf16-arguments-on-a-v100", source="tatsu-lab/stanford_alpaca#133", slug="bf16-unsupported",
        build=_bf16_arguments_for_a_v100, step=_trainer_train, failure="trains",  # GPU-only: trains on this CPU
        diagnose=lambda ns: mpdoctor.diagnose(ns["model"], ns["args"], target="V100"),
        params=lambda ns: list(ns["model"].parameters()), harm=_v100_refusal, healed=_fp16_arguments,
    ),
    Case(
        name="pure-bf16-adamw-frozen-weights", source="workofart/ml-by-hand PR #85", slug="pure-bf16-adamw",
        build=_pure_bf16_linear, step=_bf16_linear_step, failure="changed no parameter",
    ),
    Case(
        name="llama-rope-bf16", source="huggingface/transformers#29496", slug="half-precision-rope-buffers",
        build=_rope_bf16, step=_step, failure="trains", harm=_LLAMA_ROPE[0], healed=_LLAMA_ROPE[1],
    ),
    Case(
        name="gpt-neox-rope-fp16", source="EleutherAI/gpt-neox#1003", slug="half-precision-rope-buffers",
        build=_neox_fp16, step=_step, failure="trains", harm=_NEOX[0], healed=_NEOX[1],
    ),
    Case(
        name="fp16-scale-collapsed-by-an-overflowing-layer", source="deepinsight/insightface#2262",
        slug="probe-nonfinite", build=_collapsed_scaler, step=_scaled_fp16_autocast_step,
        failure="loss is not finite", diagnose=_probe_with_scaler, recipe="fp32-module", harm=_scale_collapsed,
    ),
    Case(
        name="float32-min-mask-in-fp16", source="huggingface/transformers PR #17306", slug="probe-nonfinite",
        build=_fp16_llama_with_a_float32_min_mask, step=_step, failure="loss is not finite", diagnose=_probe,
        fixed_by="attention-mask-overflow",  # the probe plans the one clamp both findings offer, under the mask check
    ),
    Case(
        name="t5-fp16-feed-forward-overflow", source="huggingface/transformers#4586", slug="probe-nonfinite",
        build=_t5_overflowing, step=_step, failure="loss is not finite", diagnose=_probe, recipe="bf16",
    ),
    Case(
        name="gemma2-fp16-mlp-overflow", source="google/gemma_pytorch#24", slug="probe-nonfinite",
        build=_gemma2_overflowing, step=_step, failure="loss is not finite", diagnose=_probe, recipe="bf16",
    ),
    Case(
        name="flash-attention-2-on-fp32", source="QwenLM/Qwen3#406", slug="flash-attention-fp32",
        build=_flash_attention_fp32, step=_step, failure=r"ImportError",  # the CPU stand-in for the GPU's refusal
    ),
    Case(
        name="fp32-lm-head-generate", source="huggingface/peft#1515", slug="mixed-param-dtypes",
        build=_fp32_head_on_bf16_lora, step=_train_under_autocast_then_generate,
        failure="expected scalar type Float but found BFloat16|same dtype",
    ),
    Case(
        name="fp16-lora-under-grad-scaler", source="oobabooga/textgen PR #5268", slug="fp16-trainable-params-with-scaler",
        build=_fp16_lora_with_scaler, step=_scaled_fp16_step, failure="Attempting to unscale FP16 gradients",
        fixed_by="adam-eps-underflow",  # one fp32-master-weights cast cures both findings
    ),
    Case(
        name="accelerate-clip-fp16-adapters", source="huggingface/transformers#30559",
        slug="fp16-trainable-params-with-scaler",
        build=_accelerate_fp16_lora, step=_accelerate_clipped_step, failure="Attempting to unscale FP16 gradients",
        fixed_by="adam-eps-underflow",
    ),
    Case(
        name="fp32-image-into-fp16-convnext", source="DepthAnything/Depth-Anything-V2#264", slug="batch-dtype-mismatch",
        build=_fp16_convnext, step=_step, failure=r"Input type \(float\) and bias type \(c10::Half\) should be the same",
        diagnose=_probe,
    ),
    Case(
        name="fp32-embeds-into-bf16-llama-in-watch", source="QwenLM/Qwen3-VL#246", slug="batch-dtype-mismatch",
        build=_bf16_llama_fed_fp32_embeds, step=_step,
        failure=r"expected m(at)?1 and m(at)?2 to have the same dtype, but got: float != c10::BFloat16",
        diagnose=_crash_inside_watch,
    ),
    Case(
        name="layer-norm-eps-1e-12-fp16", source="deepspeedai/DeepSpeed#581", slug="probe-nonfinite",
        build=_fp16_encoder_eps_1e12, step=_encoder_step, failure="loss is not finite", recipe="representable-eps",
        fixed_by="norm-eps-underflow",  # the probe plans the one eps fix both findings offer, under the eps check
        diagnose=lambda ns: mpdoctor.probe(ns["model"], ns["ids"], loss_fn=lambda out: out, name="model"),
    ),
    Case(
        name="index-put-autocast-fp16-into-fp32-buffer", source="continue-revolution/sd-webui-animatediff#168",
        slug="crash-index-put-dtype", build=_routers_under_fp16_autocast, step=_routers_step,
        failure="Index put requires the source and destination dtypes match", diagnose=_crash_of(_routers_step),
        recipe="fp32-island",
    ),
    Case(
        name="scatter-fp32-mask-into-bf16-counts", source="flairNLP/flair PR #3651", slug="crash-scatter-dtype",
        build=_bf16_pooler, step=_pooler_step, failure=r"scatter\(\): Expected self.dtype to be equal to src.dtype",
        diagnose=_crash_of(_pooler_step), recipe="fp32-island",
    ),
    Case(
        name="fp8-buffer-promoted-with-fp32", source="Comfy-Org/ComfyUI#4474", slug="crash-fp8-promotion",
        build=_fp8_guided, step=_guided_step, failure="Promotion for Float8 Types is not supported",
        diagnose=_crash_of(_guided_step), recipe="cast-held-operand",
    ),
    Case(
        name="int64-attention-mask-into-sdpa", source="seal-rg/recurrent-pretraining#23",
        slug="crash-attention-mask-dtype", build=_attention_with_int_mask, step=_attention_step,
        failure="Expected attn_mask dtype to be bool or float", diagnose=_crash_of(_attention_step),
        recipe="bool-mask-at-forward",
    ),
    Case(
        name="f-normalize-eps-zero-in-fp16", source="pytorch/pytorch#32137", slug="probe-nonfinite",
        build=_fp16_normalized_head, step=_normalized_head_step, failure="loss is not finite", recipe="fp32-module",
        diagnose=lambda ns: mpdoctor.probe(ns["model"], ns["x"], loss_fn=lambda out: out.float().sum(), name="model"),
    ),
    Case(
        name="scaler-state-held-not-loaded-on-resume", source="huggingface/transformers PR #11663",
        slug="scaler-not-restored-on-resume", build=lambda: resumed(checkpoint_after()),
        step=lambda ns: scaled_step(ns["model"], ns["opt"], ns["scaler"]),
        failure="changed no parameter",  # the fresh scale 65536 overflows: the resumed step is skipped
    ),
    Case(
        name="t5-wo-past-65504", source="huggingface/transformers#5651", slug="probe-nonfinite",
        build=_t5_wo_past_65504, step=_step, failure="loss is not finite", diagnose=_probe, recipe="bf16",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_failing_step_fails_then_trains_after_the_planned_fix_applied_through_the_api(case: Case):
    assert_broken(case)
    cure_through_api(case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_failing_step_trains_after_the_planned_fix_is_clicked_in_the_widget(case: Case):
    cure_through_widget(case)


def test_the_registry_names_each_case_once():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))


def test_the_outcome_of_a_step_tells_a_raise_a_nan_a_frozen_step_and_a_trained_one_apart():
    """The harness can fail: each way a step does not train is told apart from a step that trains."""
    from cure import outcome

    def case(step) -> Case:
        return Case(name="x", source="x", slug="x", build=dict, step=step, failure="")

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 1)
    ns = {"opt": torch.optim.SGD(lin.parameters(), lr=0.1)}

    def trains(ns, scale=1.0):
        ns["opt"].zero_grad()
        loss = lin(torch.ones(2, 4)).pow(2).mean() * scale
        loss.backward()
        ns["opt"].step()
        return loss

    def raises(ns):
        return lin(torch.ones(2, 4, dtype=torch.float16))

    assert outcome(case(raises), ns).startswith("RuntimeError: ")
    assert "changed no parameter" in outcome(case(lambda ns: lin(torch.ones(2, 4)).sum()), ns)
    assert outcome(case(trains), ns) == "trains"
    assert "loss is not finite" in outcome(case(lambda ns: trains(ns, float("nan"))), ns)  # last: it writes NaN


def test_the_outcome_of_an_inference_step_tells_a_raise_and_a_non_finite_output_from_one_that_runs():
    """An inference case's step trains nothing: it must run and return finite output, and the harness can fail."""
    from cure import outcome

    def case(step) -> Case:
        return Case(name="x", source="x", slug="x", build=dict, step=step, failure="", kind="inference")

    lin = torch.nn.Linear(4, 2).half()
    x = torch.ones(1, 4)
    assert outcome(case(lambda ns: lin(x)), {}).startswith("RuntimeError: ")
    assert outcome(case(lambda ns: {"images": lin(x.half()) * float("inf")}), {}) == "output is not finite"
    assert outcome(case(lambda ns: "no tensor"), {}).startswith("the call returned no floating tensor")
    assert outcome(case(lambda ns: (lin(x.half()), None)), {}) == "runs"
