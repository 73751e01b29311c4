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
    #: parameters of a stock torch Adam / AdamW (:func:`mpdoctor.facts.lowbit.bf16_update_loss`); None otherwise.
    bf16_update_loss: tuple[int, int] | None = None

    @property
    def param_ids(self) -> frozenset[int]:
        """Ids of every parameter in every group."""
        return frozenset(p.id for p in self.params)


