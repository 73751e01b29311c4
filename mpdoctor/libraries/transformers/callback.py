"""``MPDoctorCallback``: mpdoctor inside ``Trainer.train()``.

- ``on_train_begin``: diagnoses the model, optimizer and arguments; shows the
  report (IPython display in a notebook, ``logging`` elsewhere) when it has
  errors or warnings. With ``stop_on_error=True`` an error stops the run
  before the first step by raising :class:`MPDoctorAbort` (its message is the
  report); ``control.should_training_stop`` would only act after a step.
- every micro-batch: a forward hook on the model keeps a reference to the
  latest inputs and the loss tensor (no copy, no sync), through
  :class:`mpdoctor.attach.runtime.losses.LossWatcher`, shared with ``mpdoctor.watch``.
- ``on_pre_optimizer_step``: reads this step's losses with one transfer;
  on the first non-finite loss it probes that micro-batch *before* the
  optimizer step writes NaN into the weights, and shows where it went wrong.
  With ``stop_on_nonfinite=True`` it then raises :class:`MPDoctorAbort`, so the
  weights are left as they were before the bad step.
- ``on_step_end`` / ``on_log``: a GradScaler scale that collapsed (below 1 or
  2^16 times under its start) or a logged non-finite loss / grad norm probes
  the latest batch, once.
- ``on_train_end``: removes its hooks.

In a process group of more than one rank (DDP, FSDP, DeepSpeed under torchrun or accelerate),
the start-of-training diagnosis is the cross-rank one (:func:`mpdoctor.diagnosis.ranks.diagnose_every_rank`,
run on every rank, the same findings on each) and reports render on rank 0 only.

This is the only mpdoctor module importing transformers.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from transformers import TrainerCallback

from ...attach.numerics.probe import probe_inputs
from ...attach.training.callback_state import CallbackState, MPDoctorAbort, show_report

logger = logging.getLogger("mpdoctor")


class MPDoctorCallback(TrainerCallback, CallbackState):
    """Diagnose at the start of training and probe the batch where the loss first goes non-finite.

    Parameters
    ----------
    stop_on_error : bool
        Raise :class:`MPDoctorAbort` from ``on_train_begin`` when the diagnosis
        has errors, so the run stops before its first step.
    stop_on_nonfinite : bool
        Raise :class:`MPDoctorAbort` after probing a non-finite loss, before
        the optimizer step (the weights stay as they were).
    probe : bool
        Probe the failing batch (one extra forward + backward, everything restored).
    scan : bool
        Also scan tensor values in the start-of-training diagnosis.
    ignore : iterable of str
        Check slugs to skip.
    verbose : bool
        Show the start-of-training report even when it finds nothing (default:
        only with errors or warnings, so a healthy run stays silent).
    timeout : float
        In a multi-rank job, seconds to wait for the other ranks' start-of-training
        diagnosis (ranks that do not answer are named in the report).

    Attributes
    ----------
    start_report : Report or None
        The ``on_train_begin`` diagnosis.
    probe_report : Report or None
        The probe of the first failing batch.
    events : list of dict
        What the callback noticed (``{"step", "event", "detail"}``).
    """

    # The constructor is CallbackState's, shared with the Lightning callback.

    def _detach(self) -> None:
        self._watcher.close()
        self._close_protocol()

    # -- events ------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any):
        """Diagnose; stop before the first step on errors when asked; start watching the model."""
        from ...diagnosis.ranks import diagnose_in_callback

        objects = [o for o in (model, optimizer, args) if o is not None]
        names = {id(model): "model", id(optimizer): "optimizer", id(args): "args"}
        self.start_report = diagnose_in_callback(*objects, timeout=self.timeout, names=names, scan=self.scan,
                                                 ignore=self.ignore)  # fmt: skip
        if self.verbose or not self.start_report.ok:
            self._show(self.start_report, "at the start of training")
        errors = self.start_report.counts()["error"]
        if self.stop_on_error and errors:
            raise MPDoctorAbort(
                f"mpdoctor stopped training before the first step: {errors} error(s).\n{self.start_report.to_text()}",
                self.start_report,
            )
        self._detach()
        if isinstance(model, torch.nn.Module):
            self._watcher.attach(model)
        self._attach_protocol(names, [model])
        return control

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any):
        """Check this step's losses before the optimizer writes them into the weights."""
        self._check_losses(state.global_step + 1, model, optimizer)
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any):
        """Check the losses (if not checked yet) and the GradScaler's scale."""
        self._check_losses(state.global_step, model, optimizer)
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None and not self._fired:
            from ...objects.readers.scaler import read_scaler
            from ...rules.checks.scaler import COLLAPSE_FACTOR

            sc = read_scaler("optimizer.scaler", scaler)
            if sc.enabled and sc.scale is not None and (sc.scale < 1.0 or sc.scale < sc.init_scale * COLLAPSE_FACTOR):
                self._fire(state.global_step, "scale-collapsed", f"loss scale {sc.scale:g} (started at {sc.init_scale:g})",
                           self._watcher.latest, model, optimizer)  # fmt: skip
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, model: Any = None,
               optimizer: Any = None, **kwargs: Any):  # fmt: skip
        """A logged non-finite loss or grad norm (Trainer filters NaN losses by default; grad norms are not)."""
        for key in ("loss", "grad_norm"):
            value = (logs or {}).get(key)
            if isinstance(value, (int, float)) and not math.isfinite(value) and not self._fired:
                self._fire(state.global_step, f"nonfinite-{key}", f"logged {key} = {value}", self._watcher.latest, model,
                           optimizer)  # fmt: skip
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any):
        """Remove the hooks."""
        self._detach()
        return control

    # -- internals ---------------------------------------------------------------------
    def _check_losses(self, step_number: int, model: Any, optimizer: Any) -> None:
        found = self._watcher.take_nonfinite()
        if found is not None and not self._fired:
            value, inputs = found
            self._fire(step_number, "nonfinite-loss", f"loss = {value}", inputs, model, optimizer)

    def _fire(self, step: int, event: str, detail: str, inputs: Any, model: Any, optimizer: Any) -> None:
        self._fired = True
        self.events.append({"step": step, "event": event, "detail": detail})
        report = None
        if self.probe and inputs is not None and isinstance(model, torch.nn.Module):
            try:
                report = probe_inputs(self._watcher, model, inputs, name="model", scaler=getattr(optimizer, "scaler", None))
                self.probe_report = report
                self._show(report, f"at step {step} ({detail})")
            except Exception as exc:  # mpdoctor must never be what breaks the run
                logger.warning("mpdoctor: the probe at step %s failed: %s: %s", step, type(exc).__name__, exc)
        else:
            logger.warning("mpdoctor: %s at step %s (no batch captured to probe)", detail, step)
        if self.stop_on_nonfinite and event == "nonfinite-loss":
            self._detach()
            text = report.to_text() if report is not None else detail
            raise MPDoctorAbort(f"mpdoctor stopped training at step {step} before the optimizer step: {detail}.\n{text}",
                                report)  # fmt: skip

    def _show(self, report: Any, when: str) -> None:
        from ...diagnosis.ranks import is_rank_zero

        show_report(report, when, rank_zero=is_rank_zero())
