"""The gradient accumulation of a hand-written loop in the cells a notebook ran (read, never run).

The reading itself is :func:`mpdoctor.objects.readers.loop_accumulation.read_loop_accumulations`; here the shell's
history is its source.
"""

from __future__ import annotations

from typing import Any

from ...objects.readers.loop_accumulation import (
    LoopAccumulation,
    read_loop_accumulations,
    record_loop_accumulations,
)

__all__ = ["LoopAccumulation", "read_loop_accumulations", "record_cells", "record_loop_accumulations"]


def record_cells(shell: Any) -> list[LoopAccumulation]:
    """Read the cells ``shell`` has run for hand-written accumulation loops and record them (never run).

    Parameters
    ----------
    shell : IPython.core.interactiveshell.InteractiveShell
        The running shell: its history and its namespace.
    """
    from .history import cell_sources

    try:
        return record_loop_accumulations(cell_sources(shell), shell.user_ns)
    except Exception:  # a history that cannot be read: the report of the objects stands without the loop's setting
        return []
