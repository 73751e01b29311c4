"""fp8 / MX training recipes judged against the device and the run: torchao float8 layers, accelerate's fp8
requests and TransformerEngine recipes, on GPUs and shapes their kernels refuse."""

from __future__ import annotations

from collections.abc import Iterator

from ...facts import Facts, ModelFacts
from ...facts.fp8_training import AORecipeFacts
from ...facts.location import python_path
from ...facts.precision import PrecisionFacts, declared_precision, native_amp_for
from ...knowledge import FP8_GEMM_CAPABILITY
from ..engine.changes import SetEnvVar
from ..engine.findings import Finding, Severity
from ..engine.fixes import Fix
from ..engine.lowbit_changes import ConvertBack, ConvertToFloat8
from ..engine.rules import Applicability, Rule
from . import check
from .precision import align_spec, alignment_fix

#: Compute capability from which GPUs have float8 tensor cores (Ada L4 / RTX 4090 sm_89, Hopper H100 sm_90).
FLOAT8_CAPABILITY = FP8_GEMM_CAPABILITY


#: ``torch._scaled_mm`` requires both dimensions of each operand divisible by 16.
FLOAT8_ALIGN = 16


ENV = "ACCELERATE_MIXED_PRECISION"
#: accelerate's AO recipe reads it, default on: Float8Linear then wraps each weight in a new Parameter at prepare().
ALL_GATHER = "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER"


def _live_float8(m) -> list:
    return [layer for layer in m.float8_layers if not layer.emulate]


def _filter_code(name: str) -> str:
    return (
        "from torchao.float8 import convert_to_float8_training\n"
        "# convert only the layers the fp8 kernels accept (dims divisible by 16), on a GPU with sm_89+\n"
        f"convert_to_float8_training({name}, module_filter_fn=lambda mod, fqn: "
        "mod.in_features % 16 == 0 and mod.out_features % 16 == 0)"
    )


@check("float8-unsupported-device", Severity.ERROR, fix_safety=(Applicability.UNSAFE, Applicability.DISPLAY_ONLY))
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
        Unsafe, in place: every float8 layer of the model goes back to torch's ``nn.Linear`` (the same module
        objects, their weights unwrapped from torchao's float8 training tensor, the optimizers holding the plain
        weights), so the model trains in its weights' dtype or under bf16 autocast, which that GPU runs; undo
        converts the layers again. Unsafe: the precision the run computes in changes. Display only: an L4 /
        RTX 4090 / H100 keeps float8 (mpdoctor cannot change the GPU), or build the model without
        ``convert_to_float8_training`` (its construction is the user's code).
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
            f"tensor cores ({cap} < sm_89): torch._scaled_mm raises at the first forward. Take them out of float8 "
            "and train in bf16 there, or use an L4 / RTX 4090 / H100.",
            {"device": hw.label, "float8_layers": len(layers), "recipes": sorted({x.recipe for x in layers})},
            [
                Fix(
                    f"Take the {len(layers)} float8 layers of {m.name} out of float8: back to torch's Linear, in place",
                    "\n".join(f"{python_path(m.name + '.' + x.path)}.__class__ = torch.nn.Linear  # and its weight "
                              "unwrapped from torchao's float8 training tensor" for x in layers)
                    + "\n# then train in bf16:\nwith torch.autocast('cuda', dtype=torch.bfloat16):\n    "
                    "loss = model(batch).loss",
                    applicability=Applicability.UNSAFE,
                    changes=(ConvertBack(m.ref, tuple(x.path for x in layers), f"layers of {m.name}",
                                         facts.optimizer_refs(m.tensors.param_ids)),),  # fmt: skip
                    recipe="convert-back",
                    cost="those layers compute in their weights' dtype (or bf16 autocast) instead of float8",
                ),
                Fix(
                    f"Build {m.name} without float8 and train in bf16 on {hw.name}",
                    f"# mpdoctor cannot re-run your model's construction: rebuild {m.name} without "
                    "convert_to_float8_training(...), then\n"
                    "with torch.autocast('cuda', dtype=torch.bfloat16):\n    loss = model(batch).loss\n"
                    "# or keep float8 on an L4 / RTX 4090 / H100 (sm_89+): a GPU mpdoctor cannot change",
                    applicability=Applicability.DISPLAY_ONLY,
                    recipe="float8-to-bf16",
                ),
            ],
        )


@check("float8-unaligned-dims", Severity.ERROR, fix_safety=(Applicability.UNSAFE, Applicability.DISPLAY_ONLY))
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
        Unsafe, in place: the unaligned layers go back to torch's ``nn.Linear`` (the same module objects, their
        weights unwrapped, the optimizers holding the plain weights), so they compute in their weights' dtype
        while the aligned layers stay float8. The same as code at build time: convert only aligned layers
        (``module_filter_fn``), or pad the model's dims to multiples of 16 (``pad_inner_dim=True`` pads the
        contraction dim only).
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
                    f"Take the {len(bad)} unaligned layers of {m.name} out of float8: back to torch's Linear, in place",
                    "\n".join(f"{python_path(m.name + '.' + x.path)}.__class__ = torch.nn.Linear  # and its weight "
                              "unwrapped from torchao's float8 training tensor" for x in bad)
                    + "\n# or at build time:\n" + _filter_code(m.name),
                    applicability=Applicability.UNSAFE,
                    changes=(ConvertBack(m.ref, tuple(x.path for x in bad), f"layers of {m.name}",
                                         facts.optimizer_refs(m.tensors.param_ids)),),  # fmt: skip
                    recipe="convert-back",
                    cost="those layers compute in their weights' dtype (bf16 / fp32) instead of float8",
                ),
                Fix(
                    f"Convert only the aligned layers of {m.name} to float8",
                    _filter_code(m.name),
                    applicability=Applicability.DISPLAY_ONLY,
                    recipe="float8-filter",
                ),
            ],
        )


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
        While only the arguments exist (no Trainer yet) and no FSDP is set, in place (unsafe: it changes the
        precision the next Trainer trains in): ``bf16=False``, ``fp16=False``, ``mixed_precision="fp8"`` on the
        arguments and ``ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER=0``. The last one matters: accelerate 1.15's
        torchao recipe turns FSDP float8 all-gather on by default (the launcher sets it too), so ``prepare()``
        wraps each converted layer's weight in a new Parameter after the Trainer built its optimizer, and those
        weights never train (measured; ``optimizer-params-not-in-model`` names it). Off, the Trainer built from
        the fixed arguments trains its inner Linear layers as ``Float8Linear``. Once a Trainer or an
        ``Accelerator(mixed_precision=...)`` exists its mode and layers are chosen: advice (the line to change,
        then a new Trainer). The other fix keeps the flag's precision and drops the launcher's
        ``ACCELERATE_MIXED_PRECISION``, so nothing says fp8 (unsafe: later Accelerators in the process no longer
        default to fp8).
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
        fixes = [_fp8_through(facts, p, code)]
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


#: Distributions accelerate accepts as an fp8 backend (read from package metadata, never imported).
_FP8_BACKENDS = ("torchao", "transformer_engine", "msamp")


def _fp8_through(facts: Facts, p: PrecisionFacts, code: str) -> Fix:
    """Let the launcher's fp8 reach the Trainer: in place while only the arguments exist, no FSDP is set and an fp8
    backend is installed.

    accelerate 1.15's AO recipe turns FSDP float8 all-gather on by default; ``Float8Linear`` then wraps each weight
    in a new Parameter at ``prepare()``, after the Trainer built its optimizer, and those weights never train
    (measured). Off, the converted layers keep the optimizer's Parameters and train.
    """
    backend = any(lib in facts.runtime.versions for lib in _FP8_BACKENDS)
    if p.args_name is not None and p.accelerator_name is None and not p.args.get("fsdp") and backend:
        return Fix(
            "Let the launcher's fp8 through: no bf16/fp16 flag, no FSDP float8 all-gather (this run has no FSDP)",
            "import os\n" + code + f"\nos.environ[{ALL_GATHER!r}] = '0'  # no FSDP: on, prepare() gives Float8Linear "
            "new weights the Trainer's optimizer never holds",
            applicability=Applicability.UNSAFE,
            changes=(align_spec(facts, p, "fp8", False, {"bf16": False, "fp16": False}), SetEnvVar(ALL_GATHER, "0")),
            recipe="launcher-fp8",
            cost="the Trainer built from these arguments trains its inner Linear layers in float8 (torchao)",
        )
    # Advice once an Accelerator exists (its mode and layers are chosen; a new Trainer must be built), or where
    # no fp8 backend is installed: accelerate then refuses mixed_precision="fp8" when the Trainer is built.
    install = "" if backend else "# first: pip install torchao  (accelerate's fp8 needs torchao, transformer_engine or MS-AMP)\n"
    return Fix(
        "Let the launcher's fp8 through: no bf16/fp16 flag, no mixed_precision argument",
        install + code + f"\nos.environ[{ALL_GATHER!r}] = '0'  # without FSDP; on, prepare() gives Float8Linear new weights "
        "the optimizer never holds",
        applicability=Applicability.DISPLAY_ONLY,
        recipe="launcher-fp8",
    )


@check("fp8-requested-not-on", Severity.WARNING, fix_safety=(Applicability.UNSAFE, Applicability.DISPLAY_ONLY))
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
        Unsafe, in place, where accelerate's default filter skipped them (the handler holds no
        ``module_filter_func`` of the user's) and the accelerator shards nothing (no FSDP, DeepSpeed or
        Megatron): torch's ``nn.Linear`` layers with both dims multiples of 16 become torchao ``Float8Linear``
        layers built with the accelerator's own recipe config, as ``convert_to_float8_training`` builds them, over
        the very same weight and bias Parameters, so the optimizer (and accelerate's wrapper of it) trains them
        on; FSDP float8 all-gather is left off, since on it gives each layer a new weight Parameter the optimizer
        never holds. Undo puts the original layers back. Unsafe although the user asked for fp8: it changes the
        numerics of a running training from the next step (e4m3 forward matmuls, e5m2 gradients, where bf16 ran
        until now), and converts the first and last Linear accelerate keeps out "for stability". Layers a
        user's own filter left out stay as they are: that choice was on purpose, and the fix is then advice, as
        it is where no layer has dims multiples of 16 (nothing can be converted) or the accelerator shards.
    Sources
        huggingface/accelerate PR #4147 (the AO filter and its first/last rule); huggingface/accelerate PR #1188
        (only dims multiple of 16 are converted); fangwei123456/spikingjelly PR #685 (a leaf Linear is not
        converted); accelerate 1.15 ``utils/ao.py`` (``convert_model_to_fp8_ao``, ``filter_linear_layers``).
    """
    setups = [p for p in facts.precisions if p.accelerator_mixed_precision == "fp8" and p.accelerator_name]
    if not setups:
        return
    for m in facts.models:
        if not m.accelerate_prepared or m.float8_layers:
            continue
        p = setups[0]
        recipe = next((r for r in facts.ao_recipes if r.accelerator_ref == p.accelerator_ref), None)
        by_user = recipe is not None and recipe.user_filter
        why = ("its module_filter_func (yours) accepted none" if by_user else
               "accelerate's filter converted none (it skips the first and last Linear and dims not divisible by 16)")
        live_fix = _convert_live(m, p, recipe) if recipe is not None and not by_user else None
        yield rule.finding(
            m.name,
            f"{p.accelerator_name} is set to fp8 but {m.name}, already prepared, has no float8 layer: {why}, so every "
            "matmul runs in bf16 autocast. Convert the layers to float8, or say bf16.",
            {"accelerator.mixed_precision": "fp8", "float8_layers": 0, ENV: p.env_mixed_precision,
             "filter": "user" if by_user else "accelerate default"},  # fmt: skip
            [
                *([live_fix] if live_fix is not None else []),
                Fix(
                    f"Convert the layers of {m.name} to float8 before prepare()",
                    "# layers whose dims are not multiples of 16 have no float8 GEMM; the shapes are the model's\n"
                    "from torchao.float8 import convert_to_float8_training\n"
                    f"convert_to_float8_training({m.name}, module_filter_fn=lambda mod, fqn: "
                    "mod.in_features % 16 == 0 and mod.out_features % 16 == 0)\n"
                    "# then build the optimizer from the converted model, and prepare both",
                    applicability=Applicability.DISPLAY_ONLY,
                    recipe="float8-convert-before-prepare",
                ),
            ],
        )


def _convert_live(m: ModelFacts, p: PrecisionFacts, recipe: AORecipeFacts) -> Fix | None:
    """Turn fp8 on in the prepared model: its aligned torch Linear layers to ``Float8Linear`` with the accelerator's
    own recipe, in place over the same Parameters; None where nothing can be (no aligned Linear, a sharding
    accelerator)."""
    paths = tuple(path for path, i, o in m.float8_candidates if i % FLOAT8_ALIGN == 0 and o % FLOAT8_ALIGN == 0)
    if not paths or recipe.sharded:
        return None
    shown = ", ".join(paths[:4]) + (", ..." if len(paths) > 4 else "")
    return Fix(
        f"Turn fp8 on: convert the {len(paths)} Linear layers of {m.name} with dims multiple of 16 to float8, "
        "in place (same weights, same optimizer)",
        "import dataclasses\nfrom torchao.float8 import convert_to_float8_training\n"
        f"config = dataclasses.replace({p.accelerator_name}.ao_recipe_handler.config, "
        "enable_fsdp_float8_all_gather=False)  # no FSDP: keep the optimizer's weight Parameters\n"
        f"convert_to_float8_training({m.name}, config=config, module_filter_fn=lambda mod, fqn: fqn in {set(paths)!r})",
        applicability=Applicability.UNSAFE,
        changes=(ConvertToFloat8(m.ref, paths, p.accelerator_ref, f"layers of {m.name}"),),
        recipe="float8-convert-live",
        cost=f"{shown} compute their matmuls in float8 (e4m3 forward, e5m2 grads) from the next step, first and last "
        "layer included",
    )


@check("fp8-requested-unsupported-device", Severity.ERROR, fix_safety=(Applicability.UNSAFE, Applicability.DISPLAY_ONLY))
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
        Unsafe, in place, while only the arguments exist (no Accelerator yet, no DeepSpeed config): the request
        becomes the half precision that GPU runs, in the arguments (``bf16=True``, ``fp16=False``,
        ``mixed_precision="bf16"``) and in the launcher's ``ACCELERATE_MIXED_PRECISION``, so the Trainer built
        from them trains in bf16; undo restores both exactly. On a GPU without bf16 (T4, V100) it is fp16
        (``fp16=True``): the Trainer's Accelerator then builds its fp16 GradScaler itself. Unsafe: the run no
        longer computes in fp8. Display only where an Accelerator already exists: its fp8 backend, recipe handler
        and prepared layers were chosen when it was built, and mpdoctor does not switch them (build it with
        ``mixed_precision="bf16"``); an L4 / RTX 4090 / H100, which mpdoctor cannot provide, keeps fp8.
    Sources
        NVIDIA/TransformerEngine #1159; kvcache-ai/ktransformers #934; huggingface/accelerate PR #1348
        (sm_89 as the fp8 floor).
    """
    hw = facts.hardware
    if hw.kind != "cuda" or hw.capability is None or tuple(hw.capability) >= FLOAT8_CAPABILITY:
        return
    if any(_live_float8(m) for m in facts.models):
        return  # float8-unsupported-device names the layers
    half = "bf16" if hw.bf16_native else "fp16"
    for p in _fp8_setups(facts):
        cap = f"sm_{hw.capability[0]}{hw.capability[1]}"
        yield rule.finding(
            p.name,
            f"{p.name} asks for fp8 but {hw.label} has no float8 GEMMs ({cap} < sm_89): the first fp8 step raises "
            f"('Device compute capability 8.9 or higher required for FP8 execution'). Train in {half} there.",
            {"device": hw.label, "accelerator.mixed_precision": p.accelerator_mixed_precision, ENV: p.env_mixed_precision},
            [
                *([_ask_for(facts, p, half)] if p.args_name is not None and p.accelerator_name is None
                  and not p.args.get("deepspeed") else []),  # fmt: skip
                Fix(
                    f"Train in {half} on this GPU",
                    f"# {hw.label} has no float8 GEMMs: a GPU mpdoctor cannot change. An Accelerator built for fp8 chose its "
                    "fp8 backend and layers when it was built: mpdoctor does not switch it; set the precision where the "
                    f"run starts\naccelerator = Accelerator(mixed_precision={half!r})  # or: accelerate launch "
                    f"--mixed_precision {half}",
                    applicability=Applicability.DISPLAY_ONLY,
                    recipe=f"fp8-to-{half}",
                ),
            ],
        )


def _ask_for(facts: Facts, p: PrecisionFacts, half: str) -> Fix:
    """The arguments (and the launcher's variable) asking for ``half`` instead of fp8, in place, before a Trainer or
    Accelerator exists."""
    flags = {"bf16": half == "bf16", "fp16": half == "fp16"}
    device = "cpu" if p.args.get("use_cpu") else (p.device or facts.hardware.kind)
    env = p.env_mixed_precision == "fp8"
    lines = ["import os"] if env else []
    if env:
        lines.append(f"os.environ[{ENV!r}] = {half!r}  # what `accelerate launch --mixed_precision {half}` sets")
    lines += [f"{p.args_name}.{k} = {v!r}" for k, v in flags.items()]
    lines += [f"{p.args_name}.mixed_precision = {half!r}", f"# then build the Trainer with {p.args_name}"]
    scaler = "; its Accelerator builds the fp16 GradScaler" if half == "fp16" else ""
    return Fix(
        f"Ask for {half} instead of fp8: the arguments{' and the launcher' if env else ''}, in place",
        "\n".join(lines),
        applicability=Applicability.UNSAFE,
        changes=(align_spec(facts, p, half, native_amp_for(half, device), flags), *((SetEnvVar(ENV, half),) if env else ())),
        recipe=f"fp8-to-{half}-in-place",
        cost=f"the Trainer built from these arguments trains in {half}, not fp8{scaler}",
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
            "# TransformerEngine builds the recipe where the Accelerator is made; mpdoctor does not rebuild it\n"
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
