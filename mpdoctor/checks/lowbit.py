"""Low-bit training formats judged against the device: torchao float8 layers on GPUs and shapes their kernels refuse."""

from __future__ import annotations

from collections.abc import Iterator

from ..facts import Facts
from ..treatment.findings import Finding
from ..treatment.fixes import Applicability, Fix
from . import check

#: Compute capability from which GPUs have float8 tensor cores (Ada L4 / RTX 4090 sm_89, Hopper H100 sm_90).
FLOAT8_CAPABILITY = (8, 9)
#: ``torch._scaled_mm`` requires both dimensions of each operand divisible by 16.
FLOAT8_ALIGN = 16


def _live_float8(m) -> list:
    return [layer for layer in m.float8_layers if not layer.emulate]


def _filter_code(name: str) -> str:
    return (
        "from torchao.float8 import convert_to_float8_training\n"
        "# convert only the layers the fp8 kernels accept (dims divisible by 16), on a GPU with sm_89+\n"
        f"convert_to_float8_training({name}, module_filter_fn=lambda mod, fqn: "
        "mod.in_features % 16 == 0 and mod.out_features % 16 == 0)"
    )


@check("float8-unsupported-device", "error")
def float8_unsupported_device(facts: Facts) -> Iterator[Finding]:
    """torchao float8 training layers on a GPU without float8 tensor cores (below compute capability 8.9).

    What it detects
        A model with ``Float8Linear`` layers (``convert_to_float8_training``, not emulated) when the live
        CUDA device or the ``target=`` profile has compute capability below 8.9 (T4, V100, A100, A10G, RTX 30xx).
    Why it matters
        ``torch._scaled_mm`` needs float8 tensor cores: on an A100 or T4 the first forward raises
        ("torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9"). This CPU
        runs float8 layers through a CPU ``_scaled_mm``, so the failure shows only on the GPU.
    Severity
        Error: the first forward on that GPU raises.
    Fix
        Train in bf16 on that GPU (build the model without ``convert_to_float8_training``), or run on an
        L4 / RTX 4090 / H100. Display only: the layers cannot be unconverted in place.
    Source
        torchao ``float8`` README (hardware requirements); PyTorch ``_scaled_mm`` capability check.
    """
    hw = facts.hardware
    if hw.kind != "cuda" or hw.capability is None or tuple(hw.capability) >= FLOAT8_CAPABILITY:
        return
    for m in facts.models:
        layers = _live_float8(m)
        if not layers:
            continue
        cap = f"sm_{hw.capability[0]}{hw.capability[1]}"
        yield Finding(
            "float8-unsupported-device",
            "error",
            m.name,
            f"{m.name} has {len(layers)} float8 training layers ({layers[0].recipe}) but {hw.label} has no float8 "
            f"tensor cores ({cap} < sm_89): torch._scaled_mm raises at the first forward. Train in bf16 there, or use "
            "an L4 / RTX 4090 / H100.",
            {"device": hw.label, "float8_layers": len(layers), "recipes": sorted({x.recipe for x in layers})},
            [
                Fix(
                    f"Build {m.name} without float8 and train in bf16 on {hw.name}",
                    f"# rebuild {m.name} without convert_to_float8_training(...), then\n"
                    "with torch.autocast('cuda', dtype=torch.bfloat16):\n    loss = model(batch).loss",
                    applicability=Applicability.DISPLAY_ONLY,
                    recipe="float8-to-bf16",
                )
            ],
        )


@check("float8-unaligned-dims", "error")
def float8_unaligned_dims(facts: Facts) -> Iterator[Finding]:
    """torchao float8 layers whose in/out features are not divisible by 16, on a GPU that runs the fp8 kernels.

    What it detects
        ``Float8Linear`` layers with ``in_features`` (unless ``pad_inner_dim=True``) or ``out_features`` not
        divisible by 16, evaluated against the live CUDA device or the ``target=`` profile (this CPU enforces
        no alignment, so it is judged, not observed).
    Why it matters
        The fp8 GEMM (``torch._scaled_mm``) requires both dimensions of each operand divisible by 16: the first
        forward or backward through such a layer raises "Expected trailing dimension of mat1 to be divisible by
        16" / "Expected both dimensions of mat2 to be divisible by 16". The token count (batch x sequence) must
        be divisible by 16 too, for the grad-weight matmul in backward.
    Severity
        Error: the first step through such a layer raises on the GPU.
    Fix
        Convert only aligned layers (``module_filter_fn``) or pad the model's dims to multiples of 16
        (``pad_inner_dim=True`` pads the contraction dim only). Display only: conversion happens at build time.
    Source
        pytorch/ao issues #571, #1268, #3111; torchao ``Float8LinearConfig.pad_inner_dim``.
    """
    hw = facts.hardware
    if hw.kind != "cuda":
        return
    for m in facts.models:
        bad = [
            x
            for x in _live_float8(m)
            if x.out_features % FLOAT8_ALIGN or (x.in_features % FLOAT8_ALIGN and not x.pad_inner_dim)
        ]
        if not bad:
            continue
        shown = ", ".join(f"{x.path} ({x.in_features}->{x.out_features})" for x in bad[:4]) + (", ..." if len(bad) > 4 else "")
        yield Finding(
            "float8-unaligned-dims",
            "error",
            m.name,
            f"{len(bad)} float8 layers of {m.name} have dims not divisible by 16: {shown}. On {hw.label} the fp8 GEMM "
            "refuses them ('Expected both dimensions of mat2 to be divisible by 16'). Leave them in high precision.",
            {"device": hw.label, "layers": [(x.path, x.in_features, x.out_features) for x in bad]},
            [
                Fix(
                    f"Convert only the aligned layers of {m.name} to float8",
                    _filter_code(m.name),
                    applicability=Applicability.DISPLAY_ONLY,
                    recipe="float8-filter",
                )
            ],
        )
