"""The between-steps checks on the training stack's own objects: Lightning's ``accumulate_grad_batches`` and a
LightningModule's torchmetrics metric, each read from a real Trainer / module and fixed in place."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from steps import assert_step_trains, snapshot
from torchmetrics.aggregation import MeanMetric

import mpdoctor


class LitRegressor(pl.LightningModule):
    """A LightningModule logging its loss with a torchmetrics metric, as the Lightning docs recommend."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(16, 1)
        self.train_loss = MeanMetric()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x.to(self.net.weight.dtype)).float(), y)
        self.train_loss.update(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(accumulate: int) -> pl.Trainer:
    return pl.Trainer(accumulate_grad_batches=accumulate, max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")  # fmt: skip


def test_lightning_accumulate_grad_batches_over_a_bf16_module_is_named_and_fixed_then_fit_trains():
    module = LitRegressor().to(torch.bfloat16)
    tr = trainer(16)
    report = mpdoctor.diagnose(namespace={"module": module, "trainer": tr})
    (accumulation,) = report.findings_for("half-grad-accumulation")
    assert accumulation.evidence["accumulation_steps"] == 16
    assert accumulation.evidence["setting"] == "trainer: Trainer(accumulate_grad_batches=...)"
    (metric,) = report.findings_for("metric-states-half")
    assert metric.subject == "module.train_loss"

    accumulation.fixes[0].apply()
    metric.fixes[0].apply()
    assert module.net.weight.dtype == torch.float32 and module.train_loss.mean_value.dtype == torch.float32
    refreshed = report.refresh()
    assert refreshed.findings_for("half-grad-accumulation") == refreshed.findings_for("metric-states-half") == []

    data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    before = snapshot(module.parameters())
    tr.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    assert_step_trains(module.train_loss.compute(), before, module.parameters())


def test_healthy_twin_fp32_module_under_bf16_mixed_with_accumulation_draws_nothing():
    module = LitRegressor()
    tr = pl.Trainer(accumulate_grad_batches=16, precision="bf16-mixed", max_steps=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu")  # fmt: skip
    report = mpdoctor.diagnose(namespace={"module": module, "trainer": tr})
    assert [f.check for f in report.findings if f.severity in ("error", "warning")] == []
