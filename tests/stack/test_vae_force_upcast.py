"""vae-fp16-overflow's force_upcast fix, executed: a tiny real SDXL pipeline (diffusers 0.42) whose fp16 VAE has
``force_upcast=False`` decodes NaN images; mpdoctor sets ``force_upcast=True`` on the live config, and the very
same ``pipe(...)`` call then decodes finite images (the pipeline upcasts the VAE to fp32 to decode, then back).

Tiny random weights never overflow fp16 (docs/stack.md): the decoder's first convolution is scaled by 300,000 (its
largest weight stays about 50,000, inside fp16's range) so its outputs pass 65504 in fp16 and stay finite in fp32."""

from __future__ import annotations

import warnings

import diffusers  # a plain import: tests/stack runs where diffusers is pinned; a missing one must fail
import torch
from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
from test_field_diffusers import tiny_pipe

import mpdoctor

diffusers.utils.logging.set_verbosity_error()


def overflowing_decoder_vae(force_upcast: bool) -> AutoencoderKL:
    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(8,), down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",), latent_channels=4, norm_num_groups=8, sample_size=16,
                        force_upcast=force_upcast)  # fmt: skip
    with torch.no_grad():
        vae.decoder.conv_in.weight.mul_(300_000.0)
    assert vae.decoder.conv_in.weight.abs().max() < 65504
    return vae


def tiny_sdxl(force_upcast: bool) -> StableDiffusionXLPipeline:
    """An SDXL pipeline with no text encoders (the test hands it embeddings), in fp16."""
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=2, use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=8 * 6 + 16, cross_attention_dim=16, norm_num_groups=8,
    )  # fmt: skip
    pipe = StableDiffusionXLPipeline(vae=overflowing_decoder_vae(force_upcast), text_encoder=None, text_encoder_2=None,
                                     tokenizer=None, tokenizer_2=None, unet=unet, scheduler=EulerDiscreteScheduler())  # fmt: skip
    return pipe.to(torch.float16)


def images(pipe) -> torch.Tensor:
    """The user's call: one denoising step on fixed embeddings, decoded."""
    torch.manual_seed(0)
    emb, pooled = torch.randn(1, 4, 16, dtype=torch.float16), torch.randn(1, 16, dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' deprecation notice for upcast_vae
        return pipe(prompt_embeds=emb, pooled_prompt_embeds=pooled, negative_prompt_embeds=emb,
                    negative_pooled_prompt_embeds=pooled, num_inference_steps=1, height=16, width=16,
                    output_type="pt").images  # fmt: skip


def test_force_upcast_set_on_the_live_config_makes_the_failing_pipeline_call_decode_finite():
    pipe = tiny_sdxl(force_upcast=False)
    assert not torch.isfinite(images(pipe)).all()  # the black image
    assert torch.isfinite(images(tiny_sdxl(force_upcast=True))).all()  # the same weights, upcast to decode

    report = mpdoctor.diagnose(namespace={"pipe": pipe})
    (finding,) = report.findings_for("vae-fp16-overflow")
    assert finding.severity == "info"
    fix = next(fx for fx in finding.fixes if fx.recipe == "vae-force-upcast")
    assert fix.safe and fix.changes
    config = pipe.vae.config
    fix.apply()
    assert pipe.vae.config.force_upcast is True and pipe.vae.dtype == torch.float16
    assert torch.isfinite(images(pipe)).all()
    assert pipe.vae.dtype == torch.float16  # the pipeline cast it back after decoding
    assert not report.refresh().findings_for("vae-fp16-overflow")
    fix.undo()
    assert pipe.vae.config is config and config.force_upcast is False  # the very config object is back


def test_a_probe_that_saw_the_overflow_is_an_error_and_offers_the_executable_force_upcast():
    pipe = tiny_sdxl(force_upcast=False)
    image = torch.full((1, 3, 16, 16), 0.5, dtype=torch.float16)
    report = mpdoctor.probe(pipe.vae, {"sample": image}, setup=pipe, name="pipe.vae",
                            loss_fn=lambda out: out.sample.float().mean(), checks=True)  # fmt: skip
    (finding,) = report.findings_for("vae-fp16-overflow")
    assert finding.severity == "error"
    fix = next(fx for fx in finding.fixes if fx.recipe == "vae-force-upcast")
    assert fix.safe and fix.changes


def test_stable_diffusion_1_never_reads_force_upcast_so_the_fix_stays_display_only():
    pipe = tiny_pipe(force_upcast=False).to(torch.float16)
    (finding,) = mpdoctor.diagnose(namespace={"pipe": pipe}).findings_for("vae-fp16-overflow")
    fix = next(fx for fx in finding.fixes if fx.recipe == "vae-force-upcast")
    assert not fix.changes and fix.applicability.value == "display-only"


def test_a_healthy_fp16_sdxl_pipeline_with_force_upcast_draws_no_alarm():
    pipe = tiny_sdxl(force_upcast=True)
    assert torch.isfinite(images(pipe)).all()
    report = mpdoctor.diagnose(namespace={"pipe": pipe})
    assert not report.findings_for("vae-fp16-overflow")
    assert [f.check for f in report.findings if f.severity in ("error", "warning")] == []
