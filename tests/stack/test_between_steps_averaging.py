"""Field cases between steps: EMA / weight averaging whose updates round away in bf16, or whose update raises.

Each case is rebuilt on this CPU from a public report: the harm first (the share of shadow elements one real EMA
update moves, against what fp32 moves; or the real error), then mpdoctor naming it, the fix applied in place
through the API and through the widget button, and then the user's own step: a training step that trains and the
EMA update that now moves the shadow. Each has a healthy twin (the same setup done right) that draws no error and
no warning. Fragment: docs/field-cases/between-steps-averaging.md.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from diffusers import UNet2DModel
from diffusers.training_utils import EMAModel
from ema_pytorch import EMA
from steps import assert_step_trains, snapshot
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn

import mpdoctor

BF16 = torch.bfloat16


@dataclass
class Setup:
    """A model, its optimizer, the EMA object, the user's EMA update and the shadow tensors it writes."""

    namespace: dict
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    forward: Callable[[], torch.Tensor]
    update: Callable[[], None]
    shadow: Callable[[], list[torch.Tensor]]

    def train_step(self) -> torch.Tensor:
        loss = self.forward().float().pow(2).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.detach()

    def trains(self) -> None:
        """The user's training step trains: a finite loss and parameters that moved."""
        params = list(self.model.parameters())
        before = snapshot(params)
        assert_step_trains(self.train_step(), before, params)

    def share_moved_by_update(self) -> float:
        """The share of shadow elements one EMA update moves (after a training step gave it a gap to follow)."""
        self.train_step()
        before = [t.detach().clone() for t in self.shadow()]
        self.update()
        after = self.shadow()
        return sum(int((a != b).sum()) for a, b in zip(after, before)) / sum(b.numel() for b in before)


def _net(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).to(dtype)


def _batch(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(8, 16, dtype=dtype)


# -- the cases ------------------------------------------------------------------------------------


def dreambooth_ema(healthy: bool) -> Setup:
    """d8ahazard/sd_dreambooth_extension PR #1415 / #1417: ``weight_dtype`` bf16 with ``use_ema``: diffusers'
    EMAModel copies the bf16 UNet's parameters, "almost all EMA weight updates get rounded down to 0"; the fix
    keeps the EMA in fp32."""
    torch.manual_seed(0)
    unet = UNet2DModel(
        sample_size=8, in_channels=1, out_channels=1, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4,
    ).to(BF16)  # fmt: skip
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-3)
    ema_unet = EMAModel(unet.parameters(), decay=0.9999)
    # A run 2000 steps in (its saved state says so): diffusers' warm-up decay (1 + k) / (10 + k) is 0.9955.
    ema_unet.load_state_dict({**ema_unet.state_dict(), "optimization_step": 2000})
    if healthy:
        ema_unet.to(dtype=torch.float32)  # the PR's fix: the EMA in fp32 whatever weight_dtype is
    x, t = torch.randn(2, 1, 8, 8, dtype=BF16), torch.tensor([10, 500])
    return Setup(
        {"unet": unet, "ema_unet": ema_unet, "optimizer": optimizer}, unet, optimizer,
        lambda: unet(x, t).sample, lambda: ema_unet.step(unet.parameters()), lambda: ema_unet.shadow_params,
    )  # fmt: skip


def ema_pytorch_bf16(healthy: bool) -> Setup:
    """lucidrains/ema-pytorch PR #18: bf16 parameters added to what EMA tracks; "is bfloat16's precision enough
    for common EMA coefficients?". The EMA copy of a bf16 model is bf16."""
    net = _net(BF16)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    if healthy:
        ema = EMA(net, ema_model=copy.deepcopy(net).float(), beta=0.999, update_after_step=0, update_every=1, coerce_dtype=True)
    else:
        ema = EMA(net, beta=0.999, update_after_step=0, update_every=1)
    ema.update()  # the first update copies the online weights
    ema.step.fill_(5000)  # a run 5000 updates in: the warm-up decay 1 - (1 + k) ** -2/3 is past beta
    x = _batch(BF16)
    return Setup(
        {"net": net, "ema": ema, "optimizer": optimizer}, net, optimizer,
        lambda: net(x), ema.update, lambda: [p for p in ema.ema_model.parameters()],
    )  # fmt: skip


def ema_pytorch_deepspeed_bf16(healthy: bool) -> Setup:
    """lucidrains/ema-pytorch issue #36: "expected dtype float for `end` but got dtype c10::BFloat16" with
    DeepSpeed bf16: the EMA was built on the fp32 model, the engine made the model bf16 (here ``.to(bf16)``, which
    is what DeepSpeed's bf16 engine does to the module); "the solution is to set `coerce_dtype=True`"."""
    net = _net(torch.float32)
    ema = EMA(net, beta=0.999, update_after_step=0, update_every=1, coerce_dtype=healthy)
    ema.update()  # the first update copies the (then fp32) online weights
    net.to(BF16)
    ema.step.fill_(5000)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x = _batch(BF16)
    return Setup(
        {"net": net, "ema": ema, "optimizer": optimizer}, net, optimizer,
        lambda: net(x), ema.update, lambda: [p for p in ema.ema_model.parameters()],
    )  # fmt: skip


def videosys_averaged_bf16(healthy: bool) -> Setup:
    """NUS-HPC-AI-Lab/VideoSys PR #6 ("use fp32 for ema model"): the EMA was a copy of the bf16 model. Rebuilt
    with torch's own EMA, ``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))``, whose copy of a bf16
    model is bf16."""
    net = _net(BF16)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    if healthy:
        ema = AveragedModel(net, avg_fn=get_ema_avg_fn(0.999))
        ema.module.float()  # an fp32 average of a bf16 model, updated per tensor (promotes the bf16 weights)
    else:
        ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    ema.update_parameters(net)  # the first call copies; every later one averages
    x = _batch(BF16)
    return Setup(
        {"net": net, "ema": ema, "optimizer": optimizer}, net, optimizer,
        lambda: net(x), lambda: ema.update_parameters(net), lambda: list(ema.module.parameters()),
    )  # fmt: skip


CASES = {
    "dreambooth_ema": (dreambooth_ema, "low-precision-ema", "ema_unet"),
    "ema_pytorch_bf16": (ema_pytorch_bf16, "low-precision-ema", "ema"),
    "ema_pytorch_deepspeed_bf16": (ema_pytorch_deepspeed_bf16, "ema-update-dtype-mismatch", "ema"),
    "videosys_averaged_bf16": (videosys_averaged_bf16, "low-precision-ema", "ema"),
}


def _harm(setup: Setup, slug: str) -> None:
    """The reported failure on this CPU: the update raises, or it moves (almost) no shadow element."""
    if slug == "ema-update-dtype-mismatch":
        with pytest.raises(RuntimeError, match="expected dtype float for `end` but got dtype c10::BFloat16"):
            setup.update()
    else:
        assert setup.share_moved_by_update() < 0.05  # measured: the EMA stays where it was copied


def _after_fix(setup: Setup, slug: str) -> None:
    """The user's failing step run again: the training step trains and the EMA update moves the shadow."""
    setup.trains()
    assert all(t.dtype == torch.float32 for t in setup.shadow())
    assert setup.share_moved_by_update() > 0.5
    again = mpdoctor.diagnose(namespace=setup.namespace)
    assert not again.findings_for(slug) and not again.findings_for("mixed-param-dtypes"), again.to_text()


@pytest.mark.parametrize("case", CASES)
def test_the_case_is_reproduced_named_and_fixed_through_the_api_and_the_step_runs(case):
    build, slug, name = CASES[case]
    setup = build(healthy=False)
    setup.train_step()
    _harm(setup, slug)

    report = mpdoctor.diagnose(namespace=setup.namespace)
    (finding,) = report.findings_for(slug)
    assert finding.severity == "error" and finding.subject == name, report.to_text()
    if slug == "low-precision-ema":
        assert finding.evidence["lost_share"] is not None and finding.evidence["lost_share"] > 0.9
    assert not report.findings_for("mixed-param-dtypes")  # the fp32 island is never the accident
    (fix,) = [f for f in report.fixes if f.slug == slug]
    shadow_before = [(t, t.dtype) for t in setup.shadow()]

    fix.apply()
    _after_fix(setup, slug)

    fix.undo()
    restored = setup.shadow()
    assert [t.dtype for t in restored] == [d for _, d in shadow_before]  # undo puts the very tensors back
    if case == "dreambooth_ema":
        assert all(a is b for a, (b, _) in zip(restored, shadow_before))


@pytest.mark.parametrize("case", CASES)
def test_the_case_is_fixed_through_the_widget_button_and_the_step_runs(case):
    build, slug, _name = CASES[case]
    setup = build(healthy=False)
    setup.train_step()
    rw = mpdoctor.diagnose(namespace=setup.namespace).widget()
    rw.confirm_delay = 0.0
    (fix,) = [f for f in rw.report.fixes if f.slug == slug]
    (button,) = rw.buttons(fix.title)
    button.click()
    assert slug not in {f.check for f in rw.report.findings}
    _after_fix(setup, slug)


@pytest.mark.parametrize("case", CASES)
def test_the_healthy_twin_updates_its_average_and_draws_no_error_or_warning(case):
    build, _slug, _name = CASES[case]
    setup = build(healthy=True)
    setup.trains()
    assert setup.share_moved_by_update() > 0.5
    report = mpdoctor.diagnose(namespace=setup.namespace)
    loud = [f for f in report.findings if f.severity in ("error", "warning")]
    assert not loud, report.to_text()


def test_casting_the_fp32_ema_copy_to_bf16_as_the_old_mixed_dtype_fix_did_loses_its_updates():
    """The harm of the fix mpdoctor used to offer for an fp32 EMA kept beside a bf16 model in one module: cast to
    bf16, one update moves almost nothing; left fp32 (what mpdoctor now says nothing about), it moves."""

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net(BF16)
            self.ema = AveragedModel(_net(BF16), avg_fn=get_ema_avg_fn(0.999))
            self.ema.module.float()  # fp32 on purpose: its updates are 1/1000 of the gap

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

    def moved_share(holder: Holder) -> float:
        opt = torch.optim.AdamW(holder.net.parameters(), lr=1e-3)
        holder(_batch(BF16)).float().pow(2).mean().backward()
        opt.step()
        before = [p.detach().clone() for p in holder.ema.module.parameters()]
        holder.ema.update_parameters(holder.net)
        return sum(int((p != b).sum()) for p, b in zip(holder.ema.module.parameters(), before)) / sum(b.numel() for b in before)

    holder = Holder()
    holder.ema.update_parameters(holder.net)  # the copy
    report = mpdoctor.diagnose(holder, torch.optim.AdamW(holder.net.parameters()))
    assert not report.findings_for("mixed-param-dtypes") and not report.findings_for("low-precision-ema"), report.to_text()
    assert moved_share(holder) > 0.5

    narrowed = Holder()
    narrowed.ema.update_parameters(narrowed.net)
    narrowed.ema.module.to(BF16)  # what "Cast the minority parameters to bfloat16" did
    assert moved_share(narrowed) < 0.05
    (finding,) = mpdoctor.diagnose(narrowed).findings_for("low-precision-ema")
    assert finding.severity == "error"


# -- intent islands that need the stack: diffusers' _keep_in_fp32_modules, a torchmetrics metric ------------------


def _tiny_wan(dtype: torch.dtype, tmp_path):
    from diffusers import WanTransformer3DModel

    kw = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
              text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32)  # fmt: skip
    torch.manual_seed(0)
    WanTransformer3DModel(**kw).save_pretrained(tmp_path)
    return WanTransformer3DModel.from_pretrained(tmp_path, torch_dtype=dtype)


def _wan_step(model, opt) -> torch.Tensor:
    x, t, text = torch.randn(1, 4, 1, 4, 4, dtype=BF16), torch.tensor([10]), torch.randn(1, 3, 16, dtype=BF16)
    loss = model(x, t, text).sample.float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_wan_keeps_scale_shift_table_fp32_on_purpose_and_draws_nothing(tmp_path):
    """huggingface/diffusers#10992: "WanTransformer3DModel using torch_dtype=torch.bfloat16 keeps some parameters as
    float32" (``scale_shift_table``, ``norm2``, the time embedder); the maintainers: "Yes, this is intended"
    (``_keep_in_fp32_modules``). mpdoctor called it a mixed-param-dtypes error and offered an unsafe cast."""
    model = _tiny_wan(BF16, tmp_path)
    assert model.scale_shift_table.dtype == torch.float32 and model.blocks[0].scale_shift_table.dtype == torch.float32
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    params = list(model.parameters())
    before = snapshot(params)
    assert_step_trains(_wan_step(model, opt), before, params)  # the user's step trains with the fp32 parts
    report = mpdoctor.diagnose(model, opt)
    assert not [f for f in report.findings if f.severity in ("error", "warning")], report.to_text()


def test_wan_an_fp32_layer_the_class_does_not_keep_is_still_an_accident_fixed_through_api_and_widget(tmp_path):
    for through_widget in (False, True):
        model = _tiny_wan(BF16, tmp_path / str(through_widget))
        model.proj_out.float()  # not in _keep_in_fp32_modules: the next matmul meets bf16 activations
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with pytest.raises(RuntimeError, match="dtype"):
            _wan_step(model, opt)
        opt.zero_grad()
        report = mpdoctor.diagnose(namespace={"transformer": model, "opt": opt})
        (finding,) = report.findings_for("mixed-param-dtypes")
        assert finding.severity == "error" and list(finding.evidence["modules"]) == ["proj_out"], report.to_text()
        (fix,) = [f for f in report.fixes if f.slug == "mixed-param-dtypes"]
        if through_widget:
            rw = report.widget()
            rw.confirm_delay = 0.0
            (button,) = rw.buttons(fix.title)
            button.click()
            for armed in rw.buttons("Click again to confirm"):
                armed.click()
        else:
            fix.apply()
        assert model.proj_out.weight.dtype == BF16 and model.scale_shift_table.dtype == torch.float32
        params = list(model.parameters())
        before = snapshot(params)
        assert_step_trains(_wan_step(model, opt), before, params)


def test_a_torchmetrics_metric_with_an_fp32_feature_net_in_a_bf16_module_is_an_island():
    """A metric holding a frozen network (as FID's Inception or LPIPS's VGG do) stays fp32 inside a bf16 module:
    it runs in ``update()`` outside the forward, so it is never fed the bf16 activations."""
    from torchmetrics import Metric

    class FeatureDistance(Metric):
        def __init__(self) -> None:
            super().__init__()
            self.features = torch.nn.Linear(16, 4)
            self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")

        def update(self, a: torch.Tensor, b: torch.Tensor) -> None:
            self.total += (self.features(a.float()) - self.features(b.float())).pow(2).sum()

        def compute(self) -> torch.Tensor:
            return self.total

    class Module(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net(BF16)
            self.metric = FeatureDistance()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

    module = Module()
    opt = torch.optim.AdamW(module.net.parameters(), lr=1e-3)
    params = list(module.net.parameters())
    before = snapshot(params)
    x = _batch(BF16)
    out = module(x)
    loss = out.float().pow(2).mean()
    loss.backward()
    opt.step()
    module.metric.update(out.detach(), x)
    assert_step_trains(loss.detach(), before, params)
    assert torch.isfinite(module.metric.compute())
    report = mpdoctor.diagnose(module, opt)
    assert not [f for f in report.findings if f.severity in ("error", "warning")], report.to_text()


def test_a_cast_of_an_averaged_model_takes_its_averaged_copy_along_so_the_next_update_and_step_run():
    # bf16 model, bf16 EMA kept by AveragedModel's foreach update; the T4 what-if casts the model to fp32 master weights.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema.update_parameters(model)  # the first update copies; the second one averages
    report = mpdoctor.diagnose(model, optimizer, ema, target="T4")
    fix = next(fx for f in report.findings_for("bf16-unsupported") if f.subject == "model" for fx in f.fixes)
    fix.apply()
    assert next(model.parameters()).dtype == torch.float32
    ema.update_parameters(model)  # before: "expected dtype c10::BFloat16 for `end` but got dtype float"
    assert all(p.dtype == torch.float32 for p in ema.module.parameters())
    params = list(model.parameters())
    before = snapshot(params)
    loss = model(torch.randn(4, 8)).square().mean()
    loss.backward()
    optimizer.step()
    assert_step_trains(loss, before, params)
    ema.update_parameters(model)


def _bf16_model_with_averaged_copy() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    ema.update_parameters(model)
    return {"model": model, "ema": ema, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2)}


def test_the_code_of_a_cast_that_takes_an_averaged_copy_along_is_python_that_does_the_same():
    """The cast's code carries the averaged copy's own lines (not a comment): run on a twin with the user's names,
    it leaves the model and the copy as the in-place fix does, and the next update runs on both alike."""
    fixed, twin = _bf16_model_with_averaged_copy(), _bf16_model_with_averaged_copy()
    report = mpdoctor.diagnose(namespace=fixed, target="T4")
    fix = next(fx for f in report.findings_for("bf16-unsupported") if f.subject == "model" for fx in f.fixes)
    assert "keep ema in fp32" in fix.title and "# ema: shadow cast" not in fix.code
    fix.apply()
    exec(compile(fix.code, "<fix code>", "exec"), dict(twin))
    for ns in (fixed, twin):
        ns["ema"].update_parameters(ns["model"])  # without the copy's lines: "expected dtype c10::BFloat16 for `end`"
    for a, b in zip([*fixed["model"].parameters(), *fixed["ema"].parameters()],
                    [*twin["model"].parameters(), *twin["ema"].parameters()], strict=True):  # fmt: skip
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)


@pytest.mark.parametrize("case", CASES)
def test_the_fix_code_shown_is_python_that_does_what_the_in_place_fix_does(case):
    """The code a shadow fix shows, run with the user's names on a twin, leaves the shadow as the in-place fix does
    (dtypes and values), and the EMA update it sets up then runs and moves the shadow as the fixed one does."""
    build, slug, _name = CASES[case]
    fixed, twin = build(healthy=False), build(healthy=False)
    (fix,) = [f for f in mpdoctor.diagnose(namespace=fixed.namespace).fixes if f.slug == slug]
    (shown,) = [f for f in mpdoctor.diagnose(namespace=twin.namespace).fixes if f.slug == slug]
    assert shown.code == fix.code and not shown.code.lstrip().startswith("#")
    fix.apply()
    exec(compile(shown.code, "<fix code>", "exec"), dict(twin.namespace))  # the user's names, nothing else
    for a, b in zip(fixed.shadow(), twin.shadow(), strict=True):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    fixed.update()
    twin.update()  # before the code ran, this raised or rounded the update away
    for a, b in zip(fixed.shadow(), twin.shadow(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    _after_fix(twin, slug)


@pytest.mark.parametrize("include_online_model", [False, True])
def test_a_cast_of_the_model_ema_pytorch_follows_takes_its_ema_along_and_names_it_as_the_user_does(include_online_model):
    """ema-pytorch's ``EMA`` of a bf16 ``net``: the T4 what-if's cast of ``net`` to fp32 (bf16-unsupported) used to
    leave ``ema.ema_model`` bf16 without ``coerce_dtype``, so ``ema.update()`` raised 'expected dtype
    c10::BFloat16 for `end` but got dtype float'. The cast now keeps the EMA fp32 with an update that casts."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(BF16)
    ema = EMA(net, beta=0.999, update_after_step=0, update_every=1, include_online_model=include_online_model)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    ema.update()
    ema.step.fill_(5000)
    report = mpdoctor.diagnose(namespace={"net": net, "ema": ema, "optimizer": optimizer}, target="T4")
    (low,) = report.findings_for("low-precision-ema")
    assert low.evidence["online_model"] == "net" and low.message.endswith("stops following net.")  # not online_model
    owner = "ema" if include_online_model else "net"  # include_online_model=True folds net into ema
    fix = next(fx for f in report.findings_for("bf16-unsupported") if f.subject == owner for fx in f.fixes)
    assert "keep ema in fp32" in fix.title
    fix.apply()
    assert next(net.parameters()).dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in ema.ema_model.parameters()) and ema.coerce_dtype
    before = [p.detach().clone() for p in ema.ema_model.parameters()]
    params = list(net.parameters())
    snap = snapshot(params)
    loss = net(torch.randn(4, 8)).square().mean()
    loss.backward()
    optimizer.step()
    assert_step_trains(loss, snap, params)
    ema.update()  # before: raised
    moved = sum(int((a != b).sum()) for a, b in zip(ema.ema_model.parameters(), before))
    assert moved > 0.5 * sum(b.numel() for b in before)
