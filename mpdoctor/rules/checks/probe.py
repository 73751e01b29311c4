"""Checks on what a one-batch probe saw: the first module whose output or gradient went NaN/Inf or past
fp16's range, dtype errors and other exceptions raised in the forward or backward, and a batch entry in
the wrong dtype."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from ...facts import Facts, ModelFacts
from ..engine.changes import CastParamsTo, KeepModuleFp32
from ..engine.findings import Finding, Severity
from ..engine.fixes import Fix
from ..engine.lowbit_changes import FloorActivationScales
from ..engine.rules import Applicability, Rule
from . import check
from .inference import mask_clamp_fix
from .values import eps_fixes

#: fp16's largest finite value.
FP16_MAX = 65504.0


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


# -- why a probed module went wrong, and what to do about it ------------------------------------------------

#: Why a module's output or gradient went bad, by cause (the ``cause`` of a probe finding's evidence).
PROBE_CAUSES = {
    "weights-nonfinite": "its own weights already hold NaN/Inf: an earlier optimizer step wrote them",
    "input-nonfinite": (
        "its inputs were already non-finite: the values went bad in code between modules, or an additive "
        "mask holds -inf (float32's finfo.min becomes -inf when cast to fp16)"
    ),
    "activation-overflow-fp16": "its finite inputs produced an activation past fp16's largest value, 65504",
    "nonfinite-from-finite": "it produced NaN/Inf from finite inputs and weights (log/div of 0, softmax over -inf)",
    "activation-scale-zero": (
        "its weight quantizes its input dynamically to float8 with no lower bound on the scale: an all-zero row "
        "(padding, a masked token) gets scale amax / 448 = 0 and quantizes to 0 / 0 = NaN"
    ),
    "gradient-overflow-scaled": "the gradient, multiplied by the loss scale, passed fp16's 65504 on its way back",
    "gradient-overflow-fp16": "the gradient passed fp16's 65504 on its way back, with no loss scaling to adjust",
    "gradient-nonfinite": "the gradient went non-finite on its way back (an exploding gradient)",
}


def _model_of(facts: Facts, p) -> ModelFacts | None:
    return next((m for m in facts.models if m.name == p.model), None)


def _unfloored(facts: Facts, p) -> list:
    """The quantized weights of the probed model whose dynamic activation scales have no lower bound."""
    model = _model_of(facts, p)
    if model is None:
        return []
    return [q for q in model.quantized_weights if q.dynamic_activation and q.activation_floor is None]


def _nonfinite_cause(p, m, phase: str, facts: Facts | None = None) -> str:
    if phase == "forward":
        if m.param_nonfinite:
            return "weights-nonfinite"
        if m.in_nonfinite:
            return "input-nonfinite"
        if facts is not None and any(q.path == m.path for q in _unfloored(facts, p)):
            return "activation-scale-zero"
        dtypes = set(m.output_dtypes)
        if (p.fp16_in_use or "float16" in dtypes) and "float16" in dtypes:
            return "activation-overflow-fp16"
        return "nonfinite-from-finite"
    if p.loss_scale > 1.0 and "float16" in (set(m.grad_dtypes) | {p.autocast or ""}):
        return "gradient-overflow-scaled"
    if "float16" in set(m.grad_dtypes):
        return "gradient-overflow-fp16"
    return "gradient-nonfinite"


def _device(facts: Facts, p) -> str:
    return p.device if p.device in ("cuda", "cpu", "xpu", "mps") else "cuda"


def _bf16_fixes(facts: Facts, p, where: str) -> list[Fix]:
    """Compute in bf16: a cast of the model's fp16 weights in place when it holds them, else the autocast to use."""
    hw = facts.hardware
    if not hw.bf16_native:
        return []
    fixes = []
    model = _model_of(facts, p)
    half = [q for q in model.tensors.params if q.dtype == "float16"] if model is not None else []
    if model is not None and half:
        ids = frozenset(q.id for q in half)
        holders = facts.optimizer_refs(ids)
        fixes.append(
            Fix(
                f"Compute {p.model} in bf16: cast its {len(half)} fp16 parameters to bf16 (fp32's range, no overflow)",
                f"{p.model}.to(torch.bfloat16)  # bf16 has fp32's exponent range: 65504 is no limit there\n"
                "# optimizer state follows the cast; no GradScaler is needed in bf16",
                changes=(CastParamsTo(model.inner_ref, ids, "bfloat16", holders, f"fp16 parameters of {p.model}"),),
                recipe="bf16",
                cost="same memory; 3 fewer mantissa bits than fp16",
            )
        )
    else:
        dev = _device(facts, p)
        fixes.append(
            Fix(
                f"Autocast to bf16 instead of fp16 ({hw.label} has native bf16)",
                f"with torch.autocast({dev!r}, dtype=torch.bfloat16):  # or TrainingArguments(bf16=True), "
                "Accelerator(mixed_precision='bf16')\n"
                f"    loss = {p.model}(**batch).loss\n# bf16 needs no GradScaler",
                applicability=Applicability.DISPLAY_ONLY,
                recipe="bf16",
                cost="same speed on bf16 hardware; 3 fewer mantissa bits than fp16",
            )
        )
    return fixes


def _fp32_module_fix(facts: Facts, p, path: str, class_name: str) -> Fix:
    """Keep one module in fp32 with autocast off inside it, as ``_keep_in_fp32_modules`` does for whole classes; where
    the probe measured the overflow's fp32 span (an fp16 model without autocast), every module of that span."""
    dev = _device(facts, p)
    span = tuple(getattr(p, "fp32_span", ()) or ())
    if span and span != ((path, ""),):
        return _fp32_span_fix(facts, p, path, class_name, span, dev)
    return Fix(
        f"Keep {_where(p, path)} ({class_name}) in fp32 with autocast off inside it",
        "import torch\n"
        f"module = {p.model}.get_submodule({path!r})\n"
        "module.float()\n"
        "_forward = module.forward\n"
        "def forward_fp32(*args, **kwargs):\n"
        f"    with torch.autocast({dev!r}, enabled=False):  # fp32 inside: 65504 is no limit here\n"
        "        args = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]\n"
        "        return _forward(*args, **kwargs)\n"
        "module.forward = forward_fp32  # the modules after it must run under autocast (they get fp32 inputs)",
        changes=_keep_fp32_changes(facts, p, path, dev),
        applicability=Applicability.UNSAFE,
        recipe="fp32-module",
        cost="this module's weights and activations at fp32 size and speed",
    )


def _fp32_span_fix(facts: Facts, p, path: str, class_name: str, span: tuple, dev: str) -> Fix:
    """Keep the modules an fp16 overflow passes through in fp32 (the probe measured them in fp32 and re-ran the
    forward finite with them kept): the overflowing module's block, the blocks whose residual stream carries the
    value past 65504, and the module where it is back in range, whose output is cast back to the compute dtype."""
    names = [_where(p, q) if q else p.model for q, _ in span]
    shown = ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]
    lines = ["import torch", "", "def keep_fp32(module, cast_to=None):", "    module.float()",
             "    forward = module.forward", "",
             "    def forward_fp32(*args, **kwargs):",
             f"        with torch.autocast({dev!r}, enabled=False):  # fp32 inside: 65504 is no limit here",
             "            args = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]",
             "            kwargs = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v "
             "for k, v in kwargs.items()}",
             "            out = forward(*args, **kwargs)",
             "        return out.to(cast_to) if cast_to is not None and torch.is_tensor(out) else out", "",
             "    module.forward = forward_fp32", ""]  # fmt: skip
    for q, cast_to in span:
        target = f"{p.model}.get_submodule({q!r})" if q else p.model
        lines.append(f"keep_fp32({target}" + (f", torch.{cast_to})  # back in range: cast back" if cast_to else ")"))
    changes = tuple(c for q, cast_to in span for c in _keep_fp32_changes(facts, p, q, dev, cast_to, span_checked=True))
    return Fix(
        f"Keep the path of the overflow in {_where(p, path)} ({class_name}) in fp32: {shown} (measured: the value "
        "passes 65504 there in fp32, and the forward is finite with them kept)",
        "\n".join(lines),
        changes=changes if len(changes) == len(span) else (),
        applicability=Applicability.UNSAFE,
        recipe="fp32-span",
        cost=f"{len(span)} module{'s' if len(span) != 1 else ''}' weights and activations at fp32 size and speed",
    )


def _keep_fp32_changes(facts: Facts, p, path: str, device: str, cast_to: str = "", span_checked: bool = False) -> tuple:
    """The in-place change of :func:`_fp32_module_fix`, when the probed model is among the facts (by its ref)."""
    ref = getattr(p, "model_ref", 0)
    model = next((m for m in facts.models if m.ref == ref), None) if ref else None
    if model is None:
        return ()
    ids = frozenset(x.id for x in model.tensors.params
                    if not path or x.module == path or x.module.startswith(path + "."))  # fmt: skip
    label = f"{p.model}.{path}" if path else p.model
    return (KeepModuleFp32(ref, path, ids, device, facts.optimizer_refs(ids), label, cast_to=cast_to,
                           span_checked=span_checked),)  # fmt: skip


def _floor_fix(facts: Facts, p) -> Fix:
    """A lower bound on every unbounded dynamic activation scale of the probed model, set in place."""
    model = _model_of(facts, p)
    paths = tuple(q.path for q in _unfloored(facts, p))
    shown = ", ".join(_where(p, path) for path in paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    return Fix(
        f"Bound the float8 activation scales of {len(paths)} quantized layer{'s' if len(paths) != 1 else ''} of "
        f"{p.model} below (1e-12): an all-zero row then stays 0 ({shown})",
        "import dataclasses\n"
        f"for module in {p.model}.modules():\n"
        "    w = getattr(module, 'weight', None)\n"
        "    if getattr(w, 'act_quant_kwargs', None) is not None and w.act_quant_kwargs.hp_value_lb is None:\n"
        "        w.act_quant_kwargs = dataclasses.replace(w.act_quant_kwargs, hp_value_lb=1e-12)\n"
        "# when quantizing again: Float8DynamicActivationFloat8WeightConfig(..., activation_value_lb=1e-12)",
        changes=(FloorActivationScales(model.ref, paths, 1e-12, p.model),) if model is not None and paths else (),
        applicability=Applicability.SAFE,
        recipe="activation-scale-floor",
        cost="none: only rows whose largest value is below 1e-12 quantize differently (to 0, not NaN)",
    )


def _probe_fixes(facts: Facts, p, m, cause: str) -> list[Fix]:
    if cause == "activation-scale-zero":
        return [_floor_fix(facts, p)]
    if cause in ("activation-overflow-fp16", "gradient-overflow-fp16"):
        if not _half_in_use(p, m):  # fp32 itself overflowed: bf16 or an fp32 module changes nothing
            return [_fp32_overflow_fix(p, m)]
        return [*_bf16_fixes(facts, p, _where(p, m.path)), _fp32_module_fix(facts, p, m.path, m.class_name)]
    if cause == "gradient-overflow-scaled":
        return [
            Fix(
                "Start the GradScaler lower (it also halves itself on every skipped step)",
                "scaler = torch.amp.GradScaler(init_scale=2.0**10)  # default 2**16; it grows back when safe",
                applicability=Applicability.DISPLAY_ONLY,
                recipe="lower-loss-scale",
            ),
            *_bf16_fixes(facts, p, _where(p, m.path)),
        ]
    if cause == "weights-nonfinite":
        return [
            Fix(
                "Reload the last good checkpoint, then find what wrote NaN (fp16 eps, learning rate)",
                f"{p.model}.load_state_dict(torch.load('last_good.pt'))  # then: mpdoctor.diagnose(model, optimizer)",
                applicability=Applicability.DISPLAY_ONLY,
                recipe="reload-weights",
            )
        ]
    if cause == "input-nonfinite":
        return [
            *(mask_clamp_fix(mask) for mask in facts.attention_masks if mask.neg_inf),  # the batch's own mask
            Fix(
                "Build additive masks with the compute dtype's finfo.min, not float32's",
                "mask = (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min  # dtype: the "
                "activations' dtype",
                applicability=Applicability.DISPLAY_ONLY,
                recipe="mask-in-compute-dtype",
            )
        ]
    if cause == "gradient-nonfinite":
        return [
            Fix(
                "Clip gradients and lower the learning rate",
                f"torch.nn.utils.clip_grad_norm_({p.model}.parameters(), max_norm=1.0)  # before optimizer.step()",
                applicability=Applicability.DISPLAY_ONLY,
                recipe="clip-gradients",
            )
        ]
    if not _half_in_use(p, m):  # a pure fp32 run: keeping the module in fp32 is what it already does
        return [_fp32_overflow_fix(p, m)]
    return [_fp32_module_fix(facts, p, m.path, m.class_name)]


def _fp32_overflow_fix(p: Any, m: Any) -> Fix:
    """What to do when fp32 itself overflows: no lower precision is in play, so no bf16 / fp16 advice."""
    return Fix(
        f"Find what overflows fp32 in {_where(p, m.path)} ({m.class_name}), then clip gradients",
        f"print({p.model}.get_submodule({m.path!r}))  # fp32 overflows past 3.4e38: check the scale of its "
        f"inputs and weights\ntorch.nn.utils.clip_grad_norm_({p.model}.parameters(), max_norm=1.0)  # before "
        "optimizer.step()",
        applicability=Applicability.DISPLAY_ONLY,
        recipe="fp32-overflow",
    )


def _half_in_use(p: Any, m: Any) -> bool:
    """True when the probed forward computed in a half precision (autocast, half weights or half activations)."""
    half = ("float16", "bfloat16")
    return (
        p.autocast in half
        or p.fp16_in_use
        or any(d in half for d in (*m.input_dtypes, *m.output_dtypes, *getattr(m, "grad_dtypes", ())))
    )


@check("probe-nonfinite", Severity.ERROR, Severity.WARNING,
       fix_safety=(Applicability.SAFE, Applicability.UNSAFE, Applicability.DISPLAY_ONLY))
def probe_nonfinite(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """The first module whose output or output gradient went NaN/Inf in a one-batch probe.

    What it does
        ``mpdoctor.probe(model, batch)`` runs one forward and one backward
        with hooks on every module; this names the first module, in execution
        order, whose output went non-finite (forward), else the first whose
        output gradient did (backward), with whether its inputs and its own
        weights were finite.
    Why is this bad?
        A NaN loss tells nothing about where it started; the first module to
        produce NaN/Inf from finite inputs is where to look (a weight that is
        already inf, an fp16 activation past 65504, a softmax over -inf). In
        backward under a GradScaler, an overflow at the current scale makes the
        scaler skip the step (a warning); repeated, it collapses the scale.
    Example
        model.half()
        loss = model(**batch).loss  # an activation overflows 65504: inf, then NaN
    Use instead
        model.to(torch.bfloat16)  # fp32's range
        loss = model(**batch).loss
    Severity
        Error: the probe's batch produced NaN/Inf; the finding names the first module.
    Fix safety
        Depends on the module: reload weights that hold inf/NaN; keep the
        module in fp32 or switch to bf16 for activation overflow; lower the
        learning rate when gradients blow up. Where the module's weight quantizes its input to float8 with
        dynamic scales and no lower bound (torchao ``Float8DynamicActivationFloat8WeightConfig`` without
        ``activation_value_lb``), safe and in place: the bound set on every such weight of the model (an
        all-zero row then quantizes to 0; every other row exactly as before). Where the op that made the
        NaN (a log, sqrt, rsqrt, log1p; a division or negative power by an operand seen >= 0) runs on a
        line of your own code, display-only corrected code: that cell (or the script's function) with the
        op's argument clamped at its dtype's ``tiny``, run on copies of your objects before it is shown.
    Sources
        transformers ``DebugUnderflowOverflow`` (forward only); pytorch/ao #3356 (NaN losses of LoRA on a
        float8 row-wise base, fixed by ``activation_value_lb``); mpdoctor FIELD-CASES.
    """
    for p in facts.probes:
        hit = p.first_nonfinite()
        if hit is None:
            continue
        m, phase = hit
        if phase == "forward" and getattr(p, "origin", None) is not None:
            yield _origin_finding(facts, p, m, rule)
            continue
        where = _where(p, m.path)
        cause = _nonfinite_cause(p, m, phase, facts)
        if phase == "forward":
            if m.param_nonfinite:
                because = f"its own weights hold {m.param_nonfinite:,} NaN/Inf values: an earlier optimizer step wrote them"
            elif m.in_nonfinite:
                because = PROBE_CAUSES["input-nonfinite"]
            elif cause == "activation-scale-zero":
                grain = next((q.activation_granularity for q in _unfloored(facts, p) if q.path == m.path), "")
                because = (f"its inputs were finite (abs max {_fmt(m.in_absmax)}), but {PROBE_CAUSES[cause]}"
                           + (f" (its scales are taken per {grain})" if grain else ""))
            else:
                because = f"its inputs were finite (abs max {_fmt(m.in_absmax)})"
            if cause == "activation-overflow-fp16":
                because += f" and its {m.class_name} output, computed in float16, passed fp16's largest value 65504"
            msg = (
                f"{where} ({m.class_name}) is the first module whose output went non-finite "
                f"({m.out_nonfinite:,} NaN/Inf activation values) under {_precision(p)}; {because}."
            )
            severity = Severity.ERROR
        else:
            msg = (
                f"The gradient at the output of {where} ({m.class_name}) is the first to go non-finite in backward "
                f"({m.grad_nonfinite:,} NaN/Inf values, in {','.join(m.grad_dtypes) or 'n/a'}) under {_precision(p)}: "
                f"{PROBE_CAUSES[cause]}"
            )
            if p.loss_scale > 1.0:
                msg += "; the GradScaler will skip this step and halve its scale; if it keeps happening the scale collapses."
                severity = Severity.WARNING
            else:
                msg += "; the next optimizer step would write NaN into the weights."
                severity = Severity.ERROR
        yield rule.finding(
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
                "cause": cause,
                "why": PROBE_CAUSES[cause],
            },
            _probe_fixes(facts, p, m, cause),
            severity=severity,
        )


@check("probe-overflow", Severity.WARNING, Severity.INFO, fix_safety=(Applicability.UNSAFE, Applicability.DISPLAY_ONLY))
def probe_overflow(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """The first module whose finite output or gradient passed fp16's 65504 in a one-batch probe.

    What it does
        The first module, in execution order, whose output (forward) or
        output gradient (backward) held finite values larger than 65504,
        fp16's largest number, while the probe ran in a wider dtype. A warning
        when the run computes in fp16 elsewhere (fp16 autocast or weights),
        info otherwise.
    Why is this bad?
        Those values survive only because this op ran in bf16/fp32. In fp16,
        or on a T4/V100 where fp16 is the only half precision, they become inf
        and the loss NaN: the classic T5 / Gemma fp16 failure.
    Example
        model.half()
        out = model(**batch)  # a layer's activations pass 65504
    Use instead
        model.to(torch.bfloat16)
        out = model(**batch)
    Severity
        Warning: activations or gradients pass fp16's range, so an fp16 run overflows there.
    Fix safety
        Keep bf16 (or fp32) for this model; where fp16 is unavoidable, keep
        this module in fp32 (``_keep_in_fp32_modules``) or rescale it.
    Sources
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
        cause = (
            "activation-overflow-fp16"
            if phase == "forward"
            else "gradient-overflow-scaled" if p.loss_scale > 1.0 else "gradient-overflow-fp16"
        )
        kind = "activation" if phase == "forward" else "gradient"
        yield rule.finding(
            where,
            f"{where} ({m.class_name}) is the first module whose {what}{scaled} passed fp16's 65504 "
            f"(abs max {_fmt(value)}, {value / FP16_MAX if value else 0:.3g}x fp16's largest value, "
            f"in {','.join(m.output_dtypes if phase == 'forward' else m.grad_dtypes)}) "
            f"under {_precision(p)}; in fp16 this {kind} would be inf and the loss NaN.",
            {
                "module": m.path,
                "class": m.class_name,
                "phase": phase,
                "absmax": value,
                "fp16_headroom": m.fp16_headroom,
                "cause": cause,
                "why": PROBE_CAUSES[cause],
            },
            _probe_fixes(facts, p, m, cause),
            severity=Severity.WARNING if p.fp16_in_use else Severity.INFO,
        )


@check("probe-dtype-error", Severity.ERROR, fix_safety=(Applicability.SAFE,))
def probe_dtype_error(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A dtype mismatch raised during the probe, attributed to the module that was running.

    What it does
        An exception such as ``mat1 and mat2 must have the same dtype, but got
        Float and BFloat16`` or ``expected ... BFloat16 but got Float`` raised
        during the probe's forward or backward, with the module running at that
        moment (the innermost module entered and not yet finished; in backward,
        the module the gradient last reached) and its input and weight dtypes.
    Why is this bad?
        The traceback points into torch internals or a fused kernel; the
        module and its dtypes say which weight or activation is in the wrong
        dtype (fp32 LoRA adapters on bf16 activations, a layer left in fp32
        outside autocast).
    Example
        model.to(torch.bfloat16)
        model.classifier.float()
        mpdoctor.probe(model, batch)  # the forward raises a dtype error at model.classifier
    Use instead
        model.to(torch.bfloat16)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
    Severity
        Error: the probe's forward or backward raised a dtype error; the finding names the module.
    Fix safety
        Cast the module's weights to the activation dtype, or run the forward
        under ``torch.autocast`` so mixed dtypes are legal.
    Sources
        mpdoctor FIELD-CASES #5 (Unsloth #1260, #212).
    """
    from .batch_inputs import batch_explains

    for p in facts.probes:
        e = p.error
        if e is None or not e.is_dtype_error or batch_explains(p):  # batch-dtype-mismatch names the input
            continue
        where = _where(p, e.module) if e.module is not None else p.model
        held = ""
        if e.module is not None:
            held = f" (inputs {','.join(e.input_dtypes) or 'n/a'}, weights {','.join(e.param_dtypes) or 'none'})"
        yield rule.finding(
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


@check("probe-failed", Severity.ERROR)
def probe_failed(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """Any other exception raised by the model during the probe, attributed to the module running.

    What it does
        An exception that is not a dtype mismatch (a shape error, a bad batch,
        an out-of-memory) raised during the probe's forward, loss or backward.
    Why is this bad?
        Training would fail the same way on its first step; the module name
        is more telling than a long traceback.
    Example
        mpdoctor.probe(model, (input_ids, labels))  # forward() takes keyword arguments
    Use instead
        mpdoctor.probe(model, {"input_ids": input_ids, "labels": labels})
    Severity
        Error: the probe could not run the batch (the exception is shown).
    Fix safety
        Read the message and the module; check the batch matches ``forward``'s
        signature (``probe`` passes a dict as keyword arguments, a tuple as
        positional arguments).
    Sources
        mpdoctor.
    """
    for p in facts.probes:
        e = p.error
        if e is None or e.is_dtype_error:
            continue
        where = _where(p, e.module) if e.module is not None else p.model
        yield rule.finding(
            where,
            f"The probe's {e.phase} raised in {where}: {e.exception}: {e.message}",
            {"module": e.module, "class": e.class_name, "phase": e.phase, "exception": e.exception, "message": e.message},
        )


# -- where a NaN is born, and the batch at the model's boundary -----------------------------------------------


def _origin_fixes(facts: Facts, p, o, shown) -> list[Fix]:
    """The fix that matches the cause of a NaN's birth (:mod:`mpdoctor.attach.runtime.nan_origin`)."""
    if o.cause == "overflow":
        return _probe_fixes(facts, p, shown, "activation-overflow-fp16")
    if o.cause == "nan-in-weights":
        return _probe_fixes(facts, p, shown, "weights-nonfinite")
    if o.cause == "inf-minus-inf":
        return _probe_fixes(facts, p, shown, "input-nonfinite")
    if o.cause == "eps-underflow":
        fixes = list(eps_fixes(facts, p.model, {o.module}))
        return fixes + [_fp32_module_fix(facts, p, o.module, o.class_name)]
    code = {
        "nan-in-batch": ("Check the data: the batch already holds NaN/Inf",
                         f"for k, v in batch.items():  # {o.detail.get('key', '')}\n"
                         "    assert not v.is_floating_point() or torch.isfinite(v).all(), k"),
        "log-nonpositive": ("Clamp before the log", "torch.log(x.clamp_min(torch.finfo(x.dtype).tiny))"),
        "sqrt-negative": ("Clamp before the square root", "torch.sqrt(x.clamp_min(0))"),
        "zero-division": ("Keep the denominator away from zero",
                          "y = a / (b + eps)  # eps representable in the compute dtype: 1e-5 for fp16, "
                          "or b.clamp_min(torch.finfo(b.dtype).tiny)"),
    }.get(o.cause)
    if code is None:
        return [_fp32_module_fix(facts, p, o.module, o.class_name)]
    advice = Fix(code[0], code[1], applicability=Applicability.DISPLAY_ONLY, recipe=o.cause)
    corrected = _corrected_code_fix(o)
    return [corrected, advice] if corrected is not None else [advice]


#: The recipe of a fix that is the user's cell (or script function) corrected: run on twins before it is shown
#: (``mpdoctor.attach.runtime.op_rewrite.CORRECTED_CELL``; the runtime layer is above the checks).
_CORRECTED_CELL = "corrected-cell"


def _corrected_code_fix(o) -> Fix | None:
    """The cell (or the script's function) whose own line ran the op, with the op's argument clamped into its
    domain (``NanOrigin.corrected``, made while the replay's frames were live); None when there is none."""
    corrected = getattr(o, "corrected", "")
    if not corrected or not o.site:
        return None
    from ...facts.location import Location

    where = Location.at(o.site[0], o.site[1])
    op = f"`{o.op.strip('_')}`" if o.op else "the op"
    if where.cell is not None or where.place == "a notebook cell":
        head = f"# {where.place} again: {op}'s argument clamped into its domain ({where.label})"
        title = f"Run {where.place} again with {op}'s argument clamped into its domain (corrected code)"
    else:
        unit = _defined_name(corrected) or o.site[2]
        head = f"# {unit} in {where.place}, {op}'s argument clamped into its domain ({where.label})"
        title = f"Replace {unit} in {where.place} with {op}'s argument clamped into its domain (corrected code)"
    return Fix(title, f"{head}\n{corrected}", applicability=Applicability.DISPLAY_ONLY, recipe=_CORRECTED_CELL)


def _defined_name(code: str) -> str | None:
    """The name of the function or class a script's corrected block defines."""
    import ast

    try:
        body = ast.parse(code).body
    except SyntaxError:
        return None
    return next((n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))), None)


def _site_label(o) -> str:
    """``cell [5], line 3`` / ``train.py:42``: the line of the user's code that ran the op; "" when unknown."""
    if not getattr(o, "site", ()):
        return ""
    from ...facts.location import Location

    return Location.at(o.site[0], o.site[1]).label


#: Origin causes that mean what an older probe cause meant: the evidence keeps the older name for those.
_ORIGIN_AS_PROBE_CAUSE = {"nan-in-weights": "weights-nonfinite", "inf-minus-inf": "input-nonfinite"}


def _origin_finding(facts: Facts, p, first, rule: Rule) -> Finding:
    o = p.origin
    cause = _ORIGIN_AS_PROBE_CAUSE.get(o.cause, o.cause)
    if o.cause == "overflow" and o.dtype == "float16":
        cause = "activation-overflow-fp16"
    where = _where(p, o.module) if o.cause != "nan-in-batch" else p.model
    op = f" in `{o.op}`" if o.op else ""
    shown = "" if first.path == o.module else f"; it first shows in {_where(p, first.path)} ({first.class_name})"
    if o.cause == "nan-in-batch":
        msg = f"The batch fed to {p.model} already holds NaN/Inf ({o.detail.get('key', '?')}){shown}: check the data."
    else:
        lead = (f"{where} ({o.class_name}) is the first module whose output went non-finite "
                f"({first.out_nonfinite:,} NaN/Inf activation values); it is produced there"
                if first.path == o.module else f"The first non-finite value is produced in {where} ({o.class_name})")  # fmt: skip
        computing = f"computing in {o.dtype} under" if o.dtype else "under"  # an op with no floating output
        msg = f"{lead}{op}, {computing} {_precision(p)}: {o.why}"
        if o.cause == "overflow":
            msg += f"; its inputs were finite (abs max {_fmt(o.detail.get('input_absmax'))})"
            if o.dtype == "float16":
                msg += f" and its {o.class_name} output, computed in float16, passed fp16's largest value 65504"
        msg += f"{shown}."
        if getattr(o, "site", ()):
            from ...facts.location import Location

            msg += f" The op runs on a line of your own code: {Location.at(o.site[0], o.site[1]).label} ({o.site[2]})."
        if o.cause == "inf-minus-inf":
            msg += f" Where the inf came from: {PROBE_CAUSES['input-nonfinite']}."
    from types import SimpleNamespace

    # The op computed in o.dtype: that is what the fix judges (a half precision in play, or fp32 itself).
    at = SimpleNamespace(path=o.module, class_name=o.class_name, input_dtypes=(o.dtype,), output_dtypes=(o.dtype,))
    return rule.finding(
        where,
        msg,
        {
            "module": o.module,
            "class": o.class_name,
            "op": o.op,
            "phase": "forward",
            "cause": cause,
            "origin": o.cause,
            "why": o.why,
            "dtype": o.dtype,
            "first_shows_in": first.path,
            "line": _site_label(o),
            "output_nonfinite": first.out_nonfinite,
            "grad_nonfinite": first.grad_nonfinite,
            "input_nonfinite": first.in_nonfinite,
            "weight_nonfinite": first.param_nonfinite,
            "input_dtypes": list(first.input_dtypes),
            "output_dtypes": list(first.output_dtypes),
            "autocast": p.autocast,
            "loss_scale": p.loss_scale,
            "loss": p.loss,
            **{k: v for k, v in o.detail.items() if isinstance(v, (int, float, str))},
        },
        _origin_fixes(facts, p, o, at),
    )


@check("batch-dtype-mismatch", Severity.ERROR, fix_safety=(Applicability.SAFE,))
def batch_dtype_mismatch(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A floating batch input in another dtype than the layer that receives it, with nothing autocasting.

    What it does
        During a probe (``mpdoctor.probe``, ``watch()``) or at a crash: a floating entry of the batch (a
        tensor, a dict / ``BatchFeature`` / ``BatchEncoding`` entry such as ``pixel_values``,
        ``input_features``, ``inputs_embeds`` or a float attention mask) whose dtype differs from the weights
        of the first layer that receives it, while no autocast is active. Names the input by its key and the
        layer by its path.
    Why is this bad?
        Image processors and feature extractors return fp32; a model loaded in bf16/fp16 without autocast
        then raises ``Input type (float) and bias type (c10::BFloat16) should be the same`` or ``mat1 and mat2
        must have the same dtype`` at its first convolution or projection, on every step.
    Example
        model = AutoModelForImageClassification.from_pretrained(name, dtype=torch.bfloat16)
        batch = processor(images, return_tensors="pt")  # pixel_values are fp32
        model(**batch)
    Use instead
        batch = {k: v.to(model.dtype) if v.is_floating_point() else v for k, v in batch.items()}
        model(**batch)
    Severity
        Error when the input reached a layer with weights of another dtype or the forward raised a dtype
        error; nothing when the model converts the input itself before any layer sees it.
    Fix safety
        In place: a forward pre-hook on the model casting floating inputs (never integer ids or bool masks)
        to the compute dtype, and, when a traceback shows the user called another entry (``vae.decode``,
        ``model.generate``, ``model.encoder``), the same cast at that entry (a wrapper on the instance or a
        pre-hook on the submodule), all removed by undo; or cast the dict batch's entries in place. A cast of
        the model's weights that would leave its inputs behind is planned with this input cast. The line to keep:
        ``batch = {k: v.to(model.dtype) if v.is_floating_point() else v for k, v in batch.items()}``.
    Sources
        transformers #25220 / diffusers reports of "Input type (float) and bias type (c10::Half)"; mpdoctor
        field cases (runtime-batch-nan).
    """
    from .batch_inputs import batch_findings

    for p in facts.probes:
        yield from batch_findings(p, rule)
