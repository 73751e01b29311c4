"""Gradient accumulation done by the user's own loop, as a setting of the optimizer it steps.

A hand-written loop (``loss.backward()`` every micro-batch, ``optimizer.step()`` under ``if (i + 1) % 4 == 0``)
sets its accumulation in no training object: the loop reader finds it in the cells that ran and ``watch()`` counts
``backward()`` calls per optimizer step. Both record it here against the optimizer, weakly (the record dies with
the optimizer), and every gathering of that optimizer reads it as an :class:`~mpdoctor.facts.between.Accumulation`
named ``loop``, so the accumulation checks see it as they see ``TrainingArguments.gradient_accumulation_steps``.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable
from typing import Any

from ..facts.between import Accumulation, BetweenFacts
from .between import read_grad_replay

#: ``id(optimizer) -> (weak reference to it, the loop's accumulation)``; an entry leaves with its optimizer.
_LOOPS: dict[int, tuple[weakref.ref, Accumulation]] = {}


def record(optimizer: Any, steps: int, setting: str) -> None:
    """Record that the user's loop steps ``optimizer`` once every ``steps`` ``backward()`` calls.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The optimizer the loop steps (a wrapper's inner optimizer is looked up as well when gathering).
    steps : int
        ``backward()`` calls per optimizer step; 1 (no accumulation) removes the record.
    setting : str
        Where it was read, for the finding (``optimizer.step() every 4 backward() calls (cell [3], line 5)``).
    """
    key = id(optimizer)
    if steps <= 1:
        _LOOPS.pop(key, None)
        return
    try:
        ref = weakref.ref(optimizer, lambda _, key=key: _LOOPS.pop(key, None))
    except TypeError:  # an object that cannot be referenced weakly is not an optimizer a loop steps
        return
    _LOOPS[key] = (ref, Accumulation("loop", setting, steps))


def recorded(optimizer: Any) -> Accumulation | None:
    """The loop accumulation recorded for ``optimizer``, or None."""
    entry = _LOOPS.get(id(optimizer))
    if entry is None or entry[0]() is not optimizer:  # an id reused by another object after the first died
        return None
    return entry[1]


def with_loop_accumulations(between: BetweenFacts, subjects: Iterable[Any]) -> BetweenFacts:
    """``between`` with the loop accumulation of each optimizer subject, and the models' grad replays over it.

    Parameters
    ----------
    between : BetweenFacts
        What :func:`~mpdoctor.readers.between.read_between` read from the training objects.
    subjects : iterable of Subject
        The gathered subjects (``name``, ``kind``, ``obj``, ``inner``).
    """
    subjects = tuple(subjects)
    found = [
        acc
        for s in subjects
        if s.kind == "optimizer"
        for acc in {id(a): a for a in (recorded(s.obj), recorded(s.inner)) if a is not None}.values()
    ]
    if not found:
        return between
    accumulations = tuple(between.accumulations) + tuple(found)
    steps = max(a.steps for a in accumulations)
    if steps == max((a.steps for a in between.accumulations), default=1):
        return dataclasses.replace(between, accumulations=accumulations)  # its replays already sum this many
    replays = [read_grad_replay(s.name, s.obj, steps) for s in subjects if s.kind == "model"]
    return dataclasses.replace(
        between, accumulations=accumulations, grad_replays=tuple(r for r in replays if r is not None)
    )
