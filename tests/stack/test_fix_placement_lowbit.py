"""A block format's refused layers are taken out of the recipe in place (torchao's MXFP8 training on this CPU).

The real error first (the router's 16 outputs are not a multiple of MXFP8's 32-element block: backward raises),
then the crash's cause, its fix applied to the live model and optimizer, the same step training, and undo putting
the wrapped weights back in the model and the optimizer.
"""

from __future__ import annotations

import torch
from steps import assert_step_trains, snapshot

from mpdoctor.attach.crash import explain


class Routed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(64, 16, bias=False)  # 16 experts: not a multiple of the block
        self.up = torch.nn.Linear(64, 128, bias=False)
        self.down = torch.nn.Linear(128, 64, bias=False)

    def forward(self, x):
        gate = torch.softmax(self.router(x).float(), dim=-1).max(dim=-1, keepdim=True).values.to(x.dtype)
        return x + gate * self.down(torch.relu(self.up(x)))


def _mx_model():
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.quantization import quantize_

    torch.manual_seed(0)
    model = torch.nn.Sequential(Routed(), Routed()).to(torch.bfloat16)
    quantize_(model, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL),
              filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear))  # fmt: skip
    return model


def test_layers_a_block_format_refuses_are_converted_back_in_place_and_the_step_trains_then_undo_restores():
    model = _mx_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 64, dtype=torch.bfloat16)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    wrapped = [m.router.weight for m in model]
    try:
        step()
        raise AssertionError("the step did not raise")
    except AssertionError as exc:
        assert "must be divisible by block_size 32" in str(exc)
        report = explain(exc, exc.__traceback__, namespace={"model": model, "opt": opt, "x": x})
    fix = next(fx for fx in report.cause.fixes if fx.changes)
    assert fix.title.startswith("Take model.0.router, model.1.router out of the low-precision recipe")
    fix.apply(confirm=True)
    plain = [m.router.weight for m in model]
    assert all(type(p) is torch.nn.Parameter for p in plain)
    held = [p for g in opt.param_groups for p in g["params"]]
    assert all(any(p is h for h in held) for p in plain) and not any(any(w is h for h in held) for w in wrapped)
    params = list(model.parameters())
    start = snapshot(params)
    assert_step_trains(step(), start, params)  # the user's own step, on the live objects
    fix.undo()
    assert all(m.router.weight is w for m, w in zip(model, wrapped))
    held = [p for g in opt.param_groups for p in g["params"]]
    assert all(any(w is h for h in held) for w in wrapped)
