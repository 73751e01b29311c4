"""A code fix run before it is shown: on twins of the user's objects, for a few steps.

Some fixes are code, not a change mpdoctor can make to live objects: the corrected lines of the user's own AMP loop,
or a cast written with the user's names before the cell that raised. Such code is the user's to run, in their cell.
Before the report shows it, :func:`try_on_twins` runs that exact code on deep copies of the objects it names (one
copy, so a model and the optimizer holding its parameters stay wired together), with the random streams forked and
given back, the loop observers aside and the output swallowed, and stops it after a few optimizer steps. The report
then says what happened on the copies (:meth:`TwinTrial.sentence`): "ran 3 steps on copies of your objects: loss
4.1 → 3.8, parameters moved, all finite", or the exception it raised. The user's objects are never touched.

What is shared with the twins rather than copied: modules of code, functions, classes, and data sources (a
DataLoader, a Dataset): a new iterator over a loader reads it without changing it. What is refused (the reason is
shown): code that runs IPython magics or shell commands, objects that cannot be copied (an open iterator, a lock),
and objects whose copy would take more than :data:`COPY_BUDGET_BYTES`.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import copy
import io
import math
import random
import types
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

#: Above this many bytes of tensors to copy, the code is not run on twins (the report says so).
COPY_BUDGET_BYTES = 512 * 2**20
#: Optimizer steps after which a trial stops: enough to see the loop train, cheap on a notebook's model.
TRIAL_STEPS = 3
#: Forward calls of the copied models after which a trial stops even without its optimizer steps.
_FORWARDS_PER_STEP = 16

_SHELL_NAMES = frozenset({"_", "__", "___", "_i", "_ii", "_iii", "_oh", "_ih", "_dh", "In", "Out", "exit", "quit",
                          "get_ipython"})  # fmt: skip


@dataclass(frozen=True)
class TwinTrial:
    """What a code fix did on twins of the user's objects.

    Attributes
    ----------
    refused : str
        Why it was not run ("" when it was).
    error : str
        The exception it raised on the twins ("" when none).
    steps : int
        Optimizer steps it took (it stops after :data:`TRIAL_STEPS`).
    losses : tuple of float
        The loss at each of those steps (a scalar tensor the code binds to a name holding "loss").
    moved : bool
        A parameter of the twins' optimizers changed.
    finite : bool
        Every parameter of the twins' optimizers, and every loss, is finite after the run.
    optimizers : int
        Optimizers among the copies (a code without one is judged by running without an error).
    """

    refused: str = ""
    error: str = ""
    steps: int = 0
    losses: tuple = ()
    moved: bool = False
    finite: bool = True
    optimizers: int = 0

    @property
    def ran(self) -> bool:
        """It ran to its end (or through its last allowed step) without raising."""
        return not self.refused and not self.error

    @property
    def trains(self) -> bool:
        """It ran, and where it stepped an optimizer, it moved the parameters and everything stayed finite."""
        return self.ran and self.finite and (self.moved if self.optimizers else True)

    def sentence(self) -> str:
        """What the report says of it, plainly."""
        if self.refused:
            return f"not run on copies of your objects: {self.refused}"
        if self.error:
            return f"run on copies of your objects, this code raised {self.error}"
        if not self.steps and self.optimizers:
            return ("ran on copies of your objects, but took no optimizer step (each was skipped, or the code steps "
                    "none)")  # fmt: skip
        if not self.steps:
            return "ran on copies of your objects without an error" + ("" if self.finite else ", but a loss is not finite")
        losses = ""
        if self.losses:
            first, last = self.losses[0], self.losses[-1]
            losses = f": loss {first:.4g}" + (f" → {last:.4g}" if len(self.losses) > 1 else "")
        plural = "s" if self.steps != 1 else ""
        state = ("parameters moved, all finite" if self.moved and self.finite
                 else "but a parameter or a loss is not finite" if not self.finite
                 else "but no parameter moved")  # fmt: skip
        return f"ran {self.steps} optimizer step{plural} on copies of your objects{losses}; {state}"


class _Enough(BaseException):
    """Raised from an optimizer step hook once the trial has taken its steps (a BaseException: a user's
    ``except Exception`` around the step does not swallow it)."""


def try_on_twins(code: str, namespace: Mapping[str, Any], steps: int = TRIAL_STEPS,
                 around: Callable[[], Any] | None = None) -> TwinTrial:  # fmt: skip
    """Run ``code`` in a namespace of twins of the objects of ``namespace`` it names, for at most ``steps`` optimizer
    steps; ``around`` is a context the run happens in (the loop observers stand aside). Never raises for what the
    code does: the outcome says it."""
    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        return TwinTrial(refused=f"the code could not be read ({exc.msg}, line {exc.lineno})")
    why = _refusal(tree)
    if why:
        return TwinTrial(refused=why)
    names = sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} & set(namespace) - _SHELL_NAMES)
    held = {name: namespace[name] for name in names}
    size = _tensor_bytes(held.values())
    if size > COPY_BUDGET_BYTES:
        return TwinTrial(refused=f"copying your objects would take {size / 2**30:.1f} GiB")
    with _streams_given_back():
        try:
            twins = _twins(held)
        except Exception as exc:
            return TwinTrial(refused=f"your objects could not be copied ({_described(exc)})")
        return _run(tree, twins, steps, around)


def _refusal(tree: ast.Module) -> str:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "get_ipython":
            return f"it runs IPython magics or shell commands (line {node.lineno}), which do not run on copies"
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
            a.name.split(".")[0] in ("subprocess", "multiprocessing") for a in node.names
        ):
            return f"it starts processes (line {node.lineno})"
    return ""


def _shared(value: Any) -> bool:
    """Values the twins share with the user: code, types, and data sources read without being changed."""
    if isinstance(value, (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type, str, bytes, int,
                          float, bool, type(None), torch.dtype, torch.device)):  # fmt: skip
        return True
    return isinstance(value, (torch.utils.data.DataLoader, torch.utils.data.Dataset))


def _tensor_bytes(values: Any) -> int:
    """The bytes of the distinct tensors a copy of ``values`` would duplicate (parameters, buffers, optimizer
    state, plain tensors), read one level into modules and optimizers."""
    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen[id(t)] = t.numel() * t.element_size()

    for value in values:
        if _shared(value):
            continue
        if isinstance(value, torch.nn.Module):
            for t in (*value.parameters(), *value.buffers()):
                add(t)
        elif isinstance(value, torch.optim.Optimizer):
            for state in value.state.values():
                for t in state.values() if isinstance(state, dict) else ():
                    add(t)
        else:
            add(value)
    return sum(seen.values())


def _twins(held: dict[str, Any]) -> dict[str, Any]:
    """One deep copy of ``held``: objects that reference each other stay wired together in the copy."""
    memo: dict[int, Any] = {id(v): v for v in held.values() if _shared(v)}
    for value in held.values():
        if isinstance(value, torch.utils.data.DataLoader):
            memo[id(value.dataset)] = value.dataset
        for t in _graph_outputs(value):  # a loss from the last step: its value, without the graph behind it
            memo[id(t)] = t.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scalers = [(s, _scaler_twin(s, memo)) for s in _scalers(held.values())]
        twins = copy.deepcopy(held, memo)
    for value in held.values():
        _carry_wrappers(value, memo)
    for scaler, twin in scalers:  # per optimizer, by id: the twin's entries under the twin optimizers' ids
        for key, state in scaler._per_optimizer_states.items():
            optimizer = memo.get(key)  # deepcopy's memo is keyed by the original's id: the twin optimizer
            if optimizer is not None:
                twin._per_optimizer_states[id(optimizer)] = copy.deepcopy(state, memo)
    return twins


def _carry_wrappers(original: Any, memo: dict[int, Any]) -> None:
    """A fix's wrapper on an instance (an fp32 island around ``opt.step``) given to the instance's twin, where the
    class's own pickling leaves it out (torch's ``Optimizer.__getstate__`` keeps only its defaults, state and
    groups): the twin runs as the fixed original does, over its own method."""
    from ...objects.edits.steps import CastingCall

    twin = memo.get(id(original))
    if twin is None or twin is original:
        return
    try:
        own, theirs = object.__getattribute__(original, "__dict__"), object.__getattribute__(twin, "__dict__")
    except AttributeError:
        return
    for key, value in list(own.items()):
        if isinstance(value, CastingCall) and key not in theirs:
            theirs[key] = copy.deepcopy(value, memo)


def _scalers(values: Any) -> list:
    """The GradScalers among ``values`` and their attributes (an Accelerator's ``scaler``)."""
    from torch.amp import GradScaler

    out: list = []
    for value in values:
        for candidate in (value, *(getattr(value, "__dict__", {}) or {}).values()):
            if isinstance(candidate, GradScaler) and all(candidate is not s for s in out):
                out.append(candidate)
    return out


def _scaler_twin(scaler: Any, memo: dict[int, Any]) -> Any:
    """A GradScaler's twin, in the middle of an iteration too (its pickling refuses that): the same scale, growth
    tracker and settings, and each optimizer's stage of the iteration (filled in once the optimizers are copied)."""
    twin = type(scaler).__new__(type(scaler))
    memo[id(scaler)] = twin
    for key, value in scaler.__dict__.items():
        if key != "_per_optimizer_states":
            twin.__dict__[key] = copy.deepcopy(value, memo)
    states = scaler.__dict__.get("_per_optimizer_states")
    twin.__dict__["_per_optimizer_states"] = type(states)(states.default_factory) if states is not None else states
    return twin


def _graph_outputs(value: Any, depth: int = 2) -> Iterator[torch.Tensor]:
    """Tensors computed by autograd among ``value`` and the lists, tuples and dicts it holds (``depth`` levels):
    torch refuses to deep-copy them."""
    if isinstance(value, torch.Tensor):
        if value.grad_fn is not None:
            yield value
    elif depth and isinstance(value, (list, tuple, dict)):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _graph_outputs(item, depth - 1)


def _optimizers(twins: dict[str, Any]) -> list[torch.optim.Optimizer]:
    out: list[torch.optim.Optimizer] = []
    for value in twins.values():
        inner = getattr(value, "optimizer", None)  # accelerate's and Lightning's wrappers hold the real one
        for opt in (value, inner):
            if isinstance(opt, torch.optim.Optimizer) and all(opt is not o for o in out):
                out.append(opt)
    return out


def _run(tree: ast.Module, twins: dict[str, Any], steps: int, around: Callable[[], Any] | None) -> TwinTrial:
    namespace: dict[str, Any] = {"__builtins__": builtins, "__name__": "__mpdoctor_twins__", **twins}
    optimizers = _optimizers(twins)
    params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    if any(p.is_floating_point() and not bool(torch.isfinite(p.detach()).all()) for p in params):
        return TwinTrial(refused="your parameters already hold NaN or inf (an earlier run wrote them), so no code can "
                                 "train them; build them again, then run this code")  # fmt: skip
    before = [p.detach().clone() for p in params]
    losses: list[float] = []

    taken: list[int] = []
    forwards: list[int] = []

    def after_step(*_args: Any) -> None:
        loss = next((v for k, v in namespace.items() if "loss" in k.lower() and isinstance(v, torch.Tensor)
                     and v.numel() == 1 and v.is_floating_point()), None)  # fmt: skip
        if loss is not None:
            losses.append(float(loss.detach().float()))
        taken.append(1)
        if len(taken) >= steps:
            raise _Enough

    def before_forward(*_args: Any) -> None:
        forwards.append(1)  # a loop whose every step is skipped (an fp16 overflow) still ends
        if len(forwards) > _FORWARDS_PER_STEP * steps:
            raise _Enough

    handles = [opt.register_step_post_hook(after_step) for opt in optimizers]
    handles += [m.register_forward_pre_hook(before_forward) for m in twins.values() if isinstance(m, torch.nn.Module)]
    error = ""
    try:
        with around() if around is not None else contextlib.nullcontext(), _quiet():
            exec(compile(tree, "<mpdoctor: the fix on copies of your objects>", "exec"), namespace)  # noqa: S102
    except _Enough:
        pass
    except Exception as exc:
        error = _described(exc)
    finally:
        for handle in handles:
            handle.remove()
    moved = any(not torch.equal(p.detach(), b) for p, b in zip(params, before))
    finite = all(bool(torch.isfinite(p.detach()).all()) for p in params if p.is_floating_point()) and all(
        math.isfinite(x) for x in losses
    )
    return TwinTrial(error=error, steps=len(taken), losses=tuple(losses), moved=moved, finite=finite,
                     optimizers=len(optimizers))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """What the code prints or warns on the copies is not the user's cell output."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings():  # fmt: skip
        warnings.simplefilter("ignore")
        yield


@contextlib.contextmanager
def _streams_given_back() -> Iterator[None]:
    """The random streams (torch's CPU and CUDA generators, Python's, NumPy's) as they were, after the trial: the
    twins draw what the user's next step would draw, and the user's run draws it again."""
    state = random.getstate()
    np_random = _numpy_random()
    np_state = np_random.get_state() if np_random is not None else None
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(state)
        if np_random is not None:
            np_random.set_state(np_state)


def _numpy_random() -> Any:
    import sys

    np = sys.modules.get("numpy")
    return getattr(np, "random", None) if np is not None else None


def _described(exc: BaseException) -> str:
    from ...redact import describe_exception

    return describe_exception(exc)
