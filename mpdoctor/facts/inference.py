"""Facts of what a user holds to generate with: KV caches (transformers ``DynamicCache``, ``StaticCache``, the legacy
tuple of per-layer ``(key, value)`` pairs) and 4D attention masks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheFacts:
    """A KV cache the user holds, read from its stored key / value tensors.

    ``dtypes`` are the floating dtypes of the tensors it stores (empty for a cache no forward has filled
    yet: it takes the model's dtype at its first update). ``static`` is True for a preallocated cache
    (``StaticCache``) that copies new keys into its tensors with ``index_copy_``, which refuses another dtype;
    a dynamic cache concatenates, which promotes. ``legacy`` is True for the legacy format (a plain tuple or list
    of per-layer ``(key, value)`` pairs), which ``DynamicCache`` converts at the call: it concatenates too.
    """

    name: str
    ref: int
    class_name: str
    dtypes: tuple[str, ...]
    tensors: int
    bytes: int
    static: bool
    legacy: bool = False
    #: Tokens each self-attention layer holds (a dynamic cache; empty otherwise). Layers that disagree say a call
    #: failed part-way through a forward: the layers it reached took the new tokens, the others did not.
    lengths: tuple[int, ...] = ()

    @property
    def dtype(self) -> str | None:
        """The one dtype of its tensors, None when empty or mixed."""
        return self.dtypes[0] if len(self.dtypes) == 1 else None


@dataclass(frozen=True)
class AttentionMaskFacts:
    """A 4D additive attention mask the user holds (``0`` where attention is allowed, a large negative elsewhere).

    ``dead_rows`` counts the query rows whose every entry is ``-inf`` (a left-padded row, where nothing is
    allowed, masked with ``torch.finfo(torch.float32).min`` then cast to fp16, which rounds it to ``-inf``):
    softmax over such a row is NaN in eager attention. ``neg_inf`` counts the ``-inf`` entries.
    """

    name: str
    ref: int
    dtype: str
    shape: tuple[int, ...]
    neg_inf: int
    dead_rows: int
