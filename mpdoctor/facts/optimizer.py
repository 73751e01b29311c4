"""Optimizer facts: class, per-parameter dtypes, grad dtypes and state dtypes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .tensors import Tallier, TensorTally, dtype_name


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
    has_state: bool
    #: ``eps`` of each param group (None where a group has none), in group order.
    group_eps: tuple[float | None, ...] = ()
    #: ``(elements read, elements whose step of size lr rounds away in bf16)`` over the trainable bf16
    #: parameters of a stock torch Adam / AdamW (:func:`mpdoctor.facts.lowbit.bf16_update_loss`); None otherwise.
    bf16_update_loss: tuple[int, int] | None = None

    @property
    def param_ids(self) -> frozenset[int]:
        """Ids of every parameter in every group."""
        return frozenset(p.id for p in self.params)


_DEFAULT_KEYS = ("lr", "eps", "weight_decay", "kahan_sum", "foreach", "fused", "optim_bits", "betas")


def gather_optimizer(name: str, outer: Any, inner: Any) -> OptimizerFacts:
    """Read the parameters and state of ``inner`` (the optimizer inside any wrapper)."""
    cls = type(inner)
    tally = Tallier(name)
    params: list[OptParam] = []
    state = inner.__dict__.get("state", {})
    groups = inner.__dict__.get("param_groups", [])
    seen: set[int] = set()
    for gi, group in enumerate(groups):
        for p in group.get("params", ()):
            if not isinstance(p, torch.Tensor) or id(p) in seen:
                continue
            seen.add(id(p))
            grad = p.grad if p.is_leaf else None
            st = state.get(p, {}) if isinstance(state, dict) else {}
            sdt: list[tuple[str, str]] = []
            for key, value in st.items() if isinstance(st, dict) else ():
                if isinstance(value, torch.Tensor):
                    tally.add("optimizer_state", value, True)
                    if value.dtype.is_floating_point and value.shape == p.shape and value.numel() > 1:
                        sdt.append((str(key), dtype_name(value.dtype)))
            params.append(
                OptParam(
                    id(p),
                    gi,
                    dtype_name(p.dtype),
                    dtype_name(grad.dtype) if grad is not None else None,
                    p.numel(),
                    tuple(sdt),
                    bool(p.requires_grad),
                )
            )
    defaults = inner.__dict__.get("defaults", {})
    safe_defaults = {
        k: (v if isinstance(v, (bool, int, float, str, type(None))) else str(v))
        for k, v in (defaults.items() if isinstance(defaults, dict) else ())
        if k in _DEFAULT_KEYS
    }
    wrapper = None
    if outer is not inner:
        wcls = type(outer)
        wrapper = f"{wcls.__module__}.{wcls.__qualname__}"
    return OptimizerFacts(
        name=name,
        class_path=f"{cls.__module__}.{cls.__qualname__}",
        class_name=cls.__name__,
        wrapper=wrapper,
        params=tuple(params),
        tallies=tally.rows(),
        defaults=safe_defaults,
        has_state=bool(state),
        group_eps=tuple(_eps_of(g) for g in groups if isinstance(g, dict)),
        bf16_update_loss=_bf16_update_loss(cls, groups, params),
    )


def _bf16_update_loss(cls: type, groups: list, params: list[OptParam]) -> tuple[int, int] | None:
    # Only where pure-bf16-adamw can apply: stock torch Adam / AdamW with trainable bf16 parameters.
    if cls.__module__.split(".")[:2] != ["torch", "optim"] or cls.__name__ not in ("Adam", "AdamW"):
        return None
    if not any(p.dtype == "bfloat16" and p.requires_grad for p in params):
        return None
    from .lowbit import bf16_update_loss

    try:
        return bf16_update_loss(groups)
    except Exception:  # a value read must never stop the gathering
        return None


def _eps_of(group: dict) -> float | None:
    eps = group.get("eps")
    return float(eps) if isinstance(eps, (int, float)) and not isinstance(eps, bool) else None
