"""diffusers: a ``DiffusionPipeline`` is one patient whose parts are models.

A pipeline brings its components (UNet or transformer, VAE, text encoders,
ControlNet, ...) as child model subjects named ``pipe.unet``, ``pipe.vae``, ...
Each diffusers model (``ModelMixin``) adds the precision flags of its config:
``force_upcast`` on a VAE (the pipelines upcast an fp16 VAE to fp32 to decode
when it is True), ``upcast_attention`` / ``upcast_softmax`` on UNets and
attention blocks, and the class's ``_keep_in_fp32_modules``.

The config is diffusers' ``FrozenDict`` (a ``dict`` subclass): it is read with
``dict.get`` so no user hook runs.
"""

from __future__ import annotations

from typing import Any

from ...objects.integrations import Integration
from ...objects.live.introspect import class_path, is_a, modules_of, raw_attr, type_name
from .facts import ComponentFacts, PipelineFacts

PIPELINE = "diffusers.pipelines.pipeline_utils.DiffusionPipeline"
MODEL_MIXIN = "diffusers.models.modeling_utils.ModelMixin"
VAE_CLASSES = (
    "diffusers.models.autoencoders.autoencoder_kl.AutoencoderKL",
    "diffusers.models.autoencoders.autoencoder_tiny.AutoencoderTiny",
    "diffusers.models.autoencoders.vae.VAE",
)

#: The attributes under which pipelines register their model components (``register_modules``).
COMPONENTS = (
    "unet",
    "transformer",
    "prior",
    "decoder",
    "controlnet",
    "vae",
    "movq",
    "text_encoder",
    "text_encoder_2",
    "text_encoder_3",
    "image_encoder",
)

#: Config keys that change what a component computes in. Sources: diffusers ``AutoencoderKL.__init__``
#: (``force_upcast``), ``UNet2DConditionModel`` (``upcast_attention``), ``Attention`` (``upcast_softmax``),
#: pipelines' ``upcast_vae`` (StableDiffusionXLPipeline: "make sure the VAE is in float32 mode, as it
#: overflows in float16").
PRECISION_FLAGS = ("force_upcast", "upcast_attention", "upcast_softmax", "mid_block_add_attention", "scaling_factor")


def _config_flags(module: Any) -> tuple[tuple[str, object], ...]:
    config = raw_attr(module, "_internal_dict", None)
    if not isinstance(config, dict):
        return ()
    out = []
    for key in PRECISION_FLAGS:
        value = dict.get(config, key)
        if isinstance(value, (bool, int, float, str)):
            out.append((key, value))
    keep = raw_attr(module, "_keep_in_fp32_modules", None)
    if isinstance(keep, (list, tuple)) and keep:
        out.append(("_keep_in_fp32_modules", tuple(str(k) for k in keep)))
    return tuple(out)


#: diffusers' attention module: its ``upcast_attention`` computes q·kᵀ in fp32 in the classic processors.
ATTENTION = "diffusers.models.attention_processor.Attention"


#: ``(id(class), word) -> (class, found)``: a class's ``__call__`` source is read once per process and word.
_CALL_MENTIONS: dict[tuple[int, str], tuple[type, bool]] = {}


def _call_mentions(cls: type, word: str) -> bool:
    """True when ``word`` is in the source of ``cls.__call__`` (read, never run); False when there is no source (a
    compiled or dynamic class: it is not known to read it)."""
    import inspect

    known = _CALL_MENTIONS.get((id(cls), word))
    if known is not None and known[0] is cls:
        return known[1]
    try:
        found = word in inspect.getsource(inspect.unwrap(inspect.getattr_static(cls, "__call__")))
    except (OSError, TypeError, AttributeError):
        found = False
    _CALL_MENTIONS[(id(cls), word)] = (cls, found)
    return found


def honours_upcast(cls: type) -> bool:
    """True when the attention processor class computes its scores through ``attn.get_attention_scores`` (the
    classic ``AttnProcessor``, ``SlicedAttnProcessor``), which reads ``upcast_attention``. SDPA and xformers
    processors compute the scores in their kernel and never read the flag."""
    return _call_mentions(cls, "get_attention_scores")


def attention_upcast(model: Any) -> tuple[int, tuple[str, ...]]:
    """How many diffusers ``Attention`` modules ``model`` has, and the paths of those whose ``upcast_attention`` is
    off while their processor would honour it (read from each module's own ``__dict__``, on the shared walk)."""
    found = modules_of(model, (ATTENTION,))
    return len(found), tuple(path for path, m in found if raw_attr(m, "upcast_attention", None) is False
                             and honours_upcast(type(raw_attr(m, "processor", None))))  # fmt: skip


def _model_facts(outer: Any, inner: Any, inner_path: str, live: Any) -> dict:
    if not is_a(inner, (MODEL_MIXIN,)):
        return {}
    attention, off = attention_upcast(inner)
    return {
        "component": ComponentFacts(
            class_path=class_path(type(inner)),
            is_vae=is_a(inner, VAE_CLASSES),
            flags=_config_flags(inner),
            attention=attention,
            upcast_off=off,
        )
    }


def reads_force_upcast(cls: type) -> bool:
    """True when the pipeline class's ``__call__`` reads ``vae.config.force_upcast``."""
    return _call_mentions(cls, "force_upcast")


def _pipeline_facts(subjects: tuple, live: Any, hardware: Any) -> dict:
    """The ``pipelines`` field of the facts: each pipeline, its VAE and whether it honours ``force_upcast``."""
    out = []
    for s in subjects:
        if s.kind != "pipeline":
            continue
        vae = raw_attr(s.obj, "vae", None)
        out.append(PipelineFacts(name=s.name, ref=live.add(s.obj), class_name=type_name(s.obj),
                                 vae_ref=id(vae) if vae is not None else 0,
                                 reads_force_upcast=vae is not None and reads_force_upcast(type(s.obj))))  # fmt: skip
    return {"pipelines": tuple(out)} if out else {}


INTEGRATION = Integration(
    name="diffusers",
    modules=("diffusers",),
    kinds=((PIPELINE, "pipeline"), ("diffusers.training_utils.EMAModel", "averaging")),
    brings=((PIPELINE, COMPONENTS),),
    model_facts=_model_facts,
    facts=_pipeline_facts,
)
