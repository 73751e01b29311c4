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

from ...objects.edits.steps import Call, Change, SetAttr
from ...objects.integrations import Integration
from ...objects.live.introspect import class_path, is_a, modules_of, own_dict, raw_attr, type_name
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


#: The name ``enable_layerwise_casting`` / ``apply_layerwise_casting`` registers its ``LayerwiseCastingHook`` under,
#: in the ``HookRegistry`` each cast layer holds as ``_diffusers_hook``.
LAYERWISE_CASTING_HOOK = "layerwise_casting"
_ABSENT = object()


def layerwise_casting_hook(module: Any) -> Any:
    """The ``LayerwiseCastingHook`` diffusers registered on ``module`` itself (None when there is none), read from
    the module's own registry without running user code."""
    hooks = raw_attr(own_dict(module).get("_diffusers_hook"), "hooks", None)
    return hooks.get(LAYERWISE_CASTING_HOOK) if isinstance(hooks, dict) else None


def _registry_chain(registry: Any) -> tuple[dict, list, list]:
    """``(hooks, order, function references)`` of a ``HookRegistry``, checked to be laid out as the pinned diffusers
    (0.42) lays it out (one function reference per hook, in registration order); ValueError otherwise, so a fix built on it
    refuses rather than guesses."""
    hooks, order, refs = (raw_attr(registry, k, None) for k in ("hooks", "_hook_order", "_fn_refs"))
    if not (isinstance(hooks, dict) and isinstance(order, list) and isinstance(refs, list)
            and len(order) == len(refs) == len(hooks) and set(order) == set(hooks)
            and all(hasattr(r, "forward") and hasattr(r, "original_forward") for r in refs)):  # fmt: skip
        raise ValueError("this diffusers' HookRegistry is not laid out as mpdoctor knows it (hooks, _hook_order, "
                         "_fn_refs): its layerwise-casting hook is left in place")  # fmt: skip
    return hooks, order, refs


def _own_forward(module: Any, forward: Any) -> bool:
    """``forward`` is the module's class ``forward`` bound to the module: with no instance attribute it is what
    ``module.forward`` reads anyway."""
    return getattr(forward, "__self__", None) is module and getattr(forward, "__func__", None) is getattr(type(module), "forward", None)


def _unhook_layerwise_casting(module: Any) -> tuple:
    """Take the layerwise-casting hook out of ``module``'s registry as ``HookRegistry.remove_hook`` does, without its
    ``deinitalize_hook`` (which raises for this hook); returns what :func:`_rehook_layerwise_casting` puts back."""
    registry = own_dict(module)["_diffusers_hook"]
    hooks, order, refs = _registry_chain(registry)
    i = order.index(LAYERWISE_CASTING_HOOK)
    wrapped = refs[i].original_forward if refs[i].original_forward is not None else refs[i].forward
    own = own_dict(module)
    after = refs[i + 1] if i + 1 < len(refs) else None
    saved = (hooks, order, refs, own.get("forward", _ABSENT), after, after.forward if after is not None else None)
    if after is not None:
        after.forward = wrapped  # the next hook now wraps what this one wrapped
    elif _own_forward(module, wrapped):
        own.pop("forward", None)  # the class's forward, as a layer skipped by ``skip_modules_pattern`` has it
    else:
        own["forward"] = wrapped
    registry.hooks = {k: v for k, v in hooks.items() if k != LAYERWISE_CASTING_HOOK}
    registry._hook_order = order[:i] + order[i + 1:]
    registry._fn_refs = refs[:i] + refs[i + 1:]
    return saved


def _rehook_layerwise_casting(module: Any, saved: tuple) -> None:
    """Put back exactly the registry's containers and the forward chain :func:`_unhook_layerwise_casting` saved."""
    hooks, order, refs, forward, after, after_forward = saved
    registry = own_dict(module)["_diffusers_hook"]
    registry.hooks, registry._hook_order, registry._fn_refs = hooks, order, refs
    if after is not None:
        after.forward = after_forward
    own = own_dict(module)
    if forward is _ABSENT:
        own.pop("forward", None)
    else:
        own["forward"] = forward


def layerwise_casting_removed(module: Any, label: str) -> list[Change]:
    """The steps that take diffusers' layerwise casting off one layer, leaving it as ``skip_modules_pattern`` leaves a
    skipped layer (no ``LayerwiseCastingHook``, the forward it wrapped); undo puts back the very hook, registry
    containers and forward. Nothing when the layer holds no such hook.

    diffusers' own ``remove_hook`` cannot be used: it calls the hook's ``deinitalize_hook``, which raises
    ``NotImplementedError`` for layerwise casting after it has already rewired the forward. The layer's weights are
    not touched here (the caller casts them).
    """
    if layerwise_casting_hook(module) is None:
        return []
    _registry_chain(own_dict(module)["_diffusers_hook"])  # refuse at bind, before anything changes
    return [Call(lambda: _unhook_layerwise_casting(module), lambda saved: _rehook_layerwise_casting(module, saved),
                 f"{label}: diffusers' layerwise-casting hook removed (its weights no longer cast down after the forward)",
                 held=lambda: layerwise_casting_hook(module) is None)]  # fmt: skip


def failed_adapter_flag_reset(model: Any, label: str) -> list[Change]:
    """``model._hf_peft_config_loaded = False`` where an ``add_adapter`` that raised left it set with no
    ``peft_config``: diffusers sets the flag before injecting the adapter, so the same ``add_adapter`` run again would
    raise ``AttributeError: ... no attribute 'peft_config'``. Nothing when the flag is unset or adapters are there."""
    own = own_dict(model)
    if own.get("_hf_peft_config_loaded") is not True or "peft_config" in own:
        return []
    return [SetAttr(model, "_hf_peft_config_loaded", False, f"{label}._hf_peft_config_loaded")]


INTEGRATION = Integration(
    name="diffusers",
    modules=("diffusers",),
    kinds=((PIPELINE, "pipeline"), ("diffusers.training_utils.EMAModel", "averaging")),
    brings=((PIPELINE, COMPONENTS),),
    model_facts=_model_facts,
    facts=_pipeline_facts,
)
