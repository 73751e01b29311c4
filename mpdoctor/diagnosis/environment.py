"""``env_report()``: versions, device, precision support and allowlisted environment variables."""

from __future__ import annotations

import platform
from typing import Any

import torch

from ..objects.gathering.precision import gather_torch_state
from ..objects.readers.hardware import live_profile


class EnvReport(dict):
    """A dict of environment facts that prints as aligned text."""

    def __str__(self) -> str:
        width = max(len(k) for k in self) if self else 0
        lines = []
        for key, value in self.items():
            if isinstance(value, dict):
                value = ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
            lines.append(f"{key:<{width}}  {value}")
        return "\n".join(lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def env_report() -> EnvReport:
    """Describe this machine for mixed precision (never prints the whole environment or a token)."""
    import importlib.metadata as md

    hw = live_profile()
    rt = gather_torch_state()
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("transformers", "accelerate", "peft", "ipywidgets", "ipython", "mpdoctor"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = "not installed"
    return EnvReport(
        {
            "versions": versions,
            "platform": platform.platform(),
            "device": hw.label,
            "cuda available": torch.cuda.is_available(),
            "compute capability": ".".join(map(str, hw.capability)) if hw.capability else "-",
            "bf16 native": hw.bf16_native,
            "fp16 tensor cores": hw.fp16_tensor_cores,
            "tf32 available": hw.tf32,
            "tf32 matmul enabled": rt.matmul_tf32,
            "tf32 cudnn enabled": rt.cudnn_tf32,
            "float32 matmul precision": rt.float32_matmul_precision,
            "GradScaler unscale kernel dtypes": ", ".join(hw.unscale_dtypes or ()) or "-",
            "autocast default dtype": {
                "cpu": str(torch.get_autocast_dtype("cpu")).replace("torch.", ""),
                "cuda": str(torch.get_autocast_dtype("cuda")).replace("torch.", ""),
            },
            "autocast enabled now": rt.autocast or "off",
            "environment": rt.env or "no precision-related variables set",
        }
    )
