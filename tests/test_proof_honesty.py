"""What is labelled "verified" is what the user gets, and the run is left as it was.

Each scenario is one a user can write: the real error first, then the report, then what its labels claim held
against the user's own step run again after exactly what the label names. The fingerprints cover what a proof
must put back: parameters, gradients, ``requires_grad``, train/eval modes, optimizer state, LR schedulers, RNG
streams, data iterators.
"""

from __future__ import annotations

import pytest
import torch
from fingerprint import fingerprint, values_only
from notebook_shell import loaded_shell
from steps import assert_step_trains, snapshot

import mpdoctor
from mpdoctor.diagnosis.proof import iterator_reader, run_step

pytestmark = pytest.mark.colab


def _bf16_head_setup(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
    model[2].to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.randn(4, 8)


def _step(model, opt, x, loss_of=lambda out: out.float().pow(2).mean()):
    """The user's training step on ``x``: zero the gradients, forward, the loss, backward, the optimizer step."""

    def step():
        opt.zero_grad()
        loss = loss_of(model(x))
        loss.backward()
        opt.step()
        return loss

    return step


# -- "trained" means an optimizer step applied non-zero gradients ---------------------------------------------------


def test_a_step_whose_gradients_are_all_zero_ran_but_did_not_train_even_when_weight_decay_moves_the_weights():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randn(3, 4)

    def zero_grad_step():
        opt.zero_grad()
        (model(x) * 0.0).sum().backward()  # every gradient is zero
        opt.step()  # AdamW's decay still moves the weights

    w = model.weight.detach().clone()
    outcome = run_step(zero_grad_step, [model], [opt])
    assert not torch.equal(model.weight.detach(), w)  # the weights moved: the old "some parameter changed" said trained
    assert outcome.ran and not outcome.trained
    assert outcome.describe() == "it ran, but every gradient was zero or inf/NaN"


def test_a_step_that_zeroes_its_gradients_after_the_update_still_trained():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)

    def step():
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # no .grad is left to read after the step

    assert run_step(step, [model], [opt]).trained


def test_a_step_with_no_optimizer_step_or_nan_parameters_did_not_train():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)

    def no_update():
        opt.zero_grad()
        model(x).pow(2).mean().backward()

    outcome = run_step(no_update, [model], [opt])
    assert not outcome.trained and "no optimizer step applied the gradients" in outcome.why

    def nan_update():
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        with torch.no_grad():
            model.bias.fill_(float("nan"))

    outcome = run_step(nan_update, [model], [opt])
    assert not outcome.trained and outcome.why == "a parameter became inf/NaN"


# -- labels: each fix alone, the plan and the safe plan each as one action -------------------------------------------


def test_a_fixs_label_claims_only_what_ran_alone_and_the_plan_is_proven_as_one_action():
    model, opt, x = _bf16_head_setup()

    train_step = _step(model, opt, x)

    with pytest.raises(RuntimeError, match="same dtype"):
        train_step()
    report = mpdoctor.diagnose(model, opt, step=train_step)
    proof = report.proof
    assert proof.verified and proof.plan.trained
    for title, alone in proof.after:
        fix = next(fx for fx in report.fixes if fx.title == title)
        if proof.label(fix).startswith("verified on your step: applied alone"):
            assert alone.trained  # the label says alone: alone it trained
        else:
            assert "together with" in proof.label(fix)  # otherwise it names what else it took
    # The user does exactly what the plan's label names, on fresh objects: the step runs and trains.
    model2, opt2, _ = _bf16_head_setup()
    report2 = mpdoctor.diagnose(model2, opt2, step=lambda: None)  # same plan on the twin (no proof needed)
    for fx in report2.fixes:
        fx.apply()
    params = list(model2.parameters())
    start = snapshot(params)
    opt2.zero_grad()
    loss = model2(x).float().pow(2).mean()
    loss.backward()
    opt2.step()
    assert_step_trains(loss, start, params)


def test_a_safe_plan_that_alone_does_not_cure_says_so_and_names_what_else_it_takes():
    from mpdoctor.diagnosis.proof import prove

    model, opt, x = _bf16_head_setup()
    scaler = torch.amp.GradScaler("cpu")

    train_step = _step(model, opt, x)

    report = mpdoctor.diagnose(model, opt, scaler)
    (cast,) = report.findings_for("mixed-param-dtypes")[0].fixes
    (disable,) = report.findings_for("scaler-with-bf16")[0].fixes
    assert cast.changes and disable.changes
    # The safe plan is the scaler's fix alone: it does not reach the failing matmul.
    proof = prove([cast, disable], train_step, "train_step()", [model], [opt], [scaler], safe_plan=[disable])
    assert proof.verified and not proof.safe_verified and not proof.safe.ran
    assert proof.dropped == () and proof.beyond_safe == (cast.title,)
    summary = proof.summary()
    assert "Apply all safe fixes on its own does not cure it: after it, it raised RuntimeError" in summary
    assert summary.endswith(f"it also takes: {cast.title}.")
    assert proof.label(disable).startswith("not what your step needs")  # alone, the step fails as before
    # No safe fix at all: the report says none cures it and what it takes.
    proof = prove([cast], train_step, "train_step()", [model], [opt], [scaler], safe_plan=[])
    assert proof.verified and f"No safe fix cures it on its own: it takes {cast.title}." in proof.summary()
    # With the cast as the safe plan, Apply all safe fixes is the plan, and verified with it.
    proof = prove([cast], train_step, "train_step()", [model], [opt], [scaler], safe_plan=[cast])
    assert proof.verified and proof.safe_verified and proof.beyond_safe == ()
    assert model[2].weight.dtype == torch.bfloat16 and scaler.is_enabled()  # every trial undone


# -- the cell replay runs through the line that failed ----------------------------------------------------------------

_CELL_SETUP = """
import torch
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
adam = torch.optim.Adam(net.parameters(), lr=1e-2)
batch = torch.randn(4, 8)
probe_w = torch.randn(8, 2)
net[1].to(torch.bfloat16)
"""

# The update, then an evaluation that raises on its own (a bf16 batch against an fp32 weight, outside any model):
# curing the head lets the step run, and the cell still raises after opt.step().
_RAISES_AFTER_THE_STEP = """
adam.zero_grad()
loss = net(batch).float().pow(2).mean()
loss.backward()
adam.step()
score = batch.to(torch.bfloat16) @ probe_w
"""


def test_a_cell_that_raises_after_its_optimizer_step_is_not_called_verified(capsys):
    with loaded_shell(("torch", "net", "adam", "batch", "probe_w", "loss", "score", "r", "_")) as sh:
        sh.run_cell(_CELL_SETUP, store_history=True)
        assert isinstance(sh.run_cell(_RAISES_AFTER_THE_STEP, store_history=True).error_in_exec, RuntimeError)
        sh.run_cell("r = %mpdoctor net adam --text", store_history=True)
        report = sh.user_ns["r"]
        proof = report.proof
        assert proof.before is not None and not proof.before.ran
        assert not proof.verified and proof.plan is not None and not proof.plan.ran
        assert "Plan not verified on your step (cell [" in capsys.readouterr().out
        # What the proof said is what the user gets: the plan applied, the cell still raises after its step.
        for fx in report.fixes:
            fx.apply()
        assert isinstance(sh.run_cell(_RAISES_AFTER_THE_STEP, store_history=True).error_in_exec, RuntimeError)


def test_a_cell_replay_puts_back_requires_grad_modes_and_a_helper_that_reads_an_iterator_is_refused():
    setup = _CELL_SETUP + "net.eval()\nnet[0].weight.requires_grad_(False)\n"
    cell = "net.train()\nnet[0].weight.requires_grad_(True)\nloss = net(batch).float().pow(2).mean()\nloss.backward()\n"
    with loaded_shell(("torch", "net", "adam", "batch", "probe_w", "loss", "r", "_")) as sh:
        sh.run_cell(setup, store_history=True)
        assert isinstance(sh.run_cell(cell, store_history=True).error_in_exec, RuntimeError)
        net = sh.user_ns["net"]
        net.eval()
        net[0].weight.requires_grad_(False)  # as it was before the cell
        sh.run_cell("r = %mpdoctor net adam --text", store_history=True)
        assert sh.user_ns["r"].proof.before is not None  # the cell was replayed
        assert not net.training and not net[0].training and not net[0].weight.requires_grad

        helper = "it = iter([torch.randn(4, 8) for _ in range(7)])\ndef get_batch():\n    return next(it)\n"
        sh.run_cell(helper, store_history=True)
        reads = "x = get_batch()\nloss = net(x).float().pow(2).mean()\nloss.backward()\n"
        assert isinstance(sh.run_cell(reads, store_history=True).error_in_exec, RuntimeError)
        left = len(list(sh.user_ns["it"].__reduce__()[1][0])) - sh.user_ns["it"].__reduce__()[-1]
        sh.run_cell("r = %mpdoctor net adam --text", store_history=True)
        proof = sh.user_ns["r"].proof
        assert "the cell calls get_batch(), which reads a data iterator" in proof.refused and proof.before is None
        assert len(list(sh.user_ns["it"].__reduce__()[1][0])) - sh.user_ns["it"].__reduce__()[-1] == left


# -- diagnose(step=fn): refused when it reads an iterator, the run put back when it runs ------------------------------


def test_diagnose_step_refuses_a_step_that_reads_an_iterator_and_moves_nothing():
    model, opt, _ = _bf16_head_setup()
    it = iter([torch.randn(4, 8) for _ in range(7)])

    def train_step():
        opt.zero_grad()
        model(next(it)).float().pow(2).mean().backward()
        opt.step()

    assert iterator_reader(train_step) == "train_step()"
    assert iterator_reader(lambda: next(model.parameters())) == ""  # no data stream: not one
    report = mpdoctor.diagnose(model, opt, step=train_step)
    assert "train_step() reads a data iterator" in report.proof.refused and not report.proof.verified
    assert it.__reduce__()[-1] == 0  # no item taken
    assert "Fixes not verified on your step (train_step())" in report.to_text()


def test_diagnose_step_leaves_the_scheduler_modes_and_requires_grad_as_they_were():
    model, opt, x = _bf16_head_setup()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        sched.step()
    model.eval()
    model[0].bias.requires_grad_(False)

    def train_step():
        model.train()
        model[0].bias.requires_grad_(True)
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        return loss

    ns = {"model": model, "opt": opt}
    before = values_only(fingerprint(ns))
    epoch, lr = sched.last_epoch, opt.param_groups[0]["lr"]
    report = mpdoctor.diagnose(model, opt, step=train_step)
    assert report.proof.verified
    assert values_only(fingerprint(ns)) == before
    assert (sched.last_epoch, opt.param_groups[0]["lr"]) == (epoch, lr)
    assert not model.training and not any(m.training for m in model.modules())
    assert not model[0].bias.requires_grad


# -- stand-in steps: checked, never "verified on your step" -----------------------------------------------------------


def test_a_step_mpdoctor_builds_itself_is_checked_and_never_labelled_verified():
    from mpdoctor.diagnosis.proof import HeldStep, prove_held

    model, opt, x = _bf16_head_setup()

    def stand_in():
        opt.zero_grad()
        model(x).float().mean().backward()
        opt.step()

    report = mpdoctor.diagnose(model, opt)
    held = HeldStep(stand_in, "the held batch", stand_in="mpdoctor's own step on the held batch")
    proof = prove_held(report.fixes, held, [model], [opt])
    assert proof.checked and not proof.verified and not proof.safe_verified
    assert proof.summary().startswith("Plan not verified on your step: checked on mpdoctor's own step")
    labels = [proof.label(fx) for fx in report.fixes]
    assert labels and all(text.startswith(("checked on mpdoctor's own step", "not verified (checked on mpdoctor's"))
                          for text in labels), labels  # fmt: skip


def test_two_cures_of_one_failure_that_undo_each_other_are_not_planned_together():
    from mpdoctor.diagnosis.proof import prove
    from mpdoctor.objects.live import Live
    from mpdoctor.rules.engine.changes import CastInputsHook, CastParamsTo
    from mpdoctor.rules.engine.fixes import Fix
    from mpdoctor.rules.engine.rules import Applicability

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    net[1].to(torch.bfloat16)
    adam = torch.optim.Adam(net.parameters(), lr=1e-2)
    batch = torch.randn(4, 8)

    def step():
        adam.zero_grad()
        loss = net(batch).float().pow(2).mean()
        loss.backward()
        adam.step()
        return loss

    live = Live()
    head = frozenset(id(p) for p in net[1].parameters())
    cast_head = Fix("Cast net[1] to float32", "net[1].float()", applicability=Applicability.UNSAFE,
                    changes=(CastParamsTo(live.add(net), head, "float32", label="net[1]"),))  # fmt: skip
    cast_inputs = Fix("Cast net[1]'s inputs to bfloat16", "...", applicability=Applicability.SAFE,
                      changes=(CastInputsHook(live.add(net[1]), "bfloat16", "net[1]"),))  # fmt: skip
    for fx in (cast_head, cast_inputs):
        fx.bind(live)
    proof = prove([cast_head, cast_inputs], step, "step()", [net], [adam], [], safe_plan=[cast_inputs])
    # Each cures the step alone; together the fp32 head meets bf16 inputs. The second is left out of the plan,
    # and Apply all safe fixes (the input cast alone) is proven on its own.
    assert [outcome.trained for _, outcome in proof.after] == [True]
    assert proof.left_out == (cast_inputs.title,) and proof.verified and proof.safe_verified
    plan, safe_plan = proof.plans([cast_head, cast_inputs], [cast_inputs])
    assert plan == [cast_head] and safe_plan == [cast_inputs]
    assert net[1].weight.dtype == torch.bfloat16 and not net[1]._forward_pre_hooks  # every trial undone
    # What the labels name, done by the user: the safe plan alone, then the step trains.
    cast_inputs.apply()
    params = list(net.parameters())
    start = snapshot(params)
    assert_step_trains(step(), start, params)


def test_ipythons_output_variables_never_name_a_patient():
    setup = _CELL_SETUP.replace("net[1].to(torch.bfloat16)\n", "")
    cell = "adam.zero_grad()\nloss = net(batch).float().pow(2).mean()\nloss.backward()\nadam.step()\n"
    with loaded_shell(("torch", "net", "adam", "batch", "probe_w", "loss", "r", "_", "__", "___", "Out")) as sh:
        sh.run_cell(setup, store_history=True)
        sh.run_cell("net[1].to(torch.bfloat16)", store_history=True)  # displayed: _ and Out[n] hold net[1]
        assert sh.user_ns["_"] is sh.user_ns["net"][1]
        assert isinstance(sh.run_cell(cell, store_history=True).error_in_exec, RuntimeError)
        sh.run_cell("r = %mpdoctor --text", store_history=True)
        report = sh.user_ns["r"]
        shell_names = {"_", "__", "___", "Out", "In"}
        assert not any(f.subject.split(".")[0].split("[")[0] in shell_names or f.subject.startswith("_")
                       for f in report.findings), [f.subject for f in report.findings]  # fmt: skip
        assert report.proof.verified
        report.apply_safe_fixes()
        params = list(sh.user_ns["net"].parameters())
        start = snapshot(params)
        result = sh.run_cell(cell, store_history=True)
        assert result.error_in_exec is None
        assert_step_trains(sh.user_ns["loss"], start, params)


def test_a_cell_whose_failing_line_comes_after_its_optimizer_step_is_replayed_through_that_line():
    # The training step is healthy; the evaluation after the update raises (a bf16 model fed the fp32 batch).
    setup = _CELL_SETUP.replace("net[1].to(torch.bfloat16)\n", "") + "judge = torch.nn.Linear(8, 1).to(torch.bfloat16)\n"
    cell = ("adam.zero_grad()\nloss = net(batch).pow(2).mean()\nloss.backward()\nadam.step()\n"
            "score = judge(batch)\n")  # fmt: skip
    with loaded_shell(("torch", "net", "adam", "batch", "probe_w", "judge", "loss", "score", "r", "_")) as sh:
        sh.run_cell(setup, store_history=True)
        assert isinstance(sh.run_cell(cell, store_history=True).error_in_exec, RuntimeError)
        sh.run_cell("r = %mpdoctor --text", store_history=True)
        report = sh.user_ns["r"]
        proof = report.proof
        assert proof.before is not None and not proof.before.ran  # the replay reached the evaluation and raised
        (cause,) = report.findings_for("batch-dtype-mismatch")
        assert cause.subject == "judge" and proof.verified
        # The claim holds on the user's cell, run again after the plan: the update and the evaluation both run.
        for fx in report.fixes:
            fx.apply()
        params = list(sh.user_ns["net"].parameters())
        start = snapshot(params)
        assert sh.run_cell(cell, store_history=True).error_in_exec is None
        assert_step_trains(sh.user_ns["loss"], start, params)


def test_a_plan_after_which_the_step_runs_without_training_is_not_verified():
    model, opt, x = _bf16_head_setup()

    step = _step(model, opt, x, lambda out: (out.float() * 0.0).sum())  # no gradient reaches a parameter

    with pytest.raises(RuntimeError, match="same dtype"):
        step()
    report = mpdoctor.diagnose(model, opt, step=step)
    proof = report.proof
    assert proof.plan is not None and proof.plan.ran and not proof.plan.trained
    assert not proof.verified and "every gradient was zero" in proof.plan.why
    assert "Plan not verified on your step (step())" in report.to_text()


def test_a_cell_replay_puts_back_a_tensor_the_cell_changes_in_place():
    cell = "batch.mul_(2.0)\nadam.zero_grad()\nloss = net(batch).float().pow(2).mean()\nloss.backward()\nadam.step()\n"
    with loaded_shell(("torch", "net", "adam", "batch", "probe_w", "loss", "r", "_")) as sh:
        sh.run_cell(_CELL_SETUP, store_history=True)
        assert isinstance(sh.run_cell(cell, store_history=True).error_in_exec, RuntimeError)
        batch = sh.user_ns["batch"]
        seen = batch.clone()  # doubled once, by the user's own run
        sh.run_cell("r = %mpdoctor net adam --text", store_history=True)
        proof = sh.user_ns["r"].proof
        assert proof.before is not None and proof.after  # replayed, before and after the fix
        assert sh.user_ns["batch"] is batch and torch.equal(batch, seen)


def test_under_watch_a_loss_line_that_still_raises_after_the_plan_is_not_called_verified():
    """The plan cures the forward (a bf16 head in an fp32 net) but the user's own loss line raises whatever the
    model does (a half-precision input to BCE against fp32 targets). watch() replays that loop body, so the plan
    is "not verified", where a stand-in step (the mean of the output) would have passed."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    net[1].to(torch.bfloat16)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    data = [(torch.randn(4, 8), torch.rand(4, 1)) for _ in range(3)]
    with pytest.raises(RuntimeError), mpdoctor.watch(net, opt) as w:
        for x, y in data:
            opt.zero_grad()
            out = net(x).float()
            loss = F.binary_cross_entropy(torch.sigmoid(out).half(), y)
            loss.backward()
            opt.step()
    proof = w.crash_report.proof
    assert proof.step.startswith("your loop's body (") and not proof.before.ran
    assert proof.plan is not None and not proof.plan.ran and "expected" in proof.plan.error.lower()
    assert not proof.verified and "Plan verified" not in w.crash_report.to_text()
