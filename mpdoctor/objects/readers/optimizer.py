"""Reading an optimizer into its facts: class, per-parameter dtypes, grad dtypes and state dtypes."""

from __future__ import annotations

from typing import Any

import torch

from ...facts.optimizer import OptimizerFacts, OptParam
from ...facts.tensors import dtype_name
from .tensors import Tallier

_DEFAULT_KEYS = ("lr", "eps", "weight_decay", "kahan_sum", "foreach", "fused", "optim_bits", "betas")


def read_optimizer(name: str, outer: Any, inner: Any) -> OptimizerFacts:
    """Read the parameters and state of ``inner`` (the optimizer inside any wrapper)."""
    cls = type(inner)
    tally = Tallier(name)
    params: list[OptParam] = []
    state = inner.__dict__.get("state", {})
    groups = inner.__dict__.get("param_groups", [])
    seen: set[int] = set()
    steps = 0
    for gi, group in enumerate(groups):
        for p in group.get("params", ()):
            if not isinstance(p, torch.Tensor) or id(p) in seen:
                continue
            seen.add(id(p))
            st = state.get(p, {}) if isinstance(state, dict) else {}
            st = st if isinstance(st, dict) else {}
            steps = max(steps, _step_count(st.get("step")))
            params.append(_opt_param(gi, p, st, tally))
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
        defaults=_plain_defaults(inner.__dict__.get("defaults", {})),
        group_eps=tuple(_eps_of(g) for g in groups if isinstance(g, dict)),
        state_steps=steps,
        bf16_update_loss=_bf16_update_loss(cls, groups, params),
    )


def _opt_param(group: int, p: torch.Tensor, st: dict, tally: Tallier) -> OptParam:
    """One parameter's dtypes and its state's (tallied), as the optimizer holds them."""
    grad = p.grad if p.is_leaf else None
    sdt: list[tuple[str, str]] = []
    for key, value in st.items():
        if isinstance(value, torch.Tensor):
            tally.add("optimizer_state", value, True)
            if value.dtype.is_floating_point and value.shape == p.shape and value.numel() > 1:
                sdt.append((str(key), dtype_name(value.dtype)))
    return OptParam(
        id(p),
        group,
        dtype_name(p.dtype),
        dtype_name(grad.dtype) if grad is not None else None,
        p.numel(),
        tuple(sdt),
        bool(p.requires_grad),
    )


def _plain_defaults(defaults: Any) -> dict:
    """The defaults worth showing, as plain values (anything else as its ``str``)."""
    return {
        k: (v if isinstance(v, (bool, int, float, str, type(None))) else str(v))
        for k, v in (defaults.items() if isinstance(defaults, dict) else ())
        if k in _DEFAULT_KEYS
    }


def _step_count(step: Any) -> int:
    # Adam-family optimizers keep a 0-d ``step`` tensor (4 bytes read); others an int, or nothing.
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        step = step.item()
    return int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) and step > 0 else 0


def _eps_of(group: dict) -> float | None:
    eps = group.get("eps")
    return float(eps) if isinstance(eps, (int, float)) and not isinstance(eps, bool) else None


def _bf16_update_loss(cls: type, groups: list, params: list[OptParam]) -> tuple[int, int] | None:
    # Only where pure-bf16-adamw can apply: stock torch Adam / AdamW with trainable bf16 parameters.
    if cls.__module__.split(".")[:2] != ["torch", "optim"] or cls.__name__ not in ("Adam", "AdamW"):
        return None
    if not any(p.dtype == "bfloat16" and p.requires_grad for p in params):
        return None
    from ...facts.optimizer import bf16_update_loss

    try:
        return bf16_update_loss(groups)
    except Exception:  # a value read must never stop the gathering
        return None
