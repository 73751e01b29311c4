"""The batch at the model's boundary as plain data: each floating input, the layer that received it, their dtypes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchInput:
    """One floating tensor of the batch and the layer that received it.

    Attributes
    ----------
    key : str
        How the user names it: the dict key (``pixel_values``), ``batch[0]`` or ``input``.
    dtype : str
        Its dtype.
    layer, layer_class, layer_dtype : str or None
        The first module receiving it that holds floating weights of its own (path in the model, class,
        weight dtype); None when it reached no such module unchanged (the model cast or reshaped it first).
    model_dtype : str or None
        The dtype most of the model's floating parameters are in.
    nonfinite : int
        NaN values in it (counted only when the probe saw a non-finite value; a -inf mask is legitimate).
    """

    key: str
    dtype: str
    layer: str | None
    layer_class: str | None
    layer_dtype: str | None
    model_dtype: str | None
    nonfinite: int = 0

    @property
    def floating(self) -> bool:
        return self.dtype in ("float32", "float16", "bfloat16", "float64")

    @property
    def target(self) -> str | None:
        """The dtype the receiving layer computes in (the model's when no layer was reached)."""
        return self.layer_dtype or self.model_dtype

    def mismatched(self, autocast: str | None) -> bool:
        """True when nothing autocasts and the receiving layer computes in another dtype."""
        # A layer holding float8 weights computes in the dtype it upcasts them to, never in float8: its input is
        # not "in the wrong dtype" for being bf16 (the float8 checks read such storage).
        return (autocast is None and self.floating and self.target is not None and self.dtype != self.target
                and not self.target.startswith("float8"))
