"""Checks on what the device can do: bf16 without native bf16, FlashAttention on fp32, 4-bit compute in fp32."""

from __future__ import annotations

from collections.abc import Iterator

from ...facts import Facts, ModelFacts
from ...facts.configs import ConfigFacts
from ...facts.precision import PrecisionFacts, declared_precision, native_amp_for
from ...knowledge import FP16_OVERFLOW_MODEL_TYPES
from ..engine.changes import CastParamsTo, DType, SetAttrTo, SetComputeDtype
from ..engine.findings import Finding, Severity, count
from ..engine.fixes import Fix
from ..engine.rules import Applicability, Rule
from . import check
from .precision import align_spec


def fp16_overflow_type(m: ModelFacts) -> str | None:
    """The first model type of ``m``'s config tree known to overflow fp16, if any."""
    for c in m.configs:
        if c.model_type in FP16_OVERFLOW_MODEL_TYPES:
            return c.model_type
    return None


def _bf16_params(m: ModelFacts) -> list:
    return [p for p in m.tensors.params if p.dtype == "bfloat16"]


def _cast_code(model_name: str) -> str:
    return (
        "import torch\n"
        f"for p in {model_name}.parameters():\n"
        "    if p.dtype == torch.bfloat16:\n"
        "        p.data = p.data.float()  # fp32 master weights; same Parameter objects\n"
        "        if p.grad is not None:\n"
        "            p.grad.data = p.grad.data.float()"
    )


def _fp32_master_fix(
    facts: Facts, models: list[ModelFacts], title: str, code: str, setup: PrecisionFacts | None, target: str
) -> Fix:
    """Cast the bf16 parameters of ``models`` to fp32 and, for a setup, switch its arguments and accelerator."""
    specs: list = []
    backup = 0
    for m in models:
        ids = frozenset(p.id for p in _bf16_params(m))
        if ids:
            spec = CastParamsTo(m.ref, ids, "float32", facts.optimizer_refs(ids), "bf16 parameters")
            specs.append(spec)
            backup += spec.backup_bytes(facts)
    if setup is not None:
        # accelerate's rule on the GPU the finding is about (the live one or the target= profile): there fp16
        # arguments autocast with a GradScaler, so the fixed setup computes here as it will there.
        # A target= what-if is about the run on that GPU, even where this machine's arguments say use_cpu.
        what_if = not facts.hardware.live and facts.hardware.kind == "cuda"
        live_gpu = facts.hardware.live and facts.hardware.kind == "cuda"
        device = "cuda" if what_if else "cpu" if setup.args.get("use_cpu") else (setup.device or ("cuda" if live_gpu else "cpu"))
        specs.append(align_spec(facts, setup, target, native_amp_for(target, device), {"bf16": False, "fp16": target == "fp16"}))
    return Fix(title, code, applicability=Applicability.UNSAFE, changes=tuple(specs), backup_bytes=backup, recipe=f"fp32-master-{target}")


@check("bf16-unsupported", Severity.ERROR, Severity.WARNING, fix_safety=(Applicability.UNSAFE,))
def bf16_unsupported(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """bf16 arguments, autocast or weights on a GPU without native bf16 (V100, T4, P100, RTX 20xx).

    What it does
        On the live CUDA device or the ``target=`` profile, when it lacks native bf16 (compute capability
        below 8.0): a setup whose arguments or accelerator ask for bf16 (error), bf16 autocast active now
        (error), or a model holding bf16 parameters outside such a setup (warning).
    Why is this bad?
        transformers refuses ``bf16=True`` there ("Your setup doesn't support bf16/gpu. ... You need Ampere+
        GPU with cuda>=11.0."); bf16 matmuls that do run go through emulation at a fraction of fp16 speed,
        and fused kernels without a bf16 path (FlashAttention, SDPA's flash backend) refuse them. Switching
        to fp16 instead can overflow on checkpoints trained in bf16 (T5, Gemma 2/3, Qwen3-MoE, GPT-OSS,
        ...: ``FP16_OVERFLOW_MODEL_TYPES``).
    Example
        # on a V100 / T4
        args = TrainingArguments(output_dir="out", bf16=True)
    Use instead
        # on a V100 / T4: fp16 autocast over fp32 weights, with a GradScaler
        args = TrainingArguments(output_dir="out", fp16=True)
    Severity
        Error when a setup or autocast asks for bf16 on a device without it; warning for bf16 weights
        alone.
    Fix safety
        Switch to fp16 AMP with fp32 master weights: cast the bf16 parameters (with grads and optimizer
        state) to fp32 in place, set ``args.bf16=False, args.fp16=True`` and bring the accelerator to fp16
        as accelerate sets it up on that GPU: fp16 autocast and a GradScaler. For a ``target=`` what-if the
        objects stay on this machine and get the same (fp16 autocast on its device, a GradScaler), so the next
        step here computes in the dtypes the target will; ``fix.code`` also says to rebuild the Trainer on the
        target GPU. For model types known to overflow fp16 the fix chooses fp32 instead
        (``fp16=False``). Unsafe: it doubles the memory of the cast weights and changes the precision.
    Sources
        transformers ``TrainingArguments.__post_init__``; ms-swift issue #3896; Unsloth ``FORCE_FLOAT32``;
        NVIDIA compute capability tables (bf16 tensor cores from sm_80).
    """
    hw = facts.hardware
    if hw.bf16_native or hw.kind != "cuda":
        return
    covered: set[str] = set()
    for p in facts.precisions:
        if p.requested != "bf16" and declared_precision(p) != "bf16":
            continue
        models = [m for m in facts.models if m.name in p.model_names]
        covered.update(m.name for m in models)
        yield _bf16_requested(facts, rule, p, models)
    if hw.live and facts.runtime.autocast.get("cuda") == "bfloat16":
        yield rule.finding(
            "torch.autocast",
            f"bf16 autocast is active on {hw.label}, which has no native bf16: use dtype=torch.float16 with a GradScaler.",
            {"device": hw.label, "autocast": "bfloat16"},
        )
    for m in facts.models:
        if m.name not in covered and _bf16_params(m):
            yield _bf16_weights(facts, rule, m)


def _bf16_requested(facts: Facts, rule: Rule, p: PrecisionFacts, models: list[ModelFacts]) -> Finding:
    """A setup asking for bf16 on a GPU without it: fp16 autocast over fp32 master weights, or fp32."""
    hw = facts.hardware
    cap = f"sm_{hw.capability[0]}{hw.capability[1]}" if hw.capability else "no bf16"
    risky = sorted({t for t in (fp16_overflow_type(m) for m in models) if t})
    target = "no" if risky else "fp16"
    instead = (
        f"fp32 ({', '.join(risky)} overflows in fp16)" if risky else "fp16 autocast with fp32 master weights"
    )
    args = p.args_name or p.name
    code = "\n".join(
        [_cast_code(m.name) for m in models if _bf16_params(m)]
        + [
            f"{args}.bf16, {args}.fp16 = False, {target == 'fp16'}",
            f"{args}.mixed_precision = {target!r}",
            f"# on the {hw.name}: rebuild the Trainer from these arguments so accelerate sets up "
            + ("fp16 autocast and its GradScaler" if target == "fp16" else "an fp32 run"),
        ]
    )
    return rule.finding(
        p.name,
        f"{p.name} asks for bf16 on {hw.label}, which has no native bf16 ({cap} < sm_80): transformers refuses "
        "it ('Your setup doesn't support bf16/gpu') and emulated bf16 is slow. Use "
        f"{instead}.",
        {"device": hw.label, "requested": p.requested, "declared": declared_precision(p), "fp16_overflow_types": risky},
        [_fp32_master_fix(facts, models, f"Switch {p.name} to {instead}", code, p, target)],
    )


def _bf16_weights(facts: Facts, rule: Rule, m: ModelFacts) -> Finding:
    """A model holding bf16 weights on a GPU without bf16, that no bf16 setup already covers."""
    hw = facts.hardware
    bf16 = _bf16_params(m)
    risky = fp16_overflow_type(m)
    then = (
        f"train it in fp32 ({risky} overflows in fp16)"
        if risky
        else "train under torch.autocast(device_type='cuda', dtype=torch.float16) with a torch.amp.GradScaler('cuda')"
    )
    return rule.finding(
        m.name,
        f"{m.name} holds {count(len(bf16), 'bf16 parameter')} ({sum(p.numel for p in bf16):,} elements) but {hw.label} has "
        "no native bf16: its matmuls are emulated (slow) and fused kernels refuse them. Keep fp32 master "
        f"weights and {then}.",
        {"device": hw.label, "bf16_params": len(bf16), "fp16_overflow_type": risky},
        [
            _fp32_master_fix(
                facts,
                [m],
                f"Cast {count(len(bf16), 'bf16 parameter')} of {m.name} to fp32 (fp32 master weights)",
                _cast_code(m.name) + f"\n# then {then}",
                None,
                "no" if risky else "fp16",
            )
        ],
        severity=Severity.WARNING,
    )


def _flash(c: ConfigFacts) -> bool:
    return not c.is_generation_config and bool(c.attn_implementation) and "flash" in str(c.attn_implementation).lower()


@check("flash-attention-fp32", Severity.ERROR, Severity.WARNING, fix_safety=(Applicability.SAFE,))
def flash_attention_fp32(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A model configured for FlashAttention whose weights are fp32 with no half-precision autocast.

    What it does
        ``config._attn_implementation`` (on the config or a sub-config) naming a FlashAttention kernel
        (``flash_attention_2``, ``flash_attention_3``, a hub flash kernel) on a model whose weights are
        mostly fp32, where no setup runs it under fp16/bf16 autocast. Error when a Trainer will run it in
        fp32; warning for a bare model (a training loop mpdoctor cannot see may autocast).
    Why is this bad?
        FlashAttention kernels exist only for fp16 and bf16: "FlashAttention only support fp16 and bf16 data
        type". transformers casts fp32 queries to the autocast dtype, else to the dtype of the model's
        Linear weights, which is fp32 here, so the first forward raises.
    Example
        model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flash_attention_2")
        model.float()  # FlashAttention has no fp32 kernel
    Use instead
        model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="sdpa")
        model.float()
    Severity
        Error when a Trainer will run it in fp32 (the first forward raises); warning for a bare model,
        whose loop may autocast.
    Fix safety
        Switch the attention to SDPA (``eager`` for models without SDPA support) in place, on every config
        that names a flash kernel: same math in fp32. Safe. To keep FlashAttention, train under bf16/fp16
        autocast instead (``TrainingArguments(bf16=True)``).
    Sources
        transformers ``integrations/flash_attention.py`` (``get_target_dtype``); flash-attn
        ``flash_attn_interface`` dtype check; transformers' load-time warning "Flash Attention 2 only
        supports torch.float16 and torch.bfloat16 dtypes".
    """
    hw = facts.hardware
    device = hw.kind
    if facts.runtime.autocast.get(device) in ("float16", "bfloat16"):
        return
    for m in facts.models:
        flash = [c for c in m.configs if _flash(c)]
        if not flash or m.tensors.main_dtype != "float32":
            continue
        setups = [p for p in facts.precisions if m.name in p.model_names]
        if any(p.computes_in in ("fp16", "bf16") for p in setups):
            continue
        fallback = "sdpa" if m.supports_sdpa is not False else "eager"
        specs = tuple(
            SetAttrTo(c.ref, "_attn_implementation_internal", fallback, f"{c.path}._attn_implementation") for c in flash
        )

        code = (
            f"{m.config_path}.set_attn_implementation({fallback!r})  # FlashAttention has no fp32 kernels\n"
            "# or keep FlashAttention and compute in half precision: TrainingArguments(bf16=True) /\n"
            "# with torch.autocast('cuda', dtype=torch.bfloat16): ..."
        )
        kernels = sorted({str(c.attn_implementation) for c in flash})
        yield rule.finding(
            flash[0].path + "._attn_implementation",
            f"{m.name} uses {', '.join(kernels)} with fp32 weights and no fp16/bf16 autocast"
            + (" in its Trainer" if setups else "")
            + ": FlashAttention only supports fp16 and bf16, so the first forward raises.",
            {"attn_implementation": kernels, "main_dtype": m.tensors.main_dtype, "setups": [p.name for p in setups]},
            [Fix(f"Switch {m.name}'s attention to {fallback}", code, applicability=Applicability.SAFE, changes=specs, recipe="attention-fallback")],
            severity=Severity.ERROR if setups else Severity.WARNING,
        )


def _is_bnb(method: str | None) -> bool:
    text = (method or "").lower().replace("_", "")
    return "bitsandbytes" in text


def _half_dtype(facts: Facts, m: ModelFacts) -> str | None:
    """The half dtype the model's unquantized weights or its setup compute in."""
    if m.tensors.main_dtype in ("float16", "bfloat16"):
        return m.tensors.main_dtype
    for p in facts.precisions:
        if m.name in p.model_names:
            mode = p.computes_in
            if mode in ("fp16", "bf16"):
                return "float16" if mode == "fp16" else "bfloat16"
    return None




@check("bnb-compute-dtype-fp32", Severity.WARNING, fix_safety=(Applicability.UNSAFE,))
def bnb_compute_dtype_fp32(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A bitsandbytes 4-bit model computing in fp32 while the rest of the model or the run is half precision.

    What it does
        ``quantization_config`` with ``load_in_4bit=True`` and ``bnb_4bit_compute_dtype=torch.float32``
        (the default), or ``Linear4bit`` layers whose ``compute_dtype`` is fp32 (read by the bitsandbytes
        integration, so hand-built 4-bit models count too), on a model whose unquantized weights are fp16/bf16, or that a setup runs under
        fp16/bf16 autocast.
    Why is this bad?
        Each ``Linear4bit`` casts its half-precision input to fp32, dequantizes to fp32 and multiplies in
        fp32, then casts back: several times slower than a bf16/fp16 compute dtype and twice the
        activation memory. bitsandbytes warns "Input type into Linear4bit is torch.float16, but
        bnb_4bit_compute_dtype=torch.float32 (default). This will lead to slow inference or training
        speed."
    Example
        config = BitsAndBytesConfig(load_in_4bit=True)  # bnb_4bit_compute_dtype defaults to fp32
        model = AutoModelForCausalLM.from_pretrained(name, quantization_config=config, dtype=torch.bfloat16)
    Use instead
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(name, quantization_config=config, dtype=torch.bfloat16)
    Severity
        Warning: measurable slowdown and activation memory, no crash.
    Fix safety
        Set ``bnb_4bit_compute_dtype`` to the half dtype in use, on the quantization config and on every
        live ``Linear4bit`` module's ``compute_dtype`` (the attribute the forward reads), in place.
        Unsafe: the 4-bit matmuls then compute in half precision.
    Sources
        bitsandbytes ``nn.Linear4bit.forward``; QLoRA paper (bf16 compute dtype); transformers
        ``BitsAndBytesConfig``.
    """
    for m in facts.models:
        cfgs = [c for c in m.configs if _is_bnb(c.quant_method) and c.quant_4bit and c.bnb_compute_dtype == "float32"]
        # The layers' own compute dtype (read by the bitsandbytes integration) is what the forward uses.
        slow = [layer for layer in m.low_bit_layers if layer.bits == 4 and layer.compute_dtype == "float32"]
        if not cfgs and not slow:
            continue
        half = _half_dtype(facts, m)
        if half is None:
            continue
        specs = []
        for c in cfgs:
            if c.quant_ref:
                specs.append(
                    SetComputeDtype(c.quant_ref, "bnb_4bit_compute_dtype", DType(half), f"{c.path}.quantization_config.bnb_4bit_compute_dtype")
                )
        specs += [
            SetComputeDtype(m.ref, "compute_dtype", DType(half), f"{layer.path}.compute_dtype", submodule=layer.path)
            for layer in slow
        ]
        code = "\n".join(
            ["import torch"]
            + [f"{c.path}.quantization_config.bnb_4bit_compute_dtype = torch.{half}" for c in cfgs]
            + [
                f"for module in {m.name}.modules():",
                "    if type(module).__name__ == 'Linear4bit':  # the attribute its forward reads",
                f"        module.compute_dtype = torch.{half}",
                f"# when loading: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.{half})",
            ]
        )
        where = cfgs[0].path + ".quantization_config.bnb_4bit_compute_dtype" if cfgs else f"{m.name}.{slow[0].path}.compute_dtype"
        yield rule.finding(
            where,
            f"{m.name} is 4-bit quantized with bnb_4bit_compute_dtype=float32"
            + (f" on {len(slow)} Linear4bit layers" if slow else "")
            + f" while it runs in {half}: every 4-bit matmul upcasts to fp32 (slow, twice the activation memory).",
            {"bnb_4bit_compute_dtype": "float32", "half_dtype": half, "configs": [c.path for c in cfgs], "layers": len(slow)},
            [Fix(f"Compute {m.name}'s 4-bit layers in {half}", code, applicability=Applicability.UNSAFE, changes=tuple(specs), recipe="bnb-compute-dtype")],
        )


_HALVES = {"float16": "fp16", "bfloat16": "bf16"}


def _compute_fix(m: ModelFacts, cfgs: list[ConfigFacts], layers: list, dtype: str) -> Fix:
    """Set every mismatched ``Linear4bit.compute_dtype`` (and the quantization config's) to ``dtype``, in place."""
    specs = [SetComputeDtype(c.quant_ref, "bnb_4bit_compute_dtype", DType(dtype),
                             f"{c.path}.quantization_config.bnb_4bit_compute_dtype") for c in cfgs if c.quant_ref]  # fmt: skip
    specs += [SetComputeDtype(m.ref, "compute_dtype", DType(dtype), f"{layer.path}.compute_dtype", submodule=layer.path)
              for layer in layers]  # fmt: skip
    code = "\n".join(
        ["import torch"]
        + [f"{c.path}.quantization_config.bnb_4bit_compute_dtype = torch.{dtype}" for c in cfgs]
        + [
            f"for module in {m.name}.modules():",
            "    if type(module).__name__ == 'Linear4bit':  # the attribute its forward reads",
            f"        module.compute_dtype = torch.{dtype}",
            f"# when loading: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.{dtype})",
        ]
    )
    return Fix(f"Compute {m.name}'s 4-bit layers in {_HALVES[dtype]}, the model's dtype", code,
               applicability=Applicability.UNSAFE, changes=tuple(specs), recipe="bnb-compute-dtype")  # fmt: skip


@check("bnb-compute-dtype-mismatch", Severity.WARNING, Severity.INFO, fix_safety=(Applicability.UNSAFE,))
def bnb_compute_dtype_mismatch(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """bitsandbytes 4-bit layers computing in the other half precision than the model (fp16 in a bf16 model).

    What it does
        ``Linear4bit`` layers whose ``compute_dtype`` (read by the bitsandbytes integration), or a
        ``quantization_config`` whose ``bnb_4bit_compute_dtype``, is fp16 while the model's unquantized weights
        are bf16, or bf16 while they are fp16 (``BitsAndBytesConfig(bnb_4bit_compute_dtype=torch.float16)``
        copied from an fp16 notebook, then ``from_pretrained(..., dtype=torch.bfloat16)``).
    Why is this bad?
        Each ``Linear4bit`` casts its bf16 input to fp16, dequantizes to fp16 and multiplies in fp16, then
        casts back: every 4-bit matmul of a bf16 model has fp16's range. An activation or a matmul output past
        65504, which bf16 holds, becomes inf there and NaN after the next norm: the logits go NaN while the same
        checkpoint with a bf16 compute dtype is finite. The other way round (bf16 compute in an fp16 model)
        keeps the range but rounds every 4-bit matmul to bf16's 8 bits.
    Example
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float16)
        model = AutoModelForCausalLM.from_pretrained(name, quantization_config=config, dtype=torch.bfloat16)
    Use instead
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(name, quantization_config=config, dtype=torch.bfloat16)
    Fix safety
        Set ``compute_dtype`` on every mismatched live ``Linear4bit`` (the attribute its forward reads) and
        ``bnb_4bit_compute_dtype`` on the quantization config to the model's dtype, in place; undo restores
        each. Unsafe: the 4-bit matmuls then round differently.
    Severity
        Warning for fp16 compute in a bf16 model (fp16's range inside a model that relies on bf16's); info for
        bf16 compute in an fp16 model (coarser rounding, same range).
    Sources
        bitsandbytes ``nn.Linear4bit.forward`` (``x.to(self.compute_dtype)``, output cast back to the input's
        dtype); transformers ``BitsAndBytesConfig``.
    """
    for m in facts.models:
        dtype = m.tensors.main_dtype
        if dtype not in _HALVES:
            continue
        other = {"float16": "bfloat16", "bfloat16": "float16"}[dtype]
        layers = [x for x in m.low_bit_layers if x.bits == 4 and x.compute_dtype == other]
        cfgs = [c for c in m.configs if _is_bnb(c.quant_method) and c.quant_4bit and c.bnb_compute_dtype == other]
        if not layers and not cfgs:
            continue
        where = f"{m.name}.{layers[0].path}.compute_dtype" if layers else f"{cfgs[0].path}.quantization_config.bnb_4bit_compute_dtype"
        range_lost = other == "float16"
        yield rule.finding(
            where,
            f"{m.name} is {_HALVES[dtype]} but "
            + (f"{len(layers)} Linear4bit layers compute in {_HALVES[other]}" if layers
               else f"its bnb_4bit_compute_dtype is {_HALVES[other]}")  # fmt: skip
            + (": every 4-bit matmul has fp16's range, and an output past 65504 (which bf16 holds) becomes inf, "
               "then NaN." if range_lost else ": every 4-bit matmul rounds to bf16's 8 bits inside an fp16 model."),
            {"model_dtype": dtype, "compute_dtype": other, "layers": [x.path for x in layers],
             "configs": [c.path for c in cfgs]},  # fmt: skip
            [_compute_fix(m, cfgs, layers, dtype)],
            severity=Severity.WARNING if range_lost else Severity.INFO,
        )
