"""``compare(..., steps=N)``: N optimizer steps per precision from the same start, the loss curves, the model untouched."""

from __future__ import annotations

import math

import pytest
import torch
from fingerprint import assert_unchanged, fingerprint

from mpdoctor.attach.emulation.compare import compare


def _first_optimizer_step() -> None:
    """torch's first optimizer step in a process sets TORCHINDUCTOR_CACHE_DIR (a lazy import of its own, as the
    user's first training step would): taken before the fingerprint so only compare's effects are compared."""
    layer = torch.nn.Linear(2, 2)
    layer(torch.ones(1, 2)).sum().backward()
    torch.optim.SGD(layer.parameters(), lr=0.1).step()


def regression() -> tuple[torch.nn.Module, list[tuple[torch.Tensor]], torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(0.1), torch.nn.GELU(), torch.nn.Linear(64, 32))
    g = torch.Generator().manual_seed(1)
    xs = [(torch.randn(16, 32, generator=g),) for _ in range(3)]
    return model, xs, torch.zeros(16, 32)


def test_steps_give_a_loss_curve_per_precision_from_the_same_start_and_leave_the_model_as_it_was():
    model, xs, target = regression()
    model(*xs[0]).sum().backward()  # the user's grads
    _first_optimizer_step()
    torch.manual_seed(5)
    before = fingerprint({"model": model, "batches": xs})
    c = compare(model, xs[0], precisions=("bf16", "fp8"), loss=lambda out: (out - target).square().mean(), steps=6, batches=xs)
    assert_unchanged(before, fingerprint({"model": model, "batches": xs}), "compare(steps=6)")
    assert set(c.curves) == {"fp32", "bf16", "fp8"} and all(len(v) == 6 for v in c.curves.values())
    # Step 1 of each curve is the single-step run on the same batch, from the same weights and RNG.
    for name in ("fp32", "bf16", "fp8"):
        assert c.curves[name][0] == pytest.approx(c.losses[name], rel=1e-6)
    # They train: the fp32 loss falls, and bf16 / fp8 follow it closely on this healthy model.
    assert c.curves["fp32"][-1] < c.curves["fp32"][0]
    for name in ("bf16", "fp8"):
        assert all(abs(a - b) < 0.05 * abs(b) for a, b in zip(c.curves[name], c.curves["fp32"]))
    text, html = c.to_text(), c.to_html()
    assert "loss over 6 steps, fp8: step 1" in text
    assert "<polyline" in html and html.count("<polyline") == 3


def test_a_diverging_precision_ends_its_curve_and_the_model_is_still_restored():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
    with torch.no_grad():
        model[0].weight.mul_(1e4)  # activations past fp16's 65504
    x = torch.randn(8, 16) * 100
    _first_optimizer_step()
    before = fingerprint({"model": model})
    c = compare(model, x, precisions=("bf16", "fp16"), steps=4, optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-12))
    assert_unchanged(before, fingerprint({"model": model}), "compare(steps=4)")
    assert len(c.curves["fp32"]) == 4 and len(c.curves["fp16"]) == 1 and not math.isfinite(c.curves["fp16"][0])
