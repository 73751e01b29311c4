"""Gathering precision setups (asking each integration what arguments and accelerators request and run) and the process-wide runtime facts."""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from ...facts.hardware import DeviceProfile
from ...facts.precision import PrecisionFacts, TorchStateFacts, computes_in
from ...redact import allowed_env
from ..discovery.subjects import Subject


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
    from ..live.introspect import mro_paths

    args = integrations.requested_of(args_subject.obj, mro_paths(args_subject.obj)) if args_subject is not None else {}
    acc = acc_subject.obj if acc_subject is not None else None
    view = integrations.effective_of(acc, mro_paths(acc)) if acc is not None else None
    mp, native, scaler_enabled, device = view if view is not None else (None, None, None, None)
    facts = PrecisionFacts(
        name=name,
        args_name=args_subject.name if args_subject else None,
        accelerator_name=acc_subject.name if acc_subject else None,
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
    # torchao / transformer_engine / msamp: the fp8 backends accelerate needs before it accepts mixed_precision="fp8".
    for lib in ("transformers", "accelerate", "peft", "ipywidgets", "IPython", "torchao", "transformer_engine", "msamp"):
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


def gather_torch_state() -> TorchStateFacts:
    """Read autocast state, TF32 flags, allowlisted environment variables and library versions."""
    autocast = {}
    for dev in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(dev):
                autocast[dev] = str(torch.get_autocast_dtype(dev)).replace("torch.", "")
        except Exception:
            pass
    return TorchStateFacts(
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


def _requested(args: dict) -> str | None:
    if not args:
        return None
    if args.get("fp16"):
        return "fp16"
    if args.get("bf16"):
        return "bf16"
    return "no"
