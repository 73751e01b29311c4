"""Changes that put an fp32 island back: a router's correction bias, a metric's states, a LoRA delta.

Three change kinds (see :mod:`mpdoctor.rules.engine.changes` for the protocol): :class:`CastBuffersTo` casts named
buffers of a module tree in place (a router's ``e_score_correction_bias``), :class:`SetMetricStatesDtype`
moves a torchmetrics ``Metric``'s states to a dtype through its own ``set_dtype``, :class:`UnmergeAdapters`
takes a LoRA delta back out of a half-precision base (PEFT's ``unmerge``), so the adapter adds it exactly. Each
saves or computes what it needs before the first change and undoes to the very objects and bytes it replaced.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...objects.edits.steps import Change
from ...objects.live.introspect import own_dict, raw_attr
from .changes import ChangeSpec, torch_dtype

if TYPE_CHECKING:
    from ...facts import Facts
    from ...objects.live import Live


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


class UnmergeLayer(Change):
    """PEFT's ``layer.unmerge()`` on one LoRA layer: its adapters compute their delta beside the base again, the base
    weight set to the nearest value to ``merged - delta`` (bits of the base the merge rounded away stay lost). Undo
    merges them again (``layer.merge``) and copies the merged base weight's (and bias's) saved bytes back, so the
    weights are bit for bit what they were (a second rounding of ``base + delta`` may differ by an ulp)."""

    def __init__(self, layer: Any, label: str) -> None:
        self._layer, self.description = layer, f"unmerge the adapter of {label}"
        self._merged: list[str] = []
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _base_tensors(self) -> list[torch.Tensor]:
        base = raw_attr(self._layer, "_modules", {}).get("base_layer")
        params = raw_attr(base, "_parameters", {}) if base is not None else {}
        return [t for t in (params.get("weight"), params.get("bias")) if isinstance(t, torch.Tensor)]

    @property
    def in_place(self) -> bool:
        return not raw_attr(self._layer, "merged_adapters")

    def _recovered_base(self) -> torch.Tensor | None:
        """The base weight before the merge, as nearly as the merged one holds it: ``round(merged - delta)`` with the
        deltas in fp32 (PEFT's own unmerge subtracts them rounded to the base's dtype, one more rounding). None for
        an adapter variant (DoRA) whose unmerge is not a subtraction."""
        variants = raw_attr(self._layer, "lora_variant") or {}
        tensors = self._base_tensors()
        if not tensors or any(a in variants for a in self._merged):
            return None
        weight = tensors[0]
        with torch.no_grad():
            deltas = [self._layer.get_delta_weight(a).float() for a in self._merged]
            if any(d.shape != weight.shape for d in deltas):
                return None
            return (weight.detach().float() - sum(deltas)).to(weight.dtype)

    def apply(self) -> None:
        self._merged = list(raw_attr(self._layer, "merged_adapters") or [])
        self._saved = [(t, t.detach().clone()) for t in self._base_tensors()]  # allocated before anything changes
        base = self._recovered_base()
        self._layer.unmerge()
        if base is not None:
            with torch.no_grad():
                self._base_tensors()[0].data.copy_(base)

    def revert(self) -> None:
        now = list(raw_attr(self._layer, "merged_adapters") or [])
        missing = [a for a in self._merged if a not in now]  # all of them, or those an unmerge that failed popped
        if missing:
            self._layer.merge(adapter_names=missing)
        with torch.no_grad():
            for tensor, saved in self._saved:
                tensor.data.copy_(saved)


@dataclass(frozen=True)
class UnmergeAdapters(ChangeSpec):
    """Unmerge the LoRA layers ``paths`` of the PEFT model ``ref`` in place (``layer.unmerge()`` each): the adapter
    adds its delta in its own dtype at every forward instead of a half-precision base holding a rounded sum."""

    ref: int
    paths: tuple[str, ...]
    label: str

    def _layers(self, live: Live) -> list[tuple[str, Any]]:
        root = live.get(self.ref)
        return [(p, layer) for p in self.paths if (layer := _submodule(root, p)) is not None]

    def bind(self, live: Live) -> list[Change]:
        return [UnmergeLayer(layer, f"{self.label}.{p}") for p, layer in self._layers(live)
                if raw_attr(layer, "merged_adapters")]  # fmt: skip

    def simulate(self, facts: Facts) -> Facts:
        between = facts.between
        names = {s.name for s in facts.subjects if s.ref == self.ref}
        if between is None:
            return facts
        gone = set(self.paths)
        merged = tuple(m for m in between.merged_adapters if not (m.model in names and m.path in gone))
        return dataclasses.replace(facts, between=dataclasses.replace(between, merged_adapters=merged))

    def verify(self, live: Live) -> str | None:
        left = [p for p, layer in self._layers(live) if raw_attr(layer, "merged_adapters")]
        return f"{', '.join(left)} still merged" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, p, "merged"): False for p in self.paths}
