"""Reading tensors into tensor facts: dtype tallies per object and kind, per-parameter records, per-module dtypes.

Everything here reads metadata (dtype, device, numel, requires_grad): no tensor data is read, copied or moved,
so meta tensors are counted like any other.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable
from typing import Any

import torch

from ..facts.tensors import ModuleTensors, ParamInfo, TensorTally, dtype_name
from ..knowledge import SHORT_DTYPE  # noqa: F401  (re-exported: the facts' name for the table)
from ..live.introspect import class_path, class_paths, named_modules


class _Tally:
    __slots__ = ("tensors", "elements", "bytes", "devices", "meta")

    def __init__(self) -> None:
        self.tensors = 0
        self.elements = 0
        self.bytes = 0
        self.devices: set[str] = set()
        self.meta = 0


class Tallier:
    """Accumulates :class:`TensorTally` rows for one object."""

    def __init__(self, obj_name: str) -> None:
        self.obj_name = obj_name
        self._rows: dict[tuple[str, str, bool], _Tally] = {}

    def add(self, kind: str, tensor: torch.Tensor, trainable: bool) -> None:
        """Count one tensor (metadata only)."""
        self.add_many(kind, tensor.dtype, bool(trainable), tensor.device.type, 1, tensor.numel())

    def add_many(self, kind: str, dtype: Any, trainable: bool, device: str, tensors: int, elements: int) -> None:
        """Count ``tensors`` tensors of one dtype and device holding ``elements`` elements in all."""
        self.add_stored(kind, _name_of(dtype), trainable, device, tensors, elements, elements * dtype.itemsize)

    def add_stored(
        self, kind: str, dtype: str, trainable: bool, device: str, tensors: int, elements: int, nbytes: int
    ) -> None:
        """Count tensors of one dtype (by name) holding ``nbytes`` in all: a quantized weight's storage is not
        ``elements * itemsize`` of the dtype it reports."""
        key = (kind, dtype, bool(trainable))
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = _Tally()
        row.tensors += tensors
        row.elements += elements
        row.bytes += nbytes
        row.devices.add(device)
        if device == "meta":
            row.meta += tensors

    def rows(self) -> tuple[TensorTally, ...]:
        """The tallies, sorted by kind then descending bytes."""
        out = [
            TensorTally(self.obj_name, k, d, r.tensors, r.elements, r.bytes, t, ",".join(sorted(r.devices)), r.meta)
            for (k, d, t), r in self._rows.items()
        ]
        order = {"param": 0, "grad": 1, "buffer": 2, "optimizer_state": 3}
        out.sort(key=lambda r: (order.get(r.kind, 9), -r.bytes, r.dtype, not r.trainable))
        return tuple(out)


#: Packages whose forward wrappers are not patches of the model's code (autocast, hooks, compile).
_WRAPPER_PACKAGES = frozenset({"torch", "accelerate"})


_TYPE_MRO = type.__dict__["__mro__"].__get__


def _package(module_name: Any) -> str:
    return module_name.split(".", 1)[0] if type(module_name) is str else ""


def _origin(fn: Any) -> str:
    """``module.qualname`` of a forward, read without calling it or any user attribute hook."""
    for _ in range(4):  # exact types only: a subclass's attributes may be user code
        if type(fn) is types.MethodType:
            fn = fn.__func__
        elif type(fn) is functools.partial:
            fn = fn.func
        else:
            break
    kind = type(fn)
    if kind is types.FunctionType or kind is types.BuiltinFunctionType:
        return f"{fn.__module__}.{fn.__qualname__}"
    return class_path(type(fn))


def _patched_forward(mod: torch.nn.Module) -> str | None:
    """Where ``mod``'s forward comes from when another package assigned it; None for the class's own."""
    cls = type(mod)
    own = mod.__dict__.get("forward")  # an instance attribute: assigned over the class's forward
    if own is not None:
        home, origin = class_path(cls), _origin(own)
    else:
        # Not cached: a notebook may patch a class after a first diagnosis.
        owner = next((c for c in _TYPE_MRO(cls) if "forward" in c.__dict__), None)
        if owner is None:
            return None
        home, origin = class_path(owner), _origin(owner.__dict__["forward"])
    if _package(origin) in _WRAPPER_PACKAGES or _package(origin) == _package(home):
        return None
    return origin


#: ``torch.bfloat16 -> "bfloat16"``, filled on first sight of each dtype (dtypes are a handful of singletons).
_DTYPE_NAMES: dict[Any, str] = {}


def _name_of(dtype: Any) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype_name(dtype)
    return name


#: ``torch.device("cuda", 0) -> "cuda"``: ``device.type`` builds a new string on every read (as costly as the rest
#: of a parameter's bookkeeping), so each device object's type is read once.
_DEVICE_TYPES: dict[Any, str] = {}


def _type_of(device: Any) -> str:
    kind = _DEVICE_TYPES.get(device)
    if kind is None:
        if len(_DEVICE_TYPES) > 256:
            _DEVICE_TYPES.clear()
        kind = _DEVICE_TYPES[device] = device.type
    return kind


_PARAMETER = torch.nn.Parameter


def _storage(p: Any, readers: tuple) -> tuple[str, str, int] | None:
    for read in readers:
        try:
            found = read(p)
        except Exception:  # a reader must not stop the tally
            found = None
        if found is not None:
            return found
    return None


def read_module_tensors(
    name: str,
    module: torch.nn.Module,
    casting_layers: frozenset[str] = frozenset(),
    storage_readers: tuple = (),
) -> ModuleTensors:
    """Walk ``module`` once and collect its tensor facts (metadata only).

    The loop is the whole cost of a diagnosis of a big model, so it does per tensor only what
    cannot be shared: tallies are keyed by ``(dtype, trainable, device)`` and summed per key at
    the end, and whatever depends on a module's class alone is read once per class. A parameter
    that is not a plain ``nn.Parameter`` is shown to ``storage_readers`` (the integrations'
    ``weight_storage``): a quantized weight is tallied in its storage dtype and bytes.
    """
    # (kind, dtype, trainable, device) -> [tensors, elements]
    counts: dict[tuple[str, Any, bool, str], list[int]] = {}
    # (storage dtype name, trainable, device) -> [tensors, elements, bytes]: quantized weights
    stored: dict[tuple[str, bool, str], list[int]] = {}
    params: list[tuple] = []
    tied: list[tuple[int, str, str, str, int]] = []
    seen: set[int] = set()
    checkpointing = False
    patched: list[tuple[str, str]] = []
    tuners: list[str] = []
    per_class: dict[type, tuple[str, str | None, bool]] = {}
    names = _DTYPE_NAMES
    kinds = _DEVICE_TYPES
    for mpath, mod in named_modules(module):
        mdict = mod.__dict__
        if not checkpointing and mdict.get("gradient_checkpointing") is True:
            checkpointing = True
        cls = type(mod)
        known = per_class.get(cls)
        if known is None:
            # What depends on the class alone is read once per class and diagnosis (a 70B Llama has 6 classes).
            known = per_class[cls] = (
                f"{cls.__module__}.{cls.__qualname__}",
                _patched_forward(mod) if "forward" not in mdict else None,
                bool(casting_layers) and any(c in casting_layers for c in class_paths(cls)),
            )
        origin = _patched_forward(mod) if "forward" in mdict else known[1]
        if origin is not None:
            patched.append((mpath, origin))
        if known[2]:
            tuners.append(mpath)
        own = mdict.get("_parameters")
        if own:
            prefix = f"{mpath}." if mpath else ""
            for pname, p in own.items():
                if p is None:
                    continue
                pid = id(p)
                if pid in seen:
                    tied.append((len(params), mpath, known[0], pname, pid))
                    continue
                seen.add(pid)
                dt = p.dtype
                dname = names.get(dt) or _name_of(dt)
                trainable = p.requires_grad
                numel = p.numel()
                device = p.device
                dev = kinds.get(device) or _type_of(device)
                quantized = None
                if storage_readers and type(p) is not _PARAMETER:
                    found = _storage(p, storage_readers)
                    if found is not None:
                        quantized = found[:2]
                        row = stored.setdefault((found[1], trainable, dev), [0, 0, 0])
                        row[0] += 1
                        row[1] += numel
                        row[2] += found[2]
                if quantized is None:
                    key = ("param", dt, trainable, dev)
                    row = counts.get(key)
                    if row is None:
                        counts[key] = [1, numel]
                    else:
                        row[0] += 1
                        row[1] += numel
                grad = p.grad if p.is_leaf else None  # parameters are leaves: reading .grad neither warns nor computes
                gname = None
                if grad is not None:
                    gdt = grad.dtype
                    gname = names.get(gdt) or _name_of(gdt)
                    key = ("grad", gdt, trainable, _type_of(grad.device))
                    row = counts.get(key)
                    if row is None:
                        counts[key] = [1, grad.numel()]
                    else:
                        row[0] += 1
                        row[1] += grad.numel()
                params.append((prefix + pname, pid, dname, gname, trainable, dev, numel, mpath, known[0], quantized))
        bufs = mdict.get("_buffers")
        if bufs:
            for b in bufs.values():
                if b is None or id(b) in seen:
                    continue
                seen.add(id(b))
                key = ("buffer", b.dtype, False, _type_of(b.device))
                row = counts.get(key)
                if row is None:
                    counts[key] = [1, b.numel()]
                else:
                    row[0] += 1
                    row[1] += b.numel()
    make = ParamInfo._make
    return ModuleTensors(
        _rows(name, counts, stored),
        tuple(map(make, params)),
        checkpointing,
        frozenset([dev for (kind, _d, _t, dev) in counts if kind == "param"] + [dev for (_d, _t, dev) in stored]),
        patched_forwards=tuple(patched),
        tuner_layers=tuple(tuners),
        tied=tuple(tied),
    )


def _rows(
    obj_name: str, counts: dict[tuple[str, Any, bool, str], list[int]], stored: dict | None = None
) -> tuple[TensorTally, ...]:
    """Fold ``(kind, dtype, trainable, device) -> [tensors, elements]`` (and quantized weights'
    ``(storage dtype, trainable, device) -> [tensors, elements, bytes]``) into sorted tally rows."""
    tally = Tallier(obj_name)
    for (kind, dt, trainable, dev), (n, numel) in counts.items():
        tally.add_many(kind, dt, trainable, dev, n, numel)
    for (dname, trainable, dev), (n, numel, nbytes) in (stored or {}).items():
        tally.add_stored("param", dname, trainable, dev, n, numel, nbytes)
    return tally.rows()


def tally_tensors(obj_name: str, kind: str, tensors: Iterable[tuple[torch.Tensor, bool]]) -> tuple[TensorTally, ...]:
    """Tally arbitrary ``(tensor, trainable)`` pairs under one object and kind."""
    tally = Tallier(obj_name)
    for t, trainable in tensors:
        tally.add(kind, t, trainable)
    return tally.rows()
