"""Keep secrets out of everything mpdoctor shows.

Reports include environment variables only from :data:`ENV_ALLOWLIST`, and any
string taken from a user object passes through :func:`redact` before it is
stored in a fact, so no rendering or export can carry a token.
"""

from __future__ import annotations

import enum
import os
import re
import sys
from typing import Any

#: The only environment variables a report or ``env_report()`` may show.
ENV_ALLOWLIST = (
    "ACCELERATE_MIXED_PRECISION",
    "ACCELERATE_DOWNCAST_BF16",
    "ACCELERATE_USE_CPU",
    "ACCELERATE_USE_FSDP",
    "ACCELERATE_USE_DEEPSPEED",
    "ACCELERATE_DYNAMO_BACKEND",
    # What ``accelerate launch --mixed_precision fp8`` sets (accelerate.utils.launch.setup_fp8_env) and what its
    # recipe handlers read: backend names, formats, counts and booleans, never a path or a secret.
    "ACCELERATE_FP8_BACKEND",
    "ACCELERATE_FP8_FORMAT",
    "ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING",
    "ACCELERATE_FP8_AMAX_HISTORY_LEN",
    "ACCELERATE_FP8_AMAX_COMPUTE_ALGO",
    "ACCELERATE_FP8_MARGIN",
    "ACCELERATE_FP8_INTERVAL",
    "ACCELERATE_FP8_OVERRIDE_FPROP",
    "ACCELERATE_FP8_OVERRIDE_DGRAD",
    "ACCELERATE_FP8_OVERRIDE_WGRAD",
    "ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL",
    "ACCELERATE_FP8_OPT_LEVEL",
    "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER",
    "ACCELERATE_FP8_PAD_INNER_DIM",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "PYTORCH_CUDA_ALLOC_CONF",
    "TRANSFORMERS_OFFLINE",
    "HF_HUB_OFFLINE",
)

_TOKEN_PATTERNS = (
    re.compile(r"hf_[A-Za-z0-9]{16,}"),
    re.compile(r"sk-[A-Za-z0-9_\-]{16,}"),
    re.compile(r"(?:AKIA|ASIA)[A-Z0-9]{16}"),
    re.compile(r"gh[pousr]_[A-Za-z0-9]{20,}"),
    re.compile(r"xox[abposr]-[A-Za-z0-9\-]{10,}"),
)
# Long runs mixing letters and digits (API keys, secrets) but not dotted paths or words.
_GENERIC = re.compile(r"(?<![A-Za-z0-9_./])(?=[A-Za-z0-9+/_\-]*\d)(?=[A-Za-z0-9+/_\-]*[A-Za-z])[A-Za-z0-9+/_\-]{32,}={0,2}")
# Short words joined by - or _ (check slugs, parameter paths) are names, not secrets; UUID-like
# runs of hex segments and urlsafe base64 (long segments) stay redacted.
_WORDS = re.compile(r"[A-Za-z0-9]+(?:[-_][A-Za-z0-9]+)+")
_SEGMENT = re.compile(r"[-_]")
_NON_HEX_LETTER = re.compile(r"[g-zG-Z]")


def _generic(match: re.Match) -> str:
    text = match.group(0)
    if _WORDS.fullmatch(text):
        segments = _SEGMENT.split(text)
        if max(len(p) for p in segments) <= 12 and sum(bool(_NON_HEX_LETTER.search(p)) for p in segments) >= 2:
            return text
    return REDACTED

REDACTED = "[redacted]"


def redact(text: str) -> str:
    """Replace anything that looks like a token in ``text``."""
    for pattern in _TOKEN_PATTERNS:
        text = pattern.sub(REDACTED, text)
    return _GENERIC.sub(_generic, text)


def safe_value(value: Any, limit: int = 200) -> Any:
    """A JSON-friendly, redacted, length-bounded copy of a scalar read from a user object.

    Runs no user code: ``str`` subclasses are read as plain strings, numbers
    are copied, enums give their plain value, and any other object is shown by
    its class name rather than its (user-defined, possibly slow) ``repr``.
    """
    cls = type(value)
    if value is None or cls is bool or cls is float:
        return value
    if cls is int:
        return value if -(2**63) <= value < 2**63 else f"<int of {value.bit_length()} bits>"
    try:
        text = _short_repr(value)
    except Exception:
        text = "<?>"
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return redact(text)


_TYPE_MRO = type.__dict__["__mro__"].__get__
_TYPE_NAME = type.__dict__["__name__"].__get__
_TYPE_MODULE = type.__dict__["__module__"].__get__


def _has(mro: tuple, cls: type) -> bool:
    # ``cls in mro`` would call a metaclass's __eq__: identities only.
    return any(c is cls for c in mro)


def _short_repr(value: Any, depth: int = 0) -> str:
    cls = type(value)
    mro = _TYPE_MRO(cls)
    text = _scalar_repr(value, cls, mro, depth)
    if text is not None:
        return text
    if cls is torch_dtype_class() or cls is torch_device_class():
        text = str(value)
        return text[6:] if text.startswith("torch.") else text
    text = _container_repr(value, cls, depth)
    if text is not None:
        return text
    module = _TYPE_MODULE(cls)
    return f"<{module + '.' if type(module) is str and module != 'builtins' else ''}{_TYPE_NAME(cls)}>"


def _scalar_repr(value: Any, cls: type, mro: tuple, depth: int) -> str | None:
    """A string, enum member, number or None, read without its class's ``__repr__`` / ``__str__``; None for
    anything else."""
    if cls is str:
        return value if depth == 0 else repr(value)
    if _has(mro, enum.Enum):
        return _enum_repr(value, cls)
    if _has(mro, str):
        return str.__str__(value)
    if cls is int:
        return repr(value) if -(10**18) < value < 10**18 else f"<int of {value.bit_length()} bits>"
    if cls is float or cls is bool or value is None:
        return repr(value)
    if _has(mro, int) or _has(mro, float):
        return _short_repr(int.__int__(value) if _has(mro, int) else float.__float__(value), depth)
    return None


def _enum_repr(value: Any, cls: type) -> str:
    # OptimizerNames / PrecisionType are str enums: their plain value, not a user __repr__.
    member_value = object.__getattribute__(value, "_value_")
    if any(type(member_value) is t for t in (str, int, float, bool)):
        return str(member_value)
    return f"{_TYPE_NAME(cls)}.{object.__getattribute__(value, '_name_')}"


def _container_repr(value: Any, cls: type, depth: int) -> str | None:
    """A short plain list, tuple or dict, item by item; None for anything else (or too long, too deep)."""
    if depth >= 3 or not (cls is list or cls is tuple or cls is dict) or len(value) > 8:
        return None
    if cls is dict:
        pairs = (f"{_short_repr(k, depth + 1)}: {_short_repr(v, depth + 1)}" for k, v in dict.items(value))
        return "{" + ", ".join(pairs) + "}"
    inner = ", ".join(_short_repr(v, depth + 1) for v in value)
    return f"[{inner}]" if cls is list else f"({inner}{',' if len(value) == 1 else ''})"


def torch_dtype_class() -> type:
    """``torch.dtype`` when torch is imported, else a class nothing is an instance of."""
    torch = sys.modules.get("torch")
    return torch.dtype if torch is not None else _Never


def torch_device_class() -> type:
    """``torch.device`` when torch is imported, else a class nothing is an instance of."""
    torch = sys.modules.get("torch")
    return torch.device if torch is not None else _Never


class _Never:
    pass


def describe_exception(exc: BaseException, limit: int = 500) -> str:
    """``"TypeName: message"`` for any exception, even one whose ``__str__`` raises; redacted."""
    try:
        name = _TYPE_NAME(type(exc))
    except Exception:
        name = "Exception"
    try:
        text = str(exc)
        if type(text) is not str:
            text = ""
    except Exception:
        text = "<the exception's message could not be read>"
    text = f"{name}: {text}" if text else name
    return redact(text[:limit])


def allowed_env() -> dict[str, str]:
    """The allowlisted precision-related environment variables that are set, redacted."""
    return {k: redact(os.environ[k]) for k in ENV_ALLOWLIST if k in os.environ}


def _redacted_fix(fix: Any) -> Any:
    """``fix``, or another with its title and code redacted when they quote token-like text (a fix is a value)."""
    title, code = redact(fix.title), redact(fix.code)
    if (title, code) == (fix.title, fix.code):
        return fix
    return fix.replace(title=redact(fix._given_title), code=code)


def redact_finding(finding: Any) -> Any:
    """Redact token-like text in a finding at the source, so every export (to_frame too) is clean.

    Messages may quote user strings (an exception from a user's module, a config value).
    """
    try:
        finding.subject = redact(finding.subject)
        finding.message = redact(finding.message)
        finding.evidence = _redact_deep(finding.evidence)
        finding.fixes = [_redacted_fix(fix) for fix in finding.fixes]
    except Exception:  # a finding that cannot be redacted is still shown
        pass
    return finding


def _redact_deep(value: Any, depth: int = 0) -> Any:
    if type(value) is str:
        return redact(value)
    if depth > 6:
        return value
    if type(value) is dict:
        return {k: _redact_deep(v, depth + 1) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_redact_deep(v, depth + 1) for v in value)
    return value
