"""A fix is proven on the patient: the user's failing step, run before and after each planned fix.

Where mpdoctor holds the step that failed, the plan is checked on it: ``diagnose(..., step=fn)`` and
``%mpdoctor --step NAME``; the notebook cell that raised (:mod:`mpdoctor.diagnosis.replay`); the batch ``watch()``
held when the loop raised; the probe's batch (forward and backward). Each is a :class:`HeldStep`. The step runs once
as it is, then after each planned fix in order. A fix after which the step runs and trains is *verified*; one
after which the step raises, or stops training where it trained before, is *tried*: taken out of the plan and shown
with what happened.

The proof leaves the run exactly as it found it: every fix it applied is undone (each is exact to undo), and the
state a step changes (parameters, gradients and buffers of the models, their module tree: children and own
attributes, so an adapter a step injects is taken out; optimizer state and hyperparameters, the GradScaler's scale
and trackers, torch's, Python's and NumPy's random streams) is restored from a snapshot taken before the first run.
A step should take its batch from a variable, not from ``next(iterator)``: an iterator the step advances cannot be
rewound: a held step that would advance one is refused (:attr:`HeldStep.refused`) and the report says why its fixes
are not verified.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import sys
import types
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..objects.live.introspect import own_dict
from ..redact import describe_exception


@dataclass(frozen=True)
class StepOutcome:
    """What one run of the user's step did.

    Attributes
    ----------
    ran : bool
        It returned without raising.
    trained : bool
        All of: it ran; the loss it returned (if any) is finite; gradients reached the trainable parameters and
        some are non-zero; an optimizer step applied them (a parameter that received a non-zero gradient changed);
        every trainable parameter stayed finite. A step with no optimizer (the probe's forward and backward) trains
        when its gradients are finite and one is non-zero.
    error : str or None
        The exception it raised, one line.
    loss : float or None
        What the step returned, when it returned a number or a scalar tensor.
    why : str
        Why a step that ran did not train (``"no gradient reached the parameters"``); empty when it trained.
    at : str
        The innermost module whose forward was running when the step raised (its name among the diagnosed models,
        else its class): the same error raised by another module is another failure.
    inference : bool
        The step ran no backward and no optimizer step (``generate()``, a pipeline call, an evaluation): it is
        judged by its output, and ``trained`` then means it ran and every floating tensor it returned (for a
        replayed cell: every value it bound) is finite.
    """

    ran: bool
    trained: bool
    error: str | None = None
    loss: float | None = None
    why: str = ""
    at: str = ""
    inference: bool = False

    def fails_as(self, other: StepOutcome) -> bool:
        """It raised as ``other`` did: the same error, in the same module."""
        return not self.ran and not other.ran and self.error == other.error and self.at == other.at

    def describe(self) -> str:
        """One phrase: ``"it ran and trained (loss 0.42)"``, ``"it raised RuntimeError: ..."``."""
        if not self.ran:
            return f"it raised {str(self.error).rstrip('.')}"  # the sentence goes on after it
        if self.inference:
            what = "its output is finite" if self.trained else (self.why or "its output is not finite")
            return f"it ran and {what} (an inference step: no backward, no optimizer step)"
        loss = f" (loss {self.loss:.4g})" if self.loss is not None else ""
        if self.trained:
            return f"it ran and trained{loss}"
        return f"it ran, but {self.why or 'it did not train'}{loss}"


class RunState:
    """A snapshot of what a training step changes, restorable exactly (values, dtypes and identities)."""

    def __init__(self, modules: Iterable[Any], optimizers: Iterable[Any], scalers: Iterable[Any],
                 extra: Callable[[], Any] | None = None) -> None:  # fmt: skip
        self.modules = _unique(modules)
        self.optimizers = _unique(optimizers)
        self.scalers = _unique(scalers)
        # each tensor's values, and its gradient object itself: runs write into copies of it (shield), so it is
        # put back by identity, its values and version counter never touched
        self.tensors = [(t, t.data.clone(), t.grad, t.requires_grad) for m in self.modules for t in _module_tensors(m)]
        subs = [sub for m in self.modules for sub in _submodules(m)]
        self.modes = [(sub, sub.training) for sub in subs]
        # the module tree: a step that injects an adapter swaps children and adds attributes (PEFT's ``peft_config``)
        self.trees = [_ModuleTree(sub) for sub in subs]
        self.schedulers = _scheduler_states(self.optimizers)
        self.opt_state = [(o, {p: _clone(s) for p, s in o.state.items()}, [_group_options(g) for g in o.param_groups])
                          for o in self.optimizers]  # fmt: skip
        # the optimizer's own flags (a scheduler's wrapper sets ``_opt_called`` on the first step), and which exist
        self.opt_flags = [(o, set(vars(o)), {k: v for k, v in vars(o).items() if type(v) in (bool, int, float, str)})
                          for o in self.optimizers]  # fmt: skip
        self.scaler_state = [(s, {k: _clone(v) for k, v in vars(s).items()}) for s in self.scalers]
        self.rng = _rng_state()
        #: What else the step changes, snapshotted by its own owner (a notebook cell's namespace): has ``restore()``.
        self.extra = extra() if extra is not None else None

    def shield(self) -> None:
        """Before a run: each tensor gets a copy of its gradient, so a step (``zero_grad``, a backward that
        accumulates) writes into the copy, never into the user's gradient tensors."""
        for t, _, grad, _ in self.tensors:
            if grad is not None and t.grad is grad:
                t.grad = grad.clone()

    def restore(self) -> None:
        """Put every value back as it was when the snapshot was taken: values in place where they changed (an
        unchanged tensor is not written: its version counter stays), gradients by identity."""
        for t, data, grad, requires_grad in self.tensors:
            current = t.data
            if not (current.dtype == data.dtype and current.shape == data.shape and _equal(current, data)):
                _put(t, "data", data)
            if t.grad is not grad:
                _set_grad(t, grad)
            if t.requires_grad != requires_grad and t.is_leaf:
                t.requires_grad_(requires_grad)
        for tree in self.trees:
            tree.restore()
        for sub, training in self.modes:
            if sub.training != training:
                sub.train(training)
        for scheduler, saved in self.schedulers:
            scheduler.load_state_dict(copy.deepcopy(saved))
        for o, state, groups in self.opt_state:
            o.state.clear()
            o.state.update({p: _clone(s) for p, s in state.items()})
            for g, options in zip(o.param_groups, groups):
                g.update(_clone(options))
        for o, names, flags in self.opt_flags:
            for k in set(vars(o)) - names:
                delattr(o, k)
            vars(o).update(flags)
        for s, attrs in self.scaler_state:
            vars(s).clear()
            vars(s).update({k: _clone(v) for k, v in attrs.items()})
        if self.extra is not None:
            self.extra.restore()
        _set_rng_state(self.rng)


_ABSENT = object()
#: A module's own containers whose entries a step may swap (an adapter layer put in a child's place).
_CONTAINERS = ("_modules", "_parameters", "_buffers")
#: Own attributes :class:`RunState` restores its own way: the mode, through ``train()`` (a module may override it).
_RESTORED_ELSEWHERE = frozenset({"training"})


class _ModuleTree:
    """One module's own attributes and its children, parameters and buffers, by identity: a step that swaps a child
    (an adapter layer injected in its place) or adds an attribute (``peft_config``) is undone by putting them back."""

    def __init__(self, module: Any) -> None:
        own = own_dict(module)
        self.own = own
        self.attrs = {k: v for k, v in own.items() if k not in _RESTORED_ELSEWHERE}
        self.entries = {name: dict(own[name]) for name in _CONTAINERS if isinstance(own.get(name), dict)}

    def restore(self) -> None:
        """The same attributes holding the same objects, the same entries in each container (the containers
        themselves kept, so references to them stay valid); an unchanged module is not written."""
        own = self.own
        for name, saved in self.entries.items():
            held = own.get(name)
            if isinstance(held, dict) and (held.keys() != saved.keys() or any(held[k] is not v for k, v in saved.items())):
                held.clear()
                held.update(saved)
        for key in [k for k in own if k not in self.attrs and k not in _RESTORED_ELSEWHERE]:
            del own[key]
        for key, value in self.attrs.items():
            if own.get(key, _ABSENT) is not value:
                own[key] = value


def _submodules(module: Any) -> list:
    try:
        return list(module.modules())
    except Exception:  # a module whose tree cannot be walked keeps its modes as they are
        return []


def _scheduler_states(optimizers: list) -> list:
    """``(scheduler, state_dict)`` of each learning-rate scheduler that drives one of ``optimizers``: a step that
    calls ``scheduler.step()`` moves it, and the proof puts it back."""
    if not optimizers:
        return []
    import gc

    from torch.optim import lr_scheduler

    kinds = tuple(k for k in (getattr(lr_scheduler, "LRScheduler", None), getattr(lr_scheduler, "_LRScheduler", None),
                              getattr(lr_scheduler, "ReduceLROnPlateau", None)) if k is not None)  # fmt: skip
    ids = {id(o) for o in optimizers}
    out = []
    for obj in gc.get_objects():
        if kinds and issubclass(type(obj), kinds) and id(getattr(obj, "optimizer", None)) in ids:
            try:
                out.append((obj, copy.deepcopy(obj.state_dict())))
            except Exception:  # a scheduler whose state cannot be copied is left to the step
                continue
    return out


def _set_grad(t: Any, grad: Any) -> None:
    try:
        t.grad = grad
    except RuntimeError:  # the tensor's dtype or shape is not yet its own again: put the gradient's values back
        t.grad = None if grad is None else grad.detach().clone().to(t.dtype)


def _put(t: Any, attr: str, saved: Any) -> None:
    current = getattr(t, attr)
    if current is not None and current.dtype == saved.dtype and current.shape == saved.shape and current.device == saved.device:
        with torch.no_grad():
            current.copy_(saved)
    else:
        setattr(t, attr, saved.clone())


def _unique(objs: Iterable[Any]) -> list:
    out, seen = [], set()
    for o in objs:
        if o is not None and id(o) not in seen:
            seen.add(id(o))
            out.append(o)
    return out


def _module_tensors(module: Any) -> list:
    seen: set[int] = set()
    out = []
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _clone(value: Any) -> Any:
    """A copy a step cannot reach: tensors cloned, containers deep-copied (their types kept: a GradScaler's
    defaultdict stays one); numbers, strings and tuples of them are immutable and kept as the same objects."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (dict, list, set)):
        return copy.deepcopy(value)
    return value


def _group_options(group: dict) -> dict:
    return {k: _clone(v) for k, v in group.items() if k != "params"}


def _rng_state() -> dict:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


#: Steps mpdoctor is running to prove a fix, now (a count: a proof inside a proof's step is still one).
_PROVING = [0]


def is_proving() -> bool:
    """Whether the code running now is a step mpdoctor runs to prove a fix: what watches the user's loop
    (:class:`~mpdoctor.attach.runtime.backward_count.BackwardCounter`) does not count it as the loop's."""
    return _PROVING[0] > 0


class _Gradients:
    """What backward delivered to each trainable parameter during one run: read by hooks as each gradient is made
    (a step that zeroes its gradients after the optimizer step leaves no ``.grad`` to read afterwards)."""

    def __init__(self, params: list) -> None:
        self.reached: set[int] = set()  # parameters that received a gradient
        self.nonzero: set[int] = set()  # ... a finite, non-zero one
        self.handles = []
        for i, p in enumerate(params):
            try:
                self.handles.append(p.register_hook(self._reader(i)))
            except RuntimeError:  # a parameter torch does not let hooks on: its .grad is read after the run
                continue

    def _reader(self, i: int) -> Callable[[Any], None]:
        def read(grad: Any) -> None:
            self.reached.add(i)
            try:
                if bool(grad.any()) and bool(torch.isfinite(grad).any()):
                    self.nonzero.add(i)
            except Exception:  # a gradient that cannot be read (a sparse or meta tensor) counts as reaching
                self.nonzero.add(i)

        return read

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def run_step(step: Callable[[], Any], modules: Iterable[Any], optimizers: Iterable[Any]) -> StepOutcome:
    """Run ``step()`` once and judge whether it trained (see :class:`StepOutcome`); it never raises."""
    params = [p for m in _unique(modules) for p in m.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]  # by identity: a step that ran no backward leaves every one as it was
    from torch.optim.optimizer import register_optimizer_step_post_hook

    stepped = [0]
    hook = register_optimizer_step_post_hook(lambda *args: stepped.__setitem__(0, stepped[0] + 1))
    fresh = _Fresh(params)
    seen = _Gradients(params)
    running = _Running(modules)
    _PROVING[0] += 1
    try:
        returned = step()
    except Exception as exc:  # the step's failure is the outcome
        return StepOutcome(False, False, describe_exception(exc), at=running.innermost())
    finally:
        _PROVING[0] -= 1
        seen.remove()
        running.remove()
        hook.remove()
        fresh.remove()
    if not seen.reached and not stepped[0] and all(p.grad is g for p, g in zip(params, grads)):
        why = _nonfinite_output(returned)
        return StepOutcome(True, not why, why=why, inference=True)
    loss = _number(returned)
    for i, p in enumerate(params):  # gradients made outside the hooks' reach (a step that ran no backward now)
        g = p.grad
        if i not in seen.reached and g is not None and g.dtype.is_floating_point:
            seen.reached.add(i)
            if bool(g.any()) and bool(torch.isfinite(g).any()):
                seen.nonzero.add(i)
    why = _not_trained(params, before, seen, loss, bool(_unique(optimizers)), fresh.why(modules))
    return StepOutcome(True, not why, loss=loss, why=why)


class _Fresh:
    """Parameters the step made trainable itself (an adapter it added to a frozen model), as each optimizer step met
    them: those with a finite, non-zero gradient, valued just before that step (a global optimizer pre-hook). Read
    only when no parameter of the models was trainable before the step (``params`` empty): otherwise those judge
    the step, and nothing is copied."""

    def __init__(self, params: list) -> None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self.known = {id(p) for p in params}
        self.found: dict[int, tuple[Any, torch.Tensor]] = {}
        self.handle = register_optimizer_step_pre_hook(self._before_step) if not params else None

    def _before_step(self, optimizer: Any, *args: Any) -> None:
        for group in getattr(optimizer, "param_groups", ()):
            for p in group.get("params", ()):
                g = getattr(p, "grad", None)
                if id(p) in self.known or id(p) in self.found or g is None or not g.dtype.is_floating_point:
                    continue
                if bool(g.any()) and bool(torch.isfinite(g).all()):
                    self.found[id(p)] = (p, p.detach().clone())

    def why(self, modules: Iterable[Any]) -> str | None:
        """Why the parameters of ``modules`` the step made trainable did not train (``""``: one moved at an optimizer
        step and all stayed finite); None when the step made none that an optimizer stepped with a gradient."""
        owned = {id(p) for m in _unique(modules) for p in m.parameters()}
        ours = [(p, value) for key, (p, value) in self.found.items() if key in owned]
        if not ours:
            return None
        if not all(bool(torch.isfinite(p.detach()).all()) for p, _ in ours):
            return "a parameter the step made trainable became inf/NaN"
        moved = any(not torch.equal(p.detach(), value) for p, value in ours)
        return "" if moved else "no optimizer step moved the parameters the step made trainable"

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()


class _Running:
    """The modules whose forward is running, innermost last, through torch's global module hooks (a forward that
    raises never reaches its post-hook, so the innermost one left is where the step raised). Removed after the run."""

    def __init__(self, modules: Iterable[Any]) -> None:
        self.names = {id(sub): f"{i}.{name}" if name else str(i)
                      for i, model in enumerate(_unique(modules)) for name, sub in model.named_modules()}  # fmt: skip
        self.stack: list = []
        hooks = torch.nn.modules.module
        self.handles = (hooks.register_module_forward_pre_hook(self._enter),
                        hooks.register_module_forward_hook(self._leave))  # fmt: skip

    def _enter(self, module: Any, args: Any) -> None:
        self.stack.append(module)

    def _leave(self, module: Any, args: Any, output: Any) -> None:
        while self.stack:
            if self.stack.pop() is module:
                break

    def innermost(self) -> str:
        if not self.stack:
            return ""
        module = self.stack[-1]
        return self.names.get(id(module), type(module).__name__)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.stack.clear()


def _equal(a: torch.Tensor, b: torch.Tensor, depth: int = 0) -> bool:
    """``torch.equal``, also for tensor subclasses that do not implement it (torchao's ``Float8Tensor``): their inner
    tensors (``__tensor_flatten__``) compared one by one."""
    try:
        return bool(torch.equal(a, b))
    except (NotImplementedError, RuntimeError, TypeError):
        flatten = getattr(type(a), "__tensor_flatten__", None)
        if flatten is None or type(a) is not type(b) or depth > 3:
            return False
        names, _ = flatten(a)
        return all(_equal(getattr(a, n), getattr(b, n), depth + 1) for n in names)


def _not_trained(params: list, before: list, seen: _Gradients, loss: float | None, has_optimizer: bool,
                 made: str | None = None) -> str:  # fmt: skip
    """Why a step that ran did not train (``""`` when it did). ``made``: the same of the parameters the step made
    trainable itself, an adapter it added (:meth:`_Fresh.why`; None when it made none)."""
    if loss is not None and not math.isfinite(loss):
        return "its loss is inf/NaN"
    if any(not bool(torch.isfinite(p.detach()).all()) and bool(torch.isfinite(before[i]).all())
           for i, p in enumerate(params)):  # one already inf/NaN before the step (another model's) is not this step's
        return "a parameter became inf/NaN"
    if not params:
        return made if made is not None else "no parameter of the diagnosed models is trainable"
    if not seen.nonzero:
        return "no gradient reached the parameters" if not seen.reached else "every gradient was zero or inf/NaN"
    if not has_optimizer:
        finite = all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)
        return "" if finite else "a gradient is inf/NaN"
    moved = any(p.dtype != before[i].dtype or not torch.equal(p.detach(), before[i]) for i, p in enumerate(params)
                if i in seen.nonzero)  # fmt: skip
    return "" if moved else "no optimizer step applied the gradients (a step skipped, or none taken)"


def _nonfinite_output(value: Any, depth: int = 4) -> str:
    """Why an inference step's output is not finite: the first floating tensor (or array) in ``value`` (tensors,
    sequences, mappings, model outputs; a replayed cell's bound values) holding inf/NaN; "" when there is none."""
    seen: list = [0]

    def visit(v: Any, level: int) -> str:
        seen[0] += 1
        if seen[0] > 10_000 or level > depth:
            return ""
        if isinstance(v, torch.Tensor):
            if v.dtype.is_floating_point and v.numel() and not bool(torch.isfinite(v.detach()).all()):
                return "its output holds inf/NaN"
            return ""
        if type(v).__module__ == "numpy" and getattr(getattr(v, "dtype", None), "kind", "") == "f":
            return "" if bool(__import__("numpy").isfinite(v).all()) else "its output holds inf/NaN"
        if isinstance(v, dict):
            return next((w for w in (visit(x, level + 1) for x in v.values()) if w), "")
        if isinstance(v, (list, tuple)):
            return next((w for w in (visit(x, level + 1) for x in v) if w), "")
        return ""

    return visit(value, 0)


def _number(value: Any) -> float | None:
    try:
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return float(value.detach().float().item())
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    except Exception:  # a loss that cannot be read is no loss
        return None
    return None


@dataclass(frozen=True)
class HeldStep:
    """A step mpdoctor holds and can run again: what runs, what it is called, what it changes.

    Attributes
    ----------
    run : callable
        One run of the step, no argument; returns the loss or nothing (an exception is the step failing).
    label : str
        What the report calls it: ``"train_step()"``, ``"cell [4]"``, ``"the watched batch"``, ``"the probe's batch"``.
    modules, optimizers, scalers : tuple
        Objects the step changes besides the diagnosed ones; all are snapshotted and restored.
    around : callable or None
        A context each run happens inside (the loop's observers stand aside while the proof runs the step).
    state : callable or None
        Snapshots what else the step changes (a cell's namespace) and returns an object with ``restore()``.
    refused : str
        Why the step must not be run again (it reads a data iterator); the plan is then not verified, and says why.
    stand_in : str
        Set when ``run`` is not the user's own step but mpdoctor's on the user's batch (the probe's forward and
        backward, the watched batch): what it runs. A proof on it checks, and never says "verified on your step".
    """

    run: Callable[[], Any]
    label: str
    modules: tuple = ()
    optimizers: tuple = ()
    scalers: tuple = ()
    around: Callable[[], AbstractContextManager] | None = field(default=None, compare=False)
    state: Callable[[], Any] | None = field(default=None, compare=False)
    refused: str = ""
    stand_in: str = ""

    def __call__(self) -> Any:
        return self.run()


@dataclass(frozen=True)
class Proof:
    """The plan checked on the user's step.

    Attributes
    ----------
    step : str
        What the step is (``"train_step()"``, ``"cell [4]"``).
    before : StepOutcome or None
        The step as it was, before any fix.
    after : tuple of (fix title, StepOutcome)
        The step after each fix kept in the plan, applied alone (as a user clicking that one fix would).
    dropped : tuple of str
        Titles of the fixes taken out of the plan: they could not be applied, or they made a step that ran (or
        trained) fail.
    refused : str
        Why the step was not run at all (``before`` is then None and nothing is verified).
    plan : StepOutcome or None
        The step after the whole plan, every kept fix applied together: what "Apply" of the plan gives.
    safe : StepOutcome or None
        The step after the safe plan alone ("Apply all safe fixes" as one action); None when no fix is safe or
        the safe plan is the whole plan.
    beyond_safe : tuple of str
        The fixes of the plan the safe plan leaves out (what else the cure takes when the safe plan alone fails).
    stand_in : str
        Set when the step that ran is not the user's own (mpdoctor's forward and backward on a held batch): what
        ran instead. Nothing is then "verified on your step".
    left_out : tuple of str
        Fixes that work alone but not with the fixes planned before them (two cures of one failure, each undoing
        the other): left out of the plan, still in the safe plan when they are safe.
    labels : tuple of (Fix, str)
        What the proof says of each fix it ran: the record is the proof's, keyed by the fix (a fix is a value and
        carries no label): :meth:`label`. A report whose plan is not this proof's has no proof, so no labels.
    needs : tuple of (Fix, tuple of Fix)
        Each fix verified only together with others, and the group that ran (it among them, in order): its label
        names them, and the report's treatment applies the group when the fix is applied (:meth:`prerequisites`).
    """

    step: str
    before: StepOutcome | None
    after: tuple
    dropped: tuple
    refused: str = ""
    plan: StepOutcome | None = None
    safe: StepOutcome | None = None
    beyond_safe: tuple = ()
    stand_in: str = ""
    left_out: tuple = ()
    labels: tuple = ()
    needs: tuple = ()

    def label(self, fix: Any) -> str:
        """What this proof ran with ``fix`` and what the step did ("" for a fix it did not run)."""
        return next((text for fx, text in self.labels if fx is fix), "")

    def prerequisites(self, fix: Any) -> tuple:
        """``fix`` and the fixes it was verified with, in the order they ran: what applying it applies (() for a
        fix verified alone)."""
        return next((needed for fx, needed in self.needs if fx is fix), ())

    def not_planned(self, fix: Any) -> str:
        """Why the proof took ``fix`` out of the plan ("" when it did not)."""
        if fix.title in self.dropped or fix.title in self.left_out:
            return f"not planned: {self.label(fix)}"
        return ""

    def plans(self, plan: list, safe_plan: list) -> tuple[list, list]:
        """``plan`` and ``safe_plan`` as the proof leaves them: without the fixes it dropped, and the plan without
        those it left out."""
        dropped, left_out = set(self.dropped), set(self.left_out)
        return ([fx for fx in plan if fx.title not in dropped and fx.title not in left_out],
                [fx for fx in safe_plan if fx.title not in dropped])  # fmt: skip

    @property
    def checked(self) -> bool:
        """The step that ran (the user's own, or mpdoctor's stand-in for it) ran and trained after the whole plan."""
        return self.plan is not None and self.plan.trained

    @property
    def verified(self) -> bool:
        """The user's own step ran and trained after the whole plan, applied together."""
        return not self.stand_in and self.plan is not None and self.plan.trained

    @property
    def safe_verified(self) -> bool:
        """The user's own step ran and trained after the safe plan alone (the whole plan, when it is all safe)."""
        outcome = self.safe if self.safe is not None else (self.plan if not self.beyond_safe else None)
        return not self.stand_in and outcome is not None and outcome.trained

    @property
    def cured(self) -> bool:
        """The step runs and trains after the plan (and did not before)."""
        return self.verified and self.before is not None and not self.before.trained

    def summary(self) -> str:
        """One or two sentences for the report's header."""
        if self.refused or self.before is None:
            return f"Fixes not verified on your step ({self.step}): {self.refused or 'it was not run'}."
        if self.plan is None:
            if self.dropped:
                return (f"Not verified on your step ({self.step}): before the fixes {self.before.describe()}; no planned "
                        f"fix made it run and train (tried: {'; '.join(self.dropped)}).")  # fmt: skip
            return f"Checked on your step ({self.step}): {self.before.describe()}; no fix to try."
        together = "it" if len(self.after) == 1 else f"all {len(self.after)} of them, applied together"
        if self.stand_in:
            return (f"Plan not verified on your step: checked on {self.stand_in} ({self.step}), not on your loop's "
                    f"code: before the fixes {self.before.describe()}; after {together}, {self.plan.describe()}.")  # fmt: skip
        verdict = "verified on your step" if self.plan.trained else "not verified on your step"
        text = f"Plan {verdict} ({self.step}): before the fixes {self.before.describe()}; after {together}, {self.plan.describe()}."
        if self.safe is None and self.beyond_safe and self.plan.trained:
            text += f" No safe fix cures it on its own: it takes {'; '.join(self.beyond_safe)}."
        elif self.safe is not None:
            if self.safe.trained:
                text += " Apply all safe fixes, on its own: verified, " + self.safe.describe() + "."
            else:
                text += (f" Apply all safe fixes on its own does not cure it: after it, {self.safe.describe()}; "
                         f"it also takes: {'; '.join(self.beyond_safe)}.")  # fmt: skip
        return text


def prove(plan: list, step: Callable[[], Any], label: str, modules: list, optimizers: list, scalers: list, *,
          around: Callable[[], AbstractContextManager] | None = None, state: Callable[[], Any] | None = None,
          before: StepOutcome | None = None, safe_plan: list | None = None, stand_in: str = "") -> Proof:
    """Run ``step`` as it is, then after each fix of ``plan`` alone, then after the whole plan and after the safe
    plan (each as one action), and restore everything after every run.

    Each trial starts from the state the run was in: its fixes are applied, the step runs, the fixes are undone
    (exactly) and the snapshot restored. A fix is taken out (``Proof.dropped``, not planned, its ``note`` says why)
    when it cannot be applied, when the step fails the same way after it (it did not reach the failure), or when
    a step that ran (or trained) no longer does after it. Each fix's ``proof`` says what ran: the fix alone, or the
    whole plan, naming the other fixes it took. ``around`` is a context each run of the step happens in; ``state``
    snapshots what else the step changes (see :class:`HeldStep`). ``before``: the step as it was, already seen by
    the caller (the probe's own forward and backward); it is then not run again. ``stand_in``: what ran, when it is
    not the user's own step (nothing is then labelled verified on it).
    """
    snapshot = RunState(modules, optimizers, scalers, extra=state)
    trials = _Trials(_inside(step, around) if around is not None else step, modules, optimizers, snapshot)
    try:
        if before is None:
            before = trials.run([])
        kept, dropped, alone = trials.each_alone(plan, before)
        kept, left_out, together = trials.together(kept, alone, before)
        safe_fixes, safe = trials.safe_plan(safe_plan or [], kept, dropped, alone)
    finally:
        snapshot.restore()
    labels = _labels(kept, safe_fixes, alone, together, safe, stand_in, before, trials.labels)
    beyond = tuple(fx.title for fx in kept if not _among(fx, safe_fixes))
    return Proof(label, before, tuple((fx.title, alone[id(fx)]) for fx in kept), tuple(fx.title for fx in dropped),
                 plan=together, safe=safe, beyond_safe=beyond, stand_in=stand_in,
                 left_out=tuple(fx.title for fx in left_out), labels=labels,
                 needs=_prerequisites(labels, kept, safe_fixes))  # fmt: skip


def _labels(kept: list, safe_fixes: list, alone: dict, together: StepOutcome | None, safe: StepOutcome | None,
            stand_in: str, before: StepOutcome, taken_out: dict) -> tuple:  # fmt: skip
    """The proof's record of each fix it ran, ``(fix, label)``: what ran with it, nothing more. ``taken_out``: the
    labels of the fixes the trials dropped or left out, by ``id``."""
    labels = {id(fx): (fx, text) for fx, text in taken_out.values()}
    for fix in kept:
        labels[id(fix)] = (fix, _label(fix, alone[id(fix)], together, kept, stand_in, before))
    for fix in safe_fixes:
        if not _among(fix, kept) and id(fix) not in labels and safe is not None:  # tried only within the safe plan
            tried = _label(fix, StepOutcome(False, False, "not tried alone"), safe, safe_fixes, stand_in, before)
            labels[id(fix)] = (fix, tried)
    return tuple(labels.values())


def _prerequisites(labels: tuple, kept: list, safe_fixes: list) -> tuple:
    """``(fix, group)`` for each fix whose label claims it only together with other fixes (alone, the step did not
    train; with them, it did): the fixes that ran, in order, it among them, which applying it applies, so that
    what the user gets is what ran."""
    out = []
    for fix, text in labels:
        if " together with " in text and "(applying it applies them too" in text:
            out.append((fix, tuple(kept if _among(fix, kept) else safe_fixes)))  # the fix among them, in run order
    return tuple(out)


class _Trials:
    """Runs of the step after given fixes, each from the state the run was in (everything restored after it)."""

    def __init__(self, step: Callable[[], Any], modules: list, optimizers: list, snapshot: RunState) -> None:
        self.step, self.modules, self.optimizers, self.snapshot = step, modules, optimizers, snapshot
        #: What the trials say of the fixes they took out, ``id(fix) -> (fix, label)``.
        self.labels: dict[int, tuple[Any, str]] = {}

    def run(self, fixes: list) -> StepOutcome | None:
        """The step after ``fixes``, applied in order (None when one would not apply)."""
        return _trial(fixes, self.step, self.modules, self.optimizers, self.snapshot)

    def each_alone(self, plan: list, before: StepOutcome) -> tuple[list, list, dict]:
        """Each fix of ``plan`` tried alone: ``(kept, dropped, outcome by id(fix))``; a fix that would not apply or
        harms the step is dropped, its ``proof`` saying what happened."""
        kept, dropped, alone = [], [], {}
        for fix in plan:
            if fix.applied or not fix.changes:
                continue
            outcome = self.run([fix])
            if _worse(before, outcome):
                self.labels[id(fix)] = (fix, "tried on your step: it could not be applied" if outcome is None
                                        else f"tried on your step: after it, {outcome.describe()}")  # fmt: skip
                dropped.append(fix)
                continue
            kept.append(fix)
            alone[id(fix)] = outcome
        return kept, dropped, alone

    def together(self, kept: list, alone: dict, before: StepOutcome) -> tuple[list, list, StepOutcome | None]:
        """The plan built up in order: each fix joins when the step with it and the fixes before it is no worse
        than without it. ``(plan, left out, the step after the whole plan)``; a fix left out says why."""
        plan: list = []
        left_out: list = []
        current = before
        for fix in kept:
            outcome = alone[id(fix)] if not plan else self.run([*plan, fix])
            if plan and _worse(current, outcome):
                with_them = "; ".join(fx.title for fx in plan)
                self.labels[id(fix)] = (fix, f"left out of the plan: applied alone, {alone[id(fix)].describe()}; with "
                                        f"{with_them}, " + ("it could not be applied" if outcome is None
                                                            else outcome.describe()))  # fmt: skip
                left_out.append(fix)
                continue
            plan.append(fix)
            current = outcome
        return plan, left_out, (current if plan else None)

    def safe_plan(self, safe_plan: list, kept: list, dropped: list, alone: dict) -> tuple[list, StepOutcome | None]:
        """The safe plan's fixes still on offer, and the step after all of them applied as one action ("Apply all
        safe fixes"); None when it is the whole plan (already run) or empty."""
        fixes = [fx for fx in safe_plan if not fx.applied and fx.changes and not _among(fx, dropped)]
        if not fixes or (len(fixes) == len(kept) and all(_among(fx, kept) for fx in fixes)):
            return fixes, None
        if len(fixes) == 1 and id(fixes[0]) in alone:
            return fixes, alone[id(fixes[0])]
        return fixes, self.run(fixes)


def _among(fix: Any, fixes: list) -> bool:
    return any(fix is other for other in fixes)


def _worse(before: StepOutcome, outcome: StepOutcome | None) -> bool:
    """A fix that harms the step: it would not apply, or a step that ran (or trained) no longer does after it."""
    if outcome is None:
        return True
    return (before.ran and not outcome.ran) or (before.trained and not outcome.trained)


def _label(fix: Any, alone: StepOutcome, together: StepOutcome | None, kept: list, stand_in: str,
           before: StepOutcome) -> str:  # fmt: skip
    """What a fix's proof claims: only what ran."""
    where = f"on {stand_in}, not your step" if stand_in else "on your step"
    verdict = "checked" if stand_in else "verified"
    if alone.trained:
        return f"{verdict} {where}: applied alone, {alone.describe()}"
    others = [fx.title for fx in kept if fx is not fix]
    tried = "" if alone.error == "not tried alone" else f"applied alone, {alone.describe()}; "
    if together is not None and together.trained and others:
        if (alone.fails_as(before) or (alone.ran and before.ran and not before.trained)) and tried:  # as before
            return (f"not what your step needs ({where}): applied alone, it fails as before; with the plan's "
                    f"other fixes ({'; '.join(others)}), {together.describe()}")  # fmt: skip
        return (f"{verdict} {where} together with {'; '.join(others)}: {tried}with them, {together.describe()} "
                "(applying it applies them too, in that order)")  # fmt: skip
    unverified = f"not verified (checked {where})" if stand_in else f"not verified {where}"
    if together is not None and others:
        return f"{unverified}: {tried}with {'; '.join(others)}, {together.describe()}"
    return f"{unverified}: applied alone, {alone.describe()}"


def _trial(fixes: list, step: Callable[[], Any], modules: list, optimizers: list, snapshot: RunState) -> StepOutcome | None:
    """Apply ``fixes`` in order, run the step, undo them and restore the snapshot; None when a fix would not apply."""
    from ..rules.engine.fixes import revert_steps

    applied: list = []  # the steps each fix took, recorded here and never on the fix (a value)
    try:
        for fix in fixes:
            try:
                applied.append(fix.tried_steps())
            except Exception:  # tried_steps rolled itself back; the trial stops here
                return None
        snapshot.shield()
        return run_step(step, modules, optimizers)
    finally:
        for steps in reversed(applied):
            revert_steps(steps)  # reverts every step it can; the snapshot restores the rest
        snapshot.restore()


def _inside(step: Callable[[], Any], around: Callable[[], AbstractContextManager]) -> Callable[[], Any]:
    def run() -> Any:
        with around():
            return step()

    return run


def prove_held(plan: list, held: HeldStep, modules: Iterable[Any] = (), optimizers: Iterable[Any] = (),
               scalers: Iterable[Any] = (), before: StepOutcome | None = None,
               safe_plan: Iterable[Any] | None = None) -> Proof:  # fmt: skip
    """Check ``plan`` on a held step; ``modules``, ``optimizers`` and ``scalers`` (the diagnosed ones) are restored with
    the step's own. A refused step is not run: the proof says why. ``before`` (what the step did as it was, judged
    with no optimizer) is used only when no optimizer takes part, where :func:`run_step` would judge it the same way."""
    if held.refused:
        return Proof(held.label, None, (), (), refused=held.refused, stand_in=held.stand_in)
    optimizers = _unique([*optimizers, *held.optimizers])
    return prove(list(plan), held.run, held.label, _unique([*modules, *held.modules]), optimizers,
                 _unique([*scalers, *held.scalers]), around=held.around, state=held.state,
                 before=before if not optimizers else None, safe_plan=list(safe_plan) if safe_plan is not None else None,
                 stand_in=held.stand_in)  # fmt: skip


def step_as_held(step: Callable[[], Any]) -> HeldStep:
    """A function of the user's (``diagnose(step=fn)``, ``%mpdoctor --step fn``) as a held step: refused, with the
    reason, when running it again would take the user's next batch (it, or a function it calls, reads an
    iterator). A :class:`HeldStep` is returned as it is."""
    if isinstance(step, HeldStep):
        return step
    label = f"{getattr(step, '__name__', 'step')}()"
    reader = iterator_reader(step)
    if reader:
        return HeldStep(step, label, refused=(
            f"{reader} reads a data iterator (next(...)); run again, it would take your next batch. Read the batch "
            "into a variable outside the step (batch = next(it)) and check a step that uses it"))
    return HeldStep(step, label)


def iterator_reader(function: Any, depth: int = 3) -> str:
    """The name of ``function``, or of a function it calls through its globals (up to ``depth`` calls deep), that
    reads a data stream: its code calls ``next`` (or ``iter``) and a global or closure variable it uses holds an
    iterator or a DataLoader. ``""`` when none does. Read from the code objects and the bound values, never run:
    ``next(model.parameters())`` reads no data stream and is not one."""
    seen: set[int] = set()

    def visit(fn: Any, level: int) -> str:
        code = getattr(fn, "__code__", None)
        if code is None or id(code) in seen or level > depth:
            return ""
        seen.add(id(code))
        names = _code_names(code)
        globs = getattr(fn, "__globals__", None)
        globs = globs if type(globs) is dict else {}
        if names & {"next", "__next__", "iter"} and any(is_data_stream(v) for v in _bound_values(fn, names, globs)):
            return f"{getattr(fn, '__name__', 'the step')}()"
        for name in sorted(names):
            value = globs.get(name)
            if type(value) is types.FunctionType:
                found = visit(value, level + 1)
                if found:
                    return found
        return ""

    return visit(function, 0)


def _bound_values(fn: Any, names: set[str], globs: dict) -> list:
    """The values of the globals ``names`` reaches and of the function's closure cells."""
    values = [globs[n] for n in names if n in globs]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return values


def is_data_stream(value: Any) -> bool:
    """An iterator (its class has ``__next__``: iterating it consumes it) or a DataLoader-like loader."""
    if value is None:
        return False
    classes = _mro(value)
    if any("__next__" in vars(c) for c in classes if c is not object):
        return True
    return any(c.__name__.endswith("DataLoader") or c is torch.utils.data.IterableDataset for c in classes)


def _mro(value: Any) -> tuple:
    return type.__dict__["__mro__"].__get__(type(value))  # the class's own MRO: no user __getattr__ runs


def _code_names(code: Any) -> set[str]:
    """The global and attribute names a code object and the code nested in it (closures, comprehensions) use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


def proven_report(report: Any, held: HeldStep, before: StepOutcome | None = None) -> Any:
    """``report`` with its plan checked on ``held``: a new report (``report.evolve``) holding the proof, whose plans
    leave out the fixes the step showed not to work. Never raises: a proof that fails leaves the report as it was.
    ``before``: the step as it was, when the caller already ran it (see :func:`prove_held`).
    """
    plan, safe_plan = report.fixes, report.safe_fixes
    try:
        subjects = report.subjects
        modules = [_inner(s) for s in subjects if s.kind == "model"]
        optimizers = [_inner(s) for s in subjects if s.kind == "optimizer"]
        scalers = [s.obj for s in subjects if s.kind == "scaler"]
        proof = prove_held(plan, held, modules, optimizers, scalers, before, safe_plan)
    except Exception as exc:  # the plan stands unproven; the report says why
        return report.evolve(proof=Proof(held.label, None, (), (), refused=f"the check failed ({describe_exception(exc)})"))
    plan, safe_plan = proof.plans(plan, safe_plan)
    report = report.evolve(proof=proof, plan=plan, safe_plan=safe_plan)
    return _with_alternatives(report, held, proof, (modules, optimizers, scalers), before)


def _alternatives(report: Any, proof: Proof) -> list[tuple[Any, Any]]:
    """``(finding, fix)``: for each error or warning left with no planned fix because the proof dropped its planned
    one, the next fix it offers that changes the live objects (not tried yet)."""
    from ..rules.engine.fixes import Applicability

    if proof.checked or not proof.dropped or proof.before is None:
        return []
    dropped, planned = set(proof.dropped), {id(fx) for fx in report.fixes}
    out = []
    for finding in report.findings:
        if finding.severity not in ("error", "warning") or any(id(fx) in planned for fx in finding.fixes):
            continue
        if not any(fx.title in dropped for fx in finding.fixes):
            continue
        alternative = next((fx for fx in finding.fixes if fx.title not in dropped and fx.changes and not fx.applied
                            and fx.applicability is not Applicability.DISPLAY_ONLY), None)  # fmt: skip
        if alternative is not None:
            out.append((finding, alternative))
    return out


def _with_alternatives(report: Any, held: HeldStep, proof: Proof, objects: tuple, before: StepOutcome | None) -> Any:
    """When the step did not come out cured because the proof dropped a finding's planned fix, that finding's next
    in-place fix is tried in its place, once: the plan with it is proven again on the same step, and adopted when
    it cures the step (the alternative then leads its finding's fixes, the dropped one after it). Otherwise the
    first proof stands."""
    alternatives = _alternatives(report, proof)
    if not alternatives:
        return report
    plan = [*report.fixes, *(fx for _, fx in alternatives)]
    try:
        second = prove_held(plan, held, *objects, before, report.safe_fixes)
    except Exception:  # the first proof stands
        return report
    if not second.checked:
        return report
    # What the first proof found of the fixes it dropped stays said (they were not run again).
    second = dataclasses.replace(
        second, dropped=tuple(dict.fromkeys((*proof.dropped, *second.dropped))),
        labels=(*((fx, text) for fx, text in proof.labels if fx.title in proof.dropped), *second.labels))
    leads = {id(finding): fx for finding, fx in alternatives if second.label(fx)}
    findings = [dataclasses.replace(f, fixes=[leads[id(f)], *(fx for fx in f.fixes if fx is not leads[id(f)])])
                if id(f) in leads else f for f in report.findings]  # fmt: skip
    plan, safe_plan = second.plans(plan, report.safe_fixes)
    return report.evolve(findings=findings, proof=second, plan=plan, safe_plan=safe_plan)


def _inner(subject: Any) -> Any:
    return subject.inner if subject.inner is not None else subject.obj
