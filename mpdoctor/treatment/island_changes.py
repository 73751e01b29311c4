"""Changes that put an fp32 island back: a router's correction bias and a metric's states.

Two change kinds (see :mod:`mpdoctor.treatment.changes` for the protocol): :class:`CastBuffersTo` casts named
buffers of a module tree in place (a router's ``e_score_correction_bias``), :class:`SetMetricStatesDtype`
moves a torchmetrics ``Metric``'s states to a dtype through its own ``set_dtype``. Each computes its new
tensors before the first swap and undoes by putting the very objects it replaced back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..edits.steps import Change
from ..live.introspect import own_dict, raw_attr
from .changes import ChangeSpec, torch_dtype

if TYPE_CHECKING:
    from ..facts import Facts
    from ..live import Live


def _submodule(root: Any, path: str) -> Any:
    """The submodule at ``path`` (``""`` is ``root``), read through ``_modules``."""
    module = root
    for part in path.split(".") if path else ():
        module = raw_attr(module, "_modules", {}).get(part)
    return module


class CastBuffers(Change):
    """Replace buffers by copies in another dtype; undo puts the original tensor objects back."""

    def __init__(self, entries: list[tuple[dict, str]], dtype: torch.dtype, label: str) -> None:
        self._entries, self._dtype = entries, dtype
        self.description = f"cast {len(entries)} {label} to {str(dtype).replace('torch.', '')}"
        self._old: list[tuple[dict, str, torch.Tensor]] = []

    @property
    def in_place(self) -> bool:
        return all(d[k].dtype == self._dtype for d, k in self._entries)

    def apply(self) -> None:
        new = [(d, k, d[k].to(self._dtype, copy=True)) for d, k in self._entries]  # allocate before any swap
        self._old = [(d, k, d[k]) for d, k in self._entries]
        for d, k, t in new:
            d[k] = t

    def revert(self) -> None:
        for d, k, t in self._old:
            d[k] = t


@dataclass(frozen=True)
class CastBuffersTo(ChangeSpec):
    """Cast the buffers ``(module path, name)`` of the module ``owner`` to ``dtype``, in place."""

    owner: int
    buffers: tuple[tuple[str, str], ...]
    dtype: str
    label: str = "buffers"

    def _entries(self, live: Live) -> list[tuple[dict, str]]:
        root = live.get(self.owner)
        out = []
        for path, name in self.buffers:
            store = raw_attr(_submodule(root, path), "_buffers", {})
            if isinstance(store.get(name), torch.Tensor):
                out.append((store, name))
        return out

    def bind(self, live: Live) -> list[Change]:
        pending = [(d, k) for d, k in self._entries(live) if d[k].dtype != torch_dtype(self.dtype)]
        return [CastBuffers(pending, torch_dtype(self.dtype), self.label)] if pending else []

    def simulate(self, facts: Facts) -> Facts:
        between = facts.between
        if between is None:
            return facts
        hit = set(self.buffers)
        routers = tuple(
            dataclasses.replace(r, dtype=self.dtype, lost_updates=0.0)
            if r.model_ref == self.owner and (r.path, r.attr) in hit else r
            for r in between.router_biases
        )
        return dataclasses.replace(facts, between=dataclasses.replace(between, router_biases=routers))

    def verify(self, live: Live) -> str | None:
        left = sum(1 for d, k in self._entries(live) if d[k].dtype != torch_dtype(self.dtype))
        return f"{left} {self.label} are not {self.dtype}" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(self.owner, f"{p}.{n}"): self.dtype for p, n in self.buffers}


class SetMetricDtype(Change):
    """``metric.set_dtype(dtype)``; undo puts back every state, default and dtype attribute it replaced."""

    def __init__(self, metric: Any, dtype: torch.dtype) -> None:
        self._metric, self._dtype = metric, dtype
        self.description = f"{type(metric).__name__}.set_dtype({dtype})"
        self._saved: dict[str, Any] = {}

    @property
    def in_place(self) -> bool:
        d = own_dict(self._metric)
        states = [d.get(k) for k in d.get("_defaults", {})]
        return d.get("_dtype") == self._dtype and all(
            t.dtype == self._dtype for t in states if isinstance(t, torch.Tensor) and t.is_floating_point())

    def apply(self) -> None:
        d = own_dict(self._metric)
        keys = ("_defaults", "_dtype", "_computed", "_forward_cache", *d.get("_defaults", {}))
        self._saved = {k: d[k] for k in keys if k in d}
        self._saved["_defaults"] = dict(d["_defaults"])  # set_dtype rewrites this dict in place
        self._metric.set_dtype(self._dtype)

    def revert(self) -> None:
        d = own_dict(self._metric)
        for k, v in self._saved.items():
            if k == "_defaults":
                d["_defaults"].clear()
                d["_defaults"].update(v)
            else:
                d[k] = v


@dataclass(frozen=True)
class SetMetricStatesDtype(ChangeSpec):
    """Move the states of the torchmetrics ``Metric`` ``metric`` to ``dtype`` with its own ``set_dtype``."""

    metric: int
    dtype: str

    def bind(self, live: Live) -> list[Change]:
        return [SetMetricDtype(live.get(self.metric), torch_dtype(self.dtype))]

    def simulate(self, facts: Facts) -> Facts:
        between = facts.between
        if between is None:
            return facts
        metrics = tuple(
            dataclasses.replace(m, states=tuple((n, self.dtype) for n, _ in m.states), stall=0)
            if m.ref == self.metric else m
            for m in between.metrics
        )
        return dataclasses.replace(facts, between=dataclasses.replace(between, metrics=metrics))

    def verify(self, live: Live) -> str | None:
        metric, dtype = live.get(self.metric), torch_dtype(self.dtype)
        d = own_dict(metric)
        left = [k for k in d.get("_defaults", {}) if isinstance(d.get(k), torch.Tensor)
                and d[k].is_floating_point() and d[k].dtype != dtype]
        return f"states {', '.join(left)} are not {self.dtype}" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(self.metric, "dtype"): self.dtype}
