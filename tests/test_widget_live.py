"""Widgets re-read the live objects before a button acts, and a refreshed report says why each finding left.

Run as a notebook runs: a real ``InteractiveShell`` with ``store_history=True``, ``%load_ext mpdoctor``, and the
real ipywidgets report clicked headlessly. Before: after a later cell cast the model again, the widget's unsafe
button still read "Cast 2 trainable fp16 parameters" while the objects held 4, and one confirming click cast what
the text no longer said; "Disable amp_scaler" disabled the scaler of a model the user had meanwhile put back in
float32; and after ``r.apply_safe_fixes()`` then ``r.refresh()`` the findings that left did so silently (only the
widget's status line said why).
"""

from __future__ import annotations

import pytest
import torch
from amp_loops import BF16_CLIP_LOOP_CELL, BF16_SETUP_CELL
from notebook_shell import loaded_shell
from steps import assert_step_trains, snapshot

from mpdoctor.render.text import departures_sentence
from mpdoctor.render.widget import ReportWidget

pytestmark = pytest.mark.colab

#: A model whose first layer was cast to fp16 by hand, trained with an enabled GradScaler.
FP16_SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
model[0].half()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
amp_scaler = torch.amp.GradScaler("cpu")
x = torch.randn(16, 8)
"""
#: A later cell of the notebook: "Run All" casts the whole model again, after the report was made.
CAST_AGAIN = "model.half()"
#: The user's step: fp32 batch, fp32 loss, scaled backward.
FP16_STEP = """
optimizer.zero_grad()
loss = model(x.to(next(model.parameters()).dtype)).float().pow(2).mean()
amp_scaler.scale(loss).backward()
amp_scaler.step(optimizer)
amp_scaler.update()
"""
FP16_NAMES = ("model", "optimizer", "amp_scaler", "x", "loss", "r")

BF16_NAMES = ("model", "optimizer", "amp_scaler", "data", "x", "loss", "r")


def widget(shell) -> ReportWidget:
    shell.run_cell("r = %mpdoctor --text", store_history=True)
    rw = ReportWidget(shell.user_ns["r"])
    rw.confirm_delay = 0.0
    return rw


def only(buttons: list):
    assert len(buttons) == 1, [b.description for b in buttons]
    return buttons[0]


def cast_button(rw: ReportWidget):
    """The button of the planned cast (an alternative's label names it too, after "alternative to")."""
    return only([b for b in rw.buttons("trainable fp16 parameters") if "alternative to" not in b.description])


def fp16_dtypes(model: torch.nn.Module) -> list[torch.dtype]:
    return [p.dtype for p in model.parameters()]


# -- 1. a button re-reads the live objects before it acts ------------------------------------


def test_after_run_all_cast_the_model_again_the_unsafe_cast_button_says_so_and_casts_only_after_a_click_on_the_new_text():
    with loaded_shell(FP16_NAMES) as shell:
        shell.run_cell(FP16_SETUP, store_history=True)
        rw = widget(shell)
        stale = cast_button(rw)
        assert "Cast 2 trainable fp16 parameters" in stale.description
        model = shell.user_ns["model"]
        assert shell.run_cell(CAST_AGAIN, store_history=True).success  # Run All reaches the later cell
        assert fp16_dtypes(model) == [torch.float16] * 4

        stale.click()

        assert fp16_dtypes(model) == [torch.float16] * 4, "nothing may be cast on the report's stale text"
        assert "the objects changed since this report" in rw.status
        assert "“Cast 2 trainable fp16 parameters of model to fp32” would now be “Cast 4" in rw.status
        assert not rw.buttons("Click again to confirm"), "a click on stale text confirms nothing"
        fresh = cast_button(rw)
        assert "Cast 4 trainable fp16 parameters" in fresh.description  # the label re-read from the live objects
        assert "mixed-param-dtypes" not in {f.check for f in rw.report.findings}  # model.half() resolved it

        fresh.click()
        armed = only(rw.buttons("Click again to confirm"))
        assert "cast 4 trainable fp16 parameters" in armed.description
        armed.click()

        assert fp16_dtypes(model) == [torch.float32] * 4
        assert "fp16-trainable-params-with-scaler" not in {f.check for f in rw.report.findings}
        before = snapshot(model.parameters())
        assert shell.run_cell(FP16_STEP, store_history=True).success  # the user's step, again
        assert_step_trains(shell.user_ns["loss"], before, model.parameters())


def test_an_armed_confirmation_given_before_the_objects_changed_confirms_nothing():
    with loaded_shell(FP16_NAMES) as shell:
        shell.run_cell(FP16_SETUP, store_history=True)
        rw = widget(shell)
        cast_button(rw).click()
        armed = only(rw.buttons("Click again to confirm"))
        assert "cast 2 trainable fp16 parameters" in armed.description
        model = shell.user_ns["model"]
        assert shell.run_cell(CAST_AGAIN, store_history=True).success

        armed.click()

        assert fp16_dtypes(model) == [torch.float16] * 4
        assert "the objects changed since this report" in rw.status and "would now be “Cast 4" in rw.status
        assert not rw.buttons("Click again to confirm")
        assert "Cast 4 trainable fp16 parameters" in cast_button(rw).description


def test_an_unchanged_report_acts_on_the_first_click_of_a_safe_fix():
    with loaded_shell(BF16_NAMES) as shell:
        shell.run_cell(BF16_SETUP_CELL, store_history=True)
        rw = widget(shell)
        only(rw.buttons("Disable amp_scaler")).click()
        assert shell.user_ns["amp_scaler"].is_enabled() is False  # nothing changed: one click acts
        assert "objects changed" not in rw.status and rw.status.startswith("Applied “Disable amp_scaler")


def test_a_safe_fix_whose_finding_the_user_resolved_since_the_report_is_not_applied_and_the_widget_says_why():
    with loaded_shell(BF16_NAMES) as shell:
        shell.run_cell(BF16_SETUP_CELL, store_history=True)
        rw = widget(shell)
        button = only(rw.buttons("Disable amp_scaler"))
        assert shell.run_cell("model.float()", store_history=True).success  # the user's own fix, in a later cell

        button.click()

        scaler = shell.user_ns["amp_scaler"]
        assert scaler.is_enabled() is True, "the scaler of an fp32 model must not be disabled on stale text"
        assert "the objects changed since this report: scaler-with-bf16 on amp_scaler is no longer found" in rw.status
        assert "scaler-with-bf16" not in {f.check for f in rw.report.findings}
        assert not rw.buttons("Disable amp_scaler") and not rw.applied
        html = "".join(rw.html_values())
        assert "objects changed since this report" in html  # shown, not only kept in an attribute


def test_apply_all_safe_fixes_re_reads_the_live_objects_and_applies_nothing_stale():
    with loaded_shell(BF16_NAMES) as shell:
        shell.run_cell(BF16_SETUP_CELL, store_history=True)
        rw = widget(shell)
        apply_all = only(rw.buttons("Apply all safe fixes (1)"))
        assert shell.run_cell("model.float()", store_history=True).success

        apply_all.click()

        assert shell.user_ns["amp_scaler"].is_enabled() is True
        assert "the objects changed since this report: no longer needed: Disable amp_scaler (GradScaler)" in rw.status
        assert rw.apply_all_button.layout.display == "none"  # nothing safe is left to apply


# -- 2. after fixes applied through the API, each finding that left says why -----------------


def test_after_apply_safe_fixes_then_refresh_each_finding_that_left_says_why_in_text_html_and_dict():
    with loaded_shell(BF16_NAMES) as shell:
        shell.run_cell(BF16_SETUP_CELL, store_history=True)
        shell.run_cell(BF16_CLIP_LOOP_CELL, store_history=True)
        shell.run_cell("r = %mpdoctor --text", store_history=True)
        report = shell.user_ns["r"]
        assert {"scaler-with-bf16", "amp-clip-before-unscale"} <= {f.check for f in report.findings}
        assert report.departed == () and "since the last report" not in report.to_text()

        applied = report.apply_safe_fixes()
        assert [fx.title for fx in applied] == ["Disable amp_scaler (GradScaler)"]
        after = report.refresh()

        why = {d["check"]: d["why"] for d in after.departed}
        assert why["scaler-with-bf16"] == "fixed"
        assert why["amp-clip-before-unscale"] == "only fixable in code"
        clip = only(after.findings_for("amp-clip-before-unscale"))  # still shown, with its code
        assert "unscale_" in clip.fixes[0].code
        assert not after.findings_for("scaler-with-bf16")
        text = after.to_text()
        assert "since the last report:" in text
        assert "fixed: scaler-with-bf16  amp_scaler" in text
        assert "only fixable in code: amp-clip-before-unscale" in text
        html = after.to_html()
        assert "since the last report" in html and html.count("mpdoctor-departed") == len(after.departed)
        assert after.to_dict()["departed"] == [dict(d) for d in after.departed]
        assert "no mixed-precision problems found" not in html
        markdown = after.to_markdown()  # the bug-report export says it too
        assert "Since the last report:" in markdown and "- fixed: `scaler-with-bf16` on `amp_scaler`" in markdown
        assert "- only fixable in code: `amp-clip-before-unscale`" in markdown

        # The widget's status line reads the same decision.
        rw = ReportWidget(after)
        rw.confirm_delay = 0.0
        rw._refresh("Re-diagnosed the live objects")
        assert departures_sentence(list(rw.report.departed)) in rw.status

        # The user's loop, run again, trains (the clip is still before unscale_: its code is what is left to do).
        model = shell.user_ns["model"]
        before = snapshot(model.parameters())
        assert shell.run_cell(BF16_CLIP_LOOP_CELL, store_history=True).success
        assert_step_trains(shell.user_ns["loss"], before, model.parameters())


def test_a_finding_the_users_own_code_resolved_is_not_called_fixed_by_a_fix():
    with loaded_shell(FP16_NAMES) as shell:
        shell.run_cell(FP16_SETUP, store_history=True)
        shell.run_cell("r = %mpdoctor --text", store_history=True)
        report = shell.user_ns["r"]
        assert report.findings_for("mixed-param-dtypes")
        assert shell.run_cell(CAST_AGAIN, store_history=True).success
        after = report.refresh()
        assert {d["check"]: d["why"] for d in after.departed} == {"mixed-param-dtypes": "changed outside"}
        assert "no longer found (changed outside mpdoctor, no fix applied): mixed-param-dtypes  model" in after.to_text()


def test_a_healthy_setup_refreshed_shows_no_section_and_no_finding():
    with loaded_shell(FP16_NAMES) as shell:
        shell.run_cell(FP16_SETUP.replace("model[0].half()\n", "").replace('amp_scaler = torch.amp.GradScaler("cpu")\n', ""), store_history=True)
        shell.run_cell("r = %mpdoctor --text", store_history=True)
        after = shell.user_ns["r"].refresh()
        counts = after.counts()
        assert counts["error"] == 0 and counts["warning"] == 0, after.to_text()
        assert after.departed == () and after.to_dict()["departed"] == []
        assert "since the last report" not in after.to_text() and "since the last report" not in after.to_html()
