"""TRL: ``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``, ``KTOTrainer``, ``RLOOTrainer`` and their configs.

TRL's trainers subclass transformers' ``Trainer`` (through ``trl.trainer.base_trainer._BaseTrainer``) and
its configs subclass ``TrainingArguments`` (through ``_BaseConfig``), so discovery already finds them as
trainers and arguments through the MRO, and their precision is read by the transformers integration.
Two things are TRL's own:

- its configs default ``bf16=None``, resolved in ``__post_init__`` to ``True`` when ``fp16`` is not set:
  a default ``SFTConfig()`` asks for bf16 mixed precision (on a CPU with ``use_cpu=True``: bf16 autocast,
  measured; on a GPU without bf16: transformers refuses it, "Your setup doesn't support bf16/gpu");
- preference and RL trainers bring a second model, the frozen reference (``trainer.ref_model``), whose
  log-probabilities enter the loss. It is ``None`` when the policy is a PEFT model (the reference is then
  the base model with adapters disabled) or when the loss needs none.

Every read of TRL's objects is here, guarded, and tested against the installed TRL (1.16).
"""

from __future__ import annotations

from typing import Any

from ...objects.integrations import Integration
from ...objects.live.introspect import is_a, raw_attr, type_name
from .facts import TrlFacts

BASE_TRAINER = "trl.trainer.base_trainer._BaseTrainer"
BASE_CONFIG = "trl.trainer.base_config._BaseConfig"
_PEFT_MODELS = ("peft.peft_model.PeftModel", "peft.mixed_model.PeftMixedModel")


def _trl_facts(subject: Any, subjects: tuple) -> TrlFacts:
    obj = subject.obj
    children = {s.name: s for s in subjects if s.owner == subject.name and s.kind == "model"}
    model_name = f"{subject.name}.model" if f"{subject.name}.model" in children else None
    ref_name = f"{subject.name}.ref_model" if f"{subject.name}.ref_model" in children else None
    args = raw_attr(obj, "args", None)
    return TrlFacts(
        name=subject.name,
        trainer_class=type_name(obj),
        config_class=type_name(args) if args is not None and is_a(args, (BASE_CONFIG,)) else None,
        model_name=model_name,
        ref_model_name=ref_name,
    )


def _setup_facts(subjects: tuple, hw: Any) -> dict:
    out = []
    for s in subjects:
        if s.kind == "trainer" and is_a(s.obj, (BASE_TRAINER,)):
            try:
                out.append(_trl_facts(s, subjects))
            except Exception:  # a half-built trainer: the rest of the report still stands
                continue
    return {"trl": tuple(out)} if out else {}


INTEGRATION = Integration(
    name="trl",
    modules=("trl",),
    brings=((BASE_TRAINER, ("ref_model",)),),
    facts=lambda subjects, live, hardware: _setup_facts(subjects, hardware),
)
