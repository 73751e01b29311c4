"""Field cases from the Lightning tracker: true-half precision with a stock optimizer, named before ``fit``.

Each case measures the harm with a real ``lightning.Trainer`` on the CPU, reads mpdoctor's diagnosis of the
objects as the user holds them before ``fit`` (the module still fp32, no optimizer built yet), then runs the fix
it shows and trains.
"""

from __future__ import annotations

import lightning as L
import torch

import mpdoctor

SETTINGS = dict(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0)  # fmt: skip


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(16, 16)

    def training_step(self, batch, _):
        (x,) = batch
        return torch.nn.functional.mse_loss(self.layer(x).float(), x.float())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-5)


def loader():
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 16, generator=g)), batch_size=2)


def changed_share(module: Regressor, trainer: L.Trainer) -> float:
    """The share of weights that moved in ``fit``, against the start in the dtype the weights train in."""
    start = module.layer.weight.detach()
    before = (start.bfloat16() if trainer.precision == "bf16-true" else start).float().clone()
    trainer.fit(module, loader())
    return (module.layer.weight.detach().float() != before).float().mean().item()


def test_bf16_true_with_a_stock_adamw_in_configure_optimizers_is_named_before_fit_and_bf16_mixed_trains():
    """Lightning-AI/pytorch-lightning#19980 (``precision="bf16-true"`` "yields a very bad learning curve" next to
    ``bf16-mixed``): the weights are bf16 and AdamW updates them with no fp32 master copy.

    https://github.com/Lightning-AI/pytorch-lightning/issues/19980
    """
    assert changed_share(Regressor(), L.Trainer(precision="bf16-true", **SETTINGS)) < 0.5  # the harm: updates lost

    module, trainer = Regressor(), L.Trainer(precision="bf16-true", **SETTINGS)
    report = mpdoctor.diagnose(module, trainer, names={id(module): "module", id(trainer): "trainer"})
    finding = next(f for f in report.findings if f.check == "lightning-true-half-adam")
    assert finding.severity == "warning" and "configure_optimizers" in finding.message and "AdamW" in finding.message
    assert finding.evidence["optimizer"] == "torch.optim.adamw.AdamW"
    code = finding.fixes[0].code  # display-only: the Trainer is rebuilt
    namespace = {"L": L}
    before = ", ".join(f"{k}={v!r}" for k, v in SETTINGS.items() if f"{k}=" not in code)  # "other arguments as before"
    exec(code.replace("...", before), namespace)  # noqa: S102 - the report's own snippet
    assert changed_share(module, namespace["trainer"]) == 1.0  # fp32 master weights: every update lands


def test_bf16_mixed_and_a_module_without_a_named_stock_adam_draw_nothing():
    module = Regressor()
    report = mpdoctor.diagnose(module, L.Trainer(precision="bf16-mixed", **SETTINGS))
    assert not [f for f in report.findings if f.check == "lightning-true-half-adam"]
