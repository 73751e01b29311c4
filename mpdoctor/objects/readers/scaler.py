"""Reading a GradScaler into its facts, through its own attributes (no method of it runs)."""

from __future__ import annotations

from typing import Any

from ...facts.scaler import ScalerFacts, ScalerStateFacts
from ..live.introspect import raw_attr


def _scalar(value: Any) -> float | None:
    if value is None:
        return None
    try:
        # A one-element tensor: reading it is a copy of 4 bytes, never of user data.
        return float(value.item()) if hasattr(value, "item") else float(value)
    except Exception:
        return None


def read_scaler(name: str, scaler: Any, owners: tuple[str, ...] = ()) -> ScalerFacts:
    """Read the state of a GradScaler."""
    cls = type(scaler)
    tracker = _scalar(raw_attr(scaler, "_growth_tracker"))
    return ScalerFacts(
        name=name,
        class_path=f"{cls.__module__}.{cls.__qualname__}",
        enabled=bool(raw_attr(scaler, "_enabled", False)),
        device=str(raw_attr(scaler, "_device", "cuda")),
        scale=_scalar(raw_attr(scaler, "_scale")),
        init_scale=float(raw_attr(scaler, "_init_scale", 65536.0) or 0.0),
        growth_tracker=int(tracker) if tracker is not None else None,
        growth_interval=int(raw_attr(scaler, "_growth_interval", 2000) or 0),
        owners=owners,
        init_growth_tracker=int(_scalar(raw_attr(scaler, "_init_growth_tracker", 0)) or 0),
    )


#: The keys ``GradScaler.state_dict()`` writes for an enabled scaler, and only those.
STATE_KEYS = frozenset({"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})


def is_scaler_state(value: Any) -> bool:
    """True for an exact ``dict`` holding a GradScaler's saved state: its keys are exactly those
    ``GradScaler.state_dict()`` writes, each a number (a Python number or a one-element tensor). Read through
    ``dict``'s own methods: the predicate discovery runs on every plain dict of a namespace."""
    if type(value) is not dict or dict.__len__(value) != len(STATE_KEYS):
        return False
    if not all(type(k) is str and k in STATE_KEYS for k in dict.keys(value)):
        return False
    return all(_scalar(v) is not None for v in dict.values(value))


def read_scaler_state(name: str, state: dict) -> ScalerStateFacts:
    """Read a held scaler state dict (one :func:`is_scaler_state` recognised) into its facts."""
    get = dict.__getitem__
    return ScalerStateFacts(
        name=name,
        ref=id(state),
        scale=float(_scalar(get(state, "scale")) or 0.0),
        growth_tracker=int(_scalar(get(state, "_growth_tracker")) or 0),
        growth_factor=float(_scalar(get(state, "growth_factor")) or 0.0),
        backoff_factor=float(_scalar(get(state, "backoff_factor")) or 0.0),
        growth_interval=int(_scalar(get(state, "growth_interval")) or 0),
    )
