"""Read a 4D additive attention mask the user holds (``model(ids, attention_mask=mask)``).

A tensor is taken for an additive mask only by its values: four dimensions, one head dimension, floating,
its largest entry ``0`` and its smallest far below any attention score (``-1e4`` or less, or ``-inf``). Only
plain ``torch.Tensor`` objects on a real device and of at most :data:`MAX_ELEMENTS` elements are read.
"""

from __future__ import annotations

from typing import Any

import torch

from ...facts.inference import AttentionMaskFacts
from ...facts.tensors import dtype_name

#: Masks larger than this are not read (a 64-sequence batch of 2,048 tokens is 2**28: not a mask to scan).
MAX_ELEMENTS = 2**24
#: A masked entry lies at or below this (transformers fills with the dtype's ``finfo.min``).
MASKED_BELOW = -1e4


def is_additive_mask(t: Any) -> bool:
    """True for a ``(batch, 1, query, key)`` floating tensor of zeros and large negatives."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point() or t.shape[1] != 1:
        return False
    if t.device.type == "meta" or not 0 < t.numel() <= MAX_ELEMENTS:
        return False
    lo, hi = torch.aminmax(t.detach())
    return float(hi) == 0.0 and float(lo) <= MASKED_BELOW


def read_mask(name: str, mask: torch.Tensor) -> AttentionMaskFacts:
    """The facts of one additive mask: its dtype, its ``-inf`` entries and the rows made only of them."""
    with torch.no_grad():
        inf = torch.isneginf(mask)
        return AttentionMaskFacts(
            name=name,
            ref=id(mask),
            dtype=dtype_name(mask.dtype),
            shape=tuple(mask.shape),
            neg_inf=int(inf.sum()),
            dead_rows=int(inf.all(dim=-1).sum()),
        )
