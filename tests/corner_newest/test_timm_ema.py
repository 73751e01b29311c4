"""timm's ``ModelEmaV3``: an fp16 (or round-to-nearest bf16) EMA copy whose updates round away, named and fixed.

timm's own docstring says it: "Low precision (bfloat16 / float16) weights cannot hold a plain EMA update ...
rounds to zero"; from timm 1.0.26 a bf16 shadow is updated with stochastic rounding by default, and "set
dtype=torch.float32 ... this is the only option for float16" (facebookresearch/vissl#568 asked the same of timm's
``ModelEmaV2`` under fp16 AMP). Each case: the harm measured with timm's own ``update()``, the finding, the fix
applied in place through the API and through the widget button, then the user's training step and the EMA update,
which now moves the shadow. The healthy twins (stochastic rounding on a bf16 shadow, ``dtype=torch.float32``, an
fp32 model) draw no error and no warning.

Collected only in the newest corner (tests/corners.py, ``CORNER_ONLY``): timm imports torchvision, and only that
corner has a torchvision that imports beside its torch.
"""

from __future__ import annotations

import pytest
import torch
from cure import click_fix
from steps import assert_step_trains, snapshot
from timm.utils.model_ema import ModelEmaV2, ModelEmaV3

import mpdoctor
from mpdoctor.rules.engine.shadow_changes import shadow_fix_code

FP16, BF16 = torch.float16, torch.bfloat16


def _net(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).to(dtype)


class Run:
    """A model, its optimizer and timm's EMA of it, as a training script holds them."""

    def __init__(self, model_dtype: torch.dtype, **ema_kwargs) -> None:
        self.net = _net(model_dtype)
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=0.05)
        self.ema = ema_kwargs.pop("cls", ModelEmaV3)(self.net, decay=0.999, **ema_kwargs)
        self.x = torch.randn(8, 16, dtype=model_dtype)
        self.namespace = {"net": self.net, "optimizer": self.optimizer, "model_ema": self.ema}

    def train_step(self) -> torch.Tensor:
        loss = self.net(self.x).float().pow(2).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.detach()

    def shadow(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.ema.module.parameters()]

    def share_moved_by_update(self) -> float:
        """Of the shadow elements that differ from the online weights after a training step, the share one timm
        update moves (an fp32 shadow moves all of them)."""
        self.train_step()
        before = self.shadow()
        gaps = [o.detach().float() != b.float() for o, b in zip(self.net.parameters(), before)]
        self.ema.update(self.net)
        moved = sum(int(((a != b) & g).sum()) for a, b, g in zip(self.shadow(), before, gaps))
        return moved / max(1, sum(int(g.sum()) for g in gaps))

    def progress_over_updates(self, n: int = 200) -> float:
        """How far ``n`` updates toward fixed online weights carry the shadow, as a share of the gap (fp32 math:
        ``1 - decay ** n``, 0.18 at decay 0.999 and n = 200; a shadow whose updates round away: 0)."""
        with torch.no_grad():
            for p in self.net.parameters():  # a gap of about 5% of each weight, as training opens it
                p.mul_(1.05)
        start = torch.cat([t.float().reshape(-1) for t in self.shadow()])
        target = torch.cat([p.detach().float().reshape(-1) for p in self.net.parameters()])
        for _ in range(n):
            self.ema.update(self.net)
        end = torch.cat([t.float().reshape(-1) for t in self.shadow()])
        gap = target - start
        return float((end - start) @ gap / (gap @ gap))

    def step_and_update_work(self) -> None:
        """The user's step after the fix: it trains, the shadow is fp32, and timm's update moves it."""
        params = list(self.net.parameters())
        before = snapshot(params)
        assert_step_trains(self.train_step(), before, params)
        assert {p.dtype for p in self.ema.module.parameters()} == {torch.float32}
        assert self.share_moved_by_update() > 0.5


BROKEN = {
    "fp16": dict(dtype=FP16),  # stochastic rounding covers bf16 only: an fp16 shadow rounds to nearest
    "bf16_round_to_nearest": dict(dtype=BF16, stochastic_rounding=False),
    "fp16_v2": dict(dtype=FP16, cls=ModelEmaV2),
}


def _build(case: str) -> Run:
    kwargs = dict(BROKEN[case])
    return Run(kwargs.pop("dtype"), **kwargs)


def _named(run: Run):
    run.train_step()  # mid-run: the online weights moved away from the copy
    report = mpdoctor.diagnose(namespace=run.namespace)
    (finding,) = report.findings_for("low-precision-ema")
    assert finding.subject == "model_ema" and finding.severity == "error", report.to_text()
    assert finding.evidence["shadow"] == "model_ema.module" and finding.evidence["online_model"] == "net"
    assert finding.evidence["lost_share"] > 0.9 and finding.evidence["decay"] == 0.999
    assert not report.findings_for("mixed-param-dtypes") and not report.findings_for("ema-update-dtype-mismatch")
    (fix,) = [f for f in report.fixes if f.slug == "low-precision-ema"]
    return report, fix


@pytest.mark.parametrize("case", BROKEN)
def test_timms_low_precision_ema_loses_its_updates_is_named_fixed_through_the_api_and_trains(case):
    run = _build(case)
    assert run.share_moved_by_update() < 0.05  # the harm, with timm's own update: the EMA stays where it was copied
    _, fix = _named(run)
    before = [(p, p.dtype) for p in run.ema.module.parameters()]
    fix.apply()
    assert fix.applied, fix.error
    run.step_and_update_work()
    assert not mpdoctor.diagnose(namespace=run.namespace).findings_for("low-precision-ema")
    fix.undo()
    assert [(p, p.dtype) for p in run.ema.module.parameters()] == before  # the same Parameters, back in their dtype


@pytest.mark.parametrize("case", BROKEN)
def test_timms_low_precision_ema_is_fixed_through_the_widget_button_and_trains(case):
    run = _build(case)
    report, fix = _named(run)
    rw = report.widget()
    rw.confirm_delay = 0.0
    assert click_fix(rw, fix.key)
    assert "failed" not in rw.status, rw.status
    run.step_and_update_work()


def test_the_fix_code_shown_does_the_same_on_a_twin():
    run = _build("fp16")
    (finding,) = mpdoctor.diagnose(namespace=run.namespace).findings_for("low-precision-ema")
    code = shadow_fix_code(next(s for s in mpdoctor.diagnose(namespace=run.namespace).facts.averaging))
    assert code == finding.fixes[0].code
    exec(compile(code, "<fix>", "exec"), dict(run.namespace))
    run.step_and_update_work()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(dtype=BF16),  # timm's default: stochastic rounding keeps bf16 updates in expectation
        dict(dtype=BF16, ema_dtype=torch.float32),  # an fp32 EMA of a bf16 model (timm's advice for fp16)
        dict(dtype=FP16, ema_dtype=torch.float32),
        dict(dtype=torch.float32),
        dict(dtype=torch.float32, cls=ModelEmaV2),
    ],
    ids=["bf16_stochastic_rounding", "bf16_fp32_ema", "fp16_fp32_ema", "fp32", "fp32_v2"],
)
def test_healthy_twins_draw_nothing_and_their_updates_move_the_shadow(kwargs):
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype")
    if "ema_dtype" in kwargs:
        kwargs["dtype"] = kwargs.pop("ema_dtype")
    run = Run(dtype, **kwargs)
    run.train_step()
    report = mpdoctor.diagnose(namespace=run.namespace)
    assert not [f for f in report.findings if f.severity in ("error", "warning")], report.to_text()
    # The updates register: 200 of them carry the shadow 1 - 0.999 ** 200 = 18% of the way, as in fp32
    # (stochastic rounding: in expectation, a few elements a whole bf16 step at a time).
    assert run.progress_over_updates() == pytest.approx(1 - 0.999**200, abs=0.03)


def test_the_same_bf16_shadow_rounding_to_nearest_makes_no_progress_where_stochastic_rounding_does():
    """The twin above is healthy because of its rounding: the same bf16 shadow rounded to nearest does not move."""
    assert Run(BF16, stochastic_rounding=False).progress_over_updates() < 0.01
    assert Run(BF16).progress_over_updates() > 0.15
