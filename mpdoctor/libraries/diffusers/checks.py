"""Diffusion pipelines: a VAE decoding in fp16 past 65504, attention scores computed in fp16 without
``upcast_attention``, pipeline components whose dtypes meet without a cast."""

from __future__ import annotations

from collections.abc import Iterator

from ...facts import Facts, ModelFacts
from ...rules.checks import check
from ...rules.engine.changes import CastInputsHook, CastParamsTo, SetConfigEntry, UpcastAttention
from ...rules.engine.findings import Finding, Severity, size_delta
from ...rules.engine.fixes import Fix
from ...rules.engine.rules import Applicability, Rule

#: Component attributes of a pipeline that produce the conditioning the denoiser reads.
_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder")
_DENOISERS = ("unet", "transformer", "prior", "decoder")
#: Networks run beside the denoiser on the same latents, their residuals added into it (a ControlNet, a T2I adapter).
_CONDITIONERS = ("controlnet", "adapter")


#: The calls a user makes into a diffusers VAE besides ``forward`` (``vae.encode(image)``, ``vae.decode(latents)``).
_VAE_ENTRIES = (("", "encode"), ("", "decode"))


def _fp16_ids(m: ModelFacts) -> frozenset[int]:
    return frozenset(p.id for p in m.tensors.params if p.dtype == "float16")


def _upcast_fixes(facts: Facts, m: ModelFacts) -> list[Fix]:
    ids = _fp16_ids(m)
    spec = CastParamsTo(m.ref, ids, "float32", (), "fp16 VAE parameters")
    # The user's fp16 images and latents still arrive in fp16: each entry point casts them to the upcast weights.
    inputs = CastInputsHook(m.ref, "float32", m.name, _VAE_ENTRIES)
    extra = sum(p.numel for p in m.tensors.params if p.id in ids) * 2
    return [
        Fix(
            f"Upcast {m.name} to fp32 and cast its inputs at forward / encode / decode (the denoiser stays fp16)",
            f"{m.name}.to(torch.float32)  # pipelines cast the latents to the VAE's dtype before decoding\n"
            f"# and call it with fp32 inputs: {m.name}(image.float()), {m.name}.decode(latents.float())",
            applicability=Applicability.UNSAFE,
            changes=(spec, inputs),
            backup_bytes=spec.backup_bytes(facts),
            recipe="vae-fp32",
            cost=f"{size_delta(extra)} of VAE weights",
        ),
        _force_upcast_fix(facts, m),
    ]


def _force_upcast_fix(facts: Facts, m: ModelFacts) -> Fix:
    """``force_upcast=True`` on the VAE's live config where a pipeline that reads it holds the VAE (SDXL and its
    kin upcast it to fp32 to decode, then cast it back); shown only where no such pipeline is among the subjects."""
    title = f"Keep {m.name} in fp16 and let the pipeline upcast it to decode (force_upcast=True)"
    pipe = next((p for p in getattr(facts, "pipelines", ()) if p.vae_ref == m.ref and p.reads_force_upcast), None)
    if pipe is not None:
        return Fix(
            title,
            f"{m.name}.register_to_config(force_upcast=True)  # {pipe.class_name} upcasts it to fp32 to decode",
            applicability=Applicability.SAFE,
            changes=(SetConfigEntry(m.ref, "force_upcast", True, f"{m.name}.config.force_upcast"),),
            recipe="vae-force-upcast",
        )
    return Fix(
        title,
        f"{m.name}.register_to_config(force_upcast=True)  # SDXL / SD3 pipelines call upcast_vae() before decoding\n"
        "# or load an fp16-safe VAE: AutoencoderKL.from_pretrained('madebyollin/sdxl-vae-fp16-fix', torch_dtype=torch.float16)",
        applicability=Applicability.DISPLAY_ONLY,
        recipe="vae-force-upcast",
    )


@check("vae-fp16-overflow", Severity.ERROR, Severity.INFO,
       fix_safety=(Applicability.UNSAFE, Applicability.SAFE, Applicability.DISPLAY_ONLY))
def vae_fp16_overflow(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A diffusers VAE running in fp16 whose activations overflow (or would, with force_upcast off).

    What it does
        A diffusers VAE (``AutoencoderKL`` ...) with fp16 weights. Error when a one-batch probe
        (``mpdoctor.probe(pipe.vae, latents_or_images)``) saw its activations go inf/NaN in fp16; info
        when it is fp16 with ``config.force_upcast=False`` and no probe has looked yet.
    Why is this bad?
        The Stable Diffusion and SDXL VAEs have activations past fp16's 65504 in their decoder: in fp16 they
        become inf, the decoded image NaN, and the saved image black ("RuntimeWarning: invalid value
        encountered in cast"). diffusers marks such VAEs ``force_upcast=True`` and its pipelines upcast them
        to fp32 before decoding; a VAE loaded with ``force_upcast=False`` (or called directly) decodes in fp16.
        fp16-fixed VAEs (``madebyollin/sdxl-vae-fp16-fix``) are safe in fp16, so the static case is only info.
    Example
        pipe = StableDiffusionXLPipeline.from_pretrained(name, torch_dtype=torch.float16)
        pipe.vae.config.force_upcast = False  # the SDXL VAE overflows in fp16: black images
    Use instead
        pipe = StableDiffusionXLPipeline.from_pretrained(name, torch_dtype=torch.float16)
        pipe.vae.to(torch.float32)  # or a VAE made fp16-safe
    Severity
        Error when a probe saw the overflow (every image is black); info for the flag alone: fp16-fixed VAEs
        (``madebyollin/sdxl-vae-fp16-fix``) ship ``force_upcast=False`` in healthy fp16 SDXL recipes, so the flag
        is no failure until a probe shows the overflow.
    Fix safety
        Upcast the VAE to fp32 in place, its floating inputs cast to fp32 at ``forward``, ``encode`` and ``decode``
        (the user's fp16 images and latents; the denoiser stays fp16),
        or keep it fp16 with ``force_upcast=True`` so the pipeline upcasts it to decode, or load an fp16-safe VAE.
        ``force_upcast=True`` is set on the VAE's live config in place (safe; undo puts the very config object
        back) where a pipeline whose ``__call__`` reads it (SDXL and its kin, read from the pipeline class's
        source) holds the VAE; elsewhere (a lone VAE, Stable Diffusion 1.x, which never reads it) it is shown only.
    Sources
        diffusers ``StableDiffusionXLPipeline.__call__`` ("make sure the VAE is in float32 mode, as it
        overflows in float16"), ``AutoencoderKL(force_upcast=...)``; ComfyUI issue #1401; InstantID issue #261;
        ComfyUI-MVAdapter issue #14.
    """
    probed: set[str] = set()
    for p in facts.probes:
        m = next((x for x in facts.models if x.name == p.model), None)
        if m is None or m.component is None or not m.component.is_vae:
            continue
        fp16 = m.tensors.main_dtype == "float16" or p.autocast == "float16"
        hit = p.first_nonfinite()
        if not fp16 or hit is None:
            continue
        probed.add(m.name)
        module, phase = hit
        yield rule.finding(
            m.name,
            f"{m.name} ({m.component.class_path.rsplit('.', 1)[-1]}) runs in fp16 and its activations overflow: "
            f"{module.path or m.name} produced {module.out_nonfinite or module.grad_nonfinite:,} inf/NaN values in the "
            f"{phase} (fp16 tops out at 65504), so decoded images are NaN (black). Upcast the VAE to fp32 to decode.",
            {"module": module.path, "phase": phase, "force_upcast": m.component.flag("force_upcast"), "main_dtype": m.tensors.main_dtype},
            _upcast_fixes(facts, m),
        )
    for m in facts.models:
        c = m.component
        if c is None or not c.is_vae or m.name in probed or m.tensors.main_dtype != "float16":
            continue
        if c.flag("force_upcast") is not False:
            continue
        yield rule.finding(
            m.name,
            f"{m.name} is fp16 with force_upcast=False: pipelines decode with it in fp16. The Stable Diffusion / SDXL "
            "VAEs overflow fp16 there (black images); an fp16-fixed VAE does not. mpdoctor.probe(...) on a batch of "
            "latents tells which this is.",
            {"force_upcast": False, "main_dtype": "float16"},
            _upcast_fixes(facts, m),
            severity=Severity.INFO,
        )


def _upcast_attention_fix(m: ModelFacts) -> Fix:
    """``upcast_attention`` / ``upcast_softmax`` set on every attention module of ``m`` that has it off, and on its
    config where the config names it (safe: more precise scores, same weights)."""
    c = m.component
    changes: tuple = (UpcastAttention(m.ref, c.upcast_off, m.name),)
    if c.flag("upcast_attention") is not None:
        changes += (SetConfigEntry(m.ref, "upcast_attention", True, f"{m.name}.config.upcast_attention"),)
    return Fix(
        f"Upcast the attention scores of {m.name} to fp32 ({len(c.upcast_off)} attention modules: "
        "upcast_attention=True)",
        "from diffusers.models.attention_processor import Attention\n"
        f"for module in {m.name}.modules():\n"
        "    if isinstance(module, Attention):\n"
        "        module.upcast_attention = module.upcast_softmax = True  # q·kᵀ and softmax in fp32\n"
        f"{m.name}.register_to_config(upcast_attention=True)  # what Stable Diffusion 2.x's UNet config says",
        applicability=Applicability.SAFE,
        changes=changes,
        recipe="upcast-attention",
        cost="q·kᵀ and the softmax in fp32 in the attention modules",
    )


def _inside(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + ".") for r in roots)


def _first_bad_path(p) -> str | None:
    """Where a probe's forward first went non-finite: the op's module the NaN origin names, else the first module."""
    origin = getattr(p, "origin", None)
    if origin is not None:
        return origin.module
    hit = p.first_nonfinite()
    return hit[0].path if hit is not None and hit[1] == "forward" else None


@check("attention-upcast-off", Severity.ERROR, Severity.INFO, fix_safety=(Applicability.SAFE,))
def attention_upcast_off(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A diffusers model computes its attention scores in fp16 with ``upcast_attention`` off, and they overflow.

    What it does
        Error when a probe of a diffusers model (``mpdoctor.probe(pipe.unet, batch)``) running in fp16 saw its
        forward first go NaN/Inf inside an ``Attention`` module whose ``upcast_attention`` is False while its
        processor reads it (the classic ``AttnProcessor`` / ``SlicedAttnProcessor``). Info, without a probe, when
        the model's config asks for ``upcast_attention=True`` but its live attention modules have it off.
    Why is this bad?
        The classic processors compute q·kᵀ with ``baddbmm`` in the model's dtype: past 65504 a score is inf in
        fp16, the softmax of its row is NaN and the UNet's output NaN; the pipeline decodes black images.
        Stable Diffusion 2.x (the 768 v-models) is the known case: its config says ``upcast_attention=True`` and
        the conversion scripts take ``--upcast_attention`` ("necessary when running stable diffusion 2.1"); a UNet
        converted or built without it, run without xformers or SDPA, returns black images in fp16.
    Example
        unet = UNet2DConditionModel.from_config(config_without_upcast, torch_dtype=torch.float16)
        unet.set_default_attn_processor()  # the classic processor: scores in fp16
        unet(latents, t, encoder_hidden_states=text).sample  # NaN
    Use instead
        unet = UNet2DConditionModel.from_config({**config, "upcast_attention": True}, torch_dtype=torch.float16)
        unet(latents, t, encoder_hidden_states=text).sample
    Fix safety
        Safe: ``upcast_attention`` and ``upcast_softmax`` are set on the live attention modules (and the config
        entry where the config names it), in place; the weights stay fp16, only the scores and the softmax are
        computed in fp32 and the probabilities cast back. Undo restores every old value.
    Severity
        Error when a probe measured the overflow inside such a module; info when only the config and the
        modules disagree (a tiny or fp16-safe model may never reach 65504 there).
    Sources
        diffusers ``Attention.get_attention_scores`` (``upcast_attention`` casts query and key to fp32),
        ``scripts/convert_original_stable_diffusion_to_diffusers.py`` (``--upcast_attention``); diffusers issue
        #1614; InvokeAI issue #2329 ("SD 2.x models return only black in float16"); stable-diffusion-webui PR
        #6510 ("upcasting attention for inference using SD 2.1 models").
    """
    probed: set[str] = set()
    for p in facts.probes:
        m = next((x for x in facts.models if x.name == p.model), None)
        if m is None or m.component is None or not m.component.upcast_off:
            continue
        fp16 = m.tensors.main_dtype == "float16" or p.autocast == "float16"
        where = _first_bad_path(p)
        if not fp16 or where is None or not _inside(where, m.component.upcast_off):
            continue
        probed.add(m.name)
        yield rule.finding(
            f"{m.name}.{where}",
            f"{m.name}.{where} (Attention) computes q·kᵀ in fp16 with upcast_attention off, and the probe's forward "
            f"first went NaN/Inf there: a score past 65504 is inf, its softmax row NaN, and the output NaN (black "
            f"images). {len(m.component.upcast_off)} of {m.component.attention} attention modules of {m.name} have "
            "upcast_attention off.",
            {"module": where, "upcast_off": list(m.component.upcast_off), "attention": m.component.attention,
             "config_upcast_attention": m.component.flag("upcast_attention"), "main_dtype": m.tensors.main_dtype},  # fmt: skip
            [_upcast_attention_fix(m)],
        )
    for m in facts.models:
        c = m.component
        if c is None or m.name in probed or not c.upcast_off or c.flag("upcast_attention") is not True:
            continue
        yield rule.finding(
            m.name,
            f"{m.name}'s config asks for upcast_attention=True, but {len(c.upcast_off)} of its {c.attention} attention "
            "modules have it off: their q·kᵀ is computed in the model's dtype (in fp16, past 65504 it is inf and the "
            "output NaN). mpdoctor.probe(...) on a batch tells whether it overflows here.",
            {"upcast_off": list(c.upcast_off), "attention": c.attention, "config_upcast_attention": True},
            [_upcast_attention_fix(m)],
            severity=Severity.INFO,
        )


def _role(m: ModelFacts) -> str:
    return m.name.rsplit(".", 1)[-1]


@check("pipeline-component-dtypes", Severity.ERROR, fix_safety=(Applicability.UNSAFE,))
def pipeline_component_dtypes(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A diffusion pipeline whose text encoder (or ControlNet) and denoiser hold different dtypes.

    What it does
        In one ``DiffusionPipeline``, a text / image encoder, or a ControlNet / T2I adapter, whose weights are in
        another floating dtype than the denoiser (``unet`` / ``transformer``) it conditions, e.g. after
        ``pipe.unet.half()`` alone, or a ControlNet loaded without the pipeline's ``torch_dtype``.
    Why is this bad?
        Pipelines cast the prompt embeddings to the text encoder's dtype and prepare the latents in that dtype,
        then call the denoiser with them and no autocast: the first convolution or matmul raises
        ``Input type (float) and bias type (c10::Half) should be the same`` (or ``mat1 and mat2 must have the
        same dtype``). A VAE in fp32 beside an fp16 denoiser is the opposite case and fine: the pipelines cast
        the latents to the VAE's dtype (the ``force_upcast`` practice).
    Example
        pipe = StableDiffusionPipeline.from_pretrained(name, torch_dtype=torch.float16)
        pipe.text_encoder.float()
    Use instead
        pipe = StableDiffusionPipeline.from_pretrained(name, torch_dtype=torch.float16)  # one dtype
    Severity
        Error: the pipeline call raises at the first denoising step.
    Fix safety
        Cast the encoder to the denoiser's dtype in place (``pipe.text_encoder.to(torch.float16)``), or load
        the whole pipeline with one ``torch_dtype``. Unsafe: it changes the encoder's precision.
    Sources
        diffusers ``StableDiffusionPipeline.encode_prompt`` / ``prepare_latents``; sdnext issue #1431
        ("Input type (c10::BFloat16) and bias type (c10::Half) should be the same"); diffusers
        ``StableDiffusionControlNetPipeline.__call__`` (the ControlNet runs on the latents, its residuals are
        added into the UNet's).
    """
    owners = {s.name for s in facts.subjects if s.kind == "pipeline"}
    for owner in sorted(owners):
        parts = [m for m in facts.models if m.owner == owner]
        denoiser = next((m for m in parts if _role(m) in _DENOISERS and m.tensors.main_dtype), None)
        if denoiser is None:
            continue
        want = denoiser.tensors.main_dtype
        for enc in parts:
            have = enc.tensors.main_dtype
            if _role(enc) not in (*_ENCODERS, *_CONDITIONERS) or have is None or have == want:
                continue
            ids = frozenset(p.id for p in enc.tensors.params if p.dtype == have)
            spec = CastParamsTo(enc.ref, ids, want, (), f"{have} parameters of {enc.name}")
            how = (f"{owner} runs it on the {want} latents and adds its {have} residuals into the {want} denoiser"
                   if _role(enc) in _CONDITIONERS else
                   f"{owner} prepares the prompt embeddings and latents in {have} and feeds them to the {want} "
                   "denoiser")  # fmt: skip
            yield rule.finding(
                enc.name,
                f"{enc.name} is {have} while {denoiser.name} is {want}: {how} without a cast, so the first denoising "
                "step raises a dtype mismatch.",
                {"encoder": enc.name, "encoder_dtype": have, "denoiser": denoiser.name, "denoiser_dtype": want},
                [
                    Fix(
                        f"Cast {enc.name} to {want} (one dtype for the pipeline's "
                        f"{'conditioning network' if _role(enc) in _CONDITIONERS else 'encoder'} and denoiser)",
                        f"{enc.name}.to(torch.{want})\n# or load the pipeline with one dtype: "
                        f"DiffusionPipeline.from_pretrained(..., torch_dtype=torch.{want})", applicability=Applicability.UNSAFE,
                        changes=(spec,),
                        backup_bytes=spec.backup_bytes(facts),
                        recipe="pipeline-one-dtype",
                    )
                ],
            )
