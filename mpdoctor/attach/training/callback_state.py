"""What the transformers and Lightning callbacks share: their settings, their reports and the loss watcher.

Neither library is imported here, so each callback module imports only its own library.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from ..runtime.losses import LossWatcher


class MPDoctorAbort(RuntimeError):
    """Raised by the callbacks to stop training; ``.report`` holds the diagnosis."""

    def __init__(self, message: str, report: Any) -> None:
        super().__init__(message)
        self.report = report


def ipython_shell() -> Any:
    """The running IPython shell, if the user's process has one (never imports IPython)."""
    mod = sys.modules.get("IPython")
    if mod is None:
        return None
    try:
        return mod.get_ipython()
    except Exception:
        return None


class CallbackState:
    """Settings, reports and events of a training callback, and the :class:`LossWatcher` it shares with ``watch``.

    Its constructor is both callbacks' (``MPDoctorCallback(...)``, ``MPDoctorLightningCallback(...)``): one
    list of settings, documented once here.

    Parameters
    ----------
    stop_on_error : bool
        Stop training before the first step when the start-of-training diagnosis has an error.
    stop_on_nonfinite : bool
        Stop training at the first non-finite loss (after probing the batch).
    probe : bool
        Probe the batch where the loss first goes non-finite.
    scan : bool
        Also scan values in the start-of-training diagnosis.
    ignore : sequence of str
        Check slugs to skip.
    verbose : bool
        Log every diagnosis, not only those with findings.
    timeout : float
        Seconds a cross-rank diagnosis waits for every rank.
    """

    def __init__(
        self,
        stop_on_error: bool = False,
        stop_on_nonfinite: bool = False,
        probe: bool = True,
        scan: bool = False,
        ignore: tuple[str, ...] | list[str] = (),
        verbose: bool = False,
        timeout: float = 60.0,
    ) -> None:
        self.timeout = timeout
        self.stop_on_error = stop_on_error
        self.stop_on_nonfinite = stop_on_nonfinite
        self.probe = probe
        self.scan = scan
        self.ignore = tuple(ignore)
        self.verbose = verbose
        self.start_report: Any = None
        self.probe_report: Any = None
        self.events: list[dict] = []
        # The hooks, the capture of inputs and losses and the probe are shared with mpdoctor.watch.
        self._watcher = LossWatcher()
        self._fired = False
        #: The GradScaler protocol observer while training runs (mpdoctor.attach.runtime.protocol).
        self.protocol: Any = None

    def _attach_protocol(self, names: dict[int, str], models: list) -> None:
        """Follow the GradScaler protocol (and keep the scale history) until :meth:`_close_protocol`."""
        from ..runtime.protocol import ProtocolObserver

        self._close_protocol()
        self.protocol = ProtocolObserver(names, models=models).attach()

    def _close_protocol(self) -> None:
        if self.protocol is not None and self.protocol.attached:
            self.protocol.close()

    @property
    def scale_history(self) -> list:
        """Per GradScaler and real step: the scale, whether the step was skipped, the loss."""
        return list(self.protocol.scale_history) if self.protocol is not None else []

    @property
    def report(self) -> Any:
        """The run's report: the start diagnosis, the protocol findings and ``scale_history``."""
        from ..runtime.protocol import ProtocolObserver, protocol_report

        return protocol_report(self.protocol or ProtocolObserver(), self.start_report)


def show_report(report: Any, when: str, rank_zero: bool) -> None:
    """Show a callback's report: in a notebook as the report itself, in a script through the ``mpdoctor`` logger at
    the level of its worst finding; on another rank than 0 only a line that a failing batch was probed there."""
    logger = logging.getLogger("mpdoctor")
    if not rank_zero:
        if when.startswith("at step"):  # a probe on another rank: say so, the report renders on rank 0 only
            logger.warning("mpdoctor: non-zero rank probed a failing batch %s (see its probe_report)", when)
        return
    shell = ipython_shell()
    if shell is not None:
        from IPython.display import display

        print(f"mpdoctor {when}:")
        display(report)
        return
    counts = report.counts()
    level = logging.ERROR if counts["error"] else logging.WARNING if counts["warning"] else logging.INFO
    logger.log(level, "mpdoctor %s:\n%s", when, report.to_text())
