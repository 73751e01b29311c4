"""Hardware facts: the live device or a named what-if profile."""

from __future__ import annotations

from dataclasses import dataclass

from ..knowledge import GPU_PROFILES


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
