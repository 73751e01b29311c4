"""The GradScaler protocol's shared wrappers and their dispatch to observers (:mod:`mpdoctor.attach.runtime.protocol`).

Kept apart from the observer so that ``%load_ext mpdoctor`` can arm a notebook session's resident
``GradScaler.scale`` wrapper without importing the observer, its rules and the facts: the session's observer
is created at the first event (:mod:`mpdoctor.attach.runtime.session`).

Every wrapper calls the original with the same arguments and returns its result: numerics are unchanged.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

#: Passed by the wrappers instead of a ``Location``: the user's line is looked up only if a finding needs it.
HERE: Any = object()


def _enabled(scaler: Any) -> bool:
    return bool(scaler.__dict__.get("_enabled", False))


def _scale_value(scaler: Any) -> float | None:
    s = scaler.__dict__.get("_scale")
    if s is None:
        return None
    return float(s.item()) if isinstance(s, torch.Tensor) else float(s)


# -- the shared wrappers ---------------------------------------------------------------------------------------


class _Dispatch:
    """The wrappers installed once for every attached observer; removed when the last one detaches.

    A notebook session also keeps one *resident* wrapper, ``GradScaler.scale``, from its first cell with
    torch until ``%unload_ext`` (:meth:`arm` / :meth:`disarm`): with no observer attached it only calls the
    original. A cell's observer then attaches lazily (a list append); the first loss a scaler scales in it
    installs the rest, which the end of the cell removes.
    """

    def __init__(self) -> None:
        self.observers: list[Any] = []  # ProtocolObservers, or a session's pending one
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

    def add(self, observer: Any, lazy: bool = False) -> None:
        if not self.observers:
            if lazy and self.resident is not None:
                self.lazy = True
            else:
                self.install()
        elif self.lazy and not lazy:
            self.complete()
        self.observers.append(observer)

    def settle(self) -> None:
        """After a notebook cell: back to the resident wrapper alone, what the cell's training installed removed.

        Kept while a step is open across cells (a scaler scaled a loss or stepped and has not updated) or a
        non-lazy observer (a ``watch()`` left open across cells) is attached.
        """
        if self.lazy or self.resident is None or not (self.saved or self.handles):
            return
        if any(not o.lazy or o.mid_step for o in self.observers):
            return
        self.uninstall()
        self.lazy = bool(self.observers)

    def remove(self, observer: Any) -> None:
        if observer in self.observers:
            self.observers.remove(observer)
        if not self.observers:
            self.uninstall()

    def emit(self, method: str, *args: Any) -> None:
        for obs in list(self.observers):
            try:
                getattr(obs, method)(*args)
            except Exception as exc:  # mpdoctor must never be what breaks the loop, unless asked to stop it
                if getattr(exc, "stops_the_run", False):  # watch(stop_on_nonfinite=True)
                    raise
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
        if not (self.saved or self.handles or self.in_scaler_step):  # a lazy cell that never trained
            self.lazy = False
            return
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
    from torch.optim.lr_scheduler import LRScheduler
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from ...compat import clip_entry_points, clip_helper, grad_scaler_class

    GradScaler = grad_scaler_class()
    helper = clip_helper()
    # torch >= 2.6 clips through one helper; older torch inside clip_grad_norm_, wrapped where it is looked up.
    clips = [(*helper, _wrap_clip)] if helper else [(owner, name, _wrap_clip_norm) for owner, name in clip_entry_points()]
    wanted = [(GradScaler, "scale", _wrap_scale), (GradScaler, "unscale_", _wrap_unscale),
              (GradScaler, "step", _wrap_step), (GradScaler, "update", _wrap_update),
              *clips, (LRScheduler, "step", _wrap_scheduler)]  # fmt: skip
    return wanted, register_optimizer_step_pre_hook


def _wrap_scale(original: Callable) -> Callable:
    def scale(self: Any, outputs: Any) -> Any:
        __tracebackhide__ = True  # IPython 8+ leaves this wrapper out of the user's traceback
        if _DISPATCH.observers and _enabled(self):
            if _DISPATCH.lazy:
                _DISPATCH.complete()
            _DISPATCH.emit("on_scale", self, outputs)
        return original(self, outputs)

    scale.__wrapped__ = original
    return scale


def _wrap_unscale(original: Callable) -> Callable:
    def unscale_(self: Any, optimizer: Any) -> Any:
        __tracebackhide__ = True  # IPython 8+ leaves this wrapper out of the user's traceback
        if _DISPATCH.observers and _enabled(self):
            _DISPATCH.emit("on_unscale", self, optimizer, HERE)
        return original(self, optimizer)

    unscale_.__wrapped__ = original
    return unscale_


def _wrap_step(original: Callable) -> Callable:
    def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # IPython 8+ leaves this wrapper out of the user's traceback
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
        __tracebackhide__ = True  # IPython 8+ leaves this wrapper out of the user's traceback
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
        __tracebackhide__ = True  # IPython 8+ leaves this wrapper out of the user's traceback
        if _DISPATCH.observers:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            _DISPATCH.emit("on_clip", params, max_norm, total_norm, HERE)
            parameters = params
        return original(parameters, max_norm, total_norm, foreach)

    _clip_grads_with_norm_.__wrapped__ = original
    return _clip_grads_with_norm_


def _wrap_clip_norm(original: Callable) -> Callable:
    """``clip_grad_norm_`` itself, on a torch without ``_clip_grads_with_norm_`` (2.4, 2.5)."""

    def clip_grad_norm_(parameters: Any, max_norm: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # IPython 8+ leaves this wrapper out of the user's traceback
        if not _DISPATCH.observers:
            return original(parameters, max_norm, *args, **kwargs)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        total_norm = original(params, max_norm, *args, **kwargs)
        # Told after the clip: the observer needs the norm, and clipping changes no scaler state it reads.
        _DISPATCH.emit("on_clip", params, max_norm, total_norm, HERE)
        return total_norm

    clip_grad_norm_.__wrapped__ = original
    return clip_grad_norm_


def _wrap_scheduler(original: Callable) -> Callable:
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # IPython 8+ leaves this wrapper out of the user's traceback
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


def settle() -> None:
    """The end of a notebook cell: remove what its training installed, unless a step is still open."""
    _DISPATCH.settle()


def disarm() -> None:
    """Release a session's hold on the resident wrapper; the last release puts the original back."""
    _DISPATCH.disarm()




def hide_own_frames(exc: BaseException | None) -> None:
    """Take mpdoctor's wrapper frames (those marked ``__tracebackhide__``) out of ``exc``'s traceback, and out of the
    exceptions it was raised from or during, in place: what a plain Python traceback then prints is the user's code
    and the library's, as without mpdoctor. IPython hides them itself; a script's traceback is printed by
    ``mpdoctor run`` or passes through ``watch()``, which call this. The wrapper's own frame stays only while the
    exception is still inside it: CPython adds each frame as the exception leaves it."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        head = exc.__traceback__
        while head is not None and _own_hidden(head):
            head = head.tb_next
        entry = head
        while entry is not None:
            after = entry.tb_next
            while after is not None and _own_hidden(after):
                after = after.tb_next
            entry.tb_next = after
            entry = after
        exc.__traceback__ = head
        exc = exc.__cause__ or exc.__context__


def _own_hidden(entry: Any) -> bool:
    frame = entry.tb_frame
    try:
        return frame.f_code.co_filename.startswith(_PACKAGE_DIR) and bool(frame.f_locals.get("__tracebackhide__"))
    except Exception:  # a frame that cannot be read is shown
        return False


#: Where mpdoctor's own files are: only their frames are ever hidden.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
