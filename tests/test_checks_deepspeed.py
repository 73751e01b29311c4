"""The DeepSpeed checks on facts built by hand: severity calibration, and what each one leaves alone.

No DeepSpeed here (this module also runs on Colab's stack); the real objects are in
``tests/stack/test_deepspeed_configs.py`` and ``tests/distributed/test_deepspeed_ranks.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

import mpdoctor
from mpdoctor.libraries.deepspeed.facts import DeepSpeedFacts
from mpdoctor.rules.checks import run_checks


def _run(*ds: DeepSpeedFacts) -> list:
    facts = dataclasses.replace(mpdoctor.diagnose().facts, deepspeed=ds)
    return [(f.severity, f.check) for f in run_checks(facts) if f.check.startswith("deepspeed-")]


def _config(**kw) -> DeepSpeedFacts:
    base = dict(name="args", source="training_args", config_path="args.hf_deepspeed_config", args_name="args",
                fp16=False, bf16=True, zero_stage=2, args_fp16=False, args_bf16=True, device_fp16=True, device_bf16=True)
    base.update(kw)
    return DeepSpeedFacts(**base)


def test_a_matching_bf16_zero2_config_is_only_information():
    assert _run(_config()) == [("info", "deepspeed-low-precision-reduction")]


def test_fp32_reduction_or_no_zero_draws_nothing():
    assert _run(_config(communication_data_type="float32")) == []
    assert _run(_config(zero_stage=0)) == []


def test_fp16_reduction_of_bf16_training_is_a_warning_even_without_zero():
    assert _run(_config(zero_stage=0, communication_data_type="float16")) == [("warning", "deepspeed-low-precision-reduction")]


@pytest.mark.parametrize(("fp16", "bf16", "args_fp16", "args_bf16"), [
    (False, True, False, False),  # bf16 in the config, fp32 in the arguments
    (False, True, True, False),   # bf16 in the config, fp16 in the arguments
    (True, True, False, True),    # both in the config
])
def test_config_precision_against_the_arguments_is_an_error(fp16, bf16, args_fp16, args_bf16):
    found = _run(_config(fp16=fp16, bf16=bf16, args_fp16=args_fp16, args_bf16=args_bf16, zero_stage=0))
    assert ("error", "deepspeed-precision-mismatch") in found


def test_auto_resolves_to_the_arguments():
    d = _config(fp16="auto", bf16="auto", args_fp16=False, args_bf16=True)
    assert d.precision == "bf16"
    assert ("error", "deepspeed-precision-mismatch") not in _run(d)


def test_bf16_engine_on_a_v100_is_refused_and_fp16_on_a_cpu_without_fp16():
    v100 = _config(source="engine", args_fp16=None, args_bf16=None, device_fp16=True, device_bf16=False, device="V100",
                   communication_data_type="float32")
    assert _run(v100) == [("error", "deepspeed-precision-unsupported")]
    cpu = _config(fp16=True, bf16=False, args_fp16=True, args_bf16=False, device_fp16=False, device_bf16=True,
                  communication_data_type="float32")
    assert _run(cpu) == [("error", "deepspeed-precision-unsupported")]


def test_loss_scale_collapse_waits_for_the_minimum_and_the_last_hysteresis():
    engine = dict(source="engine", fp16=True, bf16=False, args_fp16=None, args_bf16=None, dynamic_loss_scale=True,
                  min_loss_scale=1.0, communication_data_type="float32")
    assert _run(_config(**engine, loss_scale=4.0, loss_scale_hysteresis=1)) == []
    assert _run(_config(**engine, loss_scale=1.0, loss_scale_hysteresis=2)) == []
    assert _run(_config(**engine, loss_scale=1.0, loss_scale_hysteresis=1)) == [("error", "deepspeed-loss-scale-collapsed")]


def test_the_planned_fix_leaves_no_deepspeed_error():
    d = _config(fp16=False, bf16=True, args_bf16=False, config_ref=1, config_refs=(1,), mismatches=("- ds bf16.enabled=True vs hf bf16|bf16_full_eval=False",))
    facts = dataclasses.replace(mpdoctor.diagnose().facts, deepspeed=(d,))
    (finding,) = [f for f in run_checks(facts) if f.check == "deepspeed-precision-mismatch"]
    after = finding.fixes[0].changes[0].simulate(facts)
    assert not [f for f in run_checks(after) if f.severity == "error" and f.check.startswith("deepspeed-")]
