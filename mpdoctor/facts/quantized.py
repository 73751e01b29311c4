"""Facts of weights stored in a format no matmul computes in: quantized or float8 storage, and what it computes in.

Plain data gathered by the bitsandbytes and torchao integrations and by the float8 storage reader
(:mod:`mpdoctor.libraries.torch.float8_storage`): a 4-bit / 8-bit bitsandbytes layer and the dtype its matmul
computes in, a module whose weights are held in float8 / float4 and what casts them up, a torchao quantized
weight tensor. The fp8 *training* recipes (compute in float8) are :mod:`mpdoctor.facts.fp8_training`.
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


#: Dtypes no matmul computes in directly (only scaled-mm kernels read them): a parameter in one is storage.
STORAGE_DTYPES = frozenset(
    {"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2"}
)

#: ``StoredLayer.upcast`` of a layer whose weights diffusers' layerwise casting (``enable_layerwise_casting``) casts up
#: before its forward and back down to storage after it.
LAYERWISE_UPCAST = "diffusers layerwise casting"


@dataclass(frozen=True)
class StoredLayer:
    """A module whose own weights are stored in float8 (or float4): what it stores and what it computes in.

    Attributes
    ----------
    path : str
        The module's dotted path inside the model.
    class_path : str
        The module's class.
    storage_dtype : str
        The float8 dtype its weights are held in (``float8_e4m3fn`` ...).
    params : tuple of str
        The names of its parameters in that dtype.
    trainable : bool
        Some of them require grad.
    upcast : str
        What casts them up before the math: ``"diffusers layerwise casting"``, ``"its own forward (cls)"``,
        ``"a forward pre-hook"``, ``"a patched forward (origin)"``; empty when nothing does (a stock torch
        layer whose forward feeds the float8 weight to the math as it is).
    compute_dtype : str or None
        The dtype the weights are cast to when the upcast says it (diffusers' ``compute_dtype``); None
        when it follows the input's dtype or is unknown.
    scaled : bool
        A per-tensor scale is kept beside the weight (a ``scale_weight`` / ``weight_scale`` buffer or
        parameter, as ComfyUI's and other scaled-fp8 checkpoints carry).
    emits_storage : bool
        A stock layer that returns rows of its weight as they are (``nn.Embedding``): its output is float8.
    """

    path: str
    class_path: str
    storage_dtype: str
    params: tuple[str, ...]
    trainable: bool
    upcast: str
    compute_dtype: str | None = None
    scaled: bool = False
    emits_storage: bool = False
    #: Elements of those weights, and how many sit at the format's largest finite value (e4m3: +-448, where
    #: an unscaled cast saturates) or are inf / NaN (e5m2 overflows to inf past 57344).
    elements: int = 0
    saturated: int = 0
    nonfinite: int = 0

    @property
    def computes_in(self) -> str:
        """What the layer's math runs in, in words."""
        if self.upcast:
            return self.compute_dtype or "the input's dtype (upcast before the math)"
        return self.storage_dtype


@dataclass(frozen=True)
class QuantizedWeight:
    """A layer whose weight is a torchao quantized tensor (``Float8Tensor``, ``MXTensor``, ``NVFP4Tensor`` ...).

    ``storage_dtype`` is the dtype of its element data (``float8_e4m3fn``, ``uint8`` for packed fp4);
    ``block_size`` the number of elements sharing one scale (32 for MX, 16 for NVFP4, 0 when per row or per
    tensor); ``nonfinite`` the NaN / inf elements in its float8 data (an all-zero row quantized with a zero
    scale is 0/0 = NaN).
    """

    path: str
    tensor_class: str
    storage_dtype: str
    block_size: int = 0
    elements: int = 0
    nonfinite: int = 0
    #: The activations are quantized too (``act_quant_kwargs``): the matmul is a block-scaled GEMM, which needs
    #: MX kernels (sm_100); weight-only formats dequantize and run anywhere.
    dynamic_activation: bool = False
    #: Of ``nonfinite``, the elements in blocks (rows) whose scale is 0: the block was all zeros before it was
    #: quantized (scale = amax / 448 = 0), so its value, 0, is known; the others are lost.
    zero_scale_nonfinite: int = 0
    #: How the activations' dynamic scales are taken (``"row"``, ``"tensor"``, ``""`` when they are not quantized).
    activation_granularity: str = ""
    #: The lower bound of an activation scale's amax (``hp_value_lb``; None: none). Without one, an all-zero row
    #: (per row; the whole input, per tensor) gets scale amax / 448 = 0 and quantizes to 0 / 0 = NaN.
    activation_floor: float | None = None
    #: The kernel torchao picks for the matmul of quantized activations and weight (``kernel_preference``):
    #: ``"auto"`` a hardware block-scaled GEMM, ``"emulated"`` both operands dequantized to a high-precision matmul,
    #: which runs anywhere; ``""`` where the weight picks none (NVFP4 always calls the GEMM).
    gemm: str = ""


@dataclass(frozen=True)
class AdapterConfigFacts:
    """A PEFT adapter config the user holds (``LoraConfig``), read from its fields.

    ``targets`` are its ``target_modules`` (names or a regex, as written); ``dora`` its ``use_dora``: DoRA computes
    the norm of each target's base weight (plus the adapter's delta) outside the layer's forward, when the adapter
    is created and at every forward.
    """

    name: str
    class_name: str
    dora: bool
    targets: tuple[str, ...] = ()

