"""Precision facts: what the arguments ask for, what the environment says, what runs.

A precision setup is a Trainer (its arguments and accelerator), or a lone
``TrainingArguments``, or a lone ``Accelerator``. The process-wide state
(autocast, TF32 flags, allowlisted environment variables) is read once.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch

from ..discover import Subject
from ..redact import allowed_env
from .hardware import DeviceProfile


@dataclass(frozen=True)
class PrecisionFacts:
    """Requested and effective precision of one training setup.

    Attributes
    ----------
    name : str
        The trainer, arguments or accelerator the setup is known by.
    args_name, accelerator_name, scaler_name : str or None
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
    scaler_name: str | None
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
class RuntimeFacts:
    """Process-wide precision state."""

    autocast: dict  # device type -> dtype name, for devices where autocast is on now
    matmul_tf32: bool
    cudnn_tf32: bool
    float32_matmul_precision: str
    env: dict
    versions: dict


def _requested(args: dict) -> str | None:
    if not args:
        return None
    if args.get("fp16"):
        return "fp16"
    if args.get("bf16"):
        return "bf16"
    return "no"


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


def gather_precision(
    name: str,
    args_subject: Subject | None,
    acc_subject: Subject | None,
    hw: DeviceProfile,
    model_names: tuple[str, ...] = (),
    model_refs: tuple[int, ...] = (),
) -> PrecisionFacts:
    """Read one setup's requested and effective precision."""
    from .. import integrations
    from ..introspect import mro_paths

    args = integrations.requested_of(args_subject.obj, mro_paths(args_subject.obj)) if args_subject is not None else {}
    acc = acc_subject.obj if acc_subject is not None else None
    view = integrations.effective_of(acc, mro_paths(acc)) if acc is not None else None
    mp, native, scaler_enabled, device = view if view is not None else (None, None, None, None)
    facts = PrecisionFacts(
        name=name,
        args_name=args_subject.name if args_subject else None,
        accelerator_name=acc_subject.name if acc_subject else None,
        scaler_name=f"{acc_subject.name}.scaler" if acc_subject is not None and scaler_enabled else None,
        args=args,
        requested=_requested(args),
        env_mixed_precision=os.environ.get("ACCELERATE_MIXED_PRECISION"),
        accelerator_mixed_precision=mp,
        native_amp=native,
        scaler_enabled=scaler_enabled if acc is not None else None,
        device=device,
        model_names=model_names,
        args_ref=id(args_subject.obj) if args_subject is not None else 0,
        accelerator_ref=id(acc) if acc is not None else 0,
        model_refs=model_refs,
    )
    return dataclasses.replace(facts, computes_in=computes_in(facts, hw))


def _versions() -> dict:
    import sys

    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    for lib in ("transformers", "accelerate", "peft", "ipywidgets", "IPython"):
        mod = sys.modules.get(lib)
        if mod is not None:
            out[lib] = str(getattr(mod, "__version__", "?"))
        else:
            installed = _installed_version(lib)
            if installed is not None:
                out[lib] = f"{installed} (installed, not imported)"
    return out


@functools.cache
def _installed_version(dist: str) -> str | None:
    # Package metadata, never an import: mpdoctor must not pull transformers into a kernel.
    import importlib.metadata

    try:
        return importlib.metadata.version(dist.lower() if dist == "IPython" else dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def gather_runtime() -> RuntimeFacts:
    """Read autocast state, TF32 flags, allowlisted environment variables and library versions."""
    autocast = {}
    for dev in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(dev):
                autocast[dev] = str(torch.get_autocast_dtype(dev)).replace("torch.", "")
        except Exception:
            pass
    return RuntimeFacts(
        autocast=autocast,
        matmul_tf32=bool(torch.backends.cuda.matmul.allow_tf32),
        cudnn_tf32=bool(torch.backends.cudnn.allow_tf32),
        float32_matmul_precision=_matmul_precision(),
        env=allowed_env(),
        versions=_versions(),
    )


def _matmul_precision() -> str:
    # torch >= 2.9 raises here once a notebook mixed set_float32_matmul_precision() with the
    # legacy allow_tf32 flag; the CUDA backend's own setting still says what matmuls do.
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        try:
            per_backend = torch.backends.cuda.matmul.fp32_precision
        except Exception:
            return "unknown"
        return {"ieee": "highest", "tf32": "high", "bf16": "medium"}.get(str(per_backend), str(per_backend))
