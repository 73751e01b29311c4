"""torchao: float8 training layers (``convert_to_float8_training``) and their recipe; quantized weights.

Weights quantized by ``quantize_`` (``Int8Tensor``, ``Float8Tensor``,
``AffineQuantizedTensor`` ...: subclasses of ``torchao.utils.TorchAOBaseTensor``)
report the dtype they dequantize to; :func:`weight_storage` reads what they
hold (their inner tensors, through ``__tensor_flatten__``, the protocol
torch.compile uses), so the dtype tally shows int8 data where it is, and the
layers holding them are not taken for compute modules of another dtype: they
dequantize to the dtype of the input that reaches them.

``Float8Linear`` (``torchao.float8.float8_linear``) keeps its cast settings in
``module.config`` (a ``Float8LinearConfig``): the recipe is read from the
scaling granularity of the input cast (tensorwise / axiswise) and whether the
grad-weight matmul stays in high precision (``rowwise_with_gw_hp``). Whether
the device can run it (compute capability 8.9+) and which shapes its kernels
accept (dims divisible by 16) are judged by :mod:`mpdoctor.rules.checks.fp8_training`
against the live device or the ``target=`` profile: this CPU enforces neither.
"""

from __future__ import annotations

from typing import Any

import torch

from ...facts.fp8_training import Float8Layer
from ...facts.quantized import QuantizedWeight
from ...facts.tensors import dtype_name
from ...objects.integrations import Integration
from ...objects.live.introspect import anatomy, class_path, class_paths, modules_of, raw_attr

FLOAT8_LINEAR = "torchao.float8.float8_linear.Float8Linear"
BASE_TENSOR = "torchao.utils.TorchAOBaseTensor"


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
                    weight_dtype=dtype_name(raw_attr(raw_attr(module, "weight", None), "dtype", "float32")),
                    input_dtype=dtype_name(raw_attr(raw_attr(config, "cast_config_input", None), "target_dtype", None) or torch.float8_e4m3fn),
                    grad_dtype=dtype_name(
                        raw_attr(raw_attr(config, "cast_config_grad_output", None), "target_dtype", None) or torch.float8_e5m2
                    ),
                )
            )
    except Exception:
        return {}
    out: dict = {"float8_layers": tuple(layers)} if layers else {}
    try:
        quantized = quantized_weights(outer)
    except Exception:  # a tensor subclass of another torchao version must not stop the report
        quantized = ()
    if quantized:
        out["quantized_weights"] = quantized
    return out


def float8_training_layer(linear: torch.nn.Module, config: Any) -> torch.nn.Module:
    """A ``Float8Linear`` built from ``linear`` as ``convert_to_float8_training`` builds it
    (``Float8Linear.from_float``), holding the very same weight and bias Parameters, in ``linear``'s train/eval
    mode. ``config`` must have FSDP float8 all-gather off (else the weight is wrapped in a new Parameter)."""
    from torchao.float8.float8_linear import Float8Linear

    layer = Float8Linear.from_float(linear, config=config)
    if layer.weight is not linear.weight or layer.bias is not linear.bias:
        raise RuntimeError("Float8Linear.from_float did not keep the layer's Parameters")
    return layer.train(linear.training)


#: float8 NaN / inf codes with the sign bit dropped (``float8_e4m3fn`` has NaN only; e5m2 has inf and NaN).
_NONFINITE_CODES = {torch.float8_e4m3fn: (0x7F,), torch.float8_e5m2: (0x7C, 0x7D, 0x7E, 0x7F)}


def _nonfinite(t: Any) -> int:
    codes = _NONFINITE_CODES.get(t.dtype)
    if codes is None or t.device.type == "meta" or not t.numel():
        return 0
    bits = t.detach().view(torch.uint8) & 0x7F
    return sum(int((bits == c).sum()) for c in codes)


def zero_scale_nonfinite(w: Any) -> torch.Tensor | None:
    """The mask of ``w.qdata``'s NaN / inf elements that sit in a block whose scale is 0 (an all-zero block quantized
    as 0 / 0), for a torchao float8 tensor holding ``qdata`` and a ``scale`` that expands to it by whole blocks;
    None for any other weight."""
    qdata, scale = raw_attr(w, "qdata", None), raw_attr(w, "scale", None)
    if not (isinstance(qdata, torch.Tensor) and isinstance(scale, torch.Tensor)) or qdata.dtype not in _NONFINITE_CODES:
        return None
    if qdata.device.type == "meta" or scale.dim() != qdata.dim() or not qdata.numel():
        return None
    full = scale.detach()
    for dim, (n, k) in enumerate(zip(qdata.shape, scale.shape)):
        if k == 0 or n % k:
            return None
        full = full.repeat_interleave(n // k, dim=dim)
    bits = qdata.detach().view(torch.uint8) & 0x7F
    bad = torch.zeros_like(bits, dtype=torch.bool)
    for code in _NONFINITE_CODES[qdata.dtype]:
        bad |= bits == code
    return bad & (full == 0)


def _count(mask: torch.Tensor | None) -> int:
    return int(mask.sum()) if mask is not None else 0


def quantized_weights(model: Any) -> tuple[QuantizedWeight, ...]:
    """The layers of ``model`` whose ``weight`` is a torchao quantized tensor, with NaN counts of their data."""
    out = []
    for path, mod in anatomy(model).subclassed:  # a plain nn.Parameter is never torchao's: only the others are read
        w = mod.__dict__.get("_parameters", {}).get("weight")
        if w is None or BASE_TENSOR not in class_paths(type(w)):
            continue
        leaves = _leaves(w)
        if not leaves:
            continue
        data = max(leaves, key=lambda x: x.numel() * x.element_size())
        block = raw_attr(w, "block_size", 0)
        out.append(
            QuantizedWeight(
                path=path,
                tensor_class=class_path(type(w)),
                storage_dtype=dtype_name(data.dtype),
                block_size=block if isinstance(block, int) else 0,
                elements=int(w.numel()),
                nonfinite=sum(_nonfinite(x) for x in leaves),
                dynamic_activation=raw_attr(w, "act_quant_kwargs", None) is not None,
                zero_scale_nonfinite=_count(zero_scale_nonfinite(w)),
                **_activation_scaling(raw_attr(w, "act_quant_kwargs", None)),
                gemm=_gemm_choice(w),
            )
        )
    return tuple(out)


def _gemm_choice(w: Any) -> str:
    """The matmul kernel a quantized weight picks (torchao's ``kernel_preference``, the weight's own or its
    activations' recipe's, as ``_get_gemm_choice`` takes it): ``"auto"``, ``"emulated"``...; "" when it has none."""
    choice = raw_attr(w, "kernel_preference", None)
    if choice is None:
        choice = raw_attr(raw_attr(w, "act_quant_kwargs", None), "kernel_preference", None)
    value = getattr(choice, "value", None)  # KernelPreference is a str Enum: its value is the plain name
    return value if isinstance(value, str) else ""


def dequantized_matmul_changes(w: Any, where: str) -> list:
    """The steps that make the matmul of a block-format weight that quantizes its activations run dequantized, on
    any device, the stored weight untouched; [] when it already does.

    A weight with a kernel choice of its own (``MXTensor``) switches it, and its activations' recipe's, to torchao's
    emulation: the activations are still quantized to the block format, then both operands dequantize to a bf16
    matmul (torchao 0.18 refuses an MX weight without activation quantization: "weight-only quant not yet
    supported"). A weight without one (``NVFP4Tensor``) drops its activation recipe: its matmul then dequantizes the
    weight, exactly what ``NVFP4WeightOnlyConfig`` builds from the same stored data.
    """
    import dataclasses

    from ...objects.edits.steps import SetAttr

    kwargs = raw_attr(w, "act_quant_kwargs", None)
    if kwargs is None:
        return []
    if not _gemm_choice(w):
        return [SetAttr(w, "act_quant_kwargs", None, f"{where}.act_quant_kwargs")]
    if _gemm_choice(w) == "emulated":
        return []
    from torchao.quantization.quantize_.common import KernelPreference

    emulated = KernelPreference.EMULATED
    steps = [SetAttr(w, "act_quant_kwargs", dataclasses.replace(kwargs, kernel_preference=emulated), f"{where}.act_quant_kwargs")]
    if raw_attr(w, "kernel_preference", None) is not None:
        steps.append(SetAttr(w, "kernel_preference", emulated, f"{where}.kernel_preference"))
    return steps


def _activation_scaling(kwargs: Any) -> dict:
    """``activation_granularity`` and ``activation_floor`` of a weight's dynamic activation quantization
    (torchao's ``QuantizeTensorToFloat8Kwargs``: ``granularity``, ``hp_value_lb``); empty when it has none."""
    if kwargs is None:
        return {}
    name = type(getattr(kwargs, "granularity", None)).__name__
    granularity = {"PerRow": "row", "PerTensor": "tensor"}.get(name, name.lower())
    floor = getattr(kwargs, "hp_value_lb", None)
    return {"activation_granularity": granularity,
            "activation_floor": float(floor) if isinstance(floor, (int, float)) else None}  # fmt: skip


def _leaves(t: Any, depth: int = 0) -> list:
    """The plain tensors a torchao tensor subclass is made of (``__tensor_flatten__``, nested ones too)."""
    if BASE_TENSOR not in class_paths(type(t)):
        return [t]
    if depth > 3:
        return []
    names, _ctx = type(t).__tensor_flatten__(t)  # torchao's own method on its own class
    out = []
    for n in names:
        inner = getattr(t, n, None)
        if inner is not None:
            out.extend(_leaves(inner, depth + 1))
    return out


def weight_storage(p: Any) -> tuple[str, str, int] | None:
    """``(class path, storage dtype, bytes)`` of a torchao quantized weight; None for anything else.

    The storage dtype is the dtype of its largest inner tensor (``int8`` data beside fp32 scales);
    the bytes count every inner tensor.
    """
    if BASE_TENSOR not in class_paths(type(p)):
        return None
    leaves = _leaves(p)
    if not leaves:
        return None
    largest = max(leaves, key=lambda x: x.numel() * x.element_size())
    nbytes = sum(x.numel() * x.element_size() for x in leaves)
    return class_path(type(p)), dtype_name(largest.dtype), nbytes


INTEGRATION = Integration(
    name="torchao",
    modules=("torchao",),
    model_facts=_model_facts,
    weight_storage=weight_storage,
)
