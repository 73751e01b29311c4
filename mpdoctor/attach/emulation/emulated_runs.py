"""The runs behind :func:`mpdoctor.compare` and ``Comparison.plan()``: one model on one batch, again and again
from the same start.

A :class:`Runner` holds the live model, its batch on the model's device and a
:class:`~mpdoctor.attach.numerics.harness.Snapshot` of everything a run can change. Each run starts from the same
RNG state and running statistics (the same dropout masks and batch norm in every precision), writes fresh
``.grad`` (never into the user's) and, on leaving the runner, the model is exactly as it was: weights,
buffers, ``.grad``, RNG, train/eval flags; the emulation's process-wide hooks come off after each forward,
also when it raises.

- :meth:`Runner.measure`: the reference and each precision, measured per layer (``compare()``).
- :meth:`Runner.loss_and_grads`: one mixed model (a precision per Linear), its loss and parameter
  gradients, nothing measured (a plan's verification).
- :meth:`Runner.train`: N optimizer steps of one emulated model on the user's batches, the loss of each;
  a copy of the model trains, never the user's.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..numerics.harness import Snapshot, first_line, model_device, run_loss, to_device
from .formats import Precision
from .matmuls import LayerStats
from .sites import Emulation, linears

#: A mixed model: Linear path -> its precision (None: as the model runs it); the other Linears take the default.
Assignment = Mapping[str, "Precision | None"]


@dataclass
class Runs:
    """What :meth:`Runner.measure` saw: losses, per-run statistics, call order, what raised."""

    losses: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    stats: dict[str, dict[str, LayerStats]] = field(default_factory=dict)
    attention: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: Linears and attention matmuls in the order the reference run met them (empty for a plain reference).
    order: list[str] = field(default_factory=list)
    backward: bool = True
    #: Why the reference run failed (nothing else ran).
    error: str | None = None

    def called(self, weights: Mapping[int, tuple[str, torch.Tensor]]) -> list[str]:
        """Every site some run reached, in call order (Linears and attention matmuls interleaved)."""
        seen = list(dict.fromkeys([*self.order, *(k for s in self.stats.values() for k in s)]))
        return [p for p in seen if any(p in s for s in self.stats.values())] or self.order or [p for p, _ in weights.values()]


class Runner:
    """Runs of one model on one batch from the same start; a context manager that restores the model on exit.

    Parameters
    ----------
    model : torch.nn.Module
        The live model (never copied).
    batch : Any
        As :func:`mpdoctor.probe` takes it; moved to the model's device (a copy of the batch only).
    loss_fn : callable, optional
        ``output -> scalar loss`` (default: ``output.loss``, else the first floating output's mean).
    training : bool
        Runs in train mode (the modes are restored on exit).
    """

    def __init__(self, model: torch.nn.Module, batch: Any, loss_fn: Callable | None = None, training: bool = True) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.training = training
        self.weights = linears(model)
        self.modules = {id(m): (path or "(model)", m) for path, m in model.named_modules()}
        self.device = model_device(model)
        first = next(model.parameters(), None)
        self.dtype = first.dtype if first is not None else torch.float32
        self.snapshot = Snapshot(model, batch)
        self.batch = to_device(batch, self.device)

    def __enter__(self) -> Runner:
        self.model.train(self.training)
        return self

    def __exit__(self, *exc: object) -> None:
        self.snapshot.restore()

    def emulation(self, prec: Precision, *, layers: Assignment | None = None, attention: bool = True,
                  measure: bool = True) -> Emulation:  # fmt: skip
        """A mode for one run of this model (see :class:`~mpdoctor.attach.emulation.sites.Emulation`)."""
        return Emulation(self.weights, prec, self.modules, layers=layers, attention=attention, measure=measure)

    def run(self, mode: Emulation | None, batch: Any = None, backward: bool = True) -> float:
        """One forward and backward from the start (the same RNG and running statistics); fresh grads left on
        the parameters for the caller to read. Raises what the model raises."""
        self.snapshot.clear_grads()
        self.snapshot.rewind()
        around = mode.engaged() if mode is not None else None
        return run_loss(self.model, self.batch if batch is None else batch, self.loss_fn, around, backward)

    # -- compare(): every precision, measured ----------------------------------------------------

    def measure(self, reference: Precision, precisions: Sequence[Precision]) -> Runs:
        """The reference run, then one measured run per precision; a run that raises is named, never raised."""
        runs = Runs()
        # The reference in the model's own dtype needs no emulation: the unmodified model.
        plain = reference.kind == "reference" and self.dtype == torch.float32
        mode = None if plain else self.emulation(reference)
        try:
            runs.losses[reference.name] = self.run(mode)
        except Exception as exc:  # the model's error becomes the comparison's message, never a traceback
            runs.error = f"the model rejected the batch in the {reference.name} reference run: {_message(exc)}"
            return runs
        finally:
            self.snapshot.clear_grads()
        runs.backward = self.snapshot.trains
        if mode is not None:
            runs.order = list(mode.stats)
            runs.attention.update(mode.attention)
        for prec in precisions:
            mode = self.emulation(prec)
            try:
                runs.losses[prec.name] = self.run(mode)
            except Exception as exc:
                runs.errors[prec.name] = _message(exc)
                runs.losses[prec.name] = math.nan
                continue
            finally:
                self.snapshot.clear_grads()
            runs.stats[prec.name] = mode.stats
            runs.attention.update(mode.attention)
        return runs

    # -- plan(): a mixed model, verified ---------------------------------------------------------

    def loss_and_grads(self, default: Precision | None, layers: Assignment | None = None) -> tuple[float, list[torch.Tensor | None]]:
        """The loss and parameter gradients of the model with each Linear in its assigned precision
        (``default`` for the unassigned; None: the model as it is, the reference). Attention is left as the
        model runs it, as torchao's recipes leave it; nothing is measured."""
        mode = None if default is None else self.emulation(default, layers=layers, attention=False, measure=False)
        try:
            loss = self.run(mode)
            return loss, [p.grad for p in self.snapshot.params]
        finally:
            self.snapshot.clear_grads()

    # -- compare(steps=N): training curves -------------------------------------------------------

    def train(self, prec: Precision | None, steps: int, batches: Iterable[Any] | None,
              optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]) -> list[float]:  # fmt: skip
        """``steps`` optimizer steps under ``prec`` (None: the model as it is) from the model's weights, on
        ``batches`` (cycled; the runner's batch when None); the loss of each step.

        The steps train a copy of the model (``copy.deepcopy``): the user's parameters are never written,
        not even their version counters; the RNG and statistics are put back after, also when a step raises.
        """
        self.snapshot.rewind()  # the statistics the single-step runs started from, copied with the model
        twin = copy.deepcopy(self.model)
        runner = Runner(twin, self.batch, self.loss_fn, self.training)
        # From the RNG state the single-step runs started from: step 1 draws their dropout masks.
        runner.snapshot.cpu_rng, runner.snapshot.cuda_rng = self.snapshot.cpu_rng, self.snapshot.cuda_rng
        feed = _cycle(batches, runner.batch, self.device)
        opt = optimizer([p for p in twin.parameters() if p.requires_grad])
        losses: list[float] = []
        with runner:
            runner.snapshot.rewind()
            for _ in range(steps):
                mode = None if prec is None else runner.emulation(prec, measure=False)
                losses.append(run_loss(twin, next(feed), self.loss_fn, mode.engaged() if mode is not None else None))
                opt.step()
                opt.zero_grad(set_to_none=True)
                if not math.isfinite(losses[-1]):
                    break  # a diverged run: its curve ends here
        return losses


def _cycle(batches: Iterable[Any] | None, default: Any, device: torch.device) -> Any:
    """The user's batches on the model's device, round and round (only the one batch when none are given)."""
    items = [default] if batches is None else [to_device(b, device) for b in batches]
    if not items:
        raise ValueError("batches is empty: give at least one batch")
    while True:
        yield from items


def _message(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {first_line(exc)}"
