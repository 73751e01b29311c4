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
#: Floating dtypes no matmul computes in directly: a parameter held in one is storage that something upcasts
#: (judged by ``fp8-storage-not-upcast``), never a module's compute dtype.
STORAGE_ONLY = frozenset({"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"})


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
    #: Class path of the module holding it (under the name above).
    module_class: str = ""
    #: For a quantized weight (a tensor subclass whose data is stored in another format than ``dtype``,
    #: such as torchao's ``Int8Tensor``): ``(tensor class path, storage dtype)``; ``dtype`` is then the
    #: dtype it dequantizes to. None for a plain parameter.
    quantized: tuple[str, str] | None = None


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


@dataclass(frozen=True)
class ModuleTensors:
    """Tensor facts of one model.

    ``params`` and ``modules`` are the source of truth (a simulated fix replaces
    them); the aggregates checks read (dtype counts, ids, the dtypes present)
    are computed from them once per instance, on first use.
    """

    tallies: tuple[TensorTally, ...]
    params: tuple[ParamInfo, ...]
    gradient_checkpointing: bool
    devices: frozenset[str]
    #: ``(module path, forward origin)`` for modules running a forward assigned from another package
    #: (a monkeypatch such as Unsloth's fused LoRA kernels), never torch's or accelerate's wrappers.
    patched_forwards: tuple[tuple[str, str], ...] = ()
    #: Paths of PEFT tuner layers (LoRA ``Linear`` ...): they cast their input to the adapter dtype.
    tuner_layers: tuple[str, ...] = ()
    #: A parameter seen again under another name (tied weights): ``(position in params where it was met,
    #: module path, module class path, its name in that module, param id)``.
    tied: tuple[tuple[int, str, str, str, int], ...] = ()

    @functools.cached_property
    def modules(self) -> tuple[ModuleDtypes, ...]:
        """The floating parameters of each module that holds some directly, in ``named_modules()`` order.

        Derived from ``params`` (and ``tied``), so a simulated cast of ``params`` is seen here too.
        Quantized weights are left out: the layers holding them dequantize to the dtype of the input.
        """
        by_id = {p.id: p for p in self.params} if self.tied else {}
        tied_at: dict[int, list[tuple[int, str, str, str, int]]] = {}
        for entry in self.tied:
            tied_at.setdefault(entry[0], []).append(entry)
        groups: dict[str, tuple[str, list[tuple[str, str, bool]]]] = {}

        def put(path: str, cls: str, short: str, dtype: str, trainable: bool) -> None:
            if dtype in FLOATING:
                groups.setdefault(path, (cls, []))[1].append((short, dtype, trainable))

        def put_tied(position: int) -> None:  # the names met again before params[position]
            for _, path, cls, short, pid in tied_at.get(position, ()):
                q = by_id.get(pid)
                if q is not None:
                    put(path, cls, short, q.dtype, q.requires_grad)

        for i, p in enumerate(self.params):
            put_tied(i)
            if p.quantized is not None or p.dtype in STORAGE_ONLY:
                continue  # quantized / float8-stored weights are upcast to the activations' dtype before the math
            short = p.name[len(p.module) + 1 :] if p.module else p.name
            put(p.module, p.module_class, short, p.dtype, p.requires_grad)
        put_tied(len(self.params))
        return tuple(ModuleDtypes(path, cls, tuple(rows)) for path, (cls, rows) in groups.items())

    @functools.cached_property
    def param_ids(self) -> frozenset[int]:
        """Ids of every parameter, to match optimizers to models."""
        return frozenset([p.id for p in self.params])

    @functools.cached_property
    def _dtype_counts(self) -> dict[bool, dict[str, int]]:
        counts: dict[bool, dict[str, int]] = {True: {}, False: {}}
        for p in self.params:
            c = counts[p.requires_grad]
            c[p.dtype] = c.get(p.dtype, 0) + p.numel
        return counts

    def param_dtype_counts(self, trainable: bool | None = None) -> dict[str, int]:
        """Element counts per parameter dtype, optionally only (non-)trainable ones."""
        by = self._dtype_counts
        if trainable is not None:
            return dict(by[bool(trainable)])
        out = dict(by[True])
        for d, n in by[False].items():
            out[d] = out.get(d, 0) + n
        return out

    @functools.cached_property
    def param_dtypes(self) -> frozenset[str]:
        """Every parameter dtype present."""
        return frozenset(self._dtype_counts[True]) | frozenset(self._dtype_counts[False])

    @functools.cached_property
    def module_dtypes(self) -> frozenset[str]:
        """The floating dtypes of all modules' direct parameters together (every parameter is some module's)."""
        return self.param_dtypes & FLOATING

    @functools.cached_property
    def grads_differ(self) -> bool:
        """True when some parameter's ``.grad`` has another dtype than the parameter."""
        return any(p.grad_dtype is not None and p.grad_dtype != p.dtype for p in self.params)

    @functools.cached_property
    def main_dtype(self) -> str | None:
        """The floating dtype holding most parameter elements."""
        counts = {d: n for d, n in self.param_dtype_counts().items() if d in FLOATING}
        # float8 storage is upcast before the math: the compute-capable dtype is the main one when there is one.
        computing = {d: n for d, n in counts.items() if d not in STORAGE_ONLY} or counts
        return max(computing, key=computing.get) if computing else None


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


def gather_module_tensors(
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
