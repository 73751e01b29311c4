"""Field cases of low-precision setups (fp8 storage, fp8 recipes, quantized float8 weights), reproduced on this CPU.

Each test shows the real error or the measured harm first, then mpdoctor's finding, then the advice taken and a
step that trains. GPU-only rules (float8 GEMMs need compute capability 8.9+) are judged against ``target=``
profiles, and the tests say so. Measured here (torch 2.13 CPU): ``.to(torch.float8_e4m3fn)`` saturates at 448
(inf too), ``.to(torch.float8_e5m2)`` overflows to inf past 57344.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("torchao")
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import AORecipeKwargs  # noqa: E402
from diffusers.hooks import apply_layerwise_casting  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import mpdoctor  # noqa: E402


def severities(report) -> dict[str, str]:
    return {f.check: f.severity for f in report.findings}


def finding(report, slug: str):
    return next(f for f in report.findings if f.check == slug)


def mlp(*dims: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in zip(dims, dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def trains(model, x, opt=None) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = opt or torch.optim.AdamW(params, lr=1e-2)
    before = [p.detach().clone() for p in params]
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, params)), "no parameter moved"


# -- fp8 storage nothing upcasts ----------------------------------------------------------------------------


def fp8_stored_mlp(dtype: torch.dtype = torch.bfloat16) -> torch.nn.Sequential:
    """Weights cast to float8_e4m3fn to save memory, biases in ``dtype``, stock ``nn.Linear`` layers."""
    m = mlp(32, 64, 16).to(dtype)
    for layer in (m[0], m[2]):
        layer.weight.requires_grad_(False)
        layer.weight.data = layer.weight.data.to(torch.float8_e4m3fn)
    return m


def fp8_embedding_model() -> torch.nn.Sequential:
    """A stock ``nn.Embedding`` storing float8 rows before a bf16 Linear."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(16, 32), torch.nn.Linear(32, 8)).to(torch.bfloat16)
    m[0].weight.requires_grad_(False)
    m[0].weight.data = m[0].weight.data.to(torch.float8_e4m3fn)
    return m


def upcast_reference(m: torch.nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """What the float8-storage recipe means: each layer computes with its float8 weight cast to bf16."""
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            x = torch.nn.functional.linear(x, layer.weight.to(torch.bfloat16), layer.bias)
        elif isinstance(layer, torch.nn.Embedding):
            x = torch.nn.functional.embedding(x, layer.weight.to(torch.bfloat16))
        else:
            x = layer(x)
    return x


def test_fp8_weights_in_stock_linear_layers_raise_and_the_fix_upcasts_each_layer_in_place():
    """kijai/ComfyUI-ControlNeXt-SVD#7: "mat1 and mat2 must have the same dtype, but got Half and
    Float8_e4m3fn"; lodestone-rock/ComfyUI_FluxMod#27: "self and mat2 must have the same dtype, but got BFloat16
    and Float8_e4m3fn". float8-stored weights reached a stock Linear that nothing casts up. The fix wraps each such
    layer's forward in place: it computes with the weight cast to bf16 (exact), the storage stays float8, and the
    same call runs and gives exactly what the recipe means; undo restores the layers exactly; a bf16 head on top
    trains."""
    from fingerprint import assert_unchanged, fingerprint

    m = fp8_stored_mlp()
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        m(x)
    report = mpdoctor.diagnose(m, names={id(m): "model"})
    f = finding(report, "fp8-storage-not-upcast")
    assert f.severity == "error" and "0 (Linear: float8_e4m3fn), 2 (Linear: float8_e4m3fn)" in f.message
    assert "mixed-param-dtypes" not in severities(report)  # storage, not a second compute dtype
    (fix,) = f.fixes
    assert fix.safe and "model[0].weight.to(torch.bfloat16)" in fix.code and "enable_layerwise_casting" in fix.code
    assert [fx.key for fx in report.fixes] == [fix.key]  # the plan
    before = fingerprint({"model": m})
    fix.apply()
    assert fix.applied and all(layer.weight.dtype == torch.float8_e4m3fn for layer in (m[0], m[2]))  # storage kept
    assert torch.equal(m(x), upcast_reference(m, x))  # the same call runs: what the float8 storage recipe means
    assert m[0](x).dtype == torch.bfloat16  # the layer called directly is covered too
    after = mpdoctor.diagnose(m, names={id(m): "model"})
    assert not [g for g in after.findings if g.severity in ("error", "warning")]
    fix.undo()
    assert_unchanged(before, fingerprint({"model": m}), "undo of the float8 upcast")
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        m(x)
    fix.apply()  # again, and the step trains: a bf16 head on the float8-stored body
    trains(torch.nn.Sequential(m, torch.nn.Linear(16, 4).to(torch.bfloat16)), x)


def test_an_fp8_embedding_returns_float8_rows_and_the_next_layer_raises():
    """kijai/ComfyUI-WanVideoWrapper#1374: "self and mat2 must have the same dtype, but got BFloat16 and
    Float8_e4m3fn": the float8 tensor reached the math outside the layer that stores it. A stock
    ``nn.Embedding`` holding float8 weights returns float8 rows; the Linear after it raises. The fix sits where the
    float8 comes from: the Embedding returns bf16 rows (upcast in its forward, in place), and the model runs."""
    m = fp8_embedding_model()
    ids = torch.tensor([[1, 2, 3]])
    assert m[0](ids).dtype == torch.float8_e4m3fn  # the storage leaves the layer as it is
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        m(ids)
    f = finding(mpdoctor.diagnose(m, names={id(m): "model"}), "fp8-storage-not-upcast")
    assert f.severity == "error" and f.evidence["emits_float8"] == ["0"] and "one layer later" in f.message
    (fix,) = f.fixes
    assert "torch.nn.functional.embedding(x, model[0].weight.to(torch.bfloat16)" in fix.code
    fix.apply()
    assert m[0](ids).dtype == torch.bfloat16 and m[0].weight.dtype == torch.float8_e4m3fn
    assert torch.equal(m(ids), upcast_reference(m, ids))
    trains(m, ids)
    assert "fp8-storage-not-upcast" not in severities(mpdoctor.diagnose(m))


def layerwise_cast_with_a_bf16_head() -> dict:
    """finetrainers' "fake fp8 training": ``apply_layerwise_casting`` on the body (every parameter of its layers
    stored in float8, biases included, left trainable), a bf16 head, one AdamW over the whole model."""
    body = mlp(32, 64, 16)
    apply_layerwise_casting(body, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    model = torch.nn.Sequential(body, torch.nn.Linear(16, 4).to(torch.bfloat16))
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2)}


class UpcastLinear(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), self.bias)


def fp8_base_with_a_bf16_head() -> dict:
    """kohya's ``--fp8_base``: the base layers store their weights in float8 and cast them up in their own forward;
    a bf16 head; the optimizer built over every parameter, the float8 ones left trainable."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(UpcastLinear(32, 64), torch.nn.ReLU(), UpcastLinear(64, 16), torch.nn.Linear(16, 4))
    model.to(torch.bfloat16)
    for layer in (model[0], model[2]):
        layer.weight.data = layer.weight.data.to(torch.float8_e4m3fn)  # still requires grad
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2)}


def train_step(ns: dict) -> torch.Tensor:
    """The user's step: forward, backward, optimizer step, then zero_grad (a step that raises leaves its grads)."""
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    loss = ns["model"](x).float().pow(2).mean()
    loss.backward()
    ns["optimizer"].step()
    ns["optimizer"].zero_grad()
    return loss


@pytest.mark.parametrize("build", [layerwise_cast_with_a_bf16_head, fp8_base_with_a_bf16_head])
def test_trainable_float8_storage_makes_the_optimizer_step_raise_and_the_fix_freezes_it_in_place(build):
    """huggingface/finetrainers PR #316: training with float8 layerwise casting ("fake fp8 training"); kohya-ss/sd-scripts#1711:
    "cat_cuda" not implemented for 'Float8_e4m3fn' (DDP's broadcast on a GPU; the optimizer step stands in here).
    The float8-stored parameters are left trainable: measured here, AdamW's step raises. The fix freezes them in
    place and drops the float8 grads the failed step left (AdamW steps any parameter holding a grad); the same step
    run again trains the bf16 head, the float8 storage untouched; undo restores everything exactly."""
    from fingerprint import assert_unchanged, fingerprint

    ns = build()
    model = ns["model"]
    with pytest.raises(NotImplementedError, match="not implemented for 'Float8_e4m3fn'"):
        train_step(ns)  # the user's step raises, leaving float8 grads behind
    stored = {n: p.detach().view(torch.uint8).clone() for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert stored and all(p.grad is not None for n, p in model.named_parameters() if n in stored)
    report = mpdoctor.diagnose(namespace=ns)
    f = finding(report, "fp8-storage-trainable")
    assert f.severity == "error"
    (fix,) = f.fixes
    assert not fix.safe and [fx.key for fx in report.fixes] == [fix.key]  # the plan: this fix alone
    before = fingerprint(ns)
    fix.apply()
    assert all(not p.requires_grad and p.grad is None for n, p in model.named_parameters() if n in stored)
    fix.undo()
    assert_unchanged(before, fingerprint(ns), "undo of the float8 freeze")
    fix.apply()
    head = [p for p in model.parameters() if p.requires_grad]
    snapshot = [p.detach().clone() for p in head]
    loss = train_step(ns)  # the same step, run again
    assert torch.isfinite(loss) and all(not torch.equal(a, b) for a, b in zip(snapshot, head))  # the bf16 parts train
    assert all(torch.equal(p.detach().view(torch.uint8), stored[n]) for n, p in model.named_parameters() if n in stored)
    after = mpdoctor.diagnose(namespace=ns)
    assert not [g for g in after.findings if g.severity in ("error", "warning")], after.findings


def test_float8_storage_no_optimizer_holds_is_info():
    """The model alone (inference: no optimizer holds its weights): true, harmless here, so info."""
    m = mlp(32, 64, 16)
    apply_layerwise_casting(m, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    alone = finding(mpdoctor.diagnose(m, names={id(m): "model"}), "fp8-storage-trainable")
    assert alone.severity == "info" and "no optimizer holds them now" in alone.message
    assert "0 (weight, bias), 2 (weight, bias)" in alone.message


# -- saturation and overflow of unscaled casts ---------------------------------------------------------------


def wide_layer(dtype: torch.dtype, peak: float) -> tuple[UpcastLinear, torch.Tensor]:
    torch.manual_seed(0)
    layer = UpcastLinear(64, 32)
    with torch.no_grad():
        layer.weight.mul_(peak / layer.weight.abs().max())
    hp = layer.weight.detach().clone()
    layer.weight = torch.nn.Parameter(hp.to(dtype), requires_grad=False)
    return layer, hp


def test_an_unscaled_e4m3_cast_saturates_at_448():
    """pytorch/pytorch#150756 (and PR #160488): values past 448 cast to float8_e4m3fn become 448. Measured: a weight
    spanning +-2000 loses every element past 448, silently; the layer computes with wrong weights (output error
    below). The advice (a per-tensor scale) keeps the error within e4m3's rounding."""
    layer, hp = wide_layer(torch.float8_e4m3fn, 2000.0)
    stored = layer.weight.float()
    clipped = int((hp.abs() > 464).sum())
    assert clipped > 0 and stored.abs().max() == 448 and int((stored.abs() == 448).sum()) >= clipped  # the harm
    x = torch.randn(8, 64)
    err = (layer(x) - torch.nn.functional.linear(x, hp, layer.bias)).norm() / torch.nn.functional.linear(x, hp, layer.bias).norm()
    assert err > 0.05
    m = torch.nn.Sequential(layer)
    f = finding(mpdoctor.diagnose(m, names={id(m): "model"}), "fp8-storage-saturated")
    assert f.severity == "warning" and f.evidence["layers"][0][3] >= clipped
    # The advice: scale = 448 / amax before the cast, and back after the upcast.
    scale = 448.0 / hp.abs().max()
    layer.weight = torch.nn.Parameter((hp * scale).to(torch.float8_e4m3fn), requires_grad=False)
    layer.register_buffer("scale_weight", scale.reciprocal())
    scaled_err = (torch.nn.functional.linear(x, layer.weight.float() * layer.scale_weight, layer.bias) - torch.nn.functional.linear(x, hp, layer.bias)).norm()
    assert scaled_err / torch.nn.functional.linear(x, hp, layer.bias).norm() < 0.05 < err
    assert "fp8-storage-saturated" not in severities(mpdoctor.diagnose(m))
    trains(m, x)


def test_an_unscaled_e5m2_cast_overflows_to_inf_and_nan_bytes_are_an_error():
    """e5m2 keeps inf: ``.to(torch.float8_e5m2)`` past 57344 gives inf (measured), and the forward gives NaN / inf.
    NVIDIA/Model-Optimizer#1633: NVFP4 exports wrote e4m3 block scales with NaN bytes (0x7F) from unclamped casts;
    stood in for here by NaN bytes in an e4m3-stored weight: read from the bytes, an error."""
    layer, hp = wide_layer(torch.float8_e5m2, 1e5)
    assert torch.isinf(layer.weight.float()).any()  # the overflow
    out = layer(torch.randn(4, 64))
    assert not torch.isfinite(out).all()  # the harm
    m = torch.nn.Sequential(layer)
    f = finding(mpdoctor.diagnose(m, names={id(m): "model"}), "fp8-storage-saturated")
    assert f.severity == "error" and f.evidence["layers"][0][4] > 0
    # NaN bytes in an e4m3 checkpoint, as the exporter wrote them.
    layer, _ = wide_layer(torch.float8_e4m3fn, 100.0)
    layer.weight.data.view(torch.uint8)[0, :4] = 0x7F
    assert torch.isnan(layer.weight.float()).sum() == 4
    f = finding(mpdoctor.diagnose(torch.nn.Sequential(layer)), "fp8-storage-saturated")
    assert f.severity == "error"
    # The advice: re-cast from the high-precision weights with a scale.
    scale = 448.0 / hp.abs().max()
    layer = UpcastLinear(64, 32)
    layer.weight = torch.nn.Parameter((hp * scale).to(torch.float8_e4m3fn), requires_grad=False)
    layer.register_buffer("scale_weight", scale.reciprocal())
    m = torch.nn.Sequential(layer)
    assert "fp8-storage-saturated" not in severities(mpdoctor.diagnose(m))
    trains(m, torch.randn(4, 64))


# -- quantized float8 weights with NaN ------------------------------------------------------------------------


def float8_quantized_with_a_zero_row() -> dict:
    """A bf16 MLP whose first Linear has one pruned (all-zero) row, quantized per row by ``Float8WeightOnlyConfig``;
    a bf16 head trains on top of the quantized body."""
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    body = mlp(32, 64, 16).to(torch.bfloat16)
    with torch.no_grad():
        body[0].weight[3].zero_()
    quantize_(body, Float8WeightOnlyConfig())
    model = torch.nn.Sequential(body, torch.nn.Linear(16, 4).to(torch.bfloat16))
    return {"model": model, "optimizer": torch.optim.AdamW(model[1].parameters(), lr=1e-2)}


def quantized_step(ns: dict, width: int = 32) -> torch.Tensor:
    """The user's step on the quantized body: forward, backward into the bf16 head, optimizer step."""
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    loss = ns["model"](x).float().pow(2).mean()
    loss.backward()
    ns["optimizer"].step()
    ns["optimizer"].zero_grad()
    return loss


def test_an_all_zero_row_quantized_to_float8_is_nan_and_the_fix_writes_its_zeros_back():
    """pytorch/ao#4713 (and PR #4762): "Float8Tensor zero inputs quantize to NaN": the row scale amax / 448 is 0
    and 0 / 0 is NaN. Reproduced with ``quantize_(model, Float8WeightOnlyConfig())`` (per-row) on a Linear with
    one pruned (all-zero) row: every output of that row is NaN, and the loss. A zero scale says the row was all
    zeros, so the fix writes 0 back into its NaN elements, in place: the dequantized weights then equal what a
    quantization without the bug gives (the layer stays quantized), and the same step trains. Undo restores the
    bytes exactly."""
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    ns = float8_quantized_with_a_zero_row()
    model, x = ns["model"], torch.randn(4, 32, dtype=torch.bfloat16)
    # The harm (the step itself would write NaN into the head: the cure registry shows it on a twin).
    assert torch.isnan(model[0][0](x)).any() and torch.isnan(model(x)).all()
    report = mpdoctor.diagnose(namespace=ns)
    f = finding(report, "quantized-weights-nonfinite")
    assert f.severity == "error" and f.evidence["layers"][0][3] == 32  # one row of 32 elements
    probe = mpdoctor.probe(model, x, loss_fn=lambda out: out.float().pow(2).mean())
    assert finding(probe, "probe-nonfinite").severity == "error"
    (fix,) = f.fixes
    assert fix.safe and [fx.key for fx in report.fixes] == [fix.key]
    weight, qdata = model[0][0].weight, model[0][0].weight.qdata
    stored, scale = qdata.view(torch.uint8).clone(), weight.scale.clone()  # (the fingerprint cannot read a subclass)
    fix.apply()
    assert model[0][0].weight is weight and weight.qdata is qdata  # the same quantized tensor, in place
    # What the quantization means for the zero row (0) and the others (their bytes untouched), compared with a
    # twin whose zero row is left out of quantization.
    twin = mlp(32, 64, 16).to(torch.bfloat16)
    with torch.no_grad():
        twin[0].weight[3].zero_()
    quantize_(twin, Float8WeightOnlyConfig(), filter_fn=lambda mod, fqn: fqn == "2")
    assert torch.equal(weight.dequantize()[3], twin[0].weight[3]) and torch.isfinite(weight.dequantize()).all()
    assert torch.isfinite(model(x)).all()
    fix.undo()
    assert model[0][0].weight is weight and weight.qdata is qdata and torch.equal(qdata.view(torch.uint8), stored)
    assert torch.equal(weight.scale, scale) and torch.isnan(model(x)).any()
    fix.apply()
    head = [p.detach().clone() for p in model[1].parameters()]
    loss = quantized_step(ns)  # the same step, run again
    assert torch.isfinite(loss) and all(not torch.equal(a, b) for a, b in zip(head, model[1].parameters()))
    assert "quantized-weights-nonfinite" not in severities(mpdoctor.diagnose(namespace=ns))


def test_nan_in_a_quantized_block_with_a_nonzero_scale_stays_advice():
    """NaN elements whose block scale is not 0 are lost from the quantized bytes: the high-precision weights are in
    a checkpoint mpdoctor does not reach, so the fix is the line that quantizes again (display only)."""
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    m = mlp(32, 64, 16).to(torch.bfloat16)
    quantize_(m, Float8WeightOnlyConfig())
    m[0].weight.qdata.view(torch.uint8)[5, :3] = 0x7F  # NaN bytes in a row with a real scale
    (fix,) = finding(mpdoctor.diagnose(m, names={id(m): "model"}), "quantized-weights-nonfinite").fixes
    assert fix.applicability.name == "DISPLAY_ONLY" and "checkpoint" in fix.code and "quantize_(" in fix.code


# -- is fp8 actually on? -----------------------------------------------------------------------------------


def prepare_fp8(model: torch.nn.Module):
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()], cpu=True)
    prepared = acc.prepare(model)
    opt = acc.prepare(torch.optim.AdamW(prepared.parameters(), lr=1e-2))
    return acc, prepared, opt


def fp8_prepared_run(filter_fn=None) -> dict:
    """huggingface/accelerate PR #4147's setup: ``Accelerator(mixed_precision="fp8")`` with the AO recipe, a
    two-Linear model and its optimizer prepared (the filter skips the first and last Linear: every layer here)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # a fresh run, as re-running the notebook's cells
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(module_filter_func=filter_fn)], cpu=True)
    model = acc.prepare(mlp(32, 64, 16))
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return {"model": model, "optimizer": opt, "accelerator": acc}


def fp8_step(ns: dict) -> torch.Tensor:
    """The user's accelerate step: forward, ``accelerator.backward``, optimizer step, zero_grad."""
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    loss = ns["model"](x).float().pow(2).mean()
    ns["accelerator"].backward(loss)
    ns["optimizer"].step()
    ns["optimizer"].zero_grad()
    return loss


class MatmulOperands(TorchDispatchMode):
    """Records the operand classes and dtypes of every matmul aten runs (an observer: each op runs unchanged).
    torchao's float8 path hands ``mm`` its ``Float8TrainingTensor`` operands; a bf16 run hands it plain tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in ("mm", "addmm", "_scaled_mm"):
            self.seen.append(tuple(f"{type(a).__name__}:{str(a.dtype).removeprefix('torch.')}"
                                   for a in args if isinstance(a, torch.Tensor)))  # fmt: skip
        return func(*args, **(kwargs or {}))


def matmuls_of(step, ns: dict) -> tuple[list[tuple[str, ...]], torch.Tensor]:
    with MatmulOperands() as ops:
        loss = step(ns)
    return ops.seen, loss


def ao_float8_linears(model) -> list:
    from torchao.float8.float8_linear import Float8Linear

    return [m for m in model.modules() if isinstance(m, Float8Linear)]


def fp8_runs_bf16(ns: dict) -> None:
    """The measured harm: fp8 configured, no Float8Linear, every matmul of the step on plain bf16 tensors."""
    assert ns["accelerator"].mixed_precision == "fp8" and not ao_float8_linears(ns["model"])
    seen, _ = matmuls_of(fp8_step, ns)
    assert seen and all(all(op.startswith("Tensor:bfloat16") for op in ops) for ops in seen), seen


def fp8_runs_float8(ns: dict) -> None:
    """fp8 is on: both layers are Float8Linear and every matmul of the step (forward and both backward ones)
    takes torchao's float8 training tensors."""
    assert [type(m).__name__ for m in ns["model"].modules() if isinstance(m, torch.nn.Linear)] == ["Float8Linear"] * 2
    seen, loss = matmuls_of(fp8_step, ns)
    assert torch.isfinite(loss) and len(seen) == 6, seen
    assert all(any(op.startswith("Float8TrainingTensor") for op in ops) for ops in seen), seen


def test_accelerate_fp8_on_a_model_its_filter_converts_nothing_is_turned_on_in_place():
    """huggingface/accelerate PR #4147: accelerate's AO path skips the first and last Linear "for stability".
    On a two-Linear model that is every layer: ``Accelerator(mixed_precision="fp8")`` says fp8 and the run is
    bf16 autocast (measured: no Float8Linear after prepare, every matmul on bf16 tensors). The fix converts the
    prepared model's aligned Linear layers to torchao's Float8Linear with the accelerator's own recipe config, over
    the same Parameters the (wrapped) optimizer holds; the same step then trains through float8 matmuls."""
    ns = fp8_prepared_run()
    fp8_runs_bf16(ns)
    model, opt, acc = ns["model"], ns["optimizer"], ns["accelerator"]
    report = mpdoctor.diagnose(namespace=ns)
    f = finding(report, "fp8-requested-not-on")
    assert f.severity == "warning" and "no float8 layer" in f.message and "accelerate's filter" in f.message
    fix = next(fx for fx in report.fixes if fx.slug == "fp8-requested-not-on")
    assert fix.applicability.name == "UNSAFE" and fix.recipe == "float8-convert-live" and not fix.in_place
    older = next(fx for fx in mpdoctor.diagnose(namespace=ns).fixes if fx.slug == "fp8-requested-not-on")
    layers, params = [model[0], model[2]], list(model.parameters())
    held = [p for g in opt.optimizer.param_groups for p in g["params"]]
    fix.apply(confirm=True)
    assert fix.applied and older.in_place and not fix.in_place  # an older report's card sees it done
    assert [p for p in model.parameters()] == params and all(a is b for a, b in zip(model.parameters(), params))
    assert all(a is b for a, b in zip([p for g in opt.optimizer.param_groups for p in g["params"]], held))
    assert model[0].weight is layers[0].weight and model[2].bias is layers[1].bias
    assert not model[0].config.enable_fsdp_float8_all_gather and model[0].config.pad_inner_dim  # the recipe's own
    before = [p.detach().clone() for p in params]
    fp8_runs_float8(ns)  # the user's step, run again: float8 matmuls
    assert all(not torch.equal(a, b.detach()) for a, b in zip(before, params)), "every weight and bias trains"
    assert "fp8-requested-not-on" not in severities(mpdoctor.diagnose(namespace=ns))
    fix.undo()
    assert model[0] is layers[0] and model[2] is layers[1] and type(model[0]) is torch.nn.Linear
    assert all(a is b for a, b in zip(model.parameters(), params))
    fp8_runs_bf16(ns)
    assert acc.mixed_precision == "fp8"


def test_layers_a_users_own_filter_left_out_are_not_converted():
    """A ``module_filter_func`` of the user's is a choice: the layers it refused stay out of float8, and the
    finding says whose filter it was; the fix is advice only."""
    ns = fp8_prepared_run(lambda mod, fqn: False)
    assert not ao_float8_linears(ns["model"])
    report = mpdoctor.diagnose(namespace=ns)
    f = finding(report, "fp8-requested-not-on")
    assert "module_filter_func (yours)" in f.message
    assert all(fx.applicability.name == "DISPLAY_ONLY" for fx in f.fixes)


def test_accelerate_fp8_converts_no_layer_whose_dims_are_not_multiples_of_16():
    """huggingface/accelerate PR #1188: "Only convert linear layers with weights multiple of 16". A model whose
    hidden size is 40 keeps every inner Linear in high precision under fp8 (measured), silently."""
    acc, model, opt = prepare_fp8(mlp(32, 40, 40, 40, 16))
    assert not [x for x in model.modules() if type(x).__name__ == "Float8Linear"]
    report = mpdoctor.diagnose(model, opt, acc, names={id(model): "model", id(opt): "optimizer", id(acc): "accelerator"})
    f = finding(report, "fp8-requested-not-on")
    assert f.severity == "warning"
    # Nothing can be converted (fp8 GEMMs need dims multiple of 16): the fix stays advice.
    assert all(fx.applicability.name == "DISPLAY_ONLY" for fx in f.fixes)


def test_accelerate_fp8_ao_swaps_weights_after_the_optimizer_was_built():
    """Measured on accelerate 1.15 + torchao 0.18 (no public report found): ``acc.prepare(model, optimizer)``
    with the AO backend swaps Linear for Float8Linear *after* the optimizer was built; the new layers get new
    weight parameters the optimizer does not hold, so those weights never train (their grads are computed and
    dropped). mpdoctor's ``optimizer-params-not-in-model`` is right here, not a false alarm; re-creating the
    optimizer from the prepared model (or preparing the model first) makes every weight train."""
    m = mlp(32, 64, 64, 64, 16)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()], cpu=True)
    model, popt = acc.prepare(m, opt)
    held = {id(p) for g in popt.optimizer.param_groups for p in g["params"]}
    orphans = [n for n, p in model.named_parameters() if id(p) not in held]
    assert orphans == ["2.weight", "4.weight"]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    acc.backward(model(torch.randn(16, 32)).float().pow(2).mean())
    popt.step()
    assert [n for n, p in model.named_parameters() if torch.equal(before[n], p)] == orphans  # the harm
    report = mpdoctor.diagnose(model, popt, acc, names={id(model): "model", id(popt): "optimizer", id(acc): "accelerator"})
    assert severities(report)["optimizer-params-not-in-model"] == "error"
    # The advice: build the optimizer from the live (converted) model.
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    acc.backward(model(torch.randn(16, 32)).float().pow(2).mean())
    opt.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    report = mpdoctor.diagnose(model, opt, acc, names={id(model): "model", id(opt): "optimizer", id(acc): "accelerator"})
    assert "optimizer-params-not-in-model" not in severities(report)


# -- fp8 on GPUs without float8 GEMMs ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "half"),
    [
        ("RTX3090", "bf16"),  # NVIDIA/TransformerEngine#1159: "Device compute capability 8.9 or higher required for FP8 execution."
        ("A100", "bf16"),  # kvcache-ai/ktransformers#934: "fp8e4nv data type is not supported on CUDA arch < 89"
        ("T4", "fp16"),  # no bf16 either: fp16, whose GradScaler the Trainer's Accelerator builds
    ],
)
def test_fp8_requested_through_the_launcher_on_a_gpu_without_fp8_gemms(tmp_path, monkeypatch, target, half):
    """GPU-only: the refusal happens at the first fp8 step on that GPU (this CPU runs fp8 casts in software), so
    the request is judged against the target's profile. Before the Trainer exists the request lives in the
    arguments and the launcher's variable: the fix asks for the GPU's half precision there, in place; the Trainer
    built from the fixed arguments gets an Accelerator in that precision and trains (on this CPU accelerate runs
    bf16 under autocast and fp16 without it); undo restores the variable and the arguments exactly."""
    from transformers import Trainer, TrainingArguments

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    args = TrainingArguments(str(tmp_path), bf16=False, use_cpu=True, report_to=[], max_steps=2, save_strategy="no",
                             per_device_train_batch_size=16, learning_rate=1e-2)  # fmt: skip
    assert args.mixed_precision == "fp8"
    report = mpdoctor.diagnose(args, names={id(args): "args"}, target=target)
    f = finding(report, "fp8-requested-unsupported-device")
    assert f.severity == "error" and "8.9" in f.message and f"Train in {half} there" in f.message
    for ok in ("L4", "H100"):
        assert "fp8-requested-unsupported-device" not in severities(mpdoctor.diagnose(args, target=ok))
    in_place, advice = f.fixes
    assert in_place.applicability.name == "UNSAFE" and in_place in report.fixes
    assert f"os.environ['ACCELERATE_MIXED_PRECISION'] = {half!r}" in in_place.code
    assert f"args.mixed_precision = {half!r}" in in_place.code
    assert advice.applicability.name == "DISPLAY_ONLY" and "mpdoctor does not switch it" in advice.code
    before = {k: getattr(args, k) for k in ("bf16", "fp16", "mixed_precision")}
    in_place.apply()
    assert os.environ["ACCELERATE_MIXED_PRECISION"] == half and args.mixed_precision == half
    assert (args.bf16, args.fp16) == (half == "bf16", half == "fp16")
    assert "fp8-requested-unsupported-device" not in severities(mpdoctor.diagnose(args, names={id(args): "args"}, target=target))
    model = Net()
    held = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model=model, args=args, train_dataset=[{"x": torch.randn(32)} for _ in range(16)])
    assert trainer.accelerator.mixed_precision == half
    loss = trainer.train().training_loss
    assert math.isfinite(loss) and all(not torch.equal(held[n], p.detach()) for n, p in model.named_parameters())
    in_place.undo()
    assert os.environ["ACCELERATE_MIXED_PRECISION"] == "fp8"
    assert {k: getattr(args, k) for k in before} == before
    assert "fp8-requested-unsupported-device" in severities(mpdoctor.diagnose(args, target=target))


def test_an_accelerator_built_for_fp8_on_a_gpu_without_fp8_gemms_gets_the_line_to_change():
    """An Accelerator made with ``mixed_precision="fp8"`` chose its fp8 backend and recipe handler when it was built
    (and converts or wraps the layers it prepares): mpdoctor does not switch it, so the fix is the line to change,
    and it says what it cannot reach."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(mixed_precision="fp8", cpu=True)
    try:
        assert acc.fp8_enabled and acc.has_fp8_handler
        f = finding(mpdoctor.diagnose(acc, names={id(acc): "accelerator"}, target="A100"), "fp8-requested-unsupported-device")
        (advice,) = f.fixes
        assert advice.applicability.name == "DISPLAY_ONLY" and "Accelerator(mixed_precision='bf16')" in advice.code
        assert "a GPU mpdoctor cannot change" in advice.code
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


# -- block formats on devices without block-scaled GEMMs ------------------------------------------------------


def block_quantized_with_a_bf16_head() -> dict:
    """torchao's ``MXDynamicActivationMXWeightConfig`` on a frozen bf16 body (MXFP8 weights that quantize their
    activations too), a bf16 head trained on top."""
    from torchao.prototype.mx_formats import MXDynamicActivationMXWeightConfig
    from torchao.quantization import quantize_

    body = mlp(64, 64, 32).to(torch.bfloat16)
    quantize_(body, MXDynamicActivationMXWeightConfig())
    body.requires_grad_(False)
    model = torch.nn.Sequential(body, torch.nn.Linear(32, 4).to(torch.bfloat16))
    return {"model": model, "optimizer": torch.optim.AdamW(model[1].parameters(), lr=1e-2)}


def block_step(ns: dict) -> torch.Tensor:
    """The user's step on the block-quantized body (64 wide): forward, backward into the bf16 head, optimizer step."""
    return quantized_step(ns, width=64)


def nvfp4_dynamic(layer: torch.nn.Linear) -> None:
    """``layer``'s weight as NVFP4 that quantizes its activations, built with ``NVFP4Tensor.to_nvfp4``, the call
    ``NVFP4DynamicActivationNVFP4WeightConfig``'s handler makes (``quantize_`` refuses that config below sm_100)."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, QuantizeTensorToNVFP4Kwargs

    w = NVFP4Tensor.to_nvfp4(layer.weight.detach(), is_swizzled_scales=True, act_quant_kwargs=QuantizeTensorToNVFP4Kwargs())
    layer.weight = torch.nn.Parameter(w, requires_grad=False)


def stored_bytes(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every inner tensor of the model's torchao weights (data and scales), cloned: what the fix must not touch."""
    out = []
    for mod in model.modules():
        w = mod.__dict__.get("_parameters", {}).get("weight")
        if w is not None and hasattr(type(w), "__tensor_flatten__"):
            names, _ = type(w).__tensor_flatten__(w)
            out += [getattr(w, n).detach().clone() for n in names if getattr(w, n) is not None]
    return out


def test_mxfp8_activations_and_weights_on_a_device_without_mx_gemms():
    """NVIDIA/TransformerEngine#2304: "MXFP8 (for all gemm layouts) is not supported on 12.0+ architectures yet".
    torchao's ``MXDynamicActivationMXWeightConfig`` quantizes the activations too, so the matmul is a
    block-scaled GEMM only sm_100 runs: measured here, the user's step raises at the forward; an H100 is judged
    by its profile. The fix, in place: each MX weight's matmul switches to torchao's emulated kernel (torchao 0.18
    refuses an MX weight without activation quantization, "weight-only quant not yet supported", so dropping
    ``act_quant_kwargs`` is no fix for MX), the stored data and scales kept bit for bit; the same step then trains
    the bf16 head. Undo makes it raise again."""
    ns = block_quantized_with_a_bf16_head()
    model = ns["model"]
    with pytest.raises(ValueError, match="Invalid scaling configuration"):
        block_step(ns)
    for target in (None, "H100"):
        f = finding(mpdoctor.diagnose(model, names={id(model): "model"}, target=target), "block-format-unsupported-device")
        assert f.severity == "error" and "MXTensor" in f.message
    assert "block-format-unsupported-device" not in severities(mpdoctor.diagnose(model, target="B200"))
    report = mpdoctor.diagnose(namespace=ns, step=lambda: block_step(ns))
    f = finding(report, "block-format-unsupported-device")
    in_place, advice = f.fixes
    assert in_place.applicability.name == "UNSAFE" and "KernelPreference.EMULATED" in in_place.code
    assert advice.applicability.name == "DISPLAY_ONLY" and "NVFP4WeightOnlyConfig" in advice.code
    assert "mpdoctor holds only the quantized weights" in advice.code
    assert [fx.key for fx in report.fixes] == [in_place.key]  # the plan
    assert report.proof.verified and report.proof.cured, report.proof.summary()  # on the user's own step
    weights = [layer.weight for layer in (model[0][0], model[0][2])]
    recipes = [(w.act_quant_kwargs, w.kernel_preference) for w in weights]
    stored = stored_bytes(model)
    in_place.apply()
    assert in_place.applied
    assert all(torch.equal(a, b) for a, b in zip(stored, stored_bytes(model), strict=True))  # bit for bit
    assert "block-format-unsupported-device" not in severities(mpdoctor.diagnose(model, target="H100"))
    params = list(model[1].parameters())
    held = [p.detach().clone() for p in params]
    loss = block_step(ns)  # the very step that raised
    assert torch.isfinite(loss) and all(not torch.equal(a, b) for a, b in zip(held, params))
    in_place.undo()
    assert [(w.act_quant_kwargs, w.kernel_preference) for w in weights] == recipes  # the very recipe objects back
    assert all(a[0] is b[0] for a, b in zip(recipes, [(w.act_quant_kwargs,) for w in weights]))
    with pytest.raises(ValueError, match="Invalid scaling configuration"):
        block_step(ns)


def test_nvfp4_activations_and_weights_become_weight_only_in_place():
    """NVFP4 weights that quantize their activations call the same block-scaled GEMM (measured: the CPU forward
    raises). NVFP4 has no emulated kernel in torchao 0.18: the fix drops each weight's activation recipe, so the
    matmul dequantizes the weight, exactly what ``NVFP4WeightOnlyConfig`` builds from the same stored data (equal
    outputs, measured); undo gives the recipe back."""
    from torchao.prototype.mx_formats import NVFP4WeightOnlyConfig
    from torchao.quantization import quantize_

    m = mlp(64, 64, 32).to(torch.bfloat16)
    weight_only = mlp(64, 64, 32).to(torch.bfloat16)  # the same weights (same seed)
    quantize_(weight_only, NVFP4WeightOnlyConfig(use_dynamic_per_tensor_scale=False))
    for layer in (m[0], m[2]):
        nvfp4_dynamic(layer)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Invalid scaling configuration"):
        m(x)
    f = finding(mpdoctor.diagnose(m, names={id(m): "model"}), "block-format-unsupported-device")
    assert "NVFP4Tensor" in f.message and "act_quant_kwargs = None" in f.fixes[0].code
    kwargs = m[0].weight.act_quant_kwargs
    f.fixes[0].apply()
    assert m[0].weight.act_quant_kwargs is None and torch.equal(m(x), weight_only(x))
    assert "block-format-unsupported-device" not in severities(mpdoctor.diagnose(m))
    f.fixes[0].undo()
    assert m[0].weight.act_quant_kwargs is kwargs
    with pytest.raises(ValueError, match="Invalid scaling configuration"):
        m(x)


def test_mx_recipes_that_run_anywhere_draw_nothing():
    """Weight-only NVFP4 and torchao's emulated MX kernel dequantize: they run on this CPU and draw no error."""
    from torchao.prototype.mx_formats import MXDynamicActivationMXWeightConfig, NVFP4WeightOnlyConfig
    from torchao.quantization import quantize_
    from torchao.quantization.quantize_.common import KernelPreference

    x = torch.randn(4, 64, dtype=torch.bfloat16)
    for config in (NVFP4WeightOnlyConfig(), MXDynamicActivationMXWeightConfig(kernel_preference=KernelPreference.EMULATED)):
        body = mlp(64, 64, 32).to(torch.bfloat16)
        quantize_(body, config)
        assert torch.isfinite(body(x)).all()
        for target in (None, "H100"):
            assert "block-format-unsupported-device" not in severities(mpdoctor.diagnose(body, target=target))
        body.requires_grad_(False)
        trains(torch.nn.Sequential(body, torch.nn.Linear(32, 4).to(torch.bfloat16)), x)


# -- fp8 asked for by the launcher, another flag wins ---------------------------------------------------------

#: What ``accelerate launch --mixed_precision fp8`` puts in the environment (accelerate 1.15, measured by the
#: launch test below, which prints them from the launched script). In-process tests set these as the stand-in
#: for the launcher.
LAUNCHER_FP8_ENV = {
    "ACCELERATE_MIXED_PRECISION": "fp8",
    "ACCELERATE_FP8_AMAX_COMPUTE_ALGO": "most_recent",
    "ACCELERATE_FP8_AMAX_HISTORY_LEN": "1024",
    "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER": "1",
    "ACCELERATE_FP8_FORMAT": "HYBRID",
    "ACCELERATE_FP8_INTERVAL": "1",
    "ACCELERATE_FP8_MARGIN": "0",
    "ACCELERATE_FP8_OPT_LEVEL": "O2",
    "ACCELERATE_FP8_OVERRIDE_DGRAD": "False",
    "ACCELERATE_FP8_OVERRIDE_FPROP": "False",
    "ACCELERATE_FP8_OVERRIDE_WGRAD": "False",
    "ACCELERATE_FP8_PAD_INNER_DIM": "1",
    "ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL": "False",
}

LAUNCHED_SCRIPT = '''
import json, os, torch
from transformers import Trainer, TrainingArguments
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in ((32, 64), (64, 64), (64, 64), (64, 16))])
    def forward(self, x, labels=None):
        return {"loss": self.body(x).float().pow(2).mean()}
args = TrainingArguments(os.environ["OUT"], bf16=True, use_cpu=True, report_to=[], max_steps=1, save_strategy="no",
                         per_device_train_batch_size=16)
trainer = Trainer(model=M(), args=args, train_dataset=[{"x": torch.randn(32)} for _ in range(16)])
trainer.train()
print(json.dumps({"env": {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_FP8_") or k == "ACCELERATE_MIXED_PRECISION"},
                  "args.mixed_precision": args.mixed_precision, "accelerator": trainer.accelerator.mixed_precision,
                  "fp8_backend": str(trainer.accelerator.fp8_backend),
                  "float8_layers": sum(type(m).__name__ == "Float8Linear" for m in trainer.model.modules())}))
'''


class Net(torch.nn.Module):
    """Four Linear layers with dims divisible by 16: accelerate's AO filter converts the two inner ones."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in ((32, 64), (64, 64), (64, 64), (64, 16))])

    def forward(self, x, labels=None):
        return {"loss": self.body(x).float().pow(2).mean()}


def float8_layers(model) -> int:
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


def test_accelerate_launch_fp8_with_bf16_true_trains_in_bf16_measured_with_the_real_launcher(tmp_path):
    """huggingface/trl#3860 ("bf16 Option in Training Config Prevents FP8 Training"). Measured with the real
    ``accelerate launch --cpu --mixed_precision fp8`` (accelerate 1.15, transformers 5.23): the launcher sets
    ACCELERATE_MIXED_PRECISION=fp8 and the ACCELERATE_FP8_* recipe variables; ``TrainingArguments(bf16=True)``
    leaves the variable alone but sets ``args.mixed_precision="bf16"``, the Trainer passes it to its Accelerator
    explicitly, and the run trains in bf16 with no float8 layer, silently."""
    import json
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(LAUNCHED_SCRIPT)
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env["OUT"] = str(tmp_path / "out")
    done = subprocess.run(
        [accelerate, "launch", "--cpu", "--num_processes", "1", "--num_machines", "1", "--dynamo_backend", "no",
         "--mixed_precision", "fp8", str(script)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["env"] == LAUNCHER_FP8_ENV  # the stand-in below is exactly what the launcher sets
    assert seen["args.mixed_precision"] == "bf16" and seen["accelerator"] == "bf16"
    assert seen["fp8_backend"] == "FP8BackendType.NO" and seen["float8_layers"] == 0  # the harm: no layer in fp8


def test_bf16_true_under_the_launchers_fp8_is_named_and_the_fix_lets_fp8_through(tmp_path, monkeypatch):
    """The same setup in process (the launcher's variables set as it sets them): mpdoctor names the flag that
    won. The planned fix lets fp8 through while only the arguments exist: ``bf16=False``, ``mixed_precision="fp8"``
    and FSDP float8 all-gather off. That last part matters, measured with transformers 5.23 + accelerate 1.15:
    with the launcher's ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER=1 (also accelerate's default), prepare() wraps
    the converted layers' weights in new Parameters after the Trainer built its optimizer, and they never train
    (mpdoctor's ``optimizer-params-not-in-model``). The cure on the user's ``trainer.train()`` is
    ``bf16-arguments-override-the-launchers-fp8`` in tests/stack/test_cures_stack.py."""
    from transformers import Trainer, TrainingArguments

    for k, v in LAUNCHER_FP8_ENV.items():
        monkeypatch.setenv(k, v)
    args = TrainingArguments(str(tmp_path), bf16=True, use_cpu=True, report_to=[], max_steps=2, save_strategy="no",
                             per_device_train_batch_size=16, learning_rate=1e-2)  # fmt: skip
    assert os.environ["ACCELERATE_MIXED_PRECISION"] == "fp8" and args.mixed_precision == "bf16"
    report = mpdoctor.diagnose(args, names={id(args): "args"})
    f = finding(report, "fp8-request-overridden")
    assert f.severity == "warning"
    assert "ACCELERATE_MIXED_PRECISION=fp8" in f.message and "ACCELERATE_FP8_FORMAT=HYBRID" in f.message
    assert "args.bf16=True" in f.message and "trains in bf16" in f.message and "no layer runs in fp8" in f.message
    assert "precision-override" not in severities(report)
    through, keep = f.fixes
    assert through.applicability.name == "UNSAFE" and "args.bf16 = False" in through.code
    assert "args.mixed_precision = 'fp8'" in through.code
    assert "os.environ['ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER'] = '0'" in through.code
    assert [fx.recipe for fx in report.fixes if fx.slug == "fp8-request-overridden"] == ["launcher-fp8"]
    # The other fix: keep bf16, nothing says fp8 any more; undo brings the launcher's variable back.
    keep.apply()
    assert "ACCELERATE_MIXED_PRECISION" not in os.environ and args.mixed_precision == "bf16"
    assert "fp8-request-overridden" not in severities(mpdoctor.diagnose(args, names={id(args): "args"}))
    keep.undo()
    assert os.environ["ACCELERATE_MIXED_PRECISION"] == "fp8"
    # fp8 let through by hand without turning all-gather off: two layers become Float8Linear...
    args.bf16, args.mixed_precision = False, "fp8"
    assert "fp8-request-overridden" not in severities(mpdoctor.diagnose(args, names={id(args): "args"}))
    model = Net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model=model, args=args, train_dataset=[{"x": torch.randn(32)} for _ in range(16)])
    assert trainer.accelerator.mixed_precision == "fp8"
    trainer.train()
    assert float8_layers(trainer.model) == 2
    # ...whose weights the Trainer's optimizer never held: they did not move (measured), and mpdoctor says so.
    frozen = [n for n, p in trainer.model.named_parameters() if torch.equal(before[n], p.detach())]
    assert frozen == ["body.1.weight", "body.2.weight"]
    report = mpdoctor.diagnose(trainer, names={id(trainer): "trainer"})
    assert severities(report)["optimizer-params-not-in-model"] == "error"


def test_a_trainer_already_built_under_the_launchers_fp8_gets_the_line_to_change(tmp_path, monkeypatch):
    """Once the Trainer exists its Accelerator is bf16 and its layers are chosen at prepare(): converting them in
    place is not honest, so the advice is the line to change; the other fix keeps bf16 and drops the launcher's
    variable, so nothing says fp8 any more (applied here, undone)."""
    from transformers import Trainer, TrainingArguments

    for k, v in LAUNCHER_FP8_ENV.items():
        monkeypatch.setenv(k, v)
    args = TrainingArguments(str(tmp_path), bf16=True, use_cpu=True, report_to=[], max_steps=1, save_strategy="no")
    trainer = Trainer(model=Net(), args=args, train_dataset=[{"x": torch.randn(32)} for _ in range(16)])
    assert trainer.accelerator.mixed_precision == "bf16"
    f = finding(mpdoctor.diagnose(trainer, names={id(trainer): "trainer"}), "fp8-request-overridden")
    assert "the Trainer passes it to its Accelerator" in f.message and "trains in bf16" in f.message
    advice, keep = f.fixes
    assert advice.applicability.name == "DISPLAY_ONLY" and "bf16=False" in advice.code
    keep.apply()
    assert "ACCELERATE_MIXED_PRECISION" not in os.environ
    assert "fp8-request-overridden" not in severities(mpdoctor.diagnose(trainer, names={id(trainer): "trainer"}))
    trainer.train()
    keep.undo()
    assert os.environ["ACCELERATE_MIXED_PRECISION"] == "fp8"


def test_an_explicit_accelerator_argument_beats_the_launchers_fp8(monkeypatch):
    """accelerate 1.15: ``Accelerator(mixed_precision="bf16")`` under the launcher's fp8 runs bf16 (an explicit
    argument wins over ACCELERATE_MIXED_PRECISION), measured: no fp8 backend. Without the argument, fp8."""
    from accelerate.state import AcceleratorState

    for k, v in LAUNCHER_FP8_ENV.items():
        monkeypatch.setenv(k, v)
    acc = Accelerator(mixed_precision="bf16", cpu=True)
    assert acc.mixed_precision == "bf16" and not acc.fp8_enabled
    f = finding(mpdoctor.diagnose(acc, names={id(acc): "accelerator"}), "fp8-request-overridden")
    assert "Accelerator(mixed_precision='bf16')" in f.message
    assert "accelerator = Accelerator()" in f.fixes[0].code
    # The advice, taken: no argument, the launcher's fp8 applies and the AO backend converts the inner layers.
    AcceleratorState._reset_state(reset_partial_state=True)
    acc, model, opt = Accelerator(cpu=True), None, None
    assert acc.mixed_precision == "fp8"
    model = acc.prepare(mlp(32, 64, 64, 64, 16))
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert float8_layers(model) == 2
    acc.backward(model(torch.randn(16, 32)).float().pow(2).mean())
    opt.step()
    report = mpdoctor.diagnose(model, opt, acc, names={id(model): "model", id(opt): "optimizer", id(acc): "accelerator"})
    assert "fp8-request-overridden" not in severities(report)


def test_trl_sft_config_defaults_bf16_and_overrides_the_launchers_fp8(tmp_path, monkeypatch):
    """huggingface/trl#3860: "fp8 training doesn't work because the internal logic causes self.bf16 to become
    True". TRL 1.16's ``SFTConfig`` still defaults ``bf16=True`` (measured), so under the launcher's fp8 the
    config says bf16 and wins; ``bf16=False`` leaves the launcher's choice alone."""
    from trl import SFTConfig

    for k, v in LAUNCHER_FP8_ENV.items():
        monkeypatch.setenv(k, v)
    config = SFTConfig(str(tmp_path), use_cpu=True, report_to=[])
    assert config.bf16 is True and config.mixed_precision == "bf16"
    f = finding(mpdoctor.diagnose(config, names={id(config): "config"}), "fp8-request-overridden")
    assert "config.bf16=True" in f.message
    config = SFTConfig(str(tmp_path), use_cpu=True, report_to=[], bf16=False)
    assert config.mixed_precision == "fp8"
    assert "fp8-request-overridden" not in severities(mpdoctor.diagnose(config, names={id(config): "config"}))


# -- MXFP8 recipes: e5m2 gradients ----------------------------------------------------------------------------


@pytest.fixture()
def te_distribution(tmp_path, monkeypatch):
    """Stand-in for an installed TransformerEngine, which cannot be installed on this CPU: a distribution named
    ``transformer-engine`` whose package refuses to import. accelerate's ``is_transformer_engine_available()``
    asks only whether the package and its metadata exist, so its recipe handlers build for real; nothing in
    these tests imports TE (its recipe is built at ``prepare()``, which is not called)."""
    root = tmp_path / "te_site"
    (root / "transformer_engine").mkdir(parents=True)
    (root / "transformer_engine" / "__init__.py").write_text("raise ImportError('stand-in: TransformerEngine is not installed here')\n")
    (root / "transformer_engine-2.20.2.dist-info").mkdir()
    (root / "transformer_engine-2.20.2.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: transformer-engine\nVersion: 2.20.2\n")
    monkeypatch.syspath_prepend(str(root))
    return root


def test_te_recipe_handlers_need_transformer_engine_here():
    """Measured: accelerate 1.15 refuses to build a TE recipe handler without TransformerEngine."""
    from accelerate.utils import TERecipeKwargs

    with pytest.raises(ImportError, match="TransformerEngine is not available"):
        TERecipeKwargs(use_mxfp8_block_scaling=True)


def test_an_mxfp8_handler_saying_hybrid_runs_e4m3_because_accelerate_drops_the_default(te_distribution):
    """NVIDIA-NeMo/Megatron-Bridge PR #638: "MXFP8 recipe must only use E4M3 data format for both fprop and
    bprop. Using E5M2 for gradients causes the training curve to diverge". Through accelerate 1.15 that trap is
    not reachable: ``TERecipeKwargs(use_mxfp8_block_scaling=True)`` holds ``fp8_format="HYBRID"`` (its default,
    or ACCELERATE_FP8_FORMAT from the launcher), but ``to_kwargs()`` (what ``apply_fp8_autowrap`` builds TE's
    recipe from) drops fields equal to the default, measured below; TE's ``MXFP8BlockScaling()`` then keeps its
    own default, E4M3 for every tensor (TE 2.20 ``common/recipe``). mpdoctor says so as info, not a warning."""
    from accelerate.utils import TERecipeKwargs

    os.environ["ACCELERATE_FP8_FORMAT"] = "HYBRID"  # as the launcher sets it
    handler = TERecipeKwargs(use_mxfp8_block_scaling=True)
    assert handler.fp8_format == "HYBRID"
    assert handler.to_kwargs() == {"use_mxfp8_block_scaling": True}  # HYBRID is not passed to TE
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[handler], cpu=True)
    assert acc.te_recipe_handler is handler and acc.fp8_backend == "TE"
    report = mpdoctor.diagnose(acc, names={id(acc): "accelerator"})
    (recipe,) = report.facts.fp8_recipes
    assert (recipe.owner, recipe.block_scaling, recipe.written_format, recipe.passed_format, recipe.runs_format) == (
        "accelerator.te_recipe_handler", True, "HYBRID", None, "E4M3"
    )
    f = finding(report, "mxfp8-e5m2-gradients")
    assert f.severity == "info" and "keeps its own default, E4M3" in f.message
    assert not [x for x in report.findings if x.check == "mxfp8-e5m2-gradients" and x.severity != "info"]


def test_mxfp8_with_e5m2_gradients_is_a_warning_with_the_measured_loss(te_distribution):
    """A recipe that does run MXFP8 in HYBRID (TE's ``MXFP8BlockScaling(fp8_format=Format.HYBRID)``, as NeMo's
    ``fp8="hybrid"`` MXFP8 recipe built before PR #638) cannot be built on this CPU: TE is not importable, and
    accelerate's handlers never send HYBRID to MXFP8. The recipe facts are built by hand from a real handler's,
    with TE receiving HYBRID; the measured harm (5.3 dB) is in test_compare_oracles."""
    import dataclasses

    from accelerate.utils import TERecipeKwargs

    from mpdoctor.rules.checks import run_checks

    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs(use_mxfp8_block_scaling=True)], cpu=True)
    facts = mpdoctor.diagnose(acc, names={id(acc): "accelerator"}).facts
    (real,) = facts.fp8_recipes
    hybrid = dataclasses.replace(real, passed_format="HYBRID", runs_format="HYBRID")
    (f,) = [x for x in run_checks(dataclasses.replace(facts, fp8_recipes=(hybrid,))) if x.check == "mxfp8-e5m2-gradients"]
    assert f.severity == "warning" and "25.4 dB SQNR against 30.6 dB" in f.message and "5.3 dB" in f.message
    assert "fp8_format='E4M3'" in f.fixes[0].code and f.fixes[0].applicability.name == "DISPLAY_ONLY"
    # DelayedScaling (no block scales) in HYBRID is TE's default recipe: nothing to say.
    delayed = dataclasses.replace(real, block_scaling=False, runs_format="HYBRID")
    assert not [x for x in run_checks(dataclasses.replace(facts, fp8_recipes=(delayed,))) if x.check == "mxfp8-e5m2-gradients"]
