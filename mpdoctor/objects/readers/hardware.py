"""Reading the device this kernel trains on into a device profile."""

from __future__ import annotations

import torch

from ...facts.hardware import DeviceProfile
from ...facts.tensors import dtype_name


def unscale_supported(device: str, dtype: torch.dtype) -> bool:
    """Probe whether GradScaler's unscale kernel runs for ``dtype`` on ``device``.

    Runs the real ``torch._amp_foreach_non_finite_check_and_unscale_`` on a
    one-element tensor of mpdoctor's own (never a user tensor); cached per
    device and dtype.
    """
    key = (device, dtype_name(dtype))
    if key not in _UNSCALE_CACHE:
        try:
            grad = torch.ones(1, dtype=dtype, device=device)
            found_inf = torch.zeros(1, dtype=torch.float32, device=device)
            inv_scale = torch.ones(1, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_([grad], found_inf, inv_scale)
            _UNSCALE_CACHE[key] = True
        except Exception:
            _UNSCALE_CACHE[key] = False
    return _UNSCALE_CACHE[key]


def live_profile() -> DeviceProfile:
    """Describe the device this kernel trains on (the current CUDA device, else the CPU)."""
    if torch.cuda.is_available():
        idx = torch.cuda.current_device()
        cap = torch.cuda.get_device_capability(idx)
        props = torch.cuda.get_device_properties(idx)
        device = "cuda"
        base = DeviceProfile(
            torch.cuda.get_device_name(idx),
            "cuda",
            (int(cap[0]), int(cap[1])),
            bool(torch.cuda.is_bf16_supported()) and cap[0] >= 8,
            cap[0] >= 7,
            cap[0] >= 8,
            True,
            None,
            round(props.total_memory / 2**30, 1),
        )
    else:
        device = "cpu"
        base = DeviceProfile("cpu", "cpu", None, True, False, False, True)
    dtypes = tuple(
        dtype_name(dt) for dt in (torch.float16, torch.bfloat16, torch.float32) if unscale_supported(device, dt)
    )
    return DeviceProfile(**{**base.__dict__, "unscale_dtypes": dtypes})


_UNSCALE_CACHE: dict[tuple[str, str], bool] = {}
