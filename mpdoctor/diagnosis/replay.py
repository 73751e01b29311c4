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

A replay stops after the cell's first optimizer step: a cell that trains for a thousand steps is judged on its first,
and the proof never runs the user's loop to its end.
"""

from __future__ import annotations

import ast
import contextlib
import io
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

import torch

from .proof import HeldStep, _put

#: Names bound in a notebook namespace by IPython itself, never the cell's doing.
_SHELL_NAMES = frozenset({"_", "__", "___", "_i", "_ii", "_iii", "_oh", "_ih", "_dh", "In", "Out", "exit", "quit"})


def cell_step(source: str, namespace: MutableMapping[str, Any], label: str, filename: str = "<cell>") -> HeldStep:
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
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return HeldStep(_nothing, label, refused="its source could not be read back")
    why = refusal(tree, namespace)
    if why:
        return HeldStep(_nothing, label, refused=why)
    run = _runner(tree, namespace, filename)
    names = _names_read(tree)
    return HeldStep(run, label, around=_silenced, state=lambda: NamespaceState(namespace, names))


def _nothing() -> None:
    return None


def refusal(tree: ast.Module, namespace: MutableMapping[str, Any]) -> str:
    """Why a cell must not be replayed (``""`` when it may), read from its syntax tree and the names it uses."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _called_name(node) == "get_ipython":
            return f"the cell runs IPython magics or shell commands (line {node.lineno}), which a replay cannot undo"
        if isinstance(node, ast.Call) and _called_name(node) in ("next", "iter"):
            return (f"the cell reads a data iterator ({_called_name(node)}(...), line {node.lineno}); replaying it "
                    "would hand your next batch to the check")  # fmt: skip
        iterated = _iterated(node)
        if iterated is not None:
            name = next((n for n in _names_in(iterated) if _is_data_stream(namespace.get(n))), None)
            if name is not None:
                return (f"the cell reads a data iterator (a loop over {name}, line {node.lineno}); replaying it "
                        "would hand your next batch to the check")  # fmt: skip
        for target in _bound_names(node):
            if _is_training_object(namespace.get(target)):
                return (f"the cell builds {target} anew (line {node.lineno}); a replay would check a fresh object, "
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


def _mro(value: Any) -> tuple:
    return type.__dict__["__mro__"].__get__(type(value))  # the class's own MRO: no user __getattr__ runs


def _is_data_stream(value: Any) -> bool:
    """An iterator (it has ``__next__``: iterating it consumes it) or a DataLoader-like loader."""
    if value is None:
        return False
    classes = _mro(value)
    if any("__next__" in vars(c) for c in classes if c is not object):
        return True
    return any(c.__name__.endswith("DataLoader") or c is torch.utils.data.IterableDataset for c in classes)


def _is_training_object(value: Any) -> bool:
    from ..compat import grad_scaler_class

    return isinstance(value, (torch.nn.Module, torch.optim.Optimizer, grad_scaler_class()))


def _names_read(tree: ast.Module) -> frozenset[str]:
    return frozenset(n.id for n in ast.walk(tree) if isinstance(n, ast.Name))


def _runner(tree: ast.Module, namespace: MutableMapping[str, Any], filename: str) -> Callable[[], Any]:
    """Run the cell's statements in ``namespace``; the value of its last line when that is an expression (as IPython
    displays it), so the proof reads the loss a cell ends with."""
    body, last = tree.body, None
    if body and isinstance(body[-1], ast.Expr):
        body, last = body[:-1], ast.Expression(body[-1].value)
    code = compile(ast.Module(body=body, type_ignores=[]), filename, "exec")
    tail = compile(last, filename, "eval") if last is not None else None

    def run() -> Any:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        handle = register_optimizer_step_post_hook(_stop_after_the_step)
        try:
            exec(code, namespace)  # noqa: S102 - the user's own cell, run again in the user's namespace
            return eval(tail, namespace) if tail is not None else None  # noqa: S307 - its last line, as IPython shows it
        except FirstStepDone:
            return None  # one training step is the proof; a cell that loops over a thousand is not run to its end
        finally:
            handle.remove()

    return run


class FirstStepDone(Exception):
    """Raised after the first optimizer step of a replayed cell: that step is what the proof judges."""


def _stop_after_the_step(optimizer: Any, args: tuple, kwargs: dict) -> None:
    raise FirstStepDone


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
        self.contents = [(v, _contents(v)) for k, v in self.bindings.items() if type(v) in (list, dict, set)]
        self.tensors = [(v, v.detach().clone()) for k, v in self.bindings.items()
                        if k in names and isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)]  # fmt: skip

    def restore(self) -> None:
        """Put every name, container content and tensor value back (in place: the same objects)."""
        ns = self.namespace
        for k in [k for k in ns if k not in _SHELL_NAMES and k not in self.bindings]:
            del ns[k]
        for k, v in self.bindings.items():
            if k not in ns or ns[k] is not v:
                ns[k] = v
        for container, saved in self.contents:
            container.clear()
            if isinstance(container, dict):
                container.update(saved)
            elif isinstance(container, list):
                container.extend(saved)
            else:
                container.update(saved)
        for tensor, saved in self.tensors:
            _put(tensor, "data", saved)


def _contents(container: Any) -> Any:
    return dict(container) if isinstance(container, dict) else list(container) if isinstance(container, list) else set(container)
