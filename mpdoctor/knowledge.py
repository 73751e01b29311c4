"""What mpdoctor knows about the world, in one place: model families, optimizer requirements, devices, layers.

Every table here cites its sources. Checks and facts read them; nothing else
holds a list of model types, optimizer classes or GPU capabilities.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .facts.hardware import DeviceProfile
    from .facts.optimizer import OptimizerFacts

# -- model families -------------------------------------------------------------------------------------------

#: Model types whose activations or gradients overflow fp16 (65504) in training, so that on a GPU
#: without bf16 the safe choice is fp32, not fp16 AMP. The one list mpdoctor keeps; cite it from here.
#: Sources: transformers issues #9295, #10830 (T5 / mT5 "inf in T5DenseReluDense"), #39972 (Gemma 3 fp16
#: NaN); Unsloth ``models/loader.py`` ``FORCE_FLOAT32`` (gemma3, gemma3_text, gemma3n, gemma4, glm4_moe,
#: gpt_oss, qwen3_5, qwen3_moe) and unsloth-zoo PRs #212 (falcon_h1) and #866; Gemma 2's logit
#: soft-capping was trained and is served in bf16.
FP16_OVERFLOW_MODEL_TYPES = frozenset(
    {
        "t5",
        "mt5",
        "umt5",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "gemma3n",
        "gemma3n_text",
        "gemma4",
        "gemma4_text",
        "glm4_moe",
        "gpt_oss",
        "qwen3_moe",
        "qwen3_5",
        "falcon_h1",
    }
)



#: Model types whose cached and uncached forwards take different code paths (recurrent
#: or hybrid state), where turning the cache off has been reported to change logits.
CACHE_CHANGES_LOGITS = frozenset(
    {"mamba", "mamba2", "falcon_mamba", "jamba", "zamba", "zamba2", "recurrent_gemma", "rwkv", "xlstm", "bamba"}
)



# -- layers ---------------------------------------------------------------------------------------------------

#: bitsandbytes 4-bit linear layers: their forward reads ``compute_dtype``.
LINEAR_4BIT_CLASSES = frozenset({"bitsandbytes.nn.modules.Linear4bit", "bitsandbytes.nn.modules.LinearNF4", "bitsandbytes.nn.modules.LinearFP4"})

# -- optimizers -----------------------------------------------------------------------------------------------

def _always(_o: OptimizerFacts) -> bool:
    return True


def _kahan_requested(o: OptimizerFacts) -> bool:
    return o.defaults.get("kahan_sum") is True


@dataclass(frozen=True)
class DtypeRequirement:
    """What one family of optimizers needs from the dtypes of its parameters, gradients and state.

    Attributes
    ----------
    name : str
        How messages call the optimizer.
    patterns : tuple of str
        ``fnmatch`` patterns on the optimizer's class path (``module.QualName``).
    param_dtypes : frozenset of str
        Dtypes the optimizer accepts for the parameters it updates (those with ``requires_grad``).
    severity : str
        Severity of a parameter outside ``param_dtypes``.
    consequence : str
        What happens then, in one clause.
    cast_to : str or None
        Dtype the fix casts offending parameters to; None: no cast is offered.
    applies : callable
        ``OptimizerFacts -> bool``: whether the requirement is in force (optimi's only with ``kahan_sum=True``).
    grads_match_params : bool
        The kernels read the parameter in the gradient's dtype, so the two must agree.
    state_dtypes : frozenset of str or None
        Dtypes allowed for full-size floating state tensors; None: anything.
    low_bit_from : int or None
        Parameters with at least this many elements should have low-bit (non-floating) state;
        floating full-size state there means the memory saving is not happening.
    """

    name: str
    patterns: tuple[str, ...]
    param_dtypes: frozenset[str]
    severity: str
    consequence: str
    cast_to: str | None
    applies: Callable[[OptimizerFacts], bool] = _always
    grads_match_params: bool = False
    state_dtypes: frozenset[str] | None = None
    low_bit_from: int | None = None


#: Optimizers with dtype requirements. Sources: adamw_bf16 0.0.3 (``AdamWBF16.step``: ``assert p.dtype ==
#: torch.bfloat16``), SimpleTuner's vendored copies, optimi's ``_init_state`` (Kahan buffers only for 16-bit
#: params), bitsandbytes ``optimizer_update_32bit`` / ``_8bit_blockwise`` (kernel chosen by the grad dtype).
REQUIREMENTS: tuple[DtypeRequirement, ...] = (
    DtypeRequirement(
        name="AdamWBF16",
        patterns=(
            "adamw_bf16.AdamWBF16",
            "adamw_bf16.*.AdamWBF16",
            "*adam_bfloat16*.AdamWBF16",
            "*adamw_bfloat16*.AdamWBF16",
        ),
        param_dtypes=frozenset({"bfloat16"}),
        severity="error",
        consequence="its first step() raises 'AssertionError: only bfloat 16 is supported.'",
        cast_to="bfloat16",
    ),
    DtypeRequirement(
        name="optimi with kahan_sum=True",
        patterns=("optimi.*",),
        param_dtypes=frozenset({"bfloat16", "float16"}),
        severity="warning",
        consequence=(
            "optimi applies Kahan summation only to bf16/fp16 parameters, so these train as plain fp32 "
            "(twice the weight memory the Kahan recipe is for)"
        ),
        cast_to="bfloat16",
        applies=_kahan_requested,
    ),
    DtypeRequirement(
        name="bitsandbytes 8-bit optimizer",
        patterns=("bitsandbytes.optim.*8bit*", "bitsandbytes.optim.*8Bit*"),
        param_dtypes=frozenset({"float32", "float16", "bfloat16"}),
        severity="error",
        consequence="its kernels raise 'Gradient+optimizer bit data type combination not supported'",
        cast_to="float32",
        grads_match_params=True,
        state_dtypes=frozenset({"float32"}),
        low_bit_from=4096,
    ),
)



# -- devices --------------------------------------------------------------------------------------------------


def device_profiles() -> dict[str, DeviceProfile]:
    """What-if profiles for ``target=`` (names matched case-insensitively), from NVIDIA's capability tables."""
    from .facts.hardware import DeviceProfile

    def _gpu(name: str, cap: tuple[int, int], memory: float) -> DeviceProfile:
        major = cap[0]
        return DeviceProfile(name, "cuda", cap, major >= 8, major >= 7, major >= 8, False, None, memory)

    return {
        "cpu": DeviceProfile("cpu", "cpu", None, True, False, False, False, None, None),
        "P100": _gpu("P100", (6, 0), 16),
        "V100": _gpu("V100", (7, 0), 16),
        "T4": _gpu("T4", (7, 5), 15),
        "RTX2080": _gpu("RTX2080", (7, 5), 8),
        "A10G": _gpu("A10G", (8, 6), 24),
        "A100": _gpu("A100", (8, 0), 80),
        "RTX3090": _gpu("RTX3090", (8, 6), 24),
        "L4": _gpu("L4", (8, 9), 24),
        "RTX4090": _gpu("RTX4090", (8, 9), 24),
        "H100": _gpu("H100", (9, 0), 80),
    }
