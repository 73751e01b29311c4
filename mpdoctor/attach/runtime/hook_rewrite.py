"""The corrected class cell for a clip that runs before Lightning's precision plugin unscales.

Under manual optimization with ``precision="16-mixed"``, Lightning's docs clip in ``training_step``
(``self.clip_gradients(opt, ...)`` or ``torch.nn.utils.clip_grad_norm_(self.parameters(), ...)``) after
``self.manual_backward(loss)``; the plugin unscales only inside ``opt.step()``, so the clip measures the scaled norm and
every step applies gradients clipped far below ``max_norm``. Nothing in place reaches it (an ``unscale_`` of the user's
own goes unseen, Lightning refuses ``Trainer(gradient_clip_val=...)`` under manual optimization): the fix is where the
line sits. :func:`clip_moved_to_hook` rewrites the source of the class that holds the clip (read with :mod:`ast`, never
run; every other line stays as the user wrote it): the clip statement leaves its method and is run by the class's
``on_before_optimizer_step(self, optimizer)``, which Lightning calls right after the plugin unscales (an existing hook
keeps its body, the clip appended to it). A name of the method's locals in the clip statement is mapped to the hook's
argument when the method bound it to ``self.optimizers()`` (the one optimizer Lightning hands the hook); any other
local, a clip inside a condition or a loop, or a statement sharing its line, and the source is not rewritten (the
advice stands).
"""

from __future__ import annotations

import ast

#: The hook Lightning calls after the precision plugin unscales, before the optimizer steps.
HOOK = "on_before_optimizer_step"
#: Longer sources than this are not shown whole (a script's class: the advice stands).
CORRECTED_LINES = 80


def corrected_class(file: str, line: int) -> tuple[str, bool] | None:
    """The code that holds ``line`` of ``file`` with its clip moved into the hook (:func:`clip_moved_to_hook`): a
    notebook cell whole, or a script's top-level class around the line; and whether it is a cell. None when the
    source cannot be read or rewritten."""
    import linecache

    from ...facts.location import is_cell

    source = "".join(linecache.getlines(file))
    if not source:
        return None
    cell = is_cell(file)
    start = 1
    if not cell:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return None
        top = next((n for n in tree.body if isinstance(n, ast.ClassDef)
                    and min([n.lineno, *(d.lineno for d in n.decorator_list)]) <= line <= (n.end_lineno or n.lineno)),
                   None)  # fmt: skip
        if top is None:
            return None
        start = min([top.lineno, *(d.lineno for d in top.decorator_list)])
        source = "\n".join(source.splitlines()[start - 1 : top.end_lineno]) + "\n"
    code = clip_moved_to_hook(source, line - start + 1)
    if code is None or len(code.splitlines()) > CORRECTED_LINES:
        return None
    return code, cell


def clip_moved_to_hook(source: str, line: int) -> str | None:
    """``source`` with the clip statement on ``line`` (a statement of a method of a class in it) moved into the
    class's :data:`HOOK`; None when the line is not such a statement, or a name it reads cannot be given to the hook."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    found = _clip_statement(tree, line)
    if found is None:
        return None
    cls, method, stmt = found
    hook = next((m for m in cls.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name == HOOK), None)
    if hook is method:
        return None  # already in the hook: nothing to move
    arg = _hook_argument(hook)
    if arg is None:
        return None
    moved = _mapped(stmt, method, arg)
    if moved is None:
        return None
    lines = source.splitlines()
    if _shares_line(stmt, tree):
        return None
    indent = _indent(lines[stmt.lineno - 1])
    note = f"{indent}# clip moved to {HOOK}: here the 16-mixed plugin has not unscaled the gradients yet"
    if hook is None:
        method_indent = _indent(lines[_first_line(method) - 1])
        body_indent = method_indent + (indent[len(method_indent) :] or "    ")
        added = ["", f"{method_indent}def {HOOK}(self, {arg}):",
                 f"{body_indent}# Lightning calls this after the precision plugin unscales the gradients",
                 f"{body_indent}super().{HOOK}({arg})",
                 f"{body_indent}{moved}"]  # fmt: skip
        after = method.end_lineno or method.lineno
    else:
        body_indent = _indent(lines[hook.body[0].lineno - 1])
        added = [f"{body_indent}{moved}  # after the plugin unscaled: the clip measures the real norm"]
        after = hook.end_lineno or hook.lineno
    out: list[str] = []
    for i, text in enumerate(lines, start=1):
        if i == stmt.lineno:
            out.append(note)
        elif not stmt.lineno < i <= (stmt.end_lineno or stmt.lineno):
            out.append(text)
        if i == after:
            out.extend(added)
    return "\n".join(out) + "\n"


def _clip_statement(tree: ast.Module, line: int) -> tuple[ast.ClassDef, ast.FunctionDef, ast.Expr] | None:
    """The innermost class whose method's own body (not a condition or loop in it) holds an expression statement
    calling something on ``line``: (class, method, statement)."""
    best = None
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for method in cls.body:
            if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for stmt in method.body:
                if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                        and stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno)):  # fmt: skip
                    if best is None or cls.lineno > best[0].lineno:
                        best = (cls, method, stmt)
    if best is None or len(best[1].body) < 2 or not best[1].args.args:
        return None  # the method would be left empty, or it has no ``self``
    return best


def _hook_argument(hook: ast.FunctionDef | ast.AsyncFunctionDef | None) -> str | None:
    """The name the hook holds the optimizer by: its second parameter (``optimizer``, or the user's own name)."""
    if hook is None:
        return "optimizer"
    params = [*hook.args.posonlyargs, *hook.args.args]
    return params[1].arg if len(params) >= 2 else None


def _mapped(stmt: ast.Expr, method: ast.FunctionDef | ast.AsyncFunctionDef, arg: str) -> str | None:
    """The clip statement as the hook runs it: each local of ``method`` it reads replaced by ``arg`` when the method
    bound that local to ``self.optimizers()`` alone; None when it reads any other local."""
    params = [a.arg for a in (*method.args.posonlyargs, *method.args.args, *method.args.kwonlyargs)]
    params += [a.arg for a in (method.args.vararg, method.args.kwarg) if a is not None]
    this = params[0]
    local = set(params[1:]) | _bound_names(method)
    optimizers = _bound_to_optimizers(method, this) - set(params)
    read = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)}
    if any(name in local and name not in optimizers for name in read):
        return None
    if arg in read - optimizers and arg not in optimizers:
        return None  # the hook's argument would shadow a name the clip reads
    copy = ast.parse(ast.unparse(stmt)).body[0]
    for node in ast.walk(copy):
        if isinstance(node, ast.Name) and node.id in optimizers:
            node.id = arg
        elif isinstance(node, ast.Name) and node.id == this:
            node.id = "self"
    return ast.unparse(copy)


def _bound_names(method: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(method):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not method:
            names.add(node.name)
    return names


def _bound_to_optimizers(method: ast.FunctionDef | ast.AsyncFunctionDef, this: str) -> set[str]:
    """The locals every binding of which in ``method`` is ``name = <this>.optimizers()`` (one optimizer)."""
    plain = {id(a.targets[0]) for a in ast.walk(method)
             if isinstance(a, ast.Assign) and len(a.targets) == 1 and isinstance(a.targets[0], ast.Name)
             and _is_optimizers_call(a.value, this)}  # fmt: skip
    kinds: dict[str, list[bool]] = {}
    for node in ast.walk(method):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            kinds.setdefault(node.id, []).append(id(node) in plain)
    return {name for name, held in kinds.items() if all(held)}


def _is_optimizers_call(value: ast.AST, this: str) -> bool:
    return (isinstance(value, ast.Call) and not value.args and not value.keywords
            and isinstance(value.func, ast.Attribute) and value.func.attr == "optimizers"
            and isinstance(value.func.value, ast.Name) and value.func.value.id == this)  # fmt: skip


def _shares_line(stmt: ast.stmt, tree: ast.Module) -> bool:
    """Another statement than ``stmt`` and those around it is on one of its lines (``a = f(); clip(...)``)."""
    first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
    return any(other is not stmt and other.lineno <= last and (other.end_lineno or other.lineno) >= first
               and not any(c is stmt for c in ast.walk(other))
               for other in ast.walk(tree) if isinstance(other, ast.stmt))  # fmt: skip


def _first_line(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def _indent(text: str) -> str:
    return text[: len(text) - len(text.lstrip())]
