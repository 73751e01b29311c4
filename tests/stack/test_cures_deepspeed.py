"""DeepSpeed's fixed-in-place field cases, cured on the user's own failing step (``trainer.train()``, or building the
Trainer where accelerate refused it): once through ``fix.apply()``, once through the fix's button in the widget.

The same registry shape as ``tests/test_cures.py`` (``tests/cure.py``), in its own module because DeepSpeed
joins a one-rank process group for the module (the fixtures of ``test_deepspeed_configs.py``, imported here).
"""

from __future__ import annotations

import copy
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from cure import Case, Namespace, assert_broken, cure_through_api, cure_through_widget
from deepspeed_support import tiny_llama, token_dataset, training_args, zero_config
from transformers import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the DeepSpeed field tests' fixtures

from test_deepspeed_configs import (  # noqa: E402
    _no_deepspeed_env_leaks_between_tests,  # noqa: F401
    _onednn_fp16,
    one_rank_group,  # noqa: F401
)


def _on_the_bf16_grid(model: torch.nn.Module) -> torch.nn.Module:
    """The model's fp32 weights rounded to values bf16 holds exactly: the engine's cast of the module to bf16 then
    changes no weight, so a parameter that moved was moved by an optimizer step, not by that cast."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def _trainer_params(ns: Namespace) -> list[torch.Tensor]:
    return [p for p in ns["model"].parameters() if p.requires_grad]


def _train(ns: Namespace) -> float:
    # The user's own call; a step that raised leaves no Trainer state the next call reads.
    return ns["trainer"].train().training_loss


def _bf16_config_fp32_arguments() -> Namespace:
    cfg = zero_config(2, bf16={"enabled": True})  # GOT-OCR2.0's zero2.json, no --bf16 on the command line
    del cfg["fp16"]
    torch.manual_seed(0)
    model = _on_the_bf16_grid(tiny_llama())
    args = training_args(cfg, tempfile.mkdtemp(prefix="mpdoctor-cure-"))
    return {"trainer": Trainer(model=model, args=args, train_dataset=token_dataset()), "model": model}


def _fp16_config_fp16_false() -> Namespace:
    cfg = zero_config(2, fp16={"enabled": True})  # MedicalGPT's shipped json, fp16 set false by the user
    del cfg["bf16"]
    torch.manual_seed(0)
    model = _on_the_bf16_grid(tiny_llama())
    args = training_args(cfg, tempfile.mkdtemp(prefix="mpdoctor-cure-"))
    return {"trainer": Trainer(model=model, args=args, train_dataset=token_dataset()), "args": args, "model": model}


def _fp16_and_bf16_both() -> Namespace:
    # A refused Trainer leaves accelerate's process-wide state half set up: each build starts as a fresh process.
    AcceleratorState._reset_state(reset_partial_state=True)
    cfg = zero_config(2, fp16={"enabled": True}, bf16={"enabled": True})
    torch.manual_seed(0)
    return {"args": training_args(copy.deepcopy(cfg), tempfile.mkdtemp(prefix="mpdoctor-cure-"), bf16=True), "model": _on_the_bf16_grid(tiny_llama())}


def _fp16_where_deepspeed_has_none() -> Namespace:
    torch.manual_seed(0)
    model = _on_the_bf16_grid(tiny_llama())
    args = training_args(zero_config(2), tempfile.mkdtemp(prefix="mpdoctor-cure-"), fp16=True)
    return {"trainer": Trainer(model=model, args=args, train_dataset=token_dataset()), "model": model}


class _LossInMillions(torch.nn.Module):
    """A causal LM whose loss comes in a large unit (x1e6, a summed loss): its bf16 gradients pass fp16's 65504,
    as the gradients in DeepSpeed #2071 did."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = tiny_llama()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
        return {"loss": self.lm(input_ids=input_ids, labels=labels).loss * 1e6}


def _bf16_reduced_in_fp16() -> Namespace:
    # DeepSpeed #2071: bf16 training, gradients all-reduced in fp16 (``communication_data_type: "fp16"``).
    torch.manual_seed(0)
    model = _on_the_bf16_grid(_LossInMillions())
    args = training_args(zero_config(2, communication_data_type="fp16"), tempfile.mkdtemp(prefix="mpdoctor-cure-"), bf16=True)
    return {"trainer": Trainer(model=model, args=args, train_dataset=token_dataset()), "model": model}


def _step_skipped(ns: Namespace) -> None:
    engine = ns["trainer"].model_wrapped
    assert engine.communication_data_type == torch.float16 and engine.skipped_steps == 1, engine.skipped_steps


def _step_taken(ns: Namespace) -> None:
    engine = ns["trainer"].model_wrapped
    assert engine.communication_data_type == torch.float32 and engine.skipped_steps == 0, engine.skipped_steps


def _build_trainer_and_train(ns: Namespace) -> float:
    # Arctic-Platform PR #78: building the Trainer is the call that raised.
    trainer = Trainer(model=ns["model"], args=ns["args"], train_dataset=token_dataset())
    return trainer.train().training_loss


CASES: list[Case] = [
    Case(
        name="deepspeed-bf16-config-fp32-arguments", source="GOT-OCR2.0 #134", slug="deepspeed-precision-mismatch",
        build=_bf16_config_fp32_arguments, step=_train, params=_trainer_params,
        failure=r"ds bf16.enabled=True vs hf bf16\|bf16_full_eval=False",
    ),
    Case(
        name="deepspeed-fp16-config-fp16-false", source="MedicalGPT #191", slug="deepspeed-precision-mismatch",
        build=_fp16_config_fp16_false, step=_train, params=_trainer_params,
        failure=r"ds fp16.enabled=True vs hf fp16\|fp16_full_eval=False",
    ),
    Case(
        name="deepspeed-fp16-and-bf16-both-enabled", source="Arctic-Platform #78", slug="deepspeed-precision-mismatch",
        build=_fp16_and_bf16_both, step=_build_trainer_and_train, params=_trainer_params,
        failure="cannot be set to `bf16` when `fp16` is set in the DeepSpeed config",
    ),
    Case(
        name="deepspeed-bf16-gradients-reduced-in-fp16", source="DeepSpeed #2071", slug="deepspeed-low-precision-reduction",
        build=_bf16_reduced_in_fp16, step=_train, params=_trainer_params, failure="changed no parameter",
        harm=_step_skipped, healed=_step_taken,
    ),
    # DeepSpeed refuses fp16 only where torch's oneDNN has none (this machine; avx512_fp16 / AMX-FP16 CPUs have it):
    # where it has, the step does not fail and there is nothing to cure.
    *(
        []
        if _onednn_fp16()
        else [
            Case(
                name="deepspeed-fp16-unsupported-on-this-cpu", source="DeepSpeed `_do_sanity_check`",
                slug="deepspeed-precision-unsupported", build=_fp16_where_deepspeed_has_none, step=_train,
                params=_trainer_params, failure="Type fp16 is not supported on your device.",
            )
        ]
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_failing_step_fails_then_trains_after_the_planned_fix_applied_through_the_api(case: Case):
    assert_broken(case)
    cure_through_api(case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_failing_step_trains_after_the_planned_fix_is_clicked_in_the_widget(case: Case):
    cure_through_widget(case)
