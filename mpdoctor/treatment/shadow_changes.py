"""The change that keeps an EMA / averaged copy's shadow in fp32 (with an update path that accepts it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..edits.steps import Change
from ..facts import Facts
from ..live import Live
from ..readers.intent import min_gap, shadow_kind, shadow_tensors
from .changes import ChangeSpec


@dataclass(frozen=True)
class KeepShadowFp32(ChangeSpec):
    """Cast the shadow tensors of the averaging object ``ref`` to fp32, in place, and let its update take an online
    model of another dtype (ema-pytorch's ``coerce_dtype``; ``AveragedModel``'s per-tensor ``avg_fn``)."""

    ref: int
    label: str

    def bind(self, live: Live) -> list[Change]:
        from ..integrations.averaging import keep_shadow_fp32_steps

        return keep_shadow_fp32_steps(live.get(self.ref), self.label)

    def simulate(self, facts: Facts) -> Facts:
        shadows = tuple(
            dataclasses.replace(
                s, shadow_dtypes=("float32",), low_elements=0, same_dtype_update=False,
                coerce_dtype=True if s.coerce_dtype is not None else None,
                lost_share=0.0 if s.lost_share is not None else None, min_gap=min_gap("float32", s.decay),
            ) if s.ref == self.ref else s
            for s in facts.averaging
        )  # fmt: skip
        return dataclasses.replace(facts, averaging=shadows)

    def verify(self, live: Live) -> str | None:
        obj = live.get(self.ref)
        kind = shadow_kind(obj) or ("hand-written" if isinstance(obj, (torch.nn.Module, dict)) else None)
        left = sum(1 for t in shadow_tensors(obj, kind) if t.dtype != torch.float32) if kind else 0
        return f"{left} shadow tensors of {self.label} are not float32" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, "shadow dtype"): "float32"}

    def backup_bytes(self, facts: Facts) -> int:
        return sum(2 * s.low_elements for s in facts.averaging if s.ref == self.ref)
