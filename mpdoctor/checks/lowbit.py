"""Low-bit training formats judged against the device: torchao float8 layers on GPUs and shapes their kernels refuse."""

from __future__ import annotations

from collections.abc import Iterator

from ..facts import Facts
from ..facts.precision import PrecisionFacts, declared_precision, native_amp_for
from ..knowledge import FP8_GEMM_CAPABILITY, MX_GEMM_CAPABILITY
from ..treatment.findings import Finding, Severity
from ..treatment.fixes import Fix
from ..treatment.rules import Applicability, Rule
from . import check
from .precision import alignment_fix

#: Compute capability from which GPUs have float8 tensor cores (Ada L4 / RTX 4090 sm_89, Hopper H100 sm_90).
FLOAT8_CAPABILITY = FP8_GEMM_CAPABILITY
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


@check("float8-unsupported-device", Severity.ERROR, fix_safety=(Applicability.DISPLAY_ONLY,))
def float8_unsupported_device(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """torchao float8 training layers on a GPU without float8 tensor cores (below compute capability 8.9).

    What it does
        A model with ``Float8Linear`` layers (``convert_to_float8_training``, not emulated) when the live
        CUDA device or the ``target=`` profile has compute capability below 8.9 (T4, V100, A100, A10G, RTX 30xx).
    Why is this bad?
        ``torch._scaled_mm`` needs float8 tensor cores: on an A100 or T4 the first forward raises
        ("torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9"). This CPU
        runs float8 layers through a CPU ``_scaled_mm``, so the failure shows only on the GPU.
    Example
        # on an A100 (sm_80): no fp8 GEMMs
        convert_to_float8_training(model)
    Use instead
        # on an A100: bf16 autocast
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(batch).sum()
    Severity
        Error: the first forward on that GPU raises.
    Fix safety
        Train in bf16 on that GPU (build the model without ``convert_to_float8_training``), or run on an
        L4 / RTX 4090 / H100. Display only: the layers cannot be unconverted in place.
    Sources
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
        yield rule.finding(
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


@check("float8-unaligned-dims", Severity.ERROR, fix_safety=(Applicability.DISPLAY_ONLY,))
def float8_unaligned_dims(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """torchao float8 layers whose in/out features are not divisible by 16, on a GPU that runs the fp8 kernels.

    What it does
        ``Float8Linear`` layers with ``in_features`` (unless ``pad_inner_dim=True``) or ``out_features`` not
        divisible by 16, evaluated against the live CUDA device or the ``target=`` profile (this CPU enforces
        no alignment, so it is judged, not observed).
    Why is this bad?
        The fp8 GEMM (``torch._scaled_mm``) requires both dimensions of each operand divisible by 16: the first
        forward or backward through such a layer raises "Expected trailing dimension of mat1 to be divisible by
        16" / "Expected both dimensions of mat2 to be divisible by 16". The token count (batch x sequence) must
        be divisible by 16 too, for the grad-weight matmul in backward.
    Example
        model = nn.Sequential(nn.Linear(40, 40), nn.Linear(40, 8))
        convert_to_float8_training(model)  # 40 is not a multiple of 16
    Use instead
        def module_filter_fn(module, fqn):
            return module.in_features % 16 == 0 and module.out_features % 16 == 0
        convert_to_float8_training(model, module_filter_fn=module_filter_fn)
    Severity
        Error: the first step through such a layer raises on the GPU.
    Fix safety
        Convert only aligned layers (``module_filter_fn``) or pad the model's dims to multiples of 16
        (``pad_inner_dim=True`` pads the contraction dim only). Display only: conversion happens at build time.
    Sources
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
        yield rule.finding(
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


# -- float8 weight storage ---------------------------------------------------------------------------------

#: Share of a stored float8 weight's elements at the format's largest value from which the cast clearly clipped.
SATURATION_WARNING = 1e-4


@check("fp8-storage-not-upcast", Severity.ERROR, fix_safety=(Applicability.DISPLAY_ONLY,))
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
        Upcast per layer in the forward: ``model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn,
        compute_dtype=torch.bfloat16)`` for diffusers models, or a layer class that casts its weight
        (``F.linear(x, self.weight.to(x.dtype), self.bias)``); or load those weights in bf16. Display only.
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
            [
                Fix(
                    f"Store in float8, compute in bf16: upcast each layer of {m.name} in its forward",
                    f"{m.name}.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)"
                    "  # diffusers models\n# other models: a layer class whose forward does "
                    "F.linear(x, self.weight.to(x.dtype), self.bias), or load these weights in bf16",
                    applicability=Applicability.DISPLAY_ONLY,
                    recipe="fp8-storage-upcast",
                )
            ],
        )


@check("fp8-storage-trainable", Severity.ERROR, fix_safety=(Applicability.DISPLAY_ONLY,))
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
        Error: the first optimizer step (or the DDP wrap) raises.
    Fix safety
        Freeze the float8-stored parameters (``requires_grad_(False)``) and train adapters or a subset kept in
        bf16/fp32 (``skip_modules_pattern`` of ``enable_layerwise_casting``), or store the trained layers in
        bf16. Display only: which parameters to train is the user's choice.
    Sources
        huggingface/finetrainers PR #316 (fp8 layerwise-casting training); kohya-ss/sd-scripts #1711
        ("cat_cuda" not implemented for 'Float8_e4m3fn').
    """
    for m in facts.models:
        bad = [x for x in m.stored_layers if x.trainable]
        if not bad:
            continue
        shown = ", ".join(f"{x.path or m.name} ({', '.join(x.params)})" for x in bad[:4]) + (", ..." if len(bad) > 4 else "")
        yield rule.finding(
            m.name,
            f"{len(bad)} layers of {m.name} hold trainable float8 parameters: {shown}. No optimizer computes in "
            "float8: the first step raises (\"not implemented for 'Float8_e4m3fn'\"). Freeze them and train adapters "
            "or layers kept in bf16.",
            {"layers": [(x.path, x.params, x.storage_dtype) for x in bad]},
            [
                Fix(
                    f"Freeze the float8-stored parameters of {m.name}",
                    f"for p in {m.name}.parameters():\n"
                    "    if p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):\n"
                    "        p.requires_grad_(False)  # storage only: train adapters or bf16 layers\n"
                    "# rebuild the optimizer from the parameters that still require grad",
                    applicability=Applicability.DISPLAY_ONLY,
                    recipe="freeze-fp8-storage",
                )
            ],
        )


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
                    "scale = 448.0 / w_hp.abs().max().clamp(min=1e-12)  # e4m3's largest value\n"
                    "module.weight = torch.nn.Parameter((w_hp * scale).to(torch.float8_e4m3fn), requires_grad=False)\n"
                    "module.register_buffer('scale_weight', scale.reciprocal())  # multiply back after upcasting",
                    applicability=Applicability.DISPLAY_ONLY,
                    recipe="fp8-scaled-cast",
                )
            ],
            severity=severity,
        )


# -- is fp8 actually on? ------------------------------------------------------------------------------------


def _fp8_setups(facts: Facts) -> list:
    """Setups that will run fp8: the accelerator says so, or the launcher does and nothing overrides it."""
    return [
        p
        for p in facts.precisions
        if p.accelerator_mixed_precision == "fp8"
        or (p.env_mixed_precision == "fp8" and declared_precision(p) in (None, "fp8"))
    ]


def _label(precision: str) -> str:
    return "fp32" if precision == "no" else precision


def _winner(p: PrecisionFacts, declared: str) -> str:
    """The flag that beat the launcher's fp8, as the user wrote it."""
    if p.args_name is not None and p.requested in ("fp16", "bf16"):
        via = "the Trainer passes it to its Accelerator" if p.accelerator_name else "a Trainer will pass it to its Accelerator"
        return f"{p.args_name}.{p.requested}=True ({p.args_name}.mixed_precision={declared!r}; {via} explicitly)"
    if p.args_name is not None:
        return f"{p.args_name}.mixed_precision={declared!r}"
    return f"Accelerator(mixed_precision={declared!r}) (an explicit argument beats the launcher's variable)"


def _launcher_env(facts: Facts) -> dict:
    """The launcher's fp8 variables as the report may show them (the allowlisted ones)."""
    return {k: v for k, v in facts.runtime.env.items() if k == ENV or k.startswith("ACCELERATE_FP8_")}


@check("fp8-request-overridden", Severity.WARNING, fix_safety=(Applicability.SAFE, Applicability.UNSAFE, Applicability.DISPLAY_ONLY))
def fp8_request_overridden(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """The launcher asked for fp8, but another precision flag won: the run trains in bf16 (or fp16 / fp32).

    What it does
        ``ACCELERATE_MIXED_PRECISION=fp8`` in the environment (``accelerate launch --mixed_precision fp8`` sets
        it, with the ``ACCELERATE_FP8_*`` recipe variables) while the setup declares another precision:
        ``TrainingArguments(bf16=True)`` (transformers 5.x sets ``args.mixed_precision="bf16"`` and the
        Trainer passes it to ``Accelerator(mixed_precision=...)``; TRL's configs default ``bf16=True``), or an
        ``Accelerator(mixed_precision="bf16")`` built with an explicit argument. Setups with a DeepSpeed
        config are skipped.
    Why is this bad?
        accelerate takes an explicit ``mixed_precision`` over the launcher's variable, silently: measured with
        accelerate 1.15 and transformers 5.23, ``accelerate launch --mixed_precision fp8`` and
        ``TrainingArguments(bf16=True)`` give ``trainer.accelerator.mixed_precision == "bf16"``, no fp8
        backend and no float8 layer after training, while the launch command, its config and the logs say
        fp8. Speed-ups and fp8 numerics measured on such a run are bf16's.
    Example
        args = TrainingArguments(output_dir="out", bf16=True)
        accelerator = Accelerator(mixed_precision="fp8")  # the Trainer's bf16 wins
    Use instead
        args = TrainingArguments(output_dir="out", bf16=False)
        accelerator = Accelerator(mixed_precision="fp8")
    Severity
        Warning: the run trains, but not in the precision it was launched for.
    Fix safety
        Advice: the line to change (``bf16=False`` in the arguments before the Trainer is built, no
        ``mixed_precision`` argument to ``Accelerator``). Not in place, even before a Trainer exists: with
        accelerate's torchao backend (chosen first when torchao is installed) a transformers 5.23 Trainer
        prepares model and optimizer together, the model's Linear layers become ``Float8Linear`` with new
        weights after the optimizer was built, and those weights never train (measured; mpdoctor's
        ``optimizer-params-not-in-model`` names it): letting fp8 through would make that run worse. In place:
        keep the flag's precision and drop the launcher's ``ACCELERATE_MIXED_PRECISION``, so nothing says fp8
        (unsafe: it overrides the launcher's choice for later Accelerators in the process).
    Sources
        huggingface/trl #3860 ("bf16 Option in Training Config Prevents FP8 Training"); accelerate 1.15
        ``AcceleratorState`` (an explicit ``mixed_precision`` wins over ``ACCELERATE_MIXED_PRECISION``);
        transformers 5.23 ``TrainingArguments.__post_init__`` and ``Trainer._build_accelerator_args``.
    """
    env = _launcher_env(facts)
    for p in facts.precisions:
        if p.env_mixed_precision != "fp8" or p.args.get("deepspeed"):
            continue
        declared = declared_precision(p)
        if declared in (None, "fp8"):
            continue
        winner = _winner(p, declared)
        runs = _label(p.computes_in)
        shown = ", ".join(f"{k}={v}" for k, v in env.items() if k != ENV)
        msg = (
            f"The launcher asked for fp8 ({ENV}=fp8{'; ' + shown if shown else ''}) but {winner} won: {p.name} "
            f"trains in {runs}, and no layer runs in fp8."
        )
        if p.args_name is not None and p.accelerator_name is None:
            code = (
                f"{p.args_name}.bf16 = False  # before the Trainer is built: it passes args.mixed_precision to its Accelerator\n"
                f"{p.args_name}.fp16 = False\n"
                f"{p.args_name}.mixed_precision = 'fp8'\n"
                f"# or: TrainingArguments(..., bf16=False); then build the Trainer with {p.args_name}"
            )
        elif p.args_name is not None:
            code = (
                f"{p.args_name} = TrainingArguments(..., bf16=False, fp16=False)  # leaves the launcher's fp8 alone\n"
                f"trainer = Trainer(model=model, args={p.args_name}, ...)  # a new Trainer: its Accelerator is built fp8"
            )
        else:
            code = "accelerator = Accelerator()  # no mixed_precision argument: the launcher's fp8 applies"
        # Advice, not in place: with accelerate's torchao backend a Trainer converts its layers after building
        # its optimizer (transformers 5.23, accelerate 1.15, measured), so the fp8 layers' weights would not train.
        fixes = [
            Fix(
                "Let the launcher's fp8 through: no bf16/fp16 flag, no mixed_precision argument",
                code + "\n# with accelerate's torchao backend, build the optimizer from the prepared model: "
                "prepare() swaps Linear for Float8Linear with new weights",
                applicability=Applicability.DISPLAY_ONLY,
                recipe="launcher-fp8",
            )
        ]
        device = "cpu" if p.args.get("use_cpu") else (p.device or facts.hardware.kind)
        fixes.append(
            alignment_fix(
                facts,
                p,
                f"Keep {runs}: remove the launcher's {ENV}=fp8 so nothing says fp8",
                declared,
                native_amp_for(declared, device),
                why=f"{p.name} trains in {runs}; say so",
                recipe="drop-launcher-fp8",
                cost="no change to the numbers this run computes; later Accelerators in this process no longer default to fp8",
            )
        )
        evidence = {
            **env,
            "declared": declared,
            "requested": p.requested,
            "accelerator.mixed_precision": p.accelerator_mixed_precision,
            "computes_in": p.computes_in,
            "winner": winner,
        }
        yield rule.finding(p.name, msg, evidence, fixes)


@check("fp8-requested-not-on", Severity.WARNING, fix_safety=(Applicability.DISPLAY_ONLY,))
def fp8_requested_not_on(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A run configured for fp8 whose prepared model has no float8 layer: fp8 is not on.

    What it does
        An accelerator whose ``mixed_precision`` is ``"fp8"`` (``Accelerator(mixed_precision="fp8")``,
        ``accelerate launch --mixed_precision fp8``, ``ACCELERATE_MIXED_PRECISION=fp8``), and a model that
        accelerate has already prepared holding no float8 training layer (no torchao ``Float8Linear``).
    Why is this bad?
        accelerate converts layers at ``prepare()`` through a filter: with the AO backend it skips the first and
        last Linear and every Linear whose dims are not multiples of 16, so a small or oddly shaped model ends
        up with none converted; ``convert_to_float8_training`` on a leaf Linear converts nothing. The run then
        trains in bf16 autocast while its configuration, logs and the user say fp8: measured speed-ups and
        fp8 numerics studies are of another precision.
    Example
        accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()])
        model = accelerator.prepare(model)  # no Linear passes the default filter: nothing runs in fp8
    Use instead
        def module_filter_fn(module, fqn):
            return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
        accelerator = Accelerator(mixed_precision="fp8",
                                  kwargs_handlers=[AORecipeKwargs(module_filter_func=module_filter_fn)])
    Severity
        Warning: the run trains, but not in the precision it was configured for.
    Fix safety
        Convert the layers you mean to run in float8 yourself before ``prepare()``
        (``convert_to_float8_training(model, module_filter_fn=...)``) or pass an ``AORecipeKwargs`` with a
        ``module_filter_func`` that accepts them; or say bf16 if that is what is wanted. Display only.
    Sources
        huggingface/accelerate PR #4147 (the AO filter and its first/last rule); huggingface/accelerate PR #1188
        (only dims multiple of 16 are converted); fangwei123456/spikingjelly PR #685 (a leaf Linear is not
        converted).
    """
    setups = [p for p in facts.precisions if p.accelerator_mixed_precision == "fp8" and p.accelerator_name]
    if not setups:
        return
    for m in facts.models:
        if not m.accelerate_prepared or m.float8_layers:
            continue
        p = setups[0]
        yield rule.finding(
            m.name,
            f"{p.accelerator_name} is set to fp8 but {m.name}, already prepared, has no float8 layer: accelerate's "
            "filter converted none (it skips the first and last Linear and dims not divisible by 16), so every "
            "matmul runs in bf16 autocast. Convert the layers yourself before prepare(), or say bf16.",
            {"accelerator.mixed_precision": "fp8", "float8_layers": 0, ENV: p.env_mixed_precision},
            [
                Fix(
                    f"Convert the layers of {m.name} to float8 before prepare()",
                    "from torchao.float8 import convert_to_float8_training\n"
                    f"convert_to_float8_training({m.name}, module_filter_fn=lambda mod, fqn: "
                    "mod.in_features % 16 == 0 and mod.out_features % 16 == 0)\n"
                    "# then build the optimizer from the converted model, and prepare both",
                    applicability=Applicability.DISPLAY_ONLY,
                    recipe="float8-convert-before-prepare",
                )
            ],
        )


@check("fp8-requested-unsupported-device", Severity.ERROR, fix_safety=(Applicability.DISPLAY_ONLY,))
def fp8_requested_unsupported_device(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """fp8 training requested (accelerate, the environment) on a GPU without float8 GEMMs (below sm_89).

    What it does
        A precision setup whose accelerator or ``ACCELERATE_MIXED_PRECISION`` says ``fp8`` while the live CUDA
        device or the ``target=`` profile has compute capability below 8.9 (T4, V100, A100, A10G, RTX 30xx).
        Models already holding float8 layers are judged by ``float8-unsupported-device``.
    Why is this bad?
        TransformerEngine refuses at the first fp8 autocast ("Device compute capability 8.9 or higher required
        for FP8 execution."), torchao's ``_scaled_mm`` at the first forward; Triton kernels refuse the e4m3
        type ("fp8e4nv data type is not supported on CUDA arch < 89"). This CPU enforces none of it.
    Example
        # on an A100 (sm_80)
        accelerator = Accelerator(mixed_precision="fp8")
    Use instead
        # on an A100
        accelerator = Accelerator(mixed_precision="bf16")
    Severity
        Error: the first fp8 step on that GPU raises.
    Fix safety
        Train in bf16 there (``mixed_precision="bf16"``), or move to an L4 / RTX 4090 / H100. Display only.
    Sources
        NVIDIA/TransformerEngine #1159; kvcache-ai/ktransformers #934; huggingface/accelerate PR #1348
        (sm_89 as the fp8 floor).
    """
    hw = facts.hardware
    if hw.kind != "cuda" or hw.capability is None or tuple(hw.capability) >= FLOAT8_CAPABILITY:
        return
    if any(_live_float8(m) for m in facts.models):
        return  # float8-unsupported-device names the layers
    for p in _fp8_setups(facts):
        cap = f"sm_{hw.capability[0]}{hw.capability[1]}"
        yield rule.finding(
            p.name,
            f"{p.name} asks for fp8 but {hw.label} has no float8 GEMMs ({cap} < sm_89): the first fp8 step raises "
            "('Device compute capability 8.9 or higher required for FP8 execution'). Train in bf16 there.",
            {"device": hw.label, "accelerator.mixed_precision": p.accelerator_mixed_precision, ENV: p.env_mixed_precision},
            [
                Fix(
                    "Train in bf16 on this GPU",
                    "accelerator = Accelerator(mixed_precision='bf16')  # or: accelerate launch --mixed_precision bf16",
                    applicability=Applicability.DISPLAY_ONLY,
                    recipe="fp8-to-bf16",
                )
            ],
        )


#: Measured with mpdoctor's MX emulation (``quantize_mx``, bit for bit torchao's ``to_mx``) on a Gaussian gradient
#: (1024 x 4096, seed 0, blocks of 32 along the contraction): signal-to-quantization-noise ratio in dB.
MXFP8_GRAD_SQNR_DB = {"E4M3": 30.65, "E5M2": 25.37}


@check("mxfp8-e5m2-gradients", Severity.WARNING, Severity.INFO, fix_safety=(Applicability.DISPLAY_ONLY,))
def mxfp8_e5m2_gradients(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """An MXFP8 recipe whose gradients are e5m2 (TransformerEngine's ``HYBRID`` format), not NVIDIA's e4m3.

    What it does
        A TransformerEngine fp8 recipe held by an accelerator (``TERecipeKwargs`` / ``FP8RecipeKwargs`` with
        ``use_mxfp8_block_scaling=True``) whose recipe, as TE will build it, is ``MXFP8BlockScaling`` in
        ``Format.HYBRID``: e4m3 forward, e5m2 gradients. With accelerate 1.15 that does not happen through the
        handler: ``to_kwargs()`` drops an ``fp8_format`` equal to its default ``HYBRID``, so TE's
        ``MXFP8BlockScaling()`` keeps its own default, E4M3 for every tensor. A handler that *says* HYBRID
        but runs E4M3 is reported as info (true, harmless: the recipe NVIDIA recommends runs).
    Why is this bad?
        With per-block e8m0 scales the range comes from the scale, and e5m2's wider exponent buys nothing;
        its 2 mantissa bits cost precision. Measured with mpdoctor's MX emulation on a Gaussian gradient
        (1024 x 4096): e4m3 elements 30.65 dB SQNR, e5m2 elements 25.37 dB, 5.3 dB more noise in every
        gradient (4.4 dB on a heavy-tailed Student-t(3) gradient). NVIDIA's MXFP8 pre-training recipe uses
        e4m3 for all tensors; NeMo's MXFP8 recipe used ``hybrid`` until its training curve diverged.
    Example
        recipe = TERecipeKwargs(fp8_format="HYBRID", use_mxfp8_block_scaling=True)
    Use instead
        recipe = TERecipeKwargs(fp8_format="E4M3", use_mxfp8_block_scaling=True)
    Severity
        Warning when the recipe that runs is MXFP8 with e5m2 gradients (measurably noisier gradients); info
        when the handler's HYBRID is dropped by accelerate and E4M3 runs.
    Fix safety
        ``fp8_format="E4M3"`` on the recipe. Display only: TE's recipe is built from the handler at
        ``prepare()``, and with accelerate 1.15 the handler cannot send HYBRID to MXFP8 anyway; writing E4M3
        makes the code say what runs.
    Sources
        NVIDIA-NeMo/Megatron-Bridge PR #638 ("MXFP8 recipe must only use E4M3 ... Using E5M2 for gradients
        causes the training curve to diverge"); ROCm/Megatron-LM PR #100; Mishra et al., "Recipes for
        Pre-training LLMs with MXFP8" (arXiv 2506.08027); TransformerEngine ``MXFP8BlockScaling`` (default
        ``Format.E4M3``); accelerate 1.15 ``KwargsHandler.to_kwargs`` and ``apply_fp8_autowrap``.
    """
    for r in facts.fp8_recipes:
        if not r.block_scaling:
            continue
        e4, e5 = MXFP8_GRAD_SQNR_DB["E4M3"], MXFP8_GRAD_SQNR_DB["E5M2"]
        fix = Fix(
            "Use e4m3 for every tensor of the MXFP8 recipe (NVIDIA's recipe)",
            "from accelerate.utils import TERecipeKwargs\n"
            "recipe = TERecipeKwargs(use_mxfp8_block_scaling=True, fp8_format='E4M3')  # e4m3 gradients too\n"
            "accelerator = Accelerator(mixed_precision='fp8', kwargs_handlers=[recipe])",
            applicability=Applicability.DISPLAY_ONLY,
            recipe="mxfp8-e4m3",
        )
        evidence = {
            "recipe": r.owner,
            "fp8_format": r.written_format,
            "passed_to_te": r.passed_format,
            "runs": r.runs_format,
            "grad_sqnr_db_e4m3": e4,
            "grad_sqnr_db_e5m2": e5,
        }
        if r.runs_format == "HYBRID":
            yield rule.finding(
                r.owner,
                f"{r.owner} runs MXFP8 in HYBRID format: gradients are quantized to e5m2 elements under per-block "
                f"scales, where the scale already gives the range and e5m2's 2 mantissa bits cost precision "
                f"(measured: {e5:.1f} dB SQNR against {e4:.1f} dB for e4m3, {e4 - e5:.1f} dB more gradient noise). "
                "NVIDIA's MXFP8 recipe uses e4m3 for every tensor: fp8_format='E4M3'.",
                evidence,
                [fix],
            )
        elif r.written_format == "HYBRID" and r.runs_format == "E4M3":
            yield rule.finding(
                r.owner,
                f"{r.owner} holds fp8_format='HYBRID' (e5m2 gradients: its default, the argument or "
                "ACCELERATE_FP8_FORMAT) with MXFP8, but accelerate passes only non-default fields to "
                "TransformerEngine, so MXFP8BlockScaling keeps its own default, E4M3 for every tensor: NVIDIA's "
                "recipe runs, not HYBRID, whatever the handler or the logs printing it say. "
                "Write fp8_format='E4M3' to say what runs.",
                evidence,
                [fix],
                severity=Severity.INFO,
            )


@check("quantized-weights-nonfinite", Severity.ERROR, fix_safety=(Applicability.DISPLAY_ONLY,))
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
        Quantize again from the high-precision weights with a scale floor (``activation_value_lb`` on the
        dynamic configs; for weights, zero rows kept out of quantization or a tiny epsilon added to the amax),
        or leave those layers unquantized. Display only: the NaN bytes cannot be turned back into the row.
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
            [
                Fix(
                    f"Quantize {m.name} again from its high-precision weights, leaving layers with zero rows out",
                    "from torchao.quantization import quantize_, Float8WeightOnlyConfig\n"
                    f"quantize_({m.name}_hp, Float8WeightOnlyConfig(),\n"
                    "          filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear)\n"
                    "          and bool((mod.weight.abs().amax(dim=1) > 0).all()))  # no all-zero rows",
                    applicability=Applicability.DISPLAY_ONLY,
                    recipe="float8-requantize",
                )
            ],
        )


@check("block-format-unsupported-device", Severity.ERROR, fix_safety=(Applicability.DISPLAY_ONLY,))
def block_format_unsupported_device(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """MXFP8 / NVFP4 layers that quantize their activations, on a device without block-scaled GEMMs.

    What it does
        Layers whose weight is a torchao block-scaled tensor (``MXTensor``, 32-element blocks; ``NVFP4Tensor``,
        16) set to quantize the activations too (``MXDynamicActivationMXWeightConfig`` ...), when the live device
        or the ``target=`` profile is a CPU or a GPU below compute capability 10.0 (anything before Blackwell
        B200). Weight-only formats dequantize and run anywhere: they draw nothing.
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
        A weight-only config on that device (``NVFP4WeightOnlyConfig()``), float8 on sm_89+
        (``Float8DynamicActivationFloat8WeightConfig``), or a B200. Display only: quantization happens at build
        time.
    Sources
        NVIDIA/TransformerEngine #2304; torchao ``mx_formats`` (MX GEMMs need sm_100).
    """
    hw = facts.hardware
    if hw.kind == "cuda" and hw.capability is not None and tuple(hw.capability) >= MX_GEMM_CAPABILITY:
        return
    if hw.kind not in ("cuda", "cpu"):
        return
    for m in facts.models:
        bad = [q for q in m.quantized_weights if q.dynamic_activation and q.block_size in (16, 32)]
        if not bad:
            continue
        cap = f"sm_{hw.capability[0]}{hw.capability[1]}" if hw.capability else hw.kind
        kinds = sorted({q.tensor_class.rsplit(".", 1)[-1] for q in bad})
        yield rule.finding(
            m.name,
            f"{len(bad)} layers of {m.name} ({', '.join(kinds)}) quantize their activations to a block format, whose "
            f"matmul only sm_100 kernels run; {hw.label} ({cap}) has none: the first forward raises. Use a weight-only "
            "config here, float8 on sm_89+, or a B200.",
            {"device": hw.label, "layers": [(q.path, q.tensor_class, q.block_size) for q in bad]},
            [
                Fix(
                    f"Quantize {m.name} weight-only on this device",
                    "from torchao.prototype.mx_formats import NVFP4WeightOnlyConfig\n"
                    f"quantize_({m.name}_hp, NVFP4WeightOnlyConfig())  # dequantizes in the forward: runs anywhere",
                    applicability=Applicability.DISPLAY_ONLY,
                    recipe="block-format-weight-only",
                )
            ],
        )


ENV = "ACCELERATE_MIXED_PRECISION"
