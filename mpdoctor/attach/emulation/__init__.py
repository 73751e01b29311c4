"""Precisions as functions you can emulate: quantizers (``formats``) and ``compare(model, batch)``."""

from __future__ import annotations

from typing import Any

__all__ = ["Comparison", "Recommendation", "compare"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import compare as _compare_module

        return getattr(_compare_module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
