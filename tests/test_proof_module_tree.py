"""A step that changes the model's module tree (an adapter injected in a layer's place, an attribute added) and
trains only what it created: the proof judges it by the parameters it made, and puts the tree back after each run.

PEFT's ``add_adapter`` / ``inject_adapter_in_model`` swap each targeted layer for an adapter layer that wraps it,
add ``peft_config`` to the model and train only the adapter's new parameters. Here the same mechanism in plain torch.
"""

from __future__ import annotations

import torch

import mpdoctor


class _Adapted(torch.nn.Module):
    """A layer wrapped with a trainable low-rank delta, as an adapter layer wraps its base layer."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base_layer = base
        self.down = torch.nn.Linear(base.in_features, 2, bias=False)
        self.up = torch.nn.Linear(2, base.out_features, bias=False)
        torch.nn.init.zeros_(self.up.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.up(self.down(x))


def _frozen_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model.requires_grad_(False)


def _adapter_step(model: torch.nn.Sequential, x: torch.Tensor, lr: float = 1e-2) -> torch.Tensor:
    """Inject the adapter, train what it made: the step creates the only parameters that train."""
    model[0] = _Adapted(model[0])
    vars(model)["adapter_config"] = {"rank": 2}  # an attribute the injection adds, as PEFT's peft_config
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss


def test_a_step_that_injects_an_adapter_is_judged_by_what_it_made_and_leaves_the_tree_as_it_was():
    model, x = _frozen_model(), torch.randn(4, 8)
    children, attrs, base = dict(model._modules), set(model.__dict__), model[0]
    report = mpdoctor.diagnose(model, step=lambda: _adapter_step(model, x))
    assert report.proof.before.ran and report.proof.before.trained, report.proof.before
    assert dict(model._modules) == children and model[0] is base and set(model.__dict__) == attrs
    assert not any(p.requires_grad for p in model.parameters())


def test_a_step_whose_new_parameters_never_move_did_not_train():
    """An optimizer step with a zero learning rate moves nothing it made: not trained."""
    model, x = _frozen_model(), torch.randn(4, 8)
    report = mpdoctor.diagnose(model, step=lambda: _adapter_step(model, x, lr=0.0))
    assert report.proof.before.ran and not report.proof.before.trained
    assert report.proof.before.why == "no optimizer step moved the parameters the step made trainable"
