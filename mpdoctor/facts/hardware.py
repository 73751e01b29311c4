"""Hardware facts: the live device or a named what-if profile."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..knowledge import GPU_PROFILES
from .tensors import dtype_name


@dataclass(frozen=True)
class DeviceProfile:
    """What a device can do for mixed precision.

    Attributes
    ----------
    name : str
        ``"cpu"``, a GPU model (``"T4"``) or the live CUDA device's name.
    kind : str
        ``"cpu"`` or ``"cuda"``.
    capability : tuple of int or None
        CUDA compute capability.
    bf16_native : bool
        bf16 math runs natively (Ampere, capability >= 8.0; CPUs run it through oneDNN).
    fp16_tensor_cores : bool
        fp16 matmuls use tensor cores (Volta and later).
    tf32 : bool
        TF32 tensor-core matmuls exist (Ampere and later).
    live : bool
        True for the machine the kernel runs on, False for a ``target=`` what-if.
    unscale_dtypes : tuple of str or None
        Dtypes the GradScaler unscale kernel accepted when probed on this device;
        None when it could not be probed (a what-if target).
    """

    name: str
    kind: str
    capability: tuple[int, int] | None
    bf16_native: bool
    fp16_tensor_cores: bool
    tf32: bool
    live: bool
    unscale_dtypes: tuple[str, ...] | None = None
    memory_gib: float | None = None

    @property
    def label(self) -> str:
        """A one-word description for headers: ``cpu (live)``, ``T4 (sm_75, what-if)``."""
        cap = f"sm_{self.capability[0]}{self.capability[1]}, " if self.capability else ""
        return f"{self.name} ({cap}{'live' if self.live else 'what-if'})"


def _gpu(name: str, cap: tuple[int, int], memory: float) -> DeviceProfile:
    major = cap[0]
    return DeviceProfile(name, "cuda", cap, major >= 8, major >= 7, major >= 8, False, None, memory)


#: What-if profiles for ``target=`` (the table is :data:`mpdoctor.knowledge.GPU_PROFILES`); names are
#: matched case-insensitively.
PROFILES: dict[str, DeviceProfile] = {
    "cpu": DeviceProfile("cpu", "cpu", None, True, False, False, False, None, None),
    **{name: _gpu(name, cap, mem) for name, (cap, mem) in GPU_PROFILES.items()},
}


class UnknownTarget(ValueError):
    """Raised for a ``target=`` name that is not a known profile."""


def profile_for(target: str) -> DeviceProfile:
    """Return the what-if profile named ``target`` (case-insensitive)."""
    for key, prof in PROFILES.items():
        if key.lower() == str(target).strip().lower():
            return prof
    raise UnknownTarget(f"unknown target {target!r}; known: {', '.join(PROFILES)}")


_UNSCALE_CACHE: dict[tuple[str, str], bool] = {}


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
