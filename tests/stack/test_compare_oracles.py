"""The quantizers of ``mpdoctor.attach.emulation.formats``, bit for bit against torchao's reference implementations.

torchao's CPU reference paths (``to_mx``, ``NVFP4Tensor.to_nvfp4``, ``hp_tensor_to_float8_dynamic``) are the
oracles; its kernels (``_C_mxfp8``, cutlass) are not needed. Then the whole emulated Linear against torchao's
real ``Float8Linear`` (``convert_to_float8_training``, which trains on this CPU): same output and gradients.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from mpdoctor.attach.emulation import formats
from mpdoctor.attach.emulation.compare import compare
from mpdoctor.attach.emulation.formats import precision
from mpdoctor.attach.emulation.sites import Emulation as _Emulation
from mpdoctor.attach.emulation.sites import linears as _linears

pytest.importorskip("torchao")

from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.config import ScalingGranularity  # noqa: E402
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic  # noqa: E402
from torchao.float8.float8_training_tensor import LinearMMConfig  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import get_fp_scale, to_mx  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale  # noqa: E402


def bits(t: torch.Tensor) -> torch.Tensor:
    """A float32 tensor's bit pattern (so -0.0 and 0.0, or two NaNs, are told apart exactly)."""
    return t.contiguous().view(torch.int32)


def samples() -> list[torch.Tensor]:
    """Gaussian, a six-decade channel range, an all-zero block, huge and tiny values, negative zeros."""
    g = torch.Generator().manual_seed(0)
    plain = torch.randn(64, 256, generator=g)
    wide = torch.randn(64, 256, generator=g) * torch.logspace(-6, 0, 256)
    odd = torch.randn(32, 128, generator=g) * 1e4
    odd[:, :32] = 0.0
    odd[3, 40:48] = -0.0
    odd[5, 64:96] = torch.randn(32, generator=g) * 1e-30
    # Larger than two rounding chunks, the last one partial: the chunked in-place rounding meets its seams.
    large = torch.randn(320, 512, generator=g) * torch.logspace(-9, 3, 512)
    large[7, :64] = -0.0
    return [plain, wide, odd, large]


#: Every sample's index, for the oracles run on each.
SAMPLES = range(4)


@pytest.mark.parametrize("index", SAMPLES)
def test_mxfp8_equals_torchao_to_mx_dequantized_bit_for_bit(index):
    x = samples()[index]
    scale, data = to_mx(x, torch.float8_e4m3fn, 32)
    rows, k = x.shape
    oracle = (data.float().reshape(rows, k // 32, 32) * get_fp_scale(scale).unsqueeze(-1)).reshape(rows, k)
    ours = formats.quantize_mx(x, dim=1)
    assert torch.equal(bits(ours.values), bits(oracle))
    # Along the other dimension (the weight-gradient matmul): the same as torchao on the transpose.
    scale_t, data_t = to_mx(x.t().contiguous(), torch.float8_e4m3fn, 32)
    oracle_t = (data_t.float().reshape(k, rows // 32, 32) * get_fp_scale(scale_t).unsqueeze(-1)).reshape(k, rows)
    assert torch.equal(bits(formats.quantize_mx(x, dim=0).values.t().contiguous()), bits(oracle_t))


@pytest.mark.parametrize("index", SAMPLES)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_mx_rceil_equals_torchao_to_mx_rceil_bit_for_bit_along_both_dims(index, dtype):
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    x = samples()[index]
    rows, k = x.shape
    for dim, t in ((1, x), (0, x.t().contiguous())):
        scale, data = to_mx(t, dtype, 32, scaling_mode=ScaleCalculationMode.RCEIL)
        n, m = t.shape
        oracle = (data.float().reshape(n, m // 32, 32) * get_fp_scale(scale).unsqueeze(-1)).reshape(n, m)
        ours = formats.quantize_mx(x, dim=dim, dtype=dtype, scale_mode="rceil").values
        assert torch.equal(bits(ours if dim == 1 else ours.t().contiguous()), bits(oracle))
        # The scale rounds amax / fmax up: no element of any block saturates, where FLOOR's scales clip some.
        assert formats.quantize_mx(x, dim=dim, dtype=dtype, scale_mode="rceil").saturated == 0
    assert formats.quantize_mx(samples()[0], dim=1, dtype=dtype).saturated > 0
    # RCEIL and FLOOR differ: the figures of one do not stand for the other.
    assert not torch.equal(formats.quantize_mx(x, 1, dtype, scale_mode="rceil").values, formats.quantize_mx(x, 1, dtype).values)


def test_compare_names_the_scale_mode_of_each_mx_column_and_plan():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    c = compare(model, torch.randn(32, 64), precisions=("bf16", "mxfp8", "mxfp8-rceil"))
    header = next(line for line in c.to_text().splitlines() if line.strip().startswith("layer"))
    assert "mxfp8 [FLOOR]" in header and "mxfp8-rceil [RCEIL]" in header and "bf16 [" not in header
    html = c.to_html()
    assert ">mxfp8 [FLOOR]</th>" in html and ">mxfp8-rceil [RCEIL]</th>" in html
    plan = c.plan("mxfp8-rceil")
    assert plan.to_text().startswith("plan mxfp8-rceil [RCEIL]:")
    assert "MXFP8_RCEIL" in plan.code and "assume this recipe's RCEIL scales" in plan.code
    assert "assume FLOOR scales" in c.plan("mxfp8").code
    assert c.losses["mxfp8-rceil"] != c.losses["mxfp8"]


def test_mx_shared_scale_is_two_to_the_floor_log2_of_block_amax_minus_8():
    x = samples()[1]
    scale, _ = to_mx(x, torch.float8_e4m3fn, 32)
    amax = x.reshape(64, 8, 32).abs().amax(-1)
    expected = torch.exp2(torch.floor(torch.log2(amax)) - 8)
    assert torch.equal(get_fp_scale(scale), expected)
    assert torch.equal(torch.exp2((formats.mx_scale_bits(amax) - 127).float()), expected)


@pytest.mark.parametrize("index", SAMPLES)
def test_nvfp4_equals_torchao_to_nvfp4_with_a_per_tensor_scale_bit_for_bit(index):
    x = samples()[index]
    nv = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().max()))
    oracle = nv.dequantize(torch.float32)
    assert torch.equal(bits(formats.quantize_nvfp4(x, dim=1).values), bits(oracle))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("index", SAMPLES)
def test_tensorwise_fp8_equals_hp_tensor_to_float8_dynamic_bit_for_bit(index, dtype):
    x = samples()[index]
    t = hp_tensor_to_float8_dynamic(x, dtype, LinearMMConfig())
    oracle = t._data.to(torch.float32) / t._scale
    ours = formats.quantize_tensorwise(x, dtype)
    assert torch.equal(bits(ours.values), bits(oracle))
    assert torch.equal(formats.tensorwise_scale(x, dtype), t._scale)


@pytest.mark.parametrize("index", SAMPLES)
def test_rowwise_fp8_equals_torchao_axiswise_power_of_two_scales_bit_for_bit(index):
    x = samples()[index]
    t = hp_tensor_to_float8_dynamic(
        x,
        torch.float8_e4m3fn,
        LinearMMConfig(),
        scaling_granularity=ScalingGranularity.AXISWISE,
        axiswise_dim=-1,
        round_scales_to_power_of_2=True,
    )
    assert torch.equal(bits(formats.quantize_rowwise(x, dim=1).values), bits(t._data.float() / t._scale))


def test_e4m3_saturates_and_e5m2_overflows_on_this_cpu_as_the_formats_assume():
    big = torch.tensor([500.0, 70000.0, float("inf")])
    assert big.to(torch.float8_e4m3fn).float().tolist() == [448.0, 448.0, 448.0]
    assert big.to(torch.float8_e5m2).float()[1:].isinf().all()


def test_emulated_fp8_linear_matches_torchaos_float8linear_forward_and_backward():
    """The whole emulated Linear against torchao's real Float8Linear (tensorwise) on this CPU."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False))
    x = torch.randn(32, 64) * torch.logspace(-6, 0, 64)
    real = convert_to_float8_training(copy.deepcopy(model), config=Float8LinearConfig.from_recipe_name("tensorwise"))
    assert type(real[0]).__name__ == "Float8Linear"
    x_real = x.clone().requires_grad_()
    y_real = real(x_real)
    y_real.square().sum().backward()
    x_emu = x.clone().requires_grad_()
    with _Emulation(_linears(model), precision("fp8")):
        y_emu = model(x_emu)
    y_emu.square().sum().backward()
    torch.testing.assert_close(y_emu, y_real, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model[0].weight.grad, real[0].weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_emu.grad, x_real.grad, rtol=1e-5, atol=1e-6)
    # The underflow compare reports is real in torchao too: whole input channels get exactly zero gradient.
    dead_real = (real[0].weight.grad == 0).all(dim=0)
    assert dead_real.sum() > 0 and torch.equal(dead_real, (model[0].weight.grad == 0).all(dim=0))
    assert compare(model, x, precisions=("fp8",)).row("0", "fp8").act_underflow_pct > 5


@pytest.mark.parametrize("index", SAMPLES)
def test_mx_e5m2_elements_equal_torchao_to_mx_e5m2_bit_for_bit(index):
    """The gradients of an MXFP8 recipe in HYBRID format: e5m2 elements, block scale 2^(floor(log2 amax) - 15)."""
    x = samples()[index]
    scale, data = to_mx(x, torch.float8_e5m2, 32)
    rows, k = x.shape
    oracle = (data.float().reshape(rows, k // 32, 32) * get_fp_scale(scale).unsqueeze(-1)).reshape(rows, k)
    ours = formats.quantize_mx(x, dim=1, dtype=torch.float8_e5m2)
    assert torch.equal(bits(ours.values), bits(oracle))
    assert torch.equal(bits(formats.precision("mxfp8-hybrid").quantize(x, 1, grad=True).values), bits(oracle))


def test_e5m2_gradients_under_mx_block_scales_lose_5_db_against_e4m3():
    """The measured harm behind ``mxfp8-e5m2-gradients``: the figures its message quotes."""
    from mpdoctor.rules.checks.fp8_training import MXFP8_GRAD_SQNR_DB

    def sqnr(x, q):
        return float(10 * torch.log10(x.pow(2).sum() / (x - q).pow(2).sum()))

    grad = torch.randn(1024, 4096, generator=torch.Generator().manual_seed(0))
    e4 = sqnr(grad, formats.quantize_mx(grad, 1, torch.float8_e4m3fn).values)
    e5 = sqnr(grad, formats.quantize_mx(grad, 1, torch.float8_e5m2).values)
    assert abs(e4 - MXFP8_GRAD_SQNR_DB["E4M3"]) < 0.05 and abs(e5 - MXFP8_GRAD_SQNR_DB["E5M2"]) < 0.05
    assert e4 - e5 > 5.0


# -- the emulated backward, proven against an independent reference ---------------------------------
#
# A Linear y = x Wᵀ, x (M, K), W (N, K), output gradient g (M, N), has three matmuls, each contracting
# over its own dim: the output (over K), the input gradient g @ W (over N) and the weight gradient gᵀ @ x
# (over M). The reference quantizes each operand with torchao's own quantizer along that matmul's
# contraction dim (transposing so the blocks or rows lie along it) and multiplies in plain fp32. Every MX
# figure here assumes FLOOR scales (OCP MX v1.0, torchao ``to_mx``'s default; torchao's MX training
# recipes use RCEIL, which rounds the shared scale up where FLOOR rounds down).


def _mx(t: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """torchao's MX quantizer, dequantized, blocks of 32 along the last dim (FLOOR scales)."""
    scale, data = to_mx(t.contiguous(), dtype, 32)
    rows, k = t.shape
    return (data.float().reshape(rows, k // 32, 32) * get_fp_scale(scale).unsqueeze(-1)).reshape(rows, k)


def _nvfp4(t: torch.Tensor) -> torch.Tensor:
    """torchao's NVFP4 quantizer (per-tensor amax scale, blocks of 16 along the last dim), dequantized."""
    t = t.contiguous()
    return NVFP4Tensor.to_nvfp4(t, per_tensor_scale=per_tensor_amax_to_scale(t.abs().max())).dequantize(torch.float32)


def _rowwise(t: torch.Tensor) -> torch.Tensor:
    """torchao's rowwise float8 (axiswise along the last dim, power-of-two scales), dequantized."""
    f = hp_tensor_to_float8_dynamic(t.contiguous(), torch.float8_e4m3fn, LinearMMConfig(), scaling_granularity=ScalingGranularity.AXISWISE,
                                    axiswise_dim=-1, round_scales_to_power_of_2=True)  # fmt: skip
    return f._data.float() / f._scale


ORACLES = {"mxfp8": _mx, "nvfp4": _nvfp4, "fp8-rowwise": _rowwise}


def along(quantize, t: torch.Tensor, dim: int) -> torch.Tensor:
    """``quantize`` applied with its blocks / rows along ``dim`` of a 2-D ``t``."""
    return quantize(t) if dim in (1, -1) else quantize(t.t()).t()


def reference_grads(name: str, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Input and weight gradients with every operand quantized by torchao along its matmul's contraction dim."""
    q = ORACLES[name]
    grad_x = along(q, g, 1) @ along(q, w, 0)  # g @ W: contracted over N (g's dim 1, W's dim 0)
    grad_w = along(q, g, 0).t() @ along(q, x, 0)  # gᵀ @ x: contracted over M (dim 0 of both)
    return grad_x, grad_w


def emulated_grads(prec, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The input and weight gradients of mpdoctor's emulated Linear under ``prec``, for output gradient ``g``."""
    layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(w)
    xx = x.clone().requires_grad_()
    with _Emulation(_linears(layer), prec):
        y = layer(xx)
    y.backward(g)
    return xx.grad, layer.weight.grad


def matches(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Equal up to fp32 accumulation order (the operands are bit-exact; only the matmul's sums may differ)."""
    return all(torch.allclose(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max())) for a, b in zip(got, want))


@dataclasses.dataclass(frozen=True)
class WrongGradientDim(formats.Precision):
    """A mutant: output gradients quantized along the other dim than the matmul contracts over."""

    def quantize(self, x, dim, grad=False, count=True):  # type: ignore[override]
        return super().quantize(x, 1 - dim % 2 if grad else dim, grad, count)


@dataclasses.dataclass(frozen=True)
class UnquantizedGradient(formats.Precision):
    """A mutant: output gradients left in fp32."""

    def quantize(self, x, dim, grad=False, count=True):  # type: ignore[override]
        return formats.Quantized(x, *(torch.zeros((), dtype=torch.int64),) * 3) if grad else super().quantize(x, dim, grad, count)


def _operands(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (64, 128) with wide-range channels, W (96, 128), g (64, 96) with wide-range rows: block placement matters."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 128, generator=gen) * torch.logspace(-3, 0, 128)
    w = torch.randn(96, 128, generator=gen)
    g = torch.randn(64, 96, generator=gen) * torch.logspace(-3, 0, 64).unsqueeze(1)
    return x, w, g


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4", "fp8-rowwise"])
def test_emulated_input_and_weight_gradients_equal_torchao_quantized_operands_along_each_contraction_dim(name):
    x, w, g = _operands()
    prec = precision(name)
    got = emulated_grads(prec, x, w, g)
    want = reference_grads(name, x, w, g)
    assert matches(got, want), name
    # The mutants fail the same check: a gradient operand quantized along the wrong dim, or not at all.
    fields = {f.name: getattr(prec, f.name) for f in dataclasses.fields(prec)}
    for mutant in (WrongGradientDim(**fields), UnquantizedGradient(**fields)):
        assert not matches(emulated_grads(mutant, x, w, g), want), (name, type(mutant).__name__)


def test_nvfp4_equals_torchao_along_both_dimensions():
    """The NVFP4 oracle along dim 1 (rows of blocks) and dim 0 (the transpose: the weight-gradient operands)."""
    for x in samples():
        rows, k = x.shape
        assert torch.equal(bits(formats.quantize_nvfp4(x, dim=1).values), bits(_nvfp4(x)))
        assert torch.equal(bits(formats.quantize_nvfp4(x, dim=0).values), bits(_nvfp4(x.t()).t().contiguous()))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_chunked_in_place_rounding_equals_torchs_float8_cast_across_chunks_and_on_a_strided_view(dtype):
    x = samples()[3]
    assert x.numel() > 2 * formats.ROUND_CHUNK and x.numel() % formats.ROUND_CHUNK
    fmax = torch.finfo(dtype).max
    saturated = x.mul(1e3).clamp(-fmax, fmax)  # the caller saturates first; spans the format's whole range
    mantissa, min_exp = (3, -6) if dtype == torch.float8_e4m3fn else (2, -14)
    oracle = saturated.to(dtype).to(torch.float32)
    assert torch.equal(bits(formats.round_mantissa_(saturated.clone(), mantissa, min_exp)), bits(oracle))
    strided = saturated.clone().t()  # not contiguous: rounded on the view, in one piece
    assert not strided.is_contiguous()
    assert torch.equal(bits(formats.round_mantissa_(strided, mantissa, min_exp)), bits(oracle.t()))
