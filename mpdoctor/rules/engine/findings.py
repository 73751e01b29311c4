"""Findings: what a check says about a subject, with the fixes it offers."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Severity(str, Enum):
    """How bad a finding is, calibrated the same for every rule."""

    #: It will crash or silently ruin the run.
    ERROR = "error"
    #: Measurable harm in this setup.
    WARNING = "warning"
    #: True but harmless here.
    INFO = "info"


#: Severities, most severe first. ``error``: will crash or silently train wrong.
SEVERITIES = tuple(s.value for s in Severity)
SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}


@dataclass
class Finding:
    """One problem found in the live objects.

    Attributes
    ----------
    check : str
        The stable slug of the check that found it (``scaler-with-bf16``).
    severity : str
        ``"error"``, ``"warning"`` or ``"info"``.
    subject : str
        Dotted path of the object concerned (``model.config.text_config.use_cache``).
    message : str
        One plain sentence: what is wrong and what happens if it is ignored.
    evidence : dict
        The facts the finding rests on (JSON-serialisable).
    fixes : list of Fix
        Ways to fix it in place; may be empty.
    """

    check: str
    severity: str
    subject: str
    message: str
    evidence: dict = field(default_factory=dict)
    fixes: list = field(default_factory=list)

    def __post_init__(self) -> None:
        # A Severity member is stored as its plain value: renderers and JSON read a str.
        if isinstance(self.severity, Severity):
            self.severity = self.severity.value
        if self.severity not in SEVERITY_RANK:
            raise ValueError(f"severity must be one of {SEVERITIES}, not {self.severity!r}")

    @property
    def rank(self) -> int:
        """0 for errors, 1 for warnings, 2 for info: sort key."""
        return SEVERITY_RANK[self.severity]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        return {
            "check": self.check,
            "severity": self.severity,
            "subject": self.subject,
            "message": self.message,
            "evidence": _jsonable(self.evidence),
            "fixes": [f.to_dict() for f in self.fixes],
        }


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``count(1, "parameter")`` -> ``"1 parameter"``; ``count(3, "parameter")`` -> ``"3 parameters"``."""
    return f"{n:,} {noun if n == 1 else (plural or noun + 's')}"


def size_delta(nbytes: float) -> str:
    """A signed memory figure in the unit that shows it: ``+24.0 KiB``, ``-1.5 MiB``, ``+512 B`` (never ``+0.0 MiB``)."""
    sign = "-" if nbytes < 0 else "+"
    n = abs(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    return f"{sign}{n:.1f} GiB"


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=str) if isinstance(value, (set, frozenset)) else value
        return [_jsonable(v) for v in items]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
