"""Tensor facts: dtype tallies per object and kind, per-parameter records, per-module dtype sets.

Everything here reads metadata (dtype, device, numel, requires_grad): no tensor
data is read, copied or moved, so meta tensors are counted like any other.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..introspect import class_path, class_paths, named_modules
from ..knowledge import SHORT_DTYPE  # noqa: F401  (re-exported: the facts' name for the table)


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; anything else -> its ``str``."""
    text = str(dtype)
    return text[6:] if text.startswith("torch.") else text


FLOATING = frozenset(
    {"float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}
)


class TensorTally(NamedTuple):
    """One histogram row: tensors of one object, kind, dtype and trainability."""

    object: str
    kind: str
    dtype: str
    tensors: int
    elements: int
    bytes: int
    trainable: bool
    devices: str
    meta: int


class ParamInfo(NamedTuple):
    """Metadata of one parameter (``id`` links it to optimizers)."""

    name: str
    id: int
    dtype: str
    grad_dtype: str | None
    requires_grad: bool
    device: str
    numel: int
    module: str


class ModuleDtypes(NamedTuple):
    """The floating dtypes of one module's direct parameters."""

    path: str
    class_path: str
    params: tuple[tuple[str, str, bool], ...]  # (name, dtype, requires_grad)

    @property
    def dtypes(self) -> frozenset[str]:
        """Distinct floating dtypes among the direct parameters."""
        return frozenset(d for _, d, _ in self.params)


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
        dtype = tensor.dtype
        key = (kind, dtype_name(dtype), trainable)
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = _Tally()
        numel = tensor.numel()
        row.tensors += 1
        row.elements += numel
        row.bytes += numel * dtype.itemsize
        device = tensor.device.type
        row.devices.add(device)
        if device == "meta":
            row.meta += 1

    def rows(self) -> tuple[TensorTally, ...]:
        """The tallies, sorted by kind then descending bytes."""
        out = [
            TensorTally(self.obj_name, k, d, r.tensors, r.elements, r.bytes, t, ",".join(sorted(r.devices)), r.meta)
            for (k, d, t), r in self._rows.items()
        ]
        order = {"param": 0, "grad": 1, "buffer": 2, "optimizer_state": 3}
        out.sort(key=lambda r: (order.get(r.kind, 9), -r.bytes, r.dtype, not r.trainable))
        return tuple(out)


@dataclass(frozen=True)
class ModuleTensors:
    """Tensor facts of one model."""

    tallies: tuple[TensorTally, ...]
    params: tuple[ParamInfo, ...]
    modules: tuple[ModuleDtypes, ...]
    gradient_checkpointing: bool
    devices: frozenset[str]
    #: ``(module path, forward origin)`` for modules running a forward assigned from another package
    #: (a monkeypatch such as Unsloth's fused LoRA kernels), never torch's or accelerate's wrappers.
    patched_forwards: tuple[tuple[str, str], ...] = ()
    #: Paths of PEFT tuner layers (LoRA ``Linear`` ...): they cast their input to the adapter dtype.
    tuner_layers: tuple[str, ...] = ()
    #: ``(path, class path)`` of every module, root first.
    module_classes: tuple[tuple[str, str], ...] = ()

    @property
    def param_ids(self) -> frozenset[int]:
        """Ids of every parameter, to match optimizers to models."""
        return frozenset(p.id for p in self.params)

    def param_dtype_counts(self, trainable: bool | None = None) -> dict[str, int]:
        """Element counts per parameter dtype, optionally only (non-)trainable ones."""
        counts: dict[str, int] = {}
        for p in self.params:
            if trainable is None or p.requires_grad == trainable:
                counts[p.dtype] = counts.get(p.dtype, 0) + p.numel
        return counts

    @property
    def main_dtype(self) -> str | None:
        """The floating dtype holding most parameter elements."""
        counts = {d: n for d, n in self.param_dtype_counts().items() if d in FLOATING}
        return max(counts, key=counts.get) if counts else None


def _grad_of(p: torch.Tensor) -> torch.Tensor | None:
    # Parameters are leaves, so reading .grad neither warns nor computes.
    return p.grad if p.is_leaf else None


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


def gather_module_tensors(
    name: str, module: torch.nn.Module, casting_layers: frozenset[str] = frozenset()
) -> ModuleTensors:
    """Walk ``module`` once and collect its tensor facts (metadata only)."""
    tally = Tallier(name)
    params: list[ParamInfo] = []
    modules: list[ModuleDtypes] = []
    seen: set[int] = set()
    checkpointing = False
    devices: set[str] = set()
    patched: list[tuple[str, str]] = []
    tuners: list[str] = []
    classes: list[tuple[str, str]] = []
    paths_of: dict[type, str] = {}
    per_class: dict[type, tuple[str | None, bool]] = {}
    for mpath, mod in named_modules(module):
        mdict = mod.__dict__
        if mdict.get("gradient_checkpointing") is True:
            checkpointing = True
        cls = type(mod)
        cpath = paths_of.get(cls)
        if cpath is None:
            cpath = paths_of[cls] = f"{cls.__module__}.{cls.__qualname__}"
        classes.append((mpath, cpath))
        # What depends on the class alone is read once per class and diagnosis (a 70B Llama has 6 classes).
        known = per_class.get(cls)
        if known is None:
            known = per_class[cls] = (
                _patched_forward(mod) if "forward" not in mdict else None,
                bool(casting_layers) and any(c in casting_layers for c in class_paths(cls)),
            )
        origin = _patched_forward(mod) if "forward" in mdict else known[0]
        if origin is not None:
            patched.append((mpath, origin))
        if known[1]:
            tuners.append(mpath)
        direct: list[tuple[str, str, bool]] = []
        for pname, p in mdict.get("_parameters", {}).items():
            if p is None:
                continue
            full = f"{mpath}.{pname}" if mpath else pname
            dname = dtype_name(p.dtype)
            if dname in FLOATING:
                direct.append((pname, dname, p.requires_grad))
            if id(p) in seen:
                continue
            seen.add(id(p))
            trainable = bool(p.requires_grad)
            tally.add("param", p, trainable)
            grad = _grad_of(p)
            if grad is not None:
                tally.add("grad", grad, trainable)
            dev = p.device.type
            devices.add(dev)
            params.append(
                ParamInfo(
                    full,
                    id(p),
                    dname,
                    dtype_name(grad.dtype) if grad is not None else None,
                    trainable,
                    dev,
                    p.numel(),
                    mpath,
                )
            )
        if direct:
            modules.append(ModuleDtypes(mpath, cpath, tuple(direct)))
        for _bname, b in mdict.get("_buffers", {}).items():
            if b is None or id(b) in seen:
                continue
            seen.add(id(b))
            tally.add("buffer", b, False)
    return ModuleTensors(
        tally.rows(),
        tuple(params),
        tuple(modules),
        checkpointing,
        frozenset(devices),
        patched_forwards=tuple(patched),
        tuner_layers=tuple(tuners),
        module_classes=tuple(classes),
    )


def tally_tensors(obj_name: str, kind: str, tensors: Iterable[tuple[torch.Tensor, bool]]) -> tuple[TensorTally, ...]:
    """Tally arbitrary ``(tensor, trainable)`` pairs under one object and kind."""
    tally = Tallier(obj_name)
    for t, trainable in tensors:
        tally.add(kind, t, trainable)
    return tally.rows()
