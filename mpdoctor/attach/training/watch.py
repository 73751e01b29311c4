"""``mpdoctor.watch``: the doctor inside a hand-written training loop.

:class:`LossWatcher` is the shared machinery: forward hooks that keep the
latest inputs and loss of a model (no copy, no sync), one transfer per
optimizer step to find the first non-finite loss, and a probe of that batch.
:class:`watch` (loops), ``MPDoctorCallback`` (Trainer) and ``mpdoctor run
--probe-on-nan`` (:class:`GlobalLossWatcher`) are built on it; a Lightning
callback can be too: attach in ``on_fit_start``, ``take_nonfinite`` in
``on_before_optimizer_step``, ``close`` in ``on_fit_end``.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch

from ..numerics.probe import probe_inputs
from ..runtime.losses import LossWatcher, loss_of


def show(report: Any, when: str) -> None:
    """Display a report in IPython (widget or HTML), else print its text to stderr."""
    ipython = sys.modules.get("IPython")
    shell = None
    if ipython is not None:
        try:
            shell = ipython.get_ipython()
        except Exception:
            shell = None
    if shell is not None:
        from ...render.frontend import show as display_report

        print(f"mpdoctor {when}:")
        display_report(report)
    else:
        print(f"mpdoctor {when}:\n{report.to_text()}", file=sys.stderr)


def count_nonfinite_loss(report: Any, loss: float, where: str) -> Any:
    """Make a non-finite loss an error of ``report``: a probe that found every module finite (the NaN came
    from the loss computation, outside the model) must not read "0 errors" beside ``loss = nan``."""
    from ...rules.engine.findings import Finding

    if report is None or report.counts()["error"]:
        return report
    return report.evolve(findings=(Finding(
        "nonfinite-loss",
        "error",
        where,
        f"The loss is {loss} at {where}; the probe of its batch found every module's outputs and gradients "
        "finite, so the NaN/Inf comes from the loss computation itself (a log or division of 0, labels out "
        "of range, a reduction over an empty batch). The next optimizer step would write NaN into the weights.",
        {"loss": str(loss)},
    ), *report.findings))  # fmt: skip


def _hookable(optimizer: Any) -> Any:
    """The optimizer whose step hooks fire: ``optimizer`` itself, or the one a wrapper steps.

    accelerate's ``AcceleratedOptimizer`` subclasses ``torch.optim.Optimizer`` without its hook tables; its
    ``step()`` steps ``.optimizer``. The wrappers are the integrations' own unwrap rules (as for discovery).
    None when what is left is not a real optimizer.
    """
    if optimizer is None:
        return None
    from ...objects.discovery.subjects import unwrap_optimizer

    inner, _ = unwrap_optimizer(optimizer, "optimizer")
    return inner if isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "_optimizer_step_pre_hooks") else None


def _user_names(**objects: Any) -> dict[str, str]:
    """Per role (``model``, ``optimizer``, ``scaler``): the variable the caller's frame holds that object by, else
    the role itself (an object built inline has no name)."""
    from ..runtime.protocol import name_in_user_frames

    return {role: (name_in_user_frames(obj) if obj is not None else None) or role for role, obj in objects.items()}


class NonFiniteLoss(RuntimeError):
    """Raised by :class:`watch` with ``stop_on_nonfinite=True``; ``.report`` is the probe of the batch."""

    #: Raised on purpose from inside a watched call (``scaler.update()``): the wrappers let it through.
    stops_the_run = True

    def __init__(self, message: str, report: Any) -> None:
        super().__init__(message)
        self.report = report


class watch:  # noqa: N801 - used like a function: mpdoctor.watch(model, optimizer)
    """Watch a hand-written training loop for mixed-precision faults.

    - before the first ``optimizer.step()``: diagnoses the model, optimizer and
      scaler and shows the report when it has errors or warnings;
    - at every ``optimizer.step()``: on the first non-finite loss of the step
      (a loss the model returns, or one passed to :meth:`observe`), probes that
      batch before the step writes NaN into the weights and names the layer;
    - used as a context manager, explains a known mixed-precision exception
      raised in the block (the exception still propagates);
    - :meth:`close` (or leaving the block) removes every hook it added.

    Parameters
    ----------
    model : torch.nn.Module
    optimizer : torch.optim.Optimizer, optional
    scaler : torch.amp.GradScaler, optional
    probe : bool
        Probe the batch of the first non-finite loss.
    stop_on_nonfinite : bool
        Raise :class:`NonFiniteLoss` from that ``optimizer.step()`` after the
        probe, so the weights keep their last finite values.
    scan, ignore, target
        As for :func:`mpdoctor.diagnose`.
    verbose : bool
        Show the first diagnosis even when it finds nothing.

    Attributes
    ----------
    start_report, probe_report, crash_report : Report or None
        The diagnosis before the first step, the probe of the first non-finite
        loss, the explanation of an exception raised in the block.
    events : list of dict

    Examples
    --------
    >>> with mpdoctor.watch(model, optimizer, scaler) as w:
    ...     for x, y in loader:
    ...         loss = criterion(model(x), y)
    ...         w.observe(loss)          # not needed when the model returns .loss
    ...         loss.backward(); optimizer.step(); optimizer.zero_grad()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any = None,
        scaler: Any = None,
        *,
        probe: bool = True,
        stop_on_nonfinite: bool = False,
        scan: bool = False,
        ignore: tuple[str, ...] | list[str] = (),
        target: str | None = None,
        verbose: bool = False,
    ) -> None:
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        #: The names the calling notebook or script holds the objects by (``net``, ``opt``, ...), for findings and fix code.
        self.object_names = _user_names(model=model, optimizer=optimizer, scaler=scaler)
        self.probe, self.stop_on_nonfinite, self.verbose = probe, stop_on_nonfinite, verbose
        self.scan, self.ignore, self.target = scan, tuple(ignore), target
        self.start_report: Any = None
        self.probe_report: Any = None
        self.crash_report: Any = None
        self.events: list[dict] = []
        self._steps = 0
        self._fired = False
        self._watcher = LossWatcher()
        self._handles: list[Any] = []
        #: The latest training forward's ``(args, kwargs, autocast dtype or None)``: the batch a fix is checked on.
        self._held: tuple[tuple, dict, Any] | None = None
        self._proving = False  # the proof runs the step: its forwards and optimizer steps are not the loop's
        self._backwards = 0  # backward() calls since the last optimizer step: the loop's accumulation
        if isinstance(model, torch.nn.Module):
            self._device = next(model.parameters(), torch.empty(0)).device.type  # where the loop's autocast is read
            self._watcher.attach(model)
            self._handles.append(model.register_forward_pre_hook(self._hold, with_kwargs=True))
            counted = next((p for p in model.parameters() if p.requires_grad), None)
            if counted is not None:  # one trainable parameter's grad arrives once per backward() through the model
                self._handles.append(counted.register_post_accumulate_grad_hook(self._count_backward))
        inner = _hookable(optimizer)
        if inner is not None:
            self._handles.append(inner.register_step_pre_hook(self._before_step))
        else:
            self._diagnose()
        # The GradScaler protocol (mpdoctor.attach.runtime.protocol): every scaler and optimizer, until close().
        from ..runtime.protocol import ProtocolObserver

        self.protocol = ProtocolObserver(self._names(), models=[model], step_listener=self._after_update).attach()

    @property
    def report(self) -> Any:
        """The run's report: the diagnosis before the first step, the protocol findings, ``scale_history``."""
        from ..runtime.protocol import protocol_report

        return protocol_report(self.protocol, self.start_report)

    @property
    def scale_history(self) -> list:
        """Per GradScaler and real step: the scale, whether the step was skipped, the loss."""
        return list(self.protocol.scale_history)

    def _names(self) -> dict[int, str]:
        own = self.object_names
        names = {id(self.model): own["model"], id(self.optimizer): own["optimizer"], id(self.scaler): own["scaler"]}
        inner = _hookable(self.optimizer)
        if inner is not None and inner is not self.optimizer:
            names[id(inner)] = own["optimizer"]  # the wrapped optimizer the hooks and the scaler see
        return names

    def _objects(self) -> list[Any]:
        return [o for o in (self.model, self.optimizer, self.scaler) if o is not None]

    def _diagnose(self) -> None:
        from ...diagnosis import diagnose

        self.start_report = diagnose(*self._objects(), names=self._names(), target=self.target, scan=self.scan,
                                     ignore=self.ignore)  # fmt: skip
        if not self.start_report.ok:
            self.start_report = self._proven(self.start_report)
        if self.verbose or not self.start_report.ok:
            show(self.start_report, "before the first optimizer step")

    def _hold(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Keep the inputs of a training forward (references, no copy), as they enter: a forward that raises is
        held too."""
        if not self._proving and module.training and torch.is_grad_enabled():
            device = self._device
            self._held = (args, kwargs, torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None)

    def held_step(self) -> Any:
        """The loop's step on the batch held last (:class:`~mpdoctor.diagnosis.proof.HeldStep`): forward under the
        loop's autocast, the loss (the model's ``.loss``, else the mean of its output), backward through the scaler
        if any, the optimizer step. None before any training forward."""
        if self._held is None or not isinstance(self.model, torch.nn.Module):
            return None
        from ...diagnosis.proof import HeldStep
        from ..numerics.harness import call_model, loss_of
        from ..numerics.probe_facts import ForwardCall

        args, kwargs, autocast = self._held
        model, optimizer, scaler = self.model, self.optimizer, self.scaler
        batch = ForwardCall.of(args, kwargs)
        device = self._device

        def run() -> Any:
            if optimizer is not None:
                optimizer.zero_grad()
            with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
                loss = loss_of(call_model(model, batch), None)
            if scaler is not None and optimizer is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if optimizer is not None:
                    optimizer.step()
            return loss

        return HeldStep(run, "the watched batch: forward, loss, backward, optimizer step", modules=(model,),
                        optimizers=(_hookable(optimizer),), scalers=(scaler,), around=self._aside,
                        stand_in="mpdoctor's own step on the watched batch (forward, the model's .loss or the mean of "
                                 "its output, backward, optimizer step)")  # fmt: skip

    def _loop_body(self, tb: TracebackType | None) -> Any:
        """The loop body that raised, as a held step with this watch's objects and its observers aside; None when
        its source cannot be read back."""
        import dataclasses

        from ...diagnosis.replay import loop_step

        held = loop_step(tb)
        if held is None:
            return None
        silenced = held.around

        @contextlib.contextmanager
        def around() -> Iterator[None]:
            with self._aside(), silenced():
                yield

        return dataclasses.replace(held, modules=(self.model,), optimizers=(_hookable(self.optimizer),),
                                   scalers=(self.scaler,), around=around)  # fmt: skip

    @contextlib.contextmanager
    def _aside(self) -> Iterator[None]:
        """While the proof runs the step: this watch's hooks and every protocol observer look away."""
        from ..runtime.session import observers_aside

        self._proving, self._watcher.probing = True, True
        try:
            with observers_aside():
                yield
        finally:
            self._proving, self._watcher.probing = False, False

    def _proven(self, report: Any, tb: TracebackType | None = None) -> Any:
        """``report`` with its plan checked on the user's own loop body that raised (``tb``: the watched block's
        traceback), else on mpdoctor's stand-in step on the held batch; as it was when neither can run."""
        from ..runtime.assembly import assemble

        if report is None:
            return None
        held = self._loop_body(tb) or self.held_step()
        return assemble(report, step=held)

    def _count_backward(self, param: torch.Tensor) -> None:
        if not self._proving:
            self._backwards += 1

    def _record_accumulation(self, optimizer: Any) -> None:
        """The backward() calls since the last step, recorded as the loop's accumulation setting of ``optimizer``."""
        n, self._backwards = self._backwards, 0
        if n == 0:  # a step with no backward through the model (a closure, another model's loss) says nothing
            return
        from ...objects.readers.loop_accumulation import record
        from ..runtime.protocol import user_line

        where = user_line(2)
        name = self.object_names["optimizer"]
        at = f"{where}" if where is not None else f"optimizer step {self._steps}"
        record(optimizer, n, f"{name}.step() every {n} backward() calls ({at}, watched)", counted=True)

    def _before_step(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        if self._proving:
            return
        self._steps += 1
        self._record_accumulation(optimizer)
        if self.start_report is None:
            self._diagnose()
        self._check_loss(f"optimizer step {self._steps}")

    def _after_update(self, record: Any) -> None:
        """A real step of a GradScaler: a skipped one never reaches the optimizer's hooks, so its loss is looked
        at here (an all-inf run is told at its first step, not never); the first skip is kept in ``events``."""
        if not record.skipped:
            return
        self._backwards = 0  # a skipped step never reaches the optimizer's hook: its backward() is not accumulation
        if self.start_report is None:
            self._diagnose()
        first_skip = not any(e["event"] == "skipped-step" for e in self.events)
        if isinstance(record.loss, float) and not math.isfinite(record.loss):
            # The loss the scaler scaled (computed outside the model, never passed to observe()).
            self._watcher.observe(torch.tensor(record.loss))
        try:
            self._check_loss(f"{record.scaler}'s step {record.step} (skipped)")
        finally:
            if first_skip:
                self.events.append({"step": record.step, "event": "skipped-step",
                                    "detail": f"{record.scaler} skipped its step {record.step} at scale {record.scale:g}"})

    def _check_loss(self, where: str) -> None:
        """At a real step: probe the batch of the first non-finite loss seen since the last step, once."""
        found = self._watcher.take_nonfinite()
        if found is None or self._fired:
            return
        self._fired = True
        value, inputs = found
        detail = f"loss = {value}"
        self.events.append({"step": self._steps, "event": "nonfinite-loss", "detail": detail})
        if self.probe and inputs is not None and isinstance(self.model, torch.nn.Module):
            try:
                self.probe_report = count_nonfinite_loss(
                    probe_inputs(self._watcher, self.model, inputs, scaler=self.scaler), value, where
                )
                show(self.probe_report, f"at {where} ({detail})")
            except Exception as exc:  # mpdoctor must never be what breaks the loop
                print(f"mpdoctor: the probe at {where} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        else:
            print(f"mpdoctor: {detail} at {where} (no batch captured to probe)", file=sys.stderr)
        if self.stop_on_nonfinite:
            text = self.probe_report.to_text() if self.probe_report is not None else detail
            raise NonFiniteLoss(f"mpdoctor stopped before {where}: {detail}.\n{text}", self.probe_report)

    def observe(self, loss: torch.Tensor) -> torch.Tensor:
        """Record a loss computed outside the model; returns it, so ``loss = w.observe(criterion(...))`` reads well."""
        self._watcher.observe(loss)
        return loss

    def explain(self, exc: BaseException, tb: TracebackType | None = None) -> Any:
        """Explain a known mixed-precision exception with the watched objects and the frames' objects; show it."""
        from ..crash.cause import explain

        report = explain(exc, tb, *self._objects(), names=self._names(), target=self.target, ignore=self.ignore)
        report = self._proven(report, tb)
        if report is not None:
            self.crash_report = report
            show(report, "at the crash")
        return report

    def close(self) -> None:
        """Remove every hook this watch added."""
        self.protocol.close()
        self._watcher.close()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> watch:
        return self

    def __exit__(self, etype: type | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        from ..runtime.dispatch import hide_own_frames

        hide_own_frames(exc)  # the traceback Python prints shows the user's code and the library's, not the wrappers
        tb = exc.__traceback__ if exc is not None else tb
        try:
            if isinstance(exc, Exception) and not isinstance(exc, NonFiniteLoss):
                try:
                    self.explain(exc, tb)
                except Exception as failure:  # the user's exception propagates whatever happens here
                    print(f"mpdoctor: could not diagnose this exception ({type(failure).__name__})", file=sys.stderr)
        finally:
            self.close()
        return False


class GlobalLossWatcher:
    """Every top-level module forward in the process (``mpdoctor run --probe-on-nan``).

    A global forward hook sees each outermost module call; when its output
    carries a non-finite loss (one transfer per outermost forward), the
    batch is probed once and the report printed to stderr.
    """

    def __init__(self) -> None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self.report: Any = None
        self._depth = 0
        self._fired = False
        self._model_call: tuple[torch.nn.Module, tuple, dict] | None = None
        self._watcher = LossWatcher()
        self._handles = [
            register_module_forward_pre_hook(self._enter),
            register_module_forward_hook(self._leave, with_kwargs=True, always_call=True),
        ]

    def _enter(self, module: torch.nn.Module, args: tuple) -> None:
        self._depth += 1

    def _leave(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth or self._fired or not self._watcher._watching(module):
            return
        loss = loss_of(output)
        is_criterion = type(module).__module__ == "torch.nn.modules.loss"
        if not is_criterion:
            self._model_call = (module, args, kwargs)
        if loss is None or bool(torch.isfinite(loss.detach()).all()):
            return
        # A criterion module's loss belongs to the model called before it: probe that call.
        target = self._model_call if is_criterion else (module, args, kwargs)
        if target is None:
            return
        self._fired = True
        try:
            model, margs, mkwargs = target
            value = loss.detach().float().item()
            report = probe_inputs(self._watcher, model, (margs, mkwargs), name=type(model).__name__)
            self.report = count_nonfinite_loss(report, value, "the first non-finite loss")
            show(self.report, f"at the first non-finite loss ({loss.detach().float().item()})")
        except Exception as exc:  # never what breaks the script
            print(f"mpdoctor: the probe failed: {type(exc).__name__}: {exc}", file=sys.stderr)

    def close(self) -> None:
        """Remove the global hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._watcher.close()
        self._model_call = None
