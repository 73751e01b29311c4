"""The code of ``Comparison.plan()`` executed with torchao on the real model: it converts exactly the planned Linears."""

from __future__ import annotations

import torch
from test_compare_plan import BUDGET, WIDE, data, mse_to, wide_channel_model

from mpdoctor.attach.emulation.compare import compare


def test_the_plans_torchao_code_converts_exactly_the_planned_layers_and_the_converted_model_trains():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = wide_channel_model()
    x, y = data(model)
    plan = compare(model, x, precisions=("fp8",), loss=mse_to(y)).plan("fp8", budget=BUDGET)
    assert set(plan.kept) == set(WIDE)
    # The plan's own code, run as a user would paste it, on the very model compare() measured.
    scope = {"model": model}
    exec(plan.code, scope)  # noqa: S102
    converted = {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    plain = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    assert converted == set(plan.converted) and plain == set(WIDE)
    # torchao's Float8Linear trains on this CPU: a finite loss and weights that moved.
    before = model[0].proj.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = mse_to(y)(model(x))
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and not torch.equal(before, model[0].proj.weight)
    # The config object and the callable filter select the same layers on a fresh copy.
    fresh = wide_channel_model()
    config = plan.torchao_config()
    assert isinstance(config, Float8LinearConfig)
    convert_to_float8_training(fresh, config=config, module_filter_fn=plan.module_filter_fn())
    assert {n for n, m in fresh.named_modules() if type(m).__name__ == "Float8Linear"} == set(plan.converted)


def test_the_real_float8_model_keeps_the_loss_the_plan_verified_and_all_fp8_does_not():
    """torchao's Float8Linear, not the emulation: converting every Linear moves the loss far past the
    budget, converting the planned ones keeps it within (the emulation's verdict holds on the real thing)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = wide_channel_model()
    x, y = data(model)
    plan = compare(model, x, precisions=("fp8",), loss=mse_to(y)).plan("fp8", budget=BUDGET)
    reference = mse_to(y)(model(x)).item()
    config = Float8LinearConfig.from_recipe_name("tensorwise")
    everything = convert_to_float8_training(wide_channel_model(), config=config)
    planned = convert_to_float8_training(wide_channel_model(), config=config, module_filter_fn=plan.module_filter_fn())
    with torch.no_grad():
        gap_all = abs(mse_to(y)(everything(x)).item() - reference)
        gap_plan = abs(mse_to(y)(planned(x)).item() - reference)
    print(f"real Float8Linear: loss gap all-fp8 {gap_all:.4g}, planned {gap_plan:.4g} (budget {BUDGET})")
    assert gap_all > BUDGET >= gap_plan
    assert abs(gap_plan - plan.loss_gap) < 0.5 * BUDGET
