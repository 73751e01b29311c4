"""Field cases of inference in the kernel that fine-tuned: generate, evaluate and serve with the same objects.

Each case is a public report, reproduced here with the library's real classes built from tiny configs (nothing is
downloaded): the reported error or the measured harm first, on the user's very call (``model.generate``,
``vae.encode``); then mpdoctor names it (the crash hook's cause, the generation probe, a check); then the planned
fix is applied in place, through ``fix.apply()`` and through the widget's button, and the same call returns finite
output; undo brings the failure back. Each has a healthy twin, the same recipe done right, that draws no error and
no warning.

Tiny random models rarely leave fp16's range by themselves (docs/stack.md): where a case needs a
"massive activation", one weight (a post-norm weight, one output channel of a projection) is set to a value inside
fp16's range (at most 60000), so only the activations computed from it leave the range, and each test says which.
"""

from __future__ import annotations

import re
from typing import Any

import diffusers
import pytest
import torch
import transformers
from cure import (
    Case,
    assert_broken,
    assert_output_finite,
    cure_through_api,
    cure_through_widget,
    outcome,
    planned,
)
from setups_dtypes import alarms

import mpdoctor
from mpdoctor.attach.crash.cause import explain

diffusers.utils.logging.set_verbosity_error()
transformers.logging.set_verbosity_error()

Namespace = dict[str, Any]
PROMPT = {"input_ids": torch.tensor([[3, 14, 15, 9]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}


def generated(ns: Namespace, **kwargs: Any) -> Any:
    """``model.generate`` on the prompt, with the logits of every step (what "finite output" is judged on)."""
    with torch.no_grad():
        return ns["model"].generate(**PROMPT, max_new_tokens=4, output_logits=True, return_dict_in_generate=True,
                                    pad_token_id=0, **kwargs)  # fmt: skip


def probed(ns: Namespace) -> Any:
    """What the user runs after garbage or a sampling error: the generation probe on the prompt."""
    return mpdoctor.probe(ns["model"], PROMPT, name="model", generate=True, max_new_tokens=4)


def crash_report(case_step: Any) -> Any:
    """The crash hook's report: the user's call raises, :func:`explain` reads the exception and the namespace."""

    def diagnose(ns: Namespace) -> Any:
        try:
            case_step(ns)
        except Exception as exc:  # the reported error: what the hook explains
            report = explain(exc, namespace=ns)
            assert report is not None, f"not recognised: {exc}"
            return report
        raise AssertionError("the call did not raise")

    return diagnose


def assert_undo_restores(case: Case) -> None:
    """Apply the planned fixes, see the call work, undo them: the very failure is back and the parameters are the
    same objects with their old dtypes."""
    ns = case.build()
    params = {id(p): p.dtype for v in ns.values() if isinstance(v, torch.nn.Module) for p in v.parameters()}
    report = case.diagnose(ns)
    fixes = [f for f in report.fixes if f.slug == (case.fixed_by or case.slug)]
    assert fixes
    for fix in fixes:
        fix.apply()
    assert outcome(case, ns) == "runs"
    for fix in reversed(fixes):
        fix.undo()
    after = {id(p): p.dtype for v in ns.values() if isinstance(v, torch.nn.Module) for p in v.parameters()}
    assert after == params
    assert re.search(case.failure, outcome(case, ns), re.S)


# -- Whisper in fp16, fed the feature extractor's fp32 features, through generate --------------------------------


def tiny_whisper(dtype: torch.dtype) -> Any:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=64, num_mel_bins=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, d_model=16, max_source_positions=8,
        max_target_positions=16, decoder_start_token_id=1, pad_token_id=0, eos_token_id=2, bos_token_id=1,
        begin_suppress_tokens=None, suppress_tokens=None,
    )  # fmt: skip
    return WhisperForConditionalGeneration(config).to(dtype).eval()


def whisper_fp16_fp32_features() -> Namespace:
    """``from_pretrained("openai/whisper-large-v3")`` takes the config's float16 (``dtype="auto"``); the feature
    extractor returns float32 ``input_features`` (16 frames of 8 mel bins here)."""
    torch.manual_seed(1)
    return {"model": tiny_whisper(torch.float16), "input_features": torch.randn(1, 8, 16)}


def transcribe(ns: Namespace) -> Any:
    with torch.no_grad():
        return ns["model"].generate(ns["input_features"], max_new_tokens=3, output_logits=True,
                                    return_dict_in_generate=True)  # fmt: skip


WHISPER = Case(
    name="whisper-fp16-fp32-features-generate",
    source="huggingface/transformers#47805",
    slug="batch-dtype-mismatch",
    build=whisper_fp16_fp32_features,
    step=transcribe,
    failure=r"RuntimeError: Input type \(float\) and bias type \(c10::Half\) should be the same",
    diagnose=crash_report(transcribe),
    kind="inference",
)


def test_whisper_fp16_generate_on_fp32_features_raises_the_reported_error_and_the_crash_hook_names_conv1():
    assert_broken(WHISPER)  # the very error of the thread, from the real generate()
    ns = WHISPER.build()
    report = WHISPER.diagnose(ns)
    assert report.exception == "RuntimeError: Input type (float) and bias type (c10::Half) should be the same"
    assert (
        report.cause.check == "batch-dtype-mismatch" and report.cause.subject == "model.model.encoder.conv1"
    )
    assert "`input_features` (float32)" in report.cause.message
    (fix,) = report.fixes
    assert fix.safe and "model.generate" in fix.title  # generate() calls the encoder, not model.forward


def test_whisper_fp16_generate_on_fp32_features_is_cured_through_the_api():
    cure_through_api(WHISPER)


def test_whisper_fp16_generate_on_fp32_features_is_cured_through_the_widget():
    cure_through_widget(WHISPER)


def test_whisper_input_cast_undone_brings_the_error_back():
    assert_undo_restores(WHISPER)


def test_healthy_whisper_features_cast_to_the_models_dtype_draw_nothing():
    """The maintainers' recipe in the thread: ``inputs.to(model.device, dtype=model.dtype)``; and fp32 on a CPU."""
    for dtype in (torch.float16, torch.float32):
        ns = {"model": tiny_whisper(dtype), "input_features": torch.randn(1, 8, 16).to(dtype)}
        report = mpdoctor.diagnose(namespace=ns)
        assert alarms(report) == []
        assert outcome(WHISPER, ns) == "runs"


# -- Gemma 3 generated in fp16: a post-norm output past 65504, empty output -----------------------------------------


def tiny_gemma3(dtype: torch.dtype) -> Any:
    """A tiny Gemma 3 text model whose first post-feedforward norm has weight 60000 (inside fp16's range): its
    fp32-computed output, ``normed * (1 + weight)``, is about 126000 and becomes inf when cast back to fp16,
    as the large RMSNorm weights of the real checkpoints do (the thread's diagnosis)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, sliding_window=16, pad_token_id=0,
        eos_token_id=None, bos_token_id=1,
    )  # fmt: skip
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        model.model.layers[0].post_feedforward_layernorm.weight.fill_(60000.0)
    return model.to(dtype).eval()


def greedy(ns: Namespace) -> Any:
    return generated(ns, do_sample=False)


GEMMA3 = Case(
    name="gemma3-fp16-generate-nan",
    source="huggingface/transformers#36822",
    slug="probe-nonfinite",
    build=lambda: {"model": tiny_gemma3(torch.float16)},
    step=greedy,
    failure=r"output is not finite",
    diagnose=probed,
    kind="inference",
)


def test_gemma3_in_fp16_generates_token_zero_from_nan_logits_and_the_probe_names_the_post_norm():
    ns = GEMMA3.build()
    out = greedy(ns)
    assert all(torch.isnan(step).all() for step in out.logits)  # every logit NaN from the prefill on
    assert out.sequences[0, 4:].tolist() == [0, 0, 0, 0]  # decoded: the empty output of the thread
    assert_broken(GEMMA3)
    report = probed(ns)
    assert report.cause is None or report.cause.check in ("probe-nonfinite", "probe-generation-nonfinite")
    (culprit,) = report.findings_for("probe-nonfinite")
    assert culprit.subject == "model.model.layers.0.post_feedforward_layernorm"
    (generation,) = report.findings_for("probe-generation-nonfinite")
    assert "prefill (step 0)" in generation.message
    (fix,) = [f for f in report.fixes if f.slug == "probe-nonfinite"]
    assert "bf16" in fix.title and report.proof.label(fix).startswith("checked on the probe's generate()")
    # At rest, before any probe: the family's activations pass 65504 and the weights are fp16.
    assert [f.check for f in mpdoctor.diagnose(namespace=GEMMA3.build()).findings] == ["fp16-overflow-risk"]


def test_gemma3_fp16_generate_is_cured_through_the_api():
    cure_through_api(GEMMA3)


def test_gemma3_fp16_generate_is_cured_through_the_widget():
    cure_through_widget(GEMMA3)


def test_gemma3_bf16_cast_undone_brings_the_nan_back():
    assert_undo_restores(GEMMA3)


def test_healthy_gemma3_generated_in_bf16_draws_nothing():
    """Gemma 3 in bf16, as the model card says; the same planted weight, finite, and no alarm at rest or probed."""
    ns = {"model": tiny_gemma3(torch.bfloat16)}
    assert alarms(mpdoctor.diagnose(namespace=ns)) == []
    assert alarms(probed(ns)) == []
    assert outcome(GEMMA3, ns) == "runs"


# -- GPT-NeoX sampled in fp16 (a V100): probability tensor contains inf/nan ---------------------------------------


def tiny_neox(dtype: torch.dtype) -> Any:
    """A tiny GPT-NeoX whose second MLP has its weights scaled (x300 in, x8000 out; the largest weight about 1000):
    that MLP's output passes 65504 in fp16, the bf16-trained checkpoint's massive activation."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=64, pad_token_id=0, eos_token_id=None,
                           bos_token_id=1)  # fmt: skip
    model = GPTNeoXForCausalLM(config)
    mlp = model.gpt_neox.layers[1].mlp
    with torch.no_grad():
        mlp.dense_h_to_4h.weight.mul_(300)
        mlp.dense_4h_to_h.weight.mul_(8000)
    return model.to(dtype).eval()


def sample(ns: Namespace) -> Any:
    torch.manual_seed(0)
    return generated(ns, do_sample=True)


NEOX = Case(
    name="gpt-neox-fp16-sampling-nan",
    source="togethercomputer/OpenChatKit#86",
    slug="probe-nonfinite",
    build=lambda: {"model": tiny_neox(torch.float16)},
    step=sample,
    failure=r"RuntimeError: probability tensor contains either `inf`, `nan` or element < 0",
    diagnose=probed,
    kind="inference",
)


def test_gpt_neox_sampled_in_fp16_raises_the_multinomial_error_and_the_crash_hook_sends_to_the_probe():
    assert_broken(NEOX)
    ns = NEOX.build()
    with pytest.raises(RuntimeError, match="probability tensor contains") as raised:
        sample(ns)
    report = explain(raised.value, namespace=ns)
    assert report.cause.check == "crash-sampling-nonfinite"
    probe_report = probed(ns)
    (culprit,) = probe_report.findings_for("probe-nonfinite")
    assert (
        culprit.subject == "model.gpt_neox.layers.1.mlp.dense_4h_to_h"
        and "inputs were finite" in culprit.message
    )
    assert probe_report.findings_for("probe-generation-nonfinite")
    # A V100 has no bf16: the finding also carries the overflow's fp32 span, measured (the layer alone would cast its
    # output back to fp16 and overflow again): the block whose residual carries it and the final norm, cast back.
    span = culprit.fixes[1]
    assert span.title.startswith("Keep the path of the overflow in model.gpt_neox.layers.1.mlp.dense_4h_to_h (Linear)")
    assert [(c.path, c.cast_to) for c in span.changes] == [("gpt_neox.layers.1", ""),
                                                           ("gpt_neox.final_layer_norm", "float16")]  # fmt: skip


def test_gpt_neox_fp16_sampling_is_cured_through_the_api():
    cure_through_api(NEOX)


def test_gpt_neox_fp16_sampling_is_cured_through_the_widget():
    cure_through_widget(NEOX)


def test_gpt_neox_bf16_cast_undone_brings_the_sampling_error_back():
    assert_undo_restores(NEOX)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_healthy_gpt_neox_sampled_in_bf16_or_fp32_draws_nothing(dtype):
    ns = {"model": tiny_neox(dtype)}
    assert alarms(mpdoctor.diagnose(namespace=ns)) == []
    assert alarms(probed(ns)) == []
    assert outcome(NEOX, ns) == "runs"


# -- A bf16-trained model generated in fp16 on a T4 / V100 (no bf16): the residual stream carries the overflow -------


def tiny_llama_massive_mlp(dtype: torch.dtype, layer: int = 1, scaled: bool = True) -> Any:
    """A tiny 3-layer Llama whose MLP in block ``layer`` has its weights scaled (gate and up x50, the output
    projection ``down_proj`` x10000; the largest weight about 760, inside fp16's range): that MLP's output, about
    96000, passes 65504, and so does the residual stream after it, through every later block up to the final norm,
    as a bf16-trained checkpoint's massive activation does (the thread's ``wo`` output of 66246)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=None)  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    if scaled:
        mlp = model.model.layers[layer].mlp
        with torch.no_grad():
            mlp.gate_proj.weight.mul_(50)
            mlp.up_proj.weight.mul_(50)
            mlp.down_proj.weight.mul_(10000)
    return model.to(dtype).eval()


def probed_on_t4(ns: Namespace) -> Any:
    """The generation probe, planned for a T4 (``target="T4"``: no bf16, so fp16 or fp32 only)."""
    return mpdoctor.probe(ns["model"], PROMPT, name="model", generate=True, max_new_tokens=4, target="T4")


T4_SPAN = Case(
    name="fp16-overflow-no-bf16-fp32-span",
    source="huggingface/transformers#5651",
    slug="probe-nonfinite",
    build=lambda: {"model": tiny_llama_massive_mlp(torch.float16)},
    step=greedy,
    failure=r"output is not finite",
    diagnose=probed_on_t4,
    recipe="fp32-span",
    kind="inference",
)


def fp32_tokens(layer: int = 1) -> list[int]:
    """The greedy tokens of the same weights in fp32: what the cured fp16 model must generate."""
    return greedy({"model": tiny_llama_massive_mlp(torch.float32, layer)}).sequences[0, 4:].tolist()


def test_fp16_generate_of_a_massive_activation_gives_nan_logits_and_sampling_raises():
    ns = T4_SPAN.build()
    out = greedy(ns)
    assert all(torch.isnan(step).all() for step in out.logits)  # every step's logits NaN from the prefill on
    assert out.sequences[0, 4:].tolist() == [0, 0, 0, 0] != fp32_tokens()  # garbage: token 0, four times
    with pytest.raises(RuntimeError, match="probability tensor contains either `inf`, `nan` or element < 0"):
        sample(ns)
    assert_broken(T4_SPAN)


@pytest.mark.parametrize("layer", [0, 1])
def test_on_a_t4_the_plan_keeps_the_overflows_path_in_fp32_not_the_overflowing_layer_alone(layer):
    """No bf16 on a T4: the plan keeps in fp32 the block whose MLP overflows, every later block (the residual stream
    carries the value past 65504) and the final norm, whose output is cast back to fp16; measured by the probe in
    fp32 and re-run finite. Keeping ``down_proj`` alone would cast its 96000 back to fp16: inf again."""
    report = probed_on_t4({"model": tiny_llama_massive_mlp(torch.float16, layer)})
    (culprit,) = report.findings_for("probe-nonfinite")
    assert culprit.subject == f"model.model.layers.{layer}.mlp.down_proj"
    assert not [f for f in culprit.fixes if "bf16" in f.title]  # a T4 has none
    (fix,) = [f for f in report.fixes if f.recipe == "fp32-span"]
    kept = [(c.path, c.cast_to) for c in fix.changes]
    assert kept == [*((f"model.layers.{i}", "") for i in range(layer, 3)), ("model.norm", "float16")]
    assert report.proof.label(fix).startswith("checked on the probe's generate()"), report.proof.label(fix)
    assert "its output is finite" in report.proof.label(fix)


def test_fp16_overflow_on_a_t4_is_cured_through_the_api_and_generates_the_fp32_tokens():
    cure_through_api(T4_SPAN)
    ns = T4_SPAN.build()
    for fix in planned(T4_SPAN, probed_on_t4(ns)):
        fix.apply()
    assert greedy(ns).sequences[0, 4:].tolist() == fp32_tokens()  # the user's own call, tokens as in fp32
    assert_output_finite(sample(ns))  # sampling no longer raises
    assert {p.dtype for p in ns["model"].model.layers[0].parameters()} == {torch.float16}  # layer 0 stays fp16


def test_fp16_overflow_on_a_t4_is_cured_through_the_widget():
    cure_through_widget(T4_SPAN)


def test_the_fp32_span_undone_brings_the_nan_back():
    assert_undo_restores(T4_SPAN)


def test_the_fp32_span_fix_code_run_on_a_twin_generates_the_same_tokens():
    ns, twin = T4_SPAN.build(), T4_SPAN.build()
    (fix,) = planned(T4_SPAN, probed_on_t4(ns))
    exec(fix.code, {"model": twin["model"], "torch": torch})
    fix.apply()
    assert greedy(twin).sequences.tolist() == greedy(ns).sequences.tolist()
    assert greedy(twin).sequences[0, 4:].tolist() == fp32_tokens()


def test_healthy_fp16_on_a_t4_and_the_same_weights_in_bf16_here_draw_nothing():
    """The same model without the scaled MLP in fp16 on a T4 generates finite, with no alarm and no span measured;
    the scaled model in bf16 (this CPU has bf16) does too."""
    unscaled = {"model": tiny_llama_massive_mlp(torch.float16, scaled=False)}
    report = probed_on_t4(unscaled)
    assert alarms(report) == [] and report.facts.probes[0].fp32_span == ()
    assert outcome(T4_SPAN, unscaled) == "runs"
    bf16 = {"model": tiny_llama_massive_mlp(torch.bfloat16)}
    assert alarms(probed(bf16)) == [] and alarms(mpdoctor.diagnose(namespace=bf16)) == []
    assert outcome(T4_SPAN, bf16) == "runs"


# -- The SDXL VAE called directly in fp16: NaN latents from vae.encode ---------------------------------------------


def tiny_vae(dtype: torch.dtype) -> Any:
    """A tiny AutoencoderKL (``force_upcast=True``, as the SDXL VAE's config says: a pipeline would upcast it, a direct
    ``vae.encode`` does not); one output channel of the encoder's last conv has weight 3000 (inside fp16's range),
    so the latent mean of that channel passes 65504."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(8,), down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",), latent_channels=4, norm_num_groups=8, sample_size=16,
                        force_upcast=True)  # fmt: skip
    with torch.no_grad():
        vae.encoder.conv_out.weight[0].fill_(3000.0)
    return vae.to(dtype).eval()


def vae_images(dtype: torch.dtype) -> Namespace:
    torch.manual_seed(1)
    return {"vae": tiny_vae(dtype), "imgs": torch.rand(1, 3, 16, 16) * 2.0 - 1.0, "weights_dtype": dtype}


def encode(ns: Namespace) -> Any:
    """The thread's call: ``vae.encode(imgs.to(weights_dtype)).latent_dist.sample() * scaling_factor``."""
    torch.manual_seed(2)
    with torch.no_grad():
        posterior = ns["vae"].encode(ns["imgs"].to(ns["weights_dtype"])).latent_dist
        return posterior.sample() * ns["vae"].config.scaling_factor


def probed_vae(ns: Namespace) -> Any:
    return mpdoctor.probe(ns["vae"], ns["imgs"].to(ns["weights_dtype"]), name="vae", training=False)


VAE_ENCODE = Case(
    name="sdxl-vae-encode-fp16-nan",
    source="huggingface/diffusers#7188",
    slug="vae-fp16-overflow",
    build=lambda: vae_images(torch.float16),
    step=encode,
    failure=r"output is not finite",
    diagnose=probed_vae,
    fixed_by="probe-nonfinite",
    kind="inference",
)


def test_the_vae_encoding_in_fp16_gives_nan_latents_and_the_probe_names_the_encoder():
    assert_broken(VAE_ENCODE)
    ns = VAE_ENCODE.build()
    # inf here: the overflow is in the encoder's last conv; the thread's is deeper, and the next norm makes it NaN
    assert torch.isinf(encode(ns)).any()
    report = probed_vae(ns)
    (finding,) = report.findings_for("vae-fp16-overflow")
    assert finding.severity == "error" and "encoder.conv_out" in finding.message
    (culprit,) = report.findings_for("probe-nonfinite")
    assert culprit.subject == "vae.encoder.conv_out"


def test_the_vae_encoding_in_fp16_is_cured_through_the_api():
    cure_through_api(VAE_ENCODE)


def test_the_vae_encoding_in_fp16_is_cured_through_the_widget():
    cure_through_widget(VAE_ENCODE)


def test_the_vae_fix_undone_brings_the_nan_latents_back():
    assert_undo_restores(VAE_ENCODE)


def test_healthy_vae_and_images_both_in_fp32_draw_nothing():
    """The thread's answer: "upcast both your image and vae to full precision for the encoding"."""
    ns = vae_images(torch.float32)
    assert alarms(mpdoctor.diagnose(namespace=ns)) == []
    assert alarms(probed_vae(ns)) == []
    assert outcome(VAE_ENCODE, ns) == "runs"


# -- Wav2Vec2 in bf16 on a CPU, fed the feature extractor's fp32 input_values ---------------------------------------


def tiny_wav2vec2(dtype: torch.dtype, large: bool = True) -> Any:
    """A tiny Wav2Vec2ForCTC shaped like wav2vec2-large-xlsr (``conv_bias=True``, layer-normed feature encoder): its
    first conv has a bias, so the error names it as the thread's does. ``large=False``: shaped like wav2vec2-base
    (no conv bias, a group-normed first conv), where the same fp32 features raise "expected scalar type Float but
    found BFloat16" instead."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    torch.manual_seed(0)
    shape = dict(conv_bias=True, feat_extract_norm="layer", do_stable_layer_norm=True) if large else dict(
        conv_bias=False, feat_extract_norm="group", do_stable_layer_norm=False)  # fmt: skip
    config = Wav2Vec2Config(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, pad_token_id=0, **shape,
    )  # fmt: skip
    return Wav2Vec2ForCTC(config).to(dtype).eval()


def wav2vec2_bf16_fp32_values() -> Namespace:
    """``torch_dtype=torch.bfloat16`` on a CPU; the feature extractor returns float32 ``input_values`` (400 samples)."""
    torch.manual_seed(1)
    return {"model": tiny_wav2vec2(torch.bfloat16), "input_values": torch.randn(1, 400)}


def recognise(ns: Namespace) -> Any:
    with torch.no_grad():
        return ns["model"](ns["input_values"]).logits


WAV2VEC2 = Case(
    name="wav2vec2-bf16-fp32-input-values",
    source="huggingface/transformers#28631",
    slug="batch-dtype-mismatch",
    build=wav2vec2_bf16_fp32_values,
    step=recognise,
    failure=r"RuntimeError: Input type \(float\) and bias type \(c10::BFloat16\) should be the same",
    diagnose=crash_report(recognise),
    kind="inference",
)


def test_wav2vec2_in_bf16_on_fp32_input_values_raises_the_reported_error_and_the_crash_hook_names_the_first_conv():
    assert_broken(WAV2VEC2)  # the error the PR quotes, word for word, from the real forward
    report = WAV2VEC2.diagnose(WAV2VEC2.build())
    assert report.exception == "RuntimeError: Input type (float) and bias type (c10::BFloat16) should be the same"
    assert report.cause.check == "batch-dtype-mismatch"
    assert report.cause.subject == "model.wav2vec2.feature_extractor.conv_layers.0.conv"
    assert "`input_values` (float32)" in report.cause.message
    (fix,) = report.fixes
    assert fix.safe and "bfloat16" in fix.title and "ids and bool masks untouched" in fix.title


def test_wav2vec2_bf16_on_fp32_input_values_is_cured_through_the_api():
    cure_through_api(WAV2VEC2)


def test_wav2vec2_bf16_on_fp32_input_values_is_cured_through_the_widget():
    cure_through_widget(WAV2VEC2)


def test_wav2vec2_input_cast_undone_brings_the_error_back():
    assert_undo_restores(WAV2VEC2)


def wav2vec2_base_bf16_fp32_values() -> Namespace:
    torch.manual_seed(1)
    return {"model": tiny_wav2vec2(torch.bfloat16, large=False), "input_values": torch.randn(1, 400)}


WAV2VEC2_BASE = Case(
    name="wav2vec2-base-bf16-fp32-input-values",
    source="huggingface/transformers#28631",
    slug="batch-dtype-mismatch",
    build=wav2vec2_base_bf16_fp32_values,
    step=recognise,
    failure=r"RuntimeError: expected scalar type Float but found BFloat16",
    diagnose=crash_report(recognise),
    kind="inference",
)


def test_wav2vec2_base_raises_another_message_and_the_cause_is_still_the_fp32_features_not_the_conv_weights():
    """The same mistake in a wav2vec2-base shape raises "expected scalar type Float but found BFloat16". Casting the
    conv's weights to fp32 (the operand the op met) leaves a mixed model that raises at the group norm next; the
    cause is the fp32 ``input_values`` fed to a model that is bf16 throughout, cast where they arrive."""
    assert_broken(WAV2VEC2_BASE)
    report = WAV2VEC2_BASE.diagnose(WAV2VEC2_BASE.build())
    assert report.cause.check == "batch-dtype-mismatch", [f.check for f in report.findings]
    assert "`input_values` (float32)" in report.cause.message
    assert report.fixes and report.fixes[0].safe and "bfloat16" in report.fixes[0].title
    cure_through_api(WAV2VEC2_BASE)
    cure_through_widget(WAV2VEC2_BASE)


def test_healthy_wav2vec2_input_values_cast_to_the_models_dtype_draw_nothing():
    """The recipe after the PR (the pipeline casts the features to the model's dtype on every device); and fp32."""
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(1)
        ns = {"model": tiny_wav2vec2(dtype), "input_values": torch.randn(1, 400).to(dtype)}
        assert alarms(mpdoctor.diagnose(namespace=ns)) == []
        assert outcome(WAV2VEC2, ns) == "runs"


# -- Donut (VisionEncoderDecoderModel) after model.half(), fed the image processor's fp32 pixel_values -------------


def tiny_donut(dtype: torch.dtype) -> Any:
    """A tiny Donut: a DonutSwin encoder and an MBart decoder in a VisionEncoderDecoderModel, as
    ``naver-clova-ix/donut-base`` is built."""
    from transformers import (
        DonutSwinConfig,
        MBartConfig,
        VisionEncoderDecoderConfig,
        VisionEncoderDecoderModel,
    )

    encoder = DonutSwinConfig(image_size=32, patch_size=4, num_channels=3, embed_dim=8, depths=[1, 1],
                              num_heads=[2, 2], window_size=2)  # fmt: skip
    decoder = MBartConfig(
        vocab_size=64, d_model=16, decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=32, encoder_layers=1,
        encoder_attention_heads=2, encoder_ffn_dim=32, max_position_embeddings=32, is_decoder=True,
        add_cross_attention=True, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )  # fmt: skip
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder, decoder_start_token_id=1,
                                                                     pad_token_id=0, eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    return VisionEncoderDecoderModel(config=config).to(dtype).eval()


def donut_half_fp32_pixels() -> Namespace:
    """``model.half()``; the Donut image processor rescales to float32 whatever is asked (the thread's point)."""
    torch.manual_seed(1)
    return {"model": tiny_donut(torch.float16), "pixel_values": torch.randn(1, 3, 32, 32)}


def read_document(ns: Namespace) -> Any:
    with torch.no_grad():
        return ns["model"].generate(ns["pixel_values"], max_new_tokens=3, output_logits=True,
                                    return_dict_in_generate=True)  # fmt: skip


DONUT = Case(
    name="donut-half-fp32-pixel-values-generate",
    source="huggingface/transformers#28969",
    slug="batch-dtype-mismatch",
    build=donut_half_fp32_pixels,
    step=read_document,
    failure=r"RuntimeError: Input type \(float\) and bias type \(c10::Half\) should be the same",
    diagnose=crash_report(read_document),
    kind="inference",
)


def test_donut_half_generate_on_fp32_pixel_values_raises_and_the_crash_hook_names_the_patch_embedding():
    assert_broken(DONUT)
    report = DONUT.diagnose(DONUT.build())
    assert report.cause.check == "batch-dtype-mismatch"
    assert report.cause.subject == "model.encoder.embeddings.patch_embeddings.projection"
    assert "`pixel_values` (float32)" in report.cause.message
    (fix,) = report.fixes
    assert fix.safe and "model.generate" in fix.title  # generate() calls the encoder, not model.forward


def test_donut_half_generate_on_fp32_pixel_values_is_cured_through_the_api():
    cure_through_api(DONUT)


def test_donut_half_generate_on_fp32_pixel_values_is_cured_through_the_widget():
    cure_through_widget(DONUT)


def test_donut_input_cast_undone_brings_the_error_back():
    assert_undo_restores(DONUT)


def test_healthy_donut_pixel_values_cast_to_fp16_draw_nothing():
    """The maintainers' answer in the thread: ``pixel_values.to(torch.float16)`` for a half model; and fp32."""
    for dtype in (torch.float16, torch.float32):
        torch.manual_seed(1)
        ns = {"model": tiny_donut(dtype), "pixel_values": torch.randn(1, 3, 32, 32).to(dtype)}
        assert alarms(mpdoctor.diagnose(namespace=ns)) == []
        assert outcome(DONUT, ns) == "runs"


# -- A KV cache filled by the fp32 model, then the model cast to bf16: the next generate meets fp32 keys -------------


def tiny_llama(dtype: torch.dtype = torch.float32) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0,
                         eos_token_id=None, bos_token_id=1)  # fmt: skip
    return LlamaForCausalLM(config).to(dtype).eval()


def prompt_cached(static: bool, cast_first: bool) -> Namespace:
    """The prompt's keys and values kept for reuse (transformers' prompt-reuse recipe), then ``model.to(bf16)``.

    litgpt's and nanochat's caches were allocated in fp32 (the default dtype) beside a bf16 model; transformers
    allocates a cache in the dtype of the first keys it stores, so the same fp32 cache comes from a prefill run
    before the cast (``cast_first=False``). The healthy twin casts first and fills the cache after."""
    from transformers import DynamicCache, StaticCache

    model = tiny_llama()
    if cast_first:
        model.to(torch.bfloat16)
    cache = StaticCache(config=model.config, max_cache_len=16) if static else DynamicCache(config=model.config)
    with torch.no_grad():
        model(PROMPT["input_ids"], past_key_values=cache, use_cache=True)
    model.to(torch.bfloat16)
    return {"model": model, "prompt_cache": cache, "ids": torch.tensor([[3, 14, 15, 9, 7]])}


def continue_prompt(ns: Namespace) -> Any:
    """``generate`` on the prompt plus one token, reusing the cached prompt."""
    with torch.no_grad():
        return ns["model"].generate(ns["ids"], past_key_values=ns["prompt_cache"], max_new_tokens=2, pad_token_id=0,
                                    do_sample=False, output_logits=True, return_dict_in_generate=True)  # fmt: skip


STATIC_CACHE = Case(
    name="static-kv-cache-fp32-in-bf16-model",
    source="Lightning-AI/litgpt#57",
    slug="kv-cache-dtype-mismatch",
    build=lambda: prompt_cached(static=True, cast_first=False),
    step=continue_prompt,
    failure=r"RuntimeError: index_copy_\(\): self and source expected to have the same dtype, but got \(self\) Float "
    r"and \(source\) BFloat16",
    kind="inference",
)

DYNAMIC_CACHE = Case(
    name="dynamic-kv-cache-fp32-in-bf16-model",
    source="karpathy/nanochat#795",
    slug="kv-cache-dtype-mismatch",
    build=lambda: prompt_cached(static=False, cast_first=False),
    step=continue_prompt,
    failure=r"RuntimeError: Expected query, key, and value to have the same dtype, but got query.dtype: "
    r"c10::BFloat16 key.dtype: float and value.dtype: float instead.",
    kind="inference",
)


@pytest.mark.parametrize("case", [STATIC_CACHE, DYNAMIC_CACHE], ids=["static", "dynamic"])
def test_an_fp32_kv_cache_in_a_bf16_generate_raises_the_reported_error_and_is_named(case):
    """Named at rest, before the call (the cases' diagnosis: ``diagnose(namespace=...)``), and by the crash hook after
    it. The failed call has already advanced the first layer by one token (a static layer's ``cumulative_length``,
    a dynamic layer's concatenated keys), so after the crash the cast alone does not cure the held cache: for a
    dynamic cache the crash's plan also crops it back (``kv-cache-half-updated``, tests/stack/test_cache_rollback.py);
    a static layer's count is not rolled back, and its cure is proven on the diagnosis before the call."""
    assert_broken(case)  # the threads' very errors, from the real generate() and transformers' cache classes
    (finding,) = case.diagnose(case.build()).findings_for("kv-cache-dtype-mismatch")
    assert finding.subject == "prompt_cache" and finding.severity == "error"
    assert "stores fp32 keys and values while model computes in bf16" in finding.message
    assert [a.split(":")[0] for a in alarms(case.diagnose(case.build()))] == ["kv-cache-dtype-mismatch"]
    ns = case.build()
    report = crash_report(continue_prompt)(ns)
    assert report.findings_for("kv-cache-dtype-mismatch")
    expected = ["kv-cache-dtype-mismatch"] if case is STATIC_CACHE else ["kv-cache-dtype-mismatch", "kv-cache-half-updated"]
    assert sorted(fix.slug for fix in report.fixes) == expected and all(fix.safe for fix in report.fixes)
    assert [int(layer.keys.shape[-2]) if case is not STATIC_CACHE else int(layer.cumulative_length)
            for layer in ns["prompt_cache"].layers] == [5, 4]  # fmt: skip


@pytest.mark.parametrize("case", [STATIC_CACHE, DYNAMIC_CACHE], ids=["static", "dynamic"])
def test_an_fp32_kv_cache_in_a_bf16_generate_is_cured_through_the_api(case):
    cure_through_api(case)


@pytest.mark.parametrize("case", [STATIC_CACHE, DYNAMIC_CACHE], ids=["static", "dynamic"])
def test_an_fp32_kv_cache_in_a_bf16_generate_is_cured_through_the_widget(case):
    cure_through_widget(case)


@pytest.mark.parametrize("case", [STATIC_CACHE, DYNAMIC_CACHE], ids=["static", "dynamic"])
def test_the_kv_cache_cast_undone_brings_the_error_back(case):
    assert_undo_restores(case)
    ns = case.build()
    layers = ns["prompt_cache"].layers
    keys = [layer.keys for layer in layers]
    (fix,) = case.diagnose(ns).fixes
    fix.apply()
    assert {layer.keys.dtype for layer in layers} == {torch.bfloat16}
    fix.undo()
    assert all(layer.keys is k for layer, k in zip(layers, keys, strict=True))  # the very fp32 tensors, back


@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
def test_healthy_kv_cache_filled_after_the_cast_draws_nothing(static):
    """The recipe: cast the model first, then fill the cache (the fix both threads made: the cache in the model's
    dtype)."""
    ns = prompt_cached(static=static, cast_first=True)
    assert alarms(mpdoctor.diagnose(namespace=ns)) == []
    assert outcome(STATIC_CACHE, ns) == "runs"


# -- A legacy tuple cache turned fp32 by accelerate's output conversion, beside the bf16 model: generate fails --------


def legacy_prompt_cache(convert: bool) -> Namespace:
    """transformers#30019: the Trainer's accelerate-wrapped forward (``convert_outputs_to_fp32``) cast the bf16
    model's legacy tuple cache to fp32, and the next ``generate`` with it blew up. transformers 5.23 returns a
    ``DynamicCache``, which the wrapper leaves alone; code that keeps the legacy format across versions (xinference
    PR #5477 converts it with ``DynamicCache(ddp_cache_data=...)``) still holds a tuple, and accelerate's very
    ``convert_to_fp32`` (what the wrapper applies to every output) still casts it. ``convert=False``: the healthy
    twin, the legacy tuple as the bf16 model returned it."""
    from accelerate.utils import convert_to_fp32

    model = tiny_llama(torch.bfloat16)
    with torch.no_grad():
        cache = model(PROMPT["input_ids"], use_cache=True).past_key_values
    legacy = tuple((layer.keys, layer.values) for layer in cache.layers)
    return {"model": model, "prompt_kv": convert_to_fp32(legacy) if convert else legacy,
            "ids": torch.tensor([[3, 14, 15, 9, 7]])}  # fmt: skip


def continue_from_legacy(ns: Namespace) -> Any:
    """``generate`` on the prompt plus one token, the legacy cache converted at the call."""
    from transformers import DynamicCache

    with torch.no_grad():
        return ns["model"].generate(ns["ids"], past_key_values=DynamicCache(ddp_cache_data=ns["prompt_kv"]),
                                    max_new_tokens=2, pad_token_id=0, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True)  # fmt: skip


LEGACY_CACHE = Case(
    name="legacy-tuple-kv-cache-fp32-in-bf16-model",
    source="huggingface/transformers#30019",
    slug="kv-cache-dtype-mismatch",
    build=lambda: legacy_prompt_cache(convert=True),
    step=continue_from_legacy,
    failure=r"RuntimeError: Expected query, key, and value to have the same dtype, but got query.dtype: "
    r"c10::BFloat16 key.dtype: float and value.dtype: float instead.",
    kind="inference",
)


def test_a_legacy_tuple_cache_cast_to_fp32_by_accelerate_fails_in_a_bf16_generate_and_is_named():
    """The thread's model ran flash-attention 2 on a GPU, whose error text differs; here SDPA's dtype check raises
    on the same fp32 keys. Named at rest, and by the crash hook after the call (the conversion at the call copies
    nothing into the held tuple, so after the crash the tuple is as it was and the cast cures it)."""
    assert_broken(LEGACY_CACHE)
    ns = LEGACY_CACHE.build()
    (finding,) = LEGACY_CACHE.diagnose(ns).findings_for("kv-cache-dtype-mismatch")
    assert finding.subject == "prompt_kv" and finding.severity == "error"
    assert "prompt_kv (legacy tuple of 2 layers) stores fp32 keys and values while model computes in bf16" in finding.message
    assert [a.split(":")[0] for a in alarms(LEGACY_CACHE.diagnose(ns))] == ["kv-cache-dtype-mismatch"]
    report = crash_report(continue_from_legacy)(ns)
    assert report.findings_for("kv-cache-dtype-mismatch")
    fixes = [f for f in report.fixes if f.slug == "kv-cache-dtype-mismatch"]
    assert len(fixes) == 1 and fixes[0].safe
    fixes[0].apply()
    assert_output_finite(continue_from_legacy(ns))


def test_a_legacy_tuple_cache_in_fp32_is_cured_through_the_api():
    cure_through_api(LEGACY_CACHE)


def test_a_legacy_tuple_cache_in_fp32_is_cured_through_the_widget():
    cure_through_widget(LEGACY_CACHE)


def test_the_legacy_cache_cast_undone_brings_the_error_back_with_the_very_storage():
    assert_undo_restores(LEGACY_CACHE)
    ns = LEGACY_CACHE.build()
    tensors = [t for layer in ns["prompt_kv"] for t in layer]
    storage = [t.data_ptr() for t in tensors]
    (fix,) = LEGACY_CACHE.diagnose(ns).fixes
    fix.apply()
    assert [t for layer in ns["prompt_kv"] for t in layer] == tensors and {t.dtype for t in tensors} == {torch.bfloat16}
    fix.undo()
    assert [t.data_ptr() for t in tensors] == storage


def test_healthy_legacy_tuple_cache_in_the_models_dtype_draws_nothing():
    """The recipe: the cache kept as the bf16 model returned it (what the thread's fix did: no fp32 conversion of the
    outputs), and generation on the CPU in fp32."""
    ns = legacy_prompt_cache(convert=False)
    assert alarms(mpdoctor.diagnose(namespace=ns)) == []
    assert outcome(LEGACY_CACHE, ns) == "runs"
    model = tiny_llama(torch.float32)
    with torch.no_grad():
        cache = model(PROMPT["input_ids"], use_cache=True).past_key_values
    fp32 = {"model": model, "prompt_kv": tuple((layer.keys, layer.values) for layer in cache.layers),
            "ids": ns["ids"]}  # fmt: skip
    assert alarms(mpdoctor.diagnose(namespace=fp32)) == []
    assert outcome(LEGACY_CACHE, fp32) == "runs"


# -- Stable Diffusion 2.x's UNet in fp16 without upcast_attention: the classic attention's scores overflow ----------


def tiny_sd2_unet(dtype: torch.dtype, upcast: bool, classic: bool = True) -> Any:
    """A tiny ``UNet2DConditionModel`` with the classic attention processor (``set_default_attn_processor()``: the
    path without xformers or SDPA, InvokeAI's before its fix). Its q and k projections are scaled by 400 (weights
    inside fp16's range) so q·kᵀ passes 65504: the 768 v-models of SD 2.x reach it with their own weights; tiny
    random ones do not. torch's CPU SDPA accumulates q·kᵀ in fp32 and never shows it (docs: STACK.md), hence the
    classic processor."""
    from diffusers import UNet2DConditionModel
    from diffusers.models.attention_processor import Attention

    torch.manual_seed(0)
    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(8, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=8,
                                attention_head_dim=4, norm_num_groups=4, upcast_attention=upcast)  # fmt: skip
    with torch.no_grad():
        for module in unet.modules():
            if isinstance(module, Attention):
                module.to_q.weight.mul_(400.0)
                module.to_k.weight.mul_(400.0)
    if classic:
        unet.set_default_attn_processor()
    return unet.to(dtype).eval()


def sd2_denoise_batch(dtype: torch.dtype, upcast: bool, classic: bool = True) -> Namespace:
    torch.manual_seed(1)
    batch = {"sample": torch.randn(1, 4, 8, 8, dtype=dtype), "timestep": torch.tensor([10]),
             "encoder_hidden_states": torch.randn(1, 3, 8, dtype=dtype)}  # fmt: skip
    return {"unet": tiny_sd2_unet(dtype, upcast, classic), "batch": batch}


def denoise(ns: Namespace) -> Any:
    """The pipeline's call into the UNet: the noise prediction of one step."""
    with torch.no_grad():
        return ns["unet"](**ns["batch"]).sample


def probed_unet(ns: Namespace) -> Any:
    return mpdoctor.probe(ns["unet"], ns["batch"], name="unet", training=False)


SD2_UPCAST = Case(
    name="sd2-unet-fp16-attention-not-upcast",
    source="invoke-ai/InvokeAI#2329",
    slug="attention-upcast-off",
    build=lambda: sd2_denoise_batch(torch.float16, upcast=False),
    step=denoise,
    failure=r"output is not finite",
    diagnose=probed_unet,
    kind="inference",
)


def test_an_sd2_unet_in_fp16_without_upcast_attention_predicts_nan_and_the_probe_names_the_attention():
    assert_broken(SD2_UPCAST)
    ns = SD2_UPCAST.build()
    assert torch.isnan(denoise(ns)).any()
    report = probed_unet(ns)
    (finding,) = report.findings_for("attention-upcast-off")
    assert finding.severity == "error"
    assert finding.subject == "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1"
    assert "8 of 8 attention modules of unet have upcast_attention off" in finding.message
    (fix,) = finding.fixes
    assert fix.safe


def test_an_sd2_unet_in_fp16_without_upcast_attention_is_cured_through_the_api():
    cure_through_api(SD2_UPCAST)


def test_an_sd2_unet_in_fp16_without_upcast_attention_is_cured_through_the_widget():
    cure_through_widget(SD2_UPCAST)


def test_the_upcast_undone_brings_the_nan_back_and_the_weights_stay_fp16():
    assert_undo_restores(SD2_UPCAST)
    ns = SD2_UPCAST.build()
    (fix,) = [f for f in probed_unet(ns).fixes if f.slug == "attention-upcast-off"]
    fix.apply()
    assert ns["unet"].config.upcast_attention is True
    assert {p.dtype for p in ns["unet"].parameters()} == {torch.float16}
    # The same prediction, bit for bit, as the twin built from SD 2.x's config (upcast_attention=True)
    assert torch.equal(denoise(ns), denoise(sd2_denoise_batch(torch.float16, upcast=True)))
    fix.undo()
    assert ns["unet"].config.upcast_attention is False and torch.isnan(denoise(ns)).any()


def test_a_config_asking_for_upcast_with_modules_that_have_it_off_is_info_until_a_probe_measures_it():
    ns = sd2_denoise_batch(torch.float16, upcast=False)
    ns["unet"].register_to_config(upcast_attention=True)  # the config says it; the live modules were built without
    (finding,) = mpdoctor.diagnose(namespace=ns).findings_for("attention-upcast-off")
    assert finding.severity == "info" and "asks for upcast_attention=True" in finding.message


@pytest.mark.parametrize("recipe", ["sd2-config-upcast", "sdpa-processor", "fp32"])
def test_healthy_sd2_unet_with_upcast_or_sdpa_or_fp32_draws_nothing(recipe):
    """SD 2.x's own config (``upcast_attention=True``) in fp16 with the classic processor; the default SDPA processor
    in fp16 (it never reads the flag, and this CPU's SDPA accumulates in fp32); and fp32."""
    ns = {"sd2-config-upcast": lambda: sd2_denoise_batch(torch.float16, upcast=True),
          "sdpa-processor": lambda: sd2_denoise_batch(torch.float16, upcast=False, classic=False),
          "fp32": lambda: sd2_denoise_batch(torch.float32, upcast=False)}[recipe]()  # fmt: skip
    assert alarms(probed_unet(ns)) == []
    assert alarms(mpdoctor.diagnose(namespace=ns)) == []
    assert not mpdoctor.diagnose(namespace=ns).findings_for("attention-upcast-off")
    assert outcome(SD2_UPCAST, ns) == "runs"
