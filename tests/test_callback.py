"""MPDoctorCallback inside a real Trainer: silent on a healthy run, precise on a broken one."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from setups import tiny_gemma3, tiny_llama, tiny_trainer

import mpdoctor
from mpdoctor.attach.training.callback_state import MPDoctorAbort


def _train(model, callback, **kwargs):
    trainer = tiny_trainer(model, **kwargs)
    trainer.add_callback(callback)
    return trainer, trainer.train()


def test_a_healthy_run_stays_silent_and_leaves_no_hook_behind(caplog, capsys):
    model = tiny_llama(use_cache=False)
    hooks = (dict(model._forward_pre_hooks), dict(model._forward_hooks))
    callback = mpdoctor.MPDoctorCallback()
    with caplog.at_level(logging.INFO, logger="mpdoctor"):
        _train(model, callback, max_steps=2)
    assert callback.start_report is not None and callback.start_report.ok
    assert callback.events == [] and callback.probe_report is None
    assert [r for r in caplog.records if r.name == "mpdoctor"] == []
    assert "mpdoctor" not in capsys.readouterr().out
    assert (dict(model._forward_pre_hooks), dict(model._forward_hooks)) == hooks


def test_an_inf_injected_in_a_weight_is_caught_at_the_first_step_and_attributed_to_its_module(caplog, capsys):
    model = tiny_llama(use_cache=False)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = math.inf
    callback = mpdoctor.MPDoctorCallback()
    with caplog.at_level(logging.WARNING, logger="mpdoctor"):
        _train(model, callback, max_steps=2)
    assert callback.events[0]["event"] == "nonfinite-loss" and callback.events[0]["step"] == 1
    assert len(callback.events) == 1  # the first failure only
    (finding,) = callback.probe_report.findings_for("probe-nonfinite")
    assert finding.subject == "model.model.layers.1.mlp.down_proj"
    assert finding.evidence["weight_nonfinite"] == 1
    # Shown through logging in a script, through IPython's display where a shell exists (as in this test session).
    shown = "\n".join(r.getMessage() for r in caplog.records if r.name == "mpdoctor") + capsys.readouterr().out
    assert "at step 1" in shown and "model.model.layers.1.mlp.down_proj" in shown


def test_stop_on_nonfinite_stops_before_the_optimizer_writes_nan_into_the_weights():
    model = tiny_llama(use_cache=False)
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight[1, 2] = -math.inf
    before = {k: v.clone() for k, v in model.state_dict().items()}
    callback = mpdoctor.MPDoctorCallback(stop_on_nonfinite=True)
    with pytest.raises(MPDoctorAbort, match="before the optimizer step") as stopped:
        _train(model, callback, max_steps=2)
    assert stopped.value.report.findings_for("probe-nonfinite")[0].subject == "model.model.layers.0.self_attn.o_proj"
    after = model.state_dict()
    assert all(torch.equal(before[k].nan_to_num(), after[k].nan_to_num()) for k in before)
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_stop_on_error_stops_before_the_first_step_with_the_report_as_message():
    model = tiny_gemma3(torch.float16, text_use_cache=False)  # a bf16-native family in fp16 weights
    steps = []
    model.register_forward_pre_hook(lambda *a: steps.append(1))
    callback = mpdoctor.MPDoctorCallback(stop_on_error=True)
    with pytest.raises(MPDoctorAbort, match="before the first step") as stopped:
        _train(model, callback, max_steps=1)
    assert "fp16-overflow-risk" in str(stopped.value)
    assert stopped.value.report.findings_for("fp16-overflow-risk")[0].severity == "error"
    assert steps == []  # not one forward ran
