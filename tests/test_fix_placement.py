"""A fix goes where the failure is: on the layer that meets the input, on the tensor the op met (and its twins).

Each case: the real error through the call the user makes (not the model's forward), the diagnosis, the fix
applied in place, the same call running, and undo putting the objects back.
"""

from __future__ import annotations

import pytest
import torch

import mpdoctor
from mpdoctor.attach.crash import explain

pytestmark = pytest.mark.colab


class Encoded(torch.nn.Module):
    """A model the user reaches through ``encode()``: its forward's pre-hooks never run for that call."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.encoder(x))

    def encode(self, x):
        return self.encoder(x)


def test_the_probes_input_cast_sits_on_the_layer_that_meets_the_input_so_encode_runs_too():
    torch.manual_seed(0)
    net = Encoded().to(torch.bfloat16)
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="same dtype"):
        net.encode(x)  # the user's call: it skips net.forward
    report = mpdoctor.probe(net, x)
    (finding,) = report.findings_for("batch-dtype-mismatch")
    fix = finding.fixes[0]
    assert "model.encoder.0" in fix.title and fix.safe
    fix.apply()
    out = net.encode(x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert torch.isfinite(net(x).float()).all()  # and the model's forward
    fix.undo()
    with pytest.raises(RuntimeError, match="same dtype"):
        net.encode(x)


class Shifted(torch.nn.Module):
    """A block whose own parameter enters the arithmetic directly (an AdaLN table), not through a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.table = torch.nn.Parameter(torch.randn(8) * 0.1)

    def forward(self, x):
        return self.proj(x) + self.table


def test_a_float8_parameter_met_in_arithmetic_is_upcast_in_place_with_its_twins_and_the_call_runs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Shifted(), Shifted()).to(torch.bfloat16)
    for block in model:
        block.table.data = block.table.data.to(torch.float8_e4m3fn)  # fp8 storage of the tables only
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    try:
        model(x)
        raise AssertionError("the forward did not raise")
    except RuntimeError as exc:
        assert "Promotion for Float8 Types is not supported" in str(exc)
        report = explain(exc, exc.__traceback__, namespace={"model": model, "x": x})
    fix = next(fx for fx in report.cause.fixes if fx.changes)
    assert fix.title.startswith("Cast table of every Shifted (2 tensors") and fix.safe
    tables = [block.table for block in model]
    fix.apply()
    assert [t.dtype for t in tables] == [torch.bfloat16] * 2 and [b.table for b in model] == tables  # same objects
    assert torch.isfinite(model(x).float()).all()  # both blocks run: the twin would have raised next
    fix.undo()
    assert [b.table.dtype for b in model] == [torch.float8_e4m3fn] * 2


class Energy(torch.nn.Module):
    """A squared magnitude: fine in fp32, past fp16's 65504 for activations of a few hundred."""

    def forward(self, x):
        return (x * 300.0).pow(2).mean(dim=-1, keepdim=True)


def test_a_module_that_overflows_in_fp16_is_kept_in_fp32_in_place_and_the_forward_turns_finite():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Energy()).to(torch.float16)
    batch = torch.randn(4, 8, dtype=torch.float16)
    assert torch.isinf(model(batch)).any()  # the measured harm: fp16 overflows in model.1
    report = mpdoctor.probe(model, batch)
    fix = next(fx for f in report.findings for fx in f.fixes if fx.recipe == "fp32-module")
    assert fix.title.startswith("Keep model.1 (Energy) in fp32 with autocast off inside it") and fix.changes
    fix.apply(confirm=True)
    out = model(batch)
    assert torch.isfinite(out).all() and model[0].weight.dtype == torch.float16  # only model.1 changed
    fix.undo()
    assert torch.isinf(model(batch)).any() and "forward" not in vars(model[1])
