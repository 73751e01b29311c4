"""Field cases from bitsandbytes' and torchao's trackers, reproduced on this CPU.

bitsandbytes ships a CPU backend: real nf4 loading of a locally saved tiny model works here. torchao's float8
layers train on this CPU too (torch has a CPU ``_scaled_mm``), but the GPU rules (compute capability 8.9+,
dims divisible by 16) are not enforced here: those are judged against a ``target=`` profile, and the tests
say so.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

import mpdoctor  # noqa: E402


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
    opt = opt or torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    after = [p for p in model.parameters() if p.requires_grad]
    assert torch.isfinite(loss) and any(not torch.equal(a, b.detach()) for a, b in zip(before, after))


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
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    loss = m(torch.randn(16, 32)).pow(2).mean()
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)


def test_float8_layer_with_dims_not_divisible_by_16_is_an_error_on_h100():
    """https://github.com/pytorch/ao/issues/571 (also #1268, #3111): "Expected trailing dimension of mat1 to be
    divisible by 16". GPU-only: this CPU's ``_scaled_mm`` accepts any shape (shown: the step runs), so the rule
    is judged against the H100 profile, and the fix (convert only aligned layers) is display-only."""
    m = float8_model(20)
    float8_step(m)  # the CPU does not enforce the alignment
    facts = mpdoctor.diagnose(m, target="H100").facts.models[0].float8_layers
    assert [(x.path, x.in_features, x.out_features, x.recipe) for x in facts] == [("0", 32, 48, "rowwise"), ("2", 48, 20, "rowwise")]
    report = mpdoctor.diagnose(m, target="H100")
    finding = next(f for f in report.findings if f.check == "float8-unaligned-dims")
    assert finding.severity == "error" and "2 (48->20)" in finding.message
    assert "module_filter_fn" in finding.fixes[0].code
    # The advice, taken: convert only the aligned layers.
    torch.manual_seed(0)
    fixed = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 20))
    convert_to_float8_training(fixed, module_filter_fn=lambda mod, fqn: mod.in_features % 16 == 0 and mod.out_features % 16 == 0)
    assert "float8-unaligned-dims" not in severities(mpdoctor.diagnose(fixed, target="H100"))
    float8_step(fixed)


def test_float8_training_on_an_a100_target_is_an_error():
    """https://github.com/pytorch/ao/issues/575: float8 tests are skipped on CI GPUs below capability 8.9
    (A10G): ``torch._scaled_mm`` needs float8 tensor cores. GPU-only; judged against the A100 / T4 profiles."""
    m = float8_model(16)
    for target in ("A100", "T4"):
        assert severities(mpdoctor.diagnose(m, target=target))["float8-unsupported-device"] == "error"
    for target in ("L4", "RTX4090", "H100"):
        assert "float8-unsupported-device" not in severities(mpdoctor.diagnose(m, target=target))


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
    m(x).float().pow(2).mean().backward()
    opt.step()


def test_healthy_int8_weight_only_on_a_bf16_model_draws_no_warning():
    """torchao quantization README: ``model.to(torch.bfloat16)``, then ``quantize_(model, Int8WeightOnlyConfig())``."""
    m = int8_weight_only(torch.bfloat16)
    assert m(torch.randn(4, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16
    report = mpdoctor.diagnose(m)
    assert not [f for f in report.findings if f.severity in ("error", "warning")], report.findings
    assert {t.dtype for t in report.facts.tallies if t.kind == "param"} == {"int8", "bfloat16"}
