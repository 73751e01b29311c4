"""Reading a GradScaler into its facts, through its own attributes (no method of it runs)."""

from __future__ import annotations

from typing import Any

from ..facts.scaler import ScalerFacts
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
