"""A fix is proven on the user's step: run before and after each planned fix, everything restored."""

from __future__ import annotations

import random

import pytest
import torch
from fingerprint import fingerprint, values_only

import mpdoctor

pytestmark = pytest.mark.colab


def _setup(head_dtype=torch.bfloat16, input_dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
    model[2].to(head_dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8, dtype=input_dtype)

    def train_step():
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    return model, opt, x, train_step


def test_the_failing_step_raises_then_the_planned_fix_is_verified_on_it_and_nothing_is_left_changed():
    model, opt, x, train_step = _setup()
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        train_step()  # the real error first
    ns = {"model": model, "opt": opt, "x": x}
    random.seed(1)
    before = values_only(fingerprint(ns))
    report = mpdoctor.diagnose(model, opt, step=train_step, names={id(model): "model", id(opt): "opt"})
    assert values_only(fingerprint(ns)) == before  # parameters, grads, optimizer state, RNG streams
    assert report.proof is not None and not report.proof.before.ran
    assert report.proof.after and report.proof.after[-1][1].trained
    fix = report.fixes[0]
    assert report.proof.label(fix).startswith("verified on your step")
    assert "Plan verified on your step (train_step())" in report.to_text()
    # the verified fix, applied for real, makes the user's own step run and train
    fix.apply()
    w = model[2].weight.detach().clone()
    loss = train_step()
    assert torch.isfinite(loss) and not torch.equal(model[2].weight.detach(), w)


def test_a_step_with_optimizer_state_and_randomness_is_restored_exactly():
    model, opt, x, train_step = _setup(head_dtype=torch.float32)
    for _ in range(2):
        train_step()  # Adam's moments exist, the RNG has moved
    model[2].to(torch.bfloat16)  # now it fails
    ns = {"model": model, "opt": opt, "x": x}
    before = values_only(fingerprint(ns))
    state = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    rng = torch.get_rng_state()
    report = mpdoctor.diagnose(model, opt, step=train_step)
    assert report.proof.after
    assert values_only(fingerprint(ns)) == before
    for k, v in opt.state[model[0].weight].items():
        assert torch.equal(v, state[k])
    # the step drew dropout masks three times; the stream is where it was
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_fix_that_leaves_the_failure_as_it_was_is_not_called_verified():
    # bf16 batch, fp32 body, bf16 head: casting the head to fp32 (the model's compute dtype) leaves the batch in
    # bf16, and the first Linear still raises. The cast stays offered (the head is a real mistake), but nothing
    # says it cures the step.
    model, opt, x, train_step = _setup(input_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype"):
        train_step()
    report = mpdoctor.diagnose(model, opt, step=train_step)
    cast = [fx for f in report.findings for fx in f.fixes if fx.changes]
    assert cast and all(report.proof.label(fx).startswith("not verified on your step: applied alone, it raised") for fx in cast)
    assert not report.proof.verified and not report.proof.plan.ran
    assert "Plan not verified on your step (train_step())" in report.to_text()
    assert model[2].weight.dtype == torch.bfloat16  # the trial was undone


def test_a_fix_that_breaks_a_step_that_trained_is_tried_not_planned():
    # The user's step feeds the bf16 head a bf16 input on purpose: it trains. Casting the head to fp32 (the
    # model's compute dtype) makes that step raise, so the proof takes the cast out of the plan and says why.
    model, opt, x, _ = _setup()

    def train_step():
        opt.zero_grad()
        h = model[1](model[0](x))
        loss = model[2](h.to(torch.bfloat16)).float().pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    report = mpdoctor.diagnose(model, opt, step=train_step)
    assert report.proof.before.trained
    tried = [fx for f in report.findings for fx in f.fixes if report.proof.label(fx).startswith("tried on your step")]
    assert tried and all("it raised RuntimeError" in report.proof.label(fx) for fx in tried)
    shown = [fx_view for f in report.view.data["findings"] for fx_view in f["fixes"]
             if fx_view["proof"].startswith("tried on your step")]  # fmt: skip
    assert len(shown) == len(tried) and all(not v["planned"] and v["note"].startswith("not planned: tried") for v in shown)
    assert all(fx not in report.fixes for fx in tried) and report.proof.dropped
    assert model[2].weight.dtype == torch.bfloat16  # the trial was undone


def test_without_a_step_the_report_says_its_fixes_are_not_verified():
    model, opt, _x, _step = _setup()
    text = mpdoctor.diagnose(model, opt).to_text()
    assert "Fixes not verified (no step held)" in text


def test_mpdoctor_step_in_a_notebook_checks_the_fixes_on_the_named_function(capsys):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "mpdoctor")
    try:
        shell.run_cell("""
import torch
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
net[1].to(torch.bfloat16)
adam = torch.optim.Adam(net.parameters())
batch = torch.randn(4, 8)
def one_step():
    adam.zero_grad()
    loss = net(batch).float().mean()
    loss.backward()
    adam.step()
    return loss
""", store_history=True)
        shell.run_cell("r = %mpdoctor net adam --step one_step --text", store_history=True)
        report = shell.user_ns["r"]
        assert report.proof is not None and report.proof.step == "one_step()"
        assert "Plan verified on your step (one_step())" in capsys.readouterr().out
        shell.run_cell("%mpdoctor net --step batch", store_history=True)
        assert "--step batch: give the name of a function" in capsys.readouterr().out
    finally:
        shell.run_line_magic("unload_ext", "mpdoctor")
        for name in ("net", "adam", "batch", "one_step", "r"):
            shell.user_ns.pop(name, None)


def test_a_held_step_that_must_not_be_replayed_is_not_run_and_every_rendering_says_why():
    from mpdoctor.diagnosis.proof import HeldStep

    model, opt, _x, train_step = _setup()
    runs = []
    held = HeldStep(lambda: runs.append(train_step()), "cell [7]",
                    refused="the cell reads a data iterator (next(...), line 1)")  # fmt: skip
    report = mpdoctor.diagnose(model, opt, step=held)
    assert runs == [] and report.proof.before is None and not report.proof.verified
    why = "Fixes not verified on your step (cell [7]): the cell reads a data iterator (next(...), line 1)."
    assert why in report.to_text() and "Fixes not verified on your step (cell [7])" in report.to_html()
    assert report.view.data["proof"]["refused"].startswith("the cell reads a data iterator")
    assert report.fixes and report.proof.label(report.fixes[0]) == ""  # the plan is still offered, unproven


def test_a_held_step_runs_inside_its_context_and_its_own_state_is_restored_after_every_run():
    from mpdoctor.diagnosis.proof import HeldStep

    model, opt, _x, train_step = _setup()
    log: list = []
    entered: list = []

    class LogState:
        def __init__(self):
            self.length = len(log)

        def restore(self):
            del log[self.length :]

    def step():
        log.append("ran")
        return train_step()

    import contextlib

    @contextlib.contextmanager
    def around():
        entered.append(True)
        yield

    report = mpdoctor.diagnose(model, opt, step=HeldStep(step, "the held step", around=around, state=LogState))
    assert report.proof.step == "the held step" and report.proof.verified
    assert log == [] and len(entered) == 1 + len(report.proof.after)  # before the fixes, then after each
