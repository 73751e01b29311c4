"""Weights stored in fp8 / MX / NVFP4 / int formats: what upcasts them, whether they train, saturate or hold
NaN, and the devices whose kernels refuse their block formats."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from ...facts import Facts
from ...facts.location import python_path
from ...facts.quantized import LAYERWISE_UPCAST
from ...knowledge import MX_GEMM_CAPABILITY
from ..engine.changes import FreezeParams
from ..engine.findings import Finding, Severity
from ..engine.fixes import Fix
from ..engine.lowbit_changes import (
    DequantizeBlockMatmuls,
    UnstoreFloat8Layers,
    UpcastStoredWeights,
    ZeroQuantizedZeroBlocks,
)
from ..engine.rules import Applicability, Rule
from . import check

#: Share of a stored float8 weight's elements at the format's largest value from which the cast clearly clipped.
SATURATION_WARNING = 1e-4


@check("fp8-storage-not-upcast", Severity.ERROR, fix_safety=(Applicability.SAFE, Applicability.DISPLAY_ONLY))
def fp8_storage_not_upcast(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """Weights stored in float8 in a stock torch layer that nothing casts up before the math.

    What it does
        A module holding float8 parameters of its own (``float8_e4m3fn`` ...) whose forward is torch's own
        (``nn.Linear``, ``nn.Conv*``, ``nn.Embedding``) with no forward pre-hook, no patched forward and no
        diffusers layerwise-casting hook: nothing upcasts the weight before it meets the activations. Layers
        that do upcast (``enable_layerwise_casting``, ComfyUI-style ``manual_cast`` classes, a custom forward)
        are storage, not float8 compute, and draw nothing.
    Why is this bad?
        No plain matmul computes in float8: ``F.linear`` on a float8 weight raises "mat1 and mat2 must have the
        same dtype, but got BFloat16 and Float8_e4m3fn" (or "addmm not implemented for 'Float8_e4m3fn'").
        ``nn.Embedding`` returns float8 rows as they are, so the error comes one layer later, outside the layer
        that holds the weights.
    Example
        model.to(torch.float8_e4m3fn)  # weights stored in fp8, forward computes with them directly
        model(x.to(torch.bfloat16))
    Use instead
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
        model(x.to(torch.bfloat16))
    Severity
        Error: the first forward through such a layer raises.
    Fix safety
        Upcast per layer in the forward, in place: each such layer's ``forward`` is wrapped on the instance so the
        call computes with its float8 weights cast to the compute dtype (the layer's own bf16/fp16 bias, else the
        model's), as ``enable_layerwise_casting`` and ComfyUI's ``manual_cast`` layers do; the weights stay stored
        in float8, and every entry point that reaches the layer (forward, ``generate``, the layer called
        directly) is covered. Safe: an upcast of e4m3 / e5m2 is exact, so the layer computes what the float8
        storage recipe means. Undo removes the wrappers. Packed float4 storage cannot be upcast exactly this
        way: display only (the layer's code must dequantize it).
    Sources
        kijai/ComfyUI-ControlNeXt-SVD #7; lodestone-rock/ComfyUI_FluxMod #27; diffusers ``enable_layerwise_casting``.
    """
    for m in facts.models:
        bad = [x for x in m.stored_layers if not x.upcast]
        if not bad:
            continue
        shown = ", ".join(f"{x.path or m.name} ({x.class_path.rsplit('.', 1)[-1]}: {x.storage_dtype})" for x in bad[:4])
        shown += ", ..." if len(bad) > 4 else ""
        emitting = [x.path for x in bad if x.emits_storage]
        yield rule.finding(
            m.name,
            f"{len(bad)} layers of {m.name} store their weights in float8 and nothing casts them up before the math: "
            f"{shown}. No plain matmul computes in float8: the first forward raises 'mat1 and mat2 must have the same "
            "dtype'"
            + (f" ({', '.join(emitting[:3])} return float8 rows, so it raises one layer later)" if emitting else "")
            + ". Cast each layer's weight up inside its forward.",
            {
                "layers": [(x.path, x.class_path, x.storage_dtype) for x in bad],
                "emits_float8": emitting,
            },
            [_upcast_fix(m, bad)],
        )


#: Stock layers whose forward the fix's code can write with the weight upcast, as ComfyUI's ``manual_cast`` does.
_UPCAST_CODE = {
    "Linear": "torch.nn.functional.linear(x, {m}.weight.to(torch.{d}), {bias})",
    "Embedding": "torch.nn.functional.embedding(x, {m}.weight.to(torch.{d}), {m}.padding_idx)",
    "Conv1d": "{m}._conv_forward(x, {m}.weight.to(torch.{d}), {bias})",
    "Conv2d": "{m}._conv_forward(x, {m}.weight.to(torch.{d}), {bias})",
    "Conv3d": "{m}._conv_forward(x, {m}.weight.to(torch.{d}), {bias})",
}


def _compute_dtype(m: Any, path: str) -> str:
    """The dtype a float8-stored layer computes in: its own other floating parameters' (a bf16 bias), else the
    model's main floating dtype, else bf16."""
    own = [p.dtype for p in m.tensors.params if p.module == path and p.dtype in _COMPUTE]
    rest = [p.dtype for p in m.tensors.params if p.dtype in _COMPUTE]
    for dtypes in (own, rest):
        if dtypes:
            return max(set(dtypes), key=dtypes.count)
    return "bfloat16"


_COMPUTE = ("bfloat16", "float16", "float32")
_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _upcast_fix(m: Any, bad: list) -> Fix:
    """Compute each stock layer holding float8 weights with them upcast, in place; the storage stays float8."""
    layers = tuple((x.path, _compute_dtype(m, x.path)) for x in bad if x.storage_dtype.startswith(("float8_e4m3", "float8_e5m2")))
    lines = []
    for x in bad[:6]:
        where = python_path(f"{m.name}.{x.path}" if x.path else m.name)
        dtype = _compute_dtype(m, x.path)
        bias = f"{where}.bias"
        call = _UPCAST_CODE.get(x.class_path.rsplit(".", 1)[-1])
        lines.append(f"{where}.forward = lambda x: " + call.format(m=where, d=dtype, bias=bias) if call
                     else f"# {where}: cast its float8 weight to torch.{dtype} inside its forward")  # fmt: skip
    if len(bad) > 6:
        lines.append(f"# ... and {len(bad) - 6} more layers the same way")
    code = ("# each layer computes with its weight cast up; the weight stays stored in float8 (comfy.ops.manual_cast)\n"
            + "\n".join(lines)
            + f"\n# diffusers models: {m.name}.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)")  # fmt: skip
    dtypes = sorted({_SHORT[d] for _, d in layers})
    if not layers:  # float4 or scale-only storage: nothing to upcast exactly, the layer's code must change
        return Fix(
            f"Store in a low-bit format, compute in bf16: upcast each layer of {m.name} in its forward",
            code, applicability=Applicability.DISPLAY_ONLY, recipe="fp8-storage-upcast",
        )  # fmt: skip
    return Fix(
        f"Store in float8, compute in {'/'.join(dtypes)}: upcast the weights of {len(layers)} layer"
        f"{'s' if len(layers) != 1 else ''} of {m.name} in their forward, in place",
        code,
        changes=(UpcastStoredWeights(m.ref, layers, m.name),),
        applicability=Applicability.SAFE,
        recipe="fp8-storage-upcast",
        cost="each call casts the layer's weight up (a transient copy); the stored weights stay float8",
    )


@check("fp8-storage-trainable", Severity.ERROR, Severity.INFO, fix_safety=(Applicability.UNSAFE,))
def fp8_storage_trainable(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """float8-stored parameters left trainable: their gradients and the optimizer step run in float8.

    What it does
        Parameters held in a float8 dtype with ``requires_grad=True`` (``enable_layerwise_casting`` casts every
        parameter of the layers it covers, biases and norms included; a manual ``.to(float8)`` keeps the flag).
    Why is this bad?
        No optimizer computes in float8: ``AdamW.step()`` raises "mul_cpu_reduced_float not implemented for
        'Float8_e4m3fn'" (measured here; other kernels raise the same way on GPUs), and DDP's start-up broadcast
        raises "cat_cuda not implemented for 'Float8_e4m3fn'". Even where an update ran, float8 has 3 mantissa
        bits: almost every update would round away. Layerwise casting is a storage recipe for frozen weights.
    Example
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters())  # trains float8 weights
    Use instead
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
        model.requires_grad_(False)
        model = get_peft_model(model, LoraConfig(target_modules=["to_q", "to_v"]))  # train bf16 adapters
    Severity
        Error when an optimizer holds the model's parameters: its first step (or the DDP wrap) raises. Info when
        none does (inference on float8-stored weights, ``requires_grad`` left at its default): nothing raises
        until an optimizer is built over them, and freezing them only saves autograd's bookkeeping.
    Fix safety
        Freeze the float8-stored parameters (``requires_grad_(False)``) and train adapters or a subset kept in
        bf16/fp32 (``skip_modules_pattern`` of ``enable_layerwise_casting``), or store the trained layers in
        bf16. Unsafe, applied in place on request: those weights stop training (an optimizer that holds them
        skips them: their ``.grad`` is dropped too, the float8 grads a step that raised left behind included,
        since an optimizer steps any parameter holding a grad); which parameters to train instead is the user's
        choice.
    Sources
        huggingface/finetrainers PR #316 (fp8 layerwise-casting training); kohya-ss/sd-scripts #1711
        ("cat_cuda" not implemented for 'Float8_e4m3fn').
    """
    for m in facts.models:
        bad = [x for x in m.stored_layers if x.trainable]
        if not bad:
            continue
        shown = ", ".join(f"{x.path or m.name} ({', '.join(x.params)})" for x in bad[:4]) + (", ..." if len(bad) > 4 else "")
        trained = any(o.param_ids & m.tensors.param_ids for o in facts.optimizers)
        stored = frozenset(p.id for p in m.tensors.params if p.dtype.startswith("float8") and p.requires_grad)
        consequence = ("the first step raises" if trained else
                       "no optimizer holds them now, so nothing raises yet (inference is unharmed); an optimizer built "
                       "over them would raise at its first step")  # fmt: skip
        yield rule.finding(
            m.name,
            f"{len(bad)} layers of {m.name} hold trainable float8 parameters: {shown}. No optimizer computes in "
            f"float8: {consequence} (\"not implemented for 'Float8_e4m3fn'\"). Freeze them and train adapters "
            "or layers kept in bf16.",
            {"layers": [(x.path, x.params, x.storage_dtype) for x in bad], "held_by_an_optimizer": trained},
            [
                Fix(
                    f"Freeze the float8-stored parameters of {m.name}",
                    f"for p in {m.name}.parameters():\n"
                    "    if p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):\n"
                    "        p.requires_grad_(False)  # storage only: train adapters or bf16 layers\n"
                    "# an optimizer holding them skips them (their .grad stays None): it trains the rest",
                    changes=(FreezeParams(m.ref, stored, f"float8-stored parameters of {m.name}"),),
                    applicability=Applicability.UNSAFE,
                    recipe="freeze-fp8-storage",
                    cost="those weights stop training; the rest trains as before",
                )
            ],
            severity=Severity.ERROR if trained else Severity.INFO,
        )


def _targeted(path: str, targets: tuple[str, ...]) -> bool:
    """A layer ``path`` that PEFT's ``target_modules`` select: a name its path ends with, or one regex matched in full
    (a single string); every layer when the config names none (``"all-linear"``, None)."""
    if not targets or targets == ("all-linear",):
        return True
    if len(targets) == 1 and not targets[0].isidentifier():
        try:
            return re.fullmatch(targets[0], path) is not None
        except re.error:
            return False
    return any(path == t or path.endswith("." + t) for t in targets)


def _float8_arithmetic_refused(storage: str, compute: str) -> str:
    """The error this torch raises for the arithmetic DoRA's weight norm does on a stored weight ("" when none):
    measured on one element of each dtype."""
    try:
        stored = torch.zeros(1).to(getattr(torch, storage))
        _ = stored * torch.ones(1, dtype=getattr(torch, compute))
    except Exception as exc:  # the refusal itself is the measurement
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return ""


@check("dora-on-float8-storage", Severity.ERROR, Severity.INFO,
       fix_safety=(Applicability.SAFE, Applicability.DISPLAY_ONLY))  # fmt: skip
def dora_on_float8_storage(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A DoRA adapter config whose target layers store their weights in float8.

    What it does
        A PEFT ``LoraConfig(use_dora=True)`` the user holds, beside a model whose layers that config targets keep
        their weights in a float8 dtype (diffusers' ``enable_layerwise_casting``, a manual ``.to(float8)``).
    Why is this bad?
        Layerwise casting upcasts a stored weight only inside the layer's own forward. DoRA also reads the base
        weight outside it: it computes the norm of ``W + scale * B @ A`` when the adapter is created and at every
        forward. That arithmetic meets the float8 weight as stored: "Promotion for Float8 Types is not supported"
        (CUDA), ``"mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'`` (CPU), and training never starts.
    Example
        unet.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
        unet.add_adapter(LoraConfig(r=4, use_dora=True, target_modules=["to_q", "to_v"]))  # raises
    Use instead
        unet.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16,
                                      skip_modules_pattern=("to_q", "to_v", "norm"))  # DoRA's targets stay bf16
        unet.add_adapter(LoraConfig(r=4, use_dora=True, target_modules=["to_q", "to_v"]))
    Severity
        Error when this torch refuses the arithmetic (measured on one element of the two dtypes); info when it
        computes it.
    Fix safety
        Safe, in place, when every targeted layer is stored by diffusers' layerwise casting: the targeted layers
        are taken out of float8 storage on the live model, as ``skip_modules_pattern`` would have left them. Their
        float8 weights are cast to the compute dtype (the same Parameters; every e4m3 / e5m2 value is exact in
        bf16 / fp16) and their ``LayerwiseCastingHook`` is removed (diffusers' own ``remove_hook`` refuses this
        hook, so the registry entry and the forward it wrapped are put back by hand, guarded against the
        registry's layout). The forward of those layers computes exactly what it computed before (the hook cast
        the same values to the same dtype for each call); what changes is memory: those layers are held at the
        compute dtype's size (bf16: twice their float8 bytes), the rest of the model stays float8. An
        ``add_adapter`` that already raised left diffusers' ``_hf_peft_config_loaded`` set with no adapter, so the
        same call would now raise ``AttributeError``; that flag is reset too. Undo casts back to the very float8
        tensors (bit for bit) and puts back the hooks, forwards and flag. Display only otherwise (layers stored
        another way), and as the alternative: DoRA's targets kept out of float8 storage when the storage is set
        up, a line of the user's setup. Plain LoRA is no way out through PEFT here: its adapter layers on
        float8-stored targets raise the same way at the first forward (measured).
    Sources
        Nerogar/OneTrainer #442; modelscope/DiffSynth-Studio #855; peft ``DoraLinearLayer.get_weight_norm``;
        diffusers ``HookRegistry.remove_hook`` / ``LayerwiseCastingHook.deinitalize_hook``.
    """
    dora = [c for c in facts.adapter_configs if c.dora]
    if not dora:
        return
    for m in facts.models:
        for config in dora:
            hit = [x for x in m.stored_layers if _targeted(x.path, config.targets)]
            if not hit:
                continue
            storage, compute = hit[0].storage_dtype, hit[0].compute_dtype or "bfloat16"
            refused = _float8_arithmetic_refused(storage, compute)
            shown = ", ".join(x.path for x in hit[:3]) + (f" and {len(hit) - 3} more" if len(hit) > 3 else "")
            targets = config.targets if config.targets and config.targets != ("all-linear",) else tuple(x.path for x in hit)
            yield rule.finding(
                config.name,
                f"{config.name} asks for DoRA (use_dora=True) on {len(hit)} layers of {m.name} whose weights are "
                f"stored in {storage} ({shown}). DoRA computes its weight norm from the base weight outside the "
                "layer's forward, where nothing upcasts the stored float8 weight: "
                + (f"this torch refuses that arithmetic ({refused}), so creating the adapter raises."
                   if refused else "this torch computes it, in float8's 3 mantissa bits."),
                {"config": config.name, "model": m.name, "layers": [x.path for x in hit], "storage": storage,
                 "compute": compute, "refused": refused},
                [*_unstore_targets_fix(m, config.name, hit, targets),
                 Fix(
                     "Keep DoRA and keep its target layers out of float8 storage",
                     f"{m.name}.enable_layerwise_casting(storage_dtype=torch.{storage}, compute_dtype=torch.{compute},\n"
                     f"    skip_modules_pattern={targets + ('norm',)!r})  # on the model as loaded, before the adapter\n"
                     f"{m.name}.add_adapter({config.name})",
                     applicability=Applicability.DISPLAY_ONLY,
                     recipe="dora-targets-unstored",
                     cost="the targeted layers at bf16 size; the rest stays float8",
                 )],
                severity=Severity.ERROR if refused else Severity.INFO,
            )


#: float8 formats whose every value a bf16 / fp16 / fp32 cast holds exactly (so the cast back is bit for bit).
_EXACT_UPCAST = ("float8_e4m3", "float8_e5m2")
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def _size(n: int) -> str:
    """Bytes in words: ``"4.0 KiB"``, ``"1.25 MiB"``, ``"2.50 GiB"``."""
    if n < 2**20:
        return f"{n / 2**10:.1f} KiB"
    return f"{n / 2**20:.2f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _selects_code(targets: tuple[str, ...]) -> str:
    """The condition, in the fix's code, that PEFT's ``target_modules`` select the layer ``name`` (as :func:`_targeted`)."""
    if len(targets) == 1 and not targets[0].isidentifier():
        return f"__import__('re').fullmatch({targets[0]!r}, name)"
    return f"any(name == t or name.endswith('.' + t) for t in {targets!r})"


def _unstore_targets_fix(m: Any, config: str, hit: list, targets: tuple[str, ...]) -> list[Fix]:
    """The in-place fix: DoRA's targeted layers taken out of diffusers' float8 layerwise casting on the live model;
    none when a targeted layer is stored some other way (its upcast is not known to be undone exactly)."""
    if not all(x.upcast == LAYERWISE_UPCAST and x.compute_dtype in _ITEMSIZE and x.storage_dtype.startswith(_EXACT_UPCAST)
               for x in hit):  # fmt: skip
        return []
    extra = sum(x.elements * (_ITEMSIZE[x.compute_dtype] - 1) for x in hit)
    compute = hit[0].compute_dtype
    return [Fix(
        f"Take the {len(hit)} layers {config} targets out of float8 storage in {m.name} (the rest stays float8)",
        f"for name, layer in {m.name}.named_modules():  # the layers {config} targets\n"
        "    registry = layer.__dict__.get('_diffusers_hook')\n"
        f"    if {_selects_code(targets)} and registry is not None and registry._hook_order == ['layerwise_casting']:\n"
        "        del layer.forward  # its own forward again (diffusers' remove_hook raises for this hook)\n"
        "        registry.hooks.clear(); registry._hook_order.clear(); registry._fn_refs.clear()\n"
        f"        layer.to(torch.{compute})  # exact: every float8 value is a {compute} value\n"
        f"{m.name}._hf_peft_config_loaded = 'peft_config' in {m.name}.__dict__  # an add_adapter that raised left it set\n"
        f"{m.name}.add_adapter({config})",
        changes=(UnstoreFloat8Layers(m.ref, tuple((x.path, x.compute_dtype) for x in hit), m.name),),
        applicability=Applicability.SAFE,
        recipe="dora-targets-unstored-live",
        cost=f"the targeted layers held in {compute}: {_size(extra)} more; the forward computes as before",
    )]


@check("fp8-storage-saturated", Severity.WARNING, Severity.ERROR, fix_safety=(Applicability.DISPLAY_ONLY,))
def fp8_storage_saturated(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """float8-stored weights clipped at the format's largest value, or overflowed to inf, by an unscaled cast.

    What it does
        float8-stored weights (see ``fp8-storage-not-upcast``) with elements at the format's largest finite
        value (e4m3fn: +-448) or inf / NaN (e5m2), counted from their bytes, and no per-tensor scale beside them.
    Why is this bad?
        ``w.to(torch.float8_e4m3fn)`` rounds to nearest and *saturates*: every value past 448 becomes 448
        (inf too), silently. ``w.to(torch.float8_e5m2)`` overflows to inf past 57344 and the first forward turns
        NaN. Weights with a large range must be scaled before the cast (scaled-fp8 checkpoints keep a
        ``scale_weight`` per tensor).
    Example
        layer.weight.data = layer.weight.data.to(torch.float8_e4m3fn)  # values above 448 saturate
    Use instead
        scale = 448 / layer.weight.abs().max()
        layer.weight_scale = scale
        layer.weight.data = (layer.weight.data * scale).to(torch.float8_e4m3fn)  # divide by scale in forward
    Severity
        Warning when clipped values are present (the layer computes with wrong weights); error for inf / NaN
        (the forward produces NaN).
    Fix safety
        Re-cast from the high-precision weights with a per-tensor scale (``scale = 448 / w.abs().max()``, store
        ``(w * scale).to(float8)`` and divide by the scale in the forward), or keep that layer in bf16.
        Display only: the clipped values cannot be recovered from the float8 bytes.
    Sources
        pytorch/pytorch #150756 and PR #160488 (e4m3 casts saturate at 448); NVIDIA/Model-Optimizer #1633 (NaN
        bytes from unclamped e4m3 casts); ``torch.finfo(torch.float8_e4m3fn).max == 448``.
    """
    for m in facts.models:
        hit = [x for x in m.stored_layers if (x.saturated and not x.scaled) or x.nonfinite]
        hit = [x for x in hit if x.nonfinite or x.saturated / max(x.elements, 1) >= SATURATION_WARNING]
        if not hit:
            continue
        nonfinite = sum(x.nonfinite for x in hit)
        severity = Severity.ERROR if nonfinite else Severity.WARNING
        shown = ", ".join(f"{x.path or m.name} ({x.storage_dtype}: {x.saturated} at max, {x.nonfinite} inf/NaN)" for x in hit[:4])
        yield rule.finding(
            m.name,
            f"{len(hit)} float8-stored layers of {m.name} hold clipped weights: {shown}. An unscaled cast to e4m3 "
            "saturates at 448 and one to e5m2 overflows to inf past 57344"
            + (": the forward produces NaN." if nonfinite else ": those layers compute with wrong weights.")
            + " Scale before casting (scale = 448 / amax) or keep these layers in bf16.",
            {"layers": [(x.path, x.storage_dtype, x.elements, x.saturated, x.nonfinite) for x in hit]},
            [
                Fix(
                    "Re-cast from the high-precision weights with a per-tensor scale",
                    "# the clipped values are gone from the float8 bytes, and no live object holds the high-precision\n"
                    "# weights: they are in the checkpoint (a file), which mpdoctor does not reach; load w_hp from it\n"
                    "scale = 448.0 / w_hp.abs().max().clamp(min=1e-12)  # e4m3's largest value\n"
                    "module.weight = torch.nn.Parameter((w_hp * scale).to(torch.float8_e4m3fn), requires_grad=False)\n"
                    "module.register_buffer('scale_weight', scale.reciprocal())  # multiply back after upcasting",
                    applicability=Applicability.DISPLAY_ONLY,
                    recipe="fp8-scaled-cast",
                )
            ],
            severity=severity,
        )


@check("quantized-weights-nonfinite", Severity.ERROR, fix_safety=(Applicability.SAFE, Applicability.DISPLAY_ONLY))
def quantized_weights_nonfinite(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """torchao quantized weights whose float8 data holds NaN: rows or blocks quantized with a zero scale.

    What it does
        Layers whose weight is a torchao quantized tensor (``Float8Tensor`` from ``quantize_(model,
        Float8WeightOnlyConfig())`` ...) with NaN / inf elements in its float8 data, counted from the bytes.
    Why is this bad?
        The scale of a row (or block, or tensor) is ``amax / 448`` with no lower bound: an all-zero row (a pruned
        unit, a zero-initialised LoRA ``B`` merged in, padding rows of an embedding) gets scale 0 and quantizes to
        ``0 / 0 = NaN``. Every output that reads the row is NaN from the first forward on, and the loss with it.
    Example
        layer.weight.data[0] = 0  # an all-zero row: amax 0, scale 0
        quantize_(model, Float8DynamicActivationFloat8WeightConfig())  # 0 / 0 = NaN in that row
    Use instead
        quantize_(model, Float8DynamicActivationFloat8WeightConfig(),
                  filter_fn=lambda m, fqn: fqn != "layer")  # keep the layer with zero rows unquantized
    Severity
        Error: the forward returns NaN.
    Fix safety
        Where every NaN sits in a block (row) whose scale is 0, in place and safe: a zero scale says the block's
        amax was 0, so every element was 0, and writing 0 back into those elements restores exactly the weights
        the model had (the quantized layer and its scales stay; undo gives the data back its bytes). NaN in a
        block with a non-zero scale is lost from the quantized bytes: quantize again from the high-precision
        weights (a checkpoint on disk, which mpdoctor does not reach) with a scale floor (``activation_value_lb``
        on the dynamic configs; for weights, zero rows kept out of quantization or a tiny epsilon added to the
        amax), or leave those layers unquantized: display only.
    Sources
        pytorch/ao #4713 (Float8Tensor zero inputs quantize to NaN) and PR #4762; pytorch/ao #3356 (NaN losses in
        LoRA + fp8 training, fixed by a scale lower bound); huggingface/kernels-community #681.
    """
    for m in facts.models:
        bad = [q for q in m.quantized_weights if q.nonfinite]
        if not bad:
            continue
        shown = ", ".join(f"{q.path} ({q.tensor_class.rsplit('.', 1)[-1]}: {q.nonfinite} NaN)" for q in bad[:4])
        yield rule.finding(
            m.name,
            f"{len(bad)} quantized weights of {m.name} hold NaN in their float8 data: {shown}. An all-zero row got "
            "scale amax / 448 = 0 and quantized to 0 / 0: every output reading it is NaN. Re-quantize with a scale "
            "floor, or leave these layers unquantized.",
            {"layers": [(q.path, q.tensor_class, q.storage_dtype, q.nonfinite, q.elements) for q in bad]},
            [_zero_blocks_fix(m, bad)],
        )


def _zero_blocks_fix(m: Any, bad: list) -> Fix:
    """Zero-scale blocks written back as 0 in place where every NaN sits in one; else quantize again (display only)."""
    if all(q.nonfinite == q.zero_scale_nonfinite for q in bad):
        paths = tuple(q.path for q in bad)
        where = ", ".join(python_path(f"{m.name}.{p}") for p in paths[:4]) + (", ..." if len(paths) > 4 else "")
        return Fix(
            f"Write back the zeros of the all-zero rows of {where}: their scale is 0, their NaN elements were 0",
            "\n".join(
                f"w = {python_path(f'{m.name}.{p}')}.weight  # a torchao Float8Tensor\n"
                "w.qdata.view(torch.uint8)[torch.isnan(w.qdata.float()) & (w.scale.expand_as(w.qdata) == 0)] = 0  # scale 0: the row was all 0"
                for p in paths[:4]
            ),
            changes=(ZeroQuantizedZeroBlocks(m.ref, paths, m.name),),
            applicability=Applicability.SAFE,
            recipe="float8-zero-blocks",
            cost="none: the weights become exactly what they were before quantization (the quantized layers stay)",
        )  # fmt: skip
    return Fix(
        f"Quantize {m.name} again from its high-precision weights, leaving layers with zero rows out",
        "# the NaN elements sit in blocks whose scale is not 0: their values are lost from the quantized bytes;\n"
        "# the high-precision weights are in the checkpoint (a file), which mpdoctor does not reach\n"
        "from torchao.quantization import quantize_, Float8WeightOnlyConfig\n"
        f"quantize_({m.name}_hp, Float8WeightOnlyConfig(),\n"
        "          filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear)\n"
        "          and bool((mod.weight.abs().amax(dim=1) > 0).all()))  # no all-zero rows",
        applicability=Applicability.DISPLAY_ONLY,
        recipe="float8-requantize",
    )


@check("block-format-unsupported-device", Severity.ERROR, fix_safety=(Applicability.UNSAFE, Applicability.DISPLAY_ONLY))
def block_format_unsupported_device(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """MXFP8 / NVFP4 layers that quantize their activations, on a device without block-scaled GEMMs.

    What it does
        Layers whose weight is a torchao block-scaled tensor (``MXTensor``, 32-element blocks; ``NVFP4Tensor``,
        16) set to quantize the activations too (``MXDynamicActivationMXWeightConfig`` ...) and to call the
        hardware GEMM, when the live device or the ``target=`` profile is a CPU or a GPU below compute capability
        10.0 (anything before Blackwell B200). Weight-only formats and torchao's emulated kernel
        (``kernel_preference=KernelPreference.EMULATED``) dequantize and run anywhere: they draw nothing.
    Why is this bad?
        The matmul is a block-scaled GEMM that only sm_100 kernels run: on this CPU the first forward raises
        ("Invalid scaling configuration", measured), torchao refuses NVFP4 dynamic mode below sm_100 ("NVFP4
        DYNAMIC mode is only supported on sm100+ machines", measured at ``quantize_``), and TransformerEngine
        refuses MXFP8 on other architectures ("MXFP8 (for all gemm layouts) is not supported on 12.0+
        architectures yet").
    Example
        # on an H100 (sm_90)
        quantize_(model, NVFP4DynamicActivationNVFP4WeightConfig())
    Use instead
        # on an H100: float8, which sm_89+ runs
        quantize_(model, Float8DynamicActivationFloat8WeightConfig())
    Severity
        Error: the first forward raises.
    Fix safety
        Unsafe, in place: each such weight's matmul runs dequantized, its stored data and scales kept bit for bit.
        An MX weight (and its activations' recipe) switches to torchao's emulated kernel: the activations are
        still quantized to MX, then both operands dequantize to a bf16 matmul (torchao 0.18 refuses an MX weight
        without activation quantization). An NVFP4 weight drops its activation recipe: the weight dequantizes,
        exactly what ``NVFP4WeightOnlyConfig`` builds. Unsafe: slower than a block-scaled GEMM, and NVFP4 layers no
        longer quantize their activations. Undo gives each weight its recipe and kernel choice back. Display only:
        re-quantizing from the high-precision model (mpdoctor holds only the quantized weights), or a B200.
    Sources
        NVIDIA/TransformerEngine #2304; torchao ``mx_formats`` (MX GEMMs need sm_100; ``_addmm_mx_dispatch``,
        ``nvfp4_linear``: the emulated and weight-only paths).
    """
    hw = facts.hardware
    if hw.kind == "cuda" and hw.capability is not None and tuple(hw.capability) >= MX_GEMM_CAPABILITY:
        return
    if hw.kind not in ("cuda", "cpu"):
        return
    for m in facts.models:
        bad = [q for q in m.quantized_weights if q.dynamic_activation and q.block_size in (16, 32) and q.gemm != "emulated"]
        if not bad:
            continue
        cap = f"sm_{hw.capability[0]}{hw.capability[1]}" if hw.capability else hw.kind
        kinds = sorted({q.tensor_class.rsplit(".", 1)[-1] for q in bad})
        yield rule.finding(
            m.name,
            f"{len(bad)} layers of {m.name} ({', '.join(kinds)}) quantize their activations to a block format, whose "
            f"matmul only sm_100 kernels run; {hw.label} ({cap}) has none: the first forward raises. Run their "
            "matmuls dequantized here (the stored weights kept), use float8 on sm_89+, or a B200.",
            {"device": hw.label, "layers": [(q.path, q.tensor_class, q.block_size) for q in bad]},
            [
                Fix(
                    f"Run the block-format matmuls of {m.name} dequantized, in place (the stored weights kept)",
                    _dequantized_matmul_code(m.name, bad),
                    applicability=Applicability.UNSAFE,
                    changes=(DequantizeBlockMatmuls(m.ref, tuple(q.path for q in bad), m.name),),
                    recipe="block-format-dequantized",
                    cost="slower than a block-scaled GEMM: each matmul dequantizes to bf16; NVFP4 layers no longer "
                    "quantize their activations (MX layers still do, emulated)",
                ),
                Fix(
                    f"Quantize {m.name} weight-only on this device, from its high-precision weights",
                    "# mpdoctor holds only the quantized weights: this needs the model as it was before quantize_\n"
                    "from torchao.prototype.mx_formats import NVFP4WeightOnlyConfig\n"
                    f"quantize_({m.name}_hp, NVFP4WeightOnlyConfig())  # dequantizes in the forward: runs anywhere\n"
                    "# or keep the recipe and run on a B200 (sm_100): a device mpdoctor cannot change",
                    applicability=Applicability.DISPLAY_ONLY,
                    recipe="block-format-weight-only",
                ),
            ],
        )


def _dequantized_matmul_code(name: str, bad: list) -> str:
    """Pasteable Python making the same change: MX weights to torchao's emulated kernel, NVFP4 weights weight-only."""
    mx = [q.path for q in bad if q.gemm]
    nv = [q.path for q in bad if not q.gemm]
    lines = ["import dataclasses", "from torchao.quantization.quantize_.common import KernelPreference"] if mx else []
    if mx:
        lines += [f"for path in {mx!r}:  # MX: torchao's emulated kernel (activations still MX, dequantized matmul)",
                  f"    w = {python_path(name)}.get_submodule(path).weight",
                  "    w.kernel_preference = KernelPreference.EMULATED",
                  "    w.act_quant_kwargs = dataclasses.replace(w.act_quant_kwargs, "
                  "kernel_preference=KernelPreference.EMULATED)"]  # fmt: skip
    if nv:
        lines += [f"for path in {nv!r}:  # NVFP4: weight-only, what NVFP4WeightOnlyConfig builds",
                  f"    {python_path(name)}.get_submodule(path).weight.act_quant_kwargs = None"]  # fmt: skip
    return "\n".join(lines)
