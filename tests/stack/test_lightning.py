"""Lightning: discovery of a Trainer / Fabric, precision requested vs effective, its checks, its callback.

Real ``lightning.Trainer(max_steps=1, accelerator="cpu", ...)`` fits on a tiny module; no mocks.
"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch

import mpdoctor
from mpdoctor.libraries.lightning.facts import (
    CPU_FALLBACK_WARNING,
    LightningPrecisionFacts,
    lightning_effective,
)
from mpdoctor.objects.discovery.subjects import discover


class Tiny(L.LightningModule):
    def __init__(self, optimizer=torch.optim.AdamW, **opt_kwargs):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.opt_cls, self.opt_kwargs = optimizer, {"lr": 1e-3, **opt_kwargs}
        self.losses: list[float] = []

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x).float(), y.float())
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return self.opt_cls(self.parameters(), **self.opt_kwargs)


def loader(scale: float = 1.0):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g) * scale
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def trainer(precision: str, **kw) -> L.Trainer:
    return L.Trainer(
        max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, precision=precision, **kw,
    )  # fmt: skip


AS_BEFORE = "max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False"


def run_fix_code(code: str) -> L.Trainer:
    """Execute a display-only fix's snippet as written, its ``...`` ("other arguments as before") filled in."""
    assert code.count("...") == 1 and "other arguments as before" in code, code
    namespace = {"L": L}
    exec(code.replace("...", AS_BEFORE), namespace)  # noqa: S102 - the report's own snippet
    return namespace["trainer"]


def fit_trains(t: L.Trainer, m: Tiny, data) -> None:
    """``t.fit(m, data)`` must train: finite loss, the weights moved."""
    before = [p.detach().float().clone() for p in m.parameters()]
    t.fit(m, data)
    assert m.losses and all(torch.isfinite(torch.tensor(m.losses))), m.losses
    assert any(not torch.equal(b, p.detach().float()) for b, p in zip(before, m.parameters())), "no parameter moved"


def slugs(report, *severities):
    return {f.check for f in report.findings if f.severity in severities}


def test_trainer_brings_its_module_optimizers_and_plugin_facts():
    t, m = trainer("bf16-true"), Tiny()
    t.fit(m, loader())
    subjects = {(s.kind, s.name) for s in discover([t], names={id(t): "trainer"})}
    assert subjects == {("trainer", "trainer"), ("model", "trainer.lightning_module"), ("optimizer", "trainer.optimizers[0]")}
    (p,) = mpdoctor.diagnose(t, names={id(t): "trainer"}).facts.lightning
    assert (p.requested, p.effective, p.plugin, p.input_dtype, p.device) == ("bf16-true", "bf16-true", "HalfPrecision", "bfloat16", "cpu")
    assert p.optimizer_names == ("trainer.optimizers[0]",) and p.model_names == ("trainer.lightning_module",)


def test_16_mixed_on_cpu_is_replaced_and_lightning_forgets_the_request():
    """Lightning's real rule, reproduced: 16-mixed on a CPU becomes bf16-mixed with this warning.

    The connector overwrites ``_precision_flag``, so a built Trainer no longer knows what was asked: the
    live diagnosis reports what runs (bf16-mixed) and raises nothing; the check fires where the request is
    known (facts of the request, or a what-if).
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = trainer("16-mixed")
    assert CPU_FALLBACK_WARNING in [str(w.message) for w in caught]
    assert t.precision == "bf16-mixed" and lightning_effective("16-mixed", "cpu") == "bf16-mixed"
    report = mpdoctor.diagnose(t, names={id(t): "trainer"})
    (p,) = report.facts.lightning
    assert (p.requested, p.effective) == ("bf16-mixed", "bf16-mixed")
    assert "lightning-precision-replaced" not in slugs(report, "error", "warning", "info")
    # The request as the user wrote it, on the device it ran on.
    from mpdoctor.libraries.lightning.checks import lightning_precision_replaced

    asked = LightningPrecisionFacts("trainer", "trainer", "16-mixed", lightning_effective("16-mixed", "cpu"), "MixedPrecision", device="cpu")
    (finding,) = lightning_precision_replaced(mpdoctor.diagnose(t).facts.__class__(**{**report.facts.__dict__, "lightning": (asked,)}))
    assert finding.severity == "warning" and CPU_FALLBACK_WARNING in finding.message
    fixed_t = run_fix_code(finding.fixes[0].code)  # the display-only fix, executed
    assert fixed_t.precision == "bf16-mixed" and fixed_t._accelerator_connector._precision_flag == "bf16-mixed"
    fit_trains(fixed_t, Tiny(), loader())
    assert not slugs(mpdoctor.diagnose(fixed_t), "error", "warning", "info") & {"lightning-precision-replaced"}


def test_field_16_true_adam_eps_underflow_nan():
    """Lightning-AI/pytorch-lightning#20619: "16 bit precision in Trainer leading to NaN".

    The reporter's Adam with default eps=1e-8 turned every parameter NaN at the first step under 16-bit
    weights. Reproduced: ``precision="16-true"`` + AdamW, small gradients -> non-finite weights after one
    step. Diagnosis ``lightning-true-half-adam`` (error); the planned fix gives the Trainer bf16-mixed's plugin in
    place (and the fp16 module back in fp32; its NaN weights stay NaN, so the cure on the user's ``fit`` runs on
    fresh objects: ``lightning-16-true-adam-nan`` in ``test_cures_stack.py``); the display-only rebuild beside it
    trains with finite weights.
    """
    t, m = trainer("16-true"), Tiny()
    t.fit(m, loader(scale=1e-3))
    assert not torch.isfinite(m.layer.weight).all()  # the harm, measured
    report = mpdoctor.diagnose(t, names={id(t): "trainer"})
    finding = next(f for f in report.findings if f.check == "lightning-true-half-adam")
    assert finding.severity == "error"
    assert "adam-eps-underflow" not in {f.check for f in report.findings}  # one cause: the next fit re-casts to fp16
    in_place, rebuild = finding.fixes[:2]
    assert in_place in report.fixes and in_place.applicability.value == "unsafe"
    in_place.apply()
    assert t.precision == "bf16-mixed" and m.layer.weight.dtype == torch.float32 and m.dtype == torch.float32
    assert not slugs(mpdoctor.diagnose(t), "error", "warning")
    in_place.undo()
    assert t.precision == "16-true" and m.layer.weight.dtype == torch.float16
    assert rebuild.applicability.value == "display-only"
    fixed_t, fixed_m = run_fix_code(rebuild.code), Tiny()  # the display-only fix, executed on a fresh twin
    fit_trains(fixed_t, fixed_m, loader(scale=1e-3))
    assert torch.isfinite(fixed_m.layer.weight).all() and fixed_m.layer.weight.dtype == torch.float32
    assert not slugs(mpdoctor.diagnose(fixed_t), "error", "warning")


def test_a_fabric_or_a_strategys_own_true_half_plugin_keeps_the_rebuild_and_says_why():
    """Only a Trainer's ``HalfPrecision`` plugin is swapped in place. A Fabric's set-up modules chose their backward
    for the plugin they met, and FSDP / DeepSpeed own theirs: the rebuild stays their fix, its text says why."""
    from mpdoctor.libraries.lightning.checks import lightning_true_half_adam

    t = trainer("bf16-true")
    facts = mpdoctor.diagnose(t, names={id(t): "trainer"}).facts
    for kind, plugin, why in (("fabric", "HalfPrecision", "chose their backward"), ("trainer", "FSDPPrecision", "belongs to its strategy")):
        p = LightningPrecisionFacts("run", kind, "bf16-true", "bf16-true", plugin, device="cpu", planned_optimizer="torch.optim.adamw.AdamW")
        (finding,) = lightning_true_half_adam(facts.__class__(**{**facts.__dict__, "lightning": (p,)}))
        assert [f.applicability.value for f in finding.fixes] == ["display-only", "display-only"], kind
        assert why in finding.fixes[0].code and f"L.{kind.title()}(" in finding.fixes[0].code


def test_bf16_true_adamw_is_one_finding_whose_fix_lightning_keeps():
    """bf16-true + stock AdamW: ``lightning-true-half-adam`` (warning) names it, and the optimizer-level
    ``pure-bf16-adamw`` stays silent: its in-place fp32 cast would not last, because Lightning casts the
    module back to bf16 at the next ``fit`` (shown). The Lightning fix (``bf16-mixed``) keeps fp32 weights."""
    t, m = trainer("bf16-true"), Tiny()
    t.fit(m, loader())
    report = mpdoctor.diagnose(t, names={id(t): "trainer"})
    assert "lightning-true-half-adam" in slugs(report, "warning")
    assert "lightning-true-half-adam" not in slugs(report, "error")
    assert "pure-bf16-adamw" not in {f.check for f in report.findings}
    for p in m.parameters():  # what pure-bf16-adamw's in-place fix would do
        p.data = p.data.float()
    trainer("bf16-true").fit(m, loader())
    assert m.layer.weight.dtype == torch.bfloat16, "Lightning converted the module back: the cast did not last"
    fixed_t, fixed_m = trainer("bf16-mixed"), Tiny()
    fixed_t.fit(fixed_m, loader())
    assert fixed_m.layer.weight.dtype == torch.float32
    assert not slugs(mpdoctor.diagnose(fixed_t), "error", "warning")


def test_bf16_mixed_plugin_refuses_a_scaler():
    """A GradScaler in a bf16 Lightning run is not reachable through the public API: the plugin refuses it."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match="does not use a scaler"):
        MixedPrecision("bf16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_healthy_trainer_recipes(precision):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t, m = trainer(precision), Tiny()
    assert not [w for w in caught if "precision" in str(w.message)]
    t.fit(m, loader())
    report = mpdoctor.diagnose(t, names={id(t): "trainer"})
    assert not slugs(report, "error", "warning"), report.to_text()


def test_a_trainer_given_its_precision_plugin_asks_for_what_the_plugin_runs():
    """``plugins=[MixedPrecision("16-mixed", "cpu", scaler=...)]`` (the 16-mixed recipe on a CPU with a CPU scaler):
    the connector's flag keeps its "32-true" default, but the request is the plugin: nothing replaced, no warning."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    t = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, plugins=[plugin])  # fmt: skip
    assert t._accelerator_connector._precision_flag == "32-true" and t.precision == "16-mixed"
    report = mpdoctor.diagnose(t, names={id(t): "trainer"})
    (p,) = report.facts.lightning
    assert (p.requested, p.effective) == ("16-mixed", "16-mixed")
    assert not slugs(report, "error", "warning"), report.to_text()


def test_healthy_fabric_bf16_mixed():
    fabric = L.Fabric(accelerator="cpu", precision="bf16-mixed", devices=1)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = fabric.setup(model, opt)
    x = torch.randn(4, 4)
    loss = model(x).float().pow(2).mean()
    fabric.backward(loss)
    opt.step()
    report = mpdoctor.diagnose(fabric, names={id(fabric): "fabric"})
    (p,) = report.facts.lightning
    assert (p.kind, p.requested, p.effective, p.plugin) == ("fabric", "bf16-mixed", "bf16-mixed", "MixedPrecision")
    assert not slugs(report, "error", "warning"), report.to_text()


def test_callback_diagnoses_at_fit_start_and_probes_a_nonfinite_loss():
    class Exploding(Tiny):
        def training_step(self, batch, i):
            loss = super().training_step(batch, i)
            return loss * float("inf")

    cb = mpdoctor.MPDoctorLightningCallback(stop_on_nonfinite=True)
    t, m = trainer("bf16-mixed", callbacks=[cb]), Exploding()
    before = m.layer.weight.detach().clone()
    with pytest.raises(mpdoctor.attach.training.callback_state.MPDoctorAbort):
        t.fit(m, loader())
    assert cb.start_report is not None and cb.start_report.ok
    assert cb.events and cb.events[0]["event"] == "nonfinite-loss"
    assert torch.equal(m.layer.weight, before)  # stopped before the optimizer step
    assert cb._watcher._handles == []


def test_import_mpdoctor_does_not_import_the_callback():
    import subprocess
    import sys

    # In a fresh interpreter: this test process imported the callback already (the tests above use it).

    out = subprocess.run(
        [sys.executable, "-c", "import mpdoctor, sys; print('lightning' in sys.modules, 'mpdoctor.libraries.lightning.callback' in sys.modules)"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.stdout.split() == ["False", "False"]


# The Lightning callback needs Lightning: this lives with the stack tests (Colab's venv has none).
def test_both_callbacks_share_one_constructor():
    import mpdoctor
    from mpdoctor.attach.training.callback_state import CallbackState

    transformers_cb = mpdoctor.MPDoctorCallback(stop_on_error=True, scan=True, ignore=["x"], timeout=5.0)
    lightning_cb = mpdoctor.MPDoctorLightningCallback(stop_on_error=True, scan=True, ignore=["x"], timeout=5.0)
    for cb in (transformers_cb, lightning_cb):
        assert type(cb).__init__ is CallbackState.__init__
        assert (cb.stop_on_error, cb.scan, cb.ignore, cb.timeout, cb.probe) == (True, True, ("x",), 5.0, True)
