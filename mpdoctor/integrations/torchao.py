"""torchao: float8 training layers (``convert_to_float8_training``) and their recipe.

``Float8Linear`` (``torchao.float8.float8_linear``) keeps its cast settings in
``module.config`` (a ``Float8LinearConfig``): the recipe is read from the
scaling granularity of the input cast (tensorwise / axiswise) and whether the
grad-weight matmul stays in high precision (``rowwise_with_gw_hp``). Whether
the device can run it (compute capability 8.9+) and which shapes its kernels
accept (dims divisible by 16) are judged by :mod:`mpdoctor.checks.lowbit`
against the live device or the ``target=`` profile: this CPU enforces neither.
"""

from __future__ import annotations

from typing import Any

from ..facts.lowbit import Float8Layer
from ..introspect import modules_of, raw_attr
from . import Integration

FLOAT8_LINEAR = "torchao.float8.float8_linear.Float8Linear"


def _name(value: Any) -> str:
    # torchao's enums print as ``ScalingGranularity.AXISWISE``; str() of an enum runs no user code.
    return str(value).lower()


def recipe_of(config: Any) -> str:
    """``tensorwise`` / ``rowwise`` / ``rowwise_with_gw_hp`` (``custom`` when it matches none)."""
    try:
        inp = raw_attr(config, "cast_config_input", None)
        gw = raw_attr(config, "cast_config_input_for_grad_weight", None)
        gran = _name(raw_attr(inp, "scaling_granularity", ""))
        if "tensorwise" in gran:
            return "tensorwise"
        if "axiswise" in gran:
            return "rowwise_with_gw_hp" if "disabled" in _name(raw_attr(gw, "scaling_type", "")) else "rowwise"
    except Exception:
        pass
    return "custom"


def _model_facts(outer: Any, inner: Any, inner_path: str, live: Any) -> dict:
    layers = []
    try:
        for path, module in modules_of(outer, (FLOAT8_LINEAR,)):
            config = raw_attr(module, "config", None)
            layers.append(
                Float8Layer(
                    path=path,
                    in_features=int(raw_attr(module, "in_features", 0)),
                    out_features=int(raw_attr(module, "out_features", 0)),
                    recipe=recipe_of(config),
                    emulate=bool(raw_attr(config, "emulate", False)),
                    pad_inner_dim=bool(raw_attr(config, "pad_inner_dim", False)),
                )
            )
    except Exception:
        return {}
    return {"float8_layers": tuple(layers)} if layers else {}


INTEGRATION = Integration(
    name="torchao",
    modules=("torchao",),
    model_facts=_model_facts,
)
