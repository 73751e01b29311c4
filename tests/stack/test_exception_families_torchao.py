"""torchao's exception families, raised for real by torchao 0.18 on this CPU and explained.

The refusals (block sizes, fp8 / NVFP4 capability) and the float8 training tensor's unsupported ops; the
checks are those of ``tests/test_exception_families.py`` (the torch families), here with torchao's objects.
"""

from __future__ import annotations

import pytest
import torch
from test_exception_families import check_explained, check_in_notebook, check_raised_examples, notebook_shell


def torchao_mxfp8_block():
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    activations = torch.randn(4, 40)
    to_mx(activations, torch.float8_e4m3fn, 32)


def torchao_nvfp4_block():
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    activations = torch.randn(4, 40)
    NVFP4Tensor.to_nvfp4(activations)


def torchao_nvfp4_quantize_dims():
    from torchao.prototype.mx_formats.inference_workflow import NVFP4DynamicActivationNVFP4WeightConfig
    from torchao.quantization import quantize_

    model = torch.nn.Sequential(torch.nn.Linear(40, 40)).to(torch.bfloat16)
    quantize_(model, NVFP4DynamicActivationNVFP4WeightConfig())


def torchao_float8_capability():
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, quantize_

    model = torch.nn.Sequential(torch.nn.Linear(32, 32)).to(torch.bfloat16)
    quantize_(model, Float8DynamicActivationFloat8WeightConfig())


def torchao_nvfp4_capability():
    from torchao.prototype.mx_formats.inference_workflow import NVFP4DynamicActivationNVFP4WeightConfig
    from torchao.quantization import quantize_

    model = torch.nn.Sequential(torch.nn.Linear(32, 32)).to(torch.bfloat16)
    quantize_(model, NVFP4DynamicActivationNVFP4WeightConfig())


def torchao_float8_tensor_op():
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    weight_fp8 = hp_tensor_to_float8_dynamic(torch.randn(16, 16), torch.float8_e4m3fn, LinearMMConfig())
    bias = torch.ones(16, 16)
    weight_fp8 + bias


RAISERS = {
    "crash-lowbit-block-size": [torchao_mxfp8_block, torchao_nvfp4_block, torchao_nvfp4_quantize_dims],
    "crash-fp8-capability": [torchao_float8_capability, torchao_nvfp4_capability],
    "crash-torchao-float8-op": [torchao_float8_tensor_op],
}
ALL_RAISERS = [(slug, fn) for slug, fns in RAISERS.items() for fn in fns]


def test_every_raised_torchao_example_of_the_catalogue_is_exactly_what_torchao_raises():
    check_raised_examples(RAISERS)


@pytest.mark.parametrize(("slug", "raise_it"), ALL_RAISERS, ids=[fn.__name__ for _, fn in ALL_RAISERS])
def test_torchao_refusals_are_explained_with_what_was_refused_and_the_fix(slug, raise_it):
    check_explained(slug, raise_it)


@pytest.fixture(scope="module")
def ip():
    yield from notebook_shell()


@pytest.mark.parametrize(("slug", "raise_it"), [(s, f[0]) for s, f in RAISERS.items()], ids=list(RAISERS))
def test_in_a_notebook_the_hook_explains_each_torchao_family(ip, capsys, slug, raise_it):
    check_in_notebook(ip, capsys, slug, raise_it)
