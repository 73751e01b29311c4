"""The value scan as rows: pure functions of the Facts' ``scans`` (one row per module and kind, or per tensor).

The diagnosis builds the report's scan view from these (``Report.scan_rows``, ``Report.scan_table``); the
renderers read the rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas

    from ..facts import Facts
    from ..objects.gathering.values import TensorScan

def module_rows(tensors: Iterable[TensorScan]) -> list[dict]:
    """Aggregate tensor rows per object, module and kind (in first-seen order)."""
    rows: dict[tuple[str, str, str], dict] = {}
    for t in tensors:
        key = (t.object, t.module, t.kind)
        row = rows.get(key)
        if row is None:
            row = rows[key] = {
                "object": t.object, "module": t.module, "kind": t.kind, "dtypes": [], "tensors": 0, "elements": 0,
                "nan": 0, "inf": 0, "absmax": 0.0, "fp16_overflow": 0, "fp16_underflow": 0, "bf16_overflow": 0,
                "bf16_underflow": 0,
            }  # fmt: skip
        if t.dtype not in row["dtypes"]:
            row["dtypes"].append(t.dtype)
        row["tensors"] += 1
        row["elements"] += t.numel
        for k in ("nan", "inf", "fp16_overflow", "bf16_overflow"):
            row[k] += getattr(t, k)
        for k in ("fp16_underflow", "bf16_underflow"):
            value = getattr(t, k)
            row[k] = None if value is None or row[k] is None else row[k] + value
        row["absmax"] = max(row["absmax"], t.absmax)
    for row in rows.values():
        row["dtypes"] = ",".join(row["dtypes"])
    return list(rows.values())


SCAN_COLUMNS = [
    "object", "module", "kind", "dtypes", "tensors", "elements", "nan", "inf", "absmax",
    "fp16_overflow", "fp16_underflow", "bf16_overflow", "bf16_underflow",
]  # fmt: skip


def scan_rows(facts: Facts, by: str = "module") -> list[dict]:
    """The scan as plain rows: per ``"module"`` (default) or per ``"tensor"``; empty without a scan.

    Parameters
    ----------
    facts : Facts
        Facts holding ``scans`` (``diagnose(..., scan=True)``).
    by : {"module", "tensor"}
        One row per object, module and kind (param, grad, optimizer_state), or one per tensor.
    """
    tensors = [t for s in getattr(facts, "scans", ()) for t in s.tensors]
    if by == "tensor":
        return [dict(t._asdict(), nonfinite=t.nonfinite) for t in tensors]
    if by != "module":
        raise ValueError(f"by must be 'module' or 'tensor', not {by!r}")
    return module_rows(tensors)


def scan_table(facts: Facts, by: str = "module") -> pandas.DataFrame | None:
    """The scan as a pandas DataFrame (one row per module and kind, or per tensor with ``by="tensor"``).

    Parameters
    ----------
    facts : Facts
        Facts holding ``scans``; None is returned when they hold none (no ``scan=True``).
    by : {"module", "tensor"}
        As in :func:`scan_rows`.
    """
    if not facts.scans:
        return None
    import pandas as pd

    from ..objects.gathering.values import TensorScan

    rows = scan_rows(facts, by=by)
    if by == "tensor":
        return pd.DataFrame(rows, columns=list(TensorScan._fields) + ["nonfinite"])
    return pd.DataFrame(rows, columns=SCAN_COLUMNS)
