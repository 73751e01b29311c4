"""The fp32 island: a module whose forward raises in half precision (an op with no bf16 / fp16 kernel, or one that
meets another dtype under autocast), run in fp32 with autocast off inside and its output cast back, in place.

Real raisers on this CPU: ``torch.fft.fft`` of bf16 ("Unsupported dtype BFloat16", pytorch/pytorch#117844) and
``index_put`` of autocast's fp16 values into an fp32 buffer (continue-revolution/sd-webui-animatediff#168). Each:
the real error, the crash's cause with the in-place island fix, the same step after ``fix.apply()`` (it trains), the
exact undo; a deep copy of the fixed model (an EMA, a twin) computes with its own weights, never the original's.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from fingerprint import assert_unchanged, fingerprint
from steps import assert_step_trains, snapshot

from mpdoctor.attach.crash import explain

sys.path.insert(0, str(Path(__file__).parent / "field"))
from test_between_steps_cases import FourierMixer, raised  # noqa: E402
from test_exception_cases import Router  # noqa: E402


def _island(report):
    (fix,) = [fx for fx in report.cause.fixes if fx.recipe == "fp32-island"]
    return fix


def test_an_fft_in_a_bf16_model_runs_in_an_fp32_island_in_place_and_the_same_step_trains():
    torch.manual_seed(0)
    x = torch.randn(2, 12, 16, dtype=torch.bfloat16)
    model = FourierMixer(upcast=False).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    exc = raised(step)
    assert str(exc) == "Unsupported dtype BFloat16"  # the real error
    report = explain(exc, namespace={"model": model, "opt": opt, "x": x})
    assert report.cause.check == "crash-fft-half"
    fix = _island(report)
    assert not fix.safe and "model" in fix.title
    fix.apply()
    assert fix.applied and model.proj.weight.dtype == torch.float32
    assert model(x).dtype == torch.bfloat16  # the layers after it get the dtype they compute in
    before = snapshot(model.parameters())
    assert_step_trains(step(), before, model.parameters())
    fix.undo()
    assert model.proj.weight.dtype == torch.bfloat16
    assert isinstance(raised(lambda: model(x)), RuntimeError)  # the island is gone: the op raises again


def test_applying_then_undoing_the_island_restores_the_fingerprint_exactly():
    x = torch.randn(2, 12, 16, dtype=torch.bfloat16)
    model = FourierMixer(upcast=False).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    exc = raised(lambda: model(x))
    fix = _island(explain(exc, namespace={"model": model, "opt": opt}))
    before = fingerprint({"model": model, "opt": opt})
    fix.apply()
    assert fingerprint({"model": model, "opt": opt}) != before
    fix.undo()
    assert_unchanged(before, fingerprint({"model": model, "opt": opt}), "island apply then undo")


def test_an_index_put_under_fp16_autocast_runs_in_an_fp32_island_and_every_module_of_its_class_with_it():
    torch.manual_seed(0)
    x, rows = torch.randn(4, 4), torch.tensor([0, 2])
    model = torch.nn.Sequential(Router(), Router())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sum(r(x, rows) for r in model).square().sum()
        loss.backward()
        opt.step()
        return loss

    exc = raised(step)
    assert str(exc).startswith("Index put requires the source and destination dtypes match")
    fix = _island(explain(exc, namespace={"model": model, "opt": opt}))
    assert "every Router (2" in fix.title
    fix.apply()
    before = snapshot(model.parameters())
    assert_step_trains(step(), before, model.parameters())


def test_a_deep_copy_of_a_model_with_an_island_computes_with_its_own_weights():
    x = torch.randn(2, 12, 16, dtype=torch.bfloat16)
    model = FourierMixer(upcast=False).to(torch.bfloat16)
    exc = raised(lambda: model(x))
    _island(explain(exc, namespace={"model": model})).apply()
    twin = copy.deepcopy(model)
    twin(x).float().sum().backward()
    assert all(p.grad is None for p in model.parameters())  # the original was not run
    assert all(p.grad is not None for p in twin.parameters())
    with torch.no_grad():
        twin.proj.weight.zero_()
        twin.proj.bias.zero_()
    assert torch.count_nonzero(twin(x)) == 0 and torch.count_nonzero(model(x)) > 0
