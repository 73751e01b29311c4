"""Facts of fp8 / MX training recipes: layers whose matmuls compute in float8, and the recipes that ask for it.

Plain data gathered by the torchao integration (a ``Float8Linear`` with its recipe and shape) and the
accelerate integration (the TransformerEngine recipe an accelerator holds, with the format TE will really
run). Weights merely *stored* in a low-bit format are :mod:`mpdoctor.facts.quantized`.
"""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(frozen=True)
class AORecipeFacts:
    """The torchao recipe an accelerator holds for ``mixed_precision="fp8"`` (``AORecipeKwargs``), as plain data.

    Attributes
    ----------
    owner : str
        The accelerator's name.
    accelerator_ref : int
        Its live ref: a fix converting layers reads the recipe's config from it when applied.
    user_filter : bool
        The handler holds the user's own ``module_filter_func``: the layers it left out were left out on purpose.
        False when accelerate's default filter ran (it skips the first and last Linear and dims not divisible
        by 16).
    recipe : str
        ``tensorwise`` / ``rowwise`` / ``rowwise_with_gw_hp`` / ``custom``, read from the handler's config.
    pad_inner_dim : bool
        The config pads the contraction dim to a multiple of 16.
    sharded : bool
        The accelerator shards or wraps parameters itself (FSDP, DeepSpeed, Megatron): a layer swap after
        ``prepare()`` would not reach its flat or sharded parameters.
    """

    owner: str
    accelerator_ref: int
    user_filter: bool
    recipe: str = "tensorwise"
    pad_inner_dim: bool = False
    sharded: bool = False
