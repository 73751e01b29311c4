"""The one plain view of a report that every renderer reads (text, HTML, markdown, JSON, the widget).

It is built once per report (and per state of its fixes) in the diagnosis layer
(:func:`mpdoctor.diagnosis.view_builder.build_view`), with everything a renderer shows already in it: the findings with
their rule's "why", the histogram, precision, caches, scalers, the value scan's rows, the probe's rows, the scale
history, the layer strips, the cause's heading. A renderer never reaches a live object, the facts or torch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

#: How many times each rendering ran in this process ("text", "html", "markdown"): the tests count them.
RENDERS: Counter = Counter()


@dataclass(frozen=True, eq=False)
class ReportView:
    """A report as plain data.

    Attributes
    ----------
    data : dict
        The whole report, JSON-serialisable and redacted (what ``report.to_dict()`` returns).
    counts : dict
        Findings per severity.
    device_label : str
        The device or what-if profile, as the header names it.
    elapsed : float
        Seconds the diagnosis took.
    cause_label : str or None
        ``"cause of RuntimeError: ... (raised by scaler16)"`` when the first finding explains an exception.
    layer_strips : tuple of LayerStrip
        Per model with enough numbered layers: the dtype of every layer x module kind.
    pending_safe_fixes : int
        Safe fixes of the plan not yet applied (the "Apply all safe fixes (N)" button).
    renders : dict
        Renderings already made from this view (text per width, HTML, markdown): a display renders each once.
    """

    data: dict
    counts: dict
    device_label: str
    elapsed: float
    cause_label: str | None
    layer_strips: tuple
    pending_safe_fixes: int
    renders: dict = field(default_factory=dict, repr=False)

    def rendered(self, kind: Any, render: Any) -> str:
        """``render(self)`` once per ``kind`` for this view (``"html"``, ``("text", 100)``, ...)."""
        if kind not in self.renders:
            RENDERS[kind[0] if isinstance(kind, tuple) else kind] += 1
            self.renders[kind] = render(self)
        return self.renders[kind]
