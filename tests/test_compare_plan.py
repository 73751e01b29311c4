"""``Comparison.plan()``: a per-layer precision plan, ranked by the per-layer figures, verified by running it.

The model is built so that three of its eight Linears carry wide-range channels: their input channels span
six decades (1e-6 .. 1) and their weights compensate (column j divided by the channel's scale, so in fp32
every channel contributes alike, as an outlier channel migrated into the weights does). Tensorwise fp8 loses
both ends of that range; bf16 loses neither. Runs in both venvs (no torchao here:
``tests/stack/test_compare_plan_torchao.py`` executes the plan's code with torchao).
"""

from __future__ import annotations

import math

import pytest
import torch
from fingerprint import assert_unchanged, fingerprint

from mpdoctor.attach.emulation.compare import compare
from mpdoctor.attach.emulation.precision_plan import Plan

WIDE = ("1.proj", "4.proj", "6.proj")
BUDGET = 0.02


class ChannelSpread(torch.nn.Module):
    """Multiplies input channel j by a fixed scale in 1e-6 .. 1 (a buffer): six decades across the channels."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.logspace(-6, 0, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def wide_channel_model(width: int = 64, blocks: int = 8, wide: tuple[int, ...] = (1, 4, 6)) -> torch.nn.Sequential:
    """Eight blocks ``[spread] -> Linear -> RMSNorm``; the blocks in ``wide`` spread their Linear's inputs."""
    torch.manual_seed(0)
    layers = []
    for i in range(blocks):
        block = torch.nn.Sequential()
        if i in wide:
            block.add_module("spread", ChannelSpread(width))
        block.add_module("proj", torch.nn.Linear(width, width, bias=False))
        block.add_module("norm", torch.nn.RMSNorm(width))
        if i in wide:
            with torch.no_grad():
                block.proj.weight.div_(block.spread.scale)  # fp32 output unchanged: the spread moved into the weight
        layers.append(block)
    return torch.nn.Sequential(*layers)


def data(model: torch.nn.Module, seed: int = 1, rows: int = 64, width: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets the model nearly fits (its own fp32 outputs plus 10% noise), as late in training:
    an output error then raises the loss instead of vanishing in the error of a random target."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g)
    with torch.no_grad():
        y = model(x) + 0.1 * torch.randn(rows, width, generator=g)
    return x, y


def mse_to(y: torch.Tensor):
    return lambda out: torch.nn.functional.mse_loss(out, y)


@pytest.fixture(scope="module")
def planned() -> tuple[torch.nn.Module, object, Plan]:
    model = wide_channel_model()
    x, y = data(model)
    c = compare(model, x, precisions=("bf16", "fp8"), loss=mse_to(y))
    return model, c, c.plan("fp8", budget=BUDGET)


def test_the_plan_keeps_exactly_the_three_wide_range_layers_and_its_verified_loss_gap_is_within_budget(planned):
    _, c, plan = planned
    print(plan.to_text())
    assert set(plan.kept) == set(WIDE)
    assert set(plan.converted) == {f"{i}.proj" for i in range(8)} - set(WIDE)
    assert plan.within_budget and plan.planned.loss_gap <= BUDGET
    # All-fp8 is not within budget: the per-layer judgement alone would not have told how far off it is.
    assert plan.all_target.loss_gap > BUDGET
    assert plan.all_kept.loss_gap < plan.planned.loss_gap < plan.all_target.loss_gap
    # The gradients: the plan's are much closer to fp32's than all-fp8's.
    assert plan.planned.grad_sqnr_db > plan.all_target.grad_sqnr_db + 10
    # Each kept layer says why, from its fp8 figures.
    assert all("dB" in plan.reasons[p] for p in WIDE)
    assert c.plans["fp8"] is plan


def test_the_verified_loss_of_the_plan_is_a_real_run_of_the_mixed_model(planned):
    """The plan's loss equals the loss of the model run with its kept layers in bf16 and the rest in fp8."""
    model, _, plan = planned
    from mpdoctor.attach.emulation.formats import precision
    from mpdoctor.attach.emulation.sites import Emulation, linears

    x, y = data(model)
    assignment = {p: precision("bf16") for p in plan.kept}
    with torch.no_grad(), Emulation(linears(model), precision("fp8"), layers=assignment, attention=False, measure=False):
        loss = torch.nn.functional.mse_loss(model(x), y).item()
    assert loss == pytest.approx(plan.planned.loss, rel=1e-6)
    assert abs(loss - plan.reference_loss) == pytest.approx(plan.loss_gap, abs=1e-7)


def test_the_search_bisects_rather_than_trying_every_layer(planned):
    _, _, plan = planned
    # all-fp8, all-bf16, then a bisection over 8 ranked layers: at most 2 + ceil(log2 8) distinct runs.
    assert len(plan.tried) <= 2 + 3
    assert plan.ranking[:3] and set(plan.ranking[:3]) == set(WIDE)


def test_a_share_budget_caps_the_kept_layers_and_says_when_the_loss_budget_is_missed():
    model = wide_channel_model()
    x, y = data(model)
    c = compare(model, x, precisions=("fp8",), loss=mse_to(y))
    capped = c.plan("fp8", budget=BUDGET, max_kept=0.25)  # 2 of 8 at most: one wide layer stays in fp8
    assert len(capped.kept) == 2 and set(capped.kept) <= set(WIDE)
    assert not capped.within_budget and capped.planned.loss_gap > BUDGET
    # The share alone: the worst layers up to the cap.
    share_only = c.plan("fp8", max_kept=3 / 8)
    assert set(share_only.kept) == set(WIDE) and share_only.budget is None


def test_plan_leaves_the_model_weights_grads_rng_and_hooks_as_they_were():
    model = wide_channel_model()
    x, y = data(model)
    model(x).sum().backward()  # the user's grads
    c = compare(model, x, precisions=("fp8",), loss=mse_to(y))
    torch.manual_seed(7)
    before = fingerprint({"model": model, "x": x})
    c.plan("fp8", budget=BUDGET)
    assert_unchanged(before, fingerprint({"model": model, "x": x}), "Comparison.plan()")


def test_plan_needs_a_compared_low_precision_target_and_a_live_model():
    model = wide_channel_model(blocks=2, wide=(1,))
    x, y = data(model)
    c = compare(model, x, precisions=("bf16", "fp8"), loss=mse_to(y))
    with pytest.raises(ValueError, match="mxfp8 was not compared"):
        c.plan("mxfp8")
    with pytest.raises(ValueError, match="converts to"):
        c.plan("bf16")
    with pytest.raises(ValueError, match="between 0 and 1"):
        c.plan("fp8", max_kept=2)
    del model
    import gc

    gc.collect()
    with pytest.raises(ValueError, match="the model of this comparison is gone"):
        c.plan("fp8")


def test_the_heatmap_marks_the_kept_layers_and_shows_the_plans_loss_beside_the_others(planned):
    _, c, plan = planned
    text = c.to_text()
    for p in WIDE:
        assert any(line.strip().startswith(f"{p} ◆") for line in text.splitlines())
    assert "plan fp8: 3 of 8 Linears kept in bf16" in text and "all-fp8" in text and "all-bf16" in text
    html = c.to_html()
    assert html.count(">◆</b>") == 3 and "plan fp8" in html and "all-fp8" in html
    assert f"{plan.planned.loss_gap:.3g}" in html


def test_the_plans_code_names_the_kept_layers_in_a_module_filter(planned):
    _, _, plan = planned
    assert "keep = {'1.proj', '4.proj', '6.proj'}" in plan.code
    assert "convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)" in plan.code
    assert "AORecipeKwargs(config=config, module_filter_func=module_filter_fn)" in plan.accelerate_code
    filt = plan.module_filter_fn()
    model = wide_channel_model()
    chosen = {n for n, m in model.named_modules() if filt(m, n)}
    assert chosen == set(plan.converted)


def test_a_nan_free_healthy_model_keeps_nothing():
    """No false alarm: a model with no wide-range layer is planned all-fp8, within budget at the first run."""
    model = wide_channel_model(wide=())
    x, y = data(model)
    plan = compare(model, x, precisions=("fp8",), loss=mse_to(y)).plan("fp8", budget=BUDGET)
    assert plan.kept == () and plan.within_budget and math.isfinite(plan.loss_gap)


def test_magic_plan_option_draws_the_plan_and_returns_it(shell, capsys):
    model = wide_channel_model()
    x, _ = data(model)
    shell.user_ns["net"], shell.user_ns["xb"] = model, x
    result = shell.run_cell("p = %mpdoctor net --plan fp8 xb --text")
    assert result.error_in_exec is None
    out = capsys.readouterr().out
    assert "mpdoctor.compare: net" in out and "plan fp8:" in out and "◆" in out
    assert isinstance(shell.user_ns["p"], Plan) and shell.user_ns["p"].target == "fp8"
    shell.run_cell("%mpdoctor net --plan bf16 xb --text")
    assert "--plan bf16: plan() converts to" in capsys.readouterr().out


def test_a_gradient_sqnr_budget_keeps_more_layers_than_the_loss_budget_and_the_verified_run_meets_it(planned):
    """On the wide-channel model, the loss budget alone keeps the three wide layers, but fp8 anywhere downstream
    still garbles the gradients flowing back (all parameters' gradient SQNR below 0 dB); bounding the
    gradient SQNR as well keeps layers until the verified run meets that bound too."""
    _, c, _ = planned
    loss_only = c.plan("fp8", budget=BUDGET, keep="fp32")
    assert set(loss_only.kept) == set(WIDE) and loss_only.planned.grad_sqnr_db < 0.0
    # The loss alone was bounded: the text says so, and that the gradients it did not bound are mostly noise.
    loss_text = loss_only.to_text()
    assert "within the loss budget" in loss_text and "verified" not in loss_text
    assert f"its gradient SQNR is {loss_only.planned.grad_sqnr_db:.1f} dB, not bounded" in loss_text
    both = c.plan("fp8", budget=BUDGET, keep="fp32", min_grad_sqnr_db=0.0)
    assert set(WIDE) < set(both.kept)
    assert both.within_budget and both.planned.grad_sqnr_db >= 0.0 and both.planned.loss_gap <= BUDGET
    assert both.all_target.grad_sqnr_db < 0.0  # all-fp8 is over the gradient budget
    # The search is verified runs: the plan is the fewest kept layers whose run met both bounds.
    fewer = [v for v in both.tried if len(v.kept) < len(both.kept)]
    assert fewer and all(v.grad_sqnr_db < 0.0 or v.loss_gap > BUDGET for v in fewer)
    text = both.to_text()
    assert "gradient SQNR >= 0 dB" in text and "within the loss and gradient budget" in text
    assert text.count("emulated") >= 2 and "verified" not in text  # the figures are the emulation's, and it says so
    assert both.to_dict()["min_grad_sqnr_db"] == 0.0


def test_a_gradient_budget_the_cap_cannot_meet_is_reported_over_budget(planned):
    _, c, _ = planned
    capped = c.plan("fp8", keep="fp32", min_grad_sqnr_db=0.0, max_kept=0.5)
    assert len(capped.kept) == 4 and capped.budget is None
    assert not capped.within_budget and capped.planned.grad_sqnr_db < 0.0
    assert "OVER the gradient budget (no loss budget, at most 50% of Linears kept, gradient SQNR >= 0 dB)" in capped.to_text()


def test_magic_plan_shows_the_plan_once_not_again_as_the_returned_value(shell, capsys):
    model = wide_channel_model()
    x, _ = data(model)
    shell.user_ns["net"], shell.user_ns["xb"] = model, x
    for line in ("%mpdoctor net --plan fp8 xb --text", "%mpdoctor net --plan fp8 xb"):
        result = shell.run_cell(line, store_history=True)  # the cell's value is the plan: the display hook sees it
        assert result.error_in_exec is None and isinstance(result.result, Plan)
        out = capsys.readouterr().out
        assert out.count("plan fp8:") == 1, out
        assert out.count("def module_filter_fn") == 1, out  # its code, shown once
    # Displayed on its own later, it shows. Read through Out[N], not `_`: IPython stops updating `_` once a cell
    # of the shared shell has assigned it.
    shell.run_cell(f"Out[{result.execution_count}]", store_history=True)
    assert "def module_filter_fn" in capsys.readouterr().out


def test_the_plan_keeps_every_layer_the_warning_beside_it_says_to_keep_and_the_legend_explains_each_column():
    """A generous loss budget is met with every Linear in fp8; the layers losing inputs to zero are kept all the
    same, as the underflow warning (and recommend()) say: the plan never reads '0 kept' above that warning."""
    model = wide_channel_model()
    x, y = data(model)
    c = compare(model, x, precisions=("bf16", "fp8", "mxfp8"), loss=mse_to(y))
    plan = c.plan("fp8", budget=1e9)
    (warning,) = [f for f in c.findings if f.check == "fp8-layer-underflows"]
    assert set(warning.evidence["layers"]) == set(WIDE) == set(c.recommend("fp8").keep)
    assert set(plan.kept) == set(WIDE) and plan.within_budget
    assert all("underflow" in plan.reasons[p] for p in WIDE)
    text, html = c.to_text(), c.to_html()
    assert "plan fp8: 3 of 8 Linears kept in bf16" in text
    for shown in (text, html):
        assert "mxfp8 [FLOOR]: MXFP8: 32-element blocks, e8m0 FLOOR scales" in shown  # the column heading explained
        assert "◆ = kept in bf16 by the fp8 plan" in shown
        assert "fp8 below 16 dB or ▼ above 1%" in shown
