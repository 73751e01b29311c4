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
from its first cell with torch to ``%unload_ext``, ``GradScaler.scale``, which only calls the original when no
observer is attached; a cell's observer attaches lazily and the first loss a scaler scales in the cell installs
the rest (``scale()`` opens every real step) until the cell ends. A cell that does not train costs two list
operations.
"""

from __future__ import annotations

import linecache
import math
import os
import re
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..facts.scale_history import ScaleRecord
from ..treatment.findings import SEVERITY_RANK, Finding
from .rules import RULES

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


#: Passed by the wrappers instead of a :class:`Where`: the user's line is looked up only if a finding needs it.
HERE: Any = object()


def _resolve(where: Any) -> Where | None:
    return user_line(3) if where is HERE else where


@dataclass(frozen=True)
class Where:
    """A line of the user's code: file, line number, the source text and the notebook cell if any."""

    filename: str
    lineno: int
    text: str = ""
    cell: int | None = None

    @property
    def label(self) -> str:
        """``train.py:23`` or ``In [7], line 12``."""
        if self.cell is not None:
            return f"In [{self.cell}], line {self.lineno}"
        name = self.filename
        try:
            rel = os.path.relpath(name)
            name = rel if not rel.startswith("..") else name
        except ValueError:  # another drive on Windows
            pass
        return f"{name}:{self.lineno}"


_IPYTHON_INPUT = re.compile(r"^<ipython-input-(\d+)-")


def cell_number(filename: str) -> int | None:
    """The execution count of the IPython cell compiled under ``filename``, or None when it is a file.

    IPython 7.34 names cells ``<ipython-input-7-...>``; newer IPython keeps ``compile._filename_map``
    (ipykernel's ``/tmp/ipykernel_.../123.py`` names included).
    """
    m = _IPYTHON_INPUT.match(filename)
    if m:
        return int(m.group(1))
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return None
    try:
        shell = ipython.get_ipython()
        fmap = getattr(getattr(shell, "compile", None), "_filename_map", None)
        number = fmap.get(filename) if isinstance(fmap, dict) else None
        return int(number) if isinstance(number, int) else None
    except Exception:
        return None


def user_line(depth: int = 2) -> Where | None:
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
            return Where(code.co_filename, frame.f_lineno, text, cell_number(code.co_filename))
        frame = frame.f_back
    return None


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
                if type(scope) is dict:
                    for key, value in dict.items(scope):
                        if value is obj and type(key) is str and not key.startswith("_"):
                            return key
            return None
        frame = frame.f_back
    return None


@dataclass
class _ClipEvent:
    params: frozenset
    unscaled: frozenset  # ids of the optimizers this scaler had unscaled when the clip ran
    where: Where | None
    max_norm: float | None
    total_norm: Any


@dataclass
class _ScalerTrack:
    """What an observer knows about one GradScaler since it was first seen."""

    ref: Any
    name: str
    fresh: bool = False  # first seen before it ever scaled a loss, with a fresh state
    checked_resume: bool = False
    scaled: bool = False  # a loss was scaled since the last update()
    stepped: set = field(default_factory=set)  # optimizers stepped since the last update()
    skipped: bool = False  # a step since the last update() was skipped
    losses: list = field(default_factory=list)
    clips: list = field(default_factory=list)
    updates: int = 0
    steps: int = 0
    leading_skips: int = 0  # the first run of skips (the scale settling from its start)
    settled: bool = False
    overflow_params: dict = field(default_factory=dict)  # name -> overflow steps where its grad was inf/NaN
    overflow_named: int = 0
    unsettled_reported: bool = False
    bypassed: bool = False  # optimizer.step() was called past this scaler since the last update()
    history: list = field(default_factory=list)  # this scaler's ScaleRecords
    opt_params: dict = field(default_factory=dict)  # id(optimizer) -> its param ids, cached at its first step
    union_cache: tuple = (frozenset(), frozenset())  # (unscaled optimizer ids, their param ids)


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


def _enabled(scaler: Any) -> bool:
    return bool(scaler.__dict__.get("_enabled", False))


def _scale_value(scaler: Any) -> float | None:
    s = scaler.__dict__.get("_scale")
    if s is None:
        return None
    return float(s.item()) if isinstance(s, torch.Tensor) else float(s)


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
        Called with each new :class:`~mpdoctor.findings.Finding` at the call where it happens
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
    ) -> None:
        self.names = dict(names or {})
        self.models = [m for m in models if isinstance(m, torch.nn.Module)]
        self.on_finding = on_finding if on_finding is not None else _print_finding
        self.findings: list[Finding] = []
        self.scale_history: list[ScaleRecord] = []
        self._tracks: dict[int, _ScalerTrack] = {}
        self._reported: set = set()
        self._sched_steps = 0
        self._sched_on_skipped = 0
        self._sched_reported = False
        self._last_skipped: dict[int, bool] = {}  # id(optimizer) -> its last scaler.step was skipped
        self._param_names: dict[int, str] | None = None
        self.attached = False

    # -- life cycle --------------------------------------------------------------------
    def attach(self, lazy: bool = False) -> ProtocolObserver:
        """Start observing (installs the shared wrappers when this is the first observer attached).

        ``lazy=True`` (a notebook cell, with the resident ``GradScaler.scale`` wrapper armed) installs nothing
        until a scaler scales a loss (see the module's docstring); a caller that may already be inside a step
        (:attr:`mid_step`) must not be lazy. Without the resident wrapper, ``lazy`` is ignored.
        """
        if not self.attached:
            _DISPATCH.add(self, lazy=lazy)
            self.attached = True
        return self

    @property
    def mid_step(self) -> bool:
        """True when a scaler it follows scaled a loss or stepped and has not updated yet (a step spans calls)."""
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
                             "never adapts, and the next scaler.step() raises 'step() has already been called since "
                             "the last update()'.", {"steps": track.steps})  # fmt: skip

    def __enter__(self) -> ProtocolObserver:
        return self.attach()

    def __exit__(self, *exc: Any) -> bool:
        self.close()
        return False

    # -- naming ------------------------------------------------------------------------
    def _name(self, obj: Any, default: str) -> str:
        name = self.names.get(id(obj))
        if name is None:
            name = name_in_user_frames(obj)
            if name is None:
                return default
            self.names[id(obj)] = name  # a name found once is kept: the object may be out of frame later
        return name

    def _track(self, scaler: Any) -> _ScalerTrack:
        track = self._tracks.get(id(scaler))
        if track is None or track.ref() is not scaler:
            # Fresh: never scaled a loss and at its constructor's state (what a resumed run forgot to load).
            fresh = scaler.__dict__.get("_scale") is None and _looks_fresh(scaler)
            track = _ScalerTrack(weakref.ref(scaler), self._name(scaler, "scaler"), fresh=fresh)
            self._tracks[id(scaler)] = track
        return track

    def _names_of_params(self) -> dict[int, str]:
        if self._param_names is None:
            names: dict[int, str] = {}
            for m in self.models:
                prefix = self._name(m, "model")
                for n, p in m.named_parameters():
                    names.setdefault(id(p), f"{prefix}.{n}")
            self._param_names = names
        return self._param_names

    # -- findings ----------------------------------------------------------------------
    def _report(self, slug: str, subject: str, where: Any, message: str, evidence: dict) -> Finding | None:
        where = _resolve(where)
        key = (slug, where.filename if where else None, where.lineno if where else None)
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

    def on_unscale(self, scaler: Any, optimizer: Any, where: Where | None) -> None:
        track = self._track(scaler)
        stage = _stage(scaler, optimizer)
        opt = self._name(optimizer, "optimizer")
        if stage == "unscaled":
            self._report("amp-unscale-twice", track.name, where,
                         f"{track.name}.unscale_({opt}) is called again before {track.name}.update(): GradScaler "
                         "raises 'unscale_() has already been called on this optimizer since the last update()'. "
                         "With gradient accumulation, unscale once per real step, after the last micro-batch.",
                         {"optimizer": opt, "stage": stage})  # fmt: skip
        elif stage == "stepped":
            self._report("amp-update-missing", track.name, where,
                         f"{track.name}.unscale_({opt}) after {track.name}.step({opt}) with no update() between: "
                         "GradScaler raises 'unscale_() is being called after step()'. Call update() once per step.",
                         {"optimizer": opt, "stage": stage})  # fmt: skip

    def on_clip(self, params: list, max_norm: Any, total_norm: Any, where: Where | None) -> None:
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

    def on_step(self, scaler: Any, optimizer: Any, where: Where | None) -> None:
        track = self._track(scaler)
        opt = self._name(optimizer, "optimizer")
        stage = _stage(scaler, optimizer)
        if stage == "stepped":
            self._report("amp-update-missing", track.name, where,
                         f"{track.name}.step({opt}) is called again with no {track.name}.update() since the last "
                         "step: GradScaler raises 'step() has already been called since the last update()'. Call "
                         "scaler.update() once after every scaler.step().", {"optimizer": opt})  # fmt: skip
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

    def _check_clips(self, track: _ScalerTrack, scaler: Any, optimizer: Any, where: Where | None) -> None:
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
                self._report("amp-clip-before-unscale", track.name, clip.where,
                             f"clip_grad_norm_ ran on {self._name(optimizer, 'optimizer')}'s gradients while they "
                             f"were still multiplied by the loss scale ({scale:g}): the scaled norm {shown}{real} was compared "
                             f"with max_norm, so in real units the threshold is max_norm / scale = {limit}: steps are "
                             "clipped far below max_norm. Call scaler.unscale_(optimizer) before clipping.",
                             {"scale": scale, "max_norm": clip.max_norm, "scaled_total_norm": norm,
                              "step_line": getattr(_resolve(where), "label", None)})  # fmt: skip
        track.clips = [c for c in track.clips if not (c.params & mine)]

    def on_optimizer_step(self, optimizer: Any, where: Where | None) -> None:
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

    def on_update(self, scaler: Any, where: Where | None) -> None:
        track = self._track(scaler)
        states = scaler.__dict__.get("_per_optimizer_states")
        any_check = isinstance(states, dict) and any(
            getattr(st.get("stage"), "name", "READY") != "READY" for st in dict.values(states)
        )
        bypassed, track.bypassed = track.bypassed, False
        if track.scaled and not any_check and not bypassed:
            self._report("amp-update-per-microbatch", track.name, where,
                         f"{track.name}.update() is called with no scaler.step() since the last update (once per "
                         "micro-batch?): GradScaler asserts 'No inf checks were recorded prior to update.'; with "
                         "gradient accumulation, step and update once, after the last micro-batch.", {})  # fmt: skip

    def after_update(self, scaler: Any, scale: float | None) -> None:
        track = self._track(scaler)
        if not track.stepped:
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
        record = ScaleRecord(track.name, track.updates, float(scale or 0.0), skipped, loss)
        self.scale_history.append(record)
        track.history.append(record)
        track.scaled, track.skipped, track.losses, track.clips = False, False, [], []
        track.stepped = set()
        if skipped:  # the skip share only rises with a skipped step
            self._check_unsettled(track)

    def _check_unsettled(self, track: _ScalerTrack) -> None:
        if track.unsettled_reported:
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

    def on_scheduler_step(self, scheduler: Any, where: Where | None) -> None:
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


def _float(value: Any) -> float | None:
    try:
        return float(value.item()) if isinstance(value, torch.Tensor) else (float(value) if value is not None else None)
    except Exception:
        return None


def _looks_fresh(scaler: Any) -> bool:
    from ..facts.scaler import looks_fresh

    tracker = scaler.__dict__.get("_init_growth_tracker", 0)
    return looks_fresh(scaler.__dict__.get("_init_scale"), scaler.__dict__.get("_init_scale"), tracker)


def protocol_finding(slug: str, subject: str, where: Where | None, message: str, evidence: dict) -> Finding:
    """A :class:`Finding` of a protocol rule at the user's line, with the corrected lines as display-only code."""
    from ..treatment.fixes import Applicability, Fix

    rule = RULES[slug]
    at = f"{where.label}: " if where is not None else ""
    evidence = {**evidence, "where": where.label if where else None, "code": where.text if where else None}
    fix = Fix(f"Corrected lines ({rule.title.lower()})", rule.corrected, applicability=Applicability.DISPLAY_ONLY,
              slug=slug, recipe=slug)  # fmt: skip
    return Finding(slug, rule.severity, subject, f"{at}{message}", evidence, [fix])


def _print_finding(finding: Finding) -> None:
    where = finding.evidence.get("where")
    code = finding.evidence.get("code")
    lines = [f"mpdoctor: {finding.severity} [{finding.check}] {RULES[finding.check].title}"]
    if where:
        lines.append(f"  at {where}: {code}" if code else f"  at {where}")
    message = finding.message
    if where and message.startswith(f"{where}: "):
        message = message[len(where) + 2 :]
    lines.append(f"  {message}")
    lines.append("  corrected:\n" + "\n".join(f"    {x}" for x in RULES[finding.check].corrected.splitlines()))
    print("\n".join(lines), file=sys.stderr)


# -- the shared wrappers ---------------------------------------------------------------------------------------


class _Dispatch:
    """The wrappers installed once for every attached observer; removed when the last one detaches.

    A notebook session also keeps one *resident* wrapper, ``GradScaler.scale``, from its first cell with
    torch until ``%unload_ext`` (:meth:`arm` / :meth:`disarm`): with no observer attached it only calls the
    original. A cell's observer then attaches lazily (a list append); the first loss a scaler scales in it
    installs the rest, which the end of the cell removes.
    """

    def __init__(self) -> None:
        self.observers: list[ProtocolObserver] = []
        self.saved: list[tuple[Any, str, Any]] = []
        self.handles: list[Any] = []
        self.in_scaler_step: list[int] = []  # ids of optimizers inside scaler.step (re-entrant)
        self.cache: dict[tuple[int, str], tuple[Any, Any]] = {}  # (owner, name) -> (original, its wrapper)
        self.targets: Any = None  # (what to wrap, the global hook registrar), resolved at the first install
        self.lazy = False  # observers are attached but only GradScaler.scale is wrapped; complete() adds the rest
        self.resident: tuple[Any, Any, Any] | None = None  # (GradScaler, original scale, wrapper) while armed
        self.armed = 0  # notebook sessions holding the resident wrapper

    def arm(self) -> None:
        """Install the resident ``GradScaler.scale`` wrapper (a notebook session's first cell with torch)."""
        self.armed += 1
        if self.resident is not None:
            return
        if self.targets is None:
            self.targets = _targets()
        if self.observers and not self.lazy:  # a watch() is running: scale is already wrapped, in self.saved
            for i, (owner, name, original) in enumerate(self.saved):
                if name == "scale":
                    self.resident = (owner, original, vars(owner)[name])
                    del self.saved[i]
                    return
        owner, name, wrapper = self._wrappers(first=True)[0]
        self.resident = (owner, vars(owner)[name], wrapper)
        setattr(owner, name, wrapper)

    def disarm(self) -> None:
        """Remove the resident wrapper when the last session that armed it ends (``%unload_ext``)."""
        self.armed = max(0, self.armed - 1)
        if self.armed or self.resident is None:
            return
        owner, original, wrapper = self.resident
        self.resident = None
        if self.observers and not self.lazy:  # a watch() still runs: its install keeps the wrapper until it ends
            self.saved.insert(0, (owner, "scale", original))
            return
        if vars(owner).get("scale") is wrapper:  # never undo what another library installed after us
            owner.scale = original
        if self.lazy:
            self.lazy = False

    def add(self, observer: ProtocolObserver, lazy: bool = False) -> None:
        if not self.observers:
            if lazy and self.resident is not None:
                self.lazy = True
            else:
                self.install()
        elif self.lazy and not lazy:
            self.complete()
        self.observers.append(observer)

    def remove(self, observer: ProtocolObserver) -> None:
        if observer in self.observers:
            self.observers.remove(observer)
        if not self.observers:
            self.uninstall()

    def emit(self, method: str, *args: Any) -> None:
        for obs in list(self.observers):
            try:
                getattr(obs, method)(*args)
            except Exception as exc:  # mpdoctor must never be what breaks the loop
                print(f"mpdoctor: protocol observer failed in {method}: {type(exc).__name__}: {exc}", file=sys.stderr)

    def install(self) -> None:
        try:
            if self.targets is None:
                self.targets = _targets()
            self._install_all()
        except BaseException:
            self.uninstall()
            raise

    def complete(self) -> None:
        """Install what a lazy attach left out (called by the ``scale`` wrapper, or by a non-lazy observer)."""
        if not self.lazy:
            return
        self.lazy = False
        self.install()

    def _install_all(self) -> None:
        done = {(id(owner), name) for owner, name, _ in self.saved}
        if self.resident is not None:
            done.add((id(self.resident[0]), "scale"))
        for owner, name, wrapper in self._wrappers():
            if (id(owner), name) not in done:
                self.saved.append((owner, name, vars(owner)[name]))
                setattr(owner, name, wrapper)
        self.handles.append(self.targets[1](_optimizer_pre_hook))

    def _wrappers(self, first: bool = False) -> list[tuple[Any, str, Any]]:
        """(owner, attribute, wrapper), built once per original (a notebook attaches at every cell).

        ``first``: only the first target, ``GradScaler.scale``.
        """
        out = []
        for owner, name, wrap in self.targets[0][:1] if first else self.targets[0]:
            original = vars(owner).get(name)
            if original is None:
                continue
            key = (id(owner), name)
            cached = self.cache.get(key)
            if cached is None or cached[0] is not original:
                cached = (original, wrap(original))
                self.cache[key] = cached
            out.append((owner, name, cached[1]))
        return out

    def uninstall(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        while self.saved:
            owner, name, original = self.saved.pop()
            setattr(owner, name, original)
        self.in_scaler_step.clear()
        self.lazy = False


_DISPATCH = _Dispatch()


def _targets() -> tuple[list, Callable]:
    from torch.amp.grad_scaler import GradScaler
    from torch.nn.utils import clip_grad
    from torch.optim.lr_scheduler import LRScheduler
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    wanted = [(GradScaler, "scale", _wrap_scale), (GradScaler, "unscale_", _wrap_unscale),
              (GradScaler, "step", _wrap_step), (GradScaler, "update", _wrap_update),
              (clip_grad, "_clip_grads_with_norm_", _wrap_clip), (LRScheduler, "step", _wrap_scheduler)]  # fmt: skip
    return wanted, register_optimizer_step_pre_hook


def _wrap_scale(original: Callable) -> Callable:
    def scale(self: Any, outputs: Any) -> Any:
        if _DISPATCH.observers and _enabled(self):
            if _DISPATCH.lazy:
                _DISPATCH.complete()
            _DISPATCH.emit("on_scale", self, outputs)
        return original(self, outputs)

    scale.__wrapped__ = original
    return scale


def _wrap_unscale(original: Callable) -> Callable:
    def unscale_(self: Any, optimizer: Any) -> Any:
        if _DISPATCH.observers and _enabled(self):
            _DISPATCH.emit("on_unscale", self, optimizer, HERE)
        return original(self, optimizer)

    unscale_.__wrapped__ = original
    return unscale_


def _wrap_step(original: Callable) -> Callable:
    def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if not (_DISPATCH.observers and _enabled(self)):
            return original(self, optimizer, *args, **kwargs)
        _DISPATCH.emit("on_step", self, optimizer, HERE)
        _DISPATCH.in_scaler_step.append(id(optimizer))
        try:
            result = original(self, optimizer, *args, **kwargs)
        finally:
            _DISPATCH.in_scaler_step.pop()
        _DISPATCH.emit("after_step", self, optimizer)
        return result

    step.__wrapped__ = original
    return step


def _wrap_update(original: Callable) -> Callable:
    def update(self: Any, new_scale: Any = None) -> Any:
        if not (_DISPATCH.observers and _enabled(self)):
            return original(self, new_scale)
        _DISPATCH.emit("on_update", self, HERE)
        try:
            scale = _scale_value(self)
        except Exception:
            scale = None
        result = original(self, new_scale)
        _DISPATCH.emit("after_update", self, scale)
        return result

    update.__wrapped__ = original
    return update


def _wrap_clip(original: Callable) -> Callable:
    def _clip_grads_with_norm_(parameters: Any, max_norm: Any, total_norm: Any, foreach: Any = None) -> Any:
        if _DISPATCH.observers:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            _DISPATCH.emit("on_clip", params, max_norm, total_norm, HERE)
            parameters = params
        return original(parameters, max_norm, total_norm, foreach)

    _clip_grads_with_norm_.__wrapped__ = original
    return _clip_grads_with_norm_


def _wrap_scheduler(original: Callable) -> Callable:
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _DISPATCH.observers:
            _DISPATCH.emit("on_scheduler_step", self, HERE)
        return original(self, *args, **kwargs)

    step.__wrapped__ = original
    return step


def _optimizer_pre_hook(optimizer: Any, args: tuple, kwargs: dict) -> None:
    if id(optimizer) in _DISPATCH.in_scaler_step or not _DISPATCH.observers:
        return None
    _DISPATCH.emit("on_optimizer_step", optimizer, HERE)
    return None


def installed() -> bool:
    """True while the protocol wrappers are installed (some observer is attached and completed); a notebook
    session's resident ``GradScaler.scale`` wrapper alone is not counted (see :func:`resident`)."""
    return bool(_DISPATCH.saved or _DISPATCH.handles)


def resident() -> bool:
    """True while a notebook session holds the resident ``GradScaler.scale`` wrapper (until ``%unload_ext``)."""
    return _DISPATCH.resident is not None


def arm() -> None:
    """Install the resident ``GradScaler.scale`` wrapper for a notebook session (counted; see :func:`disarm`)."""
    _DISPATCH.arm()


def disarm() -> None:
    """Release a session's hold on the resident wrapper; the last release puts the original back."""
    _DISPATCH.disarm()


def protocol_report(observer: ProtocolObserver, base: Any = None, findings: list[Finding] | None = None) -> Any:
    """The report of a watched run: ``base``'s findings (the diagnosis before the first step) and the
    protocol findings (``findings``, default all of the observer's), with ``report.scale_history``.
    Without ``base``, a diagnosis of nothing."""
    from ..diagnosis.report import Report

    if base is None:
        from ..diagnosis import diagnose_subjects

        base = diagnose_subjects([])
    observed = list(observer.findings if findings is None else findings)
    findings = sorted([*base.findings, *observed], key=lambda f: (SEVERITY_RANK[f.severity], f.check, f.subject))
    plan = [*base.fixes, *(fx for f in observed for fx in f.fixes)]
    report = Report(findings, base.facts, target=base.target, scan=base.scan, ignore=base.ignore,
                    subjects=base._subjects, live=base.live, plan=plan, hidden=base.hidden)  # fmt: skip
    report.scale_history = list(observer.scale_history)
    return report
