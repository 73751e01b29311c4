"""Precision checks: the precision a Trainer computes in versus what its arguments ask; TF32."""

from __future__ import annotations

import os

import pytest
import torch
from setups import tiny_llama, tiny_trainer, training_args
from setups_precision import ENV, accelerate_snapshot, compute_dtypes, one_torch_thread  # noqa: F401 (one_torch_thread: autouse)

import mpdoctor
import mpdoctor.libraries.accelerate.integration as precision_module
from mpdoctor.objects.edits.torch_state import fp32_precisions, restore_fp32_precisions
from mpdoctor.rules.engine.fixes import FixFailed


def _trainer(env: str | None = None, prepared: bool = False, **kwargs):
    if env is not None:
        os.environ[ENV] = env
    trainer = tiny_trainer(tiny_llama(use_cache=False), **kwargs)
    if prepared:
        # What trainer.train() does first (cheaper than a full train): accelerate prepares, and maybe wraps,
        # the model and the optimizer; later train() calls reuse both as they are.
        trainer.model_wrapped, trainer.optimizer = trainer.accelerator.prepare(trainer.model, trainer.create_optimizer())
    return trainer


def _train(trainer) -> tuple[set, float]:
    with compute_dtypes(trainer.model) as seen:
        loss = trainer.train().training_loss
    return set(seen), loss


def _override(trainer, **kwargs):
    report = mpdoctor.diagnose(namespace={"trainer": trainer}, **kwargs)
    return report, report.findings_for("precision-override")


# -- (a) a stale ACCELERATE_MIXED_PRECISION -----------------------------------------------------------------


@pytest.mark.parametrize("prepared", [False, True], ids=["before-train", "already-prepared"])
def test_stale_bf16_env_makes_an_fp32_trainer_compute_bf16_and_the_fix_restores_fp32(prepared):
    trainer = _trainer("bf16", prepared, fp16=False)
    assert trainer.accelerator.mixed_precision == "bf16" and trainer.accelerator.native_amp
    report, (finding,) = _override(trainer)
    assert finding.severity == "error" and "ACCELERATE_MIXED_PRECISION=bf16" in finding.message
    (fix,) = finding.fixes
    assert not fix.safe
    fix.apply()
    assert ENV not in os.environ and trainer.accelerator.mixed_precision == "no"
    assert "_original_forward" not in trainer.model.__dict__
    assert not report.refresh().findings_for("precision-override")
    dtypes, loss = _train(trainer)
    assert dtypes == {torch.float32} and loss == loss


def test_stale_fp16_env_reproduces_and_on_this_cpu_is_a_warning_an_error_on_a_gpu_target():
    trainer = _trainer("fp16", fp16=False)
    assert trainer.args.mixed_precision == "fp16" and trainer.accelerator.mixed_precision == "fp16"
    assert trainer.accelerator.native_amp is False  # the CPU never autocasts fp16: compute stays fp32 here
    _, (finding,) = _override(trainer)
    assert finding.severity == "warning" and "later Trainer" in finding.message
    _, (on_t4,) = _override(trainer, target="T4")
    assert on_t4.severity == "error" and on_t4.evidence["computes_in"] == "fp16"
    finding.fixes[0].apply()
    assert trainer.accelerator.mixed_precision == "no" and trainer.args.mixed_precision == "no"
    assert ENV not in os.environ
    assert not _override(trainer, target="T4")[1]


def test_lone_training_arguments_built_under_a_stale_env_are_reported_and_fixed():
    os.environ[ENV] = "bf16"
    args = training_args(fp16=False)
    assert args.mixed_precision == "bf16"  # a Trainer built from these would autocast bf16
    report = mpdoctor.diagnose(namespace={"args": args})
    (finding,) = report.findings_for("precision-override")
    assert finding.severity == "error"
    finding.fixes[0].apply()
    assert args.mixed_precision == "no" and ENV not in os.environ
    assert not report.refresh().findings_for("precision-override")


def test_training_arguments_read_the_env_var_but_transformers_5_does_not_write_it_back():
    training_args(fp16=True)
    assert ENV not in os.environ  # so a stale value comes from a launcher, %env, or older transformers


# -- (b) fp16 asked on a CPU ----------------------------------------------------------------------------------


@pytest.mark.parametrize("prepared", [False, True], ids=["before-train", "already-prepared"])
def test_fp16_on_cpu_is_silently_fp32_and_the_first_fix_enables_real_fp16_autocast(prepared):
    trainer = _trainer(None, prepared, fp16=True)
    assert trainer.accelerator.native_amp is False  # the harm is measured in test_field_case_2_precision_override
    report, (finding,) = _override(trainer)
    assert finding.severity == "error" and "silently fp32" in finding.message
    enable, honest = finding.fixes
    assert not enable.safe and not honest.safe
    enable.apply()
    assert trainer.accelerator.native_amp is True and trainer.accelerator.scaler is not None
    if prepared:  # the same optimizer object now shares the new scaler
        assert trainer.optimizer.scaler is trainer.accelerator.scaler
    assert not report.refresh().findings_for("precision-override")
    dtypes, loss = _train(trainer)
    assert dtypes == {torch.float16} and torch.isfinite(torch.tensor(loss))


def test_fp16_on_cpu_second_fix_makes_the_arguments_say_what_runs():
    trainer = _trainer(None, fp16=True)
    report, (finding,) = _override(trainer)
    finding.fixes[1].apply()
    assert trainer.args.fp16 is False and trainer.args.mixed_precision == "no"
    assert trainer.accelerator.mixed_precision == "no" and trainer.accelerator.native_amp is False
    assert not report.refresh().findings_for("precision-override")


# -- the fix contract: exact undo, idempotence, atomicity, pasteable code -------------------------------------


@pytest.mark.parametrize(
    ("env", "kwargs", "which"),
    [("bf16", {"fp16": False}, 0), (None, {"fp16": True}, 0), (None, {"fp16": True}, 1)],
    ids=["stale-env", "enable-fp16", "say-fp32"],
)
def test_precision_fixes_undo_exactly_and_apply_idempotently_on_a_prepared_trainer(env, kwargs, which):
    trainer = _trainer(env, True, **kwargs)
    before = accelerate_snapshot(trainer)
    report, (finding,) = _override(trainer)
    fix = finding.fixes[which]
    fix.apply()
    after_once = accelerate_snapshot(trainer)
    fix.apply()
    assert accelerate_snapshot(trainer) == after_once
    again = report.refresh().findings_for("precision-override")
    assert not again
    fix.undo()
    assert accelerate_snapshot(trainer) == before


def test_a_precision_fix_that_fails_half_way_leaves_everything_as_before(monkeypatch):
    trainer = _trainer("bf16", True, fp16=False)
    before = accelerate_snapshot(trainer)
    (fix,) = _override(trainer)[1][0].fixes

    def broken(model, d):
        raise RuntimeError("simulated failure while unwrapping forward")

    monkeypatch.setattr(precision_module, "_unwrap", broken)
    with pytest.raises(FixFailed, match="simulated failure"):
        fix.apply()
    assert accelerate_snapshot(trainer) == before and not fix.applied


def test_precision_fix_code_is_pasteable_and_has_the_same_effect():
    trainer = _trainer("bf16", True, fp16=False)
    (fix,) = _override(trainer)[1][0].fixes
    exec(fix.code, {"trainer": trainer})
    assert ENV not in os.environ and trainer.accelerator.mixed_precision == "no"
    assert not _override(trainer)[1]
    assert _train(trainer)[0] == {torch.float32}


def test_enable_fp16_fix_code_is_pasteable_and_has_the_same_effect_on_a_prepared_trainer():
    trainer = _trainer(None, True, fp16=True)
    enable = _override(trainer)[1][0].fixes[0]
    exec(enable.code, {"trainer": trainer})
    assert not _override(trainer)[1]
    dtypes, loss = _train(trainer)
    assert dtypes == {torch.float16} and torch.isfinite(torch.tensor(loss))


# -- healthy controls -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{"bf16": True}, {}], ids=["bf16", "fp32"])
def test_a_clean_environment_trainer_is_healthy(kwargs):
    trainer = _trainer(None, **kwargs)
    report = mpdoctor.diagnose(namespace={"trainer": trainer})
    assert report.ok, [f.message for f in report.findings if f.severity != "info"]
    assert not report.findings_for("precision-override")


# -- tf32-off -----------------------------------------------------------------------------------------------


def _tf32_state():
    return torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32, fp32_precisions()


def test_tf32_off_is_info_on_an_ampere_target_and_its_fix_is_reversible():
    before = _tf32_state()
    assert before[:2] == ("highest", False)
    report = mpdoctor.diagnose(tiny_llama(use_cache=False), target="A100")
    (finding,) = report.findings_for("tf32-off")
    assert finding.severity == "info" and report.ok
    (fix,) = finding.fixes
    assert not fix.safe
    try:
        fix.apply()
        fix.apply()
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cuda.matmul.allow_tf32
        assert not report.refresh().findings_for("tf32-off")
        fix.undo()
        assert _tf32_state() == before  # including torch 2.9+'s per-backend fp32_precision
        exec(fix.code, {})  # pasteable: the same call
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before[0])
        restore_fp32_precisions(before[2])
    assert _tf32_state() == before


@pytest.mark.parametrize("target", [None, "T4", "V100"])
def test_tf32_off_is_silent_where_there_are_no_tf32_tensor_cores(target):
    assert not mpdoctor.diagnose(tiny_llama(use_cache=False), target=target).findings_for("tf32-off")


def test_tf32_off_is_silent_for_half_precision_setups_and_when_tf32_is_on():
    trainer = _trainer(None, bf16=True)
    assert not mpdoctor.diagnose(namespace={"trainer": trainer}, target="A100").findings_for("tf32-off")
    assert not mpdoctor.diagnose(tiny_llama(torch.bfloat16), target="A100").findings_for("tf32-off")
    before = _tf32_state()
    try:
        torch.set_float32_matmul_precision("high")
        assert not mpdoctor.diagnose(tiny_llama(), target="H100").findings_for("tf32-off")
    finally:
        torch.set_float32_matmul_precision(before[0])
        restore_fp32_precisions(before[2])
