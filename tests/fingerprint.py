"""A fingerprint of everything a diagnosis or a fix could change, to compare before and after.

:func:`fingerprint` walks a namespace the way a suspicious reviewer would:
every tensor's bytes (a hash of ``t.detach().cpu().contiguous().view(torch.uint8)``;
``meta`` tensors by shape and dtype only), dtype, device, ``requires_grad``,
storage pointer and version counter, every ``.grad``; every attribute of every
module (so the hook dicts ``_forward_hooks``, ``_forward_pre_hooks``,
``_backward_hooks``, ... and ``training``), every optimizer's param groups and
state (tensors and scalars), every config attribute recursively through
sub-configs, every field of a GradScaler, Trainer, TrainingArguments and
Accelerator (with accelerate's shared state); plus the process-wide state:
the whole environment (hashed, so secrets never reach a diff), autocast,
TF32, ``float32_matmul_precision``, the default dtype, grad mode, the RNG
state and the global module hooks.

Object identity is part of the fingerprint: an object met a second time is
recorded as a reference to the path where it was first met, so a diagnosis
that replaced a Parameter with an equal copy, or an optimizer that no longer
holds the model's own Parameters, shows up as a difference.

Objects of unknown classes (a user's hostile objects) are never asked
anything: they are recorded by class, and mocks by the children and calls
they recorded, so an attribute read through a mock is itself a difference.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
import types
import weakref
from collections.abc import Iterable, Mapping
from typing import Any
from unittest import mock

import torch

#: Classes from these top-level modules are walked attribute by attribute.
WALKED_MODULES = frozenset(
    {"torch", "transformers", "accelerate", "peft", "adamw_bf16", "setups", "scenarios", "collections", "builtins", "tests"}
)
#: Containers longer than this are recorded by length and the identity of their first and last items.
LONG = 2000
_PRIMITIVES = (type(None), bool, int, float, complex, str, bytes)
_NODE_LIMIT = 500_000

_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_forward_hooks_with_kwargs",
    "_global_forward_hooks_always_called",
    "_global_buffer_registration_hooks",
    "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
)


_TYPE_MODULE = type.__dict__["__module__"].__get__
_TYPE_QUALNAME = type.__dict__["__qualname__"].__get__


def _qualname(cls: type) -> str:
    # The descriptors of ``type`` itself: a metaclass's own attributes never run.
    return f"{_TYPE_MODULE(cls)}.{_TYPE_QUALNAME(cls)}"


def _mro(cls: type) -> tuple:
    return type.__dict__["__mro__"].__get__(cls)


def _top_module(cls: type) -> str:
    module = _TYPE_MODULE(cls)
    return module.split(".", 1)[0] if type(module) is str else ""


def tensor_digest(t: torch.Tensor) -> str:
    """Hash of a tensor's bytes (never called on ``meta`` tensors)."""
    data = t.detach()
    if data.is_conj():
        data = data.resolve_conj()
    if data.is_neg():
        data = data.resolve_neg()
    data = data.cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.blake2b(data.numpy().tobytes(), digest_size=16).hexdigest()


def _one_of(cls: type, classes: tuple) -> bool:
    # ``cls in classes`` would call a metaclass's __eq__: compare identities only.
    return any(cls is c for c in classes)


def _short_hash(value: str) -> str:
    return hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


class _Walker:
    def __init__(self) -> None:
        self.out: dict[str, Any] = {}
        self.seen: dict[int, str] = {}
        self.keep: list = []  # hold temporaries so their ids cannot be reused mid-walk
        self.nodes = 0

    # -- dispatch ---------------------------------------------------------------------
    def walk(self, obj: Any, path: str, depth: int = 0) -> None:
        self.nodes += 1
        if self.nodes > _NODE_LIMIT:
            raise RuntimeError(f"fingerprint walked more than {_NODE_LIMIT} nodes at {path}")
        cls = type(obj)
        if _one_of(cls, _PRIMITIVES):
            if cls is str and len(obj) > 200:
                self.out[path] = ("str", len(obj), _short_hash(obj))
            else:
                self.out[path] = (cls.__name__, obj)
            return
        oid = id(obj)
        if oid in self.seen:
            self.out[path] = ("ref", self.seen[oid])
            return
        self.seen[oid] = path
        self.keep.append(obj)
        mro = _mro(cls)
        if _one_of(torch.Tensor, mro):
            self._tensor(obj, path, depth)
        elif _one_of(cls, (torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format)):
            self.out[path] = (cls.__name__, str(obj))
        elif _one_of(mock.NonCallableMock, mro):
            self._mock(obj, path)
        elif _one_of(cls, (weakref.ProxyType, weakref.CallableProxyType)):
            self.out[path] = ("weakproxy",)
        elif _one_of(weakref.ref, mro):
            target = obj()
            self.out[path] = ("weakref", self.seen.get(id(target), _qualname(type(target))) if target is not None else None)
        elif _one_of(types.ModuleType, mro):
            self.out[path] = ("module", _qualname(cls), obj.__dict__.get("__name__") if cls is types.ModuleType else None)
        elif _one_of(cls, (types.FunctionType, types.BuiltinFunctionType, types.BuiltinMethodType, types.MethodWrapperType)):
            self.out[path] = ("function", getattr(obj, "__qualname__", "?"))
        elif cls is types.MethodType:
            self.out[path] = ("method", obj.__func__.__qualname__)
            self.walk(obj.__self__, f"{path}.__self__", depth + 1)
        elif cls is functools.partial:
            self.out[path] = ("partial", getattr(obj.func, "__qualname__", "?"))
            self.walk(obj.args, f"{path}.args", depth + 1)
            self.walk(obj.keywords, f"{path}.keywords", depth + 1)
        elif _one_of(type, mro):
            self.out[path] = ("class", _qualname(obj))
        elif _one_of(enum.Enum, mro):
            self.out[path] = ("enum", _qualname(cls), object.__getattribute__(obj, "_name_"))
        elif _top_module(cls) not in WALKED_MODULES:
            # A user's object: never asked anything.
            self.out[path] = ("opaque", _qualname(cls))
        elif _one_of(dict, mro):
            self._mapping(obj, path, depth, cls)
        elif _one_of(list, mro) or _one_of(tuple, mro):
            self._sequence(obj, path, depth, cls)
        elif _one_of(set, mro) or _one_of(frozenset, mro):
            n = set.__len__(obj) if _one_of(set, mro) else frozenset.__len__(obj)
            if n > LONG:
                self.out[path] = (_qualname(cls), n)
                return
            items = list(set.__iter__(obj) if _one_of(set, mro) else frozenset.__iter__(obj))
            prims = sorted(repr(x) for x in items if _one_of(type(x), _PRIMITIVES))
            others = sorted(id(x) for x in items if not _one_of(type(x), _PRIMITIVES))
            self.out[path] = (_qualname(cls), n, _short_hash("|".join(prims)), tuple(others))
        elif cls is range:
            self.out[path] = ("range", obj.start, obj.stop, obj.step)
        else:
            self._object(obj, path, depth, cls)

    # -- kinds ------------------------------------------------------------------------
    def _tensor(self, t: torch.Tensor, path: str, depth: int) -> None:
        rec: dict[str, Any] = {
            "class": _qualname(type(t)),
            "dtype": str(t.dtype),
            "shape": tuple(t.shape),
            "device": str(t.device),
            "requires_grad": bool(t.requires_grad),
            "is_leaf": bool(t.is_leaf),
        }
        try:
            rec["version"] = t._version
        except Exception:
            rec["version"] = None
        if t.layout == torch.strided:
            rec["stride"] = tuple(t.stride())
            rec["offset"] = t.storage_offset()
            if t.device.type != "meta":
                rec["ptr"] = t.untyped_storage().data_ptr()
                rec["data"] = tensor_digest(t)
        else:
            rec["layout"] = str(t.layout)
        self.out[path] = ("tensor", tuple(sorted(rec.items())))
        if t.is_leaf:
            self.walk(t.grad, f"{path}.grad", depth + 1)
        own = _own_dict(t)
        if own:
            self._items(own, path, depth)

    def _mock(self, m: Any, path: str) -> None:
        d = object.__getattribute__(m, "__dict__")
        children = d.get("_mock_children", {})
        calls = d.get("_mock_mock_calls", [])
        self.out[path] = ("mock", _qualname(type(m)), tuple(sorted(map(str, children))), len(calls), len(d))

    def _mapping(self, obj: dict, path: str, depth: int, cls: type) -> None:
        n = dict.__len__(obj)
        self.out[path] = ("dict", _qualname(cls), n)
        if n > LONG:
            first = [k for _, k in zip(range(20), dict.__iter__(obj))]
            last = [k for _, k in zip(range(20), dict.__reversed__(obj))]
            self.out[path + "<ends>"] = tuple(id(k) if not _one_of(type(k), _PRIMITIVES) else k for k in first + last)
            return
        for i, (key, value) in enumerate(dict.items(obj)):
            if _one_of(type(key), _PRIMITIVES):
                sub = f"{path}[{key!r}]"
            else:
                ref = self.seen.get(id(key))
                if ref is None:
                    self.walk(key, f"{path}<key {i}>", depth + 1)
                    ref = self.seen.get(id(key), f"<key {i}>")
                sub = f"{path}[@{ref}]"
            self.walk(value, sub, depth + 1)
        own = _own_dict(obj)
        if own:
            self._items(own, path, depth)

    def _sequence(self, obj: Any, path: str, depth: int, cls: type) -> None:
        is_list = _one_of(list, _mro(cls))
        n = list.__len__(obj) if is_list else tuple.__len__(obj)
        self.out[path] = ("seq", _qualname(cls), n)
        if n > LONG:
            get = list.__getitem__ if is_list else tuple.__getitem__
            ends = [get(obj, i) for i in (*range(20), *range(n - 20, n))]
            self.out[path + "<ends>"] = tuple(x if _one_of(type(x), _PRIMITIVES) else id(x) for x in ends)
            return
        items = list(list.__iter__(obj) if is_list else tuple.__iter__(obj))
        for i, item in enumerate(items):
            self.walk(item, f"{path}[{i}]", depth + 1)

    def _object(self, obj: Any, path: str, depth: int, cls: type) -> None:
        self.out[path] = ("object", _qualname(cls))
        own = _own_dict(obj)
        if own is not None:
            self._items(own, path, depth)
        slots = [s for c in _mro(cls) for s in type.__dict__["__dict__"].__get__(c).get("__slots__", ()) or ()]
        for slot in slots if not isinstance(slots, str) else (slots,):
            if slot in ("__dict__", "__weakref__"):
                continue
            try:
                value = object.__getattribute__(obj, slot)
            except Exception:
                continue
            self.walk(value, f"{path}.{slot}", depth + 1)

    def _items(self, d: Mapping, path: str, depth: int) -> None:
        for key in sorted(d, key=str):
            self.walk(d[key], f"{path}.{key}", depth + 1)


def _own_dict(obj: Any) -> dict | None:
    try:
        d = object.__getattribute__(obj, "__dict__")
    except Exception:
        return None
    return d if type(d) is dict else None


def global_state() -> dict[str, Any]:
    """Process-wide precision state: environment, autocast, TF32, matmul precision, RNG, global hooks."""
    from torch.nn.modules import module as module_mod

    state: dict[str, Any] = {
        "env": tuple(sorted((k, _short_hash(v)) for k, v in os.environ.items())),
        "torch.rng": tensor_digest(torch.get_rng_state()),
        "default_dtype": str(torch.get_default_dtype()),
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "tf32.matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32.cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": _matmul_precision(),
        "fp32_precision": tuple(_backend_precisions()),
        "autocast.cache": torch.is_autocast_cache_enabled(),
    }
    for dev in ("cpu", "cuda"):
        state[f"autocast.{dev}"] = (torch.is_autocast_enabled(dev), str(torch.get_autocast_dtype(dev)))
    for name in _GLOBAL_HOOKS:
        hooks = getattr(module_mod, name, None)
        if hooks is not None:
            state[f"hooks.{name}"] = tuple((k, id(v)) for k, v in hooks.items())
    return state


def _matmul_precision() -> str:
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError as exc:  # torch >= 2.9 once the legacy and new TF32 APIs were mixed
        return f"<mixed: {exc.__class__.__name__}>"


def _backend_precisions():
    for name in ("backends", "backends.cuda.matmul", "backends.cudnn", "backends.mkldnn", "backends.mkldnn.matmul"):
        obj = torch
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
            yield name, str(obj.fp32_precision)
        except Exception:
            yield name, None


class Fingerprint(dict):
    """A flat ``path -> record`` mapping; ``==`` compares everything."""

    def diff(self, other: Mapping, limit: int = 15) -> list[str]:
        """Human-readable differences (``path: before -> after``), at most ``limit``."""
        out = []
        for key in sorted(set(self) | set(other)):
            a, b = self.get(key, "<absent>"), other.get(key, "<absent>")
            if a != b:
                out.append(f"{key}: {_brief(a)} -> {_brief(b)}")
                if len(out) >= limit:
                    out.append("...")
                    break
        return out


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 300 else text[:297] + "..."


def fingerprint(namespace: Mapping[str, Any] | None = None, objects: Iterable[Any] = ()) -> Fingerprint:
    """Fingerprint the values of ``namespace`` (and ``objects``) plus the process-wide state."""
    walker = _Walker()
    for key, value in (namespace or {}).items():
        walker.walk(value, str(key))
    for i, value in enumerate(objects):
        walker.walk(value, f"<object {i}>")
    result = Fingerprint(walker.out)
    for key, value in global_state().items():
        result[f"<global>.{key}"] = value
    return result


def assert_unchanged(before: Fingerprint, after: Fingerprint, what: str) -> None:
    """Fail with the first differences when two fingerprints differ."""
    if before != after:
        lines = "\n  ".join(before.diff(after))
        raise AssertionError(f"{what} changed the fingerprint:\n  {lines}")


def values_only(fp: Fingerprint) -> dict:
    """A fingerprint without storage pointers and version counters: a replayed step runs in-place ops, so those
    move; every value, dtype, identity, optimizer state and random stream must come back."""

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("version", "ptr")}
        if isinstance(value, (list, tuple)):
            kept = [v for v in value if not (isinstance(v, tuple) and len(v) == 2 and v[0] in ("version", "ptr"))]
            return type(value)(strip(v) for v in kept)
        return value

    return {k: strip(v) for k, v in dict(fp).items()}
