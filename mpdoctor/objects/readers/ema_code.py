"""A hand-written EMA read from the user's code: ``ema_p.lerp_(p, 1 - decay)`` or
``ema_p.mul_(decay).add_(p, alpha=1 - decay)`` over ``zip(ema.parameters(), model.parameters())``.

A deepcopy of a model updated by hand is a plain module: nothing in the object says it is an average (a DPO
reference model or a distillation teacher looks the same). The evidence is the update in the code the user ran:
a notebook's cells (IPython keeps them in the user namespace as ``In``, which ``sys.modules["__main__"]`` is)
or the script ``__main__`` runs, and the source file of a function that code calls from the user's own module
(``from ema_utils import update_ema``). The code is parsed, never run; names (``decay``) resolve to the values the
namespace holds or to a constant assigned in the code.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import os
import sys
import textwrap
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EmaUpdate:
    """One EMA update in the user's code: the shadow model's name, the online model's, the decay and the op.

    ``op`` is ``"lerp_"`` (``Tensor.lerp_`` takes one dtype: an fp32 shadow needs the online weight cast),
    ``"lerp_cast"`` (the online weight cast first: ``s.lerp_(p.float(), w)``) or ``"mul_add"`` (``mul_(d).add_(p, alpha=...)`` / ``copy_(d * s + w * p)``: promotes a bf16 weight into an fp32
    shadow). ``line`` is the statement as written, ``where`` the cell or file it is in.
    """

    target: str
    online: str
    decay: float | None
    op: str
    line: str
    where: str
    #: For a ``lerp_`` update: the user's code that holds it, runnable as it stands (the function that does the
    #: update, or a top-level loop, bare or under a ``with``), with the online weight cast (``p.float()``);
    #: None when the loop sits inside a larger one (a training loop: running it again would train).
    fixed: str | None = None


def user_code() -> tuple[list[tuple[str, str]], Mapping[str, Any]]:
    """``([(where, code)], namespace)`` of the code the user ran: a notebook's cells (``In``) or ``__main__``'s
    script. Read from ``sys.modules["__main__"]``'s dict; no IPython import, no user code run."""
    main = sys.modules.get("__main__")
    ns = getattr(main, "__dict__", None)
    if not isinstance(ns, dict):
        return [], {}
    cells = ns.get("In")
    if isinstance(cells, list):
        return [(f"cell [{i}]", c) for i, c in enumerate(cells) if isinstance(c, str) and c], ns
    path = ns.get("__file__")
    if isinstance(path, str) and path.endswith(".py"):
        try:
            with open(path, encoding="utf-8") as fh:
                return [(path, fh.read())], ns
        except (OSError, UnicodeDecodeError):
            return [], ns
    return [], ns


def ema_updates(code: Sequence[tuple[str, str]], namespace: Mapping[str, Any]) -> list[EmaUpdate]:
    """Every EMA update over a ``zip`` of two models' parameters, or over one model's ``named_parameters()``
    into a dict of shadow tensors, in ``code`` (top level or in a function the code calls with the names).

    Each text is parsed once per process (:func:`_parsed`): a notebook's cells are read again on every
    diagnosis, and only the names they bind are looked up anew."""
    parsed = [(where, tree) for where, text in code if (tree := _parsed(text)) is not None]
    constants: dict[str, float] = {}
    functions: dict[str, tuple[ast.FunctionDef, tuple[ast.For, ...]]] = {}
    for _, tree in parsed:
        constants.update(tree.constants)
        functions.update(tree.functions)
    out: list[EmaUpdate] = []
    for where, tree in parsed:
        for loop in tree.loops:
            out.extend(_updates_in(loop, where, {}, namespace, constants, tree.blocks.get(id(loop))))
        for call in tree.calls:
            name = call.func.id  # type: ignore[attr-defined]
            found = functions.get(name)
            called_where = where
            if found is None:  # a function imported from the user's own module (``from ema_utils import update_ema``)
                imported = _imported(namespace.get(name))
                if imported is None:
                    continue
                found, called_where = imported[:2], f"{imported[2]}, called in {where}"
            fn, loops = found
            bound = _bind(fn, call)
            for loop in loops:
                out.extend(_updates_in(loop, called_where, bound, namespace, constants, fn))
    # The update of a pair that ran last is the one in force: a cell run after another (a corrected train_step, an
    # edited loop) replaces it, while IPython keeps both texts in ``In``.
    latest = {(u.target, u.online): u for u in out if u.target.split('.')[0] in namespace and u.online.split('.')[0] in namespace}
    return list(latest.values())


#: The in-place ops every update form this module reads is written with (``lerp_``, ``mul_(...).add_(...)``).
_UPDATE_OPS = ("lerp_", "add_")


def _imported(fn: Any) -> tuple[ast.FunctionDef, tuple[ast.For, ...], str] | None:
    """``(def, its loops, "module.function (file.py:line)")`` of a plain Python function defined outside the
    notebook or script, read from its source file (never run); None for anything else, or when its source writes
    no update op."""
    if not isinstance(fn, types.FunctionType):
        return None
    try:
        fn = inspect.unwrap(fn)  # ``@torch.no_grad()`` wraps it in torch's own function (functools.wraps)
    except ValueError:  # a cycle of __wrapped__
        return None
    if not isinstance(fn, types.FunctionType) or fn.__module__ in (None, "__main__", "builtins"):
        return None
    return _imported_source(fn.__code__, f"{fn.__module__}.{fn.__qualname__}")


@functools.lru_cache(maxsize=256)
def _imported_source(code: types.CodeType, label: str) -> tuple[ast.FunctionDef, tuple[ast.For, ...], str] | None:
    try:
        source = textwrap.dedent(inspect.getsource(code))
    except (OSError, TypeError):  # no file holds it
        return None
    if not any(op in source for op in _UPDATE_OPS):
        return None
    tree = _parsed(source)
    fn = next((n for n in tree.functions.values()), None) if tree is not None else None
    if fn is None:
        return None
    where = f"{label} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
    return fn[0], fn[1], where


@dataclass(frozen=True)
class _Parsed:
    """What :func:`ema_updates` needs of one text: its ``for`` loops, its calls of a plain name, the functions it
    defines (with the loops inside each) and the numeric constants it assigns."""

    loops: tuple[ast.For, ...]
    calls: tuple[ast.Call, ...]
    functions: dict[str, tuple[ast.FunctionDef, tuple[ast.For, ...]]]
    constants: dict[str, float]
    #: ``id(loop) -> the top-level statement`` for a loop that is one, or sits directly in a top-level ``with``.
    blocks: dict[int, ast.stmt]


@functools.lru_cache(maxsize=2048)
def _parsed(text: str) -> _Parsed | None:
    """``text`` parsed and indexed once (the trees are only read, never changed); None when it is not Python
    (a cell of IPython syntax left untransformed: nothing to read in it)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    nodes = list(ast.walk(tree))
    return _Parsed(
        loops=tuple(n for n in nodes if isinstance(n, ast.For)),
        calls=tuple(n for n in nodes if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)),
        functions={
            n.name: (n, tuple(x for x in ast.walk(n) if isinstance(x, ast.For)))
            for n in nodes if isinstance(n, ast.FunctionDef)
        },
        constants=_constants(nodes),
        blocks={id(loop): stmt for stmt in tree.body for loop in _runnable_loops(stmt)},
    )


def _runnable_loops(stmt: ast.stmt) -> list[ast.For]:
    """The loops a top-level statement holds that can be shown whole and run again: the statement itself (a
    ``for``), those directly under a top-level ``with``, and every loop of a top-level function (run again, the
    ``def`` only defines it)."""
    if isinstance(stmt, ast.For):
        return [stmt]
    if isinstance(stmt, ast.With):
        return [n for n in stmt.body if isinstance(n, ast.For)]
    if isinstance(stmt, ast.FunctionDef):
        return [n for n in ast.walk(stmt) if isinstance(n, ast.For)]
    return []


def _constants(nodes: Iterable[ast.AST]) -> dict[str, float]:
    out: dict[str, float] = {}
    for node in nodes:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = _number(node.value, {}, {}, {})
            if value is not None:
                out[node.targets[0].id] = value
    return out


def _bind(fn: ast.FunctionDef, call: ast.Call) -> dict[str, ast.expr]:
    """The function's parameters bound to the call's arguments, defaults filling the rest."""
    params = [a.arg for a in fn.args.args]
    bound: dict[str, ast.expr] = dict(zip(params[len(params) - len(fn.args.defaults):], fn.args.defaults))
    bound.update(zip(params, call.args))
    bound.update({k.arg: k.value for k in call.keywords if k.arg})
    return bound


def _name(node: ast.expr, bound: dict[str, ast.expr]) -> str | None:
    """A dotted name (``ema``, ``lit.ema_model``) through the function's bound parameters."""
    if isinstance(node, ast.Name):
        target = bound.get(node.id)
        return _name(target, {}) if target is not None else node.id
    if isinstance(node, ast.Attribute):
        base = _name(node.value, bound)
        return f"{base}.{node.attr}" if base else None
    return None


def _number(node: ast.expr, bound: dict, namespace: Mapping[str, Any], constants: dict[str, float]) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.Name):
        if node.id in bound:
            return _number(bound[node.id], {}, namespace, constants)
        value = namespace.get(node.id, constants.get(node.id))
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Sub, ast.Add, ast.Mult)):
        left, right = _number(node.left, bound, namespace, constants), _number(node.right, bound, namespace, constants)
        if left is None or right is None:
            return None
        return left - right if isinstance(node.op, ast.Sub) else left + right if isinstance(node.op, ast.Add) else left * right
    return None


def _zipped(loop: ast.For, bound: dict) -> dict[str, str]:
    """``for s, p in zip(A.parameters(), B.parameters())``: ``{"s": "A", "p": "B"}``."""
    it, target = loop.iter, loop.target
    if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "zip" and isinstance(target, ast.Tuple)):
        return {}
    out = {}
    for var, arg in zip(target.elts, it.args):
        if isinstance(var, ast.Name) and isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr == "parameters":
            owner = _name(arg.func.value, bound)
            if owner:
                out[var.id] = owner
    return out


def _named(loop: ast.For, bound: dict) -> dict[str, str]:
    """``for n, p in model.named_parameters()`` with ``shadow[n]`` in the body: ``{"p": "model", "shadow[n]":
    "shadow"}`` (a dict of shadow tensors keyed by parameter name)."""
    it, target = loop.iter, loop.target
    if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr == "named_parameters"):
        return {}
    if not (isinstance(target, ast.Tuple) and len(target.elts) == 2 and all(isinstance(e, ast.Name) for e in target.elts)):
        return {}
    key, var = (e.id for e in target.elts)  # type: ignore[attr-defined]
    owner = _name(it.func.value, bound)
    if not owner:
        return {}
    out = {var: owner}
    for node in ast.walk(loop):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and isinstance(node.slice, ast.Name) and node.slice.id == key:
            out[f"{node.value.id}[{key}]"] = _name(node.value, bound) or node.value.id
    return out


def _tensor_var(node: ast.expr) -> str | None:
    """``ema_p``, ``ema_p.data`` or ``shadow[n]``: the loop variable (or dict entry) a tensor expression is."""
    if isinstance(node, ast.Attribute) and node.attr == "data":
        node = node.value
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and isinstance(node.slice, ast.Name):
        return f"{node.value.id}[{node.slice.id}]"
    return node.id if isinstance(node, ast.Name) else None


def _updates_in(loop: ast.For, where: str, bound: dict, namespace: Mapping[str, Any], constants: dict,
                block: ast.stmt | None = None) -> Iterator[EmaUpdate]:  # fmt: skip
    owners = _zipped(loop, bound) or _named(loop, bound)
    if len(owners) < 2:
        return
    for node in ast.walk(loop):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        found = _lerp(node, owners) or _mul_add(node, owners)
        if found is None:
            continue
        shadow, online, decay_node, weight, op = found
        decay = _number(decay_node, bound, namespace, constants) if decay_node is not None else None
        if decay is None and weight is not None:
            w = _number(weight, bound, namespace, constants)
            decay = None if w is None else 1.0 - w
        fixed = _cast_online(block, shadow, online) if op == "lerp_" and block is not None else None
        yield EmaUpdate(owners[shadow], owners[online], decay, op, ast.unparse(node), where, fixed)


class _CastOnline(ast.NodeTransformer):
    """``s.lerp_(p, w)`` -> ``s.lerp_(p.float(), w)`` for the loop's shadow and online tensors."""

    def __init__(self, shadow: str, online: str) -> None:
        self.shadow, self.online = shadow, online

    def visit_Call(self, node: ast.Call) -> ast.Call:
        self.generic_visit(node)
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr == "lerp_" and len(node.args) == 2
                and _tensor_var(func.value) == self.shadow and _tensor_var(node.args[0]) == self.online):  # fmt: skip
            node.args[0] = ast.Call(ast.Attribute(node.args[0], "float", ast.Load()), [], [])
        return node


def _cast_online(block: ast.stmt, shadow: str, online: str) -> str:
    """The user's ``block`` (a function or a top-level loop) as Python, its lerp toward ``online`` cast to fp32."""
    fixed = _CastOnline(shadow, online).visit(copy.deepcopy(block))
    return ast.unparse(ast.fix_missing_locations(fixed))


def _lerp(node: ast.Call, owners: dict[str, str]) -> tuple | None:
    """``s.lerp_(p, w)``: the weight ``w`` is ``1 - decay``."""
    if node.func.attr != "lerp_" or len(node.args) != 2:
        return None
    end, op = node.args[0], "lerp_"
    if isinstance(end, ast.Call) and isinstance(end.func, ast.Attribute) and end.func.attr in _CASTS:
        end, op = end.func.value, "lerp_cast"  # ``p.float()`` / ``p.to(s.dtype)``: the update takes an fp32 shadow
    shadow, online = _tensor_var(node.func.value), _tensor_var(end)
    if shadow in owners and online in owners and shadow != online:
        w = node.args[1]
        if isinstance(w, ast.BinOp) and isinstance(w.op, ast.Sub) and isinstance(w.left, ast.Constant) and w.left.value == 1:
            return shadow, online, w.right, None, op
        return shadow, online, None, w, op
    return None


_CASTS = frozenset({"float", "to", "type_as", "double"})


def _mul_add(node: ast.Call, owners: dict[str, str]) -> tuple | None:
    """``s.mul_(d).add_(p, alpha=w)`` (or ``.add_(p * w)``): the decay is ``d``."""
    inner = node.func.value
    if node.func.attr != "add_" or not node.args or not (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute)):
        return None
    if inner.func.attr != "mul_" or len(inner.args) != 1:
        return None
    shadow = _tensor_var(inner.func.value)
    other = node.args[0]
    names = {n.id for n in ast.walk(other) if isinstance(n, ast.Name)}
    online = next((v for v in names if v in owners and v != shadow), None)
    if shadow in owners and online is not None:
        return shadow, online, inner.args[0], None, "mul_add"
    return None
