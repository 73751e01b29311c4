"""Field cases from diffusers' tracker, reproduced with tiny diffusers models on this CPU.

Each test: the real error (or measured harm) first, then mpdoctor's diagnosis (the slug), the fix applied in
place through the report, then a step or forward that works. Healthy diffusers recipes draw no error or warning.
"""

from __future__ import annotations

import warnings
from typing import Any

# Plain imports: tests/stack runs in the main venv only, where diffusers is pinned; a missing one must fail.
import diffusers
import pytest
import torch
from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from peft import LoraConfig
from steps import run_step
from transformers import CLIPTextConfig, CLIPTextModel

import mpdoctor

diffusers.utils.logging.set_verbosity_error()


def tiny_vae(force_upcast: bool = True) -> AutoencoderKL:
    torch.manual_seed(0)
    return AutoencoderKL(
        block_out_channels=(8,),
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        latent_channels=4,
        norm_num_groups=8,
        sample_size=16,
        force_upcast=force_upcast,
    )


def tiny_unet() -> UNet2DConditionModel:
    torch.manual_seed(0)
    return UNet2DConditionModel(
        block_out_channels=(8, 16),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        norm_num_groups=8,
        attention_head_dim=2,
    )


def tiny_pipe(force_upcast: bool = True) -> StableDiffusionPipeline:
    text = CLIPTextModel(
        CLIPTextConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=1, vocab_size=100,
                       projection_dim=16, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    )
    return StableDiffusionPipeline(
        vae=tiny_vae(force_upcast), unet=tiny_unet(), text_encoder=text, tokenizer=None,
        scheduler=DDPMScheduler(clip_sample=False, steps_offset=1), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False,
    )


def tiny_controlnet_pipe(controlnets: int = 1, controlnet_dtype: torch.dtype = torch.float32) -> Any:
    """A ControlNet pipeline of tiny components in fp32, its ControlNet(s) (built from the UNet, as
    ``ControlNetModel.from_unet`` does) in ``controlnet_dtype``; two make a MultiControlNetModel."""
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline

    torch.manual_seed(0)
    text = CLIPTextModel(
        CLIPTextConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=1, vocab_size=100,
                       projection_dim=16, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    )
    unet = tiny_unet()
    nets = [ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(16,)).to(controlnet_dtype)
            for _ in range(controlnets)]  # fmt: skip
    pipe = StableDiffusionControlNetPipeline(
        vae=tiny_vae(), text_encoder=text, tokenizer=None, unet=unet, controlnet=nets if controlnets > 1 else nets[0],
        scheduler=DDPMScheduler(clip_sample=False, steps_offset=1), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_controlnet_pipe(pipe: Any, controlnets: int = 1) -> torch.Tensor:
    torch.manual_seed(1)
    emb, image = torch.randn(1, 4, 16), torch.rand(1, 3, 16, 16)
    out = pipe(prompt_embeds=emb, negative_prompt_embeds=emb, image=[image] * controlnets if controlnets > 1 else image,
               num_inference_steps=1, height=16, width=16, output_type="pt")
    return out.images


def run_pipe(pipe: StableDiffusionPipeline, dtype: torch.dtype) -> torch.Tensor:
    emb = torch.randn(1, 4, 16, dtype=dtype)
    out = pipe(prompt_embeds=emb, negative_prompt_embeds=emb, num_inference_steps=1, height=16, width=16,
               output_type="pt", return_dict=True)
    return out.images


def severities(report) -> dict[str, str]:
    return {f.check: f.severity for f in report.findings}


def lora_unet() -> UNet2DConditionModel:
    """The diffusers LoRA training scripts' setup: a frozen UNet with a LoRA adapter on its attention."""
    unet = tiny_unet()
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    return unet


def unet_step(unet, opt, scaler) -> torch.Tensor:
    """One fp16-autocast step under a GradScaler; returns the loss."""
    x = torch.randn(1, 4, 8, 8, dtype=unet.dtype)
    emb = torch.randn(1, 4, 16, dtype=unet.dtype)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = unet(x, torch.tensor([10]), encoder_hidden_states=emb).sample.float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return loss.detach()


# -- field cases --------------------------------------------------------------------------------------


def test_sdxl_lora_fp16_params_under_scaler_raises_then_fp32_trainable_params_train():
    """https://github.com/huggingface/diffusers/issues/10752 (also #9973, #7330, #6124).

    train_dreambooth_lora_sdxl.py with --mixed_precision=fp16: the UNet is cast to fp16 and the LoRA
    parameters added after it are fp16 too, so accelerate's GradScaler refuses to unscale them. The scripts'
    fix is ``cast_training_params(unet, dtype=torch.float32)``: trainable params fp32 on the fp16 base.
    """
    unet = lora_unet().to(torch.float16)
    params = [p for p in unet.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        unet_step(unet, opt, scaler)
    opt.zero_grad()

    report = mpdoctor.diagnose(unet, opt, scaler, names={id(unet): "unet", id(opt): "optimizer", id(scaler): "scaler"})
    assert severities(report)["fp16-trainable-params-with-scaler"] == "error"
    # AdamW's eps also rounds to 0 on fp16 weights (adam-eps-underflow): one planned treatment, fp32 master
    # weights for the trainable parameters, answers both findings.
    fix = next(f for f in report.fixes if f.recipe == "fp32-master-weights")
    fix.apply()

    assert {p.dtype for p in unet.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in unet.parameters() if not p.requires_grad} == {torch.float16}
    run_step(lambda: unet_step(unet, opt, scaler), params)  # finite loss, LoRA parameters moved
    assert "fp16-trainable-params-with-scaler" not in severities(report.refresh())


def test_dreambooth_full_unet_in_fp16_under_scaler_raises_then_trains_with_fp32_master_weights():
    """https://github.com/huggingface/diffusers/issues/1246: train_dreambooth.py with the UNet itself
    loaded in fp16 and --mixed_precision=fp16: ``ValueError: Attempting to unscale FP16 gradients.``"""
    unet = tiny_unet().to(torch.float16)
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        unet_step(unet, opt, scaler)
    opt.zero_grad()
    report = mpdoctor.diagnose(unet, opt, scaler)
    assert severities(report)["fp16-trainable-params-with-scaler"] == "error"
    next(f for f in report.fixes if f.recipe == "fp32-master-weights").apply()
    assert {p.dtype for p in unet.parameters()} == {torch.float32}
    run_step(lambda: unet_step(unet, opt, scaler), unet.parameters())  # finite loss, parameters moved
    assert all(torch.isfinite(p).all() for p in unet.parameters())


def overflowing_vae() -> AutoencoderKL:
    """A tiny VAE whose activations pass fp16's 65504 like the SD/SDXL VAEs' decoders do.

    Tiny random weights never get there, so one weight is scaled on purpose: the encoder's first
    convolution times 100,000 (its outputs reach about 1.7e5; the test asserts they pass 65504 in fp32).
    """
    vae = tiny_vae(force_upcast=False)
    with torch.no_grad():
        vae.encoder.conv_in.weight.mul_(100_000.0)
    return vae


def test_fp16_vae_overflows_to_nan_then_upcast_vae_decodes_finite():
    """https://github.com/instantX-research/InstantID/issues/261 ("the VAE encoder's outputs all become NaN"
    in fp16), https://github.com/Comfy-Org/ComfyUI/issues/1401 (black images, fp16 VAE).

    On a GPU the SD/SDXL VAEs overflow at their own scale; here one weight is scaled (see overflowing_vae).
    """
    vae = overflowing_vae()
    image = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        ref = vae(image).sample
        peak = vae.encoder.conv_in(image).abs().max().item()
    assert torch.isfinite(ref).all() and peak > 65504  # fp32 holds it; fp16 cannot
    vae.half()
    with torch.no_grad():
        broken = vae(image.half()).sample
    assert not torch.isfinite(broken).all()  # the black image: NaN pixels

    report = mpdoctor.probe(vae, image.half(), name="vae", loss_fn=lambda out: out.sample.float().mean())
    finding = next(f for f in report.findings if f.check == "vae-fp16-overflow")
    assert finding.severity == "error" and "65504" in finding.message
    upcast = next(fx for fx in finding.fixes if fx.recipe == "vae-fp32")
    assert any(fx.recipe == "vae-force-upcast" and "force_upcast=True" in fx.code for fx in finding.fixes)
    upcast.apply()
    assert {p.dtype for p in vae.parameters()} == {torch.float32}
    with torch.no_grad():
        fixed = vae(image.half()).sample  # the user's own fp16 image: the upcast covers its input
        decoded = vae.decode(vae.encode(image.half()).latent_dist.mode().half()).sample
    assert torch.isfinite(fixed).all() and torch.isfinite(decoded).all()


def test_fp16_vae_without_force_upcast_is_flagged_before_any_probe():
    vae = tiny_vae(force_upcast=False).half()
    report = mpdoctor.diagnose(vae, names={id(vae): "vae"})
    assert severities(report).get("vae-fp16-overflow") == "info"


def test_pipeline_encoder_and_unet_in_different_dtypes_raise_then_one_dtype_runs():
    """https://github.com/vladmandic/sdnext/issues/1431 ("Input type (c10::BFloat16) and bias type (c10::Half)
    should be the same"): components of one pipeline in two dtypes meet without a cast. Here ``pipe.unet.half()``
    alone: StableDiffusionPipeline prepares embeddings and latents in the text encoder's fp32."""
    pipe = tiny_pipe()
    pipe.unet.half()
    pipe.vae.half()
    with pytest.raises(RuntimeError, match="same dtype|should be the same"):
        run_pipe(pipe, torch.float32)

    report = mpdoctor.diagnose(pipe, names={id(pipe): "pipe"})
    assert {s.name for s in report.facts.subjects} >= {"pipe", "pipe.unet", "pipe.vae", "pipe.text_encoder"}
    assert severities(report)["pipeline-component-dtypes"] == "error"
    next(f for f in report.fixes if f.slug == "pipeline-component-dtypes").apply()
    assert pipe.text_encoder.dtype == torch.float16
    images = run_pipe(pipe, torch.float32)  # the very call that raised, with the user's fp32 embeddings
    assert torch.isfinite(images).all()


@pytest.mark.parametrize("controlnets", [1, 2], ids=["controlnet", "multi-controlnet"])
def test_controlnets_in_fp16_in_an_fp32_pipeline_raise_then_cast_in_place_the_same_call_runs(controlnets):
    """https://github.com/huggingface/diffusers/issues/7562: fp16 ControlNets (``ControlNetModel.from_pretrained(...,
    torch_dtype=torch.float16)``) handed to a pipeline loaded without ``torch_dtype`` (fp32): "Input type (float)
    and bias type (c10::Half) should be the same" at the first denoising step. Here the ControlNet's first matmul
    raises the same mismatch; the fix casts the ControlNet(s) to the denoiser's dtype in place."""
    pipe = tiny_controlnet_pipe(controlnets, torch.float16)
    with pytest.raises(RuntimeError, match="same dtype|should be the same"):
        run_controlnet_pipe(pipe, controlnets)
    report = mpdoctor.diagnose(pipe, names={id(pipe): "pipe"})
    (finding,) = report.findings_for("pipeline-component-dtypes")
    assert finding.subject == "pipe.controlnet" and finding.severity == "error"
    assert "residuals" in finding.message
    fix = next(f for f in report.fixes if f.slug == "pipeline-component-dtypes")
    fix.apply()
    assert all(p.dtype == torch.float32 for p in pipe.controlnet.parameters())
    assert torch.isfinite(run_controlnet_pipe(pipe, controlnets)).all()  # the very call that raised
    fix.undo()
    assert all(p.dtype == torch.float16 for p in pipe.controlnet.parameters())


# -- healthy recipes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_healthy_controlnet_pipeline_in_one_dtype_draws_no_warning(dtype):
    """diffusers' ControlNet docs: the ControlNet loaded with the pipeline's ``torch_dtype``."""
    pipe = tiny_controlnet_pipe(1, dtype).to(dtype)
    assert torch.isfinite(run_controlnet_pipe(pipe, 1)).all()  # it runs
    assert "pipeline-component-dtypes" not in severities(mpdoctor.diagnose(pipe, names={id(pipe): "pipe"}))
    assert all(sev not in ("error", "warning") for sev in severities(mpdoctor.diagnose(pipe)).values())


def test_healthy_fp16_pipeline_with_force_upcast_vae_draws_no_warning():
    """diffusers docs: ``from_pretrained(..., torch_dtype=torch.float16)``; the VAE keeps force_upcast=True."""
    pipe = tiny_pipe(force_upcast=True).to(torch_dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        images = run_pipe(pipe, torch.float16)
    assert torch.isfinite(images).all()
    report = mpdoctor.diagnose(pipe, names={id(pipe): "pipe"})
    assert not [f for f in report.findings if f.severity in ("error", "warning")], report.findings


def test_healthy_lora_training_with_fp32_trainable_params_draws_no_warning():
    """diffusers training scripts: fp16 base, ``cast_training_params(unet, dtype=torch.float32)``, GradScaler."""
    from diffusers.training_utils import cast_training_params

    unet = lora_unet().to(torch.float16)
    cast_training_params(unet, dtype=torch.float32)
    opt = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    unet_step(unet, opt, scaler)
    report = mpdoctor.diagnose(unet, opt, scaler)
    assert not [f for f in report.findings if f.severity in ("error", "warning")], report.findings
