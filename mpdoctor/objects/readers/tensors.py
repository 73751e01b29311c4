"""Reading tensors into tensor facts: dtype tallies per object and kind, per-parameter records, per-module dtypes.

Everything here reads metadata (dtype, device, numel, requires_grad): no tensor data is read, copied or moved,
so meta tensors are counted like any other.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

from ...facts.tensors import ModuleTensors, ParamInfo, TensorTally, dtype_name
from ...knowledge import SHORT_DTYPE  # noqa: F401  (re-exported: the facts' name for the table)
from ..live.introspect import class_path, class_paths, named_modules
from .forward_source import casts_own_input, children_cast_by


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
#: ``ParamInfo`` made from a full tuple of its fields without ``_make``'s Python-level call (once per parameter).
_record = tuple.__new__


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
    walk = _TensorWalk(casting_layers, storage_readers)
    walk.modules(named_modules(module))
    return walk.facts(name)


def _written_casts(cls: type) -> tuple[str | None, dict[str, str]] | None:
    """``(casts_own_input, children_cast_by)`` of a class, None when its forward casts nothing (torch's own layers
    never cast their input to their weights' dtype)."""
    if cls.__module__.startswith("torch.nn."):
        return None
    kind, by_child = casts_own_input(cls), children_cast_by(cls)
    return (kind, by_child) if kind is not None or by_child else None


def _count(counts: dict, key: tuple, numel: int) -> None:
    """One more tensor of ``numel`` elements under ``key``."""
    row = counts.get(key)
    if row is None:
        counts[key] = [1, numel]
    else:
        row[0] += 1
        row[1] += numel


class _TensorWalk:
    """What one walk of a module tree has read so far (``read_module_tensors``' loop, one module at a time)."""

    def __init__(self, casting_layers: frozenset[str], storage_readers: tuple) -> None:
        self.casting_layers = casting_layers
        self.storage_readers = storage_readers
        # (kind, dtype, trainable, device) -> [tensors, elements]
        self.counts: dict[tuple[str, Any, bool, str], list[int]] = {}
        # (storage dtype name, trainable, device) -> [tensors, elements, bytes]: quantized weights
        self.stored: dict[tuple[str, bool, str], list[int]] = {}
        self.params: list[ParamInfo] = []
        self.tied: list[tuple[int, str, str, str, int]] = []
        self.seen: set[int] = set()
        self.checkpointing = False
        self.patched: list[tuple[str, str]] = []
        self.tuners: list[str] = []
        self.per_class: dict[type, tuple] = {}
        self.input_casts: list[tuple[str, str]] = []

    def modules(self, walk: tuple[tuple[str, torch.nn.Module], ...]) -> None:
        """Read each module of the walk: its class's facts, its own parameters and buffers (one loop, its lookups
        bound once: this is the whole cost of a diagnosis of a big model)."""
        per_class, class_facts = self.per_class, self._class_facts
        holders: list[tuple[str, str, dict]] = []  # (module path, class path, own parameters): read in one loop
        hold, buffers = holders.append, []
        for mpath, mod in walk:
            mdict = mod.__dict__
            if not self.checkpointing and mdict.get("gradient_checkpointing") is True:
                self.checkpointing = True
            known = per_class.get(type(mod)) or class_facts(mod, mdict)
            origin = _patched_forward(mod) if "forward" in mdict else known[1]
            if origin is not None:
                self.patched.append((mpath, origin))
            if known[2]:
                self.tuners.append(mpath)
            if known[3] is not None:
                self._casts(mpath, mdict, *known[3])
            own = mdict.get("_parameters")
            if own:
                hold((mpath, known[0], own))
            bufs = mdict.get("_buffers")
            if bufs:
                buffers.append(bufs)
        self._parameters(holders)
        for bufs in buffers:  # after every parameter: a tensor held both ways is tallied as the parameter it is
            self._buffers(bufs)

    def _casts(self, mpath: str, mdict: dict, kind: str | None, by_child: dict[str, str]) -> None:
        """Modules whose input their own forward (``kind``), or their parent's (``by_child``), casts (deliberate
        dtype islands)."""
        if kind is not None and mdict.get("_parameters"):
            self.input_casts.append((mpath, kind))
        children = mdict.get("_modules")
        if children:
            for child, child_kind in by_child.items():
                if child in children:
                    self.input_casts.append((f"{mpath}.{child}" if mpath else child, child_kind))

    def _class_facts(self, mod: torch.nn.Module, mdict: dict) -> tuple:
        """``(class path, patched forward, is a casting layer, the casts its forward writes or None)``, read once
        per class."""
        cls = type(mod)
        known = self.per_class.get(cls)
        if known is None:
            # What depends on the class alone is read once per class and diagnosis (a 70B Llama has 6 classes).
            known = self.per_class[cls] = (
                f"{cls.__module__}.{cls.__qualname__}",
                _patched_forward(mod) if "forward" not in mdict else None,
                bool(self.casting_layers) and any(c in self.casting_layers for c in class_paths(cls)),
                _written_casts(cls),
            )
        return known

    def _parameters(self, holders: list[tuple[str, str, dict]]) -> None:
        """Read the own parameters of each module in ``holders`` (metadata only), in one loop."""
        seen, met, counts, keep = self.seen, self.seen.add, self.counts, self.params.append
        for mpath, cpath, own in holders:
            prefix = f"{mpath}." if mpath else ""
            for pname, p in own.items():
                if p is None:
                    continue
                pid = id(p)
                if pid in seen:
                    self.tied.append((len(self.params), mpath, cpath, pname, pid))
                    continue
                met(pid)
                dt = p.dtype
                dname = _DTYPE_NAMES.get(dt) or _name_of(dt)
                trainable = p.requires_grad
                numel = p.numel()
                device = p.device
                dev = _DEVICE_TYPES.get(device) or _type_of(device)
                quantized = None if type(p) is _PARAMETER else self._quantized(p, trainable, dev, numel)
                if quantized is None:  # _count, inlined: once per parameter
                    row = counts.get(("param", dt, trainable, dev))
                    if row is None:
                        counts["param", dt, trainable, dev] = [1, numel]
                    else:
                        row[0] += 1
                        row[1] += numel
                # an nn.Parameter is a leaf (reading its .grad neither warns nor computes); a subclass is asked
                grad = p.grad if type(p) is _PARAMETER or p.is_leaf else None
                gname = None if grad is None else self._grad(grad, trainable)
                keep(_record(ParamInfo, (prefix + pname, pid, dname, gname, trainable, dev, numel, mpath, cpath, quantized)))

    def _quantized(self, p: torch.nn.Parameter, trainable: bool, dev: str, numel: int) -> tuple | None:
        """A quantized weight's ``(tensor class, storage dtype)``, tallied in its storage; None for a plain one."""
        if not self.storage_readers or type(p) is _PARAMETER:
            return None
        found = _storage(p, self.storage_readers)
        if found is None:
            return None
        row = self.stored.setdefault((found[1], trainable, dev), [0, 0, 0])
        row[0] += 1
        row[1] += numel
        row[2] += found[2]
        return found[:2]

    def _grad(self, grad: torch.Tensor, trainable: bool) -> str:
        """The gradient's dtype name (tallied)."""
        gdt = grad.dtype
        _count(self.counts, ("grad", gdt, trainable, _type_of(grad.device)), grad.numel())
        return _DTYPE_NAMES.get(gdt) or _name_of(gdt)

    def _buffers(self, bufs: dict) -> None:
        for b in bufs.values():
            if b is None or id(b) in self.seen:
                continue
            self.seen.add(id(b))
            _count(self.counts, ("buffer", b.dtype, False, _type_of(b.device)), b.numel())

    def facts(self, name: str) -> ModuleTensors:
        """The tree's tensor facts under ``name``."""
        counts, stored = self.counts, self.stored
        return ModuleTensors(
            _rows(name, counts, stored),
            tuple(self.params),
            self.checkpointing,
            frozenset([dev for (kind, _d, _t, dev) in counts if kind == "param"] + [dev for (_d, _t, dev) in stored]),
            patched_forwards=tuple(self.patched),
            tuner_layers=tuple(self.tuners),
            tied=tuple(self.tied),
            input_casts=tuple(dict(self.input_casts).items()),
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
