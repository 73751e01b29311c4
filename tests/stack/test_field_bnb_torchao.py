"""Field cases from bitsandbytes' and torchao's trackers, reproduced on this CPU.

bitsandbytes ships a CPU backend: real nf4 loading of a locally saved tiny model works here. torchao's float8
layers train on this CPU too (torch has a CPU ``_scaled_mm``), but the GPU rules (compute capability 8.9+,
dims divisible by 16) are not enforced here: those are judged against a ``target=`` profile, and the tests
say so.
"""

from __future__ import annotations

import logging
import warnings

import bitsandbytes as bnb  # a plain import: tests/stack runs where the stack is pinned, a missing one must fail
import pytest
import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from steps import assert_step_trains, run_step, snapshot
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

import mpdoctor


def severities(report) -> dict[str, str]:
    return {f.check: f.severity for f in report.findings}


def load_4bit(tmp_path, compute_dtype: torch.dtype, dtype: torch.dtype):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=32)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype)
    return LlamaForCausalLM.from_pretrained(tmp_path, quantization_config=q, device_map="cpu", dtype=dtype)


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def lora_step(model, ids, opt=None) -> None:
    """One LoRA step that must train: finite loss, adapters moved (``steps.run_step``)."""
    opt = opt or torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss

    run_step(step, model.parameters())


def test_qlora_fp32_compute_dtype_on_half_model_is_found_and_fixed_in_place(tmp_path):
    """https://github.com/h2oai/h2ogpt/pull/682: "Input type into Linear4bit is torch.float16, but
    bnb_4bit_compute_type=torch.float32 (default). This will lead to slow inference or training speed."
    (5 -> 16 tokens/s once fixed). The default ``BitsAndBytesConfig`` computes in fp32 under a bf16 model:
    measured here as the dtype each 4-bit layer casts to. The slowdown itself is GPU-only."""
    model = load_4bit(tmp_path, torch.float32, torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and {m.compute_dtype for m in layers} == {torch.float32}  # the harm: fp32 matmuls
    report = mpdoctor.diagnose(model, names={id(model): "model"})
    assert severities(report)["bnb-compute-dtype-fp32"] == "warning"
    facts = report.facts.models[0].low_bit_layers
    assert {(x.bits, x.compute_dtype, x.quant_type, x.quantized) for x in facts} == {(4, "float32", "nf4", True)}
    next(f for f in report.fixes if f.slug == "bnb-compute-dtype-fp32").apply()
    assert {m.compute_dtype for m in layers} == {torch.bfloat16}
    assert model.config.quantization_config.bnb_4bit_compute_dtype == torch.bfloat16
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    lora_step(model, torch.randint(0, 64, (1, 8)))
    assert "bnb-compute-dtype-fp32" not in severities(mpdoctor.diagnose(model))


def test_hand_built_linear4bit_with_explicit_fp32_compute_gives_no_signal_but_is_diagnosed():
    """https://github.com/bitsandbytes-foundation/bitsandbytes/pull/2077: when ``compute_dtype=torch.float32``
    is passed explicitly, ``set_compute_type`` never runs and bitsandbytes says nothing. Reproduced: a bf16
    forward through such a layer emits no warning, while every matmul runs in fp32."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), bnb.nn.Linear4bit(32, 32, compute_dtype=torch.float32)).to(torch.bfloat16)
    model.to("cpu")
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    model.eval()
    handler = Captured()
    logging.getLogger("bitsandbytes").addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = model(x)
    logging.getLogger("bitsandbytes").removeHandler(handler)
    assert y.dtype == torch.bfloat16 and not handler.messages and not [w for w in caught if "Linear4bit" in str(w.message)]
    assert model[1].compute_dtype == torch.float32

    report = mpdoctor.diagnose(model, names={id(model): "model"})
    assert severities(report)["bnb-compute-dtype-fp32"] == "warning"
    fix = next(f for f in report.fixes if f.slug == "bnb-compute-dtype-fp32")  # planned: it makes the setup healthier
    fix.apply()
    assert model[1].compute_dtype == torch.bfloat16
    assert torch.isfinite(model(x).float()).all()
    fix.undo()
    assert model[1].compute_dtype == torch.float32


def test_healthy_qlora_bf16_compute_draws_no_warning(tmp_path):
    """QLoRA as the PEFT / transformers docs give it: nf4, bnb_4bit_compute_dtype=bf16,
    prepare_model_for_kbit_training, LoRA. Forward, backward and a step; no error, no warning."""
    model = load_4bit(tmp_path, torch.bfloat16, torch.bfloat16)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    opt = bnb.optim.AdamW8bit([p for p in model.parameters() if p.requires_grad], lr=1e-3)  # QLoRA's 8-bit optimizer
    lora_step(model, torch.randint(0, 64, (1, 8)), opt)
    report = mpdoctor.diagnose(model, opt, names={id(model): "model", id(opt): "optimizer"})
    assert not [f for f in report.findings if f.severity in ("error", "warning")], report.findings


# -- torchao float8 --------------------------------------------------------------------------------


def float8_model(width_out: int = 20):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, width_out))
    convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name("rowwise"))
    return m


def float8_step(m) -> None:
    """One float8 training step that must train: finite loss, parameters moved."""
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    def step():
        loss = m(torch.randn(16, 32)).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    run_step(step, m.parameters())


def test_float8_layer_with_dims_not_divisible_by_16_is_an_error_on_h100():
    """https://github.com/pytorch/ao/issues/571 (also #1268, #3111): "Expected trailing dimension of mat1 to be
    divisible by 16". GPU-only: this CPU's ``_scaled_mm`` accepts any shape (shown: the step runs), so the rule
    is judged against the H100 profile. The fix takes the unaligned layer out of float8 in place (back to torch's
    Linear, its weight unwrapped, the optimizer holding the plain weight); its code at build time (convert only
    aligned layers) is run as written too."""
    m = float8_model(20)
    float8_step(m)  # the CPU does not enforce the alignment
    facts = mpdoctor.diagnose(m, target="H100").facts.models[0].float8_layers
    assert [(x.path, x.in_features, x.out_features, x.recipe) for x in facts] == [("0", 32, 48, "rowwise"), ("2", 48, 20, "rowwise")]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    report = mpdoctor.diagnose(m, opt, target="H100", names={id(m): "model", id(opt): "opt"})
    finding = next(f for f in report.findings if f.check == "float8-unaligned-dims")
    assert finding.severity == "error" and "2 (48->20)" in finding.message
    in_place = finding.fixes[0]
    assert in_place.recipe == "convert-back" and in_place in report.fixes
    wrapped = m[2].weight  # torchao's float8 training tensor around the weight
    in_place.apply()
    assert [type(mod).__name__ for mod in m] == ["Float8Linear", "ReLU", "Linear"]
    assert any(p is m[2].weight for g in opt.param_groups for p in g["params"])  # the optimizer holds the plain weight
    assert "float8-unaligned-dims" not in severities(mpdoctor.diagnose(m, opt, target="H100"))
    loss = m(torch.randn(16, 32)).pow(2).mean()
    held = snapshot(m.parameters())
    loss.backward()
    opt.step()
    assert_step_trains(loss, held, m.parameters())
    in_place.undo()
    assert [type(mod).__name__ for mod in m] == ["Float8Linear", "ReLU", "Float8Linear"]
    assert m[2].weight is wrapped and any(p is wrapped for g in opt.param_groups for p in g["params"])  # exact undo
    # The build-time fix, executed as written on a fresh twin (the same model before its conversion).
    torch.manual_seed(0)
    fixed = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 20))
    exec(finding.fixes[1].code, {"model": fixed})  # noqa: S102 - the report's own snippet, the user's name `model`
    assert [type(mod).__name__ for mod in fixed] == ["Float8Linear", "ReLU", "Linear"]  # only the aligned layer
    assert "float8-unaligned-dims" not in severities(mpdoctor.diagnose(fixed, target="H100"))
    float8_step(fixed)


def test_float8_training_on_an_a100_target_is_an_error_and_the_fix_takes_the_layers_out_of_float8():
    """https://github.com/pytorch/ao/issues/575: float8 tests are skipped on CI GPUs below capability 8.9
    (A10G): ``torch._scaled_mm`` needs float8 tensor cores. GPU-only (this CPU's ``_scaled_mm`` runs, so there is no
    failing step here); judged against the A100 / T4 profiles. The fix, in place: every float8 layer back to torch's
    Linear, the optimizer holding the plain weights; a bf16 autocast step then trains; undo restores the float8
    layers and the optimizer's float8 weights."""
    m = float8_model(16)
    for target in ("A100", "T4"):
        assert severities(mpdoctor.diagnose(m, target=target))["float8-unsupported-device"] == "error"
    for target in ("L4", "RTX4090", "H100"):
        assert "float8-unsupported-device" not in severities(mpdoctor.diagnose(m, target=target))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    report = mpdoctor.diagnose(m, opt, target="A100", names={id(m): "model", id(opt): "opt"})
    finding = next(f for f in report.findings if f.check == "float8-unsupported-device")
    in_place, advice = finding.fixes
    assert in_place.applicability.name == "UNSAFE" and in_place in report.fixes
    assert "model[0].__class__ = torch.nn.Linear" in in_place.code and "model[2].__class__" in in_place.code
    assert advice.applicability.name == "DISPLAY_ONLY" and "a GPU mpdoctor cannot change" in advice.code
    wrapped = [m[0].weight, m[2].weight]  # torchao's float8 training tensors around the weights
    in_place.apply()
    assert [type(mod).__name__ for mod in m] == ["Linear", "ReLU", "Linear"]
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert all(id(p) in held for p in m.parameters())  # the optimizer holds the plain weights
    for target in ("A100", "T4"):
        assert "float8-unsupported-device" not in severities(mpdoctor.diagnose(m, opt, target=target))
    before = snapshot(m.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(torch.randn(16, 32))
    assert out.dtype == torch.bfloat16  # the plain Linear layers compute under bf16 autocast
    loss = out.float().pow(2).mean()
    loss.backward()
    opt.step()
    assert_step_trains(loss, before, m.parameters())
    in_place.undo()
    assert [type(mod).__name__ for mod in m] == ["Float8Linear", "ReLU", "Float8Linear"]
    assert all(w is v for w, v in zip([m[0].weight, m[2].weight], wrapped, strict=True))
    assert all(any(p is w for g in opt.param_groups for p in g["params"]) for w in wrapped)  # exact undo
    assert severities(mpdoctor.diagnose(m, target="A100"))["float8-unsupported-device"] == "error"


def test_healthy_float8_on_h100_with_aligned_dims_draws_no_warning():
    """torchao float8 README: convert_to_float8_training on a model with dims divisible by 16, H100."""
    m = float8_model(16)
    float8_step(m)
    report = mpdoctor.diagnose(m, target="H100")
    assert not [f for f in report.findings if f.severity in ("error", "warning")], report.findings


# -- torchao quantized weights (quantize_) ------------------------------------------------------------


def int8_weight_only(dtype_before: torch.dtype):
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)).to(dtype_before)
    quantize_(m, Int8WeightOnlyConfig())
    return m


def inner_bytes(w) -> int:
    names, _ = type(w).__tensor_flatten__(w)
    return sum(getattr(w, n).numel() * getattr(w, n).element_size() for n in names if getattr(w, n) is not None)


def test_quantized_weights_cast_after_quantize_are_not_taken_for_mixed_dtypes():
    """torchao's README quantizes a bf16 model; people also quantize first and call ``.to(torch.bfloat16)``
    after. The ``Int8Tensor`` weights then keep reporting float32 (the dtype they dequantize to) beside
    bf16 biases and norms, a layout that looks like fp32 weights meeting bf16 activations. It is not: the
    quantized layers dequantize to their input's dtype, and the bf16 forward and a training step run.
    mpdoctor 0.1 called it a mixed-param-dtypes error (a false alarm); the tally showed the int8 weights as
    float32, four times their real size."""
    m = int8_weight_only(torch.float32)
    m.to(torch.bfloat16)
    w = m[0].weight
    assert w.dtype == torch.float32 and m[0].bias.dtype == torch.bfloat16, "quantized weights keep their dtype"
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert m(x).dtype == torch.bfloat16  # the forward runs: no mismatch reaches a matmul
    report = mpdoctor.diagnose(m)
    assert "mixed-param-dtypes" not in severities(report), report.findings
    assert not [f for f in report.findings if f.severity in ("error", "warning")], report.findings
    # The tally shows what is stored: int8 data (with its scales), not 64x64 float32 values.
    int8 = [t for t in report.facts.tallies if t.kind == "param" and t.dtype == "int8"]
    assert len(int8) == 1 and int8[0].tensors == 2
    assert int8[0].bytes == inner_bytes(m[0].weight) + inner_bytes(m[2].weight)
    assert int8[0].bytes < (64 * 64 + 8 * 64) * 2  # smaller than even bf16 weights
    (q,) = [p for p in report.facts.models[0].tensors.params if p.name == "0.weight"]
    assert q.dtype == "float32" and q.quantized == ("torchao.quantization.Int8Tensor", "int8")
    # A training step of the unquantized parameters (bias, norm) works.
    trainable = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)

    def step():
        loss = m(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    run_step(step, trainable)


def test_healthy_int8_weight_only_on_a_bf16_model_draws_no_warning():
    """torchao quantization README: ``model.to(torch.bfloat16)``, then ``quantize_(model, Int8WeightOnlyConfig())``."""
    m = int8_weight_only(torch.bfloat16)
    assert m(torch.randn(4, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16
    report = mpdoctor.diagnose(m)
    assert not [f for f in report.findings if f.severity in ("error", "warning")], report.findings
    assert {t.dtype for t in report.facts.tallies if t.kind == "param"} == {"int8", "bfloat16"}


# -- bitsandbytes 8-bit optimizers, the real ones ---------------------------------------------------------


def test_real_adamw8bit_over_bf16_params_with_fp32_grads_raises_then_the_grad_cast_fix_trains():
    """The 8-bit optimizer rule on a real ``bnb.optim.AdamW8bit``: bf16 parameters whose gradients were cast to
    fp32 (what a hand-written fp32 gradient clipping or accumulation leaves) make the real step raise here;
    the report names it and its fix casts the gradients back, after which the 8-bit step trains."""
    from setups import batch, tiny_llama

    def build():
        model = tiny_llama(torch.bfloat16, use_cache=False)
        opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
        model(**batch()).loss.backward()
        for p in model.parameters():
            p.grad.data = p.grad.data.float()
        return model, opt

    model, opt = build()
    with pytest.raises(RuntimeError, match="gradient with dtype 'float' to a tensor with grad_dtype 'BFloat16'"):
        opt.step()
    model, opt = build()
    report = mpdoctor.diagnose(model, opt, names={id(model): "model", id(opt): "opt"})
    (finding,) = [f for f in report.findings_for("optimizer-dtype-requirement") if "gradients" in f.message]
    assert finding.severity == "error" and "bitsandbytes 8-bit optimizer" in finding.message
    finding.fixes[0].apply()
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
    before = [p.detach().float().clone() for p in model.parameters()]
    opt.step()
    assert sum(not torch.equal(b, p.detach().float()) for b, p in zip(before, model.parameters())) > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not report.refresh().findings_for("optimizer-dtype-requirement")


def test_real_adamw8bit_over_float64_params_steps_on_the_cpu_and_is_an_error_only_for_a_gpu():
    """The CUDA kernels have no float64 variant ('Gradient+optimizer bit data type combination not supported');
    bitsandbytes' CPU backend steps float64 weights. So the rule is judged on a CUDA device or a GPU ``target=``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 64).double()
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
    model(torch.randn(2, 128, dtype=torch.float64)).pow(2).sum().backward()
    before = model.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model.weight) and torch.isfinite(model.weight).all()
    assert opt.state[model.weight]["state1"].dtype == torch.uint8
    names = {id(model): "model", id(opt): "opt"}
    assert not mpdoctor.diagnose(model, opt, names=names).findings_for("optimizer-dtype-requirement")
    (finding,) = mpdoctor.diagnose(model, opt, names=names, target="A100").findings_for("optimizer-dtype-requirement")
    assert finding.severity == "error" and "float64" in finding.message


def test_real_adamw8bit_state_is_read_from_the_optimizer():
    """``bnb.optim.AdamW8bit`` keeps uint8 state for a parameter of >= ``min_8bit_size`` elements: no finding.
    Raising ``min_8bit_size`` above the layer's 8,192 weights makes bitsandbytes keep fp32 state there: the 8-bit
    saving is not in effect, an info."""
    torch.manual_seed(0)
    for min_8bit_size, expected in ((4096, []), (100_000, ["info"])):
        model = torch.nn.Linear(128, 64)
        opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=min_8bit_size)

        def step(model=model, opt=opt):
            loss = model(torch.randn(2, 128)).pow(2).sum()
            loss.backward()
            opt.step()
            return loss

        run_step(step, model.parameters())
        state = opt.state[model.weight]
        assert state["state1"].dtype == (torch.uint8 if min_8bit_size == 4096 else torch.float32)
        found = mpdoctor.diagnose(model, opt, names={id(model): "model", id(opt): "opt"}).findings_for("optimizer-dtype-requirement")
        assert [f.severity for f in found] == expected
