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

from .catalogue import FAMILIES, Family
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
    kind : str
        ``"dtype"``, ``"protocol"``, ``"refusal"`` (the catalogue's families) or ``""``.
    cast : str
        How the fixing cast is chosen (:mod:`mpdoctor.attach.crash.catalogue`), for dtype families.
    rule : str
        The GradScaler rule broken, for protocol families.
    code : str
        The fix as a code template (``{src}``, ``{dst}``, ``{dtype}``, ``{scaler}``, ``{optimizer}``).
    """

    slug: str
    exception_types: tuple[str, ...]
    message: re.Pattern
    checks: tuple[str, ...]
    meaning: str
    fix: str
    scan: bool = False
    kind: str = ""
    cast: str = ""
    rule: str = ""
    code: str = ""


def _p(slug: str, types: tuple[str, ...], regex: str, checks: tuple[str, ...], meaning: str, fix: str,
       scan: bool = False) -> Pattern:  # fmt: skip
    return Pattern(slug, types, re.compile(regex), checks, meaning, fix, scan)


def _from_family(f: Family) -> Pattern:
    regex = "|".join(f"(?:{m})" for m in f.messages)
    return Pattern(f.slug, f.exception_types, re.compile(regex), f.checks, f.cause, f.fix, f.scan, f.kind, f.cast,
                   f.protocol_rule, f.code)  # fmt: skip


#: The catalogue's families (``docs/exception-families.md``) first, then the other known failures.
PATTERNS: tuple[Pattern, ...] = tuple(_from_family(f) for f in FAMILIES) + (
    _p(
        "crash-grad-dtype",
        ("builtins.RuntimeError",),
        r"attempting to assign a gradient with dtype .+ to a tensor with (?:grad_)?dtype",  # torch 2.4 says "dtype", 2.13 "grad_dtype"
        ("grad-dtype-mismatch", "mixed-param-dtypes"),
        "A gradient was assigned in another dtype than its parameter (code that casts .grad to fp32 or bf16 "
        "after backward, or a parameter cast without its grad).",
        "Keep each .grad in its parameter's dtype: cast parameters together with their grads.",
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
        "crash-sampling-nonfinite",
        ("builtins.RuntimeError",),
        r"probability tensor contains either `?inf`?, `?nan`? or element < 0",
        ("probe-nonfinite", "probe-generation-nonfinite", "nonfinite-values"),
        "Sampling (torch.multinomial, what generate(do_sample=True) runs) was given NaN/Inf probabilities: the "
        "model's logits held NaN/Inf at that decoding step. A model trained in bf16 and run in fp16 does this when "
        "an activation passes fp16's 65504 (greedy search then repeats token 0 instead of raising); so do weights "
        "that hold NaN.",
        "Run the generation probe on the prompt to name the first module out of range: "
        "mpdoctor.probe(model, prompt, generate=True), or %mpdoctor model --probe prompt --generate 8; then "
        "generate in bf16 (fp32's range) or keep that module in fp32.",
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


def checks_explaining(slug: str) -> tuple[str, ...]:
    """The check slugs whose findings explain the exceptions of pattern ``slug``, most specific first (none for an
    unknown slug)."""
    return next((p.checks for p in PATTERNS if p.slug == slug), ())


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
