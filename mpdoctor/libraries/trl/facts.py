"""TRL setup facts: which TRL trainer and config, its policy model and the reference model it brings.

The reads of TRL's objects live in :mod:`mpdoctor.libraries.trl.integration`; this module holds plain data.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrlFacts:
    """One TRL trainer (``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer`` ...).

    Attributes
    ----------
    name : str
        The trainer as the user holds it.
    trainer_class : str
        ``DPOTrainer``, ``SFTTrainer`` ...
    config_class : str or None
        ``SFTConfig``, ``DPOConfig`` ... (TRL's configs default ``bf16=True`` when ``fp16`` is not set).
    model_name : str or None
        The policy model subject (``trainer.model``).
    ref_model_name : str or None
        The reference model subject (``trainer.ref_model``); None when the trainer has none (SFT, or a
        PEFT policy whose reference is the base model with adapters disabled).
    """

    name: str
    trainer_class: str
    config_class: str | None = None
    model_name: str | None = None
    ref_model_name: str | None = None
