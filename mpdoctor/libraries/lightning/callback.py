"""``MPDoctorLightningCallback``: mpdoctor inside a Lightning ``Trainer.fit()``.

- ``on_fit_start``: diagnoses the Trainer (its LightningModule, optimizers and precision plugin come
  along) and shows the report on global rank 0 when it has errors or warnings. With
  ``stop_on_error=True`` an error stops the run before the first step (:class:`MPDoctorAbort`).
- ``on_train_start``: the optimizers exist now; a forward hook on the LightningModule keeps a
  reference to the latest inputs (no copy, no sync), through :class:`mpdoctor.attach.runtime.losses.LossWatcher`,
  shared with ``mpdoctor.watch`` and the transformers callback.
- ``on_before_backward``: records the loss tensor Lightning is about to back-propagate.
- ``on_before_optimizer_step``: reads the recorded losses with one transfer; on the first non-finite loss
  it probes the module on the latest inputs *before* the optimizer writes NaN into the weights.
  With ``stop_on_nonfinite=True`` it then raises :class:`MPDoctorAbort`.
- ``on_fit_end``: removes its hooks.

In a process group of more than one rank the start diagnosis is the cross-rank one
(:func:`mpdoctor.diagnosis.ranks.diagnose_every_rank`, run on every rank, the same findings on each).
Reports render on global rank 0 only (``trainer.is_global_zero`` and ``is_rank_zero()``). This is the only mpdoctor module
importing Lightning; ``import mpdoctor`` never imports it (``mpdoctor.MPDoctorLightningCallback`` is lazy).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ...attach.numerics.probe import probe_inputs

try:  # the unified package first; the standalone ``pytorch_lightning`` where only it is installed
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - depends on the installed namespace
    from pytorch_lightning.callbacks import Callback

from ...attach.training.callback_state import CallbackState, MPDoctorAbort, show_report

logger = logging.getLogger("mpdoctor")

__all__ = ["MPDoctorAbort", "MPDoctorLightningCallback"]


class MPDoctorLightningCallback(Callback, CallbackState):
    """Diagnose at the start of ``fit`` and probe the batch where the loss first goes non-finite.

    Parameters
    ----------
    stop_on_error : bool
        Raise :class:`MPDoctorAbort` from ``on_fit_start`` when the diagnosis has errors.
    stop_on_nonfinite : bool
        Raise :class:`MPDoctorAbort` after probing a non-finite loss, before the optimizer step.
    probe : bool
        Probe the failing batch (one extra forward + backward, everything restored).
    scan : bool
        Also scan tensor values in the start-of-fit diagnosis.
    ignore : iterable of str
        Check slugs to skip.
    verbose : bool
        Show the start report even when it finds nothing.
    timeout : float
        In a multi-rank job, seconds to wait for the other ranks' start diagnosis.

    Attributes
    ----------
    start_report, probe_report : Report or None
        The ``on_fit_start`` diagnosis; the probe of the first failing batch.
    events : list of dict
        What the callback noticed (``{"step", "event", "detail"}``).
    """

    # The constructor is CallbackState's, shared with the transformers callback.

    # -- events ------------------------------------------------------------------------

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Diagnose the Trainer; stop before the first step on errors when asked."""
        from ...diagnosis.ranks import diagnose_in_callback

        self.start_report = diagnose_in_callback(trainer, timeout=self.timeout, names={id(trainer): "trainer"},
                                                 scan=self.scan, ignore=self.ignore)  # fmt: skip
        if self.verbose or not self.start_report.ok:
            self._show(trainer, self.start_report, "at the start of fit")
        errors = self.start_report.counts()["error"]
        if self.stop_on_error and errors:
            raise MPDoctorAbort(
                f"mpdoctor stopped training before the first step: {errors} error(s).\n{self.start_report.to_text()}",
                self.start_report,
            )

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Start watching the module's inputs."""
        self._watcher.close()
        if isinstance(pl_module, torch.nn.Module):
            self._watcher.attach(pl_module)
        # Manual optimization leaves the AMP loop to the user's training_step: follow the scaler protocol.
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._attach_protocol({id(scaler): "trainer.precision_plugin.scaler"}, [pl_module])

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        """Record the loss about to be back-propagated (a reference, no sync)."""
        self._watcher.observe(loss)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """Check this step's losses before the optimizer writes them into the weights."""
        found = self._watcher.take_nonfinite()
        if found is None or self._fired:
            return
        value, inputs = found
        self._fire(trainer, pl_module, trainer.global_step + 1, f"loss = {value}", inputs)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """Remove the hooks."""
        self._watcher.close()
        self._close_protocol()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Remove the hooks when fit stops on an exception (ours included)."""
        self._watcher.close()
        self._close_protocol()

    # -- internals ---------------------------------------------------------------------

    def _fire(self, trainer: Any, pl_module: Any, step: int, detail: str, inputs: Any) -> None:
        self._fired = True
        self.events.append({"step": step, "event": "nonfinite-loss", "detail": detail})
        report = None
        if self.probe and inputs is not None and isinstance(pl_module, torch.nn.Module):
            try:
                scaler = getattr(trainer.precision_plugin, "scaler", None)
                report = probe_inputs(self._watcher, pl_module, inputs, name="trainer.lightning_module", scaler=scaler)
                self.probe_report = report
                self._show(trainer, report, f"at step {step} ({detail})")
            except Exception as exc:  # mpdoctor must never be what breaks the run
                logger.warning("mpdoctor: the probe at step %s failed: %s: %s", step, type(exc).__name__, exc)
        else:
            logger.warning("mpdoctor: %s at step %s (no batch captured to probe)", detail, step)
        if self.stop_on_nonfinite:
            self._watcher.close()
            text = report.to_text() if report is not None else detail
            raise MPDoctorAbort(f"mpdoctor stopped training at step {step} before the optimizer step: {detail}.\n{text}",
                                report)  # fmt: skip

    def _show(self, trainer: Any, report: Any, when: str) -> None:
        from ...diagnosis.ranks import is_rank_zero

        show_report(report, when, rank_zero=getattr(trainer, "is_global_zero", True) and is_rank_zero())
