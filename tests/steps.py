"""What "a training step works" means in these tests: a finite loss AND parameters that actually changed.

A step that an AMP scaler skipped, an optimizer that holds no parameter, or a fix that froze the model all
leave the parameters as they were: ``assert_step_trains`` fails on each.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable

import torch


def snapshot(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Detached fp32 copies of the trainable parameters (the ones a step must move)."""
    return [p.detach().float().clone() for p in params if p.requires_grad]


def moved(before: list[torch.Tensor], params: Iterable[torch.Tensor]) -> int:
    """How many of the parameters in ``before`` hold other values now."""
    now = [p for p in params if p.requires_grad]
    assert len(now) == len(before) > 0, f"{len(before)} parameters snapshotted, {len(now)} trainable now"
    return sum(not torch.equal(b, p.detach().float()) for b, p in zip(before, now))


def step_trains(loss: Any, before: list[torch.Tensor], params: Iterable[torch.Tensor]) -> dict:
    """``{"loss_finite": ..., "moved": n}`` of one step (JSON-able, for workers on other ranks)."""
    value = loss.detach().float() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
    return {"loss_finite": bool(torch.isfinite(value).all()), "moved": moved(before, params)}


def assert_step_trains(loss: Any, before: list[torch.Tensor], params: Iterable[torch.Tensor]) -> None:
    """Fail unless the step's loss is finite and at least one parameter changed."""
    got = step_trains(loss, before, params)
    assert got["loss_finite"], f"loss is not finite: {loss}"
    assert got["moved"] > 0, "the step changed no parameter (skipped step, frozen model or empty optimizer)"


def run_step(step: Callable[[], Any], params: Iterable[torch.Tensor]) -> Any:
    """Run ``step()`` (forward, backward, optimizer step; returns the loss) and assert that it trained."""
    params = list(params)
    before = snapshot(params)
    loss = step()
    assert_step_trains(loss, before, params)
    return loss


def trained_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any) -> float:
    """``setups.train_step(model, optimizer, **kwargs)`` that must train: finite loss, the optimizer's parameters moved."""
    from setups import train_step

    params = [p for group in optimizer.param_groups for p in group["params"]]
    before = snapshot(params)
    loss = train_step(model, optimizer, **kwargs)
    assert_step_trains(loss, before, params)
    return loss
