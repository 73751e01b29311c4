"""Read a transformers KV cache into its facts, and find the slots its tensors are held in.

transformers 4.56 and later keep a cache's tensors on its layers (``cache.layers[i].keys`` / ``.values``; a
``StaticLayer`` also records the ``dtype`` it allocated in); before, on the cache itself, as the lists
``cache.key_cache`` / ``cache.value_cache``. An ``EncoderDecoderCache`` holds two caches. Attributes are read
from the objects' own ``__dict__``: nothing of the cache runs.
"""

from __future__ import annotations

from typing import Any

import torch

from ..facts.inference import KVCacheFacts
from ..facts.tensors import dtype_name
from ..live.introspect import class_paths, raw_attr, type_name

#: Caches whose stored tensors are quantized or offloaded: their dtype is not the one attention reads.
_SKIPPED = ("transformers.cache_utils.QuantizedCache", "transformers.cache_utils.OffloadedCache")
#: The two caches of an encoder-decoder cache.
_SUB_CACHES = ("self_attention_cache", "cross_attention_cache")
_TENSOR_ATTRS = ("keys", "values")
_LIST_ATTRS = ("key_cache", "value_cache")


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


def stored_tensors(value: Any) -> list[torch.Tensor]:
    """The floating tensors of one slot's value (a tensor, a list of tensors, or nothing)."""
    items = value if type(value) is list else [value]
    return [t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0]


def is_static(cache: Any) -> bool:
    """True for a preallocated cache that copies new keys in with ``index_copy_`` (which refuses another dtype)."""
    names = [type_name(cache)] + [type_name(layer) for sub in _caches(cache) for layer in _layers(sub)]
    return any(name.startswith(("Static", "SlidingWindow", "Hybrid")) for name in names)


def read_kv_cache(name: str, cache: Any) -> KVCacheFacts | None:
    """The facts of one cache; None when it stores nothing attention reads in its own dtype."""
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
        class_name=type_name(cache),
        dtypes=tuple(dtypes),
        tensors=len(tensors),
        bytes=sum(t.numel() * t.element_size() for t in tensors),
        static=is_static(cache),
    )
