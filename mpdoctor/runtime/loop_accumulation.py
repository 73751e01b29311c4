"""The gradient accumulation of a hand-written loop, read from its code (never run).

A loop that calls ``loss.backward()`` every micro-batch and ``optimizer.step()`` only under a modulo guard
(``if (i + 1) % accum_steps == 0:``) sums ``accum_steps`` gradients into ``.grad`` before each step. The number is
the guard's divisor: a literal, or a name the namespace holds as an int. What is read is recorded against the
optimizer (:mod:`mpdoctor.readers.loop_accumulation`), where the accumulation checks find it as a setting.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..live.introspect import mro_paths
from ..readers.loop_accumulation import record
from .loop_source import Source, dotted

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
    # ``(i + 1) % N == 0`` / ``step % N == 0``: N as a literal or as an int the namespace holds.
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
    else:
        return None
    return value if type(value) is int and value > 0 else None


def _calls(nodes: Sequence[ast.stmt], attr: str) -> Iterator[ast.Call]:
    for stmt in nodes:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr:
                yield node


def _steps_in(loop: ast.For | ast.While, source: Source, namespace: Mapping[str, Any]) -> Iterator[LoopAccumulation]:
    if not any(True for _ in _calls(loop.body, "backward")):
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
        for node in ast.walk(source.tree):
            if isinstance(node, (ast.For, ast.While)):
                for found in _steps_in(node, source, namespace):
                    out[found.optimizer] = found  # the later loop is the one the user runs now
    return out


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


def record_cells(shell: Any) -> list[LoopAccumulation]:
    """Read the cells ``shell`` has run for hand-written accumulation loops and record them (never run).

    Parameters
    ----------
    shell : IPython.core.interactiveshell.InteractiveShell
        The running shell: its history and its namespace.
    """
    from .history import cell_sources

    try:
        return record_loop_accumulations(cell_sources(shell), shell.user_ns)
    except Exception:  # a history that cannot be read: the report of the objects stands without the loop's setting
        return []
