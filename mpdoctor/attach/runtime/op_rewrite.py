"""The corrected cell: an op with no half-precision kernel, on the user's own line, run on fp32 copies of its tensors.

A ``torch.linalg.svd(delta)`` or ``torch.linalg.cholesky(hessian)`` written in a cell over bf16 / fp16 tensors that no
module holds raises, and nothing in place reaches it: the fix is the cell itself, corrected. The line the crash's
frames point at is rewritten (read with :mod:`ast`, never run): each tensor argument that reads a bf16 / fp16 tensor
of the namespace is upcast with ``.float()``, and the result is cast back to that dtype where it is bound (a single
tensor inline, the tensors of a tuple unpacked into names by the line after it; a tuple bound to one name stays
fp32). The lines after it that pass those results, or other half tensors, to another such op are rewritten the same
way, so the cell runs through. Every other line stays as the user wrote it.
"""

from __future__ import annotations

import ast
import types
from collections.abc import Mapping
from typing import Any

import torch

#: The recipe of a cause's display-only fix that is the crashing cell corrected: it is run on twins before it is shown
#: (:func:`mpdoctor.attach.runtime.assembly.assemble`).
CORRECTED_CELL = "corrected-cell"

_HALF = {torch.float16: "float16", torch.bfloat16: "bfloat16"}

#: Ops that give back one tensor (cast back inline); the others give a tuple.
_SINGLE = frozenset({"cholesky", "inv", "solve", "solve_triangular", "pinv", "det", "householder_product",
                     "matrix_exp", "svdvals", "eigvalsh", "eigvals", "cholesky_inverse", "cholesky_solve", "inverse",
                     "logdet", "pinverse", "orgqr", "ormqr", "lu_solve", "cond", "ldl_solve"})  # fmt: skip


def corrected_cell(source: str, line: int, namespace: Mapping[str, Any], families: tuple[str, ...] = ("linalg",)) -> str | None:
    """``source`` (a cell) with the op of ``families`` on ``line`` run on fp32 copies of its half tensors and its
    result cast back, and the same for such ops on the lines after it; None when the line holds no such call over a
    bf16 / fp16 tensor of ``namespace``, or the cell cannot be read."""
    from ...objects.edits.fp32_ops import family_op_names

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    simple = sorted((s for s in ast.walk(tree) if isinstance(s, ast.stmt) and not _compound(s)), key=lambda s: s.lineno)
    failing = next((s for s in simple if s.lineno <= line <= (s.end_lineno or s.lineno)), None)
    if failing is None:
        return None
    half = {n: _HALF[v.dtype] for n, v in dict(namespace).items()
            if isinstance(v, torch.Tensor) and v.dtype in _HALF}  # fmt: skip
    rewritten = _rewritten(_Upcast(family_op_names(families), namespace, half), simple, failing)
    return _spliced(source.splitlines(), simple, rewritten) if rewritten else None


def _rewritten(rewriter: _Upcast, simple: list[ast.stmt], failing: ast.stmt) -> dict[int, list[str]] | None:
    """The new lines of each statement from ``failing`` on that holds a call to rewrite, by first line; None when
    the failing one holds none, or a rewritten statement shares a line with another."""
    out: dict[int, list[str]] = {}
    for stmt in (s for s in simple if s.lineno >= failing.lineno):
        lines = rewriter.statement(stmt)
        if lines is None:
            if stmt is failing:
                return None
            continue
        if any(o is not stmt and o.lineno <= (stmt.end_lineno or stmt.lineno) and (o.end_lineno or o.lineno) >= stmt.lineno
               for o in simple):  # fmt: skip
            return None  # two statements on one line (``a = f(x); b = g(a)``): not rewritten line by line
        out[stmt.lineno] = lines
    return out


def _compound(stmt: ast.stmt) -> bool:
    return any(isinstance(getattr(stmt, f, None), list) and getattr(stmt, f) and isinstance(getattr(stmt, f)[0], ast.stmt)
               for f in ("body", "orelse", "finalbody", "handlers"))  # fmt: skip


def _spliced(lines: list[str], simple: list[ast.stmt], rewritten: dict[int, list[str]]) -> str:
    out: list[str] = []
    by_line = {s.lineno: s for s in simple}
    i = 1
    while i <= len(lines):
        stmt = by_line.get(i)
        if stmt is not None and i in rewritten:
            text = lines[i - 1]
            indent = text[: len(text) - len(text.lstrip())]
            new = rewritten[i]
            out.append(f"{indent}{new[0]}  # no half-precision kernel: the op on fp32 copies, its result cast back")
            out.extend(f"{indent}{extra}" for extra in new[1:])
            i = (stmt.end_lineno or stmt.lineno) + 1
            continue
        out.append(lines[i - 1])
        i += 1
    return "\n".join(out) + "\n"


class _Upcast(ast.NodeTransformer):
    """Rewrites the calls of ``ops`` whose arguments read a half tensor (``half``: name -> dtype name)."""

    def __init__(self, ops: dict[Any, str], namespace: Mapping[str, Any], half: dict[str, str]) -> None:
        self.ops, self.namespace, self.half = ops, namespace, half
        self._hits: list[tuple[ast.Call, str, str]] = []

    def statement(self, stmt: ast.stmt) -> list[str] | None:
        """The statement's new lines, or None when it holds no call to rewrite."""
        self._hits = []
        new = self.visit(ast.parse(ast.unparse(stmt)).body[0])  # a copy: the cell's tree stays as read
        if not self._hits:
            return None
        lines = [ast.unparse(new)]
        value = getattr(new, "value", None)
        hit = next((h for h in self._hits if h[0] is value), None)
        targets = getattr(new, "targets", None) or ([new.target] if isinstance(new, ast.AnnAssign) else [])
        if hit is not None and len(targets) == 1:
            bound = [n.id for n in ast.walk(targets[0]) if isinstance(n, ast.Name)]
            if hit[1] not in _SINGLE and isinstance(targets[0], ast.Tuple) and len(bound) == len(targets[0].elts):
                names = ", ".join(bound)
                lines.append(f"{names} = (t.to(torch.{hit[2]}) if t.is_floating_point() else t for t in ({names}))")
            if hit[1] in _SINGLE or isinstance(targets[0], ast.Tuple):
                self.half.update(dict.fromkeys(bound, hit[2]))
        return lines

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        name = self._op(node.func)
        method = name is None and isinstance(node.func, ast.Attribute) and self._method(node.func)
        if name is None and not method:
            return node
        dtype = next((d for a in (*node.args, *(k.value for k in node.keywords)) for d in [self._reads_half(a)] if d),
                     None) if not method else self._reads_half(node.func.value)  # fmt: skip
        if dtype is None:
            return node
        if method:
            node.func.value = _float(node.func.value)
            name = node.func.attr
        else:
            node.args = [_float(a) if self._reads_half(a) else a for a in node.args]
            for k in node.keywords:
                k.value = _float(k.value) if self._reads_half(k.value) else k.value
        if name in _SINGLE:
            cast = ast.Call(ast.Attribute(node, "to", ast.Load()), [_dtype(dtype)], [])
            self._hits.append((cast, name, dtype))
            return cast
        self._hits.append((node, name, dtype))
        return node

    def _op(self, func: ast.AST) -> str | None:
        """The op's name when ``func`` reads one of the ops through modules of the namespace (``torch.linalg.svd``,
        ``LA.svd``, ``svd`` imported by name)."""
        value = self._resolved(func)
        try:
            return self.ops.get(value) if value is not None else None
        except TypeError:  # an unhashable value: no op
            return None

    def _resolved(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Name):
            return dict.get(self.namespace, node.id) if isinstance(self.namespace, dict) else self.namespace.get(node.id)
        if isinstance(node, ast.Attribute):
            owner = self._resolved(node.value)
            return getattr(owner, node.attr, None) if isinstance(owner, types.ModuleType) else None
        return None

    def _method(self, func: ast.Attribute) -> bool:
        """``x.cholesky()`` on a half tensor: the op as a method of ``torch.Tensor``."""
        return getattr(torch.Tensor, func.attr, None) in self.ops and self._reads_half(func.value) is not None

    def _reads_half(self, node: ast.AST) -> str | None:
        """The dtype of the first half tensor of the namespace ``node`` reads (by name), or None."""
        return next((self.half[n.id] for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in self.half), None)


def _float(node: ast.AST) -> ast.AST:
    return ast.Call(ast.Attribute(node, "float", ast.Load()), [], [])


def _dtype(name: str) -> ast.AST:
    return ast.Attribute(ast.Name("torch", ast.Load()), name, ast.Load())
