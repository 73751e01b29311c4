"""Watching the loss a model produces: the forward hook that sees each loss, the first non-finite one and the inputs that produced it."""

from __future__ import annotations

import math
from typing import Any

import torch

#: The positional and keyword arguments of one forward call.
Inputs = tuple[tuple, dict]


def loss_of(output: Any) -> torch.Tensor | None:
    """The scalar loss in a forward's output (``output.loss``, ``output["loss"]`` or a 0-d first element)."""
    if isinstance(output, torch.Tensor):
        return output if output.numel() == 1 and output.dim() == 0 else None
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if loss is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        loss = output[0] if output[0].dim() == 0 else None
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


class LossWatcher:
    """Keep a model's latest inputs and losses; find the first non-finite loss; probe its batch.

    Attributes
    ----------
    latest : (args, kwargs) or None
        The inputs of the latest training forward.
    probing : bool
        True while a probe runs (its own forwards are not recorded).
    """

    def __init__(self) -> None:
        self.latest: Inputs | None = None
        self.probing = False
        self._pending: list[tuple[torch.Tensor, Inputs | None]] = []
        self._handles: list[Any] = []

    def attach(self, model: torch.nn.Module) -> None:
        """Hook ``model``'s forward: keep its inputs, and its loss when the output carries one."""
        self._handles.append(model.register_forward_hook(self._on_forward, with_kwargs=True))

    def _watching(self, module: torch.nn.Module) -> bool:
        return not self.probing and module.training and torch.is_grad_enabled()

    def _on_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._watching(module):
            self.latest = (args, kwargs)
            loss = loss_of(output)
            if loss is not None:
                self._pending.append((loss.detach(), self.latest))

    def observe(self, loss: torch.Tensor) -> None:
        """Record a loss computed outside the model (``criterion(model(x), y)``) with the latest inputs."""
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._pending.append((loss.detach(), self.latest))

    def take_nonfinite(self) -> tuple[float, Inputs | None] | None:
        """Empty the recorded losses; the first non-finite one (value, inputs), or None. One transfer."""
        pending, self._pending = self._pending, []
        if not pending:
            return None
        values = torch.stack([loss.float().reshape(()) for loss, _ in pending]).tolist()
        for value, (_, inputs) in zip(values, pending):
            if not math.isfinite(value):
                return value, inputs
        return None

    def close(self) -> None:
        """Remove every hook; forget the inputs and losses."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pending.clear()
        self.latest = None
