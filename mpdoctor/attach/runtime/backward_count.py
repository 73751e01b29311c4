"""Gradient accumulation counted on a running script: ``backward()`` calls per optimizer step.

``mpdoctor run train.py`` runs code it did not write and cannot read in full: a loop's guard may be
``if step % args.gradient_accumulation_steps == 0``, a config field, or a counter. :class:`BackwardCounter` counts
instead of reading. It wraps ``torch.autograd.backward`` (what ``loss.backward()``, ``scaler.scale(loss).backward()``,
``accelerator.backward(loss)`` and DeepSpeed's engine all end in) and registers torch's global optimizer step
pre-hook; at each real step it records the count against the optimizer
(:func:`mpdoctor.objects.readers.loop_accumulation.record`, ``counted=True``), where every later gathering of that optimizer
(the crash report, a ``diagnose()`` the script calls) finds it as the accumulation checks find
``TrainingArguments.gradient_accumulation_steps``.

What is not counted: a ``backward()`` inside another one (reentrant activation checkpointing runs one per
checkpointed segment), the steps mpdoctor itself runs to prove a fix (:func:`mpdoctor.diagnosis.proof.proving`),
and the ``backward()`` calls of a step a GradScaler skipped (they never reached an optimizer). :meth:`close` puts
``torch.autograd.backward`` back and removes the hook, even when the script raised.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import torch

from ...diagnosis.proof import is_proving
from ...objects.readers.loop_accumulation import record
from .protocol import name_in_user_frames, user_line


class BackwardCounter:
    """Counts the outermost ``backward()`` calls between two steps of any optimizer, for a whole process."""

    def __init__(self) -> None:
        self.backwards = 0
        self.recorded: list[tuple[str, int]] = []  # (optimizer name, backward() calls per step), as recorded
        self._depth = 0  # backward() calls in progress: a nested one (reentrant checkpointing) is not counted
        self._lock = threading.Lock()
        self._real: Callable[..., Any] | None = None
        self._wrapper: Callable[..., Any] | None = None
        self._handle: Any = None

    def attach(self) -> BackwardCounter:
        real = torch.autograd.backward
        counter = self

        @functools.wraps(real)
        def backward(*args: Any, **kwargs: Any) -> Any:
            with counter._lock:
                outermost = counter._depth == 0
                counter._depth += 1
                if outermost and not is_proving():
                    counter.backwards += 1
            try:
                return real(*args, **kwargs)
            finally:
                with counter._lock:
                    counter._depth -= 1

        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._handle = register_optimizer_step_pre_hook(self._before_step)  # first: a failure here wraps nothing
        self._real, self._wrapper = real, backward
        torch.autograd.backward = backward
        return self

    def close(self) -> None:
        """Remove the hook and put ``torch.autograd.backward`` back (unless someone wrapped it again since)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._wrapper is not None and torch.autograd.backward is self._wrapper:
            torch.autograd.backward = self._real
        self._wrapper = self._real = None

    def skipped(self) -> None:
        """A GradScaler skipped the step: its ``backward()`` calls reached no optimizer and are not accumulation."""
        self.backwards = 0

    def _before_step(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        if is_proving():
            return
        n, self.backwards = self.backwards, 0
        if n == 0:  # a second optimizer stepped after the same backward(), or a closure's step: nothing to say
            return
        try:
            name = name_in_user_frames(optimizer) or "optimizer"
            where = user_line(2)
            at = str(where) if where is not None else "the script"
            record(optimizer, n, f"{name}.step() every {n} backward() calls ({at}, counted)", counted=True)
            self.recorded.append((name, n))
        except Exception:  # the script runs whatever happens here
            return
