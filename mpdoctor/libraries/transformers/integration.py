"""transformers: Trainer and TrainingArguments, PreTrainedModel configs.

A Trainer brings its model, optimizer, arguments, accelerator and scaler. A
PreTrainedModel adds its config tree (nested sub-configs and the generation
config, where ``use_cache``, the checkpoint dtype, the attention kernel and the
quantization config live) and ``_keep_in_fp32_modules``. TrainingArguments
state what precision is requested (``fp16`` / ``bf16`` / ``mixed_precision``).
A KV cache the user holds (``DynamicCache``, ``StaticCache``, or the legacy plain tuple of per-layer
``(key, value)`` pairs, recognised by its shape) is a subject of kind ``kv_cache``; its facts are the dtypes of
the tensors it stores. A 4D additive attention
mask held by name (a plain tensor of zeros and large negatives) is a subject of kind
``attention_mask``, read by its values.
"""

from __future__ import annotations

from typing import Any

from ...compat import rope_init_function
from ...objects.integrations import Integration
from ...objects.live.introspect import is_a, modules_where, raw_attr
from ...objects.readers.configs import read_configs
from ...objects.readers.kv_cache import is_legacy_cache, read_kv_cache
from ...objects.readers.masks import is_additive_mask, read_mask
from ...redact import safe_value

TRAINER = "transformers.trainer.Trainer"
TRAINING_ARGS = "transformers.training_args.TrainingArguments"
PRETRAINED = "transformers.modeling_utils.PreTrainedModel"
#: The base of every KV cache class (``DynamicCache``, ``StaticCache``, ``EncoderDecoderCache`` ...).
CACHE = "transformers.cache_utils.Cache"

#: TrainingArguments fields that say something about precision.
ARG_KEYS = (
    "fp16",
    "bf16",
    "fp16_full_eval",
    "bf16_full_eval",
    "tf32",
    "half_precision_backend",
    "use_cpu",
    "mixed_precision",
    "optim",
    "gradient_checkpointing",
    "deepspeed",
)


def _keep_in_fp32(module: Any) -> tuple[str, ...]:
    names: set[str] = set()
    for key in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        value = raw_attr(module, key, None)
        if isinstance(value, (list, tuple, set, frozenset)):
            names.update(v for v in value if isinstance(v, str))
    return tuple(sorted(names))


#: Rounding of a half-precision buffer relative to its value (half an ulp), used when no fp32 reference exists.
_HALF_REL = {"bfloat16": 2.0**-9, "float16": 2.0**-11}


def _rope_modules(inner: Any) -> list[tuple[str, Any]]:
    """``(path, module)`` of every rotary embedding holding an ``inv_freq`` buffer."""
    import torch

    out = []
    try:
        for path, mod in modules_where(inner, lambda cls: cls.__name__.endswith("RotaryEmbedding")):
            buf = mod.__dict__.get("_buffers", {}).get("inv_freq")
            if isinstance(buf, torch.Tensor) and buf.dtype.is_floating_point:
                out.append((path, mod))
    except Exception:
        return []
    return out


def rope_reference(mod: Any) -> Any:
    """The fp32 ``inv_freq`` the module computed at construction, recomputed from its config (None if unknown).

    transformers 4.4x-5.x rotary classes keep ``config`` and ``rope_type`` and compute their frequencies with
    ``compute_default_rope_parameters`` or ``ROPE_INIT_FUNCTIONS[rope_type]``, which return ``(inv_freq, scaling)``.
    """
    import torch

    config = raw_attr(mod, "config", None)
    if config is None:
        return None
    rope_type = raw_attr(mod, "rope_type", "default")
    try:
        if rope_type == "default" and hasattr(type(mod), "compute_default_rope_parameters"):
            fn = type(mod).compute_default_rope_parameters
        else:
            fn = rope_init_function(rope_type)
            if fn is None:
                return None
        with torch.no_grad():
            inv_freq = fn(config)[0]
    except Exception:
        return None
    buf = mod.__dict__["_buffers"]["inv_freq"]
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.shape != buf.shape:
        return None
    return inv_freq.to(device=buf.device, dtype=torch.float32)


def _rope_buffers(inner: Any) -> tuple[tuple[str, str, str, float, int], ...]:
    """Half-precision ``inv_freq`` buffers and the phase error they cause at the model's last position."""
    import math

    import torch

    from ...facts.tensors import dtype_name

    out = []
    for path, mod in _rope_modules(inner):
        buf = mod.__dict__["_buffers"]["inv_freq"]
        dt = dtype_name(buf.dtype)
        if dt not in _HALF_REL or buf.device.type == "meta":
            continue
        positions = raw_attr(mod, "original_max_seq_len", None) or raw_attr(mod, "max_seq_len_cached", None) or 2048
        positions = int(positions) if isinstance(positions, int) else 2048
        ref = rope_reference(mod)
        with torch.no_grad():
            if ref is not None:
                err = float((buf.float() - ref).abs().max()) * (positions - 1)
            else:
                err = float(buf.float().abs().max()) * _HALF_REL[dt] * (positions - 1)
        out.append((path, type(mod).__name__, dt, min(err, math.pi), positions))
    return tuple(out)


def rope_fp32_changes(model: Any, paths: tuple[str, ...]) -> list:
    """Steps restoring fp32 ``inv_freq`` (and ``original_inv_freq``) recomputed from the config, in place."""
    import torch

    from ...objects.edits.steps import SetItem

    steps = []
    mods = dict(_rope_modules(model))
    for path in paths:
        mod = mods.get(path)
        if mod is None:
            continue
        ref = rope_reference(mod)
        bufs = mod.__dict__["_buffers"]
        if ref is None:  # nothing exact to restore: at least stop computing from a half-precision table
            ref = bufs["inv_freq"].float()
        for name in ("inv_freq", "original_inv_freq"):
            old = bufs.get(name)
            if isinstance(old, torch.Tensor) and old.dtype != torch.float32:
                step = SetItem(bufs, name, ref.clone(), "")
                step.description = f"{path}.{name} = fp32 frequencies recomputed from the config (was {old.dtype})"
                steps.append(step)
    return steps


def _loaded_from(model: Any) -> str:
    """``config._name_or_path``: what ``from_pretrained`` loaded, ``""`` for a model built from a config."""
    name = raw_attr(raw_attr(model, "config", None), "_name_or_path", "")
    return name if type(name) is str else ""


def _model_facts(outer: Any, inner: Any, inner_path: str, live: Any) -> dict:
    return {
        "rope_buffers": _rope_buffers(inner) if is_a(inner, (PRETRAINED,)) else (),
        "configs": read_configs(inner_path, inner, live),
        "is_pretrained": is_a(inner, (PRETRAINED,)),
        "loaded_from": _loaded_from(inner) if is_a(inner, (PRETRAINED,)) else "",
        "keep_in_fp32": _keep_in_fp32(inner),
        "supports_sdpa": raw_attr(inner, "_supports_sdpa", True) is not False if is_a(inner, (PRETRAINED,)) else None,
    }


def requested(args: Any) -> dict:
    """The precision-related fields of a TrainingArguments, as plain values."""
    out = {}
    for key in ARG_KEYS:
        value = raw_attr(args, key, None)
        if value is not None:
            out[key] = safe_value(value)
    return out


def _inference_facts(subjects: tuple, live: Any, hardware: Any) -> dict:
    """The ``kv_caches`` and ``attention_masks`` fields of the facts: the caches and 4D masks the user holds."""
    caches, masks = [], []
    for s in subjects:
        if s.kind == "kv_cache":
            cache = read_kv_cache(s.name, s.obj)
            if cache is not None:
                live.add(s.obj)
                caches.append(cache)
        elif s.kind == "attention_mask":
            live.add(s.obj)
            masks.append(read_mask(s.name, s.obj))
    out: dict = {"kv_caches": tuple(caches)} if caches else {}
    return {**out, "attention_masks": tuple(masks)} if masks else out


INTEGRATION = Integration(
    name="transformers",
    modules=("transformers",),
    kinds=((TRAINER, "trainer"), (TRAINING_ARGS, "training_args"), (CACHE, "kv_cache")),
    brings=((TRAINER, ("model", "optimizer", "args", "accelerator", "scaler")),),
    model_facts=_model_facts,
    requested=requested,
    facts=_inference_facts,
    value_kinds=(("torch.Tensor", is_additive_mask, "attention_mask"), ("builtins.tuple", is_legacy_cache, "kv_cache"),
                 ("builtins.list", is_legacy_cache, "kv_cache")),
)
