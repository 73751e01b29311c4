"""The GradScaler protocol, watched: :class:`ProtocolObserver`.

``scaler.scale(loss).backward()`` -> ``scaler.unscale_(opt)`` at most once per real step -> clipping ->
``scaler.step(opt)`` -> ``scaler.update()`` once per real step. While at least one observer is attached,
mpdoctor follows every GradScaler and optimizer of the process through:

- scoped wrappers of ``GradScaler.scale / unscale_ / step / update`` (class attributes), of the clipping
  helper every ``clip_grad_norm_`` calls (``torch.nn.utils.clip_grad._clip_grads_with_norm_``) and of
  ``LRScheduler.step``;
- the global optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``);
- the scaler's own per-optimizer state (``scaler._per_optimizer_states``), read, never written.

Every wrapper calls the original with the same arguments and returns its result: numerics are unchanged.
The wrappers are installed once for all attached observers and removed (the originals put back, identity
equal) when the last one detaches, also when the loop raises. A notebook session keeps one wrapper resident
from torch's import to ``%unload_ext``, ``GradScaler.scale``, and its observer attached lazily: the first loss a
scaler scales installs the rest (``scale()`` opens every real step), and the end of the cell removes them again
(:func:`settle`) unless a step is still open. A cell that does not train runs none of mpdoctor's code but one
``post_run_cell`` callback. The wrappers and their dispatch live in :mod:`mpdoctor.attach.runtime.dispatch`.
"""

from __future__ import annotations

import linecache
import math
import sys
import weakref
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import torch

from .dispatch import (  # noqa: F401 - arm, disarm, installed, resident and settle: the protocol's public switches
    _DISPATCH,
    HERE,
    _enabled,
    _scale_value,
    arm,
    disarm,
    installed,
    resident,
    settle,
)
from .protocol_rules import RULES, corrected_template

if TYPE_CHECKING:  # imported where used: %load_ext arms the resident wrapper without the facts package
    from ...facts.location import Location
    from ...facts.scale_history import ScaleRecord
    from ...rules.engine.findings import Finding

#: Frames of these packages are library code; the user's line is the first frame outside them.
_LIBRARY_PREFIXES = (
    "torch", "mpdoctor", "accelerate", "lightning", "pytorch_lightning", "lightning_fabric", "transformers",
    "trl", "peft", "deepspeed", "functools", "contextlib", "typing", "IPython", "ipykernel",
)  # fmt: skip

#: Skipped steps the schedule may advance on before it counts as a changed schedule (share of scheduler steps).
SCHEDULER_SKIP_SHARE = 0.01
#: Updates after the first settling run of skips needed before judging the skip rate, and the window judged.
UNSETTLED_MIN_UPDATES = 10
UNSETTLED_WINDOW = 50
#: Share of skipped steps in that window that says the scale never settles (a healthy run skips ~1 in 2000).
UNSETTLED_SKIP_SHARE = 0.25
#: Overflow steps whose non-finite gradients are named (each costs one finiteness check per gradient).
OVERFLOW_STEPS_NAMED = 8


def _running_cell() -> str:
    """``cell [5]`` while cell 5 runs (the outermost notebook cell on the stack: the cell that ran the call, not
    the one that defined the function it is in), named as :class:`~mpdoctor.facts.location.Location` names it;
    "" outside a notebook."""
    from ...facts.location import cell_number

    frame, number = sys._getframe(1), None
    while frame is not None:
        number = cell_number(frame.f_code.co_filename) or number
        frame = frame.f_back
    return f"cell [{number}]" if number is not None else ""


def _unscale_twice(scaler: str, opt: str, where: Location | None) -> str:
    """The message of a second ``unscale_``: an iteration that skipped the update, or gradient accumulation."""
    from .loop_exits import exit_before_update

    said = (f"{scaler}.unscale_({opt}) is called again before {scaler}.update(): GradScaler raises 'unscale_() has "
            "already been called on this optimizer since the last update()'.")  # fmt: skip
    leaves = exit_before_update(where) if where is not None else None
    if leaves is not None:
        return (f"{said} The iteration that takes `{leaves.code}` ({leaves.label}) skips the optimizer step and "
                f"{scaler}.update() with it: call {scaler}.update() on every iteration that ran unscale_, even when "
                f"it skips the step (or let {scaler}.step skip it: it skips on inf/NaN gradients itself).")
    return f"{said} With gradient accumulation, unscale once per real step, after the last micro-batch."


def _resolve(where: Any) -> Location | None:
    return user_line(3) if where is HERE else where


def user_line(depth: int = 2) -> Location | None:
    """The first frame above this call that is not library code: the user's line."""
    try:
        frame = sys._getframe(depth)
    except ValueError:
        return None
    while frame is not None:
        g = frame.f_globals
        name = dict.get(g, "__name__") if type(g) is dict else None
        name = name if type(name) is str else ""
        if name.split(".", 1)[0] not in _LIBRARY_PREFIXES:
            code = frame.f_code
            text = linecache.getline(code.co_filename, frame.f_lineno).strip()
            from ...facts.location import Location

            return Location.at(code.co_filename, frame.f_lineno, text)
        frame = frame.f_back
    return None


#: What a function frame's ``f_locals`` is: a dict before Python 3.13, a ``FrameLocalsProxy`` from 3.13 (PEP 667).
_FRAME_LOCALS = type((lambda: sys._getframe().f_locals)())


def _scope_items(scope: Any) -> list:
    """The items of a frame's locals or globals, read without running user code (no user mapping's methods)."""
    if type(scope) is dict:
        return list(dict.items(scope))
    if type(scope) is _FRAME_LOCALS and _FRAME_LOCALS is not dict:
        return list(scope.items())
    return []


def name_in_user_frames(obj: Any) -> str | None:
    """The variable the user's code holds ``obj`` by, in the nearest user frame (locals, then globals)."""
    try:
        frame = sys._getframe(1)
    except ValueError:
        return None
    while frame is not None:
        g = frame.f_globals
        name = dict.get(g, "__name__") if type(g) is dict else None
        if not (type(name) is str and name.split(".", 1)[0] in _LIBRARY_PREFIXES):
            for scope in (frame.f_locals, g):
                for key, value in _scope_items(scope):
                    if value is obj and type(key) is str and not key.startswith("_"):
                        return key
            return None
        frame = frame.f_back
    return None


def modules_in_user_frames() -> list[tuple[str, Any]]:
    """``(name, module)`` of every ``torch.nn.Module`` the nearest user frame holds (locals, then globals)."""
    try:
        frame = sys._getframe(1)
    except ValueError:
        return []
    while frame is not None:
        g = frame.f_globals
        name = dict.get(g, "__name__") if type(g) is dict else None
        if not (type(name) is str and name.split(".", 1)[0] in _LIBRARY_PREFIXES):
            out: dict[int, tuple[str, Any]] = {}
            for scope in (frame.f_locals, g):
                for key, value in _scope_items(scope):
                    if type(key) is str and key[:1] != "_" and issubclass(type(value), torch.nn.Module):
                        out.setdefault(id(value), (key, value))
            return list(out.values())
        frame = frame.f_back
    return []


class _ClipEvent:
    """One clip_grad_norm_ call: the parameters clipped, and what the scaler had unscaled then."""

    __slots__ = ("params", "unscaled", "where", "max_norm", "total_norm")

    def __init__(self, params: frozenset, unscaled: frozenset, where: Location | None, max_norm: float | None,
                 total_norm: Any) -> None:  # fmt: skip
        self.params = params
        self.unscaled = unscaled  # ids of the optimizers this scaler had unscaled when the clip ran
        self.where = where
        self.max_norm = max_norm
        self.total_norm = total_norm


class _ScalerTrack:
    """What an observer knows about one GradScaler since it was first seen.

    A plain class, not a dataclass: ``%load_ext`` imports this module, and a dataclass costs its definition.
    """

    __slots__ = (
        "series", "ref", "name", "fresh", "checked_resume", "scaled", "stepped", "skipped", "losses", "clips", "updates",
        "steps", "leading_skips", "settled", "overflow_params", "overflow_named", "unsettled_reported", "bypassed",
        "history", "opt_params", "union_cache",
    )  # fmt: skip

    def __init__(self, ref: Any, name: str, fresh: bool = False) -> None:
        self.ref = ref
        self.name = name
        self.fresh = fresh  # first seen before it ever scaled a loss, with a fresh state
        self.checked_resume = False
        self.scaled = False  # a loss was scaled since the last update()
        self.stepped: set = set()  # optimizers stepped since the last update()
        self.skipped = False  # a step since the last update() was skipped
        self.losses: list = []
        self.clips: list = []
        self.updates = 0
        self.steps = 0
        self.leading_skips = 0  # the first run of skips (the scale settling from its start)
        self.settled = False
        self.overflow_params: dict = {}  # name -> overflow steps where its grad was inf/NaN
        self.overflow_named = 0
        self.unsettled_reported = False
        self.bypassed = False  # optimizer.step() was called past this scaler since the last update()
        self.history: list = []  # this scaler's ScaleRecords
        self.opt_params: dict = {}  # id(optimizer) -> its param ids, cached at its first step
        self.union_cache: tuple = (frozenset(), frozenset())  # (unscaled optimizer ids, their param ids)


def _stage(scaler: Any, optimizer: Any) -> str:
    """The scaler's stage for ``optimizer``: 'ready', 'unscaled' or 'stepped' (read, never created)."""
    states = scaler.__dict__.get("_per_optimizer_states")
    st = dict.get(states, id(optimizer)) if isinstance(states, dict) else None
    stage = st.get("stage") if isinstance(st, dict) else None
    return getattr(stage, "name", "READY").lower()


def _unscaled_ids(scaler: Any) -> frozenset:
    states = scaler.__dict__.get("_per_optimizer_states")
    if not isinstance(states, dict):
        return frozenset()
    return frozenset(k for k, st in dict.items(states) if getattr(st.get("stage"), "name", "") == "UNSCALED")


def _optimizer_steps(optimizer: Any) -> int:
    """The largest ``step`` in the optimizer's per-parameter state (0 when it has not stepped)."""
    best = 0
    state = getattr(optimizer, "state", None)
    for st in state.values() if isinstance(state, dict) else ():
        step = st.get("step") if isinstance(st, dict) else None
        if isinstance(step, torch.Tensor) and step.numel() == 1:
            step = float(step.item())
        if isinstance(step, (int, float)) and step > best:
            best = int(step)
    return best


def _param_ids(optimizer: Any) -> frozenset:
    return frozenset(id(p) for g in getattr(optimizer, "param_groups", ()) for p in g.get("params", ()))


class ProtocolObserver:
    """Follow every GradScaler and optimizer of the process while attached; name protocol mistakes.

    Parameters
    ----------
    names : dict of int to str, optional
        ``id(obj) -> name`` for scalers, optimizers and models the user knows by a name.
    models : iterable of torch.nn.Module, optional
        Models whose parameter names identify the gradients that overflowed.
    on_finding : callable, optional
        Called with each new :class:`~mpdoctor.rules.engine.findings.Finding` at the call where it happens
        (default: print one block to stderr).

    Attributes
    ----------
    findings : list of Finding
        Protocol findings, in the order they happened (one per rule and line).
    scale_history : list of ScaleRecord
        One record per ``update()`` of every scaler seen.

    Examples
    --------
    >>> with ProtocolObserver(names={id(scaler): "scaler"}) as protocol:
    ...     train()
    >>> protocol.findings, protocol.scale_history
    """

    def __init__(
        self,
        names: dict[int, str] | None = None,
        models: Any = (),
        on_finding: Callable[[Finding], None] | None = None,
        step_listener: Callable[[Any], None] | None = None,
    ) -> None:
        self.names = dict(names or {})
        self._found_names: dict[int, tuple[Any, str]] = {}
        self._series = 0  # scalers seen so far: each one's scale history is its own series
        self.models = [m for m in models if isinstance(m, torch.nn.Module)]
        self.on_finding = on_finding if on_finding is not None else print_finding
        #: Called with each real step's ScaleRecord after ``update()`` (``watch()`` looks at skipped steps there:
        #: a step the scaler skips never reaches the optimizer's step hooks).
        self.step_listener = step_listener
        self.findings: list[Finding] = []
        self.scale_history: list[ScaleRecord] = []
        self._tracks: dict[int, _ScalerTrack] = {}
        self._reported: set = set()
        self._sched_steps = 0
        self._sched_on_skipped = 0
        self._sched_reported = False
        self._last_skipped: dict[int, bool] = {}  # id(optimizer) -> its last scaler.step was skipped
        self.attached = False
        self.lazy = False  # attached lazily: a notebook session's observer, which stays attached between cells

    # -- life cycle --------------------------------------------------------------------
    def attach(self, lazy: bool = False) -> ProtocolObserver:
        """Start observing (installs the shared wrappers when this is the first observer attached).

        ``lazy=True`` (a notebook cell, with the resident ``GradScaler.scale`` wrapper armed) installs nothing
        until a scaler scales a loss (see the module's docstring); a caller that may already be inside a step
        (:attr:`mid_step`) must not be lazy. Without the resident wrapper, ``lazy`` is ignored.
        """
        if not self.attached:
            self.lazy = lazy
            _DISPATCH.add(self, lazy=lazy)
            self.attached = True
        return self

    @property
    def mid_step(self) -> bool:
        """True when a scaler it follows scaled a loss or stepped and has not updated yet (a step spans calls)."""
        if not self._tracks:  # the common notebook cell: no scaler seen yet
            return False
        return any((t.scaled or t.stepped) and t.ref() is not None for t in self._tracks.values())

    def detach(self) -> None:
        """Stop observing (the wrappers are removed when no observer is left)."""
        if self.attached:
            self.attached = False
            _DISPATCH.remove(self)

    def close(self) -> None:
        """Detach, then judge what only the end of a run shows (a scaler that stepped and never updated)."""
        self.detach()
        for track in list(self._tracks.values()):
            said = any(f.check == "amp-update-missing" and f.subject == track.name for f in self.findings)
            if track.steps and not track.updates and not said:
                self._report("amp-update-missing", track.name, None,
                             f"{track.name} stepped {track.steps} time(s) and update() was never called: the scale "
                             f"never adapts, and the next {track.name}.step() raises 'step() has already been called since "
                             "the last update()'.", {"steps": track.steps})  # fmt: skip

    def __enter__(self) -> ProtocolObserver:
        return self.attach()

    def __exit__(self, *exc: Any) -> bool:
        self.close()
        return False

    # -- naming ------------------------------------------------------------------------
    def _name(self, obj: Any, default: str) -> str:
        found = self._found_names.get(id(obj))
        if found is not None and found[0]() is obj:
            return found[1]
        name = self.names.get(id(obj))
        if name is not None:
            return name
        name = name_in_user_frames(obj)
        if name is None:
            return default
        try:
            # Kept while the object lives (it may be out of frame later); never handed to another object that
            # reuses the id of a freed one (a notebook that rebuilds model, optimizer and scaler per lesson).
            self._found_names[id(obj)] = (weakref.ref(obj), name)
        except TypeError:  # not weakly referenceable: looked up again next time
            pass
        return name

    def _track(self, scaler: Any) -> _ScalerTrack:
        track = self._tracks.get(id(scaler))
        if track is None or track.ref() is not scaler:
            # Fresh: never scaled a loss and at its constructor's state (what a resumed run forgot to load).
            fresh = scaler.__dict__.get("_scale") is None and _looks_fresh(scaler)
            track = _ScalerTrack(weakref.ref(scaler), self._name(scaler, "scaler"), fresh=fresh)
            self._series += 1
            track.series = self._series
            self._tracks[id(scaler)] = track
        return track

    def _names_of_params(self) -> dict[int, str]:
        # Read each time (at most OVERFLOW_STEPS_NAMED times per scaler): a cache keyed by ids would name the
        # parameters of a model rebuilt since by the freed one's names.
        names: dict[int, str] = {}
        for prefix, m in self._named_models():
            for n, p in m.named_parameters():
                names.setdefault(id(p), f"{prefix}.{n}")
        return names

    def _named_models(self) -> list[tuple[str, Any]]:
        """The models given, else the modules the user's nearest frame holds by name (a notebook's ``model``)."""
        if self.models:
            return [(self._name(m, "model"), m) for m in self.models]
        return modules_in_user_frames()

    # -- findings ----------------------------------------------------------------------
    def _report(self, slug: str, subject: str, where: Any, message: str, evidence: dict) -> Finding | None:
        where = _resolve(where)
        key = (slug, where.file if where else None, where.line if where else None)
        if key in self._reported:
            return None
        self._reported.add(key)
        finding = protocol_finding(slug, subject, where, message, evidence)
        self.findings.append(finding)
        try:
            self.on_finding(finding)
        except Exception:  # showing a finding must never break the loop
            pass
        return finding

    # -- events (called by the shared wrappers, inside try/except) -------------------
    def on_scale(self, scaler: Any, outputs: Any) -> None:
        track = self._track(scaler)
        track.scaled = True
        if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
            track.losses.append(outputs.detach())

    def on_unscale(self, scaler: Any, optimizer: Any, where: Location | None) -> None:
        track = self._track(scaler)
        stage = _stage(scaler, optimizer)
        opt = self._name(optimizer, "optimizer")
        if stage == "unscaled":
            self._report("amp-unscale-twice", track.name, where, _unscale_twice(track.name, opt, _resolve(where)),
                         {"optimizer": opt, "stage": stage})  # fmt: skip
        elif stage == "stepped":
            self._report("amp-update-missing", track.name, where,
                         f"{track.name}.unscale_({opt}) after {track.name}.step({opt}) with no update() between: "
                         "GradScaler raises 'unscale_() is being called after step()'. Call update() once per step.",
                         {"optimizer": opt, "stage": stage})  # fmt: skip

    def on_clip(self, params: list, max_norm: Any, total_norm: Any, where: Location | None) -> None:
        limit = _float(max_norm)
        if limit is not None and not math.isfinite(limit):
            return  # clip_grad_norm_(params, inf) only measures the norm (the Trainer logs grad_norm so)
        ids = None
        for track in self._tracks.values():
            scaler = track.ref()
            if scaler is None or not track.scaled or not _enabled(scaler):
                continue
            if ids is None:
                ids = frozenset(id(p) for p in params)
            unscaled = _unscaled_ids(scaler)
            # The recipe's case, cheaply: every clipped parameter belongs to an optimizer already unscaled.
            if unscaled and all(o in track.opt_params for o in unscaled):
                if track.union_cache[0] != unscaled:
                    track.union_cache = (unscaled, frozenset().union(*(track.opt_params[o] for o in unscaled)))
                if ids <= track.union_cache[1]:
                    continue
            if where is HERE:
                where = user_line(2)
            track.clips.append(_ClipEvent(ids, unscaled, where, limit, total_norm))

    def on_step(self, scaler: Any, optimizer: Any, where: Location | None) -> None:
        track = self._track(scaler)
        opt = self._name(optimizer, "optimizer")
        stage = _stage(scaler, optimizer)
        if stage == "stepped":
            self._report("amp-update-missing", track.name, where,
                         f"{track.name}.step({opt}) is called again with no {track.name}.update() since the last "
                         "step: GradScaler raises 'step() has already been called since the last update()'. Call "
                         f"{track.name}.update() once after every {track.name}.step().", {"optimizer": opt})  # fmt: skip
        self._check_clips(track, scaler, optimizer, where)
        if track.fresh and not track.checked_resume:
            track.checked_resume = True
            steps = _optimizer_steps(optimizer)
            if steps > 0:
                self._report("scaler-not-restored-on-resume", track.name, where,
                             f"{opt} has already taken {steps} steps but {track.name} is fresh "
                             f"(scale {_scale_value(scaler) or scaler.__dict__.get('_init_scale')}, growth tracker 0): "
                             "the scaler's state was not restored, so the first steps after resume are skipped "
                             "while the scale falls back to where it was.",
                             {"optimizer_steps": steps, "optimizer": opt})  # fmt: skip

    def after_step(self, scaler: Any, optimizer: Any) -> None:
        track = self._track(scaler)
        track.steps += 1
        track.stepped.add(id(optimizer))
        if id(optimizer) not in track.opt_params:
            track.opt_params[id(optimizer)] = _param_ids(optimizer)
        states = scaler.__dict__.get("_per_optimizer_states")
        st = dict.get(states, id(optimizer)) if isinstance(states, dict) else None
        found = st.get("found_inf_per_device", {}) if isinstance(st, dict) else {}
        # GradScaler already read these with .item() to decide whether to step: no new sync.
        skipped = bool(sum(float(v.item()) for v in found.values())) if found else False
        track.skipped = track.skipped or skipped
        self._last_skipped[id(optimizer)] = skipped
        if skipped and track.settled and track.overflow_named < OVERFLOW_STEPS_NAMED:
            track.overflow_named += 1
            for name in self._nonfinite_grads(optimizer):
                track.overflow_params[name] = track.overflow_params.get(name, 0) + 1

    def _nonfinite_grads(self, optimizer: Any) -> list[str]:
        names = self._names_of_params()
        params = [(gi, pi, p) for gi, g in enumerate(optimizer.param_groups) for pi, p in enumerate(g["params"])
                  if p.grad is not None]  # fmt: skip
        if not params:
            return []
        finite = torch.stack([torch.isfinite(p.grad).all() for _, _, p in params]).tolist()  # one transfer
        opt = self._name(optimizer, "optimizer")
        return [names.get(id(p), f"{opt}.param_groups[{gi}]['params'][{pi}] {tuple(p.shape)}")
                for (gi, pi, p), ok in zip(params, finite) if not ok]  # fmt: skip

    def _check_clips(self, track: _ScalerTrack, scaler: Any, optimizer: Any, where: Location | None) -> None:
        if not track.clips:
            return
        mine = track.opt_params.get(id(optimizer)) or _param_ids(optimizer)
        for clip in track.clips:
            if clip.params & mine and id(optimizer) not in clip.unscaled:
                scale = _scale_value(scaler) or 1.0
                norm = _float(clip.total_norm)
                real = f" (a real gradient norm of {norm / scale:.3g})" if norm is not None and math.isfinite(norm) else ""
                shown = f"{norm:.4g}" if norm is not None else "?"
                limit = f"{clip.max_norm / scale:.3g}" if clip.max_norm is not None else "max_norm / scale"
                lightning = track.name.endswith("precision_plugin.scaler") or _trainer_steps()  # Lightning's plugin
                advice = (LIGHTNING_CLIP_ADVICE if lightning else
                          f"Call {track.name}.unscale_({self._name(optimizer, 'optimizer')}) before clipping.")  # fmt: skip
                self._report("amp-clip-before-unscale", track.name, clip.where,
                             f"clip_grad_norm_ ran on {self._name(optimizer, 'optimizer')}'s gradients while they "
                             f"were still multiplied by the loss scale ({scale:g}): the scaled norm {shown}{real} was compared "
                             f"with max_norm, so in real units the threshold is max_norm / scale = {limit}: steps are "
                             f"clipped far below max_norm. {advice}",
                             {"optimizer": self._name(optimizer, "optimizer"), "scale": scale,
                              "max_norm": clip.max_norm, "scaled_total_norm": norm,
                              "step_line": getattr(_resolve(where), "label", None),
                              **({"lightning": True} if lightning else {})})  # fmt: skip
        track.clips = [c for c in track.clips if not (c.params & mine)]

    def on_optimizer_step(self, optimizer: Any, where: Location | None) -> None:
        """An optimizer.step() not called by scaler.step (the global pre-hook)."""
        for track in self._tracks.values():
            scaler = track.ref()
            if scaler is None or not track.scaled or not _enabled(scaler):
                continue
            opt = self._name(optimizer, "optimizer")
            track.bypassed = True
            self._check_clips(track, scaler, optimizer, where)
            if _stage(scaler, optimizer) == "unscaled":
                detail = ("the gradients were unscaled, but a step with inf/NaN gradients is not skipped and "
                          "writes NaN into the weights")  # fmt: skip
            else:
                scale = _scale_value(scaler)
                detail = (f"the gradients are still multiplied by the loss scale ({scale:g}), so the update is "
                          f"{scale:g} times too large")  # fmt: skip
            self._report("amp-step-bypasses-scaler", opt, where,
                         f"{opt}.step() is called directly after {track.name}.scale(loss).backward(): {detail}. "
                         f"Call {track.name}.step({opt}) instead.", {"scaler": track.name, "optimizer": opt})  # fmt: skip
            return

    def on_update(self, scaler: Any, where: Location | None) -> None:
        track = self._track(scaler)
        states = scaler.__dict__.get("_per_optimizer_states")
        any_check = isinstance(states, dict) and any(
            getattr(st.get("stage"), "name", "READY") != "READY" for st in dict.values(states)
        )
        bypassed, track.bypassed = track.bypassed, False
        if not (track.scaled and not any_check and not bypassed):
            return
        where = _resolve(where)
        if track.steps or _calls_in_source(where, f"{track.name}.step(") is not False:
            self._report("amp-update-per-microbatch", track.name, where,
                         f"{track.name}.update() is called with no {track.name}.step() since the last update (once "
                         "per micro-batch): GradScaler asserts 'No inf checks were recorded prior to update.'; with "
                         "gradient accumulation, step and update once, after the last micro-batch.", {})  # fmt: skip
        else:  # no scaler.step anywhere in the loop's code: the step is missing, not misplaced
            self._report("amp-step-missing", track.name, where,
                         f"{track.name}.update() is called but {track.name}.step(optimizer) is never called: the "
                         "optimizer never steps and nothing trains; GradScaler asserts 'No inf checks were recorded "
                         f"prior to update.'. Call {track.name}.step(optimizer) before {track.name}.update().",
                         {})  # fmt: skip

    def after_update(self, scaler: Any, scale: float | None) -> None:
        track = self._track(scaler)
        if not track.stepped:  # no step to record; update() still reset the scaler's per-optimizer state
            track.scaled, track.skipped, track.losses, track.clips = False, False, [], []
            return
        loss = None
        if len(track.losses) == 1:
            loss = float(track.losses[0])
        elif track.losses:
            loss = float(torch.stack([x.float().reshape(()) for x in track.losses]).sum().item())
        track.updates += 1
        skipped = track.skipped
        if not track.settled:
            if skipped:
                track.leading_skips += 1
            else:
                track.settled = True
        from ...facts.scale_history import ScaleRecord

        record = ScaleRecord(track.name, track.updates, float(scale or 0.0), skipped, loss, track.series, _running_cell())
        self.scale_history.append(record)
        track.history.append(record)
        if self.step_listener is not None:  # it handles its own failures; it raises only to stop the run on request
            self.step_listener(record)
        track.scaled, track.skipped, track.losses, track.clips = False, False, [], []
        track.stepped = set()
        if skipped:  # the skip share only rises with a skipped step
            self._check_unsettled(track)

    def _check_unsettled(self, track: _ScalerTrack) -> None:
        if track.unsettled_reported:
            return
        if not track.settled:
            self._check_never_settles(track)
            return
        window = track.history[track.leading_skips :][-UNSETTLED_WINDOW:]
        if len(window) < UNSETTLED_MIN_UPDATES:
            return
        skips = sum(r.skipped for r in window)
        if skips / len(window) < UNSETTLED_SKIP_SHARE:
            return
        track.unsettled_reported = True
        worst = sorted(track.overflow_params.items(), key=lambda kv: -kv[1])[:5]
        params = ", ".join(f"{n} ({k}x)" for n, k in worst) or "no gradient was inf/NaN at step time"
        self._report("amp-scale-unsettled", track.name, None,
                     f"{track.name} skipped {skips} of its last {len(window)} steps (scale now "
                     f"{window[-1].scale:g}): the run trains on a fraction of its batches. Gradients inf/NaN on the "
                     f"overflow steps: {params}.", {"skipped": skips, "window": len(window),
                                                    "overflow_params": dict(worst),
                                                    "step": window[-1].step})  # fmt: skip

    def _check_never_settles(self, track: _ScalerTrack) -> None:
        """Every step so far skipped, and the scale already below 1: no scale makes these gradients finite.

        A healthy start skips while the scale falls from its initial value to one the gradients fit (each skip
        halves it); past a scale of 1 the scaler shrinks the loss and it still overflows, so the loss or its
        gradients are inf/NaN whatever the scale. Judged from the scale's fall, not a fixed number of steps.
        """
        first, last = track.history[0], track.history[-1]
        if last.scale >= 1.0 or first.scale <= last.scale:
            return
        track.unsettled_reported = True
        steps = len(track.history)
        self._report("amp-scale-unsettled", track.name, None,
                     f"{track.name} skipped every one of its {steps} steps so far: the scale fell from {first.scale:g} "
                     f"to {last.scale:g} (below 1, where scaling shrinks the loss) and the gradients are still inf/NaN, "
                     "so the loss or its gradients overflow at any scale and nothing has trained. Find where: "
                     "mpdoctor.probe(model, batch).",
                     {"skipped": steps, "window": steps, "overflow_params": dict(sorted(
                         track.overflow_params.items(), key=lambda kv: -kv[1])[:5]),
                      "step": last.step, "scale_first": first.scale, "scale_now": last.scale})  # fmt: skip

    def on_scheduler_step(self, scheduler: Any, where: Location | None) -> None:
        self._sched_steps += 1
        opt = getattr(scheduler, "optimizer", None)
        if opt is None or not self._last_skipped.get(id(opt)):
            return
        self._last_skipped[id(opt)] = False  # one count per skipped step
        self._sched_on_skipped += 1
        if self._sched_reported or self._sched_on_skipped < max(2, math.ceil(SCHEDULER_SKIP_SHARE * self._sched_steps)):
            return
        self._sched_reported = True
        name = self._name(scheduler, "scheduler")
        self._report("amp-scheduler-on-skipped-steps", name, where,
                     f"{name}.step() advanced the learning-rate schedule on {self._sched_on_skipped} optimizer "
                     f"steps that {', '.join(t.name for t in self._tracks.values())} skipped (inf/NaN gradients), of "
                     f"{self._sched_steps} scheduler steps: warm-up and decay run ahead of the optimizer. Step the "
                     "scheduler only when the scale did not fall.",
                     {"scheduler_steps": self._sched_steps, "on_skipped_steps": self._sched_on_skipped})  # fmt: skip


def _calls_in_source(where: Location | None, call: str) -> bool | None:
    """Whether the file or cell of ``where`` holds ``call`` (``amp_scaler.step(``) outside a comment; None when
    its source cannot be read."""
    lines = linecache.getlines(where.file) if where is not None and where.file else []
    if not lines:
        return None
    return any(call in line.split("#", 1)[0] for line in lines)


def watched_findings(slugs: Collection[str], place: str) -> list[Finding]:
    """What the attached observers saw of rules ``slugs`` in ``place`` (``train.py``, ``cell [5]``), in the order
    seen: the crash explainer's cause for a protocol error the watcher saw happen (one mistake, one finding).

    Parameters
    ----------
    slugs : collection of str
        Runtime rule slugs (a crash family's ``checks``).
    place : str
        The failing line's :attr:`~mpdoctor.facts.location.Location.place`.
    """
    out: list[Finding] = []
    for observer in list(_DISPATCH.observers):
        for finding in getattr(observer, "findings", ()):
            where = finding.evidence.get("where") if isinstance(finding.evidence, dict) else None
            if finding.check in slugs and isinstance(where, str) and where.startswith((f"{place}:", f"{place},")):
                out.append(finding)
    return out


def _float(value: Any) -> float | None:
    try:
        return float(value.item()) if isinstance(value, torch.Tensor) else (float(value) if value is not None else None)
    except Exception:
        return None


def _looks_fresh(scaler: Any) -> bool:
    from ...facts.scaler import looks_fresh

    tracker = scaler.__dict__.get("_init_growth_tracker", 0)
    return looks_fresh(scaler.__dict__.get("_init_scale"), scaler.__dict__.get("_init_scale"), tracker)


#: Rules whose finding's subject is the optimizer or the scheduler, not the scaler.
_SCHEDULER = frozenset({"amp-scheduler-on-skipped-steps"})
_SUBJECT_NOT_SCALER = frozenset({"amp-step-bypasses-scaler"}) | _SCHEDULER


#: The packages of a Lightning ``Trainer`` (not Fabric, whose ``clip_gradients`` unscales first).
_TRAINER_PACKAGES = ("lightning.pytorch.", "pytorch_lightning.")


def _trainer_steps() -> bool:
    """A Lightning ``Trainer``'s code is on the stack of this step (its precision plugin calls ``scaler.step``), however
    the user names the scaler: read only when a clip before unscale is found."""
    frame = sys._getframe(1)
    while frame is not None:
        g = frame.f_globals
        name = dict.get(g, "__name__") if type(g) is dict else None
        if type(name) is str and name.startswith(_TRAINER_PACKAGES):
            return True
        frame = frame.f_back
    return False


#: Under a Lightning Trainer's 16-mixed plugin, where the clip belongs (the plugin unscales right before the hook).
LIGHTNING_CLIP_ADVICE = (
    "Clip in on_before_optimizer_step, where Lightning's precision plugin has unscaled them (not after a "
    "scaler.unscale_ of your own: the plugin unscales the gradients a second time)."
)
#: Not in place: the mistake is where a line of the user's LightningModule sits. An unscale_ of the user's own (on the
#: LightningOptimizer wrapper) goes unseen and the plugin unscales again; Lightning refuses Trainer(gradient_clip_val=...)
#: under manual optimization.
LIGHTNING_CLIP_CODE = (
    "# in the LightningModule: drop the clip from training_step and clip once Lightning has unscaled the gradients\n"
    "def on_before_optimizer_step(self, optimizer):\n"
    "    self.clip_gradients(optimizer, gradient_clip_val={max_norm!r}, gradient_clip_algorithm=\"norm\")\n"
    "# not applied in place: the mistake is the line's place in your method, which Trainer.fit calls; an unscale_ of\n"
    "# your own before it leaves the plugin unscaling a second time, and Lightning refuses Trainer(gradient_clip_val=...)\n"
    "# under manual optimization"
)


def protocol_finding(slug: str, subject: str, where: Location | None, message: str, evidence: dict) -> Finding:
    """A :class:`Finding` of a protocol rule at the user's line, with the corrected lines as display-only code."""
    from ...rules.engine.findings import Finding
    from ...rules.engine.fixes import Applicability, Fix

    rule = RULES[slug]
    at = f"{where.label}: " if where is not None else ""
    evidence = {**evidence, "where": where.label if where else None, "code": where.code if where else None}
    # The corrected lines in the user's names: the scaler is the subject unless the finding is about another object.
    scaler = evidence.get("scaler") or (subject if slug not in _SUBJECT_NOT_SCALER else "")
    code = corrected_template(slug, scaler, evidence.get("optimizer") or "", subject if slug in _SCHEDULER else "")
    fix = Fix(f"Corrected lines ({slug})", code, applicability=Applicability.DISPLAY_ONLY,
              slug=slug, recipe=slug)  # fmt: skip
    if evidence.get("lightning"):
        fix = _lightning_clip_fix(slug, where, evidence.get("max_norm"))
    return Finding(slug, rule.severity, subject, f"{at}{message}", evidence, [fix])


def _lightning_clip_fix(slug: str, where: Location | None, max_norm: Any) -> Any:
    """The user's LightningModule class with its clip moved into ``on_before_optimizer_step`` (its cell whole, or the
    script's class), a corrected cell run on twins before it is shown; else the hook as advice."""
    from ...rules.engine.fixes import Applicability, Fix
    from .op_rewrite import CORRECTED_CELL

    corrected = None
    if where is not None:
        from .hook_rewrite import corrected_class

        try:
            corrected = corrected_class(where.file, where.line)
        except Exception:  # the advice stands
            corrected = None
    if corrected is None:
        return Fix(f"Corrected lines ({slug})", LIGHTNING_CLIP_CODE.format(max_norm=max_norm),
                   applicability=Applicability.DISPLAY_ONLY, slug=slug, recipe=slug)  # fmt: skip
    code, cell = corrected
    place = where.place if cell else f"the class in {where.place}"
    head = (f"# {place} again, its clip moved to on_before_optimizer_step (after Lightning's precision plugin "
            "unscales);\n# then make a new instance of the class and fit it")  # fmt: skip
    return Fix(f"Run {place} again with the clip in on_before_optimizer_step (corrected code)", f"{head}\n{code}",
               applicability=Applicability.DISPLAY_ONLY, slug=slug, recipe=CORRECTED_CELL)  # fmt: skip


def print_finding(finding: Finding) -> None:
    """Print ``finding`` to stderr as one block: the rule, the line, the message, the corrected lines."""
    where = finding.evidence.get("where")
    code = finding.evidence.get("code")
    lines = [f"mpdoctor: {finding.severity} [{finding.check}] {RULES[finding.check].title}"]
    if where:
        lines.append(f"  at {where}: {code}" if code else f"  at {where}")
    message = finding.message
    if where and message.startswith(f"{where}: "):
        message = message[len(where) + 2 :]
    lines.append(f"  {message}")
    code = finding.fixes[0].code if finding.fixes else RULES[finding.check].use_instead
    lines.append("  corrected:\n" + "\n".join(f"    {x}" for x in code.splitlines()))
    print("\n".join(lines), file=sys.stderr)


def protocol_report(observer: ProtocolObserver, base: Any = None, findings: list[Finding] | None = None,
                    history: list | None = None) -> Any:  # fmt: skip
    """The report of a watched run, assembled (:func:`mpdoctor.attach.runtime.assembly.assemble`): ``base``'s findings (the
    diagnosis before the first step) and the protocol findings (``findings``, default all of the observer's), with
    the scale history ``history`` (default all of the observer's). Without ``base``, a diagnosis of nothing."""
    from .assembly import Observed, assemble

    if base is None:
        from ...diagnosis import diagnose_subjects

        base = diagnose_subjects([])
    observed = tuple(observer.findings if findings is None else findings)
    steps = observer.scale_history if history is None else history
    return assemble(base, Observed(watched=observed, scale_history=tuple(steps)))
