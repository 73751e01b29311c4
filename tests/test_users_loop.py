"""The corrected lines a watched cell shows are the user's own loop, corrected: never the rule's template, whose
names (``loader``, ``loss_fn``, ``max_norm``) the user's namespace may not hold. As notebook 09 runs its lessons."""

from __future__ import annotations

import pytest
import torch
from notebook_shell import loaded_shell

pytestmark = pytest.mark.colab

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(8)]
"""

CLIP_FIRST = """
for x, y in data:
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    scaler.step(optimizer)
    scaler.update()
"""

UNSCALE_EACH_MICRO_BATCH = """
accum = 4
for i, (x, y) in enumerate(data):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y) / accum
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    if (i + 1) % accum == 0:
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
"""

_NAMES = ("model", "optimizer", "scaler", "data", "x", "y", "loss", "i", "accum", "r")


@pytest.fixture
def shell():
    with loaded_shell(_NAMES) as sh:
        yield sh


def _runs_and_trains(shell, code: str) -> None:
    """The shown code, run as the user would paste it, trains the model and breaks no rule the watcher knows."""
    before = shell.user_ns["model"].weight.detach().clone()
    result = shell.run_cell(code, store_history=True)
    assert result.error_in_exec is None, result.error_in_exec
    assert not torch.equal(before, shell.user_ns["model"].weight.detach())


def test_a_watched_cell_shows_its_own_loop_corrected_and_the_code_runs(shell, capsys):
    shell.run_cell(SETUP, store_history=True)
    shell.run_cell(CLIP_FIRST, store_history=True)
    out = capsys.readouterr().out
    assert "amp-clip-before-unscale" in out
    # The template would say clip_grad_norm_(model.parameters(), max_norm), with max_norm unbound here.
    assert "max_norm)" not in out and "max_norm=1.0" in out
    assert "scaler.unscale_(optimizer)" in out
    r = shell.run_cell("r = %mpdoctor --text", store_history=True).result
    (finding,) = [f for f in shell.user_ns["r"].findings if f.check == "amp-clip-before-unscale"]
    assert len(finding.fixes) == 1, "one mistake, one fix"  # the template is not shown beside the user's loop
    assert "max_norm=1.0" in finding.fixes[0].code
    del r
    capsys.readouterr()  # what %mpdoctor printed
    _runs_and_trains(shell, finding.fixes[0].code)
    assert "amp-clip-before-unscale" not in capsys.readouterr().out


def test_a_raising_cell_shows_its_own_loop_corrected_and_the_code_runs(shell, capsys):
    shell.run_cell(SETUP, store_history=True)
    result = shell.run_cell(UNSCALE_EACH_MICRO_BATCH, store_history=True)
    assert "unscale_() has already been called" in str(result.error_in_exec)  # the real error first
    out = capsys.readouterr().out
    assert "amp-unscale-twice" in out
    assert "loader" not in out and "loss_fn" not in out, "the rule's template, not the user's loop"
    shell.run_cell("r = %mpdoctor --text", store_history=True)
    (finding,) = [f for f in shell.user_ns["r"].findings if f.check == "amp-unscale-twice"]
    (fix,) = finding.fixes
    assert "enumerate(data)" in fix.code and "loader" not in fix.code
    shell.user_ns["optimizer"].zero_grad()
    shell.user_ns["scaler"] = torch.amp.GradScaler("cpu")  # the failed run left the old scaler mid-step
    capsys.readouterr()  # what %mpdoctor printed
    _runs_and_trains(shell, fix.code)
    assert "amp-unscale-twice" not in capsys.readouterr().out
