"""Optimizer facts: class, per-parameter dtypes, grad dtypes and state dtypes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .tensors import TensorTally


class OptParam(NamedTuple):
    """One parameter as an optimizer sees it."""

    id: int
    group: int
    dtype: str
    grad_dtype: str | None
    numel: int
    state_dtypes: tuple[tuple[str, str], ...]  # (state key, dtype) for full-size floating state tensors
    requires_grad: bool = True  # frozen params never get a grad, so dtype-checking optimizers never see them


@dataclass(frozen=True)
class OptimizerFacts:
    """What one optimizer holds."""

    name: str
    class_path: str
    class_name: str
    wrapper: str | None
    params: tuple[OptParam, ...]
    tallies: tuple[TensorTally, ...]
    defaults: dict
    #: ``eps`` of each param group (None where a group has none), in group order.
    group_eps: tuple[float | None, ...] = ()
    #: The largest per-parameter ``step`` in the optimizer state: how many steps it has taken (0 when fresh).
    state_steps: int = 0
    #: ``(elements read, elements whose step of size lr rounds away in bf16)`` over the trainable bf16
    #: parameters of a stock torch Adam / AdamW (:func:`bf16_update_loss`); None otherwise.
    bf16_update_loss: tuple[int, int] | None = None

    @property
    def param_ids(self) -> frozenset[int]:
        """Ids of every parameter in every group."""
        return frozenset(p.id for p in self.params)


#: Elements of one tensor read to estimate the share of lost bf16 updates (a strided view: no copy of the tensor).
UPDATE_SAMPLE = 65536


def bf16_update_loss(groups: list) -> tuple[int, int] | None:
    """``(elements read, elements whose Adam step of size lr rounds away in bf16)`` over trainable bf16 parameters.

    An Adam step moves a weight by about ``lr``; bf16 keeps 8 significant bits, so the step is lost (rounds back
    to the same value) when ``lr`` is below half a unit in the last place of the weight: for every weight with
    ``|w| >= 2 ** (floor(log2(lr)) + 9)``. Zero and small weights (LoRA adapters at init) keep their steps.
    Large tensors are read through a strided view of at most :data:`UPDATE_SAMPLE` elements. None when no param
    group has a numeric ``lr`` and a trainable bf16 parameter.
    """
    import math

    import torch

    read = lost = 0
    for group in groups:
        lr = group.get("lr") if isinstance(group, dict) else None
        if isinstance(lr, torch.Tensor):
            lr = float(lr) if lr.numel() == 1 else None
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or lr <= 0:
            continue
        threshold = 2.0 ** (math.floor(math.log2(lr)) + 9)
        for p in group.get("params", ()):
            if not isinstance(p, torch.Tensor) or p.dtype != torch.bfloat16 or not p.requires_grad:
                continue
            if p.device.type == "meta" or not p.numel():
                continue
            flat = p.detach().reshape(-1)  # a view for the contiguous parameters optimizers hold
            sample = flat[:: max(1, flat.numel() // UPDATE_SAMPLE)]
            read += sample.numel()
            lost += int((sample.abs() >= threshold).sum())
    return (read, lost) if read else None
