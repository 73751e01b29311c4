"""Keep secrets out of everything mpdoctor shows.

Reports include environment variables only from :data:`ENV_ALLOWLIST`, and any
string taken from a user object passes through :func:`redact` before it is
stored in a fact, so no rendering or export can carry a token.
"""

from __future__ import annotations

import os
import re
from typing import Any

#: The only environment variables a report or ``env_report()`` may show.
ENV_ALLOWLIST = (
    "ACCELERATE_MIXED_PRECISION",
    "ACCELERATE_DOWNCAST_BF16",
    "ACCELERATE_USE_CPU",
    "ACCELERATE_USE_FSDP",
    "ACCELERATE_USE_DEEPSPEED",
    "ACCELERATE_DYNAMO_BACKEND",
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
    # Long runs mixing letters and digits (API keys, secrets) but not dotted paths or words.
    re.compile(r"(?<![A-Za-z0-9_./])(?=[A-Za-z0-9+/_\-]*\d)(?=[A-Za-z0-9+/_\-]*[A-Za-z])[A-Za-z0-9+/_\-]{32,}={0,2}"),
)

REDACTED = "[redacted]"


def redact(text: str) -> str:
    """Replace anything that looks like a token in ``text``."""
    for pattern in _TOKEN_PATTERNS:
        text = pattern.sub(REDACTED, text)
    return text


def safe_value(value: Any, limit: int = 200) -> Any:
    """A JSON-friendly, redacted, length-bounded copy of a scalar read from a user object."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    text = value if isinstance(value, str) else _short_repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return redact(text)


def _short_repr(value: Any) -> str:
    text = str(value) if type(value).__module__ == "torch" else None
    if text is not None:
        return text[6:] if text.startswith("torch.") else text
    try:
        return repr(value)
    except Exception:
        return f"<{type(value).__name__}>"


def allowed_env() -> dict[str, str]:
    """The allowlisted precision-related environment variables that are set, redacted."""
    return {k: redact(os.environ[k]) for k in ENV_ALLOWLIST if k in os.environ}
