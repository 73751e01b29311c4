"""The stack libraries' fixed-in-place field cases (diffusers, bitsandbytes, TRL), cured on the user's own failing step:
once through ``fix.apply()``, once through the fix's button in the widget. The same registry shape as
``tests/test_cures.py`` (``tests/cure.py``); here because the Colab venv lacks these libraries.
"""

from __future__ import annotations

import copy
import math
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import bitsandbytes as bnb  # plain imports: tests/stack runs where the stack is pinned, a missing one must fail
import pytest
import torch
from cure import Case, Namespace, assert_broken, cure_through_api, cure_through_widget
from peft import LoraConfig, get_peft_model

import mpdoctor

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the stack field tests' own builders

from test_field_bnb_torchao import load_4bit  # noqa: E402
from test_field_diffusers import (  # noqa: E402
    lora_unet,
    overflowing_vae,
    run_controlnet_pipe,
    run_pipe,
    tiny_controlnet_pipe,
    tiny_pipe,
    tiny_unet,
    unet_step,
)
from test_field_dora_float8 import adapter_step, dora_on_float8  # noqa: E402
from test_field_float8_activations import probe_tagger, tagger, tagger_step  # noqa: E402
from test_field_lowprecision import (  # noqa: E402
    LAUNCHER_FP8_ENV,
    Net,
    block_quantized_with_a_bf16_head,
    block_step,
    float8_layers,
    float8_quantized_with_a_zero_row,
    fp8_base_with_a_bf16_head,
    fp8_embedding_model,
    fp8_prepared_run,
    fp8_runs_bf16,
    fp8_runs_float8,
    fp8_step,
    fp8_stored_mlp,
    layerwise_cast_with_a_bf16_head,
    quantized_step,
    train_step,
)
from test_lightning_field_cases import SETTINGS, AdamRegressor, RecordingRegressor  # noqa: E402
from test_lightning_field_cases import loader as lightning_loader  # noqa: E402
from test_trl import BF16_REFUSED, build_tokenizer, common, dpo, large_logit_policy_and_fp16_reference, sft  # noqa: E402
from test_trl import tiny_llama as trl_llama  # noqa: E402

# -- diffusers ----------------------------------------------------------------------------------------


def _fp16_lora_unet() -> Namespace:
    unet = lora_unet().to(torch.float16)  # train_dreambooth_lora_sdxl.py --mixed_precision=fp16
    opt = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=1e-3)
    return {"unet": unet, "optimizer": opt, "scaler": torch.amp.GradScaler("cpu")}


def _fp16_unet() -> Namespace:
    unet = tiny_unet().to(torch.float16)  # train_dreambooth.py with the UNet loaded in fp16
    return {"unet": unet, "optimizer": torch.optim.AdamW(unet.parameters(), lr=1e-4), "scaler": torch.amp.GradScaler("cpu")}


def _unet_step(ns: Namespace) -> torch.Tensor:
    torch.manual_seed(1)  # the same noise and embeddings each time the step runs
    ns["optimizer"].zero_grad()
    return unet_step(ns["unet"], ns["optimizer"], ns["scaler"])


def _pipe_with_fp16_denoiser() -> Namespace:
    torch.manual_seed(0)
    pipe = tiny_pipe()
    pipe.unet.half()  # sdnext#1431: the denoiser and VAE cast, the text encoder left in fp32
    pipe.vae.half()
    return {"pipe": pipe}


def _pipe_call(ns: Namespace) -> torch.Tensor:
    # The user's inference call with their fp32 prompt embeddings, the same seed each time it runs.
    torch.manual_seed(1)
    return run_pipe(ns["pipe"], torch.float32)


def _fp16_controlnet_in_fp32_pipe() -> Namespace:
    return {"pipe": tiny_controlnet_pipe(1, torch.float16)}  # diffusers#7562: fp16 ControlNets, an fp32 pipeline


def _controlnet_pipe_call(ns: Namespace) -> torch.Tensor:
    return run_controlnet_pipe(ns["pipe"], 1)


def _diagnose_pipe(ns: Namespace):
    return mpdoctor.diagnose(ns["pipe"], names={id(ns["pipe"]): "pipe"})


# -- bitsandbytes -------------------------------------------------------------------------------------


def _qlora_fp32_compute() -> Namespace:
    model = load_4bit(tempfile.mkdtemp(prefix="mpdoctor-cure-"), torch.float32, torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    return {"model": model, "opt": torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)}


def _lora_step(ns: Namespace) -> torch.Tensor:
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    ns["opt"].zero_grad()
    loss = ns["model"](input_ids=ids, labels=ids).loss
    loss.backward()
    ns["opt"].step()
    return loss


def _linear4bit_explicit_fp32() -> Namespace:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), bnb.nn.Linear4bit(32, 32, compute_dtype=torch.float32))
    model = model.to(torch.bfloat16).to("cpu")
    return {"model": model, "opt": torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)}


def _bf16_step(ns: Namespace) -> torch.Tensor:
    ns["opt"].zero_grad()
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    loss = ns["model"](x).float().pow(2).mean()
    loss.backward()
    ns["opt"].step()
    return loss


def _compute_dtypes(ns: Namespace) -> set[torch.dtype]:
    return {m.compute_dtype for m in ns["model"].modules() if isinstance(m, bnb.nn.Linear4bit)}


def _computes_in_fp32(ns: Namespace) -> None:
    assert _compute_dtypes(ns) == {torch.float32}, "the harm: every 4-bit matmul runs in fp32 under a bf16 model"


def _computes_in_bf16(ns: Namespace) -> None:
    assert _compute_dtypes(ns) == {torch.bfloat16}


# -- TRL ----------------------------------------------------------------------------------------------


def _dpo(policy: torch.nn.Module, reference: torch.nn.Module) -> Namespace:
    # A real learning rate, as the reported runs had: the step must train, not only score.
    trainer, logs = dpo(build_tokenizer(), tempfile.mkdtemp(prefix="mpdoctor-cure-"), policy, reference, learning_rate=1e-3)
    return {"trainer": trainer, "logs": logs}


def _fp16_vae() -> Namespace:
    torch.manual_seed(0)
    vae = overflowing_vae().half()
    image = torch.randn(1, 3, 16, 16).half()  # the user's own fp16 image, as InstantID feeds it
    return {"vae": vae, "image": image, "optimizer": torch.optim.SGD(vae.parameters(), lr=1e-6)}


def _vae_step(ns: Namespace) -> torch.Tensor:
    ns["optimizer"].zero_grad()
    loss = ns["vae"](ns["image"]).sample.float().square().mean()
    loss.backward()
    ns["optimizer"].step()
    return loss


def _probe_vae(ns: Namespace):
    return mpdoctor.probe(ns["vae"], ns["image"], name="vae", loss_fn=lambda out: out.sample.float().mean())


def _dpo_fp16_reference() -> Namespace:
    return _dpo(*large_logit_policy_and_fp16_reference(build_tokenizer()))


def _dpo_bf16_reference() -> Namespace:
    model = trl_llama(build_tokenizer()).to(torch.bfloat16).float()  # bf16-representable: the later cast is exact
    return _dpo(model, copy.deepcopy(model).to(torch.bfloat16))


def _train(ns: Namespace) -> float:
    return ns["trainer"].train().training_loss


def _policy_params(ns: Namespace) -> list[torch.Tensor]:
    return [p for p in ns["trainer"].model.parameters() if p.requires_grad]


def _first_log(ns: Namespace) -> dict:
    return ns["logs"].logs[-1]


def _nan_rewards(ns: Namespace) -> None:
    assert math.isnan(_first_log(ns)["rewards/chosen"]), "the harm: NaN rewards from the fp16 reference"


def _finite_rewards(ns: Namespace) -> None:
    log = _first_log(ns)
    assert log["rewards/chosen"] == 0.0 and math.isfinite(log["grad_norm"])  # identical weights at the first step
    assert all(torch.isfinite(p).all() for p in _policy_params(ns))


def _biased_margin(ns: Namespace) -> None:
    assert _first_log(ns)["rewards/margins"] != 0.0, "the harm: identical weights, a non-zero margin"


def _zero_margin(ns: Namespace) -> None:
    assert _first_log(ns)["rewards/margins"] == 0.0


def _default_sft_trainer() -> Namespace:
    # unsloth#2783: TRL's SFTConfig as its notebooks build it, bf16=True by default (use_cpu only to build it here).
    return {"trainer": sft(build_tokenizer(), tempfile.mkdtemp(prefix="mpdoctor-cure-"))}


def _t4_refusal(ns: Namespace) -> None:
    from trl import SFTConfig

    # The T4's refusal, reproduced on this GPU-less machine: the same config without use_cpu.
    with pytest.raises(ValueError, match=BF16_REFUSED):
        SFTConfig(**common(ns["trainer"].args.output_dir))


def _runs_fp16(ns: Namespace) -> None:
    args = ns["trainer"].args
    assert (args.bf16, args.fp16) == (False, True) and ns["trainer"].accelerator.mixed_precision == "fp16"


def _bf16_arguments_under_the_launchers_fp8() -> Namespace:
    import os

    from transformers import TrainingArguments

    os.environ.update(LAUNCHER_FP8_ENV)  # what `accelerate launch --mixed_precision fp8` sets (conftest restores)
    args = TrainingArguments(tempfile.mkdtemp(prefix="mpdoctor-cure-"), bf16=True, use_cpu=True, report_to=[],
                             max_steps=2, save_strategy="no", per_device_train_batch_size=16, learning_rate=1e-2)  # fmt: skip
    return {"model": Net(), "args": args}


def _build_trainer_and_train(ns: Namespace) -> float:
    # trl#3860's script: the Trainer built from the model and the arguments, then train().
    from transformers import Trainer

    ns["before"] = {n: p.detach().clone() for n, p in ns["model"].named_parameters()}
    ns["trainer"] = Trainer(model=ns["model"], args=ns["args"], train_dataset=[{"x": torch.randn(32)} for _ in range(16)])
    return ns["trainer"].train().training_loss


def _trains_in_bf16_without_fp8(ns: Namespace) -> None:
    trainer = ns["trainer"]
    assert trainer.accelerator.mixed_precision == "bf16" and float8_layers(trainer.model) == 0, "the harm: no fp8 layer"


def _trains_its_float8_layers(ns: Namespace) -> None:
    trainer = ns["trainer"]
    assert trainer.accelerator.mixed_precision == "fp8" and float8_layers(trainer.model) == 2
    frozen = [n for n, p in trainer.model.named_parameters() if torch.equal(ns["before"][n], p.detach())]
    assert frozen == [], f"the float8 layers' weights must train too: {frozen} did not move"


# -- float8 storage -----------------------------------------------------------------------------------


def _fp8_stored(dtype: torch.dtype) -> Callable[[], Namespace]:
    def build() -> Namespace:
        # ComfyUI loading an fp8 checkpoint into stock layers: weights float8_e4m3fn, biases and input in `dtype`.
        return {"model": fp8_stored_mlp(dtype), "x": torch.randn(4, 32, generator=torch.Generator().manual_seed(0)).to(dtype)}

    return build


def _fp8_embedding() -> Namespace:
    return {"model": fp8_embedding_model(), "ids": torch.tensor([[1, 2, 3]])}


def _call_model(ns: Namespace) -> torch.Tensor:
    return ns["model"](ns["x"] if "x" in ns else ns["ids"])


def _storage_stays_float8(ns: Namespace) -> None:
    stored = [p for p in ns["model"].parameters() if p.dtype == torch.float8_e4m3fn]
    assert stored and all(not p.requires_grad for p in stored), "the fix keeps the float8 storage"


def _untargeted_layers_stay_float8(ns: Namespace) -> None:
    stored = [n for n, p in ns["unet"].named_parameters() if p.dtype == torch.float8_e4m3fn]
    assert stored and not any(".to_" in n for n in stored), "only DoRA's targets leave float8 storage"


# -- Lightning ----------------------------------------------------------------------------------------


class _LosingRegressor(RecordingRegressor):
    """Lightning-AI/pytorch-lightning#19980's module (stock AdamW at lr=1e-5) recording each step's loss."""


def _true_half_trainer(precision: str, module: type, scale: float) -> Callable[[], Namespace]:
    def build() -> Namespace:
        import lightning as L

        return {"module": module(), "trainer": L.Trainer(precision=precision, **SETTINGS), "scale": scale}

    return build


def _fit(ns: Namespace) -> float:
    # The user's cell: fit, as the user calls it; the loss of its last step.
    module = ns["module"]
    ns["start"] = module.layer.weight.detach().float().clone()
    ns["trainer"].fit(module, lightning_loader(ns["scale"]))
    return module.losses[-1]


def _diagnose_before_fit(ns: Namespace):
    module, trainer = ns["module"], ns["trainer"]
    return mpdoctor.diagnose(module, trainer, names={id(module): "module", id(trainer): "trainer"})


def _module_params(ns: Namespace) -> list[torch.Tensor]:
    return list(ns["module"].parameters())


def _updates_lost(ns: Namespace) -> None:
    w = ns["module"].layer.weight.detach()
    assert w.dtype == torch.bfloat16 and (w.float() != ns["start"].bfloat16().float()).float().mean() < 0.5, "the harm"


def _every_update_lands(ns: Namespace) -> None:
    w = ns["module"].layer.weight.detach()
    assert w.dtype == torch.float32 and bool((w != ns["start"]).all()) and ns["trainer"].precision == "bf16-mixed"


def _fp32_weights_finite(ns: Namespace) -> None:
    w = ns["module"].layer.weight
    assert w.dtype == torch.float32 and bool(torch.isfinite(w).all()) and ns["trainer"].precision == "bf16-mixed"


CASES: list[Case] = [
    Case(
        name="lightning-16-true-adam-nan", source="Lightning-AI/pytorch-lightning#20619", slug="lightning-true-half-adam",
        build=_true_half_trainer("16-true", AdamRegressor, 1e-3), step=_fit, failure="loss is not finite",
        diagnose=_diagnose_before_fit, params=_module_params, healed=_fp32_weights_finite,
    ),
    Case(
        name="lightning-bf16-true-adamw-updates-lost", source="Lightning-AI/pytorch-lightning#19980",
        slug="lightning-true-half-adam", build=_true_half_trainer("bf16-true", _LosingRegressor, 1.0), step=_fit,
        failure="trains", diagnose=_diagnose_before_fit, params=_module_params, harm=_updates_lost,
        healed=_every_update_lands,
    ),
    Case(
        name="fp8-weights-in-stock-linear-fp16", source="kijai/ComfyUI-ControlNeXt-SVD#7", slug="fp8-storage-not-upcast",
        build=_fp8_stored(torch.float16), step=_call_model, failure="must have the same dtype", kind="inference",
        healed=_storage_stays_float8,
    ),
    Case(
        name="fp8-weights-in-stock-linear-bf16", source="lodestone-rock/ComfyUI_FluxMod#27", slug="fp8-storage-not-upcast",
        build=_fp8_stored(torch.bfloat16), step=_call_model, failure="must have the same dtype", kind="inference",
        healed=_storage_stays_float8,
    ),
    Case(
        name="fp8-embedding-rows-meet-bf16-math", source="kijai/ComfyUI-WanVideoWrapper#1374", slug="fp8-storage-not-upcast",
        build=_fp8_embedding, step=_call_model, failure="must have the same dtype", kind="inference",
        healed=_storage_stays_float8,
    ),
    Case(
        name="fp8-layerwise-casting-trainable-storage", source="huggingface/finetrainers PR #316", slug="fp8-storage-trainable",
        build=layerwise_cast_with_a_bf16_head, step=train_step, failure="not implemented for 'Float8_e4m3fn'",
        healed=_storage_stays_float8,
    ),
    Case(
        name="fp8-base-left-trainable", source="kohya-ss/sd-scripts#1711", slug="fp8-storage-trainable",
        build=fp8_base_with_a_bf16_head, step=train_step, failure="not implemented for 'Float8_e4m3fn'",
        healed=_storage_stays_float8,  # GPU-only "cat_cuda" at DDP's broadcast: the optimizer step stands in
    ),
    Case(
        name="dora-on-float8-stored-unet", source="Nerogar/OneTrainer#442", slug="dora-on-float8-storage",
        build=dora_on_float8, step=adapter_step, failure=r"not implemented for 'Float8_e4m3fn'|Promotion for Float8",
        params=None, healed=_untargeted_layers_stay_float8,  # the step adds the adapter it trains and checks it moved
    ),
    Case(
        name="float8-quantized-zero-row-nan", source="pytorch/ao#4713", slug="quantized-weights-nonfinite",
        build=float8_quantized_with_a_zero_row, step=quantized_step, failure="loss is not finite",
    ),
    Case(
        name="mxfp8-activations-on-a-device-without-mx-gemms", source="NVIDIA/TransformerEngine#2304",
        slug="block-format-unsupported-device", build=block_quantized_with_a_bf16_head, step=block_step,
        failure="Invalid scaling configuration",
    ),
    Case(
        name="float8-activation-scale-zero-row", source="pytorch/ao#3356", slug="probe-nonfinite",
        build=tagger, step=tagger_step, failure="loss is not finite", diagnose=probe_tagger,
    ),
    Case(
        name="accelerate-fp8-filter-converts-nothing", source="huggingface/accelerate PR #4147", slug="fp8-requested-not-on",
        build=fp8_prepared_run, step=fp8_step, failure="trains", harm=fp8_runs_bf16, healed=fp8_runs_float8,
        recipe="float8-convert-live",
    ),
    Case(
        name="bf16-arguments-override-the-launchers-fp8", source="huggingface/trl#3860", slug="fp8-request-overridden",
        build=_bf16_arguments_under_the_launchers_fp8, step=_build_trainer_and_train, failure="trains",
        diagnose=lambda ns: mpdoctor.diagnose(ns["model"], ns["args"], names={id(ns["model"]): "model", id(ns["args"]): "args"}),
        params=lambda ns: list(ns["model"].parameters()), harm=_trains_in_bf16_without_fp8,
        healed=_trains_its_float8_layers, recipe="launcher-fp8",
    ),
    Case(
        name="controlnet-fp16-in-fp32-pipeline", source="huggingface/diffusers#7562", slug="pipeline-component-dtypes",
        build=_fp16_controlnet_in_fp32_pipe, step=_controlnet_pipe_call, failure=r"same dtype|should be the same",
        diagnose=_diagnose_pipe, kind="inference",
    ),
    Case(
        name="sd-pipeline-fp16-unet-fp32-text-encoder", source="sdnext #1431", slug="pipeline-component-dtypes",
        build=_pipe_with_fp16_denoiser, step=_pipe_call, failure=r"same dtype|should be the same",
        diagnose=_diagnose_pipe, kind="inference",
    ),
    Case(
        name="sdxl-lora-fp16-under-scaler", source="diffusers #10752", slug="fp16-trainable-params-with-scaler",
        build=_fp16_lora_unet, step=_unet_step, failure="Attempting to unscale FP16 gradients",
        fixed_by="adam-eps-underflow",  # one fp32-master-weights cast of the trainable params cures both findings
    ),
    Case(
        name="dreambooth-fp16-unet-under-scaler", source="diffusers #1246", slug="fp16-trainable-params-with-scaler",
        build=_fp16_unet, step=_unet_step, failure="Attempting to unscale FP16 gradients",
        fixed_by="adam-eps-underflow",
    ),
    Case(
        name="fp16-vae-overflow-fp16-image", source="InstantID #261", slug="vae-fp16-overflow",
        build=_fp16_vae, step=_vae_step, failure="loss is not finite", diagnose=_probe_vae,
        fixed_by="probe-nonfinite",  # on bf16 hardware the plan computes the VAE in bf16 (inputs cast); vae-fp32 elsewhere
    ),
    Case(
        name="qlora-fp32-compute-dtype", source="h2ogpt PR #682", slug="bnb-compute-dtype-fp32",
        build=_qlora_fp32_compute, step=_lora_step, failure="trains", harm=_computes_in_fp32, healed=_computes_in_bf16,
    ),
    Case(
        name="linear4bit-explicit-fp32-compute", source="bitsandbytes PR #2077", slug="bnb-compute-dtype-fp32",
        build=_linear4bit_explicit_fp32, step=_bf16_step, failure="trains", harm=_computes_in_fp32,
        healed=_computes_in_bf16,
    ),
    Case(
        name="sft-default-bf16-on-a-t4", source="unslothai/unsloth#2783", slug="bf16-unsupported",
        build=_default_sft_trainer, step=_train, params=_policy_params, failure="trains",  # GPU-only refusal
        diagnose=lambda ns: mpdoctor.diagnose(ns["trainer"], names={id(ns["trainer"]): "trainer"}, target="T4"),
        harm=_t4_refusal, healed=_runs_fp16,
    ),
    Case(
        name="dpo-fp16-reference-nan-rewards", source="huggingface/trl#878", slug="trl-ref-model-dtype",
        build=_dpo_fp16_reference, step=_train, params=_policy_params, failure="loss is not finite|trains",
        harm=_nan_rewards, healed=_finite_rewards,
    ),
    Case(
        name="dpo-bf16-reference-biased-margin", source="RLHFlow/Online-DPO-R1#16", slug="trl-ref-model-dtype",
        build=_dpo_bf16_reference, step=_train, params=_policy_params, failure="trains",
        harm=_biased_margin, healed=_zero_margin,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_failing_step_fails_then_trains_after_the_planned_fix_applied_through_the_api(case: Case):
    assert_broken(case)
    cure_through_api(case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_failing_step_trains_after_the_planned_fix_is_clicked_in_the_widget(case: Case):
    cure_through_widget(case)
