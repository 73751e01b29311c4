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
    #: The weight's own dtype (what it stores: the high-precision master copy) and the float8 formats its
    #: matmuls compute in (``cast_config_*.target_dtype``): e4m3 inputs and weights, e5m2 output gradients.
    weight_dtype: str = "float32"
    input_dtype: str = "float8_e4m3fn"
    grad_dtype: str = "float8_e5m2"

    @property
    def computes_in(self) -> str:
        """What the matmuls compute in, in words (fp32 accumulation, as ``torch._scaled_mm`` does)."""
        return f"{self.input_dtype} x {self.input_dtype} forward, {self.grad_dtype} output grads, fp32 accumulation"


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


#: Dtypes no matmul computes in directly (only scaled-mm kernels read them): a parameter in one is storage.
STORAGE_DTYPES = frozenset(
    {"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2"}
)


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


#: Elements of one tensor read to estimate the share of lost bf16 updates (a strided view: no copy of the tensor).
UPDATE_SAMPLE = 65536


def bf16_update_loss(groups: list) -> tuple[int, int] | None:
    """``(elements read, elements whose Adam step of size lr rounds away in bf16)`` over trainable bf16 parameters.

    An Adam step moves a weight by about ``lr``; bf16 keeps 8 significant bits, so the step is lost (rounds back
    to the same value) when ``lr`` is below half a unit in the last place of the weight: for every weight with
    ``|w| >= 2 ** (floor(log2(lr)) + 9)``. Zero and small weights (LoRA adapters at init) keep their steps.
    Large tensors are read through a strided view of at most :data:`UPDATE_SAMPLE` elements. None when no param
    group has a numeric ``lr`` and a trainable bf16 parameter.
    """
    import math

    import torch

    read = lost = 0
    for group in groups:
        lr = group.get("lr") if isinstance(group, dict) else None
        if isinstance(lr, torch.Tensor):
            lr = float(lr) if lr.numel() == 1 else None
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or lr <= 0:
            continue
        threshold = 2.0 ** (math.floor(math.log2(lr)) + 9)
        for p in group.get("params", ()):
            if not isinstance(p, torch.Tensor) or p.dtype != torch.bfloat16 or not p.requires_grad:
                continue
            if p.device.type == "meta" or not p.numel():
                continue
            flat = p.detach().reshape(-1)  # a view for the contiguous parameters optimizers hold
            sample = flat[:: max(1, flat.numel() // UPDATE_SAMPLE)]
            read += sample.numel()
            lost += int((sample.abs() >= threshold).sum())
    return (read, lost) if read else None


@dataclass(frozen=True)
class FP8RecipeFacts:
    """A TransformerEngine fp8 recipe an accelerator holds (``TERecipeKwargs`` / ``FP8RecipeKwargs``), as plain data.

    Attributes
    ----------
    owner : str
        Where the recipe lives: ``accelerator.te_recipe_handler`` ...
    class_path : str
        The handler's class path.
    block_scaling : bool
        ``use_mxfp8_block_scaling``: TE builds ``MXFP8BlockScaling`` (32-element blocks, e8m0 scales) rather
        than ``DelayedScaling``.
    written_format : str or None
        ``fp8_format`` as the handler holds it (``HYBRID``, ``E4M3``, ``E5M2``), from the argument or from
        ``ACCELERATE_FP8_FORMAT``.
    passed_format : str or None
        What accelerate passes to TE's recipe: None when it passes nothing and TE's own default applies.
    runs_format : str or None
        The format TE's recipe will hold: ``E4M3`` (every tensor), ``HYBRID`` (e4m3 forward, e5m2 gradients).
    """

    owner: str
    class_path: str
    block_scaling: bool
    written_format: str | None
    passed_format: str | None
    runs_format: str | None
