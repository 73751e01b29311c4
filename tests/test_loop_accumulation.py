"""A hand-written notebook loop's gradient accumulation, read as a setting: ``half-grad-accumulation`` names it.

The loop calls ``loss.backward()`` every micro-batch and ``optimizer.step()`` under ``if (i + 1) % accum_steps == 0``
on a bf16 model: autograd sums four micro-batch gradients into bf16 ``.grad``. No training object says so: the
accumulation is read from the cells that ran (``%mpdoctor``) and counted at run time under ``watch()`` (backward
calls per optimizer step). Each test runs in a real ``InteractiveShell(store_history=True)``: the measured harm
first, the finding naming the loop's line and the relative error, the fix applied in place (API and widget), then
the user's own loop cell run again, training.
"""

from __future__ import annotations

import copy

import pytest
import torch
from cure import click_fix
from notebook_shell import loaded_shell

from mpdoctor.attach.runtime.cell_accumulation import read_loop_accumulations
from mpdoctor.objects.readers.loop_source import source_of

SETUP = """import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(torch.bfloat16)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
accum_steps = 4
data = [(torch.randn(8, 64), torch.randn(8, 1)) for _ in range(8)]
"""

#: The user's loop: bf16 compute under autocast, four micro-batches per optimizer step (line 6: the step).
LOOP = """for i, (x, y) in enumerate(data):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y) / accum_steps
    loss.backward()
    if (i + 1) % accum_steps == 0:
        optimizer.step()
        optimizer.zero_grad()
"""

WATCHED = "import mpdoctor\nwith mpdoctor.watch(model, optimizer) as w:\n" + "".join(f"    {line}\n" for line in LOOP.splitlines())

#: The same loop stepping every micro-batch: nothing is accumulated.
NO_ACCUMULATION = LOOP.replace("    if (i + 1) % accum_steps == 0:\n        optimizer.step()\n        optimizer.zero_grad()",
                               "    optimizer.step()\n    optimizer.zero_grad()")  # fmt: skip

_NAMES = ("torch", "model", "optimizer", "accum_steps", "data", "x", "y", "i", "loss", "w", "r", "mpdoctor")


@pytest.fixture
def shell():
    with loaded_shell(_NAMES) as sh:
        yield sh


def _run(shell, code: str) -> None:
    result = shell.run_cell(code, store_history=True)
    assert result.error_in_exec is None, result.error_in_exec


def _report(shell):
    _run(shell, "r = %mpdoctor --text")
    return shell.user_ns["r"]


def _loop_trains(shell, code: str = LOOP) -> None:
    """The user's loop cell, run again: finite losses, the weights moved, in the dtype the fix left."""
    model = shell.user_ns["model"]
    before = [p.detach().float().clone() for p in model.parameters()]
    _run(shell, code)
    assert torch.isfinite(shell.user_ns["loss"]).all()
    assert all(not torch.equal(b, p.detach().float()) for b, p in zip(before, model.parameters()))


def _accumulated_in_bf16_vs_fp32(shell) -> float:
    """The harm, measured on a copy of the user's model: the four micro-batch gradients autograd sums into bf16
    ``.grad`` against the same four summed in fp32 (relative error of the first layer's weight gradient)."""
    ns = shell.user_ns
    model, data, accum = copy.deepcopy(ns["model"]), ns["data"], ns["accum_steps"]
    micro = []
    for x, y in data[:accum]:
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            (torch.nn.functional.mse_loss(model(x).float(), y) / accum).backward()
        micro.append(model[0].weight.grad.clone())
    model.zero_grad()
    for x, y in data[:accum]:  # the loop's own accumulation: backward four times, no zero_grad between
        with torch.autocast("cpu", dtype=torch.bfloat16):
            (torch.nn.functional.mse_loss(model(x).float(), y) / accum).backward()
    accumulated = model[0].weight.grad
    assert accumulated.dtype == torch.bfloat16
    in_bf16 = micro[0]
    for g in micro[1:]:
        in_bf16 = in_bf16 + g
    assert torch.equal(accumulated, in_bf16), "autograd sums the micro-batches in bf16, one rounding per addition"
    in_fp32 = torch.stack([g.float() for g in micro]).sum(0)
    return float((accumulated.float() - in_fp32).norm() / in_fp32.norm())


def _named(report, where: str):
    (finding,) = report.findings_for("half-grad-accumulation")
    assert finding.severity == "warning" and finding.subject == "model"
    assert finding.evidence["accumulation_steps"] == 4 and finding.evidence["grad_dtype"] == "bfloat16"
    assert finding.evidence["setting"].startswith("loop: optimizer.step() every 4 backward() calls (")
    assert where in finding.evidence["setting"], finding.evidence["setting"]
    assert finding.evidence["relative_error"] > 1e-3 and f"{finding.evidence['relative_error']:.2%}"[:3] in finding.message
    return finding


def _planned(report):
    (fix,) = [f for f in report.fixes if f.slug == "half-grad-accumulation"]
    assert not fix.safe and fix.recipe == "fp32-grad-accumulation"
    return fix


# -- read from the cells -------------------------------------------------------------------------------------


def test_a_notebook_loop_accumulating_into_bf16_grads_is_named_from_its_cell_fixed_and_trains(shell):
    _run(shell, SETUP)
    assert _accumulated_in_bf16_vs_fp32(shell) > 1e-3  # the harm: the summed gradient is off in the third digit
    _run(shell, LOOP)  # runs without an error: the harm is silent
    report = _report(shell)
    _named(report, f"cell [{shell.execution_count - 2}], line 6")
    fix = _planned(report)
    fix.apply()
    assert fix.applied, fix.error
    assert {p.dtype for p in shell.user_ns["model"].parameters()} == {torch.float32}
    _loop_trains(shell)  # the user's own loop: fp32 grads, bf16 matmuls under its autocast
    assert not _report(shell).findings_for("half-grad-accumulation")


def test_the_fix_clicked_in_the_widget_makes_the_same_loop_train(shell):
    _run(shell, SETUP)
    _run(shell, LOOP)
    report = _report(shell)
    _named(report, "line 6")
    rw = report.widget()
    rw.confirm_delay = 0.0  # a test's second click is a confirmation, not the tail of a double-click
    assert click_fix(rw, _planned(report).key)
    assert "failed" not in rw.status, rw.status
    assert {p.dtype for p in shell.user_ns["model"].parameters()} == {torch.float32}
    _loop_trains(shell)


def test_the_python_api_in_a_later_cell_sees_the_loop_as_the_magic_does(shell):
    """``mpdoctor.diagnose()`` (no magic) in the cell after the loop: the loop cell's accumulation was recorded when
    that cell ended, so the API names it, and its fix makes the same loop train."""
    _run(shell, SETUP)
    _run(shell, LOOP)
    _run(shell, "import mpdoctor\nr = mpdoctor.diagnose()")
    report = shell.user_ns["r"]
    _named(report, f"cell [{shell.execution_count - 2}], line 6")
    fix = _planned(report)
    fix.apply()
    assert fix.applied, fix.error
    _loop_trains(shell)
    _run(shell, NO_ACCUMULATION)  # the loop the user runs now steps every micro-batch: the record is cleared
    _run(shell, "r = mpdoctor.diagnose()")
    assert not shell.user_ns["r"].findings_for("half-grad-accumulation")


# -- counted under watch() -----------------------------------------------------------------------------------


def test_watch_counts_four_backward_calls_per_step_and_names_them_with_the_models_own_gradients(shell):
    _run(shell, SETUP)
    _run(shell, WATCHED)
    report = shell.user_ns["w"].report
    finding = _named(report, "watched")
    assert "every 4 backward() calls (cell [" in finding.evidence["setting"]  # the step's line in the user's cell
    assert finding.evidence["measured_on"] == "the model's own gradients"  # read at the first step: 4 summed
    fix = _planned(report)
    fix.apply()
    assert fix.applied, fix.error
    _loop_trains(shell, WATCHED)
    assert not shell.user_ns["w"].report.findings_for("half-grad-accumulation")


# -- healthy twins -------------------------------------------------------------------------------------------


def test_fp32_weights_under_bf16_autocast_with_the_same_loop_draw_nothing(shell):
    _run(shell, SETUP.replace(".to(torch.bfloat16)", ""))
    _run(shell, LOOP)
    report = _report(shell)
    assert not [f for f in report.findings if f.severity in ("error", "warning")], report.to_text()
    _run(shell, WATCHED)
    watched = shell.user_ns["w"].report
    assert not [f for f in watched.findings if f.severity in ("error", "warning")], watched.to_text()


def test_a_loop_with_no_accumulation_draws_no_accumulation_finding_even_after_one_that_accumulated(shell):
    _run(shell, SETUP)
    _run(shell, NO_ACCUMULATION)
    assert not _report(shell).findings_for("half-grad-accumulation")
    _run(shell, LOOP)
    assert _report(shell).findings_for("half-grad-accumulation")
    _run(shell, NO_ACCUMULATION)  # the loop the user runs now steps every micro-batch
    assert not _report(shell).findings_for("half-grad-accumulation")
    _run(shell, WATCHED.replace(LOOP.splitlines()[4], "    if True:"))  # watched: one backward per step
    assert not shell.user_ns["w"].report.findings_for("half-grad-accumulation")


# -- the static reader ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("guard", "namespace", "steps"),
    [
        ("(i + 1) % accum_steps == 0", {"accum_steps": 8}, 8),
        ("(i + 1) % 16 == 0", {}, 16),
        ("0 == step % 2", {}, 2),
        ("(i + 1) % accum_steps == 0", {}, None),  # the divisor is not in the namespace: nothing is read
        ("(i + 1) % accum_steps == 0", {"accum_steps": "8"}, None),  # not an int
        ("i > 3", {}, None),  # not a modulo guard
    ],
)
def test_the_reader_takes_n_from_the_guard_literal_or_the_namespace(guard, namespace, steps):
    code = f"for i, x in enumerate(data):\n    model(x).sum().backward()\n    if {guard}:\n        opt.step()\n"
    found = read_loop_accumulations([source_of("In[3]", code)], namespace)
    if steps is None:
        assert "opt" not in found
    else:
        assert found["opt"].steps == steps and found["opt"].setting == f"opt.step() every {steps} backward() calls (cell [3], line 4)"


def test_a_loop_without_backward_is_not_an_accumulation_loop():
    code = "for i, x in enumerate(data):\n    if (i + 1) % 4 == 0:\n        opt.step()\n"
    assert read_loop_accumulations([source_of("In[1]", code)], {}) == {}


def test_a_recorded_loop_setting_leaves_with_its_optimizer_and_a_step_every_batch_clears_it():
    import gc

    from mpdoctor.objects.readers import loop_accumulation as registry

    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    registry.record(opt, 4, "opt.step() every 4 backward() calls (cell [1], line 4)")
    assert registry.recorded(opt) == registry.Accumulation("loop", "opt.step() every 4 backward() calls (cell [1], line 4)", 4)
    registry.record(opt, 1, "opt.step() every 1 backward() calls (cell [2], line 3)")
    assert registry.recorded(opt) is None
    registry.record(opt, 8, "again")
    key = id(opt)
    del opt
    gc.collect()
    assert key not in registry._LOOPS


# -- in a script: read from its code (python train.py), counted as it runs (mpdoctor run) --------------------

#: A script's loop as people write it: the accumulation from argparse, the guard on a counter the static reader
#: cannot follow (``micro == args.accum``), then the script's own diagnosis; the fix is applied, and the same loop
#: runs again. Prints one JSON line.
SCRIPT = '''import argparse, json, sys
import torch
import mpdoctor

parser = argparse.ArgumentParser()
parser.add_argument("--accum", type=int, default=4)
parser.add_argument("--dtype", default="bfloat16")
args = parser.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(getattr(torch, args.dtype))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = [(torch.randn(8, 64), torch.randn(8, 1)) for _ in range(8)]


def train():
    micro, losses = 0, []
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y) / args.accum
        loss.backward()
        micro += 1
        if GUARD:
            optimizer.step()
            optimizer.zero_grad()
            micro = 0
        losses.append(loss.item())
    return losses


train()
report = mpdoctor.diagnose(model, optimizer)
found = report.findings_for("half-grad-accumulation")
out = {"findings": [[f.check, f.severity] for f in report.findings],
       "setting": found[0].evidence["setting"] if found else None,
       "steps": found[0].evidence["accumulation_steps"] if found else None}
if found:
    (fix,) = [f for f in report.fixes if f.slug == "half-grad-accumulation"]
    fix.apply()
    out["applied"] = fix.applied
    before = [p.detach().clone() for p in model.parameters()]
    losses = train()
    out["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    out["trained"] = all(map(lambda v: v == v, losses)) and all(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
out["backward_wrapped"] = hasattr(torch.autograd.backward, "__wrapped__")
print("RESULT " + json.dumps(out))
'''


def _script_result(tmp_path, guard: str, *args: str, run: bool = False) -> dict:
    import json
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("GUARD", guard))
    cmd = [sys.executable, "-m", "mpdoctor", "run", str(script), *args] if run else [sys.executable, str(script), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def test_a_plain_script_calling_diagnose_is_read_for_its_loop_named_at_its_line_fixed_and_trains(tmp_path):
    """``python train.py``: nothing watches the loop; ``diagnose()`` reads the script it is called from, the guard's
    divisor an argparse attribute (``args.accum``, read from the namespace without running code)."""
    out = _script_result(tmp_path, "(len(train.__code__.co_varnames) and (micro % args.accum == 0))")
    assert out["setting"] is None  # a guard the reader does not follow is not guessed at
    out = _script_result(tmp_path, "micro % args.accum == 0")
    assert out["steps"] == 4 and out["setting"] == "loop: optimizer.step() every 4 backward() calls (train.py:23)"
    assert ["half-grad-accumulation", "warning"] in out["findings"]
    assert out["applied"] and out["dtypes"] == ["torch.float32"] and out["trained"] and not out["backward_wrapped"]


def test_mpdoctor_run_counts_the_loops_backward_calls_per_step_whatever_its_guard_and_the_fix_trains(tmp_path):
    """``mpdoctor run train.py``: the backward() calls per optimizer step are counted as the script runs, so a guard
    the code reader cannot follow is still known; the count outranks the reading; torch.autograd.backward is put back."""
    out = _script_result(tmp_path, "(len(train.__code__.co_varnames) and (micro % args.accum == 0))", run=True)
    assert out["steps"] == 4 and out["setting"].startswith("loop: optimizer.step() every 4 backward() calls (")
    assert out["setting"].endswith("train.py:23, counted)"), out["setting"]
    assert out["applied"] and out["dtypes"] == ["torch.float32"] and out["trained"]
    assert out["backward_wrapped"]  # while the script runs (the last test shows close() puts it back)
    out = _script_result(tmp_path, "micro % args.accum == 0", "--accum", "2", run=True)
    assert out["steps"] == 2 and out["setting"].endswith(", counted)")


def test_healthy_twins_in_a_script_draw_nothing(tmp_path):
    """fp32 weights under bf16 autocast (fp32 grads): the same loops, run plainly and under ``mpdoctor run``."""
    for run in (False, True):
        out = _script_result(tmp_path, "micro % args.accum == 0", "--dtype", "float32", run=run)
        assert out["setting"] is None
        assert not [f for f in out["findings"] if f[1] in ("error", "warning")], out


def test_the_counter_skips_nested_backward_calls_and_proofs_and_leaves_torch_as_it_found_it():
    """Reentrant checkpointing calls backward() once per checkpointed segment inside the outer one: one per
    micro-batch is counted. A step mpdoctor runs to prove a fix is not the loop's. close() restores torch."""
    from torch.utils.checkpoint import checkpoint

    from mpdoctor.attach.runtime.backward_count import BackwardCounter
    from mpdoctor.diagnosis.proof import run_step
    from mpdoctor.objects.readers.loop_accumulation import recorded

    real = torch.autograd.backward
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def forward(x):
        for layer in model:
            x = checkpoint(layer, x, use_reentrant=True)
        return x

    counter = BackwardCounter().attach()
    try:
        assert torch.autograd.backward is not real
        for i in range(6):
            forward(torch.randn(4, 8, requires_grad=True)).sum().backward()
            if (i + 1) % 3 == 0:
                opt.step()
                opt.zero_grad()
        assert recorded(opt).steps == 3 and counter.recorded == [("opt", 3), ("opt", 3)]

        def proof_step():  # one backward and a step, as a proof runs it
            forward(torch.randn(4, 8, requires_grad=True)).sum().backward()
            opt.step()

        assert run_step(proof_step, [model], [opt]).trained
        assert recorded(opt).steps == 3 and counter.backwards == 0
    finally:
        counter.close()
    assert torch.autograd.backward is real
