"""Field cases of whole-chain fixes: the input cast lands on the call the user made (``vae.decode``,
``vae.encode``, a diffusers transformer's forward), rebuilt from public reports on tiny configs.

Each case raises the reported error first, then reads mpdoctor naming it (``batch-dtype-mismatch``, the cause of
the crash), applies the fix in place through the API or through the widget button, and runs the user's own failing
call again, inside a training step that must train. Each has a healthy twin (the same setup done right) that draws
no error and no warning. Rows: ``docs/field-cases/whole-chain.md``.
"""

from __future__ import annotations

import warnings

# Plain imports: tests/stack runs in the main venv only, where diffusers is pinned; a missing one must fail.
import pytest
import torch
from diffusers import AutoencoderKL, SD3Transformer2DModel
from steps import assert_step_trains, snapshot

import mpdoctor
from mpdoctor.attach.crash import explain

VIAS = ("api", "widget")


def raised(call) -> BaseException:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            call()
    except Exception as exc:  # noqa: BLE001 - the error torch raises is the subject of the test
        return exc
    raise AssertionError("the call raised nothing")


def tiny_vae(dtype: torch.dtype) -> AutoencoderKL:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vae = AutoencoderKL(block_out_channels=(8,), down_block_types=("DownEncoderBlock2D",),
                            up_block_types=("UpDecoderBlock2D",), latent_channels=4, norm_num_groups=8,
                            sample_size=8)  # fmt: skip
        return vae.to(dtype)


def apply_cause_fix(report, via: str, button_text: str):
    """Apply the cause's first fix through the API or by clicking its button in the widget."""
    fix = report.cause.fixes[0]
    if via == "api":
        fix.apply()
    else:
        rw = report.widget()
        rw.confirm_delay = 0.0
        buttons = [b for b in rw.buttons(button_text) if b.description.startswith(button_text)]  # not an alternative's
        assert len(buttons) == 1, [b.description for b in rw.buttons()]
        buttons[0].click()
    return fix


def trains_through(call, module: torch.nn.Module) -> None:
    """The user's call inside one training step of ``module``: a finite loss and parameters that moved."""
    params = [p for p in module.parameters() if p.requires_grad]
    before = snapshot(params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = call().float().square().mean()
    loss.backward()
    torch.optim.SGD(params, lr=0.1).step()
    assert_step_trains(loss, before, params)


def healthy(**namespace) -> None:
    report = mpdoctor.diagnose(namespace=namespace)
    loud = [(f.check, f.severity) for f in report.findings if f.severity in ("error", "warning")]
    assert not loud, loud


# -- huggingface/diffusers#14183 (PR #14219), PR #12847: fp16 latents into a VAE that upcast_vae() left in fp32 --


@pytest.mark.parametrize("via", VIAS)
def test_fp16_latents_into_an_upcast_fp32_vae_decode(via):
    vae, latents = tiny_vae(torch.float32), torch.randn(1, 4, 8, 8).half()
    exc = raised(lambda: vae.decode(latents))
    assert str(exc) == "Input type (c10::Half) and bias type (float) should be the same"
    report = explain(exc, namespace={"vae": vae, "latents": latents})
    assert report.cause.check == "batch-dtype-mismatch"
    assert "crash-conv-dtype" in {f.check for f in report.findings}
    fix = apply_cause_fix(report, via, "Cast vae's floating inputs")
    assert fix.changes[0].entries == (("", "decode"),)
    trains_through(lambda: vae.decode(latents).sample, vae)  # the user's own failing call


def test_healthy_twin_latents_cast_to_the_vaes_dtype_before_decode():
    vae = tiny_vae(torch.float32)
    latents = torch.randn(1, 4, 8, 8).half().to(vae.dtype)
    trains_through(lambda: vae.decode(latents).sample, vae)
    healthy(vae=vae, latents=latents)


# -- fastai/diffusion-nbs#27: an fp16 image into vae.encode of an fp32 VAE --------------------------------------


@pytest.mark.parametrize("via", VIAS)
def test_fp16_image_into_vae_encode(via):
    vae, image = tiny_vae(torch.float32), (torch.rand(1, 3, 8, 8).half() * 2 - 1)
    exc = raised(lambda: vae.encode(image))
    assert str(exc) == "Input type (c10::Half) and bias type (float) should be the same"
    report = explain(exc, namespace={"vae": vae, "image": image})
    assert report.cause.check == "batch-dtype-mismatch"
    fix = apply_cause_fix(report, via, "Cast vae's floating inputs")
    assert fix.changes[0].entries == (("", "encode"),)
    assert "at vae.encode and its forward" in fix.title
    trains_through(lambda: vae.encode(image).latent_dist.mean, vae)


def test_healthy_twin_image_in_the_vaes_dtype_into_encode():
    vae = tiny_vae(torch.float32)
    image = torch.rand(1, 3, 8, 8) * 2 - 1
    trains_through(lambda: vae.encode(image).latent_dist.mean, vae)
    healthy(vae=vae, image=image)


# -- huggingface/diffusers#11050: fp32 prompt embeddings into a bf16 SD3 transformer --------------------------


def tiny_sd3() -> SD3Transformer2DModel:
    torch.manual_seed(0)
    return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                                 num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                 pooled_projection_dim=8, out_channels=4, pos_embed_max_size=16).to(torch.bfloat16)  # fmt: skip


def sd3_inputs(dtype: torch.dtype) -> dict:
    torch.manual_seed(1)
    return {
        "latents": torch.randn(1, 4, 8, 8).to(torch.bfloat16),
        "prompt_embeds": torch.randn(1, 5, 16).to(dtype),  # compute_text_embeddings returned fp32
        "pooled_prompt_embeds": torch.randn(1, 8).to(dtype),
        "timestep": torch.tensor([10.0]),
    }


def sd3_call(transformer: SD3Transformer2DModel, x: dict):
    def call():
        return transformer(hidden_states=x["latents"], encoder_hidden_states=x["prompt_embeds"],
                           pooled_projections=x["pooled_prompt_embeds"], timestep=x["timestep"]).sample  # fmt: skip

    return call


@pytest.mark.parametrize("via", VIAS)
def test_fp32_prompt_embeds_into_a_bf16_sd3_transformer(via):
    transformer, x = tiny_sd3(), sd3_inputs(torch.float32)
    exc = raised(sd3_call(transformer, x))
    assert "same dtype" in str(exc)
    report = explain(exc, namespace={"transformer": transformer, **x})
    assert report.cause.check == "batch-dtype-mismatch"
    fix = apply_cause_fix(report, via, "Cast transformer's floating inputs")
    assert fix.changes[0].dtype == "bfloat16"
    trains_through(sd3_call(transformer, x), transformer)


def test_healthy_twin_prompt_embeds_cast_to_the_weight_dtype():
    transformer, x = tiny_sd3(), sd3_inputs(torch.bfloat16)
    trains_through(sd3_call(transformer, x), transformer)
    healthy(transformer=transformer, **x)


# -- huggingface/diffusers PR #8391: a pipeline's __call__ reaches vae.decode with latents of another dtype -------


def pipe_with_half_vae():
    """Stand-in for PixArt-Sigma: a tiny StableDiffusionPipeline whose UNet makes fp32 latents and whose VAE is
    fp16 (no force_upcast): the pipeline calls ``self.vae.decode(latents / scaling_factor)`` without a cast."""
    from test_field_diffusers import tiny_pipe

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = tiny_pipe(force_upcast=False)
    pipe.vae.half()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipe_call(pipe):
    def call():
        from test_field_diffusers import run_pipe

        return run_pipe(pipe, torch.float32)

    return call


@pytest.mark.parametrize("via", VIAS)
def test_a_pipeline_call_that_reaches_vae_decode_with_fp32_latents(via):
    pipe = pipe_with_half_vae()
    exc = raised(pipe_call(pipe))
    assert str(exc) == "Input type (float) and bias type (c10::Half) should be the same"
    report = explain(exc, namespace={"pipe": pipe})  # the user holds the pipeline only
    assert report.cause.check == "batch-dtype-mismatch"
    fix = apply_cause_fix(report, via, "Cast vae's floating inputs")
    assert fix.changes[0].entries == (("", "decode"),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        images = pipe_call(pipe)()  # the user's own failing call
    assert torch.isfinite(images).all()
    latents = torch.randn(1, 4, 2, 2)  # the UNet's fp32 latents, decoded in a training step of the VAE
    trains_through(lambda: pipe.vae.decode(latents).sample, pipe.vae)


def test_healthy_twin_a_pipeline_in_one_dtype_runs_and_draws_nothing():
    from test_field_diffusers import tiny_pipe

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = tiny_pipe(force_upcast=False)
        pipe.set_progress_bar_config(disable=True)
        assert torch.isfinite(pipe_call(pipe)()).all()
    healthy(pipe=pipe)
