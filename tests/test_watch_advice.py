"""``mpdoctor.watch``'s advice fits the run: no fp16 advice for a pure fp32 loop, and a non-finite loss is
an error in the report's header even when every module of the model stayed finite."""

from __future__ import annotations

import math

import pytest
import torch

import mpdoctor

pytestmark = pytest.mark.colab


def _fp32_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def _all_advice(report) -> str:
    return "\n".join(f"{fx.title}\n{fx.code}\n{fx.cost}" for f in report.findings for fx in f.fixes)


def test_a_pure_fp32_overflow_gets_no_fp16_advice():
    model = _fp32_mlp()
    with torch.no_grad():
        model[0].weight.fill_(1e38)  # fp32 itself overflows: 1e10 * 1e38
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.full((2, 4), 1e10), torch.zeros(2, 1)
    loss = torch.nn.functional.mse_loss(model(x), y)
    assert not math.isfinite(float(loss.detach()))  # the real harm: a NaN loss in an fp32 run
    with mpdoctor.watch(model, optimizer) as w:
        w.observe(torch.nn.functional.mse_loss(model(x), y)).backward()
        optimizer.step()
    report = w.probe_report
    assert report.counts()["error"] >= 1 and report.findings[0].check == "probe-nonfinite"
    advice = _all_advice(report)
    assert "fp16" not in advice.replace("fp16-", "") and "65504" not in advice and "bf16" not in advice, advice
    assert "fp32" in advice  # it says what overflows where it runs: fp32


def test_a_non_finite_loss_from_the_loss_computation_is_an_error_in_the_header():
    model = _fp32_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with mpdoctor.watch(model, optimizer) as w:
        out = model(torch.randn(2, 4))
        w.observe(torch.log(out - 100).mean()).backward()  # log of a negative number: NaN outside the model
        optimizer.step()
    assert w.events[0]["event"] == "nonfinite-loss"
    report = w.probe_report
    assert report.counts()["error"] == 1
    assert report.to_text().splitlines()[0].startswith("mpdoctor | 1 error |")
    (finding,) = report.findings_for("nonfinite-loss")
    assert "loss computation" in finding.message
    # once the loss is computed where it is defined, the same loop trains
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    loss = torch.nn.functional.softplus(model(torch.randn(2, 4))).mean()
    loss.backward()
    optimizer.step()
    assert math.isfinite(float(loss.detach()))
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
