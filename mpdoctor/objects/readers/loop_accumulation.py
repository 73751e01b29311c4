"""Gradient accumulation done by the user's own loop, as a setting of the optimizer it steps.

A hand-written loop (``loss.backward()`` every micro-batch, ``optimizer.step()`` under ``if (i + 1) % 4 == 0``)
sets its accumulation in no training object: the loop reader finds it in the cells that ran and ``watch()`` counts
``backward()`` calls per optimizer step. Both record it here against the optimizer, weakly (the record dies with
the optimizer), and every gathering of that optimizer reads it as an :class:`~mpdoctor.facts.between.Accumulation`
named ``loop``, so the accumulation checks see it as they see ``TrainingArguments.gradient_accumulation_steps``.
"""

from __future__ import annotations

import ast
import dataclasses
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...facts.between import Accumulation, BetweenFacts
from ..live.introspect import mro_paths, raw_attr
from .between import read_grad_replay
from .loop_source import Source, dotted

#: ``id(optimizer) -> (weak reference to it, the loop's accumulation, counted)``; an entry leaves with its
#: optimizer. ``counted``: the steps were counted on the running loop (``watch()``, ``mpdoctor run``), not read
#: from its code.
_LOOPS: dict[int, tuple[weakref.ref, Accumulation, bool]] = {}


def record(optimizer: Any, steps: int, setting: str, counted: bool = False) -> None:
    """Record that the user's loop steps ``optimizer`` once every ``steps`` ``backward()`` calls.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The optimizer the loop steps (a wrapper's inner optimizer is looked up as well when gathering).
    steps : int
        ``backward()`` calls per optimizer step; 1 (no accumulation) removes the record.
    setting : str
        Where it was read, for the finding (``optimizer.step() every 4 backward() calls (cell [3], line 5)``).
    counted : bool
        Counted on the running loop. What the loop really did outranks a reading of its code: a reading never
        replaces a counted record (the code may compute its guard in a way the reading does not follow).
    """
    key = id(optimizer)
    entry = _LOOPS.get(key)
    if not counted and entry is not None and entry[2] and entry[0]() is optimizer:
        return
    if steps <= 1:
        _LOOPS.pop(key, None)
        return
    try:
        ref = weakref.ref(optimizer, lambda _, key=key: _LOOPS.pop(key, None))
    except TypeError:  # an object that cannot be referenced weakly is not an optimizer a loop steps
        return
    _LOOPS[key] = (ref, Accumulation("loop", setting, steps), counted)


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
        What :func:`~mpdoctor.objects.readers.between.read_between` read from the training objects.
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


# -- read from the loop's code (never run) ----------------------------------------------------------------------

_OPTIMIZER = "torch.optim.optimizer.Optimizer"


@dataclass(frozen=True)
class LoopAccumulation:
    """An optimizer's step inside a loop, with the micro-batches its guard lets through per step.

    Attributes
    ----------
    optimizer : str
        The name the loop steps it by (``optimizer``).
    steps : int
        ``backward()`` calls per ``optimizer.step()``: the guard's divisor, 1 with no guard.
    where : str
        The step's line as the user reads it (``cell [3], line 5``).
    """

    optimizer: str
    steps: int
    where: str

    @property
    def setting(self) -> str:
        """``optimizer.step() every 4 backward() calls (cell [3], line 5)``."""
        return f"{self.optimizer}.step() every {self.steps} backward() calls ({self.where})"


def _divisor(test: ast.AST, namespace: Mapping[str, Any]) -> int | None:
    # ``(i + 1) % N == 0`` / ``step % N == 0``: N as a literal, an int the namespace holds, or an int attribute of an
    # object it holds (``args.gradient_accumulation_steps`` from argparse; read from the instance dict, no code run).
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return None
    left, right = test.left, test.comparators[0]
    mod = left if isinstance(left, ast.BinOp) else right
    zero = right if mod is left else left
    if not (isinstance(mod, ast.BinOp) and isinstance(mod.op, ast.Mod) and isinstance(zero, ast.Constant) and zero.value == 0):
        return None
    n = mod.right
    if isinstance(n, ast.Constant):
        value = n.value
    elif isinstance(n, ast.Name):
        value = namespace.get(n.id) if type(namespace) is dict else None
    elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and type(namespace) is dict:
        holder = namespace.get(n.value.id)
        value = raw_attr(holder, n.attr) if holder is not None else None
    else:
        return None
    return value if type(value) is int and value > 0 else None


def _calls(nodes: Sequence[ast.stmt], attr: str) -> Iterator[ast.Call]:
    for stmt in nodes:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr:
                yield node


def _calls_backward(loop: ast.For | ast.While) -> bool:
    return any(True for _ in _calls(loop.body, "backward"))


def _steps_in(loop: ast.For | ast.While, source: Source, namespace: Mapping[str, Any]) -> Iterator[LoopAccumulation]:
    if not _calls_backward(loop):
        return
    guarded: set[int] = set()
    for node in (n for stmt in loop.body for n in ast.walk(stmt)):
        if isinstance(node, ast.If):
            n = _divisor(node.test, namespace)
            for call in _calls(node.body, "step"):
                guarded.add(id(call))
                name = dotted(call.func.value)
                if name and n is not None:
                    yield LoopAccumulation(name, n, str(source.location(call.lineno)))
    for call in _calls(loop.body, "step"):
        name = dotted(call.func.value)
        if id(call) not in guarded and name and not call.args and not call.keywords:
            yield LoopAccumulation(name, 1, str(source.location(call.lineno)))  # stepped every micro-batch


def read_loop_accumulations(sources: Sequence[Source], namespace: Mapping[str, Any]) -> dict[str, LoopAccumulation]:
    """``optimizer name -> LoopAccumulation`` of the latest loop in ``sources`` that steps it after ``backward()``.

    Parameters
    ----------
    sources : sequence of Source
        The cells that ran (in execution order) or a script.
    namespace : mapping
        The user's namespace, where a guard's divisor given by name (``accum_steps``) is read.
    """
    out: dict[str, LoopAccumulation] = {}
    for source in sources:
        for node in _backward_loops(source.tree):
            for found in _steps_in(node, source, namespace):
                out[found.optimizer] = found  # the later loop is the one the user runs now
    return out


#: ``id(tree) -> (tree, its loops that call backward())``: a script is parsed once per process
#: (``loop_source.parse``), and every ``diagnose()`` it runs would walk the whole tree again for them.
_LOOPS: dict[int, tuple[ast.Module, tuple[ast.For | ast.While, ...]]] = {}


def _backward_loops(tree: ast.Module) -> tuple[ast.For | ast.While, ...]:
    """The ``for`` and ``while`` loops of ``tree`` whose body calls ``backward()``, in ``ast.walk`` order (the tree is
    held, so its id is not reused)."""
    hit = _LOOPS.get(id(tree))
    if hit is None or hit[0] is not tree:
        if len(_LOOPS) >= 4096:
            _LOOPS.clear()
        loops = (n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While)))
        hit = _LOOPS[id(tree)] = (tree, tuple(n for n in loops if _calls_backward(n)))
    return hit[1]


def record_loop_accumulations(sources: Sequence[Source], namespace: Mapping[str, Any]) -> list[LoopAccumulation]:
    """Record each optimizer the namespace holds by a name its loop steps, with that loop's accumulation.

    Returns the accumulations recorded (a loop with no guard clears an earlier record of its optimizer).
    """
    out = []
    for name, found in read_loop_accumulations(sources, namespace).items():
        obj = namespace.get(name) if type(namespace) is dict else None
        if obj is not None and _OPTIMIZER in mro_paths(obj):
            record(obj, found.steps, found.setting)
            out.append(found)
    return out


def record_script_loops(frame: Any) -> list[LoopAccumulation]:
    """Read the script a plain ``python train.py`` runs for its hand-written accumulation loops, and record them.

    ``frame`` is the user's frame (the code that called ``diagnose()``): its file and the ``__main__`` script are
    read (an ``import``-ed helper that calls ``diagnose()`` is not where the loop usually is), with the frame's
    globals and locals as the namespace the guard's divisor and the optimizer's name are looked up in. Never
    raises; reads nothing in IPython, where the session reads the cells (:mod:`mpdoctor.attach.runtime.session`), and
    never replaces an accumulation counted on the running loop.
    """
    import builtins
    import os
    import sys

    from .loop_source import source_of

    try:
        if getattr(builtins, "__IPYTHON__", False) or frame is None:
            return []
        main = getattr(sys.modules.get("__main__"), "__file__", None)
        paths = list(dict.fromkeys(p for p in (frame.f_code.co_filename, main) if isinstance(p, str) and p.endswith(".py")))
        sources = []
        for path in paths:
            if os.path.isfile(path) and os.path.getsize(path) < 2_000_000:
                with open(path, encoding="utf-8") as f:
                    source = source_of(path, f.read())
                if source is not None:
                    sources.append(source)
        if not sources:
            return []
        namespace = {**dict(frame.f_globals), **dict(frame.f_locals)}
        return record_loop_accumulations(sources, namespace)
    except Exception:  # the report of the objects stands without the loop's setting
        return []
