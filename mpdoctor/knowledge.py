"""What mpdoctor knows about the world, in one place: model families, optimizer requirements, devices, layers.

Every table here cites its sources. Checks and facts read them; nothing else
holds a list of model types, optimizer classes or GPU capabilities.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# -- dtype names ----------------------------------------------------------------------------------------------

#: Terse dtype names for compact renderings (as lovely-tensors prints them).
SHORT_DTYPE = {
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float64": "f64",
    "float8_e4m3fn": "f8e4m3",
    "float8_e5m2": "f8e5m2",
    "int8": "i8",
    "uint8": "u8",
    "int32": "i32",
    "int64": "i64",
    "bool": "bool",
    "complex64": "c64",
    "complex128": "c128",
}


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

# -- optimizers -----------------------------------------------------------------------------------------------

def _always(_o: Any) -> bool:
    return True


def _kahan_requested(o: Any) -> bool:
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
    applies: Callable[[Any], bool] = _always
    grads_match_params: bool = False
    state_dtypes: frozenset[str] | None = None
    low_bit_from: int | None = None
    #: The parameter-dtype rule is the CUDA kernels' only: judged when the parameters are on a CUDA device or
    #: ``target=`` is a GPU. (bitsandbytes 0.50.2's CPU backend steps float64 parameters: measured.)
    params_rule_cuda_only: bool = False


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
        params_rule_cuda_only=True,
    ),
)



# -- devices --------------------------------------------------------------------------------------------------


#: What-if device profiles for ``target=``: GPU name -> (CUDA compute capability, memory in GiB). bf16 and TF32
#: tensor cores from sm_80 (Ampere), fp16 tensor cores from sm_70 (Volta), fp8 from sm_89 (NVIDIA's tables).
#: ``mpdoctor.facts.hardware`` turns them into DeviceProfiles (names matched case-insensitively), with "cpu".
GPU_PROFILES: dict[str, tuple[tuple[int, int], float]] = {
    "P100": ((6, 0), 16),
    "V100": ((7, 0), 16),
    "T4": ((7, 5), 15),
    "RTX2080": ((7, 5), 8),
    "A10G": ((8, 6), 24),
    "A100": ((8, 0), 80),
    "RTX3090": ((8, 6), 24),
    "L4": ((8, 9), 24),
    "RTX4090": ((8, 9), 24),
    "H100": ((9, 0), 80),
    "B200": ((10, 0), 192),
}

#: Compute capability from which GPUs run float8 GEMMs (``torch._scaled_mm``, TransformerEngine): Ada sm_89, Hopper.
FP8_GEMM_CAPABILITY = (8, 9)
#: Compute capability from which GPUs run block-scaled MXFP8 / NVFP4 GEMMs (Blackwell data-center sm_100).
MX_GEMM_CAPABILITY = (10, 0)
