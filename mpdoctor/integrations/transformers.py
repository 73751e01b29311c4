"""transformers: Trainer and TrainingArguments, PreTrainedModel configs.

A Trainer brings its model, optimizer, arguments, accelerator and scaler. A
PreTrainedModel adds its config tree (nested sub-configs and the generation
config, where ``use_cache``, the checkpoint dtype, the attention kernel and the
quantization config live) and ``_keep_in_fp32_modules``. TrainingArguments
state what precision is requested (``fp16`` / ``bf16`` / ``mixed_precision``).
"""

from __future__ import annotations

from typing import Any

from ..facts.configs import gather_configs
from ..introspect import is_a, raw_attr
from ..redact import safe_value
from . import Integration

TRAINER = "transformers.trainer.Trainer"
TRAINING_ARGS = "transformers.training_args.TrainingArguments"
PRETRAINED = "transformers.modeling_utils.PreTrainedModel"

#: TrainingArguments fields that say something about precision.
ARG_KEYS = (
    "fp16",
    "bf16",
    "fp16_full_eval",
    "bf16_full_eval",
    "tf32",
    "half_precision_backend",
    "use_cpu",
    "mixed_precision",
    "optim",
    "gradient_checkpointing",
    "deepspeed",
)


def _keep_in_fp32(module: Any) -> tuple[str, ...]:
    names: set[str] = set()
    for key in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        value = raw_attr(module, key, None)
        if isinstance(value, (list, tuple, set, frozenset)):
            names.update(v for v in value if isinstance(v, str))
    return tuple(sorted(names))


def _model_facts(outer: Any, inner: Any, inner_path: str, live: Any) -> dict:
    return {
        "configs": gather_configs(inner_path, inner, live),
        "is_pretrained": is_a(inner, (PRETRAINED,)),
        "keep_in_fp32": _keep_in_fp32(inner),
        "supports_sdpa": raw_attr(inner, "_supports_sdpa", True) is not False if is_a(inner, (PRETRAINED,)) else None,
    }


def requested(args: Any) -> dict:
    """The precision-related fields of a TrainingArguments, as plain values."""
    out = {}
    for key in ARG_KEYS:
        value = raw_attr(args, key, None)
        if value is not None:
            out[key] = safe_value(value)
    return out


INTEGRATION = Integration(
    name="transformers",
    modules=("transformers",),
    kinds=((TRAINER, "trainer"), (TRAINING_ARGS, "training_args")),
    brings=((TRAINER, ("model", "optimizer", "args", "accelerator", "scaler")),),
    model_facts=_model_facts,
    requested=requested,
)
