"""After a crash in IPython, ``r = %mpdoctor`` holds the crash's finding, applies its safe fix, and every fix code
string it shows runs as shown in the user's namespace.

Before: ``r.apply_safe_fixes()`` returned ``[]`` (the crash's fix, bound to the batch it saw, was not in the
report's plan) and the fix code named ``cast_floating_inputs``, defined nowhere the user could see.
"""

from __future__ import annotations

import pytest
import torch
from amp_loops import BF16_CLIP_LOOP_CELL, BF16_SETUP_CELL
from notebook_shell import loaded_shell
from steps import assert_step_trains, snapshot

from mpdoctor.render.widget import ReportWidget

pytestmark = pytest.mark.colab

SETUP = """
import torch
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(torch.bfloat16)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
x = torch.randn(16, 4)
"""
#: The user's own step: an fp32 batch into a bf16 model.
STEP = """
opt.zero_grad()
loss = net(x).float().pow(2).mean()
loss.backward()
opt.step()
"""
NAMES = ("net", "opt", "x", "loss", "r", "cast_floating_inputs")


def crashed(shell) -> None:
    shell.run_cell(SETUP, store_history=True)
    result = shell.run_cell(STEP, store_history=True)
    assert isinstance(result.error_in_exec, RuntimeError)
    assert "must have the same dtype" in str(result.error_in_exec)  # the real error


def test_after_a_crash_mpdoctor_holds_its_finding_and_applies_its_safe_fix_then_the_step_trains():
    with loaded_shell(NAMES) as shell:
        crashed(shell)
        shell.run_cell("r = %mpdoctor --text", store_history=True)
        report = shell.user_ns["r"]
        assert report.cause is not None and report.cause.check == "batch-dtype-mismatch"
        assert report.safe_fixes, "the crash's safe fix is not in the plan"
        applied = report.apply_safe_fixes()
        assert [fx.recipe for fx in applied] == ["cast-inputs-hook"]
        net = shell.user_ns["net"]
        before = snapshot(net.parameters())
        assert shell.run_cell(STEP, store_history=True).success  # the user's failing step, again
        assert_step_trains(shell.user_ns["loss"], before, net.parameters())


def test_after_a_crash_the_widgets_apply_all_safe_fixes_button_fixes_it_and_the_step_trains():
    with loaded_shell(NAMES) as shell:
        crashed(shell)
        shell.run_cell("r = %mpdoctor --text", store_history=True)
        rw = ReportWidget(shell.user_ns["r"])
        rw.confirm_delay = 0.0
        (button,) = rw.buttons("Apply all safe fixes")
        button.click()
        net = shell.user_ns["net"]
        before = snapshot(net.parameters())
        assert shell.run_cell(STEP, store_history=True).success
        assert_step_trains(shell.user_ns["loss"], before, net.parameters())


def test_every_fix_code_a_crash_report_shows_runs_as_shown_and_the_step_then_trains():
    with loaded_shell(NAMES) as shell:
        crashed(shell)
        shell.run_cell("r = %mpdoctor --text", store_history=True)
        report = shell.user_ns["r"]
        codes = [fx.code for f in report.findings for fx in f.fixes if fx.code]
        assert codes and any("register_forward_pre_hook" in c for c in codes)
        for code in codes:  # no undefined name (cast_floating_inputs, net.dtype): each runs as shown
            assert shell.run_cell(code, store_history=True).success, code
        net = shell.user_ns["net"]
        before = snapshot(net.parameters())
        assert shell.run_cell(STEP, store_history=True).success
        assert_step_trains(shell.user_ns["loss"], before, net.parameters())
        assert net(torch.randn(2, 4)).dtype == torch.bfloat16  # the hook casts every call's input


def test_after_apply_all_safe_fixes_each_finding_that_left_says_why_and_code_only_ones_stay(capsys):
    with loaded_shell(("model", "optimizer", "amp_scaler", "data", "x", "loss", "r")) as shell:
        shell.run_cell(BF16_SETUP_CELL, store_history=True)
        shell.run_cell(BF16_CLIP_LOOP_CELL, store_history=True)
        shell.run_cell("r = %mpdoctor --text", store_history=True)
        report = shell.user_ns["r"]
        checks = [f.check for f in report.findings]
        assert "amp-clip-before-unscale" in checks and report.safe_fixes, checks
        rw = ReportWidget(report)
        rw.confirm_delay = 0.0
        (button,) = rw.buttons("Apply all safe fixes")
        button.click()
        after = [f.check for f in rw.report.findings]
        assert "amp-clip-before-unscale" in after, after  # still shown: only code can fix it
        clip = next(f for f in rw.report.findings if f.check == "amp-clip-before-unscale")
        assert "unscale_" in clip.fixes[0].code  # with the code
        assert "Only fixable in code, still shown with the code: amp-clip-before-unscale" in rw.status
        gone = [f.check for f in report.findings if f.check not in after]
        assert gone and all(check in rw.status for check in gone), (gone, rw.status)
        assert "fixed: " in rw.status
        assert "no mixed-precision problems found" not in rw.report.to_html()


def test_a_crash_finding_whose_fix_is_not_applied_yet_stays_after_a_refresh_and_is_never_called_superseded():
    with loaded_shell(NAMES) as shell:
        crashed(shell)
        shell.run_cell("r = %mpdoctor --text", store_history=True)
        report = shell.user_ns["r"]
        after = report.refresh()  # nothing applied: the diagnosis at rest cannot see the crash's batch
        assert after.findings_for("batch-dtype-mismatch"), "the crash's finding left a refresh with its fix pending"
        assert all(d["check"] != "batch-dtype-mismatch" for d in after.departed)
        (fix,) = [fx for fx in after.safe_fixes if fx.recipe == "cast-inputs-hook"]  # still the one to apply
        fix.apply()
        net = shell.user_ns["net"]
        before = snapshot(net.parameters())
        assert shell.run_cell(STEP, store_history=True).success
        assert_step_trains(shell.user_ns["loss"], before, net.parameters())
