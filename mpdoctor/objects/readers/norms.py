"""Reading a model's normalisation epsilons: every norm module's eps (and where its kernel adds it) and the
config fields that set it."""

from __future__ import annotations

from typing import Any

from ..live import Live
from ..live.introspect import modules_where, raw_attr

#: Config fields holding a normalisation epsilon (transformers' names).
_CONFIG_EPS = ("layer_norm_eps", "rms_norm_eps", "norm_eps", "layer_norm_epsilon", "norm_epsilon")
_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")
_KERNELS: dict[type, str] = {}


def _norm_kernel(cls: type) -> str:
    """Where a norm class adds its eps: torch's fused kernels and forwards that upcast do it in fp32."""
    if cls not in _KERNELS:
        kernel = "dtype"
        if cls.__module__.startswith("torch.nn.modules."):
            kernel = "fused"
        else:
            import inspect

            forward = next((c.__dict__["forward"] for c in cls.__mro__ if "forward" in c.__dict__), None)
            try:  # read the source, never run it (the function is found in the class dicts, not by getattr)
                src = inspect.getsource(forward)
                kernel = "upcast" if ("float32" in src or ".float()" in src) else "dtype"
            except (OSError, TypeError):
                kernel = "dtype"
        _KERNELS[cls] = kernel
    return _KERNELS[cls]


def norm_epsilons(inner: Any, live: Live) -> dict:
    """The ``norm_eps`` and ``config_eps`` fields: every norm module's eps and the config fields setting it."""
    try:
        norms = modules_where(inner, lambda cls: "norm" in cls.__name__.lower())
    except Exception:
        return {}
    found = []
    for path, mod in norms:
        for attr in _EPS_ATTRS:
            value = raw_attr(mod, attr, None)
            if type(value) is float:
                found.append((path, type(mod).__name__, attr, value, _norm_kernel(type(mod))))
                break
    configs = []
    config = raw_attr(inner, "config", None)
    for cfg in (config, *(raw_attr(config, k, None) for k in ("text_config", "vision_config", "audio_config"))):
        if cfg is None:
            continue
        for attr in _CONFIG_EPS:
            value = raw_attr(cfg, attr, None)
            if type(value) is float:
                configs.append((live.add(cfg), attr, value))
    return {"norm_eps": tuple(found), "config_eps": tuple(configs)}
