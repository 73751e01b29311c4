"""float8 weight storage: modules that hold their weights in float8 and what casts them up for the math.

A common memory-saving recipe stores each Linear's weight as ``float8_e4m3fn`` and casts it to bf16 inside
the forward: diffusers' ``enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn,
compute_dtype=torch.bfloat16)`` (a ``LayerwiseCastingHook`` in the module's ``_diffusers_hook`` registry),
ComfyUI-style layer classes whose own ``forward`` casts the weight (``comfy.ops.manual_cast``), or a forward
pre-hook. Such a module *stores* float8 and *computes* in the compute dtype: it is not a float8 compute
module. A stock torch layer (``nn.Linear`` / ``nn.Conv*`` with torch's own forward, no hook) holding a float8
weight feeds it to the matmul as it is, which raises on every device; a stock ``nn.Embedding`` returns
float8 rows, which then meet the next layer's math.

No library is needed (float8 dtypes are torch's). The gathering asks :func:`model_facts` only for models whose
tensor tally holds float8 parameters, and only their modules are read: other models cost one set intersection.
"""

from __future__ import annotations

from typing import Any

import torch

from ...facts.quantized import LAYERWISE_UPCAST, STORAGE_DTYPES, StoredLayer
from ...facts.tensors import dtype_name
from ...objects.live.introspect import class_path, named_modules, raw_attr

_STORAGE = frozenset(getattr(torch, n) for n in STORAGE_DTYPES if hasattr(torch, n))
#: Stock layers that return rows of their weight uncast (their output is in the storage dtype).
_EMITTING = frozenset({torch.nn.Embedding, torch.nn.EmbeddingBag})
#: Names of per-tensor scales that scaled-fp8 checkpoints keep beside the weight.
_SCALE_NAMES = ("scale_weight", "weight_scale", "scale", "weight_scale_inv")


def _torch_forward(cls: type) -> bool:
    """True when the class's forward is torch's own (``torch.nn.modules...``)."""
    owner = next((c for c in cls.__mro__ if "forward" in c.__dict__), None)
    return owner is not None and owner.__module__.startswith("torch.nn.")


def _upcast(mod: Any) -> tuple[str, str | None]:
    """``(what upcasts the weights, compute dtype or None)``; ``("", None)`` when nothing does."""
    registry = mod.__dict__.get("_diffusers_hook")
    if registry is not None:
        hooks = raw_attr(registry, "hooks", None)
        hook = hooks.get("layerwise_casting") if isinstance(hooks, dict) else None
        if hook is not None:
            compute = raw_attr(hook, "compute_dtype", None)
            return LAYERWISE_UPCAST, dtype_name(compute) if compute is not None else None
    own = mod.__dict__.get("forward")
    if own is not None:
        fn = getattr(own, "__func__", own)
        return f"a patched forward ({getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')})", None
    cls = type(mod)
    if not _torch_forward(cls):
        return f"its own forward ({class_path(cls)})", None
    if mod.__dict__.get("_forward_pre_hooks") or torch.nn.modules.module._global_forward_pre_hooks:
        return "a forward pre-hook", None
    return "", None


#: Bit patterns (sign dropped) of each float8 format's largest finite value and of its inf / NaN codes.
_MAX_BITS = {"float8_e4m3fn": 0x7E, "float8_e5m2": 0x7B, "float8_e4m3fnuz": 0x7F, "float8_e5m2fnuz": 0x7F}
_NONFINITE_BITS = {"float8_e4m3fn": (0x7F,), "float8_e5m2": (0x7C, 0x7D, 0x7E, 0x7F)}


def _extremes(p: Any, dtype: str) -> tuple[int, int]:
    """``(elements at the largest finite value, inf / NaN elements)`` of one float8 tensor, read as bytes."""
    if p.device.type == "meta" or dtype not in _MAX_BITS or not p.numel():
        return 0, 0
    bits = p.detach().view(torch.uint8) & 0x7F
    saturated = int((bits == _MAX_BITS[dtype]).sum())
    nonfinite = sum(int((bits == code).sum()) for code in _NONFINITE_BITS.get(dtype, ()))
    return saturated, nonfinite


def stored_layers(model: Any, paths: tuple[str, ...] | None = None) -> tuple[StoredLayer, ...]:
    """The modules of ``model`` holding float8 / float4 parameters of their own, in module order.

    ``paths`` (the module paths the tensor tally saw float8 parameters in) limits the reads to those modules;
    None walks the whole tree.
    """
    out = []
    if paths is None:
        walk = named_modules(model)
    else:
        walk = []
        for path in paths:
            try:
                walk.append((path, model.get_submodule(path)))
            except Exception:  # a path the tally read through a wrapper: skipped, not guessed
                continue
    for path, mod in walk:
        params = mod.__dict__.get("_parameters")
        if not params:
            continue
        names = [n for n, p in params.items() if p is not None and p.dtype in _STORAGE]
        if not names:
            continue
        upcast, compute = _upcast(mod)
        dtype = dtype_name(params[names[0]].dtype)
        extremes = [_extremes(params[n], dtype_name(params[n].dtype)) for n in names]
        tensors = {**mod.__dict__.get("_buffers", {}), **params}
        out.append(
            StoredLayer(
                path=path,
                class_path=class_path(type(mod)),
                storage_dtype=dtype,
                params=tuple(names),
                trainable=any(params[n].requires_grad for n in names),
                upcast=upcast,
                compute_dtype=compute,
                scaled=any(tensors.get(s) is not None for s in _SCALE_NAMES),
                emits_storage=not upcast and type(mod) in _EMITTING,
                elements=sum(params[n].numel() for n in names),
                saturated=sum(e[0] for e in extremes),
                nonfinite=sum(e[1] for e in extremes),
            )
        )
    return tuple(out)


def model_facts(model: Any, tensors: Any) -> dict:
    """``{"stored_layers": ...}`` for a model whose tensor tally (:class:`~mpdoctor.facts.tensors.ModuleTensors`)
    holds float8 / float4 parameters; nothing is read for any other model."""
    paths = tuple(dict.fromkeys(p.module for p in tensors.params if p.dtype in STORAGE_DTYPES))
    if not paths:
        return {}
    try:
        layers = stored_layers(model, paths)
    except Exception:  # a hostile module tree must not stop the report
        return {}
    return {"stored_layers": layers} if layers else {}

