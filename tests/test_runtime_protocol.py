"""The GradScaler protocol, watched: each loop mistake's real error or measured harm, then the finding naming
the user's line, then the corrected loop training. Real GradScalers on the CPU: ``torch.amp.GradScaler("cpu")``
scales for real (fp16 autocast on the CPU overflows and skips steps, as on a GPU)."""

from __future__ import annotations

import copy
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

import mpdoctor
from mpdoctor import compat
from mpdoctor.attach.runtime import protocol as protocol_module
from mpdoctor.attach.runtime.protocol import ProtocolObserver
from mpdoctor.attach.runtime.protocol_rules import corrected_template
from mpdoctor.attach.training.script_runner import run_script
from mpdoctor.facts.location import cell_number

HERE = Path(__file__)


def line_of(marker: str) -> str:
    """``file:line`` of the line of this file holding ``marker`` (what a finding must name)."""
    for number, text in enumerate(HERE.read_text().splitlines(), 1):
        if marker in text and "line_of(" not in text:
            import os

            rel = os.path.relpath(HERE)
            return f"{rel if not rel.startswith('..') else HERE}:{number}"
    raise AssertionError(marker)


def make(init_scale: float = 1024.0, seed: int = 0, opt: str = "sgd"):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = (torch.optim.SGD(model.parameters(), lr=0.05) if opt == "sgd"
                 else torch.optim.Adam(model.parameters(), lr=1e-2))  # fmt: skip
    return model, optimizer, torch.amp.GradScaler("cpu", init_scale=init_scale)


X = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
Y = torch.randn(32, 1, generator=torch.Generator().manual_seed(2))


def loss_fn(model, x=X, y=Y):
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    return F.mse_loss(out.float(), y)


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def changed(before, model):
    return any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def checks(w) -> list[str]:
    return [f.check for f in w.protocol.findings]


def finding(w, slug):
    (f,) = [f for f in w.protocol.findings if f.check == slug]
    return f


def correct_loop(model, opt, scaler, steps=5, clip=None):
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model)
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(opt)
            clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
    return loss


def assert_trains(model, opt, scaler, clip=None):
    before = params_of(model)
    with mpdoctor.watch(model, opt, scaler) as w:
        loss = correct_loop(model, opt, scaler, clip=clip)
    assert torch.isfinite(loss) and changed(before, model)
    assert checks(w) == []
    return w


# -- gradients clipped while still scaled -----------------------------------------------------------------------


def grad_norm(model) -> float:
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))


def test_clipping_before_unscale_shrinks_every_step_to_max_norm_over_scale_and_is_named_at_its_line():
    model, opt, scaler = make()
    # Harm, measured: the same batch, clipped after unscale_ (the recipe) vs before.
    good, good_scaler = copy.deepcopy(model), torch.amp.GradScaler("cpu", init_scale=1024.0)
    good_opt = torch.optim.SGD(good.parameters(), lr=0.05)
    good_scaler.scale(loss_fn(good)).backward()
    good_scaler.unscale_(good_opt)
    true_norm = grad_norm(good)
    clip_grad_norm_(good.parameters(), 1.0)
    assert true_norm > 1.0 and grad_norm(good) == pytest.approx(1.0, rel=1e-4)

    with mpdoctor.watch(model, opt, scaler) as w:
        scaler.scale(loss_fn(model)).backward()
        clip_grad_norm_(model.parameters(), 1.0)  # wrong: clipped while scaled
        scaler.step(opt)  # unscales what was clipped
        scaler.update()
    # The gradients the step applied had a norm of max_norm / scale, not max_norm.
    assert grad_norm(model) == pytest.approx(1.0 / 1024, rel=1e-3)
    f = finding(w, "amp-clip-before-unscale")
    assert f.severity == "error" and f.evidence["where"] == line_of("# wrong: clipped while scaled")
    assert f.evidence["code"] == "clip_grad_norm_(model.parameters(), 1.0)  # wrong: clipped while scaled"
    assert "max_norm / scale = 0.000977" in f.message
    assert f.fixes and f.fixes[0].code == corrected_template("amp-clip-before-unscale", "scaler", "opt")  # the names the loop holds them by
    assert "amp-clip-before-unscale" in [x.check for x in w.report.findings]
    assert_trains(*make(), clip=1.0)


def test_clipping_is_caught_however_clip_grad_norm_was_imported():
    model, opt, scaler = make()
    with mpdoctor.watch(model, opt, scaler) as w:
        scaler.scale(loss_fn(model)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    assert checks(w) == ["amp-clip-before-unscale"]


# -- optimizer.step() bypassing scaler.step ------------------------------------------------------------------------


def test_optimizer_step_bypassing_the_scaler_multiplies_the_update_by_the_scale():
    model, opt, scaler = make()
    reference = copy.deepcopy(model)
    ref_opt, ref_scaler = torch.optim.SGD(reference.parameters(), lr=0.05), torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = params_of(model)
    ref_scaler.scale(loss_fn(reference)).backward()
    ref_scaler.step(ref_opt)
    ref_scaler.update()
    with mpdoctor.watch(model, opt, scaler) as w:
        scaler.scale(loss_fn(model)).backward()
        opt.step()  # wrong: bypasses scaler.step
    # Measured: each weight moved 1024 (the scale) times as far as the scaler's step moves it.
    moved = torch.cat([(p - b).flatten() for p, b in zip(model.parameters(), before)])
    right = torch.cat([(p - b).flatten() for p, b in zip(reference.parameters(), before)])
    assert torch.allclose(moved, right * 1024, rtol=0.05, atol=1e-3)  # fp16 backward rounding
    f = finding(w, "amp-step-bypasses-scaler")
    assert f.evidence["where"] == line_of("# wrong: bypasses scaler.step") and "1024 times too large" in f.message
    assert f.subject == "opt"  # the name the loop holds it by
    assert_trains(*make())


# -- unscale_ twice before update() (gradient accumulation) -------------------------------------------------------


def test_unscale_per_micro_batch_is_explained_before_gradscalers_own_runtime_error():
    model, opt, scaler = make()
    seen_while_no_exception: list[bool] = []
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called on this optimizer since the last update"):
        with mpdoctor.watch(model, opt, scaler) as w:
            w.protocol.on_finding = lambda f: seen_while_no_exception.append(sys.exc_info()[0] is None)
            for i in range(4):
                scaler.scale(loss_fn(model) / 2).backward()
                scaler.unscale_(opt)  # wrong: once per micro-batch
                clip_grad_norm_(model.parameters(), 1.0)
                if (i + 1) % 2 == 0:
                    scaler.step(opt)
                    scaler.update()
    f = finding(w, "amp-unscale-twice")
    assert f.evidence["where"] == line_of("# wrong: once per micro-batch") and seen_while_no_exception == [True]
    # The corrected accumulation loop (PyTorch's recipe) trains and draws nothing.
    model, opt, scaler = make()
    before = params_of(model)
    with mpdoctor.watch(model, opt, scaler) as w:
        for i in range(4):
            loss = loss_fn(model) / 2
            scaler.scale(loss).backward()
            if (i + 1) % 2 == 0:
                scaler.unscale_(opt)
                clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    assert checks(w) == [] and torch.isfinite(loss) and changed(before, model)
    assert [r.step for r in w.scale_history] == [1, 2]


# -- a step with no update(), update() per micro-batch -------------------------------------------------------------


def test_a_step_with_no_update_raises_at_the_next_step_and_is_named_first():
    model, opt, scaler = make()
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update"):
        with mpdoctor.watch(model, opt, scaler) as w:
            for _ in range(2):
                opt.zero_grad()
                scaler.scale(loss_fn(model)).backward()
                scaler.step(opt)  # wrong: no update() after it
    assert finding(w, "amp-update-missing").evidence["where"] == line_of("# wrong: no update() after it")
    assert_trains(*make())


def test_a_loop_that_never_updates_is_named_when_the_watch_ends():
    model, opt, scaler = make()
    with mpdoctor.watch(model, opt, scaler) as w:
        scaler.scale(loss_fn(model)).backward()
        scaler.step(opt)
    assert checks(w) == ["amp-update-missing"]


def test_update_per_micro_batch_is_explained_before_gradscalers_assertion():
    model, opt, scaler = make()
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
        with mpdoctor.watch(model, opt, scaler) as w:
            for i in range(4):
                scaler.scale(loss_fn(model) / 2).backward()
                if (i + 1) % 2 == 0:
                    scaler.step(opt)
                scaler.update()  # wrong: per micro-batch
    f = finding(w, "amp-update-per-microbatch")
    assert f.severity == "error" and f.evidence["where"] == line_of("# wrong: per micro-batch")
    assert_trains(*make())


# -- the LR scheduler on skipped steps -----------------------------------------------------------------------------


def warmup_run(step_scheduler_on_skips: bool):
    # init_scale 2**30: fp16 backward overflows until the scale falls under ~2**16, as a fresh GPU run does.
    model, opt, scaler = make(init_scale=2.0**30)
    sched = LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    with mpdoctor.watch(model, opt, scaler) as w:
        for _ in range(30):
            opt.zero_grad()
            scaler.scale(loss_fn(model)).backward()
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if step_scheduler_on_skips:
                sched.step()  # wrong: also on skipped steps
            elif scaler.get_scale() >= before:
                sched.step()
    return w, sched


def test_the_scheduler_stepping_on_skipped_steps_runs_the_warmup_ahead_of_the_optimizer():
    with pytest.warns(UserWarning, match=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`"):
        w, sched = warmup_run(step_scheduler_on_skips=True)
    skipped = sum(r.skipped for r in w.scale_history)
    assert skipped >= 5  # measured: the scale fell from 2**30 to where the fp16 backward fits
    # Harm: the schedule advanced 30 times, the optimizer only 30 - skipped: warm-up ended `skipped` steps early.
    assert sched.last_epoch == 30 and sum(not r.skipped for r in w.scale_history) == 30 - skipped
    f = finding(w, "amp-scheduler-on-skipped-steps")
    assert f.severity == "warning" and f.evidence["where"] == line_of("# wrong: also on skipped steps")
    w, sched = warmup_run(step_scheduler_on_skips=False)
    assert checks(w) == [] and sched.last_epoch == sum(not r.skipped for r in w.scale_history)


# -- a scale that never settles --------------------------------------------------------------------------------------


class TwoBranches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.good = torch.nn.Linear(8, 1)
        self.bad = torch.nn.Linear(8, 1)

    def forward(self, x, z):
        return self.good(x), self.bad(z)


def test_a_scale_that_never_settles_is_named_with_the_parameters_whose_gradients_overflow():
    torch.manual_seed(0)
    model = TwoBranches()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with mpdoctor.watch(model, opt, scaler) as w:
        for i in range(30):
            # Every other batch carries values past fp16's 65504 into the bad branch: inf whatever the scale.
            z = X[:, :8] * (1e5 if i % 2 else 1.0)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                a, b = model(X, z)
            loss = F.mse_loss(a.float(), Y) + F.mse_loss(b.float(), Y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    # Harm, measured by the optimizer itself: Adam took 15 of 30 steps, and the scale collapsed.
    assert int(opt.state[model.good.weight]["step"]) == 15
    assert scaler.get_scale() < 1024.0 * 2.0**-10
    f = finding(w, "amp-scale-unsettled")
    assert set(f.evidence["overflow_params"]) == {"model.bad.weight", "model.bad.bias"}
    assert "model.bad.weight" in f.message and "model.good" not in f.message


# -- a resumed run whose scaler was not restored ----------------------------------------------------------------------


def settle(steps=40):
    # A loss whose fp16 backward overflows above a scale of ~2**9: the run settles there.
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(steps):
        resume_step(model, opt, scaler)
    return {"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}


def resume_step(model, opt, scaler):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.ones(8, 8)).sum() * 16
    scaler.scale(loss).backward()
    before = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    return scaler.get_scale() < before  # skipped


def resumed(ckpt, restore_scaler: bool):
    model = torch.nn.Linear(8, 1)
    model.load_state_dict(ckpt["model"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt.load_state_dict(ckpt["opt"])
    scaler = torch.amp.GradScaler("cpu")
    if restore_scaler:
        scaler.load_state_dict(ckpt["scaler"])
    return model, opt, scaler


def test_a_resumed_run_without_the_scaler_state_skips_its_first_steps_and_is_caught_before_and_at_the_first_step():
    ckpt = settle()
    assert ckpt["scaler"]["scale"] < 2.0**16
    model, opt, scaler = resumed(ckpt, restore_scaler=False)
    names = {id(model): "model", id(opt): "opt", id(scaler): "scaler"}
    # Statically, before any step runs.
    (f,) = mpdoctor.diagnose(model, opt, scaler, names=names).findings_for("scaler-not-restored-on-resume")
    real_steps = int(ckpt["opt"]["state"][0]["step"])  # Adam counts the steps it took (skipped ones are not)
    assert f.severity == "warning" and f.evidence["optimizer_steps"] == real_steps > 0
    assert f.fixes[0].applicability.value == "display-only" and "scaler.load_state_dict" in f.fixes[0].code
    # Harm, measured: the first steps after resume are skipped while the scale falls back.
    with mpdoctor.watch(model, opt, scaler) as w:
        skipped = [resume_step(model, opt, scaler) for _ in range(10)]
    assert sum(skipped) >= 3 and skipped[0]
    assert finding(w, "scaler-not-restored-on-resume").evidence["optimizer_steps"] == real_steps
    # Restored: nothing skipped, nothing found, the weights move.
    model, opt, scaler = resumed(ckpt, restore_scaler=True)
    assert mpdoctor.diagnose(model, opt, scaler).findings_for("scaler-not-restored-on-resume") == []
    before = params_of(model)
    with mpdoctor.watch(model, opt, scaler) as w:
        skipped = [resume_step(model, opt, scaler) for _ in range(10)]
    assert sum(skipped) == 0 and checks(w) == [] and changed(before, model)


def test_a_fresh_run_is_not_a_resumed_one():
    model, opt, scaler = make(init_scale=2.0**16, opt="adam")
    assert mpdoctor.diagnose(model, opt, scaler).findings_for("scaler-not-restored-on-resume") == []
    with mpdoctor.watch(model, opt, scaler) as w:
        correct_loop(model, opt, scaler, steps=3)
    assert "scaler-not-restored-on-resume" not in checks(w)


# -- nothing left behind, numerics unchanged -----------------------------------------------------------------------------


def originals():
    from torch.amp.grad_scaler import GradScaler

    return {
        **{n: vars(GradScaler)[n] for n in ("scale", "unscale_", "step", "update")},
        **{f"clip {n}": vars(o)[n] for o, n in ([compat.clip_helper()] if compat.clip_helper() else compat.clip_entry_points())},
        "sched": vars(LRScheduler)["step"],
    }


def test_the_watch_leaves_nothing_behind_also_when_the_loop_raises():
    from torch.optim import optimizer as optimizer_module

    before = originals()
    pre_hooks = dict(optimizer_module._global_optimizer_pre_hooks)
    model, opt, scaler = make()
    with pytest.raises(ZeroDivisionError):
        with mpdoctor.watch(model, opt, scaler):
            assert protocol_module.installed() and originals()["step"] is not before["step"]
            scaler.scale(loss_fn(model)).backward()
            raise ZeroDivisionError("the loop fails mid-step")
    after = originals()
    assert all(after[k] is before[k] for k in before)
    assert dict(optimizer_module._global_optimizer_pre_hooks) == pre_hooks and not protocol_module.installed()
    assert opt._optimizer_step_pre_hooks == {} and opt._optimizer_step_post_hooks == {}


def test_watched_and_unwatched_loops_give_bitwise_equal_weights():
    a, oa, sa = make()
    b, ob, sb = make()
    correct_loop(a, oa, sa, clip=1.0)
    with mpdoctor.watch(b, ob, sb):
        correct_loop(b, ob, sb, clip=1.0)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert sa.get_scale() == sb.get_scale()


def test_nested_observers_share_one_set_of_wrappers_and_both_see_the_mistake():
    model, opt, scaler = make()
    with ProtocolObserver(on_finding=lambda f: None) as outer:
        with mpdoctor.watch(model, opt, scaler) as w:
            scaler.scale(loss_fn(model)).backward()
            opt.step()
        assert protocol_module.installed()
    assert not protocol_module.installed()
    assert checks(w) == ["amp-step-bypasses-scaler"] and [f.check for f in outer.findings] == ["amp-step-bypasses-scaler"]


# -- notebooks: the observer per cell after %load_ext ----------------------------------------------------------------------


def test_cell_numbers_from_ipython_filenames():
    assert cell_number("<ipython-input-7-0123abcd>") == 7
    assert cell_number("/home/user/train.py") is None


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    before = set(sh.user_ns)
    hist = sh.history_manager
    cells = len(hist.input_hist_parsed)
    sh.run_line_magic("load_ext", "mpdoctor")
    yield sh
    sh.run_line_magic("unload_ext", "mpdoctor")
    for name in set(sh.user_ns) - before:  # the shell is shared by the suite: leave no variable behind
        sh.user_ns.pop(name, None)
    for lines in (hist.input_hist_parsed, hist.input_hist_raw):  # nor a broken loop for %mpdoctor to read later
        lines[cells:] = [""] * (len(lines) - cells)


def test_a_notebook_cell_clipping_scaled_gradients_is_named_by_cell_and_line(shell, capsys):
    from mpdoctor.attach.runtime import session

    shell.run_cell("import torch\nm = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                   "scaler = torch.amp.GradScaler('cpu')", store_history=True)  # fmt: skip
    assert not protocol_module.installed()  # between cells nothing of mpdoctor's is in torch
    cell = textwrap.dedent("""\
        x = torch.randn(8, 4)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(x).pow(2).mean()
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    """)
    number = shell.execution_count
    result = shell.run_cell(cell, store_history=True)
    assert result.success
    err = capsys.readouterr().err
    assert f"cell [{number}], line 5" in err and "amp-clip-before-unscale" in err
    (f,) = session.observer(shell).findings
    assert f.subject == "scaler" and "opt's gradients" in f.message
    assert not protocol_module.installed()


def test_a_notebook_cell_that_unscales_twice_shows_the_finding_then_the_runtime_error(shell, capsys):
    shell.run_cell("import torch\nm = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                   "scaler = torch.amp.GradScaler('cpu')", store_history=True)  # fmt: skip
    number = shell.execution_count
    result = shell.run_cell("for i in range(2):\n    scaler.scale(m(torch.randn(2, 4)).sum()).backward()\n"
                            "    scaler.unscale_(opt)\nscaler.step(opt)\nscaler.update()", store_history=True)  # fmt: skip
    assert isinstance(result.error_in_exec, RuntimeError)
    captured = capsys.readouterr()
    assert f"cell [{number}], line 3" in captured.err and "amp-unscale-twice" in captured.err
    # The step is still open (the scaler holds an unscaled optimizer): the next cells are watched in full
    # from their first line until an update() closes it; then only the resident scale wrapper stays.
    assert protocol_module.installed()
    assert shell.run_cell("scaler.update()", store_history=True).success
    assert not protocol_module.installed() and protocol_module.resident()


def test_a_cell_that_does_not_train_adds_no_wrapper_and_a_training_cell_gets_every_wrapper(shell):
    from torch.amp.grad_scaler import GradScaler
    from torch.optim.lr_scheduler import LRScheduler

    originals = {n: getattr(vars(GradScaler)[n], "__wrapped__", vars(GradScaler)[n]) for n in ("scale", "unscale_", "step", "update")}
    sched_step = vars(LRScheduler)["step"]
    shell.run_cell("import torch\nm = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                   "scaler = torch.amp.GradScaler('cpu')", store_history=True)  # fmt: skip
    seen = {}
    shell.user_ns["_seen"] = seen
    # Inside a cell that does not scale a loss: GradScaler.scale's resident wrapper only; the rest untouched.
    shell.run_cell("from torch.amp.grad_scaler import GradScaler as _G\nfrom torch.optim.lr_scheduler import LRScheduler as _L\n"
                   "_seen['idle'] = {n: vars(_G)[n] for n in ('scale', 'unscale_', 'step', 'update')}\n"
                   "_seen['idle_sched'] = vars(_L)['step']\n"
                   "import torch.optim.optimizer as _O\n_seen['idle_hooks'] = len(_O._global_optimizer_pre_hooks)")  # fmt: skip
    assert seen["idle"]["scale"] is not originals["scale"]
    assert all(seen["idle"][n] is originals[n] for n in ("unscale_", "step", "update"))
    assert seen["idle_sched"] is sched_step and seen["idle_hooks"] == 0
    # A cell that scales a loss: from that call on, every wrapper and the global hook.
    shell.run_cell("loss = m(torch.randn(2, 4)).sum()\nscaler.scale(loss).backward()\n"
                   "_seen['busy'] = {n: vars(_G)[n] for n in ('scale', 'unscale_', 'step', 'update')}\n"
                   "_seen['busy_hooks'] = len(_O._global_optimizer_pre_hooks)\n"
                   "scaler.step(opt)\nscaler.update()")  # fmt: skip
    assert all(seen["busy"][n] is not originals[n] for n in originals) and seen["busy_hooks"] == 1
    # Between cells: GradScaler.scale's resident pass-through wrapper only; the rest put back, identity equal.
    assert not protocol_module.installed() and vars(GradScaler)["scale"].__wrapped__ is originals["scale"]
    assert all(vars(GradScaler)[n] is originals[n] for n in ("unscale_", "step", "update"))
    assert vars(LRScheduler)["step"] is sched_step


def test_watch_inside_a_notebook_cell_shares_the_resident_wrapper_and_leaves_it_as_it_was(shell, capsys):
    from torch.amp.grad_scaler import GradScaler

    shell.run_cell("import torch, mpdoctor\nm = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                   "scaler = torch.amp.GradScaler('cpu')", store_history=True)  # fmt: skip
    resident = GradScaler.scale
    result = shell.run_cell("with mpdoctor.watch(m, opt, scaler) as w:\n"
                            "    for _ in range(2):\n"
                            "        scaler.scale(m(torch.randn(8, 4)).pow(2).mean()).backward()\n"
                            "        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)\n"
                            "        scaler.step(opt)\n        scaler.update()\n"
                            "        opt.zero_grad()", store_history=True)  # fmt: skip
    assert result.success
    # watch() and the cell's observer both saw the clip on scaled gradients, through one set of wrappers.
    assert [f.check for f in shell.user_ns["w"].protocol.findings] == ["amp-clip-before-unscale"]
    assert GradScaler.scale is resident and not protocol_module.installed()
    capsys.readouterr()


def test_a_step_split_across_cells_is_watched_from_the_first_line_of_the_next_cell(shell, capsys):
    from mpdoctor.attach.runtime import session

    shell.run_cell("import torch\nm = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                   "scaler = torch.amp.GradScaler('cpu')", store_history=True)  # fmt: skip
    shell.run_cell("with torch.autocast('cpu', dtype=torch.float16):\n    loss = m(torch.randn(8, 4)).pow(2).mean()\n"
                   "scaler.scale(loss).backward()", store_history=True)  # fmt: skip
    assert session.observer(shell).mid_step and protocol_module.installed()  # kept in full while the step is open
    number = shell.execution_count
    # This cell never calls scale(): only the previous cell's unfinished step makes it watched in full.
    result = shell.run_cell("opt.step()\nscaler.update()", store_history=True)
    assert isinstance(result.error_in_exec, AssertionError)  # GradScaler: "No inf checks were recorded prior to update."
    assert any(f.check == "amp-step-bypasses-scaler" and f.evidence["where"] == f"cell [{number}], line 1"
               for f in session.observer(shell).findings)  # fmt: skip
    capsys.readouterr()


def test_a_cells_protocol_findings_are_shown_as_a_report_when_the_cell_ends(shell, capsys):
    shell.run_cell("import torch\nm = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                   "scaler = torch.amp.GradScaler('cpu')", store_history=True)  # fmt: skip
    number = shell.execution_count
    shell.run_cell("loss = m(torch.randn(8, 4)).pow(2).mean()\nscaler.scale(loss).backward()\n"
                   "torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)\nscaler.step(opt)\nscaler.update()",
                   store_history=True)  # fmt: skip
    captured = capsys.readouterr()
    # At the call: one line on stderr. When the cell ends: the report (text here; the widget in Jupyter).
    (line,) = [x for x in captured.err.splitlines() if x.startswith("mpdoctor:")]
    assert f"[amp-clip-before-unscale] at cell [{number}], line 3" in line and "details when the cell ends" in line
    out = captured.out
    assert f"watched: the AMP loop as it ran (cell [{number}]): GradScaler protocol" in out
    assert "ERROR   amp-clip-before-unscale" in out and "scaler.unscale_(opt)" in out  # the corrected lines in the cell's names
    assert "inspected: nothing" not in out
    # In a widget frontend the same report is the widget: its header says what was watched.
    from mpdoctor.attach.runtime import session
    from mpdoctor.render.widget import ReportWidget

    widget = ReportWidget(session.cell_report(session.observer(shell), session.observer(shell).findings))
    assert f"watched: the AMP loop as it ran (cell [{number}])" in widget.header.value
    assert "amp-clip-before-unscale" in widget.report.to_html()
    # The next cell shows nothing again: each finding is shown once.
    shell.run_cell("loss = m(torch.randn(8, 4)).pow(2).mean()\nscaler.scale(loss).backward()\n"
                   "scaler.unscale_(opt)\ntorch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)\nscaler.step(opt)\n"
                   "scaler.update()", store_history=True)  # fmt: skip
    assert capsys.readouterr() == ("", "")


def test_unloading_the_extension_unregisters_the_cell_events_and_puts_back_gradscaler_scale(shell):
    from torch.amp.grad_scaler import GradScaler

    from mpdoctor.attach.runtime import session

    shell.run_cell("import torch\nx = 1", store_history=False)  # a cell with torch arms the resident wrapper
    assert protocol_module.resident()
    original = GradScaler.scale.__wrapped__
    shell.run_line_magic("unload_ext", "mpdoctor")
    assert GradScaler.scale is original and not protocol_module.resident() and not protocol_module.installed()
    names = {getattr(cb, "__qualname__", "") for cb in shell.events.callbacks["pre_run_cell"]}
    assert not any(session.__name__ in getattr(cb, "__module__", "") for cb in shell.events.callbacks["pre_run_cell"])
    assert not any("pre_run_cell" in n and "install" in n for n in names)
    shell.run_line_magic("load_ext", "mpdoctor")  # the fixture unloads it again


# -- mpdoctor run -----------------------------------------------------------------------------------------------------------


def test_mpdoctor_run_names_the_scripts_line(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import torch
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        for _ in range(3):
            optimizer.zero_grad()
            scaler.scale(model(torch.randn(8, 4)).pow(2).mean()).backward()
            optimizer.step()
            scaler.update()
    """))
    code = run_script(str(script), [])
    err = capsys.readouterr().err
    assert code == 1 and "No inf checks were recorded prior to update" in err  # the real error, from update()
    assert "train.py:8" in err and "amp-step-bypasses-scaler" in err and "bypassing scaler.step" in err
    # told once: read before the run, and the crash tied to it
    assert "is the amp-step-bypasses-scaler mistake at train.py:8, shown above" in err
    assert "optimizer.step() is called directly" not in err
    assert not protocol_module.installed()


# -- no false alarms on PyTorch's AMP examples, accelerate's loop, Lightning manual optimization ------------------------


def no_findings(w):
    assert [f.check for f in w.protocol.findings] == []
    assert w.scale_history, "the scaler was not followed"


def test_amp_examples_typical_loop_and_clipping_and_accumulation_draw_nothing():
    for clip in (None, 1.0):
        model, opt, scaler = make()
        with mpdoctor.watch(model, opt, scaler) as w:
            correct_loop(model, opt, scaler, clip=clip)
        no_findings(w)


def test_amp_examples_gradient_penalty_draws_nothing():
    model, opt, scaler = make()
    with mpdoctor.watch(model, opt, scaler) as w:
        for _ in range(3):
            opt.zero_grad()
            loss = loss_fn(model)
            scaled_grads = torch.autograd.grad(outputs=scaler.scale(loss), inputs=list(model.parameters()), create_graph=True)
            inv_scale = 1.0 / scaler.get_scale()
            grads = [g * inv_scale for g in scaled_grads]
            with torch.autocast("cpu", dtype=torch.float16):
                penalty = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
                loss = loss + penalty
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    no_findings(w)


def test_amp_examples_multiple_models_losses_and_optimizers_draw_nothing():
    torch.manual_seed(0)
    m0, m1 = torch.nn.Linear(8, 1), torch.nn.Linear(8, 1)
    o0, o1 = torch.optim.SGD(m0.parameters(), lr=0.01), torch.optim.Adam(m1.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with ProtocolObserver(on_finding=lambda f: None) as p:
        for _ in range(3):
            o0.zero_grad()
            o1.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out0, out1 = m0(X), m1(X)
                loss0 = F.mse_loss(2 * out0.float() + 3 * out1.float(), Y)
                loss1 = F.mse_loss(3 * out0.float() - 5 * out1.float(), Y)
            scaler.scale(loss0).backward(retain_graph=True)
            scaler.scale(loss1).backward()
            scaler.unscale_(o0)  # the recipe: unscale one optimizer to inspect or clip its grads
            scaler.step(o0)
            scaler.step(o1)
            scaler.update()
    assert p.findings == [] and len(p.scale_history) == 3


def test_accelerates_loop_draws_nothing():
    from accelerate import Accelerator

    torch.manual_seed(0)
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    before = params_of(model)
    # watch() hooks the inner torch optimizer (its step pre-hook); the protocol observer follows any optimizer.
    with mpdoctor.watch(model, opt.optimizer) as w:
        for _ in range(3):
            opt.zero_grad()
            loss = F.mse_loss(model(X), Y)
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    assert checks(w) == [] and changed(before, model)


def test_measuring_the_norm_with_an_infinite_max_norm_is_not_clipping():
    # transformers' Trainer logs grad_norm through clip_grad_norm_(params, inf): nothing is clipped.
    model, opt, scaler = make()
    with mpdoctor.watch(model, opt, scaler) as w:
        scaler.scale(loss_fn(model)).backward()
        clip_grad_norm_(model.parameters(), float("inf"))
        scaler.step(opt)
        scaler.update()
    no_findings(w)


def test_mpdoctor_in_a_notebook_shows_the_scale_history_of_the_cells_run_since_load_ext(shell, capsys):
    shell.run_cell("import torch\nm = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                   "scaler = torch.amp.GradScaler('cpu', init_scale=2.0**20)", store_history=True)  # fmt: skip
    for _ in range(2):  # two cells, one session history
        shell.run_cell("for _ in range(3):\n    opt.zero_grad()\n    with torch.autocast('cpu', dtype=torch.float16):\n"
                       "        loss = m(torch.randn(8, 4) * 30).pow(2).mean()\n    scaler.scale(loss).backward()\n"
                       "    scaler.step(opt)\n    scaler.update()", store_history=True)  # fmt: skip
    report = shell.run_line_magic("mpdoctor", "m opt scaler --text")
    history = report.scale_history
    assert [r.step for r in history] == [1, 2, 3, 4, 5, 6] and any(r.skipped for r in history)
    assert "loss scale and loss over steps" in capsys.readouterr().out


def test_cells_compiled_under_ipykernel_names_map_to_their_execution_count(shell):
    fmap = getattr(shell.compile, "_filename_map", None)
    if fmap is None:  # IPython 7.34 names cells <ipython-input-N-...>, read from the name itself
        assert cell_number("/tmp/ipykernel_1/123.py") is None and cell_number("<ipython-input-12-ab>") == 12
    else:
        fmap["/tmp/ipykernel_1/123.py"] = 12
        try:
            assert cell_number("/tmp/ipykernel_1/123.py") == 12
        finally:
            del fmap["/tmp/ipykernel_1/123.py"]


def test_load_ext_arms_the_watch_without_importing_the_observer_until_a_scaler_scales_a_loss():
    import subprocess
    import sys

    code = textwrap.dedent("""\
        import sys, torch, mpdoctor
        from IPython.core.interactiveshell import InteractiveShell
        sh = InteractiveShell.instance()
        sh.run_line_magic("load_ext", "mpdoctor")
        from mpdoctor.attach.runtime import dispatch
        assert dispatch.resident() and "mpdoctor.attach.runtime.protocol" not in sys.modules
        sh.run_cell("x = 1")
        assert "mpdoctor.attach.runtime.protocol" not in sys.modules  # a cell that does not train wakes nothing
        sh.run_cell("import torch\\nm = torch.nn.Linear(4, 1)\\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\\n"
                    "scaler = torch.amp.GradScaler('cpu')\\nscaler.scale(m(torch.randn(2, 4)).sum()).backward()\\n"
                    "torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)\\nscaler.step(opt)\\nscaler.update()")
        from mpdoctor.attach.runtime import session
        assert [f.check for f in session.observer(sh).findings] == ["amp-clip-before-unscale"]
        sh.run_line_magic("unload_ext", "mpdoctor")
        assert not dispatch.resident() and not dispatch.installed()
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-2000:]
