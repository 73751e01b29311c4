"""Facts of layers that compute in another format than their weights are stored in, and of model components.

Plain data gathered by the bitsandbytes, torchao and diffusers integrations
(:mod:`mpdoctor.integrations`): a 4-bit / 8-bit bitsandbytes layer and the dtype
its matmul computes in, a torchao float8 training layer with its recipe and
shape, the precision flags of a diffusers component's config.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LowBitLayer:
    """A bitsandbytes quantized linear layer.

    Attributes
    ----------
    path : str
        The module's dotted path inside the model.
    class_path : str
        ``bitsandbytes.nn.modules.Linear4bit`` ...
    bits : int
        4 or 8.
    compute_dtype : str or None
        ``Linear4bit.compute_dtype``: the dtype its forward casts the input and the dequantized weight to.
        None until the first forward sets it from the input (``compute_type_is_set`` False).
    compute_dtype_set : bool
        bitsandbytes' ``compute_type_is_set``: False means the first forward will pick the input's dtype.
    quant_type : str or None
        ``nf4`` / ``fp4`` (4-bit), None for 8-bit.
    quantized : bool
        The weight holds quantized data (``weight.quant_state`` for 4-bit, int8 data for 8-bit):
        False for a layer built but not yet moved to its device.
    storage_dtype : str or None
        The dtype the quantized weight is stored in (``uint8`` ...).
    """

    path: str
    class_path: str
    bits: int
    compute_dtype: str | None
    compute_dtype_set: bool
    quant_type: str | None
    quantized: bool
    storage_dtype: str | None = None


@dataclass(frozen=True)
class Float8Layer:
    """A torchao float8 training layer (``Float8Linear``).

    ``recipe`` is ``tensorwise``, ``rowwise`` or ``rowwise_with_gw_hp`` as read from ``module.config``;
    ``emulate`` is True when the layer emulates float8 matmuls (no hardware requirement then).
    """

    path: str
    in_features: int
    out_features: int
    recipe: str
    emulate: bool = False
    pad_inner_dim: bool = False


@dataclass(frozen=True)
class ComponentFacts:
    """A diffusers model component (UNet, transformer, VAE) and the precision flags of its config.

    ``flags`` are ``(key, value)`` pairs of the config keys that change precision
    (``force_upcast``, ``upcast_attention``, ...), present on the config.
    """

    class_path: str
    is_vae: bool
    flags: tuple[tuple[str, object], ...] = ()

    def flag(self, key: str, default: object = None) -> object:
        """The value of one flag."""
        return dict(self.flags).get(key, default)
