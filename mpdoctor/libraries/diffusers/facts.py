"""Facts of a diffusers model component: its class and the precision flags of its config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ComponentFacts:
    """A diffusers model component (UNet, transformer, VAE) and the precision flags of its config.

    ``flags`` are ``(key, value)`` pairs of the config keys that change precision
    (``force_upcast``, ``upcast_attention``, ...), present on the config. ``attention`` counts its diffusers
    ``Attention`` modules; ``upcast_off`` are the paths of those whose live ``upcast_attention`` is False while
    their processor reads it (the classic processors, which then compute q·kᵀ in the model's dtype, where fp16
    tops out at 65504; SDPA and xformers processors never read it).
    """

    class_path: str
    is_vae: bool
    flags: tuple[tuple[str, object], ...] = ()
    attention: int = 0
    upcast_off: tuple[str, ...] = ()

    def flag(self, key: str, default: object = None) -> object:
        """The value of one flag."""
        return dict(self.flags).get(key, default)


@dataclass(frozen=True)
class PipelineFacts:
    """A diffusers pipeline the user holds: its class, its VAE and whether its ``__call__`` reads the VAE's
    ``config.force_upcast`` (the SDXL family upcasts an fp16 VAE to fp32 to decode when it is True; the
    Stable Diffusion 1.x pipeline never reads it)."""

    name: str
    ref: int
    class_name: str
    vae_ref: int
    reads_force_upcast: bool
