"""The forward / backward harness the probe and ``compare()`` share: one run of the user's model on their batch.

- :func:`call_model`: a batch as the model takes it (keyword arguments, one tensor, positional
  arguments or a :class:`~mpdoctor.attach.numerics.probe_facts.ForwardCall`).
- :func:`loss_of`: the loss of an output (``loss_fn``, ``output.loss``, else the mean of the first
  floating tensor).
- :func:`to_device`: a copy of the batch on the model's device (never a copy of the model).
- :class:`Snapshot`: what a forward + backward can change (``.grad`` of every parameter and batch leaf,
  RNG states, train/eval flags, normalisation running statistics), rewound before each run and
  restored exactly after, also when the run raises.
- :func:`run_loss`: one forward, the loss and (optionally) its backward inside a context (hooks,
  modes) that is entered and left around the forward, so what it attaches comes off even when the
  run raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import torch

from .probe_facts import ForwardCall

#: The batch types a run takes.
BATCH_TYPES = (Mapping, torch.Tensor, tuple, list, ForwardCall)
#: What a batch of another type is told.
BATCH_MESSAGE = "batch must be a dict of keyword arguments, a tensor or a tuple/list, not {}"


def floating_tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Floating, strided, non-empty tensors in a module's inputs or outputs (tuples, lists, dicts, ModelOutputs)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.numel() > 0 and value.layout == torch.strided and not value.is_meta:
            yield value
    elif depth < 3 and isinstance(value, (tuple, list)):
        for v in value:
            yield from floating_tensors(v, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for v in value.values():
            yield from floating_tensors(v, depth + 1)


def floating_list(value: Any) -> list[torch.Tensor]:
    """:func:`floating_tensors` as a list, without a generator per container: what a hook running on every
    module's every call uses (a lone tensor or a tuple of tensors is the common case)."""
    out: list[torch.Tensor] = []
    _collect(value, 0, out)
    return out


def _collect(value: Any, depth: int, out: list[torch.Tensor]) -> None:
    # The same walk and order as floating_tensors (three containers deep), appending instead of yielding.
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.numel() > 0 and value.layout == torch.strided and not value.is_meta:
            out.append(value)
    elif depth < 3 and isinstance(value, (tuple, list)):
        for v in value:
            _collect(v, depth + 1, out)
    elif depth < 3 and isinstance(value, dict):
        for v in value.values():
            _collect(v, depth + 1, out)


def all_tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor of a batch (a ForwardCall's arguments included), three containers deep."""
    if isinstance(value, ForwardCall):
        yield from all_tensors((value.args, value.kwargs), depth)
    elif isinstance(value, torch.Tensor):
        yield value
    elif depth < 3 and isinstance(value, (tuple, list)):
        for v in value:
            yield from all_tensors(v, depth + 1)
    elif depth < 3 and isinstance(value, Mapping):
        for v in value.values():
            yield from all_tensors(v, depth + 1)


def to_device(value: Any, device: torch.device) -> Any:
    """The batch on the model's device (a DataLoader yields CPU tensors; the Trainer moves them the same way)."""
    if isinstance(value, ForwardCall):
        return ForwardCall.of(to_device(value.args, device), to_device(value.kwargs, device))
    if isinstance(value, torch.Tensor):
        return value if value.device == device or value.device.type == "meta" else value.to(device)
    if isinstance(value, Mapping):
        return {k: to_device(v, device) for k, v in value.items()}
    if type(value) in (tuple, list):
        return type(value)(to_device(v, device) for v in value)
    return value


def call_model(model: torch.nn.Module, batch: Any) -> Any:
    """``model`` called on ``batch`` as a DataLoader's batch is passed: ``**dict``, one tensor, ``*tuple``."""
    if isinstance(batch, ForwardCall):
        return model(*batch.args, **batch.kwargs)
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    raise TypeError(BATCH_MESSAGE.format(type(batch).__name__))


def loss_of(output: Any, loss_fn: Callable | None) -> torch.Tensor:
    """The scalar loss of ``output``: ``loss_fn(output)``, else ``output.loss``, else the first floating tensor's mean."""
    if loss_fn is not None:
        return loss_fn(output)
    loss = None
    if isinstance(output, dict):
        loss = output.get("loss")
    elif not isinstance(output, torch.Tensor):
        loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    first = next(floating_tensors(output), None)
    if first is None:
        raise TypeError(f"no loss: the model returned {type(output).__name__} without a floating tensor")
    return first.float().mean()


def first_line(exc: BaseException) -> str:
    """An exception's first line (at most 500 characters), for a message that is never a traceback."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (the CPU for a model without one)."""
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


class Snapshot:
    """The state a forward + backward could change, rewound by :meth:`rewind` and restored exactly by :meth:`restore`."""

    def __init__(self, model: torch.nn.Module, batch: Any) -> None:
        self.modes = [(m, m.training) for m in model.modules()]
        self.params = list(dict.fromkeys(model.parameters()))  # each once, in order
        self.grads = [p.grad for p in self.params]
        self.leaves = [t for t in all_tensors(batch) if t.requires_grad and t.is_leaf]
        self.leaf_grads = [t.grad for t in self.leaves]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        # BatchNorm-style running statistics move on every training forward.
        self.running = [
            (b, b.detach().clone())
            for m in model.modules()
            if isinstance(m, torch.nn.modules.batchnorm._NormBase)
            for b in m.buffers(recurse=False)
        ]

    @property
    def trains(self) -> bool:
        """Whether a backward has anything to reach: a parameter or a batch leaf that requires grad."""
        return any(p.requires_grad for p in self.params) or bool(self.leaves)

    def clear_grads(self) -> None:
        """Let backward write fresh grads instead of accumulating into the user's."""
        for p in self.params:
            p.grad = None
        for t in self.leaves:
            t.grad = None

    def rewind(self) -> None:
        """RNG states and running statistics as they were: the next run draws the same dropout masks."""
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        with torch.no_grad():
            for b, saved in self.running:
                b.copy_(saved)

    def restore(self) -> None:
        """Everything as it was when the snapshot was taken (grads by identity, modes, RNG, running statistics)."""
        for p, g in zip(self.params, self.grads):
            p.grad = g
        for t, g in zip(self.leaves, self.leaf_grads):
            t.grad = g
        for m, flag in self.modes:
            m.training = flag
        self.rewind()


def run_loss(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: Callable | None = None,
    around: contextlib.AbstractContextManager | None = None,
    backward: bool = True,
) -> float:
    """One forward under ``around`` (entered for the forward and the loss only, left also when they raise),
    then the backward of the loss when ``backward`` and the loss requires grad. Returns the loss as a float;
    the caller clears and restores the grads (:class:`Snapshot`)."""
    with torch.enable_grad():
        with around if around is not None else contextlib.nullcontext():
            output = call_model(model, batch)
            loss = loss_of(output, loss_fn)
        del output
        value = float(loss.detach().float())
        if backward and loss.requires_grad:
            loss.backward()
    return value
