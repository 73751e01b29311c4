"""PEFT: ``PeftModel`` and tuner wrappers around the base network; tuner layers that cast their input.

A LoRA ``Linear`` casts its input to the adapter's dtype and the sum back
(``_cast_input_dtype``), so fp32 adapters on a bf16 base are a legal mix:
:mod:`mpdoctor.rules.checks.dtypes` reads ``casting_layers`` to tell them apart.
"""

from __future__ import annotations

from typing import Any

from ...facts.quantized import AdapterConfigFacts
from ...objects.integrations import Integration, Unwrap
from ...objects.live.introspect import is_a, raw_attr

_PEFT_MODELS = ("peft.peft_model.PeftModel", "peft.mixed_model.PeftMixedModel", "peft.tuners.tuners_utils.BaseTuner")


def _model_facts(outer: Any, inner: Any, inner_path: str, live: Any) -> dict:
    return {"is_peft": is_a(outer, _PEFT_MODELS)}


#: PEFT's adapter configs: read as subjects, so a check can judge an adapter before it is created.
_ADAPTER_CONFIGS = ("peft.tuners.lora.config.LoraConfig",)


def _adapter_configs(subjects: tuple, live: Any, hardware: Any) -> dict:
    out = []
    for s in subjects:
        if s.kind != "adapter_config":
            continue
        targets = raw_attr(s.obj, "target_modules", None)
        if isinstance(targets, str):
            targets = (targets,)
        out.append(AdapterConfigFacts(name=s.name, class_name=type(s.obj).__name__,
                                      dora=raw_attr(s.obj, "use_dora", False) is True,
                                      targets=tuple(sorted(str(t) for t in targets or ()))))  # fmt: skip
    return {"adapter_configs": tuple(out)} if out else {}


INTEGRATION = Integration(
    name="peft",
    modules=("peft",),
    kinds=tuple((c, "adapter_config") for c in _ADAPTER_CONFIGS),
    facts=_adapter_configs,
    model_unwraps=(
        Unwrap("peft.peft_model.PeftModel", "base_model"),
        Unwrap("peft.mixed_model.PeftMixedModel", "base_model"),
        Unwrap("peft.tuners.tuners_utils.BaseTuner", "model"),
    ),
    casting_layers=("peft.tuners.tuners_utils.BaseTunerLayer",),
    model_facts=_model_facts,
)
