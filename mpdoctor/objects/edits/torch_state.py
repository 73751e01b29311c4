"""Process-wide torch precision state that fixes change and undo exactly (TF32 / fp32 matmul precision)."""

from __future__ import annotations

from typing import Any

import torch

#: torch >= 2.9 keeps a per-backend ``fp32_precision`` beside the legacy flags; both are part of an exact undo.
_FP32_PRECISION_PATHS = (
    "backends",
    "backends.cuda.matmul",
    "backends.cudnn",
    "backends.cudnn.conv",
    "backends.cudnn.rnn",
    "backends.mkldnn",
    "backends.mkldnn.matmul",
    "backends.mkldnn.conv",
    "backends.mkldnn.rnn",
)


def _backend(path: str) -> Any:
    obj: Any = torch
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def fp32_precisions() -> dict:
    """``fp32_precision`` of every torch backend that has one (empty before torch 2.9)."""
    out = {}
    for path in _FP32_PRECISION_PATHS:
        try:
            out[path] = _backend(path).fp32_precision
        except (AttributeError, RuntimeError):
            pass
    return out


def restore_fp32_precisions(saved: dict) -> None:
    """Put back what :func:`fp32_precisions` read, parents first."""
    for path, value in saved.items():
        if fp32_precisions().get(path) != value:
            _backend(path).fp32_precision = value
