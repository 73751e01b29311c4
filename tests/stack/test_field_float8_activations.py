"""pytorch/ao#3356: a float8 row-wise base whose activation scales have no lower bound turns padding into NaN.

``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` quantizes each input row to float8 with scale
``amax / 448``. A row that is all zeros (the embedding of a padding token whose row is zero, ``padding_idx``) gets
scale 0 and quantizes to ``0 / 0 = NaN``: the loss is NaN from the first step, and the LoRA weights with it. The
maintainers' fix is a lower bound on the scale, ``activation_value_lb=1e-12``.

Stand-in: torchao's ``quantize_`` refuses float8 dynamic quantization off an sm_89+ GPU (``_check_hardware_support``,
docs/stack.md), so the weights are built with ``Float8Tensor.from_hp``, the call its config handler makes, with the
same arguments (row-wise, ``act_quant_kwargs`` row-wise, kernel ``torch``: ``torch._scaled_mm``, which runs on this
CPU). The forward is torchao's own; no torchao function is replaced.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao")
from torchao.float8.inference import Float8MMConfig  # noqa: E402
from torchao.quantization import PerRow  # noqa: E402
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference  # noqa: E402
from torchao.quantization.quantize_.workflows.float8.float8_tensor import (  # noqa: E402
    Float8Tensor,
    QuantizeTensorToFloat8Kwargs,
)

import mpdoctor  # noqa: E402
from mpdoctor.attach.training.watch import NonFiniteLoss  # noqa: E402

PAD = 0


def float8_rowwise(linear: torch.nn.Linear, floor: float | None = None) -> None:
    """``linear.weight`` quantized as ``Float8DynamicActivationFloat8WeightConfig(PerRow(), activation_value_lb=floor)``
    quantizes it (frozen)."""
    kwargs = QuantizeTensorToFloat8Kwargs(granularity=PerRow(), hp_value_lb=floor, kernel_preference=KernelPreference.TORCH)
    w = Float8Tensor.from_hp(linear.weight.detach(), granularity=PerRow(), act_quant_kwargs=kwargs,
                             mm_config=Float8MMConfig(use_fast_accum=True), kernel_preference=KernelPreference.TORCH)
    linear.weight = torch.nn.Parameter(w, requires_grad=False)


class Tagger(torch.nn.Module):
    """A token model: a frozen embedding (padding row zero) into a frozen float8 row-wise body, a trainable bf16 head."""

    def __init__(self, floor: float | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 32, padding_idx=PAD)
        self.body = torch.nn.Linear(32, 64, bias=False)
        self.head = torch.nn.Linear(64, 8)
        self.to(torch.bfloat16)
        self.embed.weight.requires_grad_(False)
        float8_rowwise(self.body, floor)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.embed(ids))))


def tagger(floor: float | None = None) -> dict:
    model = Tagger(floor)
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    ids[1, 8:] = PAD  # a right-padded row of the batch
    optimizer = torch.optim.AdamW(model.head.parameters(), lr=1e-2)
    return {"model": model, "optimizer": optimizer, "ids": ids}


def tagger_step(ns: dict) -> torch.Tensor:
    """The user's step: forward, a loss over every position, backward into the head, optimizer step."""
    loss = ns["model"](ns["ids"]).float().pow(2).mean()
    loss.backward()
    ns["optimizer"].step()
    ns["optimizer"].zero_grad()
    return loss


def probe_tagger(ns: dict):
    return mpdoctor.probe(ns["model"], ns["ids"], loss_fn=lambda out: out.float().pow(2).mean(), name="model")


def test_a_zero_row_under_unbounded_float8_activation_scales_is_nan_and_the_bound_set_in_place_cures_it():
    ns = tagger()
    model, body = ns["model"], ns["model"].body
    # The harm: the padded row quantizes to NaN, and the loss with it (the head would take a NaN step).
    out = model(ns["ids"])
    assert torch.isnan(out[1, 8:]).all() and torch.isfinite(out[0]).all()
    report = probe_tagger(ns)
    (f,) = report.findings_for("probe-nonfinite")
    assert f.severity == "error" and f.evidence["cause"] == "activation-scale-zero"
    assert f.evidence["module"] == "body" and "lower bound" in f.message and "0 / 0 = NaN" in f.message
    fix = f.fixes[0]
    assert fix.safe and fix.applicability.name == "SAFE" and fix in report.fixes and not fix.in_place
    weight, recipe = body.weight, body.weight.act_quant_kwargs
    fix.apply()
    assert body.weight is weight and weight.act_quant_kwargs.hp_value_lb == 1e-12  # the same quantized weight
    assert weight.act_quant_kwargs.granularity == recipe.granularity
    # Rows above the bound quantize exactly as before; the padded row is now 0, not NaN.
    fixed = model(ns["ids"])
    assert torch.equal(fixed[0], out[0]) and torch.isfinite(fixed).all()
    fix.undo()
    assert body.weight.act_quant_kwargs is recipe and torch.isnan(model(ns["ids"])).any()
    fix.apply()
    assert probe_tagger(ns).findings_for("probe-nonfinite") == []
    head = [p.detach().clone() for p in model.head.parameters()]
    loss = tagger_step(ns)  # the same step, run again: it trains
    assert torch.isfinite(loss) and all(not torch.equal(a, b) for a, b in zip(head, model.head.parameters()))


def test_the_bound_is_checked_on_the_probes_batch_and_said_so():
    """The probe holds the batch, not the user's loop: its proof runs forward and backward on that batch, says it is
    a stand-in, and that the bound alone made it finite; the run is left as it was."""
    ns = tagger()
    report = probe_tagger(ns)
    fix = report.findings_for("probe-nonfinite")[0].fixes[0]
    assert report.proof is not None and report.proof.stand_in and not report.proof.verified
    assert "applied alone, it ran and trained" in report.proof.label(fix)
    assert not fix.applied and ns["model"].body.weight.act_quant_kwargs.hp_value_lb is None
    assert torch.isnan(ns["model"](ns["ids"])).any()


def test_watch_names_the_unbounded_scale_at_the_first_nan_loss_and_its_fix_cures_the_loop():
    """The loss is computed outside the model, so the loop hands it to ``w.observe``; at the optimizer step after
    the first NaN loss, watch probes that batch."""
    ns = tagger()
    head = [p.detach().clone() for p in ns["model"].head.parameters()]
    with pytest.raises(NonFiniteLoss) as stopped:
        with mpdoctor.watch(ns["model"], ns["optimizer"], stop_on_nonfinite=True) as w:
            loss = w.observe(ns["model"](ns["ids"]).float().pow(2).mean())
            loss.backward()
            ns["optimizer"].step()  # stopped before it: the head keeps its finite weights
    assert torch.isnan(loss) and all(torch.equal(a, b) for a, b in zip(head, ns["model"].head.parameters()))
    ns["optimizer"].zero_grad()
    report = w.probe_report
    assert stopped.value.report is report
    (f,) = report.findings_for("probe-nonfinite")
    assert f.evidence["cause"] == "activation-scale-zero", report.to_text()
    f.fixes[0].apply()
    assert torch.isfinite(tagger_step(ns))


@pytest.mark.parametrize("floor", [1e-12, None], ids=["bounded", "no-zero-row"])
def test_bounded_scales_or_batches_without_zero_rows_draw_nothing(floor):
    """The healthy twins: the maintainers' recipe (``activation_value_lb=1e-12``) with the padded batch, and no
    bound with a batch that has no all-zero row (harmless here): no error, no warning, and the step trains."""
    ns = tagger(floor)
    if floor is None:
        ns["ids"][1, 8:] = 5  # no padding
    report = probe_tagger(ns)
    assert [x.check for x in report.findings if x.severity in ("error", "warning")] == [], report.to_text()
    assert torch.isfinite(tagger_step(ns))
