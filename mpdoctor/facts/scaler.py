"""GradScaler facts, read from the scaler's fields without calling its methods."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..facts.configs import raw_attr


@dataclass(frozen=True)
class ScalerFacts:
    """State of one ``torch.amp.GradScaler``.

    ``scale`` is None until the first ``scaler.scale(loss)`` (the scaler is lazy);
    ``init_scale`` is where it starts.
    """

    name: str
    class_path: str
    enabled: bool
    device: str
    scale: float | None
    init_scale: float
    growth_tracker: int | None
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    owners: tuple[str, ...] = ()
    #: ``_init_growth_tracker``: where the tracker starts (a restored scaler's saved tracker until its first scale()).
    init_growth_tracker: int = 0

    @property
    def fresh(self) -> bool:
        """At a default constructor's state (scale 2**16, growth tracker 0): nothing restored, nothing run."""
        tracker = self.growth_tracker if self.growth_tracker is not None else self.init_growth_tracker
        return looks_fresh(self.scale, self.init_scale, tracker)


#: What ``GradScaler()`` starts at when no ``init_scale`` is given.
DEFAULT_INIT_SCALE = 2.0**16


def looks_fresh(scale: float | None, init_scale: float | None, growth_tracker: int | float | None) -> bool:
    """Whether a scaler is at a default constructor's state: never scaled, or scale == init_scale == 2**16,
    growth tracker 0 (a restored scaler carries the saved scale and tracker instead)."""
    return (
        init_scale == DEFAULT_INIT_SCALE
        and (scale is None or scale == init_scale)
        and (growth_tracker is None or int(growth_tracker) == 0)
    )


def _scalar(value: Any) -> float | None:
    if value is None:
        return None
    try:
        # A one-element tensor: reading it is a copy of 4 bytes, never of user data.
        return float(value.item()) if hasattr(value, "item") else float(value)
    except Exception:
        return None


def gather_scaler(name: str, scaler: Any, owners: tuple[str, ...] = ()) -> ScalerFacts:
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
        growth_factor=float(raw_attr(scaler, "_growth_factor", 2.0) or 0.0),
        backoff_factor=float(raw_attr(scaler, "_backoff_factor", 0.5) or 0.0),
        growth_interval=int(raw_attr(scaler, "_growth_interval", 2000) or 0),
        owners=owners,
        init_growth_tracker=int(_scalar(raw_attr(scaler, "_init_growth_tracker", 0)) or 0),
    )
