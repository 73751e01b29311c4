"""Field case 2 (ms-swift #3896): the precision in effect is not the precision asked for.

Reproduced on this CPU with a real Trainer: a stale ``ACCELERATE_MIXED_PRECISION`` overrides
``fp16=False``; ``fp16=True`` on a CPU silently trains fp32; and the hardware side, bf16 arguments on a
GPU without native bf16 (a ``target="T4"`` what-if). A forward hook on a Linear records the dtype it
computes in during a real ``trainer.train()`` step, before the fix (wrong) and after it (right).
"""

from __future__ import annotations

import os

import pytest
import torch
from setups import tiny_llama, tiny_trainer
from setups_precision import ENV, compute_dtypes, one_torch_thread  # noqa: F401 (one_torch_thread: autouse)
from steps import assert_step_trains, snapshot

import mpdoctor


def _train(trainer) -> tuple[set, float]:
    with compute_dtypes(trainer.model) as seen:
        loss = trainer.train().training_loss
    return set(seen), loss


def test_stale_fp16_env_turns_fp16_false_into_an_fp16_accelerator_and_the_fix_aligns_it():
    os.environ[ENV] = "fp16"  # left by a launcher or an earlier cell
    trainer = tiny_trainer(tiny_llama(use_cache=False), fp16=False)
    assert trainer.accelerator.mixed_precision == "fp16"  # the field case, reproduced
    (on_gpu,) = mpdoctor.diagnose(namespace={"trainer": trainer}, target="V100").findings_for("precision-override")
    assert on_gpu.severity == "error" and on_gpu.evidence["computes_in"] == "fp16"  # NaN territory on a V100
    report = mpdoctor.diagnose(namespace={"trainer": trainer})
    (finding,) = report.findings_for("precision-override")
    finding.fixes[0].apply()
    assert trainer.accelerator.mixed_precision == "no" and ENV not in os.environ
    assert not report.refresh().findings_for("precision-override")
    dtypes, loss = _train(trainer)
    assert dtypes == {torch.float32} and torch.isfinite(torch.tensor(loss))


def test_stale_bf16_env_computes_bf16_under_fp16_false_until_the_fix():
    os.environ[ENV] = "bf16"
    trainer = tiny_trainer(tiny_llama(use_cache=False), fp16=False)
    dtypes, _ = _train(trainer)
    assert dtypes == {torch.bfloat16}  # wrong: the arguments asked for fp32
    (finding,) = mpdoctor.diagnose(namespace={"trainer": trainer}).findings_for("precision-override")
    assert finding.severity == "error"
    finding.fixes[0].apply()  # the model was already prepared and wrapped: the fix unwraps it
    dtypes, loss = _train(trainer)
    assert dtypes == {torch.float32} and torch.isfinite(torch.tensor(loss))


def test_fp16_true_on_a_cpu_is_silently_fp32_until_the_fix_enables_fp16_autocast():
    trainer = tiny_trainer(tiny_llama(use_cache=False), fp16=True)
    assert trainer.accelerator.native_amp is False
    dtypes, _ = _train(trainer)
    assert dtypes == {torch.float32}  # wrong: the arguments asked for fp16
    report = mpdoctor.diagnose(namespace={"trainer": trainer})
    (finding,) = report.findings_for("precision-override")
    assert finding.severity == "error"
    finding.fixes[0].apply()
    dtypes, loss = _train(trainer)
    assert dtypes == {torch.float16} and torch.isfinite(torch.tensor(loss))
    assert trainer.optimizer.scaler is trainer.accelerator.scaler  # loss scaling, shared as accelerate does
    assert not report.refresh().findings_for("precision-override")


@pytest.mark.parametrize("target", ["T4", "V100"])
def test_hardware_side_bf16_arguments_on_a_t4_are_an_error_and_the_fix_switches_to_fp16_amp(target):
    """The fixed setup computes as the target GPU will: fp16 autocast (the hooked Linear computes in fp16) with a
    GradScaler shared by accelerator and optimizer, fp32 weights; and neither the target nor this machine's own
    diagnosis finds anything left to say about its precision."""
    trainer = tiny_trainer(tiny_llama(use_cache=False), bf16=True)
    report = mpdoctor.diagnose(namespace={"trainer": trainer}, target=target)
    (finding,) = report.findings_for("bf16-unsupported")
    assert finding.severity == "error" and "doesn't support bf16/gpu" in finding.message
    finding.fixes[0].apply()
    assert not report.refresh().findings_for("bf16-unsupported")
    assert (trainer.args.bf16, trainer.args.fp16) == (False, True)
    assert trainer.accelerator.mixed_precision == "fp16" and trainer.accelerator.native_amp
    params = list(trainer.model.parameters())
    before = snapshot(params)
    dtypes, loss = _train(trainer)
    assert dtypes == {torch.float16}  # fp16 AMP, what the target computes in
    assert trainer.optimizer.scaler is trainer.accelerator.scaler and trainer.accelerator.scaler.is_enabled()
    assert {p.dtype for p in params} == {torch.float32}  # fp32 master weights
    assert_step_trains(loss, before, params)
    for where in ({"target": target}, {}):  # the target and this CPU agree: no precision finding left
        found = mpdoctor.diagnose(namespace={"trainer": trainer}, **where).findings
        assert not [f for f in found if f.check in ("bf16-unsupported", "precision-override")], found


def test_a_clean_bf16_trainer_on_the_cpu_is_healthy_and_computes_bf16():
    trainer = tiny_trainer(tiny_llama(use_cache=False), bf16=True)
    report = mpdoctor.diagnose(namespace={"trainer": trainer})
    assert report.ok, [f.message for f in report.findings if f.severity != "info"]
    assert _train(trainer)[0] == {torch.bfloat16}
