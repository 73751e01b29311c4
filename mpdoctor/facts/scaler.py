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
    growth_interval: int
    owners: tuple[str, ...] = ()
    #: ``_init_growth_tracker``: where the tracker starts (a restored scaler's saved tracker until its first scale()).
    init_growth_tracker: int = 0

    @property
    def fresh(self) -> bool:
        """At a default constructor's state (scale 2**16, growth tracker 0): nothing restored, nothing run."""
        tracker = self.growth_tracker if self.growth_tracker is not None else self.init_growth_tracker
        return looks_fresh(self.scale, self.init_scale, tracker)


@dataclass(frozen=True)
class ScalerStateFacts:
    """A GradScaler's saved state the user holds (``ckpt["scaler"]`` of a checkpoint loaded with ``torch.load``):
    a plain dict with exactly the keys ``GradScaler.state_dict()`` writes, read by its values.

    ``ref`` is the dict's live ref: a fix loads it into a live scaler.
    """

    name: str
    ref: int
    scale: float
    growth_tracker: int
    growth_factor: float
    backoff_factor: float
    growth_interval: int

    @property
    def fresh(self) -> bool:
        """A fresh scaler's state (scale 2**16, tracker 0): loading it restores nothing."""
        return looks_fresh(self.scale, self.scale, self.growth_tracker)


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
