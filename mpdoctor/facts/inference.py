"""Facts of what a user holds to generate with: KV caches (transformers ``DynamicCache``, ``StaticCache``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheFacts:
    """A KV cache the user holds, read from its stored key / value tensors.

    ``dtypes`` are the floating dtypes of the tensors it stores (empty for a cache no forward has filled
    yet: it takes the model's dtype at its first update). ``static`` is True for a preallocated cache
    (``StaticCache``) that copies new keys into its tensors with ``index_copy_``, which refuses another dtype;
    a dynamic cache concatenates, which promotes.
    """

    name: str
    ref: int
    class_name: str
    dtypes: tuple[str, ...]
    tensors: int
    bytes: int
    static: bool

    @property
    def dtype(self) -> str | None:
        """The one dtype of its tensors, None when empty or mixed."""
        return self.dtypes[0] if len(self.dtypes) == 1 else None
