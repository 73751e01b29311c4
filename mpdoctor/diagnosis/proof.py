"""A fix is proven on the patient: the user's failing step, run before and after each planned fix.

Where mpdoctor holds the step that failed, the plan is checked on it: ``diagnose(..., step=fn)`` and
``%mpdoctor --step NAME``; the notebook cell that raised (:mod:`mpdoctor.diagnosis.replay`); the batch ``watch()``
held when the loop raised; the probe's batch (forward and backward). Each is a :class:`HeldStep`. The step runs once
as it is, then after each planned fix in order. A fix after which the step runs and trains is *verified*; one
after which the step raises, or stops training where it trained before, is *tried*: taken out of the plan and shown
with what happened.

The proof leaves the run exactly as it found it: every fix it applied is undone (each is exact to undo), and the
state a step changes (parameters, gradients and buffers of the models, optimizer state and hyperparameters, the
GradScaler's scale and trackers, torch's, Python's and NumPy's random streams) is restored from a snapshot taken
before the first run. A step should take its batch from a variable, not from ``next(iterator)``: an iterator the
step advances cannot be rewound: a held step that would advance one is refused (:attr:`HeldStep.refused`) and the
report says why its fixes are not verified.
"""

from __future__ import annotations

import copy
import math
import random
import sys
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..redact import describe_exception


@dataclass(frozen=True)
class StepOutcome:
    """What one run of the user's step did.

    Attributes
    ----------
    ran : bool
        It returned without raising.
    trained : bool
        It ran, every trainable parameter stayed finite and at least one changed (an optimizer step happened), or,
        for a step with no optimizer (the probe's forward and backward), every gradient is finite and one is non-zero.
    error : str or None
        The exception it raised, one line.
    loss : float or None
        What the step returned, when it returned a number or a scalar tensor.
    """

    ran: bool
    trained: bool
    error: str | None = None
    loss: float | None = None

    def describe(self) -> str:
        """One phrase: ``"it ran and trained (loss 0.42)"``, ``"it raised RuntimeError: ..."``."""
        if not self.ran:
            return f"it raised {self.error}"
        loss = f" (loss {self.loss:.4g})" if self.loss is not None else ""
        if self.trained:
            return f"it ran and trained{loss}"
        return f"it ran but did not train{loss}: no parameter changed, or one became inf/NaN"


class RunState:
    """A snapshot of what a training step changes, restorable exactly (values, dtypes and identities)."""

    def __init__(self, modules: Iterable[Any], optimizers: Iterable[Any], scalers: Iterable[Any],
                 extra: Callable[[], Any] | None = None) -> None:  # fmt: skip
        self.modules = _unique(modules)
        self.optimizers = _unique(optimizers)
        self.scalers = _unique(scalers)
        # each tensor's values, and its gradient object itself: runs write into copies of it (shield), so it is
        # put back by identity, its values and version counter never touched
        self.tensors = [(t, t.data.clone(), t.grad) for m in self.modules for t in _module_tensors(m)]
        self.opt_state = [(o, {p: _clone(s) for p, s in o.state.items()}, [_group_options(g) for g in o.param_groups])
                          for o in self.optimizers]  # fmt: skip
        self.scaler_state = [(s, {k: _clone(v) for k, v in vars(s).items()}) for s in self.scalers]
        self.rng = _rng_state()
        #: What else the step changes, snapshotted by its own owner (a notebook cell's namespace): has ``restore()``.
        self.extra = extra() if extra is not None else None

    def shield(self) -> None:
        """Before a run: each tensor gets a copy of its gradient, so a step (``zero_grad``, a backward that
        accumulates) writes into the copy, never into the user's gradient tensors."""
        for t, _, grad in self.tensors:
            if grad is not None and t.grad is grad:
                t.grad = grad.clone()

    def restore(self) -> None:
        """Put every value back as it was when the snapshot was taken: values in place where they changed (an
        unchanged tensor is not written: its version counter stays), gradients by identity."""
        for t, data, grad in self.tensors:
            current = t.data
            if not (current.dtype == data.dtype and current.shape == data.shape and torch.equal(current, data)):
                _put(t, "data", data)
            if t.grad is not grad:
                _set_grad(t, grad)
        for o, state, groups in self.opt_state:
            o.state.clear()
            o.state.update({p: _clone(s) for p, s in state.items()})
            for g, options in zip(o.param_groups, groups):
                g.update(_clone(options))
        for s, attrs in self.scaler_state:
            vars(s).clear()
            vars(s).update({k: _clone(v) for k, v in attrs.items()})
        if self.extra is not None:
            self.extra.restore()
        _set_rng_state(self.rng)


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
    (:class:`~mpdoctor.runtime.backward_count.BackwardCounter`) does not count it as the loop's."""
    return _PROVING[0] > 0


def run_step(step: Callable[[], Any], modules: Iterable[Any], optimizers: Iterable[Any]) -> StepOutcome:
    """Run ``step()`` once and judge whether it trained (it never raises)."""
    params = [p for m in _unique(modules) for p in m.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    _PROVING[0] += 1
    try:
        returned = step()
    except Exception as exc:  # the step's failure is the outcome
        return StepOutcome(False, False, describe_exception(exc))
    finally:
        _PROVING[0] -= 1
    loss = _number(returned)
    if loss is not None and not math.isfinite(loss):
        return StepOutcome(True, False, loss=loss)
    if any(not bool(torch.isfinite(p.detach()).all()) for p in params):
        return StepOutcome(True, False, loss=loss)
    if _unique(optimizers) or not params:
        changed = any(p.dtype != b.dtype or not torch.equal(p.detach(), b) for p, b in zip(params, before))
        return StepOutcome(True, changed, loss=loss)
    grads = [p.grad for p in params if p.grad is not None]
    trained = bool(grads) and all(bool(torch.isfinite(g).all()) for g in grads) and any(bool(g.any()) for g in grads)
    return StepOutcome(True, trained, loss=loss)


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
    """

    run: Callable[[], Any]
    label: str
    modules: tuple = ()
    optimizers: tuple = ()
    scalers: tuple = ()
    around: Callable[[], AbstractContextManager] | None = field(default=None, compare=False)
    state: Callable[[], Any] | None = field(default=None, compare=False)
    refused: str = ""

    def __call__(self) -> Any:
        return self.run()


@dataclass(frozen=True)
class Proof:
    """The plan checked on the user's step.

    Attributes
    ----------
    step : str
        What the step is (``"train_step()"``, ``"the probe's batch"``).
    before : StepOutcome
        The step as it was, before any fix.
    after : tuple of (fix title, StepOutcome)
        The step after each planned fix, applied in order.
    dropped : tuple of str
        Titles of the fixes taken out of the plan: the step raised or stopped training after them.
    refused : str
        Why the step was not run at all (``before`` is then None and nothing is verified).
    """

    step: str
    before: StepOutcome | None
    after: tuple
    dropped: tuple
    refused: str = ""

    @property
    def verified(self) -> bool:
        """The step ran and trained after the last fix kept in the plan."""
        return bool(self.after) and self.after[-1][1].trained

    @property
    def cured(self) -> bool:
        """The step runs and trains after the plan (and did not before)."""
        return self.verified and self.before is not None and not self.before.trained

    def summary(self) -> str:
        """One sentence for the report's header."""
        if self.refused or self.before is None:
            return f"Fixes not verified on your step ({self.step}): {self.refused or 'it was not run'}."
        if not self.after:
            if self.dropped:
                return (f"Not verified on your step ({self.step}): before the fixes {self.before.describe()}; no planned "
                        f"fix made it run and train (tried: {'; '.join(self.dropped)}).")  # fmt: skip
            return f"Checked on your step ({self.step}): {self.before.describe()}; no fix to try."
        last = self.after[-1][1]
        verdict = "verified on your step" if last.trained else "not verified on your step"
        return f"Plan {verdict} ({self.step}): before the fixes {self.before.describe()}; after them {last.describe()}."


def prove(plan: list, step: Callable[[], Any], label: str, modules: list, optimizers: list, scalers: list, *,
          around: Callable[[], AbstractContextManager] | None = None, state: Callable[[], Any] | None = None,
          before: StepOutcome | None = None) -> Proof:
    """Run ``step`` as it is, then after each fix of ``plan`` (with the fixes kept before it), and restore everything.

    Each trial starts from the state the run was in: the fixes are applied, the step runs, the fixes are undone
    (exactly) and the snapshot restored. Each fix's ``proof`` says what the step did after it; a fix after which the
    step raised, or stopped training where it trained before, is taken out (``Proof.dropped``), not planned, and its
    ``note`` says why. ``around`` is a context each run of the step happens in; ``state`` snapshots what else the step
    changes (see :class:`HeldStep`). ``before``: the step as it was, already seen by the caller (the probe's own
    forward and backward); it is then not run again.
    """
    snapshot = RunState(modules, optimizers, scalers, extra=state)
    if around is not None:
        step = _inside(step, around)
    kept: list = []
    after: list = []
    dropped: list = []
    try:
        if before is None:
            snapshot.shield()
            before = run_step(step, modules, optimizers)
            snapshot.restore()
        previous = before
        for fix in plan:
            if fix.applied or not fix.changes:
                continue
            outcome = _trial([*kept, fix], step, modules, optimizers, snapshot)
            fix.error = None  # a trial's roll-back is the proof's to tell, not a failed apply
            if outcome is None or not outcome.ran or (previous.trained and not outcome.trained):
                fix.proof = ("tried on your step: it could not be applied" if outcome is None
                             else f"tried on your step: after it, {outcome.describe()}")  # fmt: skip
                dropped.append(fix)
                continue
            fix.proof = (f"verified on your step: after it, {outcome.describe()}" if outcome.trained
                         else f"checked on your step: after it, {outcome.describe()}")  # fmt: skip
            kept.append(fix)
            after.append((fix.title, outcome))
            previous = outcome
    finally:
        snapshot.restore()
    for fix in dropped:
        fix.planned = False
        fix.note = f"not planned: {fix.proof}"
    return Proof(label, before, tuple(after), tuple(fx.title for fx in dropped))


def _trial(fixes: list, step: Callable[[], Any], modules: list, optimizers: list, snapshot: RunState) -> StepOutcome | None:
    """Apply ``fixes`` in order, run the step, undo them and restore the snapshot; None when a fix would not apply."""
    applied: list = []
    try:
        for fix in fixes:
            try:
                fix.apply_steps()
            except Exception:  # apply_steps rolled itself back; the trial stops here
                return None
            applied.append(fix)
        snapshot.shield()
        return run_step(step, modules, optimizers)
    finally:
        for fix in reversed(applied):
            _undo(fix)
        snapshot.restore()


def _undo(fix: Any) -> None:
    try:
        fix.undo_steps()
    except Exception:  # undo_steps reverts every step it can; what it could not is in fix.error
        pass


def _inside(step: Callable[[], Any], around: Callable[[], AbstractContextManager]) -> Callable[[], Any]:
    def run() -> Any:
        with around():
            return step()

    return run


def prove_held(plan: list, held: HeldStep, modules: Iterable[Any] = (), optimizers: Iterable[Any] = (),
               scalers: Iterable[Any] = (), before: StepOutcome | None = None) -> Proof:  # fmt: skip
    """Check ``plan`` on a held step; ``modules``, ``optimizers`` and ``scalers`` (the diagnosed ones) are restored with
    the step's own. A refused step is not run: the proof says why. ``before`` (what the step did as it was, judged
    with no optimizer) is used only when no optimizer takes part, where :func:`run_step` would judge it the same way."""
    if held.refused:
        return Proof(held.label, None, (), (), refused=held.refused)
    optimizers = _unique([*optimizers, *held.optimizers])
    return prove(list(plan), held.run, held.label, _unique([*modules, *held.modules]), optimizers,
                 _unique([*scalers, *held.scalers]), around=held.around, state=held.state,
                 before=before if not optimizers else None)  # fmt: skip


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
        proof = prove_held(plan, held, modules, optimizers, scalers, before)
    except Exception as exc:  # the plan stands unproven; the report says why
        return report.evolve(proof=Proof(held.label, None, (), (), refused=f"the check failed ({describe_exception(exc)})"))
    dropped = set(proof.dropped)
    return report.evolve(proof=proof, plan=[fx for fx in plan if fx.title not in dropped],
                         safe_plan=[fx for fx in safe_plan if fx.title not in dropped])  # fmt: skip


def _inner(subject: Any) -> Any:
    return subject.inner if subject.inner is not None else subject.obj
