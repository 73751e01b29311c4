"""bitsandbytes: 4-bit and 8-bit linear layers and the dtype their matmuls compute in; 8-bit optimizers.

Every read of bitsandbytes' semi-private layer state lives here, guarded:
``Linear4bit.compute_dtype`` and ``compute_type_is_set`` (what the forward casts
the input and the dequantized weight to), ``weight.quant_state`` and
``weight.quant_type`` (``Params4bit``), ``Linear8bitLt.state.has_fp16_weights``.
The 8-bit optimizers' dtype requirements are a knowledge table
(:data:`mpdoctor.knowledge.REQUIREMENTS`) read by the optimizer checks.
"""

from __future__ import annotations

from typing import Any

from ...facts.quantized import LowBitLayer
from ...facts.tensors import dtype_name
from ...objects.integrations import Integration
from ...objects.live.introspect import class_path, is_a, modules_of, raw_attr

LINEAR_4BIT = "bitsandbytes.nn.modules.Linear4bit"
LINEAR_8BIT = "bitsandbytes.nn.modules.Linear8bitLt"


def _dtype(value: Any) -> str | None:
    return dtype_name(value) if value is not None and type(value).__name__ == "dtype" else None


def _weight(module: Any) -> Any:
    params = raw_attr(module, "_parameters", None)
    return dict.get(params, "weight") if isinstance(params, dict) else None


def layer_facts(path: str, module: Any) -> LowBitLayer | None:
    """The facts of one bitsandbytes linear layer, or None for any other module."""
    try:
        weight = _weight(module)
        if is_a(module, (LINEAR_4BIT,)):
            qstate = raw_attr(weight, "quant_state", None) if weight is not None else None
            qtype = raw_attr(weight, "quant_type", None) if weight is not None else None
            return LowBitLayer(
                path=path,
                class_path=class_path(type(module)),
                bits=4,
                compute_dtype=_dtype(raw_attr(module, "compute_dtype", None)),
                compute_dtype_set=bool(raw_attr(module, "compute_type_is_set", False)),
                quant_type=qtype if isinstance(qtype, str) else None,
                quantized=qstate is not None,
                storage_dtype=dtype_name(weight.dtype) if weight is not None else None,
            )
        if is_a(module, (LINEAR_8BIT,)):
            storage = dtype_name(weight.dtype) if weight is not None else None
            return LowBitLayer(
                path=path,
                class_path=class_path(type(module)),
                bits=8,
                compute_dtype=None,
                compute_dtype_set=False,
                quant_type=None,
                quantized=storage == "int8",
                storage_dtype=storage,
            )
    except Exception:  # a half-built layer: no facts rather than a broken report
        return None
    return None


def _model_facts(outer: Any, inner: Any, inner_path: str, live: Any) -> dict:
    layers = []
    try:
        for path, module in modules_of(outer, (LINEAR_4BIT, LINEAR_8BIT)):
            facts = layer_facts(path, module)
            if facts is not None:
                layers.append(facts)
    except Exception:
        return {}
    return {"low_bit_layers": tuple(layers)} if layers else {}


INTEGRATION = Integration(
    name="bitsandbytes",
    modules=("bitsandbytes",),
    model_facts=_model_facts,
)
