"""The notebook cell that raised, as a step the proof can run again (:class:`~mpdoctor.diagnosis.proof.HeldStep`).

When a cell raises a mixed-precision error, the crash hook keeps its source. ``%mpdoctor`` then checks its plan by
running that source again in the user's namespace, before and after each fix, and restores everything after each
run: the models, optimizers and scalers (:class:`~mpdoctor.diagnosis.proof.RunState`), the random streams, and the
namespace itself (:class:`NamespaceState`: names the cell bound or rebound, the contents of the lists, dicts and sets
and the values of the tensors the cell reads).

What is not replayed (the proof then says "not verified" and why), decided from the cell's source, never by
running it:

- a cell that reads a data iterator (``next(it)``, ``iter(...)``, a ``for`` loop over an iterator or a DataLoader):
  an iterator cannot be rewound, and a replay would hand the user's next batch to the proof;
- a cell that builds one of the user's models, optimizers or scalers anew (``model = Net()``): a replay would test
  a fresh object, not the one the fix changed, and rebind the name;
- a cell that runs IPython magics or shell commands (``%time``, ``!ls``): their effects are not the cell's to undo.

A replay runs the cell through the line that raised and on, to the cell's end, or until that line is about to run a
second time (the next iteration of the loop that holds it): a cell that raises after its optimizer step (an
evaluation after the update) is judged on all of it, and a loop of a thousand steps is judged on one round.
"""

from __future__ import annotations

import ast
import contextlib
import io
import linecache
import types
from collections.abc import Callable, Iterable, MutableMapping
from types import TracebackType
from typing import Any

import torch

from .proof import HeldStep, _put, is_data_stream, iterator_reader

#: Names bound in a notebook namespace by IPython itself, never the cell's doing.
_SHELL_NAMES = frozenset({"_", "__", "___", "_i", "_ii", "_iii", "_oh", "_ih", "_dh", "In", "Out", "exit", "quit"})


def cell_step(source: str, namespace: MutableMapping[str, Any], label: str, filename: str = "<cell>",
              line: int | None = None) -> HeldStep:
    """The cell ``source`` as a held step running in ``namespace`` (refused, with the reason, when it must not be replayed).

    Parameters
    ----------
    source : str
        The cell's Python source, as IPython compiled it (magics already turned into calls).
    namespace : mapping
        The user's namespace (IPython's ``user_ns``): the cell runs in it, and it is restored after each run.
    label : str
        What the report calls the step (``"cell [4]"``).
    filename : str
        The name the code is compiled under (the cell's, so a traceback of the replay reads as the cell's).
    line : int, optional
        The cell's line that raised. The replay runs through it and on, to the cell's end or until the line is
        about to run again (the next iteration of the loop that holds it). Without it, the whole cell runs.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return HeldStep(_nothing, label, refused="its source could not be read back")
    why = refusal(tree, namespace)
    if why:
        return HeldStep(_nothing, label, refused=why)
    run = _runner(tree, namespace, filename, line)
    names = _names_read(tree)
    return HeldStep(run, label, around=_silenced, state=lambda: NamespaceState(namespace, names))


def _nothing() -> None:
    return None


def refusal(tree: ast.Module, namespace: MutableMapping[str, Any], what: str = "the cell") -> str:
    """Why a cell (or ``what`` else: ``"the loop's body"``) must not be replayed (``""`` when it may), read from its
    syntax tree and the names it uses."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _called_name(node) == "get_ipython":
            return f"{what} runs IPython magics or shell commands (line {node.lineno}), which a replay cannot undo"
        if isinstance(node, ast.Call) and _called_name(node) in ("next", "iter"):
            return (f"{what} reads a data iterator ({_called_name(node)}(...), line {node.lineno}); replaying it "
                    "would hand your next batch to the check")  # fmt: skip
        helper = namespace.get(_called_name(node)) if isinstance(node, ast.Call) else None
        if type(helper) is types.FunctionType:
            reader = iterator_reader(helper)
            if reader:
                return (f"{what} calls {reader}, which reads a data iterator (line {node.lineno}); replaying it "
                        "would hand your next batch to the check")  # fmt: skip
        iterated = _iterated(node)
        if iterated is not None:
            name = next((n for n in _names_in(iterated) if is_data_stream(namespace.get(n))), None)
            if name is not None:
                return (f"{what} reads a data iterator (a loop over {name}, line {node.lineno}); replaying it "
                        "would hand your next batch to the check")  # fmt: skip
        for target in _bound_names(node):
            if _is_training_object(namespace.get(target)):
                return (f"{what} builds {target} anew (line {node.lineno}); a replay would check a fresh object, "
                        "not the one the fix changes")  # fmt: skip
    return ""


def _called_name(call: ast.Call) -> str:
    return call.func.id if isinstance(call.func, ast.Name) else ""


def _iterated(node: ast.AST) -> ast.AST | None:
    """The expression a ``for`` loop or a comprehension iterates over."""
    if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
        return node.iter
    return None


def _names_in(node: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]


def _bound_names(node: ast.AST) -> list[str]:
    """The plain names an assignment statement binds (``a = ...``, ``a, b = ...``, ``a: T = ...``)."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
        targets = [node.target]
    else:
        return []
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]


def _is_training_object(value: Any) -> bool:
    from ..compat import grad_scaler_class

    return isinstance(value, (torch.nn.Module, torch.optim.Optimizer, grad_scaler_class()))


def _names_read(tree: ast.Module) -> frozenset[str]:
    return frozenset(n.id for n in ast.walk(tree) if isinstance(n, ast.Name))


#: The name the replay binds, for the duration of one run, to the marks it places around the cell's failing line.
_MARKER = "__mpdoctor_failing_line__"


def _runner(tree: ast.Module, namespace: MutableMapping[str, Any], filename: str, line: int | None) -> Callable[[], Any]:
    """Run the cell's statements in ``namespace`` through its failing ``line`` and the rest of that round; the value
    of its last line when that is an expression (as IPython displays it), so the proof reads the loss a cell ends
    with."""
    body, last = list(tree.body), None
    if body and isinstance(body[-1], ast.Expr):
        body, last = body[:-1], ast.Expression(body[-1].value)
    if line is not None:
        _mark_around(body, line)
    code = compile(ast.fix_missing_locations(ast.Module(body=body, type_ignores=[])), filename, "exec")
    tail = compile(last, filename, "eval") if last is not None else None

    bound = sorted({t.id for stmt in body for node in ast.walk(stmt) if isinstance(stmt, (ast.Assign, ast.AnnAssign))
                    for t in [node] if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)})  # fmt: skip

    def run() -> Any:
        namespace[_MARKER] = _Round()
        try:
            exec(code, namespace)  # noqa: S102 - the user's own cell, run again in the user's namespace
            if tail is not None:
                return eval(tail, namespace)  # noqa: S307 - its last line, as IPython shows it
            # What the cell bound: an inference cell (generate(), a pipeline) is judged by its outputs.
            return {name: namespace[name] for name in bound if name in namespace}
        except FailingLineAgain:
            return None  # one round through the failing line ran; a loop of a thousand steps is not run to its end
        finally:
            namespace.pop(_MARKER, None)

    return run


def _mark_around(body: list, line: int) -> bool:
    """Place a mark before and after the innermost statement of ``body`` (nested blocks included) that holds
    ``line``; whether one was found."""
    for i, stmt in enumerate(body):
        if not (stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno)):
            continue
        for block in _blocks(stmt):
            if _mark_around(block, line):
                return True
        body[i:i + 1] = [_mark(stmt, "starts"), stmt, _mark(stmt, "ran")]
        return True
    return False


def _mark(stmt: ast.stmt, event: str) -> ast.stmt:
    call = ast.Call(ast.Attribute(ast.Name(_MARKER, ast.Load()), event, ast.Load()), [], [])
    return ast.copy_location(ast.Expr(call), stmt)


def _blocks(stmt: ast.stmt) -> list[list]:
    """The statement lists nested in ``stmt`` (bodies, else branches, handlers, match cases)."""
    blocks = [getattr(stmt, a) for a in ("body", "orelse", "finalbody") if isinstance(getattr(stmt, a, None), list)]
    blocks += [h.body for h in getattr(stmt, "handlers", ())]
    blocks += [c.body for c in getattr(stmt, "cases", ())]
    return [b for b in blocks if b and isinstance(b[0], ast.stmt)]


class FailingLineAgain(Exception):
    """Raised when a replayed cell is about to run its failing line a second time: the round through it (the rest
    of the cell, or of the loop's iteration, after it) has run, and that is what the proof judges."""


class _Round:
    """Where one replay is: whether the failing line has run."""

    def __init__(self) -> None:
        self.done = False

    def starts(self) -> None:
        if self.done:
            raise FailingLineAgain

    def ran(self) -> None:
        self.done = True


@contextlib.contextmanager
def _silenced() -> Any:
    """A replay prints nothing into the notebook: what the cell prints is the cell's, shown when the user runs it."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


class NamespaceState:
    """A namespace as it was, restorable: names bound, rebound or deleted, the contents of its plain lists, dicts
    and sets, and the values of the tensors among ``names`` (the names a cell reads: a cell may change them in place).
    """

    def __init__(self, namespace: MutableMapping[str, Any], names: Iterable[str]) -> None:
        self.namespace = namespace
        self.bindings = {k: v for k, v in namespace.items() if k not in _SHELL_NAMES}
        # the user's own lists, dicts and sets; never a module's dunders (``__builtins__`` is the builtins' dict)
        self.contents = [(v, _contents(v)) for k, v in self.bindings.items()
                         if type(v) in (list, dict, set) and not k.startswith("__")]  # fmt: skip
        self.tensors = [(v, v.detach().clone()) for k, v in self.bindings.items()
                        if k in names and isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)]  # fmt: skip
        # KV caches the namespace holds (by name, or in a plain container it holds): a replayed generate() appends to
        # them, and a call that raises part-way leaves them half-updated.
        held = [*self.bindings.values(), *(x for _, saved in self.contents for x in _items(saved))]
        self.caches = [CacheState(c) for c in _unique_caches(held)]

    def restore(self) -> None:
        """Put every name, container content and tensor value back (in place: the same objects)."""
        ns = self.namespace
        for k in [k for k in ns if k not in _SHELL_NAMES and k not in self.bindings]:
            del ns[k]
        for k, v in self.bindings.items():
            if k not in ns or ns[k] is not v:
                ns[k] = v
        for container, saved in self.contents:
            if _same_contents(container, saved):
                continue  # untouched: not rewritten (clearing drops references a finalizer may still need)
            container.clear()
            if isinstance(container, dict):
                container.update(saved)
            elif isinstance(container, list):
                container.extend(saved)
            else:
                container.update(saved)
        for tensor, saved in self.tensors:
            _put(tensor, "data", saved)
        for cache in self.caches:
            cache.restore()


def _items(saved: Any) -> list:
    return list(saved.values()) if isinstance(saved, dict) else list(saved)


def _unique_caches(values: Iterable[Any]) -> list[Any]:
    from ..objects.readers.kv_cache import is_cache

    out, seen = [], set()
    for v in values:
        if id(v) not in seen and is_cache(v):
            seen.add(id(v))
            out.append(v)
    return out


class CacheState:
    """A KV cache as it was: the attributes of the cache, its sub-caches and layers (the tensors they point at, the
    contents of their lists), and for a preallocated cache, which writes in place, the values of its tensors."""

    def __init__(self, cache: Any) -> None:
        from ..objects.readers.kv_cache import cache_holders, is_static

        self.holders = [(h, dict(object.__getattribute__(h, "__dict__"))) for h in cache_holders(cache)]
        self.lists = [(v, list(v)) for _, attrs in self.holders for v in attrs.values() if type(v) is list]
        tensors = [t for _, attrs in self.holders for v in attrs.values()
                   for t in (v if type(v) is list else [v]) if isinstance(t, torch.Tensor)] if is_static(cache) else []  # fmt: skip
        self.values = [(t, t.detach().clone()) for t in tensors]

    def restore(self) -> None:
        """Every attribute back to the object it was (in place: the same cache, sub-caches and layers)."""
        for holder, attrs in self.holders:
            d = object.__getattribute__(holder, "__dict__")
            if d.keys() != attrs.keys() or any(d[k] is not v for k, v in attrs.items()):
                d.clear()
                d.update(attrs)
        for lst, saved in self.lists:
            if len(lst) != len(saved) or any(a is not b for a, b in zip(lst, saved)):
                lst[:] = saved
        for tensor, saved in self.values:
            if not torch.equal(tensor, saved):
                _put(tensor, "data", saved)


def _same_contents(container: Any, saved: Any) -> bool:
    """Whether a container holds the very objects it held (identity, not equality: no user ``__eq__`` runs)."""
    if len(container) != len(saved):
        return False
    if isinstance(container, dict):
        return all(k in saved and saved[k] is v for k, v in dict.items(container))
    if isinstance(container, list):
        return all(a is b for a, b in zip(container, saved))
    return {id(x) for x in container} == {id(x) for x in saved}


def _contents(container: Any) -> Any:
    return dict(container) if isinstance(container, dict) else list(container) if isinstance(container, list) else set(container)


def loop_step(tb: TracebackType | None) -> HeldStep | None:
    """The user's own loop body around the line that raised, as a step the proof runs again (``watch()``).

    ``tb`` starts at the frame that ran the watched block (what ``__exit__`` receives). Its line that raised lies
    in a loop's body: the innermost loop around it whose body takes an optimizer step (else the innermost). The
    body runs again in that frame's namespace, with the loop's variables as they were when it raised (the batch
    that failed); a module's or a cell's namespace is restored after each run, a function's is a copy. None when
    the source or the loop cannot be read back (the proof then runs mpdoctor's stand-in step, and says so).
    """
    if tb is None:
        return None
    frame, line = tb.tb_frame, tb.tb_lineno
    filename = frame.f_code.co_filename
    source = "".join(linecache.getlines(filename, frame.f_globals))
    try:
        loop = _loop_around(ast.parse(source), line) if source else None
    except SyntaxError:
        return None
    if loop is None:
        return None
    from ..facts.location import Location

    body = ast.Module(body=list(loop.body), type_ignores=[])
    first, last = loop.body[0].lineno, loop.body[-1].end_lineno or loop.body[-1].lineno
    lines = Location.at(filename, first).label + (f" to line {last}" if last != first else "")
    label = f"your loop's body ({lines}) on the batch it raised on"
    globs = frame.f_globals
    namespace = globs if frame.f_locals is globs else {**globs, **dict(frame.f_locals)}
    why = refusal(body, namespace, "the loop's body")
    if why:
        return HeldStep(_nothing, label, refused=why)
    try:
        code = compile(_one_iteration(body), filename, "exec")
    except SyntaxError:  # a body that returns or yields does not run outside its function
        return None

    def run() -> None:
        exec(code, namespace)  # noqa: S102 - the user's own loop body, run again where it ran

    names = _names_read(body)
    return HeldStep(run, label, around=_silenced, state=lambda: NamespaceState(namespace, names))


#: The loop variable of the one iteration a replayed body runs in (no user's name).
_ONCE = "__mpdoctor_one_iteration"


def _one_iteration(body: ast.Module) -> ast.Module:
    """``body`` as a module to run: inside a loop of one iteration when it holds its loop's own ``continue`` or
    ``break`` (a skipped batch, a bad norm), which end the replayed iteration as they ended the user's; as it is
    otherwise."""
    own = [n for stmt in body.body for n in _own_statements(stmt)]
    if not any(isinstance(n, (ast.Continue, ast.Break)) for n in own):
        return body
    once = ast.For(target=ast.Name(_ONCE, ast.Store()), iter=ast.Tuple([ast.Constant(None)], ast.Load()),
                   body=list(body.body), orelse=[])  # fmt: skip
    ast.copy_location(once, body.body[0])
    return ast.fix_missing_locations(ast.Module(body=[once], type_ignores=[]))


def _own_statements(stmt: ast.AST):
    """``stmt`` and the statements within it that belong to its loop (not to a loop, function or class inside)."""
    yield stmt
    if isinstance(stmt, (ast.For, ast.While, ast.AsyncFor, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return
    for child in ast.iter_child_nodes(stmt):
        if isinstance(child, ast.stmt):
            yield from _own_statements(child)


def _loop_around(tree: ast.Module, line: int) -> ast.stmt | None:
    """The loop whose body holds ``line``: the innermost whose body takes an optimizer step, else the innermost."""
    loops = [n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While, ast.AsyncFor)) and n.body
             and n.body[0].lineno <= line <= (n.body[-1].end_lineno or n.body[-1].lineno)]  # fmt: skip
    loops.sort(key=lambda n: n.body[0].lineno, reverse=True)  # innermost first
    stepping = [n for n in loops if _takes_a_step(n.body)]
    return stepping[0] if stepping else (loops[0] if loops else None)


def _takes_a_step(body: list) -> bool:
    """Whether a loop body calls ``<something>.step(...)`` (an optimizer's, a scaler's) itself."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "step"
               for stmt in body for n in ast.walk(stmt))  # fmt: skip
