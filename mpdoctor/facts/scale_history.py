"""Loss scale and loss over time: one :class:`ScaleRecord` per real optimizer step of each GradScaler.

Plain data (no torch): renderers read it to draw the scale over steps, skips marked, beside the loss.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ScaleRecord:
    """One real optimizer step of one GradScaler (one ``update()``).

    Attributes
    ----------
    scaler : str
        The name the scaler is known by.
    step : int
        1-based count of this scaler's ``update()`` calls while watched.
    scale : float
        The loss scale the step ran with (before ``update()`` adjusted it).
    skipped : bool
        True when the gradients held inf/NaN and ``scaler.step`` skipped the optimizer step.
    loss : float or None
        The sum of the losses passed to ``scaler.scale`` since the previous ``update()`` (the step's loss
        when micro-batch losses are divided by the accumulation count, as the recipes do).
    series : int
        Which scaler, in the order the watcher first saw them (1, 2, ...): two scalers known by one name (a
        notebook that rebuilds ``scaler``) are two series, never one merged step by step.
    place : str
        Where the step ran, as the user names it (``cell [5]``); empty outside a notebook.
    """

    scaler: str
    step: int
    scale: float
    skipped: bool
    loss: float | None = None
    series: int = 1
    place: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        return asdict(self)
