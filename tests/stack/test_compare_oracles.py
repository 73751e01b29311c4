"""The quantizers of ``mpdoctor.emulation.formats``, bit for bit against torchao's reference implementations.

torchao's CPU reference paths (``to_mx``, ``NVFP4Tensor.to_nvfp4``, ``hp_tensor_to_float8_dynamic``) are the
oracles; its kernels (``_C_mxfp8``, cutlass) are not needed. Then the whole emulated Linear against torchao's
real ``Float8Linear`` (``convert_to_float8_training``, which trains on this CPU): same output and gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mpdoctor.emulation import formats
from mpdoctor.emulation.compare import compare
from mpdoctor.emulation.formats import precision
from mpdoctor.emulation.sites import Emulation as _Emulation
from mpdoctor.emulation.sites import linears as _linears

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
    return [plain, wide, odd]


@pytest.mark.parametrize("index", range(3))
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


def test_mx_shared_scale_is_two_to_the_floor_log2_of_block_amax_minus_8():
    x = samples()[1]
    scale, _ = to_mx(x, torch.float8_e4m3fn, 32)
    amax = x.reshape(64, 8, 32).abs().amax(-1)
    expected = torch.exp2(torch.floor(torch.log2(amax)) - 8)
    assert torch.equal(get_fp_scale(scale), expected)
    assert torch.equal(torch.exp2((formats.mx_scale_bits(amax) - 127).float()), expected)


@pytest.mark.parametrize("index", range(3))
def test_nvfp4_equals_torchao_to_nvfp4_with_a_per_tensor_scale_bit_for_bit(index):
    x = samples()[index]
    nv = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().max()))
    oracle = nv.dequantize(torch.float32)
    assert torch.equal(bits(formats.quantize_nvfp4(x, dim=1).values), bits(oracle))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("index", range(3))
def test_tensorwise_fp8_equals_hp_tensor_to_float8_dynamic_bit_for_bit(index, dtype):
    x = samples()[index]
    t = hp_tensor_to_float8_dynamic(x, dtype, LinearMMConfig())
    oracle = t._data.to(torch.float32) / t._scale
    ours = formats.quantize_tensorwise(x, dtype)
    assert torch.equal(bits(ours.values), bits(oracle))
    assert torch.equal(formats.tensorwise_scale(x, dtype), t._scale)


@pytest.mark.parametrize("index", range(3))
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


@pytest.mark.parametrize("index", range(3))
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
    from mpdoctor.checks.lowbit import MXFP8_GRAD_SQNR_DB

    def sqnr(x, q):
        return float(10 * torch.log10(x.pow(2).sum() / (x - q).pow(2).sum()))

    grad = torch.randn(1024, 4096, generator=torch.Generator().manual_seed(0))
    e4 = sqnr(grad, formats.quantize_mx(grad, 1, torch.float8_e4m3fn).values)
    e5 = sqnr(grad, formats.quantize_mx(grad, 1, torch.float8_e5m2).values)
    assert abs(e4 - MXFP8_GRAD_SQNR_DB["E4M3"]) < 0.05 and abs(e5 - MXFP8_GRAD_SQNR_DB["E5M2"]) < 0.05
    assert e4 - e5 > 5.0
