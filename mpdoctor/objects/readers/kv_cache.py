"""Read a transformers KV cache into its facts, and find the slots its tensors are held in.

transformers 4.56 and later keep a cache's tensors on its layers (``cache.layers[i].keys`` / ``.values``; a
``StaticLayer`` also records the ``dtype`` it allocated in); before, on the cache itself, as the lists
``cache.key_cache`` / ``cache.value_cache``. An ``EncoderDecoderCache`` holds two caches. Attributes are read
from the objects' own ``__dict__``: nothing of the cache runs.

The legacy format (transformers before 4.36, and code that still keeps it across versions) is a plain tuple or list
with one ``(key, value)`` pair per layer, or ``(key, value, cross_key, cross_value)`` for an encoder-decoder model;
``DynamicCache(ddp_cache_data=...)`` / ``from_legacy_cache`` convert it at the call. It is recognised by its shape
alone (:func:`is_legacy_cache`); its tensors cannot be re-bound inside an immutable tuple, so a cast replaces
each tensor's data (:func:`legacy_tensors`).
"""

from __future__ import annotations

from typing import Any

import torch

from ...facts.inference import KVCacheFacts
from ...facts.tensors import dtype_name
from ..live.introspect import class_paths, raw_attr, type_name

#: Caches whose stored tensors are quantized or offloaded: their dtype is not the one attention reads.
_SKIPPED = ("transformers.cache_utils.QuantizedCache", "transformers.cache_utils.OffloadedCache")
#: The two caches of an encoder-decoder cache.
_SUB_CACHES = ("self_attention_cache", "cross_attention_cache")
_TENSOR_ATTRS = ("keys", "values")
_LIST_ATTRS = ("key_cache", "value_cache")
#: Tensors per layer of a legacy cache: (key, value), or with the cross-attention pair of an encoder-decoder.
_LEGACY_WIDTHS = (2, 4)
#: A legacy cache has one entry per layer; a longer container is not read as one.
_LEGACY_MAX_LAYERS = 1024


def _caches(cache: Any) -> list[Any]:
    """The cache itself, or the caches an encoder-decoder cache holds."""
    subs = [raw_attr(cache, a, None) for a in _SUB_CACHES]
    return [s for s in subs if s is not None] or [cache]


def _layers(cache: Any) -> list[Any]:
    layers = raw_attr(cache, "layers", None)
    return list(layers) if type(layers) in (list, tuple) else []


def tensor_slots(cache: Any) -> list[tuple[Any, str, Any]]:
    """``(holder, attribute, value)`` of every place the cache stores keys or values.

    ``value`` is a tensor (a layer's ``keys``), a list of tensors (``key_cache`` before 4.56) or None (a
    layer not filled yet). A quantized or offloaded cache has none: its stored tensors are not what
    attention reads.
    """
    if set(class_paths(type(cache))) & set(_SKIPPED):
        return []
    out: list[tuple[Any, str, Any]] = []
    for sub in _caches(cache):
        layers = _layers(sub)
        for layer in layers:
            out.extend((layer, attr, raw_attr(layer, attr, None)) for attr in _TENSOR_ATTRS)
        if not layers:
            out.extend((sub, attr, raw_attr(sub, attr, None)) for attr in _LIST_ATTRS if type(raw_attr(sub, attr, None)) is list)
    return out


def _legacy_layer(layer: Any) -> bool:
    """A ``(key, value[, cross_key, cross_value])`` entry: 4D floating tensors, each pair of one shape."""
    kind = type(layer)  # compared by identity: a hostile metaclass's __eq__ is never asked
    if (kind is not tuple and kind is not list) or len(layer) not in _LEGACY_WIDTHS:
        return False
    if not all(type(t) is torch.Tensor and t.dim() == 4 and t.is_floating_point() for t in layer):
        return False
    return all(layer[i].shape == layer[i + 1].shape for i in range(0, len(layer), 2))


def is_legacy_cache(obj: Any) -> bool:
    """True for a plain tuple / list of per-layer ``(key, value)`` (or 4-tensor encoder-decoder) entries.

    Read by its shape: every entry of one width, 4D floating plain tensors, keys and values of one shape, all on
    one real device (a meta tensor is not a cache). The first entry is tested first, so most containers of a
    namespace are refused at once.
    """
    kind = type(obj)
    if (kind is not tuple and kind is not list) or not 0 < len(obj) <= _LEGACY_MAX_LAYERS or not _legacy_layer(obj[0]):
        return False
    width = len(obj[0])
    if not all(len(layer) == width and _legacy_layer(layer) for layer in obj):
        return False
    return all(t.device.type != "meta" for layer in obj for t in layer)


def legacy_tensors(obj: Any) -> list[torch.Tensor]:
    """The key / value tensors of a legacy cache (empty for anything else), each once."""
    if not is_legacy_cache(obj):
        return []
    seen: set[int] = set()
    out = []
    for layer in obj:
        for t in layer:
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def stored_tensors(value: Any) -> list[torch.Tensor]:
    """The floating tensors of one slot's value (a tensor, a list of tensors, or nothing)."""
    items = value if type(value) is list else [value]
    return [t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0]


def is_cache(obj: Any) -> bool:
    """A transformers cache object (``DynamicCache``, ``StaticCache``, ``EncoderDecoderCache`` ...)."""
    return "transformers.cache_utils.Cache" in class_paths(type(obj))


def cache_holders(cache: Any) -> list[Any]:
    """The objects whose attributes hold a cache's state: the cache, its sub-caches and their layers."""
    out = [cache]
    for sub in _caches(cache):
        if sub is not cache:
            out.append(sub)
        out.extend(_layers(sub))
    return out


def layer_lengths(cache: Any) -> tuple[int, ...]:
    """The tokens each self-attention layer of a dynamic cache holds (its keys' sequence length), in layer order;
    empty for a static, quantized, offloaded or legacy cache, or one no forward has filled."""
    if is_static(cache) or set(class_paths(type(cache))) & set(_SKIPPED):
        return ()
    sub = _caches(cache)[0]
    layers = _layers(sub)
    if layers:
        keys = [raw_attr(layer, "keys", None) for layer in layers]
    else:
        listed = raw_attr(sub, "key_cache", None)
        keys = list(listed) if type(listed) is list else []
    return tuple(int(k.shape[-2]) for k in keys if isinstance(k, torch.Tensor) and k.dim() == 4 and k.numel() > 0)


def crop_slots(cache: Any, length: int) -> list[tuple[Any, str, Any]]:
    """``(holder, attribute, new value)`` that crop the self-attention layers of a dynamic cache to their first
    ``length`` tokens (copies, made here); empty when nothing is longer, or for a cache that is not plainly dynamic
    (static, sliding-window: those count tokens beyond what they keep)."""
    if not layer_lengths(cache):
        return []
    sub = _caches(cache)[0]
    layers = _layers(sub)
    if any(raw_attr(layer, "cumulative_length", None) is not None for layer in layers):
        return []
    out: list[tuple[Any, str, Any]] = []
    if layers:
        for layer in layers:
            for attr in _TENSOR_ATTRS:
                t = raw_attr(layer, attr, None)
                if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[-2] > length:
                    out.append((layer, attr, t[..., :length, :].clone()))
        return out
    for attr in _LIST_ATTRS:
        listed = raw_attr(sub, attr, None)
        if type(listed) is list and any(isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[-2] > length
                                        for t in listed):  # fmt: skip
            out.append((sub, attr, [t[..., :length, :].clone() if isinstance(t, torch.Tensor) and t.dim() == 4 else t
                                    for t in listed]))  # fmt: skip
    return out


def is_static(cache: Any) -> bool:
    """True for a preallocated cache that copies new keys in with ``index_copy_`` (which refuses another dtype)."""
    names = [type_name(cache)] + [type_name(layer) for sub in _caches(cache) for layer in _layers(sub)]
    return any(name.startswith(("Static", "SlidingWindow", "Hybrid")) for name in names)


def read_kv_cache(name: str, cache: Any) -> KVCacheFacts | None:
    """The facts of one cache; None when it stores nothing attention reads in its own dtype."""
    legacy = legacy_tensors(cache)
    if legacy:
        tensors = [t for t in legacy if t.numel() > 0]
    else:
        slots = tensor_slots(cache)
        if not slots:
            return None
        tensors = [t for _holder, _attr, value in slots for t in stored_tensors(value)]
    dtypes: list[str] = []
    for t in tensors:
        dt = dtype_name(t.dtype)
        if dt not in dtypes:
            dtypes.append(dt)
    return KVCacheFacts(
        name=name,
        ref=id(cache),
        class_name=f"legacy {type_name(cache)} of {len(cache)} layers" if legacy else type_name(cache),
        dtypes=tuple(dtypes),
        tensors=len(tensors),
        bytes=sum(t.numel() * t.element_size() for t in tensors),
        static=False if legacy else is_static(cache),
        legacy=bool(legacy),
        lengths=() if legacy else layer_lengths(cache),
    )
