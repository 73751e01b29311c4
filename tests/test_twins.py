"""A code fix is run before it is shown: the corrected lines of the user's own AMP loop, on copies of the user's
objects, for a few optimizer steps (:mod:`mpdoctor.attach.runtime.twins`). In a real ``InteractiveShell``: the loop's real
mistake, ``%mpdoctor`` naming it with the corrected lines and what they did on the copies, the user's objects and
random streams untouched, then the corrected lines run by the user: they train as the trial said.
"""

from __future__ import annotations

import pytest
import torch
from notebook_shell import loaded_shell

from mpdoctor.attach.runtime.twins import TRIAL_STEPS, try_on_twins

pytestmark = pytest.mark.colab

SETUP = """
import torch
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
x = torch.randn(16, 8)
"""

# Clipping the scaled gradients: the clip sees them 65536 times too large, so the updates all but stop.
LOOP_CLIPS_SCALED = """
for _ in range(4):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = net(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
"""

# The scaler never updates: its second step raises "step() has already been called since the last update()".
LOOP_WITHOUT_UPDATE = """
for _ in range(4):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = net(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
"""

NAMES = ("torch", "net", "opt", "scaler", "x", "loss", "r", "_")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().view(torch.uint8)


def _state(ns: dict) -> dict:
    """What the trial must leave as it was: parameters and grads bit for bit, optimizer and scaler state, the
    random stream, the names bound."""
    net = ns["net"]
    return {
        "params": [_bits(p) for p in net.parameters()],
        "grads": [_bits(p.grad) if p.grad is not None else None for p in net.parameters()],
        "opt": repr(ns["opt"].state_dict()),
        "scaler": repr(ns["scaler"].state_dict()),
        "rng": _bits(torch.get_rng_state()),
        "names": {k: id(v) for k, v in ns.items() if not k.startswith("_") and k != "r"},
    }


def _same(a: dict, b: dict) -> bool:
    def eq(x, y):
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, list):
            return len(x) == len(y) and all(eq(i, j) for i, j in zip(x, y))
        return x == y

    differ = [k for k in a if not eq(a[k], b[k])]
    assert not differ, differ
    return True


def test_the_corrected_loop_runs_on_copies_before_it_is_shown_and_the_users_objects_stay_as_they_were():
    with loaded_shell(NAMES) as sh:
        sh.run_cell(SETUP, store_history=True)
        assert sh.run_cell(LOOP_CLIPS_SCALED, store_history=True).success
        before = _state(sh.user_ns)
        sh.run_cell("r = %mpdoctor --text", store_history=True)
        report = sh.user_ns["r"]
        assert _same(before, _state(sh.user_ns)), "the trial changed the user's objects or random stream"
        (finding,) = report.findings_for("amp-clip-before-unscale")
        (fix,) = [fx for fx in finding.fixes if "scaler.unscale_(opt)" in fx.code]
        (trial,) = [t for fx, t in report.trials if fx is fix]
        assert trial.ran and trial.trains and trial.steps == TRIAL_STEPS, trial
        assert trial.moved and trial.finite and len(trial.losses) == TRIAL_STEPS
        assert f"ran {TRIAL_STEPS} optimizer steps on copies of your objects: loss" in report.to_text()
        # The user runs the corrected lines: they train, as the copies did.
        params = [p.detach().clone() for p in sh.user_ns["net"].parameters()]
        assert sh.run_cell(fix.code, store_history=True).success
        after = list(sh.user_ns["net"].parameters())
        assert any(not torch.equal(a, b) for a, b in zip(params, after))
        assert all(torch.isfinite(p).all() for p in after)


def test_after_a_crash_mid_iteration_the_trial_runs_on_the_scaler_as_it_is_and_says_what_the_users_run_would_hit():
    """The twin of a GradScaler stopped between ``step()`` and ``update()`` is in that same stage (its pickling
    refuses it): the corrected loop, run on it, raises what it raises when the user runs it in this kernel."""
    with loaded_shell(NAMES) as sh:
        sh.run_cell(SETUP, store_history=True)
        failed = sh.run_cell(LOOP_WITHOUT_UPDATE, store_history=True)
        assert "step() has already been called since the last update()" in str(failed.error_in_exec)  # the real error
        sh.run_cell("r = %mpdoctor --text", store_history=True)
        report = sh.user_ns["r"]
        trials = [(fx, t) for fx, t in report.trials if "scaler.update()" in fx.code]
        assert trials, [fx.code for fx, _ in report.trials]
        fix, trial = trials[0]
        assert "step() has already been called since the last update()" in trial.error, trial
        again = sh.run_cell(fix.code, store_history=True)
        assert "step() has already been called since the last update()" in str(again.error_in_exec)
        # With a scaler built again (or updated once), the same corrected lines train, on copies and for real.
        sh.run_cell('scaler = torch.amp.GradScaler("cpu")', store_history=True)
        from mpdoctor.attach.runtime.twins import try_on_twins

        assert try_on_twins(fix.code, sh.user_ns).trains
        assert sh.run_cell(fix.code, store_history=True).success


def test_the_loop_as_it_was_does_not_train_on_copies_which_is_what_the_trial_would_say_of_it():
    """The trial can fail: the user's loop, as written, run on copies, raises the scaler's own error."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ns = {"torch": torch, "net": net, "opt": opt, "x": torch.randn(16, 8), "scaler": torch.amp.GradScaler("cpu")}
    wrong = try_on_twins(LOOP_WITHOUT_UPDATE, ns)
    assert not wrong.ran and not wrong.trains and "step() has already been called" in wrong.error, wrong
    assert wrong.steps == 1  # its first step was taken, on the copies
    corrected = LOOP_WITHOUT_UPDATE.replace("scaler.step(opt)\n", "scaler.step(opt)\n    scaler.update()\n")
    right = try_on_twins(corrected, ns)
    assert right.trains and right.steps == TRIAL_STEPS, right
    # At a scale where every fp16 step overflows, the scaler skips them all: the trial says no step was taken.
    ns["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0**120, growth_interval=10**6, backoff_factor=0.999)
    skipped = try_on_twins(corrected, ns)
    assert skipped.ran and skipped.steps == 0 and not skipped.trains and "took no optimizer step" in skipped.sentence()


def test_code_that_raises_or_cannot_run_on_copies_says_so():
    net = torch.nn.Linear(4, 4).to(torch.bfloat16)
    ns = {"torch": torch, "net": net, "x": torch.randn(2, 4)}
    raised = try_on_twins("y = net(x)", ns)
    assert not raised.ran and "mat1 and mat2 must have the same dtype" in raised.error
    assert raised.sentence().startswith("run on copies of your objects, this code raised RuntimeError")
    assert try_on_twins("get_ipython().run_line_magic('time', '1')", ns).refused.startswith("it runs IPython magics")
    assert "could not be read" in try_on_twins("for", ns).refused
    it = iter([1, 2])  # an open generator cannot be copied: the code is not run against the user's own
    gen = (i for i in it)
    assert "could not be copied" in try_on_twins("y = next(gen)", {"gen": gen}).refused
    assert next(gen) == 1


def test_objects_too_large_to_copy_are_not_copied(monkeypatch):
    import mpdoctor.attach.runtime.twins as twins

    monkeypatch.setattr(twins, "COPY_BUDGET_BYTES", 1024)
    ns = {"net": torch.nn.Linear(64, 64), "torch": torch}
    assert twins.try_on_twins("y = net(torch.ones(1, 64))", ns).refused.startswith("copying your objects would take")
