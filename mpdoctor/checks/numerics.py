"""Checks on values: NaN/Inf in tensors, fp16 overflow risk, and what a one-batch probe saw."""

from __future__ import annotations

import math
from collections.abc import Iterator

from ..facts import Facts, ModelFacts
from ..findings import Finding
from . import check
from .hardware import FP16_OVERFLOW_MODEL_TYPES

#: Model types whose checkpoints were trained in bf16 and whose activations are known to pass 65504
#: in fp16; one list shared with the hardware checks (sources there).
BF16_NATIVE_MODEL_TYPES = FP16_OVERFLOW_MODEL_TYPES

_KIND_WORDS = {"param": "parameter", "grad": "gradient", "optimizer_state": "optimizer-state"}


def _fp16_reasons(facts: Facts, m: ModelFacts) -> list[str]:
    """Why ``m`` will compute in fp16: fp16 setups, an active fp16 autocast, fp16 weights."""
    reasons = []
    for p in facts.precisions:
        if p.model_names and m.name not in p.model_names:
            continue
        asks = (p.effective, p.requested, p.accelerator_mixed_precision, p.args.get("mixed_precision"))
        if "fp16" in asks:
            live = " (fp32 on this CPU, fp16 on a GPU)" if p.effective != "fp16" else ""
            reasons.append(f"{p.name} runs fp16 mixed precision{live}")
    if facts.runtime.autocast.get("cuda") == "float16" or facts.runtime.autocast.get("cpu") == "float16":
        reasons.append("torch.autocast(dtype=torch.float16) is active")
    counts = m.tensors.param_dtype_counts()
    total = sum(counts.values())
    if total and counts.get("float16", 0) * 2 >= total:
        reasons.append(f"{m.name}'s weights are stored in fp16")
    return reasons


def _bf16_native_types(m: ModelFacts) -> list[str]:
    return sorted({c.model_type for c in m.configs if c.model_type in BF16_NATIVE_MODEL_TYPES})


def _scans_of(facts: Facts, name: str) -> list:
    return [s for s in facts.scans if s.object == name]


@check("fp16-overflow-risk", "error")
def fp16_overflow_risk(facts: Facts) -> Iterator[Finding]:
    """A model known to pass 65504 (or holding values past it) run, or about to run, in fp16.

    What it detects
        Statically: a model of a bf16-native family (T5/mT5, Gemma 2/3,
        Qwen3-MoE, GPT-OSS, ...) set to compute in fp16: fp16 mixed precision
        in a Trainer, TrainingArguments or Accelerator (also when this CPU
        runs it as fp32: a GPU will not), an fp16 autocast, or fp16 weights.
        With a value scan (``scan=True``): parameters holding finite values
        past 65504 under such a setup (error), in half precision on a device
        without bf16 where fp16 is the only half precision (warning), or
        anywhere else (info: the model cannot be moved to fp16).
    Why it matters
        fp16's largest value is 65504. These checkpoints were trained in bf16,
        whose range is fp32's; in fp16 their activations overflow to inf and
        the loss turns NaN within a few steps (a GradScaler only skips steps
        and collapses its scale). A weight past 65504 becomes inf the moment
        autocast casts it.
    Severity
        Error when a scan shows values past fp16's range in a model that will run in fp16; warning for a
        model type known to overflow fp16 without a scan.
    Fix
        Use bf16 where the hardware has it (``bf16=True`` on Ampere or newer);
        on V100/T4, train in fp32 (Unsloth forces fp32 for several of these
        families), or keep the overflowing modules in fp32. No automatic fix:
        the choice changes memory and speed.
    Source
        transformers issue #5651 (T5DenseReluDense output 66246 > 65504), PR #10956, issue #14189;
        google-research/text-to-text-transfer-transformer #539 ("all of our experiments use bfloat16
        activations"); mpdoctor FIELD-CASES #2.
    """
    hw = facts.hardware
    for m in facts.models:
        families = _bf16_native_types(m)
        reasons = _fp16_reasons(facts, m)
        over = [
            t for s in _scans_of(facts, m.name) for t in s.tensors if t.kind == "param" and t.fp16_overflow > 0
        ]
        half = m.tensors.main_dtype in ("bfloat16", "float16")
        if reasons and (families or over):
            severity = "error"
        elif over and not hw.bf16_native and half:
            severity = "warning"  # bf16 weights on a device without bf16: fp16 is the only half precision left
        elif over:
            severity = "info"
        else:
            # A bf16 family on a device without bf16 but not in fp16: bf16-unsupported already says to use fp32.
            continue
        parts = []
        if families:
            parts.append(
                f"{m.name} is a {'/'.join(families)} model (config dtype {m.config_dtype or 'unknown'}), "
                "a family whose activations pass fp16's 65504"
            )
        if over:
            n = sum(t.fp16_overflow for t in over)
            worst = max(over, key=lambda t: t.absmax)
            parts.append(
                f"{n:,} parameter values in {len(over)} tensors are past 65504 (largest {worst.absmax:.4g} in {worst.name})"
            )
        if reasons:
            tail = f"but {'; '.join(reasons)}: expect inf activations and a NaN loss."
        elif severity == "warning":
            tail = f"and {hw.label} has no native bf16, so fp16 is the only half precision there: use fp32 on it."
        else:
            tail = "nothing here computes in fp16 now; it cannot be switched to fp16 without overflowing."
        yield Finding(
            "fp16-overflow-risk",
            severity,
            m.name,
            f"{'; '.join(parts)}, {tail}",
            {
                "model_types": families,
                "config_dtype": m.config_dtype,
                "fp16_reasons": reasons,
                "device_bf16_native": hw.bf16_native,
                "device": hw.label,
                "overflow_values": sum(t.fp16_overflow for t in over),
                "overflow_tensors": [t.name for t in over[:10]],
            },
        )


@check("nonfinite-values", "error")
def nonfinite_values(facts: Facts) -> Iterator[Finding]:
    """NaN or Inf values in parameters, gradients or optimizer state (from a value scan).

    What it detects
        With ``scan=True`` / ``%mpdoctor --scan``: any NaN or Inf in a
        parameter, a ``.grad`` or an optimizer-state tensor, counted exactly
        and reported per tensor kind with the first tensors affected.
    Why it matters
        A NaN weight makes every forward NaN; NaN in Adam's moments makes
        every later update NaN; non-finite gradients turn the next optimizer
        step into NaN weights unless a GradScaler skips it (then it is a warning:
        the scaler is doing its job, until its scale collapses).
    Severity
        Error: NaN or Inf already in weights, grads or optimizer state poisons every later step.
    Fix
        No automatic fix: reload the last good checkpoint; find the layer that
        overflows with ``mpdoctor.probe(model, batch)`` (``%mpdoctor --probe batch``),
        then move to bf16, lower the learning rate or clip gradients.
    Source
        transformers ``DebugUnderflowOverflow`` docs; torch.amp.GradScaler docs.
    """
    scaler_on = any(s.enabled for s in facts.scalers)
    for scan in facts.scans:
        by_kind: dict[str, list] = {}
        for t in scan.tensors:
            if t.nonfinite:
                by_kind.setdefault(t.kind, []).append(t)
        for kind, bad in by_kind.items():
            nan = sum(t.nan for t in bad)
            inf = sum(t.inf for t in bad)
            word = _KIND_WORDS.get(kind, kind)
            listed = ", ".join(f"{t.name} ({t.nan} NaN, {t.inf} Inf)" for t in bad[:3])
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            if kind == "grad":
                consequence = (
                    "the scaler will skip this step and halve its scale."
                    if scaler_on
                    else "without a GradScaler the next optimizer step writes NaN into the weights."
                )
            elif kind == "optimizer_state":
                consequence = "every later update of these parameters is NaN."
            else:
                consequence = "every forward through them produces NaN."
            yield Finding(
                "nonfinite-values",
                "warning" if kind == "grad" and scaler_on else "error",
                bad[0].name,
                f"{scan.object} holds {nan:,} NaN and {inf:,} Inf values in {len(bad)} {word} tensors: {listed}{more}; "
                f"{consequence}",
                {
                    "object": scan.object,
                    "kind": kind,
                    "nan": nan,
                    "inf": inf,
                    "tensors": [{"name": t.name, "module": t.module, "nan": t.nan, "inf": t.inf} for t in bad[:20]],
                },
            )


# -- probe findings -------------------------------------------------------------------------


def _where(p, path: str) -> str:
    return f"{p.model}.{path}" if path else p.model


def _fmt(v: float | None) -> str:
    if v is None:
        return "n/a"
    return "NaN" if math.isnan(v) else f"{v:.4g}"


def _precision(p) -> str:
    ac = f"autocast {p.autocast} ({p.autocast_source})" if p.autocast else "no autocast"
    scale = f", loss scale {p.loss_scale:g}" if p.loss_scale != 1.0 else ""
    return f"{ac}{scale}"


@check("probe-nonfinite", "error")
def probe_nonfinite(facts: Facts) -> Iterator[Finding]:
    """The first module whose output or output gradient went NaN/Inf in a one-batch probe.

    What it detects
        ``mpdoctor.probe(model, batch)`` runs one forward and one backward
        with hooks on every module; this names the first module, in execution
        order, whose output went non-finite (forward), else the first whose
        output gradient did (backward), with whether its inputs and its own
        weights were finite.
    Why it matters
        A NaN loss tells nothing about where it started; the first module to
        produce NaN/Inf from finite inputs is where to look (a weight that is
        already inf, an fp16 activation past 65504, a softmax over -inf). In
        backward under a GradScaler, an overflow at the current scale makes the
        scaler skip the step (a warning); repeated, it collapses the scale.
    Severity
        Error: the probe's batch produced NaN/Inf; the finding names the first module.
    Fix
        Depends on the module: reload weights that hold inf/NaN; keep the
        module in fp32 or switch to bf16 for activation overflow; lower the
        learning rate when gradients blow up.
    Source
        transformers ``DebugUnderflowOverflow`` (forward only); mpdoctor FIELD-CASES.
    """
    for p in facts.probes:
        hit = p.first_nonfinite()
        if hit is None:
            continue
        m, phase = hit
        where = _where(p, m.path)
        if phase == "forward":
            if m.param_nonfinite:
                cause = f"its own weights hold {m.param_nonfinite:,} NaN/Inf values"
            elif m.in_nonfinite:
                cause = "its inputs were already non-finite: the values went bad in code between modules"
            else:
                cause = f"its inputs were finite (abs max {_fmt(m.in_absmax)})"
            msg = (
                f"{where} ({m.class_name}) is the first module whose output went non-finite "
                f"({m.out_nonfinite:,} NaN/Inf values) under {_precision(p)}; {cause}."
            )
            severity = "error"
        else:
            msg = (
                f"The gradient at the output of {where} ({m.class_name}) is the first to go non-finite in backward "
                f"({m.grad_nonfinite:,} NaN/Inf values) under {_precision(p)}"
            )
            if p.loss_scale > 1.0:
                msg += ": the GradScaler will skip this step and halve its scale; if it keeps happening the scale collapses."
                severity = "warning"
            else:
                msg += "; the next optimizer step would write NaN into the weights."
                severity = "error"
        yield Finding(
            "probe-nonfinite",
            severity,
            where,
            msg,
            {
                "module": m.path,
                "class": m.class_name,
                "phase": phase,
                "output_nonfinite": m.out_nonfinite,
                "grad_nonfinite": m.grad_nonfinite,
                "input_nonfinite": m.in_nonfinite,
                "weight_nonfinite": m.param_nonfinite,
                "input_dtypes": list(m.input_dtypes),
                "output_dtypes": list(m.output_dtypes),
                "autocast": p.autocast,
                "loss_scale": p.loss_scale,
                "loss": p.loss,
            },
        )


@check("probe-overflow", "warning")
def probe_overflow(facts: Facts) -> Iterator[Finding]:
    """The first module whose finite output or gradient passed fp16's 65504 in a one-batch probe.

    What it detects
        The first module, in execution order, whose output (forward) or
        output gradient (backward) held finite values larger than 65504,
        fp16's largest number, while the probe ran in a wider dtype. A warning
        when the run computes in fp16 elsewhere (fp16 autocast or weights),
        info otherwise.
    Why it matters
        Those values survive only because this op ran in bf16/fp32. In fp16,
        or on a T4/V100 where fp16 is the only half precision, they become inf
        and the loss NaN: the classic T5 / Gemma fp16 failure.
    Severity
        Warning: activations or gradients pass fp16's range, so an fp16 run overflows there.
    Fix
        Keep bf16 (or fp32) for this model; where fp16 is unavoidable, keep
        this module in fp32 (``_keep_in_fp32_modules``) or rescale it.
    Source
        transformers T5 fp16 overflow discussions; ``DebugUnderflowOverflow`` docs.
    """
    for p in facts.probes:
        if p.first_nonfinite() is not None and p.first_nonfinite()[1] == "forward":
            continue  # the non-finite finding already names where it broke
        hit = p.first_overflow()
        if hit is None:
            continue
        m, phase = hit
        where = _where(p, m.path)
        value = m.out_absmax if phase == "forward" else m.grad_absmax
        what = "output" if phase == "forward" else "output gradient"
        scaled = " (scaled by the loss scale)" if phase == "backward" and p.loss_scale != 1.0 else ""
        yield Finding(
            "probe-overflow",
            "warning" if p.fp16_in_use else "info",
            where,
            f"{where} ({m.class_name}) is the first module whose {what}{scaled} passed fp16's 65504 "
            f"(abs max {_fmt(value)}, in {','.join(m.output_dtypes if phase == 'forward' else m.grad_dtypes)}) "
            f"under {_precision(p)}; in fp16 it would be inf.",
            {"module": m.path, "class": m.class_name, "phase": phase, "absmax": value, "fp16_headroom": m.fp16_headroom},
        )


@check("probe-dtype-error", "error")
def probe_dtype_error(facts: Facts) -> Iterator[Finding]:
    """A dtype mismatch raised during the probe, attributed to the module that was running.

    What it detects
        An exception such as ``mat1 and mat2 must have the same dtype, but got
        Float and BFloat16`` or ``expected ... BFloat16 but got Float`` raised
        during the probe's forward or backward, with the module running at that
        moment (the innermost module entered and not yet finished; in backward,
        the module the gradient last reached) and its input and weight dtypes.
    Why it matters
        The traceback points into torch internals or a fused kernel; the
        module and its dtypes say which weight or activation is in the wrong
        dtype (fp32 LoRA adapters on bf16 activations, a layer left in fp32
        outside autocast).
    Severity
        Error: the probe's forward or backward raised a dtype error; the finding names the module.
    Fix
        Cast the module's weights to the activation dtype, or run the forward
        under ``torch.autocast`` so mixed dtypes are legal.
    Source
        mpdoctor FIELD-CASES #5 (Unsloth #1260, #212).
    """
    for p in facts.probes:
        e = p.error
        if e is None or not e.is_dtype_error:
            continue
        where = _where(p, e.module) if e.module is not None else p.model
        held = ""
        if e.module is not None:
            held = f" (inputs {','.join(e.input_dtypes) or 'n/a'}, weights {','.join(e.param_dtypes) or 'none'})"
        yield Finding(
            "probe-dtype-error",
            "error",
            where,
            f"{e.phase.capitalize()} raised in {where}{' (' + e.class_name + ')' if e.class_name else ''}{held} "
            f"under {_precision(p)}: {e.exception}: {e.message}",
            {
                "module": e.module,
                "class": e.class_name,
                "phase": e.phase,
                "exception": e.exception,
                "message": e.message,
                "input_dtypes": list(e.input_dtypes),
                "param_dtypes": list(e.param_dtypes),
            },
        )


@check("probe-failed", "error")
def probe_failed(facts: Facts) -> Iterator[Finding]:
    """Any other exception raised by the model during the probe, attributed to the module running.

    What it detects
        An exception that is not a dtype mismatch (a shape error, a bad batch,
        an out-of-memory) raised during the probe's forward, loss or backward.
    Why it matters
        Training would fail the same way on its first step; the module name
        is more telling than a long traceback.
    Severity
        Error: the probe could not run the batch (the exception is shown).
    Fix
        Read the message and the module; check the batch matches ``forward``'s
        signature (``probe`` passes a dict as keyword arguments, a tuple as
        positional arguments).
    Source
        mpdoctor.
    """
    for p in facts.probes:
        e = p.error
        if e is None or e.is_dtype_error:
            continue
        where = _where(p, e.module) if e.module is not None else p.model
        yield Finding(
            "probe-failed",
            "error",
            where,
            f"The probe's {e.phase} raised in {where}: {e.exception}: {e.message}",
            {"module": e.module, "class": e.class_name, "phase": e.phase, "exception": e.exception, "message": e.message},
        )
