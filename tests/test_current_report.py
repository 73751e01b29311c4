"""One mistake, one current finding: after the user corrects a cell and runs it again, the report follows.

The new user's notebook: an fp32 net trained under fp16 autocast with a GradScaler, in a loop that calls
``opt.step()`` directly; then an unrelated bf16 head fed a float32 batch, which raises. In a real
``InteractiveShell``, cells run as a notebook front end runs them (with a cell id, as JupyterLab, Notebook 7, VS
Code and Colab send one; and without, as a plain IPython does).
"""

from __future__ import annotations

import pytest
from notebook_shell import loaded_shell

pytestmark = pytest.mark.colab

SETUP = """
import torch
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
head = torch.nn.Linear(8, 2).to(torch.bfloat16)
x = torch.randn(16, 8)
"""

LOOP_WRONG = """
for _ in range(3):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = net(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    opt.step()
"""

LOOP_RIGHT = LOOP_WRONG.replace("    opt.step()\n", "    scaler.step(opt)\n    scaler.update()\n")

HEAD_WRONG = "logits = head(x)\n"
HEAD_RIGHT = "logits = head(x.to(torch.bfloat16))\n"

NAMES = ("torch", "net", "opt", "scaler", "head", "x", "loss", "logits", "r", "_")


def _errors(sh) -> list[str]:
    sh.run_cell("r = %mpdoctor --text", store_history=True)
    report = sh.user_ns["r"]
    return sorted(f"{f.check}@{f.subject}" for f in report.findings if f.severity == "error")


def _run(sh, code: str, cell_id: str | None):
    return sh.run_cell(code, store_history=True, cell_id=cell_id)


@pytest.mark.parametrize("ids", [True, False], ids=["cell-ids", "no-cell-ids"])
def test_after_the_user_corrects_both_cells_and_runs_them_again_the_report_holds_no_stale_error(ids):
    with loaded_shell(NAMES) as sh:
        _run(sh, SETUP, "setup" if ids else None)
        assert _run(sh, LOOP_WRONG, "loop" if ids else None).success
        assert not _run(sh, HEAD_WRONG, "head" if ids else None).success  # the real error
        before = _errors(sh)
        assert any(e.startswith("amp-step-bypasses-scaler") for e in before), before
        # The crash is one finding, under the user's name for the object, never "<module>" or "_".
        crash = [e for e in before if "dtype" in e or "matmul" in e]
        assert len(crash) == 1 and crash[0].endswith("@head"), before
        # The same crash again, then the user corrects both cells (the same cells, by id) and runs them again.
        assert not _run(sh, HEAD_WRONG, "head" if ids else None).success
        if ids:
            assert _run(sh, LOOP_RIGHT, "loop").success
            assert _run(sh, HEAD_RIGHT, "head").success
        else:  # without ids, a cell is the same cell when it is the same code: the fix applied in place, run again
            sh.run_cell("head.float()", store_history=True)
            assert _run(sh, HEAD_WRONG, None).success
            assert _run(sh, LOOP_RIGHT, None).success
        after = _errors(sh)
        if ids:
            assert after == [], after
        else:  # the replaced loop cell cannot be told from a new one: its old code is still read
            assert [e for e in after if not e.startswith("amp-step-bypasses-scaler")] == [], after


def test_a_crash_of_a_cell_that_has_not_run_cleanly_since_stays_in_the_report():
    with loaded_shell(NAMES) as sh:
        _run(sh, SETUP, "setup")
        assert not _run(sh, HEAD_WRONG, "head").success
        assert _run(sh, "y = 1\n", "other").success  # another cell ran cleanly: the crash is still current
        errors = _errors(sh)
        assert len([e for e in errors if e.endswith("@head")]) == 1, errors


def test_a_fix_whose_change_is_already_in_place_draws_no_button_and_says_so():
    """An older report is still on screen when the user applies the same fix from a newer ``%mpdoctor``: the older
    card's button would change nothing (a button that does nothing is a defect), so it is not drawn, the card says
    the change is already in place, and that report's plan no longer holds it."""
    from mpdoctor.attach.runtime.assembly import assemble

    with loaded_shell(NAMES) as sh:
        _run(sh, SETUP, "setup")
        sh.run_cell("older = %mpdoctor --text", store_history=True)
        sh.run_cell("newer = %mpdoctor --text", store_history=True)
        older, newer = sh.user_ns["older"], sh.user_ns["newer"]
        (on_screen,) = [fx for fx in older.fixes if fx.slug == "scaler-with-bf16"]
        widget = older.widget()
        assert any(on_screen in fixes for _button, fixes in widget.fix_buttons)
        (fix,) = [fx for fx in newer.fixes if fx.key == on_screen.key]
        assert not on_screen.in_place and not fix.in_place
        fix.apply()
        assert fix.applied and not fix.in_place  # applied: shown as applied, with Undo
        assert on_screen.in_place and not on_screen.applied
        assert not sh.user_ns["scaler"].is_enabled()
        (view,) = [fv for f in older.to_dict()["findings"] for fv in f["fixes"] if fv["title"] == on_screen.title]
        assert view["in_place"] and not view["planned"] and view["note"].startswith("already in place")
        assert "[already in place]" in older.to_text()
        widget._render()  # the older card, drawn again (any click on it does this)
        assert all(on_screen not in fixes for _button, fixes in widget.fix_buttons)
        assert any("already in place" in v for v in widget.html_values())
        assert on_screen not in assemble(older).fixes
        fix.undo()
        assert not on_screen.in_place  # the change is gone again: its button is back
        widget._render()
        assert any(on_screen in fixes for _button, fixes in widget.fix_buttons)
