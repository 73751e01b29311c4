"""The tally, the scan, the probe and the crash-frame reader read every float8 dtype and torchao's tensor subclasses.

They read what can be read and say what cannot: float8 values are upcast to fp32 to be reduced (torch has no
CPU ``aminmax`` / ``isfinite`` for them), torchao's ``Float8Tensor`` is read through its stored data or its
``dequantize()`` (it implements no ``aten.abs``), and packed float4 (``float4_e2m1fn_x2``), which torch cannot even
copy to another dtype, is named as unreadable.
"""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("torchao")
from torchao.quantization import Float8WeightOnlyConfig, quantize_  # noqa: E402

import mpdoctor  # noqa: E402
from mpdoctor.attach.crash.frames import tensor_locals, traceback_frames  # noqa: E402

FLOAT8 = [n for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n)]
FLOAT4 = "float4_e2m1fn_x2"


def float8_weight_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    quantize_(m, Float8WeightOnlyConfig())
    return m


def test_torchao_float8_weights_are_not_readable_by_reductions():
    """The reported failures, reproduced: torchao's Float8Tensor has no ``aten.abs`` (``isfinite`` runs it) and
    float8 tensors have no CPU ``aminmax``."""
    w = float8_weight_model()[0].weight
    with pytest.raises(NotImplementedError, match="aten.abs"):
        torch.isfinite(w.detach())
    with pytest.raises(RuntimeError, match="aminmax"):
        torch.aminmax(torch.randn(4).to(torch.float8_e4m3fn))


def test_the_probe_reads_float8_weights_when_the_output_goes_non_finite():
    """mpdoctor 0.1's probe raised ``NotImplementedError: ... aten.abs`` counting NaN in the Float8Tensor weights of
    a module whose output went non-finite; now it names the module."""
    m = float8_weight_model()
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    x[0, 0] = float("inf")
    report = mpdoctor.probe(m, x, loss_fn=lambda out: out.float().pow(2).mean())
    f = next(f for f in report.findings if f.check == "probe-nonfinite")
    assert "model.0" in f.message


@pytest.mark.parametrize("dtype", FLOAT8 + ([FLOAT4] if hasattr(torch, FLOAT4) else []))
def test_the_probe_reads_float8_activations(dtype):
    """A module returning a float8 tensor (an fp8-stored Embedding's rows) made the probe fail with '"aminmax_cpu"
    not implemented for Float8_e4m3fn' (reported as probe-failed); every float8 dtype is now read, packed float4
    is recorded without values."""
    d = getattr(torch, dtype)

    class Emit(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            z = torch.zeros(2, 4, dtype=torch.uint8).view(d) if dtype == FLOAT4 else y.detach().abs().to(d)
            return y, z

    report = mpdoctor.probe(Emit(), torch.randn(2, 8), loss_fn=lambda out: out[0].pow(2).mean())
    assert not [f for f in report.findings if f.check in ("probe-failed", "internal-error")], report.findings


def every_format_module() -> torch.nn.Module:
    m = torch.nn.Module()
    for i, name in enumerate(FLOAT8):
        m.register_parameter(f"p{i}", torch.nn.Parameter(torch.rand(8, 8).to(getattr(torch, name)), requires_grad=False))
    if hasattr(torch, FLOAT4):
        packed = torch.zeros(8, 4, dtype=torch.uint8).view(getattr(torch, FLOAT4))
        m.register_parameter("packed", torch.nn.Parameter(packed, requires_grad=False))
    m.q = float8_weight_model()
    return m


def test_the_tally_and_the_scan_read_every_format_and_say_what_they_cannot():
    m = every_format_module()
    report = mpdoctor.diagnose(m, names={id(m): "model"}, scan=True)
    assert not [f for f in report.findings if f.check == "internal-error"], report.findings
    tallied = {t.dtype for t in report.facts.tallies}
    assert set(FLOAT8) <= tallied and "bfloat16" in tallied
    scan = report.facts.scans[0]
    read = {t.name: t for t in scan.tensors}
    assert {f"model.p{i}" for i in range(len(FLOAT8))} <= set(read)
    # The torchao weight is read through its stored float8 data (NaN / inf counted; absmax of the stored elements).
    assert read["model.q.0.weight"].dtype == "float8_e4m3fn" and read["model.q.0.weight"].nan == 0
    if hasattr(torch, FLOAT4):
        assert dict(scan.skipped) == {"model.packed": "packed float4_e2m1fn_x2: torch has no kernel to read its values"}


def test_the_scan_counts_nan_in_a_quantized_weight_with_an_all_zero_row():
    """pytorch/ao#4713: a zero row quantizes to NaN; the scan counts it in the stored data."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 16)).to(torch.bfloat16)
    with torch.no_grad():
        m[0].weight[5].zero_()
    quantize_(m, Float8WeightOnlyConfig())
    scan = mpdoctor.diagnose(m, names={id(m): "model"}, scan=True).facts.scans[0]
    (w,) = [t for t in scan.tensors if t.name == "model.0.weight"]
    assert w.nan == 32


def test_the_crash_frame_reader_names_float8_locals():
    """The crash hook's frame reader quotes dtypes and shapes only (torch's own descriptors): float8 reads fine."""
    lin = torch.nn.Linear(8, 4)
    lin.weight.data = lin.weight.data.to(torch.float8_e4m3fn)
    try:
        lin(torch.randn(2, 8))
    except RuntimeError:
        lines = tensor_locals(traceback_frames(sys.exc_info()[2]))
    assert any("float8_e4m3fn[4, 8]" in line for line in lines), lines
