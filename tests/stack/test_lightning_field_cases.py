"""Field cases from the Lightning tracker: true-half precision with a stock optimizer, named before ``fit``.

Each case measures the harm with a real ``lightning.Trainer`` on the CPU, reads mpdoctor's diagnosis of the
objects as the user holds them before ``fit`` (the module still fp32, no optimizer built yet), applies the fix it
plans (the Trainer's plugin swapped in place for the one ``precision="bf16-mixed"`` builds) and trains; undo
restores the Trainer exactly. The cures on the user's own ``fit`` (API and widget) are in ``test_cures_stack.py``.
"""

from __future__ import annotations

import lightning as L
import torch
from fingerprint import assert_unchanged, fingerprint

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


class Recording(Regressor):
    """Records what each ``training_step`` sees: the batch's, the weight's and the output's dtypes, whether autocast
    is on, the default dtype and ``module.dtype``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple] = []

    def training_step(self, batch, i):
        out = self.layer(batch[0])
        self.seen.append(tuple(str(d).replace("torch.", "") for d in (batch[0].dtype, self.layer.weight.dtype, out.dtype))
                         + (torch.is_autocast_enabled("cpu"), str(torch.get_default_dtype()).replace("torch.", ""),
                            str(self.dtype).replace("torch.", "")))  # fmt: skip
        return super().training_step(batch, i)


class RecordingRegressor(Regressor):
    """The regressor recording each step's loss (``losses``)."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def training_step(self, batch, i):
        loss = super().training_step(batch, i)
        self.losses.append(float(loss.detach()))
        return loss


class AdamRegressor(RecordingRegressor):
    """Lightning-AI/pytorch-lightning#20619's optimizer: ``torch.optim.Adam`` with its default ``eps=1e-8``; records
    each step's loss."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def lightning_fingerprint(ns: dict, monkeypatch) -> dict:
    """The fingerprint of ``ns`` with Lightning's objects (and this module's LightningModules) walked attribute by
    attribute: the plugin in the strategy and the connector, the flags, the module's tensors and the optimizer."""
    import fingerprint as fp

    monkeypatch.setattr(fp, "WALKED_MODULES", fp.WALKED_MODULES | {"lightning", __name__.split(".")[0]})
    return fingerprint(ns)


def loader(scale: float = 1.0):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, generator=g) * scale
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=2)


def changed_share(module: Regressor, trainer: L.Trainer) -> float:
    """The share of weights that moved in ``fit``, against the start in the dtype the weights train in."""
    start = module.layer.weight.detach()
    before = (start.bfloat16() if trainer.precision == "bf16-true" else start).float().clone()
    trainer.fit(module, loader())
    return (module.layer.weight.detach().float() != before).float().mean().item()


def test_bf16_true_with_a_stock_adamw_in_configure_optimizers_is_named_before_fit_and_fixed_in_place(monkeypatch):
    """Lightning-AI/pytorch-lightning#19980 (``precision="bf16-true"`` "yields a very bad learning curve" next to
    ``bf16-mixed``): the weights are bf16 and AdamW updates them with no fp32 master copy. The planned fix gives the
    Trainer the plugin ``bf16-mixed`` builds, in place; undo puts the very plugin back.

    https://github.com/Lightning-AI/pytorch-lightning/issues/19980
    """
    assert changed_share(Regressor(), L.Trainer(precision="bf16-true", **SETTINGS)) < 0.5  # the harm: updates lost

    module, trainer = Regressor(), L.Trainer(precision="bf16-true", **SETTINGS)
    report = mpdoctor.diagnose(module, trainer, names={id(module): "module", id(trainer): "trainer"})
    finding = next(f for f in report.findings if f.check == "lightning-true-half-adam")
    assert finding.severity == "warning" and "configure_optimizers" in finding.message and "AdamW" in finding.message
    assert finding.evidence["optimizer"] == "torch.optim.adamw.AdamW"
    fix = finding.fixes[0]
    assert fix in report.fixes and fix.applicability.value == "unsafe" and fix.recipe == "lightning-bf16-mixed-in-place"
    ns = {"module": module, "trainer": trainer}
    before = lightning_fingerprint(ns, monkeypatch)
    fix.apply()
    assert fix.applied and trainer.precision == "bf16-mixed", fix.error
    assert not [f for f in mpdoctor.diagnose(module, trainer).findings if f.severity in ("error", "warning")]
    fix.undo()
    assert_unchanged(before, lightning_fingerprint(ns, monkeypatch), "undo of the in-place bf16-mixed plugin")
    assert trainer.precision == "bf16-true"
    fix.apply()
    assert changed_share(module, trainer) == 1.0  # fp32 master weights: every update lands


def test_the_in_place_plugin_makes_fit_run_as_a_trainer_built_with_bf16_mixed():
    """What ``training_step`` sees (input, weight and output dtypes, autocast, the default dtype, ``module.dtype``), the
    optimizer's parameter and state dtypes and the trained weights, bit for bit: the bf16-true Trainer fixed in place
    and a Trainer built with ``precision="bf16-mixed"`` run the same ``fit``."""

    def run(trainer: L.Trainer) -> tuple:
        module = Recording()
        trainer.fit(module, loader())
        opt = trainer.optimizers[0]
        dtypes = sorted({str(t.dtype).replace("torch.", "") for p in module.parameters() for t in [p, *opt.state[p].values()] if t.is_floating_point()})
        return module.seen, dtypes, module.layer.weight.detach().clone(), trainer.precision

    built = run(L.Trainer(precision="bf16-mixed", **SETTINGS))
    trainer = L.Trainer(precision="bf16-true", **SETTINGS)
    unfixed = run(L.Trainer(precision="bf16-true", **SETTINGS))
    report = mpdoctor.diagnose(Recording(), trainer)
    (fix,) = [f for f in report.fixes if f.slug == "lightning-true-half-adam"]
    fix.apply()
    fixed = run(trainer)
    assert built[0] == [("float32", "float32", "bfloat16", True, "float32", "float32")] * 2
    assert unfixed[0] != built[0]  # the test can tell the two recipes apart
    assert fixed[0] == built[0] and fixed[1] == built[1] == ["float32"] and fixed[3] == built[3] == "bf16-mixed"
    assert torch.equal(fixed[2], built[2])


def test_after_a_bf16_true_fit_the_module_comes_back_to_fp32_and_the_next_fit_trains(monkeypatch):
    """Between fits: the first ``fit`` cast the module to bf16 (parameters, grads, Adam state, ``module.dtype``); the
    fix casts it back with the plugin swap, the next ``fit`` trains fp32 weights under bf16 autocast, and undo
    restores every tensor and flag exactly."""
    module, trainer = Recording(), L.Trainer(precision="bf16-true", **SETTINGS)
    trainer.fit(module, loader())
    assert module.layer.weight.dtype == torch.bfloat16 and module.dtype == torch.bfloat16
    report = mpdoctor.diagnose(trainer, names={id(trainer): "trainer"})
    (fix,) = [f for f in report.fixes if f.slug == "lightning-true-half-adam"]
    ns = {"trainer": trainer}
    before = lightning_fingerprint(ns, monkeypatch)
    fix.apply()
    opt = trainer.optimizers[0]
    assert module.layer.weight.dtype == module.layer.weight.grad.dtype == module.dtype == torch.float32
    assert all(t.dtype == torch.float32 for st in opt.state.values() for t in st.values() if t.is_floating_point())
    fix.undo()
    assert_unchanged(before, lightning_fingerprint(ns, monkeypatch), "undo of the plugin swap and the fp32 cast")
    fix.apply()
    trainer.fit_loop.epoch_loop.max_steps += 2  # two more steps on the same Trainer
    start = module.layer.weight.detach().clone()
    trainer.fit(module, loader())
    assert module.seen[-2:] == [("float32", "float32", "bfloat16", True, "float32", "float32")] * 2
    assert bool((module.layer.weight != start).all()) and module.layer.weight.dtype == torch.float32


def test_bf16_mixed_and_a_module_without_a_named_stock_adam_draw_nothing():
    module = Regressor()
    report = mpdoctor.diagnose(module, L.Trainer(precision="bf16-mixed", **SETTINGS))
    assert not [f for f in report.findings if f.check == "lightning-true-half-adam"]
