"""Precision facts: what the arguments ask for, what the environment says, what runs.

A precision setup is a Trainer (its arguments and accelerator), or a lone
``TrainingArguments``, or a lone ``Accelerator``. The process-wide state
(autocast, TF32 flags, allowlisted environment variables) is read once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .hardware import DeviceProfile


@dataclass(frozen=True)
class PrecisionFacts:
    """Requested and effective precision of one training setup.

    Attributes
    ----------
    name : str
        The trainer, arguments or accelerator the setup is known by.
    args_name, accelerator_name : str or None
        Paths of the parts, for messages and fix code.
    args : dict
        The precision-related TrainingArguments fields (``fp16``, ``bf16``, ...).
    requested : str or None
        ``"fp16"``, ``"bf16"`` or ``"no"`` as the explicit ``fp16`` / ``bf16`` flags say.
    env_mixed_precision : str or None
        ``ACCELERATE_MIXED_PRECISION`` as it is now.
    accelerator_mixed_precision : str or None
        What the accelerator will autocast to (``accelerator.mixed_precision``).
    native_amp : bool or None
        Whether the accelerator really autocasts (False: the run is fp32 whatever it says).
    scaler_enabled : bool or None
        Whether the accelerator holds an enabled GradScaler.
    forward_wrapped : tuple of str
        Models whose ``forward`` accelerate wrapped with autocast and fp32 output conversion.
    device : str or None
        The accelerator's device type.
    """

    name: str
    args_name: str | None
    accelerator_name: str | None
    args: dict
    requested: str | None
    env_mixed_precision: str | None
    accelerator_mixed_precision: str | None
    native_amp: bool | None
    scaler_enabled: bool | None
    device: str | None
    model_names: tuple[str, ...] = ()
    #: The precision the next training step computes in, on the live device or the ``target=`` profile:
    #: computed once while gathering (:func:`computes_in`) and read by every check and renderer.
    computes_in: str = "no"
    args_ref: int = 0
    accelerator_ref: int = 0
    model_refs: tuple[int, ...] = ()

    @property
    def effective(self) -> str:
        """The precision the next training step will actually compute in (``"no"`` is fp32)."""
        return self.computes_in

    @property
    def declared(self) -> str | None:
        """The mode the setup says it runs in: the accelerator's, else ``args.mixed_precision``."""
        return declared_precision(self)


@dataclass(frozen=True)
class TorchStateFacts:
    """torch's process-wide precision state: autocast on now, TF32, the precision environment, versions.

    ``Facts.runtime`` holds it. Named for what it holds: the ``runtime`` package is the run as patient.
    """

    autocast: dict  # device type -> dtype name, for devices where autocast is on now
    matmul_tf32: bool
    cudnn_tf32: bool
    float32_matmul_precision: str
    env: dict
    versions: dict


_MODES = ("no", "fp16", "bf16", "fp8")


def declared_precision(p: PrecisionFacts) -> str | None:
    """The mode the setup says it runs in: the accelerator's, else ``args.mixed_precision``."""
    if p.accelerator_mixed_precision in _MODES:
        return p.accelerator_mixed_precision
    mp = p.args.get("mixed_precision")
    return mp if mp in _MODES else None


def setup_device(p: PrecisionFacts, hw: DeviceProfile) -> str:
    """The device type the setup trains on: the what-if target's, else the accelerator's (``use_cpu`` wins)."""
    if not hw.live:
        return hw.kind
    if p.args.get("use_cpu"):
        return "cpu"
    return p.device or hw.kind


def native_amp_for(precision: str, device: str) -> bool:
    """accelerate's rule (``Accelerator.__init__``): fp16 autocasts everywhere but on the CPU; bf16 everywhere."""
    if precision == "fp16":
        return device != "cpu"
    return precision in ("bf16", "fp8")


def computes_in(p: PrecisionFacts, hw: DeviceProfile) -> str:
    """The precision the next training step of setup ``p`` computes in on ``hw`` (the one precision model).

    On the live machine, an accelerator's own ``native_amp`` decides; for a
    ``target=`` what-if, accelerate's rule is applied to the target's device.
    """
    declared = declared_precision(p)
    if declared is None:
        return p.requested if p.requested in ("fp16", "bf16") and native_amp_for(p.requested, setup_device(p, hw)) else "no"
    if declared == "no":
        return "no"
    if hw.live and p.accelerator_name is not None and p.native_amp is not None:
        return declared if p.native_amp else "no"
    return declared if native_amp_for(declared, setup_device(p, hw)) else "no"


def __getattr__(name: str) -> Any:
    # 0.3.0 named TorchStateFacts RuntimeFacts; facts built by hand may still say so (removed in 0.4).
    if name == "RuntimeFacts":
        import warnings

        warnings.warn("RuntimeFacts is now TorchStateFacts; the old name goes away in 0.4", DeprecationWarning, stacklevel=2)
        return TorchStateFacts
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
