"""Which cell runs are current: a run replaced by a later run of the same cell (the same cell id) is not.

The notebook session records it as cells end (:mod:`mpdoctor.attach.runtime.session`); the history reading skips the
replaced runs (:mod:`mpdoctor.attach.runtime.history`), so the code it reads is the code the user has now.
"""

from __future__ import annotations

from typing import Any

#: ``id(shell) -> {cell id: execution count of its latest run}``, and the execution counts replaced since.
_LATEST: dict[int, dict[Any, int]] = {}
_REPLACED: dict[int, set[int]] = {}


def ran(shell: Any, cell_id: Any, count: Any) -> None:
    """Record that the cell ``cell_id`` (the id the front end gives it; None: no id) ran as ``count``."""
    if cell_id is None or not isinstance(count, int):
        return
    latest = _LATEST.setdefault(id(shell), {})
    earlier = latest.get(cell_id)
    if earlier is not None and earlier != count:
        _REPLACED.setdefault(id(shell), set()).add(earlier)
    latest[cell_id] = count


def replaced_runs(shell: Any) -> frozenset[int]:
    """Execution counts of the cell runs replaced since by a later run of the same cell."""
    return frozenset(_REPLACED.get(id(shell), ()))


def forget(shell: Any) -> None:
    """Drop what was recorded of ``shell`` (``%unload_ext``)."""
    _LATEST.pop(id(shell), None)
    _REPLACED.pop(id(shell), None)
