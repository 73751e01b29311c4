"""The run's pictures show the right thing: the reported cell's steps, one series per scaler, no contradiction."""

from __future__ import annotations

import re

import pytest
import torch
from notebook_shell import loaded_shell

import mpdoctor
from mpdoctor.render.svg import scale_history_svg

pytestmark = pytest.mark.colab

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(16, 8)
def steps(n, clip_before_unscale=False):
    for _ in range(n):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if clip_before_unscale:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
"""


@pytest.fixture
def shell():
    with loaded_shell(("model", "optimizer", "scaler", "x", "steps", "r")) as sh:
        yield sh


def test_a_cells_report_pictures_that_cells_steps_only(shell, capsys):
    from mpdoctor.attach.runtime import session

    shell.run_cell(SETUP, store_history=True)
    shell.run_cell("steps(5)", store_history=True)  # healthy: nothing shown
    capsys.readouterr()
    observer = session.observer(shell)
    before = len(observer.scale_history)
    shell.run_cell("steps(3, clip_before_unscale=True)", store_history=True)
    out = capsys.readouterr().out
    assert "amp-clip-before-unscale" in out
    assert re.search(r"scaler: 3 steps \(1\.\.3\)|scaler: 3 steps \(6\.\.8\)", out), out
    assert len(observer.scale_history) == before + 3


def test_two_scalers_known_by_one_name_are_two_series_never_merged(shell, capsys):
    shell.run_cell(SETUP, store_history=True)
    shell.run_cell("steps(4)", store_history=True)
    shell.run_cell('scaler = torch.amp.GradScaler("cpu")\nsteps(4)', store_history=True)
    capsys.readouterr()
    shell.run_cell("r = %mpdoctor --text", store_history=True)
    text = shell.user_ns["r"].to_text()
    # The scaler the name holds now is "scaler"; the one it replaced says which cell ran it.
    first_cell = shell.execution_count - 3
    assert f"scaler, an earlier one (discarded; ran in cell [{first_cell}]): 4 steps (1..4)" in text, text
    assert "\n  scaler: 4 steps (1..4)" in text and "scaler (2)" not in text, text
    assert "8 steps" not in text
    html = shell.user_ns["r"].to_html()
    assert f"scaler, an earlier one (discarded; ran in cell [{first_cell}])" in html


def test_a_chart_with_no_skipped_step_says_so_and_no_red_count():
    rows = [{"scaler": "scaler", "step": i, "scale": 65536.0, "skipped": False, "loss": 1.0} for i in range(1, 5)]
    svg = scale_history_svg(rows, "scaler")
    assert "no skipped step" in svg and "\u2715 0" not in svg
    rows[2]["skipped"] = True
    assert "\u2715 1 skipped step" in scale_history_svg(rows, "scaler")


def test_the_scaler_panel_does_not_deny_the_scaler_whose_chart_it_shows(shell, capsys):
    shell.run_cell(SETUP, store_history=True)
    shell.run_cell("steps(3, clip_before_unscale=True)", store_history=True)
    from mpdoctor.attach.runtime import session

    observer = session.observer(shell)
    report = session.cell_report(observer, observer.findings)
    html = report.to_html()
    assert "loss scale" in html and "No GradScaler among the inspected objects" not in html
    empty = mpdoctor.diagnose(torch.nn.Linear(2, 2))
    assert "No GradScaler among the inspected objects" in empty.to_html()


def test_a_watchers_report_says_it_inspected_nothing_instead_of_denying_the_model_and_scaler(shell, capsys):
    from mpdoctor.attach.runtime import session
    from mpdoctor.render.widget import ReportWidget

    shell.run_cell(SETUP, store_history=True)
    # optimizer.step() straight after the scaled backward: the watcher sees it, and no scaler step ever runs.
    shell.run_cell(
        "optimizer.zero_grad()\nscaler.scale(model(x).pow(2).mean()).backward()\noptimizer.step()", store_history=True
    )
    observer = session.observer(shell)
    report = session.cell_report(observer, observer.findings)
    assert "amp-step-bypasses-scaler" in {f.check for f in report.findings}
    rw = ReportWidget(report)
    for html in (report.to_html(), rw.dtypes_panel.value, rw.scaler_panel.value):
        assert "No GradScaler among the inspected objects" not in html and "No tensors." not in html
        assert "loop watcher saw as the cell ran; it inspected no objects" in html
    assert "No scaler step or update ran in it." in rw.scaler_panel.value
    # Its tabs would each say that it inspected nothing: they are hidden, and the widget says it once.
    assert rw.panel_titles() == ["precision", "issue report"]
    assert "it inspected no objects" in rw.watcher_note.value
    rw.close()
    inspected = mpdoctor.diagnose(torch.nn.Linear(2, 2))  # a report of inspected objects keeps the plain words
    assert "No GradScaler among the inspected objects" in inspected.to_html()
    assert "inspected no objects" not in inspected.to_html()


def test_a_run_whose_every_loss_is_inf_is_told_as_soon_as_the_scale_falls_below_one():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(16, 8)
    scales = []
    with mpdoctor.watch(model, opt, scaler) as w:
        for _ in range(20):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().mean() * float("inf")
            scaler.scale(loss).backward()
            scales.append(scaler.get_scale())
            scaler.step(opt)
            scaler.update()
    # Harm: no step trained, and the scale collapsed (65536 -> 2**-4 after 20 halvings).
    assert scaler.get_scale() < 1.0 and "step" not in opt.state_dict()["state"].get(0, {})
    found = [f for f in w.protocol.findings if f.check == "amp-scale-unsettled"]
    assert len(found) == 1, [f.check for f in w.protocol.findings]
    # told at the first step run with a scale below 1, not after some fixed number of steps
    first_below_one = next(i for i, s in enumerate(scales, 1) if s < 1.0)
    assert found[0].evidence["step"] == first_below_one
    assert "every one of its" in found[0].message


def test_watch_speaks_at_the_first_nonfinite_loss_even_when_the_scaler_skips_every_step(capsys):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(16, 8)
    x[0, 0] = float("inf")  # one bad sample: every loss is inf, every step skipped, optimizer.step never runs
    with mpdoctor.watch(model, opt, scaler) as w:
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert not torch.isfinite(loss) and "step" not in opt.state_dict()["state"].get(0, {})
    events = [e["event"] for e in w.events]
    assert events[:2] == ["nonfinite-loss", "skipped-step"], w.events
    assert w.events[0]["step"] == 0  # no optimizer step ever ran: it was told at the scaler's first (skipped) step
    assert w.probe_report is not None  # the batch was probed at the first step, as the README promises
    assert "non-finite" in capsys.readouterr().out.lower() or w.probe_report.counts()["error"]


def test_watch_stop_on_nonfinite_stops_at_a_skipped_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.full((4, 8), float("inf"))
    from mpdoctor.attach.training.watch import NonFiniteLoss

    with pytest.raises(NonFiniteLoss):
        with mpdoctor.watch(model, opt, scaler, stop_on_nonfinite=True):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
