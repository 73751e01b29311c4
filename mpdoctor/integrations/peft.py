"""PEFT: ``PeftModel`` and tuner wrappers around the base network; tuner layers that cast their input.

A LoRA ``Linear`` casts its input to the adapter's dtype and the sum back
(``_cast_input_dtype``), so fp32 adapters on a bf16 base are a legal mix:
:mod:`mpdoctor.checks.dtypes` reads ``casting_layers`` to tell them apart.
"""

from __future__ import annotations

from typing import Any

from ..live.introspect import is_a
from . import Integration, Unwrap

_PEFT_MODELS = ("peft.peft_model.PeftModel", "peft.mixed_model.PeftMixedModel", "peft.tuners.tuners_utils.BaseTuner")


def _model_facts(outer: Any, inner: Any, inner_path: str, live: Any) -> dict:
    return {"is_peft": is_a(outer, _PEFT_MODELS)}


INTEGRATION = Integration(
    name="peft",
    modules=("peft",),
    model_unwraps=(
        Unwrap("peft.peft_model.PeftModel", "base_model"),
        Unwrap("peft.mixed_model.PeftMixedModel", "base_model"),
        Unwrap("peft.tuners.tuners_utils.BaseTuner", "model"),
    ),
    casting_layers=("peft.tuners.tuners_utils.BaseTunerLayer",),
    model_facts=_model_facts,
)
