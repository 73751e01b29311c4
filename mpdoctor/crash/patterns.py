"""Known mixed-precision exceptions: which checks explain them and what they mean.

Each pattern matches the exception's exact class (by name, read through
``type``'s descriptors) and its message against the text the library really
raises; every pattern has a test that raises that error from real objects.
Messages are read from ``BaseException.args`` only when the argument is a
plain ``str``, so matching never runs an exception's own ``__str__``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .frames import class_path

#: How many links of ``__cause__`` / ``__context__`` are followed to find a known exception.
CHAIN_DEPTH = 8


@dataclass(frozen=True)
class Pattern:
    """One known failure.

    Attributes
    ----------
    slug : str
        Stable name, also the check slug of the cause note (``crash-matmul-dtype``).
    exception_types : tuple of str
        Class paths the exception must be exactly (``builtins.RuntimeError``).
    message : re.Pattern
        Searched in the exception message.
    checks : tuple of str
        Check slugs whose findings explain this exception, most specific first.
    meaning : str
        What the error means in mixed-precision terms.
    fix : str
        The generic fix, for when no finding names the objects.
    scan : bool
        Diagnose with a value scan (the failure is about values, not dtypes).
    """

    slug: str
    exception_types: tuple[str, ...]
    message: re.Pattern
    checks: tuple[str, ...]
    meaning: str
    fix: str
    scan: bool = False


def _p(slug: str, types: tuple[str, ...], regex: str, checks: tuple[str, ...], meaning: str, fix: str,
       scan: bool = False) -> Pattern:  # fmt: skip
    return Pattern(slug, types, re.compile(regex), checks, meaning, fix, scan)


_DTYPE_CHECKS = ("mixed-param-dtypes", "probe-dtype-error", "load-dtype-mismatch", "grad-dtype-mismatch")
_DTYPE_FIX = (
    "Give both operands one dtype: cast the module to the input's dtype (or the input to the module's), "
    "or run the forward under torch.autocast so mixed dtypes are cast per operation."
)

PATTERNS: tuple[Pattern, ...] = (
    _p(
        "crash-matmul-dtype",
        ("builtins.RuntimeError",),
        r"mat1 and mat2 must have the same dtype|expected m1 and m2 to have the same dtype"
        r"|self and mat2 must have the same dtype|expected mat1 and mat2 to have the same dtype"
        r"|expected scalar type \w+ but found \w+",
        _DTYPE_CHECKS,
        "A matrix multiply (Linear, matmul, bmm, addmm) met two dtypes: usually a half-precision weight fed "
        "fp32 activations, or an fp32 adapter or head on a bf16/fp16 model, without autocast.",
        _DTYPE_FIX,
    ),
    _p(
        "crash-conv-dtype",
        ("builtins.RuntimeError",),
        r"Input type \(.+?\) and (?:weight|bias) type \(.+?\) should be the same",
        _DTYPE_CHECKS,
        "A convolution's input and its weight or bias have different dtypes (a half-precision conv fed fp32, "
        "or the reverse) without autocast.",
        _DTYPE_FIX,
    ),
    _p(
        "crash-norm-dtype",
        ("builtins.RuntimeError",),
        r"mixed dtype \(\w+\): expect parameter to have scalar type of \w+",
        _DTYPE_CHECKS,
        "A normalisation layer's parameters and its input have different dtypes (a half-precision LayerNorm "
        "fed fp32, or norms kept in fp32 on purpose but fed half outside autocast).",
        _DTYPE_FIX,
    ),
    _p(
        "crash-rnn-dtype",
        ("builtins.ValueError",),
        r"RNN input dtype \(.+?\) does not match weight dtype",
        _DTYPE_CHECKS,
        "A recurrent layer's weights and its input have different dtypes.",
        _DTYPE_FIX,
    ),
    _p(
        "crash-attention-dtype",
        ("builtins.RuntimeError",),
        r"Expected query, key, and value to have the same dtype",
        _DTYPE_CHECKS,
        "scaled_dot_product_attention got query, key and value in different dtypes: one projection runs in "
        "another precision than the others.",
        _DTYPE_FIX,
    ),
    _p(
        "crash-grad-dtype",
        ("builtins.RuntimeError",),
        r"attempting to assign a gradient with dtype .+ to a tensor with grad_dtype",
        ("grad-dtype-mismatch", "mixed-param-dtypes"),
        "A gradient was assigned in another dtype than its parameter (code that casts .grad to fp32 or bf16 "
        "after backward, or a parameter cast without its grad).",
        "Keep each .grad in its parameter's dtype: cast parameters together with their grads.",
    ),
    _p(
        "crash-unscale-fp16",
        ("builtins.ValueError",),
        r"Attempting to unscale FP16 gradients",
        ("fp16-trainable-params-with-scaler",),
        "A GradScaler was asked to unscale gradients of fp16 parameters. Loss scaling needs fp32 master "
        "weights: fp16 belongs in autocast, not in the trainable parameters.",
        "Cast the trainable parameters (with their grads and optimizer state) to fp32 and keep fp16 in "
        "torch.autocast; or drop the scaler if the run is meant to be pure half precision.",
    ),
    _p(
        "crash-scaler-bf16",
        ("builtins.RuntimeError", "torch.AcceleratorError"),
        r"_amp_foreach_non_finite_check_and_unscale\w* ?\"? not implemented for 'BFloat16'",
        ("scaler-with-bf16",),
        "A GradScaler unscaled bf16 gradients; this CUDA kernel has no bf16 version, and bf16 needs no loss "
        "scaling at all.",
        "Disable the scaler for bf16 (GradScaler(enabled=False), or set enabled on the live one).",
    ),
    _p(
        "crash-bf16-only-optimizer",
        ("builtins.AssertionError",),
        r"only bfloat ?16 is supported",
        ("optimizer-dtype-requirement",),
        "A bf16-only optimizer (AdamWBF16) holds parameters that are not bf16, typically fp32 LoRA adapters.",
        "Cast the optimizer's parameters to bf16 in place (keeping the optimizer's references), or use an "
        "optimizer that accepts fp32.",
    ),
    _p(
        "crash-cache-float",
        ("builtins.AttributeError",),
        r"'\w*Cache\w*' object has no attribute 'float'",
        ("cache-in-training", "gradient-checkpointing-with-cache"),
        "accelerate's fp32 output conversion treated a KV cache object (it has a .dtype) as a tensor: the "
        "model returned a cache in a training forward under mixed precision.",
        "Turn the cache off for training: model.config.use_cache = False, and the nested "
        "config.text_config.use_cache too on multimodal models.",
    ),
    _p(
        "crash-anomaly-nonfinite",
        ("builtins.RuntimeError",),
        r"Function '\w+' returned (?:nan|inf) values in its \d+\w* output",
        ("nonfinite-values", "probe-nonfinite", "probe-overflow", "fp16-overflow-risk", "scaler-scale-collapsed"),
        "Anomaly mode caught a backward function producing NaN/Inf: values overflowed (fp16's range ends at "
        "65504) or were already non-finite in the weights or inputs.",
        "Probe the failing batch (mpdoctor.probe(model, batch)) to name the first layer that overflows; bf16 "
        "or fp32 for that part, or a GradScaler with fp16, usually fixes it.",
        scan=True,
    ),
    _p(
        "crash-fsdp-uniform-dtype",
        ("builtins.ValueError",),
        r"Must flatten tensors with uniform dtype",
        ("mixed-param-dtypes", "load-dtype-mismatch"),
        "FSDP flattens each wrapped unit's parameters into one tensor, so they must share one dtype; the "
        "module mixes dtypes (e.g. fp32 adapters on a bf16 base).",
        "Cast the module to one dtype before wrapping and express precision with FSDP's MixedPrecision "
        "(param_dtype / reduce_dtype), or wrap the differently-typed parts as their own units.",
    ),
    _p(
        "crash-deepspeed-loss-scale",
        ("builtins.Exception",),
        r"Current loss scale already at minimum",
        ("deepspeed-loss-scale-collapsed", "scaler-scale-collapsed", "nonfinite-values", "fp16-overflow-risk"),
        "DeepSpeed's fp16 loss scaler kept overflowing until the scale hit its minimum: the values overflow "
        "fp16 whatever the scale, often a bf16-trained checkpoint run in fp16.",
        "Train in bf16 (or fp32) instead of fp16 where the hardware allows, or find the overflowing layer "
        "with mpdoctor.probe.",
        scan=True,
    ),
    _p(
        "crash-bf16-unsupported",
        ("builtins.ValueError",),
        r"Your setup doesn't support bf16/gpu",
        ("bf16-unsupported",),
        "transformers refused bf16=True: this machine has no bf16-capable GPU (a CPU-only machine, or a "
        "GPU older than Ampere).",
        "Use fp16=True with fp32 weights on a pre-Ampere GPU, use_cpu=True on a CPU, or run on an Ampere+ GPU.",
    ),
    _p(
        "crash-fp16-and-bf16",
        ("builtins.ValueError",),
        r"At most one of fp16 and bf16 can be True",
        ("precision-override",),
        "Both fp16 and bf16 were requested; a run computes in one half precision.",
        "Keep bf16=True on Ampere+ GPUs and fp16=True on older ones, not both.",
    ),
    _p(
        "crash-deepspeed-config-mismatch",
        ("builtins.ValueError",),
        r"DeepSpeed config values that mismatch TrainingArguments values:(?s:.)*- ds (fp16|bf16)\.enabled=",
        ("deepspeed-precision-mismatch",),
        "The DeepSpeed config enables a precision the TrainingArguments do not ask for (or the reverse); the HF "
        "integration refuses to start the engine.",
        "Set the config's fp16/bf16 'enabled' to \"auto\" (or to what the arguments say) before trainer.train().",
    ),
    _p(
        "crash-deepspeed-precision-unsupported",
        ("builtins.ValueError",),
        r"Type (fp16|bf16) is not supported on your device",
        ("deepspeed-precision-unsupported",),
        "DeepSpeed's accelerator refuses this precision on this device (fp16 on a CPU without oneDNN fp16, bf16 "
        "below compute capability 8.0).",
        "Train in the precision the device has (bf16 on a CPU or Ampere+, fp16 on a V100/T4), in the arguments "
        "and the DeepSpeed config together.",
    ),
)


def exception_message(exc: BaseException) -> str | None:
    """The message of ``exc`` when it is a single plain string argument; None otherwise (never calls ``__str__``)."""
    try:
        args = BaseException.__dict__["args"].__get__(exc)
    except Exception:
        return None
    if type(args) is tuple and len(args) == 1 and type(args[0]) is str:
        return args[0]
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` then the exceptions it was raised from or during, innermost last, each once."""
    out: list[BaseException] = []
    cause_of = BaseException.__dict__["__cause__"].__get__
    context_of = BaseException.__dict__["__context__"].__get__
    current: BaseException | None = exc
    while current is not None and len(out) < CHAIN_DEPTH and all(current is not e for e in out):
        out.append(current)
        try:
            current = cause_of(current) or context_of(current)
        except Exception:
            break
    return out


def match_exception(exc: BaseException) -> tuple[Pattern, BaseException] | None:
    """The pattern that ``exc`` (or an exception it was raised from) matches, with that exception.

    Parameters
    ----------
    exc : BaseException
        Any exception; only its class path and string arguments are read.

    Returns
    -------
    (Pattern, BaseException) or None
        None for an exception that is not a known mixed-precision failure.
    """
    for link in _chain(exc):
        path = class_path(type(link))
        message = exception_message(link)
        if message is None:
            continue
        for pattern in PATTERNS:
            if path in pattern.exception_types and pattern.message.search(message):
                return pattern, link
    return None
