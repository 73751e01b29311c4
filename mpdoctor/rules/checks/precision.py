"""Checks on the precision a run computes in: what the arguments ask versus what accelerate will do; TF32.

The fixes here edit accelerate's live objects. Every attribute involved, read from accelerate 1.x
(``Accelerator.__init__``, ``prepare_model``, ``backward``, ``unscale_gradients``,
``AcceleratedOptimizer``):

- ``AcceleratorState._mixed_precision``: a process-wide singleton (``state.__dict__`` is the class's shared
  dict), so every Accelerator in the kernel sees the change;
- ``accelerator.native_amp``: whether ``prepare_model`` wraps ``forward`` in autocast, and whether
  ``unscale_gradients`` unscales;
- ``accelerator.scaler`` and each ``AcceleratedOptimizer.scaler`` (the same object, so it is mutated, not
  rebound; when none exists a new one is given to both, with the step-patching attributes
  ``AcceleratedOptimizer.__init__`` sets);
- ``model.forward`` / ``model._original_forward`` of models already prepared (``prepare_model`` returns
  early for ``_is_accelerate_prepared`` models, so a later ``train()`` never rewraps them);
- ``accelerator.autocast_handler`` (its kwargs are passed to the autocast a rewrap builds);
- ``TrainingArguments.mixed_precision`` / ``fp16`` / ``bf16`` and ``ACCELERATE_MIXED_PRECISION``.
"""

from __future__ import annotations

from collections.abc import Iterator

from ...facts import Facts, ModelFacts
from ...facts.precision import PrecisionFacts, computes_in, declared_precision, native_amp_for, setup_device
from ..engine.changes import AlignPrecision, SetMatmulPrecision
from ..engine.findings import Finding, Severity
from ..engine.fixes import Fix
from ..engine.rules import Applicability, Rule
from . import check

ENV_VAR = "ACCELERATE_MIXED_PRECISION"
_HALF_DTYPE = {"fp16": "float16", "bf16": "bfloat16"}

__all__ = ["alignment_fix", "computes_in", "declared_precision", "native_amp_for", "setup_device"]


def _device(facts: Facts, p: PrecisionFacts) -> str:
    """The device type the setup's objects live on (the what-if target never moves them)."""
    if p.args.get("use_cpu"):
        return "cpu"
    return p.device or ("cuda" if facts.hardware.live and facts.hardware.kind == "cuda" else "cpu")


def align_spec(facts: Facts, p: PrecisionFacts, precision: str, native: bool, flags: dict | None = None) -> AlignPrecision:
    """The change bringing setup ``p`` to ``precision`` (autocasting iff ``native``), as data."""
    models = tuple((m.name, m.ref) for m in facts.models if m.name in p.model_names)
    return AlignPrecision(
        setup=p.name,
        precision=precision,
        native=native,
        flags=tuple(sorted((flags or {}).items())),
        args=p.args_ref,
        accelerator=p.accelerator_ref,
        args_name=p.args_name,
        accelerator_name=p.accelerator_name,
        models=models,
    )


def alignment_code(facts: Facts, p: PrecisionFacts, precision: str, native: bool, flags: dict | None = None, why: str = "") -> str:
    """Pasteable Python making the same changes the accelerate integration will make."""
    lines = ["import os", "import torch"] + ([f"# {why}"] if why else [])
    if p.env_mixed_precision not in (None, precision):
        lines.append(f"os.environ.pop({ENV_VAR!r}, None)  # stale: left by an earlier TrainingArguments or a launcher")
    lines += _arguments_lines(p, precision, flags)
    if p.accelerator_name is not None:
        lines += _accelerator_lines(facts, p, precision, native)
        for m in facts.models:
            if m.name in p.model_names:
                lines += _forward_lines(facts, p, m, precision, native)
    return "\n".join(lines)


def _arguments_lines(p: PrecisionFacts, precision: str, flags: dict | None) -> list[str]:
    """The lines setting the arguments' flags and ``mixed_precision``."""
    if p.args_name is None:
        return []
    lines = [f"{p.args_name}.{key} = {value!r}" for key, value in (flags or {}).items() if p.args.get(key) != value]
    if p.args.get("mixed_precision") != precision:
        lines.append(f"{p.args_name}.mixed_precision = {precision!r}")
    return lines


def _accelerator_lines(facts: Facts, p: PrecisionFacts, precision: str, native: bool) -> list[str]:
    """The lines bringing the accelerator's state, autocast flag and shared scaler to ``precision``."""
    name = p.accelerator_name
    lines = []
    if p.accelerator_mixed_precision != precision:
        lines.append(f"{name}.state._mixed_precision = {precision!r}  # AcceleratorState is one per process")
    if bool(p.native_amp) != native:
        lines.append(f"{name}.native_amp = {native!r}")
    want = native and precision == "fp16"
    if p.scaler_enabled and not want:
        lines.append(f"{name}.scaler._enabled = False  # the optimizer shares this scaler")
    elif want and not p.scaler_enabled:
        lines.append(f"{name}.scaler = torch.amp.GradScaler({_device(facts, p)!r})")
        lines.append(f"for opt in {name}._optimizers:  # already prepared: give them the scaler too")
        lines.append(f"    opt.__setstate__({{'scaler': {name}.scaler}})  # sets the step-patching attributes")
    return lines


def _forward_lines(facts: Facts, p: PrecisionFacts, m: ModelFacts, precision: str, native: bool) -> list[str]:
    """The lines unwrapping a prepared model's autocast forward, or wrapping it in the new precision."""
    lines = []
    wrapped = m.forward_wrapped
    if wrapped and (not native or p.accelerator_mixed_precision != precision):
        lines.append(f"{m.name}.forward = {m.name}._original_forward; del {m.name}._original_forward")
        wrapped = False
    if native and not wrapped and (m.accelerate_prepared or m.forward_wrapped):
        dtype = f"torch.{_HALF_DTYPE[precision]}"
        lines += [
            "from types import MethodType",
            "from accelerate.utils import convert_outputs_to_fp32",
            f"{m.name}._original_forward = {m.name}.forward  # prepared already: accelerate will not wrap it again",
            f"{m.name}.forward = MethodType(convert_outputs_to_fp32(torch.autocast({_device(facts, p)!r}, "
            f"dtype={dtype})({m.name}.forward.__func__)), {m.name})",
        ]
    return lines


def alignment_fix(
    facts: Facts,
    p: PrecisionFacts,
    title: str,
    precision: str,
    native: bool,
    flags: dict | None = None,
    why: str = "",
    safe: bool = False,
    recipe: str = "",
    cost: str = "",
) -> Fix:
    """A fix bringing setup ``p`` to ``precision`` (``native`` autocast)."""
    return Fix(
        title,
        alignment_code(facts, p, precision, native, flags, why), applicability=Applicability.SAFE if safe else Applicability.UNSAFE,
        changes=(align_spec(facts, p, precision, native, flags),),
        recipe=recipe or f"run-{precision}",
        cost=cost,
    )


# -- checks -------------------------------------------------------------------------------------------------


@check("precision-override", Severity.ERROR, Severity.WARNING, fix_safety=(Applicability.SAFE, Applicability.UNSAFE))
def precision_override(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """The precision a run computes in is not the precision its arguments ask for.

    What it does
        A Trainer (or ``TrainingArguments``) whose explicit ``fp16`` / ``bf16`` flags disagree with what
        accelerate will run: (a) a stale ``ACCELERATE_MIXED_PRECISION`` (left by an earlier
        ``TrainingArguments`` in the kernel, or a launcher) that turned ``fp16=False`` into
        ``accelerator.mixed_precision == "fp16"`` (or ``"bf16"``); (b) ``fp16=True`` on a CPU, where
        accelerate keeps ``native_amp=False`` and never autocasts, so the run is silently fp32. Error
        when the computed precision differs from the request; warning when only the labels differ
        (fp16 declared on a CPU computes fp32 as asked, but the stale variable will switch every later
        Trainer in the kernel to fp16 on a GPU). Setups with a DeepSpeed config are skipped.
    Why is this bad?
        ms-swift users passing ``--fp16 false`` still trained under fp16 autocast on V100s and got NaN;
        a CPU run asked for fp16 silently trains and measures fp32.
    Example
        os.environ["ACCELERATE_MIXED_PRECISION"] = "fp16"  # left from an earlier run
        trainer = Trainer(model, TrainingArguments(output_dir="out", bf16=True), train_dataset=ds)
    Use instead
        os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
        trainer = Trainer(model, TrainingArguments(output_dir="out", bf16=True), train_dataset=ds)
    Severity
        Error when the run computes in another precision than asked; warning when only the labels differ
        (a stale variable that will bite a later run).
    Fix safety
        Bring the accelerator (``AcceleratorState._mixed_precision``, ``native_amp``, the shared scaler, the
        autocast wrapper of already prepared models), ``args.mixed_precision`` and the environment
        variable in line with the arguments, in place, so the next ``trainer.train()`` step computes in
        the requested precision; the stale variable is removed rather than rewritten (absent means "no" to
        both transformers and accelerate). For (b) two fixes, since torch 2.13 can autocast fp16 on a CPU
        (accelerate chooses not to): enable it as asked, with a CPU GradScaler shared by the accelerator and
        its optimizer; or make the arguments say what runs (``fp16=False``). CPUs without fp16 matmul units
        pay for the first (measured here, one thread, a 256x1024 by 1024x1024 Linear: fp32 6.6 ms, fp16
        autocast 50 ms, bf16 autocast 1.8 ms), so the message points to bf16 as the CPU's half precision.
        All unsafe: each changes the numerics of the next step or a choice the user wrote, and the
        accelerator state is process-wide.
    Sources
        ms-swift issue #3896 / PR #3909; transformers ``TrainingArguments.__post_init__`` (reads
        ``ACCELERATE_MIXED_PRECISION``); accelerate ``Accelerator.__init__`` (fp16 on CPU: no native AMP).
    """
    hw = facts.hardware
    for p in facts.precisions:
        if p.requested is None or p.args.get("deepspeed"):
            continue
        declared = declared_precision(p)
        if declared is None:
            continue
        computes = p.computes_in
        if declared == p.requested and computes == p.requested:
            continue
        if declared == "fp8" and p.requested == "no" and p.env_mixed_precision == "fp8":
            continue  # fp8 is asked through the launcher (TrainingArguments has no fp8 flag): bf16=False keeps it
        severity = Severity.ERROR if computes != p.requested else Severity.WARNING
        evidence = {
            "requested": p.requested,
            "args.mixed_precision": p.args.get("mixed_precision"),
            ENV_VAR: p.env_mixed_precision,
            "accelerator.mixed_precision": p.accelerator_mixed_precision,
            "native_amp": p.native_amp,
            "computes_in": computes,
            "device": setup_device(p, hw),
        }
        if declared != p.requested:
            msg, fixes = _stale_setting(facts, p, declared, severity)
        else:
            msg, fixes = _half_not_autocast(facts, p)
        yield rule.finding(p.name, msg, evidence, fixes, severity=severity)


def _stale_setting(facts: Facts, p: PrecisionFacts, declared: str, severity: Severity) -> tuple[str, list[Fix]]:
    """Message and fix when a stale setting (the environment, the accelerator) overrides the arguments."""
    hw = facts.hardware
    computes = p.computes_in
    cause = (
        f"{ENV_VAR}={p.env_mixed_precision} in the environment"
        if p.env_mixed_precision == declared
        else f"{'the accelerator' if p.accelerator_name else 'args.mixed_precision'} says {declared}"
    )
    msg = (
        f"{p.name} asks for {_label(p.requested)} but {cause}"
        + (
            f", so the next step computes in {_label(computes)}."
            if severity == Severity.ERROR
            else f"; on this {setup_device(p, hw)} that still computes in {_label(computes)}, but the stale "
            "setting will run any later Trainer in this kernel in "
            f"{declared} on a GPU."
        )
    )
    native = native_amp_for(p.requested, _device(facts, p))
    fix = alignment_fix(
        facts,
        p,
        f"Make {p.name} run in {_label(p.requested)} as its arguments ask",
        p.requested,
        native,
        why=f"{p.name}: run in {_label(p.requested)} as asked",
        recipe="as-asked",
    )
    return msg, [fix]


def _half_not_autocast(facts: Facts, p: PrecisionFacts) -> tuple[str, list[Fix]]:
    """Message and fixes when accelerate does not autocast the half precision asked for on this device."""
    hw = facts.hardware
    device = _device(facts, p)
    msg = (
        f"{p.name} asks for {p.requested} but accelerate does not autocast {p.requested} on the "
        f"{setup_device(p, hw)} (native_amp=False): the run is silently {_label(p.computes_in)}."
        + (" On a CPU, bf16=True is the fast half precision." if setup_device(p, hw) == "cpu" else "")
    )
    fixes = []
    flags = {"fp16": p.requested == "fp16", "bf16": p.requested == "bf16"}
    if p.accelerator_name is not None and p.requested in _HALF_DTYPE:
        fixes.append(
            alignment_fix(
                facts,
                p,
                f"Enable {p.requested} autocast on the {device} as {p.name} asks"
                + (" (with a GradScaler; fp16 matmuls are slow on most CPUs)" if p.requested == "fp16" else ""),
                p.requested,
                True,
                flags,
                why=f"torch can autocast {p.requested} on the {device}",
                recipe="enable-autocast",
                cost="matches what the arguments ask"
                + ("; on most CPUs fp16 matmuls are several times slower than fp32" if device == "cpu" and p.requested == "fp16" else ""),
            )
        )
    honest = {"fp16": False, "bf16": False}
    fixes.append(
        alignment_fix(
            facts,
            p,
            f"Make {p.name} say what runs: fp32 (use bf16=True for half precision on the CPU)",
            "no",
            False,
            honest,
            why="accelerate runs fp16 on the CPU as fp32",
            recipe="say-fp32",
            cost="no change to the numbers this run computes",
        )
    )
    return msg, fixes


def _label(precision: str) -> str:
    return "fp32" if precision == "no" else precision


def _half_setup_models(facts: Facts) -> set[str]:
    """Models a setup will run under fp16/bf16 autocast."""
    out: set[str] = set()
    for p in facts.precisions:
        if p.computes_in in ("fp16", "bf16", "fp8"):
            out.update(p.model_names)
    return out


@check("tf32-off", Severity.INFO, fix_safety=(Applicability.UNSAFE,))
def tf32_off(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """fp32 matmuls on a GPU with TF32 tensor cores, with TF32 switched off.

    What it does
        On the live device or the ``target=`` profile with TF32 (Ampere and later): a model whose weights
        are mostly fp32 and that no setup runs under fp16/bf16 autocast, while
        ``torch.backends.cuda.matmul.allow_tf32`` is False and ``torch.get_float32_matmul_precision()`` is
        ``"highest"`` (PyTorch's default).
    Why is this bad?
        fp32 matmuls then run on CUDA cores at a fraction of the tensor-core throughput (A100: 19.5 vs 156
        TFLOPS). TF32 keeps fp32's range with a 10-bit mantissa, which is ample for training.
    Example
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 matmuls on an A100
    Use instead
        torch.set_float32_matmul_precision("high")  # TF32 tensor cores
    Severity
        Info: a speed opportunity on Ampere and later, never a fault.
    Fix safety
        ``torch.set_float32_matmul_precision("high")`` (also sets ``allow_tf32``), process-wide and
        reversible. Unsafe: it changes matmul numerics slightly (outputs differ in the fourth significant
        digit), so it is applied only on request.
    Sources
        PyTorch docs "TensorFloat-32 (TF32) on Ampere (and later) devices"; ``torch.set_float32_matmul_precision``.
    """
    hw, rt = facts.hardware, facts.runtime
    if not hw.tf32 or rt.matmul_tf32 or rt.float32_matmul_precision != "highest" or rt.autocast.get("cuda"):
        return
    covered = _half_setup_models(facts)
    fp32 = [m.name for m in facts.models if m.tensors.main_dtype == "float32" and m.name not in covered]
    if not fp32:
        return

    fix = Fix(
        "Allow TF32 matmuls: torch.set_float32_matmul_precision('high')",
        "import torch\ntorch.set_float32_matmul_precision('high')  # TF32 tensor cores for fp32 matmuls", applicability=Applicability.UNSAFE,
        changes=(SetMatmulPrecision("high"),),
        recipe="tf32",
        cost="several times faster fp32 matmuls; outputs differ in the fourth significant digit",
    )
    yield rule.finding(
        "torch.backends.cuda.matmul.allow_tf32",
        f"{', '.join(fp32)} {'runs' if len(fp32) == 1 else 'run'} fp32 matmuls on {hw.label} with TF32 off: "
        "tensor cores sit idle; TF32 is several times faster with fp32's range.",
        {
            "allow_tf32": rt.matmul_tf32,
            "float32_matmul_precision": rt.float32_matmul_precision,
            "fp32_models": fp32,
            "device": hw.label,
        },
        [fix],
    )
