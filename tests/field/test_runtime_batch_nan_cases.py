"""Field cases of the run as patient: the batch's dtype at the model's boundary, and where a NaN is born.

Each case reproduces the reported failure on this CPU first (the real error, or the measured harm), then
asserts the diagnosis names the input and layer (or the op, module and cause of the NaN), applies the
treatment and trains a step (finite loss, parameters changed).
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers as T
from torch import nn

import mpdoctor
from mpdoctor.attach.numerics.probe import ForwardCall


def _trains(model, batch, loss_of=lambda m, b: m(**b).loss, lr=1e-2) -> bool:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    before = [p.detach().clone() for p in model.parameters()]
    loss = loss_of(model, batch)
    loss.backward()
    opt.step()
    moved = any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    return bool(torch.isfinite(loss.detach()).all()) and moved


def _nonfinite(report):
    return next(f for f in report.findings if f.check == "probe-nonfinite")


def test_fp32_image_into_an_fp16_vision_model_input_type_float_bias_type_half():
    """DepthAnything/Depth-Anything-V2#264, nvidia-cosmos/cosmos-transfer1#137.

    https://github.com/DepthAnything/Depth-Anything-V2/issues/264 --
    https://github.com/nvidia-cosmos/cosmos-transfer1/issues/137
    """
    torch.manual_seed(0)
    config = T.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1], num_labels=3)
    model = T.ConvNextForImageClassification(config).half()
    batch = T.BatchFeature({"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([0, 1])})
    with pytest.raises(RuntimeError, match=r"Input type \(float\) and bias type \(c10::Half\) should be the same"):
        model(**batch)

    report = mpdoctor.probe(model, batch)
    finding = next(f for f in report.findings if f.check == "batch-dtype-mismatch")
    assert finding.evidence["inputs"] == {"pixel_values": "float32"} and finding.evidence["layer_dtype"] == "float16"
    assert finding.evidence["layer_class"] == "Conv2d"
    fix = finding.fixes[0]
    fix.apply()
    assert _trains(model, batch, lr=1.0)  # fp16 weights: a step large enough not to round away
    fix.undo()


def test_processor_output_in_fp32_into_a_bf16_language_model_mat1_and_mat2():
    """QwenLM/Qwen3-VL#246: fp32 features from the processor into a bf16 model (stand-in: fp32 inputs_embeds).

    https://github.com/QwenLM/Qwen3-VL/issues/246
    """
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    model = T.LlamaForCausalLM(config).to(torch.bfloat16)
    batch = {"inputs_embeds": torch.randn(2, 5, 32), "labels": torch.randint(0, 100, (2, 5))}
    with pytest.raises(RuntimeError, match=r"expected m(at)?1 and m(at)?2 to have the same dtype, but got: float != c10::BFloat16"):
        with mpdoctor.watch(model) as w:
            model(**batch)
    cause = w.crash_report.cause
    assert cause.check == "batch-dtype-mismatch" and cause.evidence["inputs"] == {"inputs_embeds": "float32"}
    fix = cause.fixes[0]
    fix.apply()
    assert _trains(model, batch, lr=1.0)
    fix.undo()


class KernelLayerNorm(nn.Module):
    """What DeepSpeed's fused kernel did (#581): variance + eps, then rsqrt, in fp16."""

    def __init__(self, dim: int, eps: float = 1e-12) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return self.weight * ((x - mean) * torch.rsqrt(var + self.variance_epsilon)) + self.bias


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8, padding_idx=0)
        self.norm = KernelLayerNorm(8)
        self.head = nn.Linear(8, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids))).float().pow(2).mean()


def test_layer_norm_eps_1e12_in_fp16_gives_nan_on_padding_rows():
    """deepspeedai/DeepSpeed#581, pytorch/pytorch#41527, wenet-e2e/wenet PR #907 (eps 1e-12 -> 1e-5 for half).

    https://github.com/deepspeedai/DeepSpeed/issues/581 -- https://github.com/pytorch/pytorch/issues/41527 --
    https://github.com/wenet-e2e/wenet/pull/907
    """
    torch.manual_seed(0)
    model = Encoder().half()
    ids = torch.tensor([[3, 4, 0, 0], [5, 6, 7, 0]])  # padding rows embed to zeros: zero variance
    assert torch.isnan(model(ids))  # the real harm

    report = mpdoctor.probe(model, ids, loss_fn=lambda out: out)
    f = _nonfinite(report)
    assert f.evidence["origin"] == "eps-underflow" and f.evidence["module"] == "norm"
    static = next(g for g in report.findings if g.check == "norm-eps-underflow")
    assert static.severity == "error"
    fix = next(fx for fx in f.fixes if fx.recipe == "representable-eps")
    fix.apply()
    assert model.norm.variance_epsilon == 1e-5
    assert _trains(model, ids, loss_of=lambda m, b: m(b), lr=1.0)
    fix.undo()
    assert model.norm.variance_epsilon == 1e-12


def test_f_normalize_default_eps_is_zero_in_fp16():
    """pytorch/pytorch#32137, huggingface/diffusers PR #13316 (normalize computed in fp32 for half inputs).

    https://github.com/pytorch/pytorch/issues/32137 -- https://github.com/huggingface/diffusers/pull/13316
    """
    model, x = normalized_head()
    assert torch.isnan(model(x)).any()  # the real harm: zero-norm row -> 0 / max(0, 1e-12 -> 0)

    report = mpdoctor.probe(model, x, loss_fn=lambda out: out.float().sum())
    f = _nonfinite(report)
    assert f.evidence["origin"] == "eps-underflow" and f.evidence["op"] == "normalize"
    (fix,) = [fx for fx in report.fixes if fx.recipe == "fp32-module"]  # planned: the normalisation in fp32
    held = [(p, p.data) for p in model.parameters()]
    fix.apply()
    assert fix.applied and model.proj.weight.dtype == torch.float32
    assert _trains(model, x, loss_of=lambda m, b: m(b).float().sum(), lr=1.0)  # the user's own forward
    fix.undo()
    assert all(p.dtype == torch.float16 for p, _ in held) and "forward" not in vars(model)
    assert torch.isnan(model(x)).any()  # undone: the fp16 normalisation again

    model, x = normalized_head()  # the code the finding shows, run as the user would
    assert _trains(model, x, loss_of=lambda m, b: m(b, fp32=True).float().sum(), lr=1.0)


class Head(nn.Module):
    """A projection then ``F.normalize`` (eps 1e-12, which is 0 in fp16)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, fp32: bool = False) -> torch.Tensor:
        h = self.proj(x)
        if fp32:  # the code the finding shows: the normalisation in fp32
            return torch.nn.functional.normalize(h.float(), dim=-1).to(h.dtype)
        return torch.nn.functional.normalize(h, dim=-1)


def normalized_head() -> tuple[Head, torch.Tensor]:
    """An fp16 ``Head`` whose first output is bias only (zero), and a batch whose first row is zero: a zero norm."""
    torch.manual_seed(0)
    model = Head().half()
    with torch.no_grad():
        model.proj.weight[0] = 0.0  # one all-zero output row of weights: h[:, 0] is bias only
        model.proj.bias.zero_()
    x = torch.zeros(2, 4, dtype=torch.float16)
    x[1] = 1.0
    return model, x


def test_t5_feed_forward_output_passes_65504_in_fp16():
    """huggingface/transformers#5651 (T5DenseReluDense `wo` output 66246 > 65504 in fp16).

    https://github.com/huggingface/transformers/issues/5651
    """
    torch.manual_seed(0)
    config = T.T5Config(vocab_size=100, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                        num_heads=2, decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    model = T.T5ForConditionalGeneration(config).half()
    with torch.no_grad():  # tiny random weights stay small: scale wo so its output passes 65504, as trained T5s do
        model.encoder.block[0].layer[1].DenseReluDense.wo.weight.mul_(60000.0)
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    assert torch.isnan(model(**batch).loss)  # the real harm

    report = mpdoctor.probe(model, batch)
    f = _nonfinite(report)
    assert f.evidence["origin"] == "overflow" and f.evidence["op"] == "linear"
    assert f.evidence["module"] == "encoder.block.0.layer.1.DenseReluDense.wo"  # not T5's log of bucket 0
    fix = next(fx for fx in f.fixes if fx.recipe == "bf16")
    fix.apply()
    assert _trains(model, batch)


def test_log_of_zero_in_a_hand_written_loss():
    """yhenon/pytorch-retinanet#3, mathiaszinnen/focal_loss_torch#3 (torch.log(p) with p == 0 -> NaN loss).

    https://github.com/yhenon/pytorch-retinanet/issues/3 -- https://github.com/mathiaszinnen/focal_loss_torch/issues/3
    """

    class Focal(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, y: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
            p = torch.sigmoid(self.fc(x)).squeeze(-1)
            p_t = torch.where(y > 0, p, 1 - p)
            if eps:  # the fix the finding gives: clamp before the log
                p_t = p_t.clamp_min(eps)
            return (-((1 - p_t) ** 2) * torch.log(p_t)).mean()

    torch.manual_seed(0)
    model = Focal()
    with torch.no_grad():
        model.fc.weight.fill_(30.0)
    x = torch.tensor([[1.0, 1, 1, 1], [0.01, 0.01, 0.01, 0.01]])
    y = torch.tensor([0.0, 1.0])  # first row: p == 1.0 exactly in fp32, label 0 -> log(0)
    assert not torch.isfinite(model(x, y))  # the real harm: 0 * -inf = NaN

    f = _nonfinite(mpdoctor.probe(model, ForwardCall(x, y), loss_fn=lambda out: out))
    assert f.evidence["origin"] == "log-nonpositive" and f.evidence["op"] == "log"
    assert "clamp" in f.fixes[0].code
    assert _trains(model, (x, y), loss_of=lambda m, b: m(*b, eps=torch.finfo(torch.float32).tiny), lr=1e-2)
    assert math.isfinite(float(model(x, y, eps=torch.finfo(torch.float32).tiny).detach()))


FOCAL_LOSS_CELL = """
import torch
from torch import nn


def focal_loss(logits, y, gamma=2.0):
    p = torch.sigmoid(logits)
    p_t = torch.where(y > 0, p, 1 - p)
    return (-((1 - p_t) ** gamma) * torch.log(p_t)).mean()
"""

DETECTOR_CELL = """
class Detector(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x, y):
        return focal_loss(self.fc(x).squeeze(-1), y)  # RetinaNet's forward returns its focal loss in training


torch.manual_seed(0)
model = Detector()
with torch.no_grad():
    model.fc.weight.fill_(30.0)  # a confident classifier: sigmoid saturates to exactly 1.0 in fp32
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
x = torch.tensor([[1.0, 1, 1, 1], [0.01, 0.01, 0.01, 0.01]])
y = torch.tensor([0.0, 1.0])  # the first row's label is 0: its p_t = 1 - p == 0, and log(0) = -inf
batch = (x, y)
"""

TRAIN_CELL = """
loss = model(x, y)
opt.zero_grad()
loss.backward()
opt.step()
"""

_NOTEBOOK_NAMES = ("torch", "nn", "focal_loss", "Detector", "model", "opt", "x", "y", "batch", "loss", "r")


def test_retinanet_3_log_of_a_saturated_probability_in_a_notebook_gets_its_loss_cell_corrected():
    """yhenon/pytorch-retinanet#3 in a notebook: the focal loss is a function of its own cell, called by the model's
    forward; p == 1.0 exactly in fp32 makes ``torch.log(p_t)`` -inf, the loss inf, and the step writes NaN into the
    weights. The probe names the log and the line of the user's cell; the fix is that cell with the log's argument
    clamped at fp32's tiny, run on copies before it is shown, insertable, then run for real: the step trains.

    https://github.com/yhenon/pytorch-retinanet/issues/3
    """
    from notebook_shell import loaded_shell

    from mpdoctor.attach.runtime.twins import try_on_twins
    from mpdoctor.diagnosis.view_builder import code_fixes

    with loaded_shell(_NOTEBOOK_NAMES) as sh:
        loss_cell = sh.execution_count
        assert sh.run_cell(FOCAL_LOSS_CELL, store_history=True).success
        assert sh.run_cell(DETECTOR_CELL, store_history=True).success
        assert sh.run_cell(TRAIN_CELL, store_history=True).success
        ns = sh.user_ns
        assert not torch.isfinite(ns["loss"])  # the real harm: the loss is inf, ...
        assert not bool(torch.isfinite(ns["model"].fc.weight).all())  # ... and the step wrote NaN into the weights
        assert sh.run_cell(DETECTOR_CELL, store_history=True).success  # the user builds the model again
        user_loss, weight = ns["focal_loss"], ns["model"].fc.weight.detach().clone()

        assert sh.run_cell("r = %mpdoctor model --probe batch --text", store_history=True).success
        report = ns["r"]
        f = next(f for f in report.findings if f.check == "probe-nonfinite")
        assert f.evidence["origin"] == "log-nonpositive" and f.evidence["op"] == "log"
        assert f.evidence["line"] == f"cell [{loss_cell}], line 8"  # the log's line in the loss's own cell
        assert f"cell [{loss_cell}], line 8 (focal_loss)" in f.message
        (fix,) = [fx for fx in f.fixes if fx.recipe == "corrected-cell"]
        assert fix.title.endswith("(corrected code)") and f"cell [{loss_cell}]" in fix.title
        assert "torch.log(p_t.clamp_min(torch.finfo(p_t.dtype).tiny))" in fix.code
        assert "def focal_loss(logits, y, gamma=2.0):" in fix.code and "p_t = torch.where(y > 0, p, 1 - p)" in fix.code
        assert "class Detector" not in fix.code  # the cell that holds the line, not the one that calls it

        (trial,) = [t for fx, t in report.trials if fx is fix]  # run on copies before it is shown
        assert trial.ran, trial.sentence()
        assert ns["focal_loss"] is user_loss and torch.equal(ns["model"].fc.weight, weight)  # nothing of the user's ran
        assert try_on_twins(fix.code, ns).ran and ns["focal_loss"] is user_loss

        number = next(i for i, fx in enumerate(code_fixes(report), 1) if fx is fix)
        sh.rl_next_input = None
        assert sh.run_cell(f"%mpdoctor insert {number}", store_history=True).success
        assert sh.rl_next_input == fix.code

        assert sh.run_cell(fix.code, store_history=True).success  # then for real: the corrected cell ...
        assert ns["focal_loss"] is not user_loss
        assert sh.run_cell(TRAIN_CELL, store_history=True).success  # ... and the same step, on the same model
        assert math.isfinite(float(ns["loss"].detach()))
        after = ns["model"].fc.weight.detach()
        assert bool(torch.isfinite(after).all()) and not torch.equal(after, weight)


def test_a_focal_loss_already_clamped_in_a_notebook_draws_no_error_or_warning():
    """The healthy twin of retinanet#3: the same notebook with the log's argument clamped; the probe finds nothing."""
    from notebook_shell import loaded_shell

    healthy = FOCAL_LOSS_CELL.replace("torch.log(p_t)", "torch.log(p_t.clamp_min(torch.finfo(p_t.dtype).tiny))")
    with loaded_shell(_NOTEBOOK_NAMES) as sh:
        for cell in (healthy, DETECTOR_CELL):
            assert sh.run_cell(cell, store_history=True).success
        assert sh.run_cell("r = %mpdoctor model --probe batch --text", store_history=True).success
        report = sh.user_ns["r"]
        assert [f.check for f in report.findings if f.severity in ("error", "warning")] == []
        assert sh.run_cell(TRAIN_CELL, store_history=True).success
        assert math.isfinite(float(sh.user_ns["loss"].detach()))
