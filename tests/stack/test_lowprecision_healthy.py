"""Documented healthy low-precision recipes draw no error and no warning (torchao 0.18, accelerate, peft, diffusers).

Each recipe is built from the real libraries, trains one step on this CPU (finite loss, parameters changed) and
is diagnosed live and, where a GPU rule applies, against the H100 profile. What this CPU cannot run is said in
the test: torchao 0.18 has no MX *training* layers (its ``mx_formats`` package holds inference configs only),
and its MXFP8 inference matmul needs sm_100 kernels; TransformerEngine is not installable here
(``TERecipeKwargs`` raises "TransformerEngine is not available").
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("torchao")
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import AORecipeKwargs  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402

import mpdoctor  # noqa: E402


def loud(report) -> list:
    return [(f.check, f.severity, f.message[:160]) for f in report.findings if f.severity in ("error", "warning")]


def mlp(*dims: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in zip(dims, dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def step(model, x, opt=None, dtype=None) -> float:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = opt or torch.optim.AdamW(params, lr=1e-2)
    before = [p.detach().clone() for p in params]
    out = model(x if dtype is None else x.to(dtype))
    loss = out.float().pow(2).mean()
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, params)), "no parameter moved"
    return float(loss.detach())


def test_torchao_float8_with_a_module_filter():
    """torchao float8 README: ``convert_to_float8_training(model, module_filter_fn=...)`` keeping the last layer
    (and any dim not divisible by 16) in high precision; H100 target for the GPU rules."""
    m = mlp(32, 64, 64, 10)
    convert_to_float8_training(
        m,
        config=Float8LinearConfig.from_recipe_name("tensorwise"),
        module_filter_fn=lambda mod, fqn: fqn != "4" and mod.in_features % 16 == 0 and mod.out_features % 16 == 0,
    )
    step(m, torch.randn(16, 32))
    layers = mpdoctor.diagnose(m).facts.models[0].float8_layers
    assert [(x.path, x.recipe, x.weight_dtype, x.input_dtype, x.grad_dtype) for x in layers] == [
        ("0", "tensorwise", "float32", "float8_e4m3fn", "float8_e5m2"),
        ("2", "tensorwise", "float32", "float8_e4m3fn", "float8_e5m2"),
    ]
    assert "e4m3fn x float8_e4m3fn forward" in layers[0].computes_in
    for target in (None, "H100", "L4"):
        assert loud(mpdoctor.diagnose(m, target=target)) == []


def test_accelerate_fp8_with_the_ao_backend():
    """accelerate "Low precision training" guide: ``Accelerator(mixed_precision="fp8",
    kwargs_handlers=[AORecipeKwargs()])``. The model is prepared first and the optimizer built from the prepared
    model (accelerate swaps Linear for Float8Linear at prepare(), with new weight parameters); the first and last
    Linear stay in high precision, as accelerate's filter intends."""
    m = mlp(32, 64, 64, 64, 16)
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()], cpu=True)
    model = acc.prepare(m)
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert [type(x).__name__ for x in model if "Linear" in type(x).__name__] == ["Linear", "Float8Linear", "Float8Linear", "Linear"]
    x = torch.randn(16, 32)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(x).float().pow(2).mean()
    acc.backward(loss)
    opt.step()
    assert torch.isfinite(loss) and all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    report = mpdoctor.diagnose(model, opt, acc, names={id(model): "model", id(opt): "optimizer", id(acc): "accelerator"})
    assert loud(report) == []
    assert report.facts.precisions[0].computes_in == "fp8"
    assert len(report.facts.models[0].float8_layers) == 2
    # fp8 is on: the first and last Linear accelerate keeps out "for stability" are left alone, no fix converts them.
    (recipe,) = report.facts.ao_recipes
    assert not recipe.user_filter and not recipe.sharded
    assert not [fx for f in report.findings for fx in f.fixes if fx.recipe == "float8-convert-live"]


def test_accelerate_fp8_with_the_users_own_module_filter():
    """accelerate's ``AORecipeKwargs(module_filter_func=...)``: the user converts the inner layers they choose; the
    ones their filter refuses (the aligned first and last Linear too) stay high precision, drawing nothing."""
    acc = Accelerator(mixed_precision="fp8", cpu=True,
                      kwargs_handlers=[AORecipeKwargs(module_filter_func=lambda mod, fqn: fqn == "2")])  # fmt: skip
    model = acc.prepare(mlp(32, 64, 64, 16))
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert [type(x).__name__ for x in model if "Linear" in type(x).__name__] == ["Linear", "Float8Linear", "Linear"]
    acc.backward(model(torch.randn(16, 32)).float().pow(2).mean())
    opt.step()
    report = mpdoctor.diagnose(model, opt, acc, names={id(model): "model", id(opt): "optimizer", id(acc): "accelerator"})
    assert loud(report) == [] and report.facts.ao_recipes[0].user_filter
    assert not [fx for f in report.findings for fx in f.fixes if fx.recipe == "float8-convert-live"]


def test_fp8_requested_through_the_launcher_with_bf16_false_is_no_override(tmp_path):
    """``accelerate launch --mixed_precision fp8 train.py`` sets ACCELERATE_MIXED_PRECISION=fp8; TrainingArguments
    has no fp8 flag, and ``bf16=False`` is how a script leaves the launcher's choice alone (transformers keeps the
    variable when neither fp16 nor bf16 is set). mpdoctor 0.1 called that a precision override (error)."""
    from transformers import TrainingArguments

    os.environ["ACCELERATE_MIXED_PRECISION"] = "fp8"
    args = TrainingArguments(str(tmp_path), bf16=False, use_cpu=True, report_to=[])
    assert os.environ["ACCELERATE_MIXED_PRECISION"] == "fp8"  # transformers kept the launcher's choice
    report = mpdoctor.diagnose(args, names={id(args): "args"})
    assert loud(report) == [] and report.facts.precisions[0].computes_in == "fp8"
    assert loud(mpdoctor.diagnose(args, target="H100")) == []


class CastLinear(torch.nn.Linear):
    """ComfyUI-style manual cast: the weight is stored in float8 and cast to the input's dtype in forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), bias)


def test_fp8_storage_upcast_per_layer_with_diffusers_layerwise_casting():
    """diffusers ``enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)``
    (``apply_layerwise_casting`` on any module): weights stored in float8, cast to bf16 around each forward.
    mpdoctor 0.1 read the float8 weights as the model's compute dtype and called it mixed-param-dtypes (error),
    offering to cast the bf16 parameters to float8: a cast after which no matmul runs."""
    from diffusers.hooks import apply_layerwise_casting

    m = mlp(32, 64, 16)
    apply_layerwise_casting(m, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    assert m[0].weight.dtype == torch.float8_e4m3fn
    for p in m.parameters():
        p.requires_grad_(False)
    head = torch.nn.Linear(16, 4).to(torch.bfloat16)  # a trainable bf16 head on the frozen fp8-stored body
    model = torch.nn.Sequential(m, head)
    step(model, torch.randn(8, 32), dtype=torch.bfloat16)
    assert m[0].weight.dtype == torch.float8_e4m3fn  # back to storage after the forward
    report = mpdoctor.diagnose(model, names={id(model): "model"})
    assert loud(report) == []
    stored = report.facts.models[0].stored_layers
    assert [(x.path, x.storage_dtype, x.upcast, x.compute_dtype, x.computes_in) for x in stored] == [
        ("0.0", "float8_e4m3fn", "diffusers layerwise casting", "bfloat16", "bfloat16"),
        ("0.2", "float8_e4m3fn", "diffusers layerwise casting", "bfloat16", "bfloat16"),
    ]
    assert report.facts.models[0].tensors.main_dtype == "bfloat16"


def test_fp8_storage_upcast_in_the_layers_own_forward():
    """ComfyUI-style ``manual_cast`` layers: float8 weights, cast to the input dtype inside ``forward``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(CastLinear(32, 64), torch.nn.ReLU(), CastLinear(64, 16)).to(torch.bfloat16)
    for layer in (model[0], model[2]):
        layer.weight.requires_grad_(False)
        layer.weight.data = layer.weight.data.to(torch.float8_e4m3fn)
    step(model, torch.randn(8, 32), dtype=torch.bfloat16)  # the bf16 biases train
    report = mpdoctor.diagnose(model, names={id(model): "model"})
    assert loud(report) == []
    assert {x.upcast for x in report.facts.models[0].stored_layers} == {f"its own forward ({__name__}.CastLinear)"}


class ScaledCastLinear(torch.nn.Linear):
    """Scaled e4m3 storage: ``(w * s).to(e4m3)`` with ``s = 448 / amax``, and ``w = stored / s`` in forward."""

    def store(self) -> None:
        w = self.weight.detach()
        scale = 448.0 / w.abs().max().clamp(min=1e-12)
        self.register_buffer("scale_weight", scale.reciprocal())
        self.weight = torch.nn.Parameter((w * scale).to(torch.float8_e4m3fn), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.to(x.dtype) * self.scale_weight.to(x.dtype)
        return torch.nn.functional.linear(x, w, self.bias)


def test_scaled_e4m3_storage_of_a_wide_range_weight():
    """Weights up to 2000 (past e4m3's 448) stored with a per-tensor scale: the largest element maps to 448 by
    design, so a value at the format's maximum is not clipping; the dequantized weight is within e4m3's
    rounding of the original. No warning."""
    torch.manual_seed(0)
    layer = ScaledCastLinear(64, 32)
    with torch.no_grad():
        layer.weight.mul_(2000 / layer.weight.abs().max())
    original = layer.weight.detach().clone()
    layer.store()
    restored = layer.weight.float() * layer.scale_weight
    assert ((restored - original).abs() <= original.abs() * 2**-3 + 1e-6).all()  # e4m3: 3 mantissa bits
    model = torch.nn.Sequential(layer)
    step(model, torch.randn(8, 64))
    report = mpdoctor.diagnose(model, names={id(model): "model"})
    assert loud(report) == []
    (stored,) = report.facts.models[0].stored_layers
    assert stored.scaled and stored.saturated >= 1


def test_mxfp8_and_nvfp4_weights_with_aligned_dims():
    """torchao ``mx_formats``: ``quantize_(model, MXDynamicActivationMXWeightConfig())`` (MXFP8: e4m3 elements,
    e8m0 scales per 32) and ``NVFP4WeightOnlyConfig()`` (e2m1 elements, e4m3 scales per 16) on dims that are
    multiples of the block. torchao 0.18 ships no MX training layer, so "e4m3 gradients" has nothing to convert
    here; the MXFP8 matmul needs sm_100 kernels (its CPU forward refuses: judged healthy on the B200 profile),
    the NVFP4 weight-only forward runs here (judged live)."""
    from torchao.prototype.mx_formats import MXDynamicActivationMXWeightConfig, NVFP4WeightOnlyConfig
    from torchao.quantization import quantize_

    mx = mlp(64, 64, 32).to(torch.bfloat16)
    quantize_(mx, MXDynamicActivationMXWeightConfig())
    nv = mlp(64, 64, 32).to(torch.bfloat16)
    quantize_(nv, NVFP4WeightOnlyConfig())
    assert torch.isfinite(nv(torch.randn(4, 64, dtype=torch.bfloat16))).all()
    for model, cls, block, target in ((mx, "MXTensor", 32, "B200"), (nv, "NVFP4Tensor", 16, None)):
        report = mpdoctor.diagnose(model, names={id(model): "model"}, target=target)
        assert loud(report) == []
        q = report.facts.models[0].quantized_weights
        assert [(x.path, x.tensor_class.rsplit(".", 1)[-1], x.block_size, x.nonfinite) for x in q] == [
            ("0", cls, block, 0),
            ("2", cls, block, 0),
        ]


def test_lora_on_a_float8_converted_base():
    """fp8 with LoRA adapters: PEFT LoRA on a base converted by ``convert_to_float8_training`` (``Float8Linear``
    subclasses ``nn.Linear``, so PEFT wraps it): the frozen base computes in float8, the fp32 adapters train."""
    base = mlp(32, 64, 64, 16)
    convert_to_float8_training(base)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["0", "2"]))
    step(model, torch.randn(16, 32))
    report = mpdoctor.diagnose(model, names={id(model): "model"})
    assert loud(report) == []
    assert len(report.facts.models[0].float8_layers) == 3


class WeightCastLinear(torch.nn.Linear):
    """Casts only its float8 weight to the input's dtype (the bias is kept in the compute dtype)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), self.bias)


def test_lora_on_an_fp8_stored_frozen_base_and_the_planned_fixes_keep_the_step_working():
    """LoRA on a frozen base whose weights are stored in float8 and cast up inside each layer's forward.
    mpdoctor 0.1 read float8 as the compute dtype (mixed-param-dtypes, error) and planned "cast 2 parameters to
    float8_e4m3fn" (the bf16 biases): applied, the next forward raised "mat1 and mat2 must have the same dtype"
    (reproduced against the previous commit). Now nothing loud is found, no planned fix casts to float8, and
    after applying every planned fix the step trains."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(WeightCastLinear(32, 64), torch.nn.ReLU(), WeightCastLinear(64, 16)).to(torch.bfloat16)
    for layer in (base[0], base[2]):
        layer.weight.data = layer.weight.data.to(torch.float8_e4m3fn)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["0", "2"]))
    x = torch.randn(8, 32)
    step(model, x, dtype=torch.bfloat16)
    report = mpdoctor.diagnose(model, names={id(model): "model"})
    assert loud(report) == []
    assert not any("float8" in (fx.code or "") + fx.title for fx in report.fixes)
    for fx in report.fixes:
        fx.apply()
    step(model, x, dtype=torch.bfloat16)
    # The diffusers variant: layerwise casting under the adapters.
    from diffusers.hooks import apply_layerwise_casting

    base = mlp(32, 64, 64, 16).to(torch.bfloat16)
    apply_layerwise_casting(base, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["0", "2"]))
    step(model, x, dtype=torch.bfloat16)
    assert loud(mpdoctor.diagnose(model, names={id(model): "model"})) == []


def test_the_launchers_fp8_with_bf16_false_and_the_model_prepared_before_the_optimizer(tmp_path, monkeypatch):
    """``accelerate launch --mixed_precision fp8`` (its variables set as the launcher sets them; the list is checked
    against the real launcher in test_field_lowprecision), ``TrainingArguments(bf16=False)``, and accelerate's
    documented order for fp8: the model prepared first, the optimizer built from the prepared model. The
    arguments keep the launcher's fp8 and the accelerator is fp8 with two float8 layers that train. (A
    transformers 5.23 Trainer prepares both together and its float8 weights do not train: see
    test_bf16_true_under_the_launchers_fp8_is_named_and_the_advice_lets_fp8_through.)"""
    from test_field_lowprecision import LAUNCHER_FP8_ENV
    from transformers import TrainingArguments

    for k, v in LAUNCHER_FP8_ENV.items():
        monkeypatch.setenv(k, v)
    args = TrainingArguments(str(tmp_path), bf16=False, use_cpu=True, report_to=[])
    assert args.mixed_precision == "fp8"
    acc = Accelerator(mixed_precision=args.mixed_precision, cpu=True)
    model = acc.prepare(mlp(32, 64, 64, 64, 16))
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert acc.mixed_precision == "fp8" and len([x for x in model if type(x).__name__ == "Float8Linear"]) == 2
    x = torch.randn(16, 32)
    before = [p.detach().clone() for p in model.parameters()]
    acc.backward(model(x).float().pow(2).mean())
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    names = {id(model): "model", id(opt): "optimizer", id(acc): "accelerator", id(args): "args"}
    report = mpdoctor.diagnose(model, opt, acc, args, names=names)
    assert loud(report) == [] and {p.computes_in for p in report.facts.precisions} == {"fp8"}


def test_mxfp8_recipe_with_e4m3_for_every_tensor(tmp_path, monkeypatch):
    """NVIDIA's MXFP8 recipe through accelerate: ``TERecipeKwargs(use_mxfp8_block_scaling=True,
    fp8_format="E4M3")``. TransformerEngine is not installable here: a stand-in distribution (see
    ``te_distribution`` in test_field_lowprecision) lets accelerate build the handler for real; nothing imports
    TE. E4M3 is passed to TE explicitly, and mpdoctor says nothing about the recipe, not even info."""
    from accelerate.utils import TERecipeKwargs

    root = tmp_path / "te_site"
    (root / "transformer_engine").mkdir(parents=True)
    (root / "transformer_engine" / "__init__.py").write_text("raise ImportError('stand-in')\n")
    (root / "transformer_engine-2.20.2.dist-info").mkdir()
    (root / "transformer_engine-2.20.2.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: transformer-engine\nVersion: 2.20.2\n")
    monkeypatch.syspath_prepend(str(root))
    handler = TERecipeKwargs(use_mxfp8_block_scaling=True, fp8_format="E4M3")
    assert handler.to_kwargs() == {"fp8_format": "E4M3", "use_mxfp8_block_scaling": True}
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[handler], cpu=True)
    report = mpdoctor.diagnose(acc, names={id(acc): "accelerator"})
    assert report.facts.fp8_recipes[0].runs_format == "E4M3"
    assert loud(report) == [] and "mxfp8-e5m2-gradients" not in {f.check for f in report.findings}
    assert loud(mpdoctor.diagnose(acc, target="B200")) == []
