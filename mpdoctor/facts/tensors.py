"""Tensor facts: dtype tallies per object and kind, per-parameter records, per-module dtype sets.

Everything here reads metadata (dtype, device, numel, requires_grad): no tensor
data is read, copied or moved, so meta tensors are counted like any other.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

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
    #: ``(module path, "own-dtype" | "float32")`` for modules whose input their forward, or their parent's, casts
    #: (read from the source: a deliberate fp32 router, gate or head under a bf16 model).
    input_casts: tuple[tuple[str, str], ...] = ()
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
