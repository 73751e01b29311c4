"""Lightning-AI/pytorch-lightning#18089 in a notebook: the clip in ``training_step`` under 16-mixed, corrected by moving
it into ``on_before_optimizer_step`` of the user's own class cell (main venv only: needs Lightning)."""

from __future__ import annotations

import pytest
from notebook_shell import loaded_shell

from mpdoctor.attach.runtime.twins import try_on_twins

pytest.importorskip("lightning")

SETUP = """\
import torch
import torch.nn.functional as F
import lightning as L
from lightning.pytorch.plugins.precision import MixedPrecision

X = torch.randn(32, 8, generator=torch.Generator().manual_seed(1)) * 10
Y = torch.randn(32, 1, generator=torch.Generator().manual_seed(2)) * 10
applied = []

def grad_norm(params):
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])))
"""

#: The manual-optimization example of Lightning's docs: the clip after manual_backward, before opt.step().
CLASS_CELL = """\
class ClipModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = F.mse_loss(self.net(batch[0]), batch[1])
        opt.zero_grad()
        self.manual_backward(loss)
        {clip}
        opt.step()
        applied.append(grad_norm(self.parameters()))
        return loss
{hook}
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
"""

DOC_CLIP = 'self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")'

FIT_CELL = """\
applied.clear()
trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))])
model = ClipModel()
trainer.fit(model, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8))
"""

NAMES = ("torch", "F", "L", "MixedPrecision", "X", "Y", "applied", "grad_norm", "ClipModel", "trainer", "model", "r")


def _run(sh, code: str) -> None:
    result = sh.run_cell(code, store_history=True)
    assert result.error_in_exec is None and result.error_before_exec is None, result


@pytest.mark.parametrize("clip", [DOC_CLIP, "torch.nn.utils.clip_grad_norm_(self.parameters(), 0.5)"])
def test_18089_clip_in_training_step_is_corrected_into_on_before_optimizer_step(clip):
    """Lightning-AI/pytorch-lightning#18089: the docs' manual optimization clips in ``training_step``, before the
    16-mixed plugin unscales. The fix is the class cell corrected (the clip in ``on_before_optimizer_step``, the
    optimizer local mapped to the hook's argument), run on copies before it is shown, then for real.

    https://github.com/Lightning-AI/pytorch-lightning/issues/18089
    """
    with loaded_shell(NAMES) as sh:
        _run(sh, SETUP)
        _run(sh, CLASS_CELL.format(clip=clip, hook=""))
        _run(sh, FIT_CELL)
        ns = sh.user_ns
        # Harm, measured: every step applied gradients of norm 0.5 / 1024 (clipped in scaled units).
        assert len(ns["applied"]) == 3 and all(n == pytest.approx(0.5 / 1024, rel=1e-2) for n in ns["applied"])
        before = ns["ClipModel"]
        _run(sh, "r = %mpdoctor --text")
        report = ns["r"]
        (finding,) = report.findings_for("amp-clip-before-unscale")
        (fix,) = finding.fixes
        assert fix.recipe == "corrected-cell" and fix.applicability.value == "display-only"
        assert "def on_before_optimizer_step(self, optimizer):" in fix.code
        moved = clip.replace("(opt,", "(optimizer,").replace('"norm"', "'norm'")
        assert f"        {moved}" in fix.code  # the optimizer local, mapped to the hook's argument
        assert fix.code.count(moved) == 1  # gone from training_step
        (trial,) = [t for fx, t in report.trials if fx is fix or fx.code == fix.code]  # run on twins before shown
        assert trial.ran, trial.sentence()
        assert ns["ClipModel"] is before and len(ns["applied"]) == 3  # the copies ran it, not the namespace
        assert try_on_twins(fix.code, ns).ran and ns["ClipModel"] is before
        # Then for real: the corrected cell, a new instance, fit again: the applied norm is 0.5.
        _run(sh, fix.code)
        assert ns["ClipModel"] is not before
        _run(sh, FIT_CELL)
        assert len(ns["applied"]) == 3 and all(n == pytest.approx(0.5, rel=1e-2) for n in ns["applied"])
        _run(sh, "r = %mpdoctor --text")
        assert not [f for f in ns["r"].findings if f.check == "amp-clip-before-unscale"]


HOOK = """
    def on_before_optimizer_step(self, optimizer):
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
"""


def test_18089_healthy_twin_clip_already_in_the_hook_draws_nothing():
    with loaded_shell(NAMES) as sh:
        _run(sh, SETUP)
        _run(sh, CLASS_CELL.format(clip="pass", hook=HOOK))
        _run(sh, FIT_CELL)
        assert all(n == pytest.approx(0.5, rel=1e-2) for n in sh.user_ns["applied"])
        _run(sh, "r = %mpdoctor --text")
        loud = [f for f in sh.user_ns["r"].findings if f.severity in ("error", "warning")]
        assert loud == [], [(f.check, f.message) for f in loud]


def test_18089_an_optimizer_local_not_bound_to_self_optimizers_keeps_the_advice():
    """The clip reads a local the hook cannot be given (a scale computed in ``training_step``): no corrected cell."""
    with loaded_shell(NAMES) as sh:
        _run(sh, SETUP)
        cell = CLASS_CELL.format(clip="limit = 0.5\n        torch.nn.utils.clip_grad_norm_(self.parameters(), limit)",
                                 hook="")  # fmt: skip
        _run(sh, cell)
        _run(sh, FIT_CELL)
        _run(sh, "r = %mpdoctor --text")
        (finding,) = sh.user_ns["r"].findings_for("amp-clip-before-unscale")
        (fix,) = finding.fixes
        assert fix.recipe != "corrected-cell" and "def on_before_optimizer_step" in fix.code
