"""GradScaler facts, read from the scaler's fields without calling its methods."""

from __future__ import annotations

from dataclasses import dataclass


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
