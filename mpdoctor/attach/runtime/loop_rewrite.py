"""The corrected loop: the user's own lines with a protocol mistake's fix written in, for a display-only fix.

Edits (insert before / after a statement, replace an expression or a statement, delete a statement) are made
on the window of the source holding them: the innermost loop, else function, else the top-level statements.
A construct the rewriter does not know falls back to the rule's corrected template with the user's names.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from ...objects.readers.loop_source import Source, parse, text_of
from .loop_interpreter import LoopMistake, is_clip
from .protocol_rules import corrected_template


@dataclass
class Edit:
    """A change to one source's lines: insert before / after a statement, replace a span, delete a statement."""

    kind: str  # "before" | "after" | "replace" | "delete"
    stmt: ast.stmt
    text: str = ""
    node: ast.AST | None = None  # for "replace": the expression replaced within its line


def _parents(source: Source) -> dict[int, ast.AST]:
    """id(node) -> its parent, computed once per cached tree."""
    return _parent_map(source.code)


@lru_cache(maxsize=256)
def _parent_map(code: str) -> dict[int, ast.AST]:
    # Kept beside the parse cache, not on the tree: a tree holding its own parent map is a reference cycle,
    # and freeing thousands of cyclic trees costs the garbage collector more than the reading itself.
    tree = parse(code)
    if tree is None:
        return {}
    return {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _ancestors(source: Source, node: ast.AST) -> list[ast.AST]:
    parents, out = _parents(source), []
    while id(node) in parents:
        node = parents[id(node)]
        out.append(node)
    return out


def _statement_of(source: Source, node: ast.AST) -> ast.stmt | None:
    """The innermost statement holding ``node``."""
    if isinstance(node, ast.stmt):
        return node
    return next((a for a in _ancestors(source, node) if isinstance(a, ast.stmt)), None)


def _indent(source: Source, stmt: ast.stmt) -> str:
    line = source.lines[stmt.lineno - 1]
    return line[: len(line) - len(line.lstrip())]


def _end(node: ast.AST) -> int:
    return node.end_lineno or node.lineno


#: The statements a corrected window is cut to, innermost kind first: a loop, else a function.
_WINDOW_KINDS = ((ast.For, ast.AsyncFor, ast.While), (ast.FunctionDef, ast.AsyncFunctionDef))


def _window(source: Source, stmts: Sequence[ast.stmt]) -> tuple[int, int]:
    """Lines (1-based, inclusive) of the innermost loop (else function, else top-level run) holding ``stmts``."""
    lo = min(s.lineno for s in stmts)
    hi = max(_end(s) for s in stmts)
    around = [a for a in _ancestors(source, stmts[0]) if isinstance(a, ast.stmt) and a.lineno <= lo and _end(a) >= hi]
    for kinds in _WINDOW_KINDS:
        best = next((a for a in around if isinstance(a, kinds)), None)
        if best is not None:
            start = min([best.lineno] + [d.lineno for d in getattr(best, "decorator_list", [])])
            return start, _end(best)
    tops = [s for s in source.tree.body if _end(s) >= lo and s.lineno <= hi]
    return min(s.lineno for s in tops), max(_end(s) for s in tops)


def apply_edits(source: Source, edits: Sequence[Edit], stale: Sequence[ast.stmt] = ()) -> str:
    """The corrected lines: the window of ``source`` holding the edits, with the edits made, dedented; the
    statements ``stale`` (the mistaken lines a fix keeps) lose their trailing comments."""
    lines = list(source.lines)
    for stmt in stale:
        for n in range(stmt.lineno, _end(stmt) + 1):
            lines[n - 1] = _without_comment(lines[n - 1])
    lo, hi = _window(source, [e.stmt for e in edits])
    before: dict[int, list[str]] = {}
    after: dict[int, list[str]] = {}
    deleted: set[int] = set()
    replaced: dict[int, str] = {}
    for e in edits:
        end = e.stmt.end_lineno or e.stmt.lineno
        if e.kind == "before":
            before.setdefault(e.stmt.lineno, []).extend(e.text.splitlines())
        elif e.kind == "after":
            after.setdefault(end, []).extend(e.text.splitlines())
        elif e.kind == "delete":
            deleted.update(range(e.stmt.lineno, end + 1))
        elif e.kind == "replace" and e.node is not None and e.node.lineno == e.node.end_lineno:
            line = replaced.get(e.node.lineno, lines[e.node.lineno - 1])
            replaced[e.node.lineno] = line[: e.node.col_offset] + e.text + line[e.node.end_col_offset :]
        elif e.kind == "replace":  # a whole statement replaced by new lines
            deleted.update(range(e.stmt.lineno, end + 1))
            before.setdefault(e.stmt.lineno, []).extend(e.text.splitlines())
    out: list[str] = []
    for n in range(lo, hi + 1):
        out.extend(before.get(n, []))
        if n not in deleted:
            out.append(replaced.get(n, lines[n - 1]))
        out.extend(after.get(n, []))
    indents = [len(x) - len(x.lstrip()) for x in out if x.strip()]
    cut = min(indents) if indents else 0
    return "\n".join(x[cut:] if x.strip() else "" for x in out).rstrip() + "\n"


def corrected_lines(mistake: LoopMistake) -> tuple[int, int] | None:
    """The lines (as the user numbers them, inclusive) that :func:`corrected_code` replaces, when it rewrites the
    user's own lines; None when it falls back to the rule's template."""
    try:
        edits = _edits_of(mistake)
    except Exception:  # the template stands: no lines of the user's are replaced
        return None
    if not edits:
        return None
    source = mistake.at.source
    lo, hi = _window(source, [e.stmt for e in edits])
    return lo + source.line_offset, hi + source.line_offset


def corrected_code(mistake: LoopMistake, others: Sequence[LoopMistake] = ()) -> str:
    """The user's own loop with the corrected lines (the rule's template with their names when that fails).

    ``others`` are the other mistakes read in the same code: those in the same window are corrected too, so the
    loop shown fixes every known mistake at once (it never still clips before ``unscale_``). The lines a fix
    keeps lose the user's comment about the mistake (``# mistake: ...``).
    """
    try:
        code = _corrected(mistake, others)
    except Exception:  # a construct the rewriter does not know: the template still names their objects
        code = None
    return code or corrected_template(mistake.slug, mistake.scaler, mistake.optimizer, mistake.scheduler)


def _find_calls(source: Source, receiver: str, attr: str) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(source.tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == attr
        and text_of(n.func.value) == receiver
    ]


def _function_of(source: Source, node: ast.AST) -> ast.AST | None:
    """The innermost function holding ``node`` (None: the top level)."""
    return next((a for a in _ancestors(source, node) if isinstance(a, _WINDOW_KINDS[1])), None)


def _beside(source: Source, node: ast.AST, calls: Sequence[ast.Call]) -> list[ast.Call]:
    """``calls`` in the function ``node`` is in (the top level for a top-level node), in the order they are written:
    a script's other functions use the same names for their own loops."""
    home = _function_of(source, node)
    return sorted((c for c in calls if _function_of(source, c) is home), key=lambda c: (c.lineno, c.col_offset))


def _edits_of(mistake: LoopMistake) -> list[Edit] | None:
    stmt = _statement_of(mistake.at.source, mistake.at.node)
    rewrite = _REWRITES.get(mistake.slug)
    if stmt is None or rewrite is None:
        return None
    return rewrite(mistake, stmt)


def _corrected(mistake: LoopMistake, others: Sequence[LoopMistake] = ()) -> str | None:
    """The corrected window of the mistake's source, or None when its lines cannot be rewritten."""
    edits = _edits_of(mistake)
    if not edits:
        return None
    source = mistake.at.source
    window = _window(source, [e.stmt for e in edits])
    stale = {_statement_of(source, mistake.at.node)}
    for other in others:
        if other is mistake or other.at.source is not source or other.slug == mistake.slug:
            continue
        try:
            more = _edits_of(other)
        except Exception:  # that mistake keeps its own finding's corrected lines
            more = None
        if not more or not _inside(_window(source, [e.stmt for e in more]), window) or _clash(edits, more):
            continue
        edits = [*edits, *more]
        stale.add(_statement_of(source, other.at.node))
    return apply_edits(source, edits, stale=[s for s in stale if s is not None])


def _inside(inner: tuple[int, int], outer: tuple[int, int]) -> bool:
    return outer[0] <= inner[0] and inner[1] <= outer[1]


def _clash(edits: Sequence[Edit], more: Sequence[Edit]) -> bool:
    """Two fixes that touch the same statement (one moves or deletes what the other edits) are not combined."""
    touched = {id(e.stmt) for e in edits if e.kind in ("delete", "replace")}
    touched_more = {id(e.stmt) for e in more if e.kind in ("delete", "replace")}
    return bool(touched & {id(e.stmt) for e in more}) or bool(touched_more & {id(e.stmt) for e in edits})


def _unscale_before_clip(mistake: LoopMistake, stmt: ast.stmt) -> list[Edit] | None:
    source, node, s = mistake.at.source, mistake.at.node, mistake.scaler
    if not mistake.optimizer:  # the optimizer the scaler steps next names the unscale_
        steps = [c for c in _beside(source, node, _find_calls(source, s, "step")) if c.args and c.lineno > node.lineno]
        mistake.optimizer = text_of(steps[0].args[0]) if steps else _stepped_directly(source, node.lineno)
    if not mistake.optimizer:
        return None
    line = f"{_indent(source, stmt)}{s}.unscale_({mistake.optimizer})  # unscale first: clip the true gradients"
    return [Edit("before", stmt, line)]


def _stepped_directly(source: Source, after: int) -> str:
    """The receiver of the first bare ``<optimizer>.step()`` after line ``after`` (a loop that bypasses the
    scaler), else ``""``."""
    calls = [n for n in ast.walk(source.tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "step" and not n.args and not n.keywords and n.lineno > after]  # fmt: skip
    calls.sort(key=lambda c: (c.lineno, c.col_offset))
    return text_of(calls[0].func.value) if calls else ""


def _step_through_scaler(mistake: LoopMistake, stmt: ast.stmt) -> list[Edit] | None:
    source, node, s = mistake.at.source, mistake.at.node, mistake.scaler
    edits = [Edit("replace", stmt, f"{s}.step({mistake.optimizer})", node=node)]
    if not [c for c in _find_calls(source, s, "update") if c.lineno > node.lineno]:
        edits.append(Edit("after", stmt, f"{_indent(source, stmt)}{s}.update()"))
    return edits


def _update_after_step(mistake: LoopMistake, stmt: ast.stmt) -> list[Edit] | None:
    source = mistake.at.source
    return [Edit("after", stmt, f"{_indent(source, stmt)}{mistake.scaler}.update()  # once per real step")]


def _unscale_once(mistake: LoopMistake, stmt: ast.stmt) -> list[Edit] | None:
    source, node, s, opt = mistake.at.source, mistake.at.node, mistake.scaler, mistake.optimizer
    steps = [c for c in _beside(source, node, _find_calls(source, s, "step")) if text_of(c.args[0]) == opt] if opt else []
    target = next((c for c in steps if c.lineno > node.lineno), steps[0] if steps else None)
    target_stmt = _statement_of(source, target) if target is not None else None
    if target_stmt is None or target_stmt.lineno <= stmt.lineno <= (target_stmt.end_lineno or 0):
        return None
    moved = [stmt, *_clips_after(source, stmt)]  # clipping right after the unscale moves with it
    if any(m.lineno <= target_stmt.lineno <= _end(m) for m in moved):
        return None
    guard = _guard_reading(source, target_stmt, moved)
    if guard is not None:  # the clip's result decides whether to step: it cannot move under that decision
        return _update_every_iteration(source, s, guard)
    skip = _exit_reading(source, target_stmt, moved)
    if skip is not None:  # ... nor past an `if norm > limit: continue` that skips the step on it
        return _update_before_exits(source, s, skip)
    new_indent = _indent(source, target_stmt)
    lines = [line for m in moved for line in _reindent(source, m, new_indent)]
    lines[0] = _without_comment(lines[0]) + "  # once per real step, after the last micro-batch"
    return [Edit("delete", m) for m in moved] + [Edit("before", target_stmt, "\n".join(lines))]


def _guard_reading(source: Source, target_stmt: ast.stmt, moved: Sequence[ast.stmt]) -> ast.If | None:
    """The ``if`` around the step whose test reads a name the unscale or the clip binds (``grad_norm``), else None."""
    bound = {n.id for m in moved for n in ast.walk(m) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    for ancestor in _ancestors(source, target_stmt):
        if isinstance(ancestor, ast.If) and bound & {n.id for n in ast.walk(ancestor.test) if isinstance(n, ast.Name)}:
            return ancestor
    return None


def _exit_reading(source: Source, target_stmt: ast.stmt, moved: Sequence[ast.stmt]) -> ast.If | None:
    """The ``if`` between the clip and the step, in the loop around the step, whose test reads a name the unscale or
    the clip binds and whose body leaves the iteration (``if grad_norm > limit: continue``), else None."""
    bound = {n.id for m in moved for n in ast.walk(m) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    loop = next((a for a in _ancestors(source, target_stmt) if isinstance(a, _WINDOW_KINDS[0])), None)
    if loop is None or not bound:
        return None
    after, before = _end(moved[-1]), target_stmt.lineno
    for node in ast.walk(loop):
        if (isinstance(node, ast.If) and after < node.lineno < before and _exits(node)
                and bound & {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}):  # fmt: skip
            return node
    return None


def _exits(node: ast.If) -> list[ast.stmt]:
    """The ``continue`` / ``break`` / ``return`` statements of ``node``'s branches (not of loops or functions in it)."""
    out: list[ast.stmt] = []
    stack: list[ast.AST] = [*node.body, *node.orelse]
    while stack:
        item = stack.pop()
        if isinstance(item, (ast.Continue, ast.Break, ast.Return)):
            out.append(item)
        elif not isinstance(item, (*_WINDOW_KINDS[0], *_WINDOW_KINDS[1], ast.Lambda, ast.ClassDef)):
            stack.extend(c for c in ast.iter_child_nodes(item) if isinstance(c, ast.stmt))
    return out


def _update_before_exits(source: Source, scaler: str, skip: ast.If) -> list[Edit]:
    """``update()`` before each way out of the iteration that skips the step: the skipped iteration clears the record
    of ``unscale_`` too (and backs the scale off when its gradients overflowed)."""
    return [Edit("before", stmt, f"{_indent(source, stmt)}{scaler}.update()  # every iteration, stepped or skipped")
            for stmt in _exits(skip)]  # fmt: skip


def _update_every_iteration(source: Source, scaler: str, guard: ast.If) -> list[Edit]:
    """``update()`` after the guarded step's ``if``, for the stepped and the skipped iterations alike (it clears the
    record of ``unscale_``); the ``update()`` calls inside the guard go."""
    inside = [_statement_of(source, c) for c in _find_calls(source, scaler, "update")
              if guard.lineno <= c.lineno <= _end(guard)]  # fmt: skip
    line = f"{_indent(source, guard)}{scaler}.update()  # every iteration, stepped or skipped"
    return [*(Edit("delete", st) for st in inside if st is not None), Edit("after", guard, line)]


def _clips_after(source: Source, stmt: ast.stmt) -> list[ast.stmt]:
    """The clipping statements right after ``stmt`` in its block (``clip_grad_norm_(...)``, ``norm = clip_grad_norm_(...)``)."""
    parent = _parent_body(source, stmt)
    out: list[ast.stmt] = []
    for nxt in parent[parent.index(stmt) + 1 :] if parent is not None else []:
        value = nxt.value if isinstance(nxt, (ast.Expr, ast.Assign, ast.AnnAssign)) else None  # a kept norm too
        if not (isinstance(value, ast.Call) and is_clip(value)):
            break
        out.append(nxt)
    return out


def _update_with_step(mistake: LoopMistake, stmt: ast.stmt) -> list[Edit] | None:
    source = mistake.at.source
    guarded = mistake.related.get("guarded_step")
    target_stmt = _statement_of(source, guarded.node) if guarded is not None and guarded.source is source else None
    if target_stmt is None:
        return None
    line = f"{_indent(source, target_stmt)}{mistake.scaler}.update()  # once per real step, with the step"
    return [Edit("delete", stmt), Edit("after", target_stmt, line)]


def _schedule_on_real_steps(mistake: LoopMistake, stmt: ast.stmt) -> list[Edit] | None:
    source, s = mistake.at.source, mistake.scaler
    step = mistake.related.get("scaler_step")
    step_stmt = _statement_of(source, step.node) if step is not None and step.source is source else None
    if step_stmt is None or _parent_body(source, step_stmt) is not _parent_body(source, stmt):
        return None
    sched = mistake.scheduler or text_of(mistake.at.node.func.value)
    indent = _indent(source, stmt)
    guarded = f"{indent}if {s}.get_scale() >= scale_before:  # the step was not skipped\n{indent}    {sched}.step()"
    return [
        Edit("before", step_stmt, f"{_indent(source, step_stmt)}scale_before = {s}.get_scale()"),
        Edit("replace", stmt, guarded),
    ]


#: Rule slug -> how the user's lines are rewritten (the others get the rule's template with their names).
_REWRITES = {
    "amp-clip-before-unscale": _unscale_before_clip,
    "amp-step-bypasses-scaler": _step_through_scaler,
    "amp-update-missing": _update_after_step,
    "amp-unscale-twice": _unscale_once,
    "amp-update-per-microbatch": _update_with_step,
    "amp-scheduler-on-skipped-steps": _schedule_on_real_steps,
}


def _without_comment(line: str) -> str:
    """``line`` without its trailing ``# comment`` (a ``#`` inside a string stays)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line.rstrip("\n") + "\n").readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):  # a continuation line: left as it is
        return line
    comment = next((t for t in tokens if t.type == tokenize.COMMENT), None)
    if comment is None or not line[: comment.start[1]].strip():
        return line
    return line[: comment.start[1]].rstrip()


def _reindent(source: Source, stmt: ast.stmt, indent: str) -> list[str]:
    """The lines of ``stmt`` moved to ``indent`` (its continuation lines keep their relative indent)."""
    lines = source.lines[stmt.lineno - 1 : stmt.end_lineno or stmt.lineno]
    cut = len(lines[0]) - len(lines[0].lstrip())
    return [indent + line[cut:] if line[:cut].strip() == "" else indent + line.lstrip() for line in lines]


def _parent_body(source: Source, stmt: ast.stmt) -> list | None:
    node = _parents(source).get(id(stmt))
    if node is not None:
        for name in ("body", "orelse", "finalbody", "handlers"):
            body = getattr(node, name, None)
            if isinstance(body, list) and any(x is stmt for x in body):
                return body
    return None

