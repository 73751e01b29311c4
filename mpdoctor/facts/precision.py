"""Precision facts: what the arguments ask for, what the environment says, what runs.

A precision setup is a Trainer (its arguments and accelerator), or a lone
``TrainingArguments``, or a lone ``Accelerator``. The process-wide state
(autocast, TF32 flags, allowlisted environment variables) is read once.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..discover import Subject
from ..redact import allowed_env, safe_value
from .configs import raw_attr

_ARG_KEYS = (
    "fp16",
    "bf16",
    "fp16_full_eval",
    "bf16_full_eval",
    "tf32",
    "half_precision_backend",
    "use_cpu",
    "mixed_precision",
    "optim",
    "gradient_checkpointing",
    "deepspeed",
)


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
    subject: Any = field(default=None, compare=False, repr=False)

    @property
    def effective(self) -> str:
        """The precision the next training step will actually compute in."""
        if self.accelerator_mixed_precision is not None:
            if self.accelerator_mixed_precision in ("fp16", "bf16") and self.native_amp is False:
                return "no"
            return self.accelerator_mixed_precision
        if self.args.get("mixed_precision") in ("fp16", "bf16", "no"):
            return self.args["mixed_precision"]
        return self.requested or "no"


@dataclass(frozen=True)
class RuntimeFacts:
    """Process-wide precision state."""

    autocast: dict  # device type -> dtype name, for devices where autocast is on now
    matmul_tf32: bool
    cudnn_tf32: bool
    float32_matmul_precision: str
    env: dict
    versions: dict


def _args_dict(args: Any) -> dict:
    out = {}
    for key in _ARG_KEYS:
        value = raw_attr(args, key, None)
        if value is not None:
            out[key] = safe_value(value)
    return out


def _requested(args: dict) -> str | None:
    if not args:
        return None
    if args.get("fp16"):
        return "fp16"
    if args.get("bf16"):
        return "bf16"
    return "no"


def _accelerator_view(acc: Any) -> tuple[str | None, bool | None, bool | None, str | None]:
    if acc is None:
        return None, None, None, None
    state = raw_attr(acc, "state", None)
    mp = raw_attr(state, "_mixed_precision", None) if state is not None else None
    if mp is None and state is not None:
        shared = raw_attr(state, "_shared_state", None)
        if isinstance(shared, dict):
            mp = shared.get("_mixed_precision")
    native = raw_attr(acc, "native_amp", None)
    scaler = raw_attr(acc, "scaler", None)
    scaler_enabled = bool(raw_attr(scaler, "_enabled", False)) if scaler is not None else False
    device = raw_attr(acc, "device", None)
    if device is None and state is not None:
        device = raw_attr(state, "device", None)
    dev_type = getattr(device, "type", None) if isinstance(device, torch.device) else None
    return (str(mp) if mp is not None else None), (bool(native) if native is not None else None), scaler_enabled, dev_type


def gather_precision(
    name: str,
    args_subject: Subject | None,
    acc_subject: Subject | None,
    model_names: tuple[str, ...] = (),
    owner: Subject | None = None,
) -> PrecisionFacts:
    """Read one setup's requested and effective precision."""
    args = _args_dict(args_subject.obj) if args_subject is not None else {}
    acc = acc_subject.obj if acc_subject is not None else None
    mp, native, scaler_enabled, device = _accelerator_view(acc)
    return PrecisionFacts(
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
        subject=owner or args_subject or acc_subject,
    )


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
