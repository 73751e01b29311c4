"""An iteration that leaves the loop between ``scaler.unscale_(...)`` and ``scaler.update()``, read from its source.

A loop that skips the optimizer step on a bad gradient norm (``continue``) skips the ``update()`` written after
it too; the next ``unscale_`` then raises "unscale_() has already been called on this optimizer since the last
update()". The watcher sees the second ``unscale_``; the loop's source says which line skipped the update.
"""

from __future__ import annotations

import ast
import linecache

from ...facts.location import Location

#: Statements that leave the iteration of the loop they belong to.
_EXITS = (ast.Continue, ast.Break, ast.Return)
_LOOPS = (ast.For, ast.AsyncFor, ast.While)


def exit_before_update(where: Location | None) -> Location | None:
    """The ``continue`` / ``break`` / ``return`` of the loop around ``where`` (an ``unscale_`` call) that comes after it
    and before the loop's first ``.update(...)`` call, so the iteration that takes it skips the update; None when
    there is none or the source cannot be read."""
    if where is None:
        return None
    lines = linecache.getlines(where.file)
    raw = _raw_line(lines, where)
    if raw is None:
        return None
    try:
        tree = ast.parse("".join(lines))
    except (SyntaxError, ValueError):
        return None
    loop = _innermost_loop(tree, raw)
    if loop is None:
        return None
    nodes = list(_own_nodes(loop.body))
    updates = [n.lineno for n in nodes if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr == "update" and n.lineno > raw]  # fmt: skip
    first_update = min(updates, default=None)
    exits = sorted(n.lineno for n in nodes if isinstance(n, _EXITS) and n.lineno > raw
                   and (first_update is None or n.lineno < first_update))  # fmt: skip
    if not exits:
        return None
    line = where.line + exits[0] - raw  # as the user sees it (a %%time cell counts from the magic)
    return Location(where.file, line, lines[exits[0] - 1].strip(), where.cell)


def _raw_line(lines: list[str], where: Location) -> int | None:
    """The file's line of ``where``: its own number, or the nearest line holding its code."""
    for line in (where.line, where.line + 1, where.line - 1, where.line + 2):
        if 0 < line <= len(lines) and (not where.code or lines[line - 1].strip() == where.code):
            return line
    return None


def _innermost_loop(tree: ast.AST, line: int) -> ast.AST | None:
    best = None
    for node in ast.walk(tree):
        if isinstance(node, _LOOPS) and node.lineno <= line <= (node.end_lineno or node.lineno):
            if best is None or node.lineno >= best.lineno:
                best = node
    return best


def _own_nodes(body: list[ast.stmt]):
    """Every node of ``body`` that belongs to this loop: nested loops and functions are left out."""
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (*_LOOPS, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                stack.append(child)
