"""Checks on tensor values and the ranges they must fit: NaN/Inf found by the value scan, models that
overflow fp16, and normalisation eps that vanish in the dtype a layer computes in."""

from __future__ import annotations

from collections.abc import Iterator

from ...facts import Facts, ModelFacts
from ...knowledge import FP16_OVERFLOW_MODEL_TYPES
from ..engine.changes import SetNormEps
from ..engine.findings import Finding, Severity
from ..engine.fixes import Fix
from ..engine.rules import Applicability, Rule
from . import check

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


@check("fp16-overflow-risk", Severity.ERROR, Severity.WARNING, Severity.INFO)
def fp16_overflow_risk(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A model known to pass 65504 (or holding values past it) run, or about to run, in fp16.

    What it does
        Statically: a model of a bf16-native family (T5/mT5, Gemma 2/3,
        Qwen3-MoE, GPT-OSS, ...) set to compute in fp16: fp16 mixed precision
        in a Trainer, TrainingArguments or Accelerator (also when this CPU
        runs it as fp32: a GPU will not), an fp16 autocast, or fp16 weights.
        With a value scan (``scan=True``): parameters holding finite values
        past 65504 under such a setup (error), in half precision on a device
        without bf16 where fp16 is the only half precision (warning), or
        anywhere else (info: the model cannot be moved to fp16).
    Why is this bad?
        fp16's largest value is 65504. These checkpoints were trained in bf16,
        whose range is fp32's; in fp16 their activations overflow to inf and
        the loss turns NaN within a few steps (a GradScaler only skips steps
        and collapses its scale). A weight past 65504 becomes inf the moment
        autocast casts it.
    Example
        model = AutoModelForCausalLM.from_pretrained("google/gemma-2-2b", dtype=torch.float16)
        args = TrainingArguments(output_dir="out", fp16=True)
    Use instead
        model = AutoModelForCausalLM.from_pretrained("google/gemma-2-2b", dtype=torch.bfloat16)
        args = TrainingArguments(output_dir="out", bf16=True)
    Severity
        Error when a scan shows values past fp16's range in a model that will run in fp16; warning for a
        model type known to overflow fp16 without a scan.
    Fix safety
        Use bf16 where the hardware has it (``bf16=True`` on Ampere or newer);
        on V100/T4, train in fp32 (Unsloth forces fp32 for several of these
        families), or keep the overflowing modules in fp32. No automatic fix:
        the choice changes memory and speed.
    Sources
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
        severity = _overflow_severity(facts, m, bool(reasons), bool(families), bool(over))
        if severity is None:
            # A bf16 family on a device without bf16 but not in fp16: bf16-unsupported already says to use fp32.
            continue
        parts, tail = _overflow_words(facts, m, families, over, reasons, severity)
        yield rule.finding(
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
            severity=severity,
        )


def _overflow_severity(facts: Facts, m: ModelFacts, fp16: bool, family: bool, over: bool) -> Severity | None:
    """Error when fp16 meets an overflowing family or values; warning when fp16 is the only half precision
    left on the device; info for values past 65504 in a run that is not fp16; None otherwise."""
    half = m.tensors.main_dtype in ("bfloat16", "float16")
    if fp16 and (family or over):
        return Severity.ERROR
    if over and not facts.hardware.bf16_native and half:
        return Severity.WARNING  # bf16 weights on a device without bf16: fp16 is the only half precision left
    return Severity.INFO if over else None


def _overflow_words(facts: Facts, m: ModelFacts, families: list[str], over: list, reasons: list[str],
                    severity: Severity) -> tuple[list[str], str]:  # fmt: skip
    """The parts of the message (the family, the values past 65504) and its tail (what follows)."""
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
    elif severity == Severity.WARNING:
        tail = f"and {facts.hardware.label} has no native bf16, so fp16 is the only half precision there: use fp32 on it."
    else:
        tail = "nothing here computes in fp16 now; it cannot be switched to fp16 without overflowing."
    return parts, tail


@check("nonfinite-values", Severity.ERROR, Severity.WARNING)
def nonfinite_values(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """NaN or Inf values in parameters, gradients or optimizer state (from a value scan).

    What it does
        With ``scan=True`` / ``%mpdoctor --scan``: any NaN or Inf in a
        parameter, a ``.grad`` or an optimizer-state tensor, counted exactly
        and reported per tensor kind with the first tensors affected.
    Why is this bad?
        A NaN weight makes every forward NaN; NaN in Adam's moments makes
        every later update NaN; non-finite gradients turn the next optimizer
        step into NaN weights unless a GradScaler skips it (then it is a warning:
        the scaler is doing its job, until its scale collapses).
    Example
        optimizer.step()  # a step on inf gradients writes NaN into the weights
        torch.isfinite(model.lm_head.weight).all()  # tensor(False)
    Use instead
        model.load_state_dict(torch.load("last_good.pt"))
        report = mpdoctor.probe(model, batch)  # find the layer that overflows before training on
    Severity
        Error: NaN or Inf already in weights, grads or optimizer state poisons every later step.
    Fix safety
        No automatic fix: reload the last good checkpoint; find the layer that
        overflows with ``mpdoctor.probe(model, batch)`` (``%mpdoctor --probe batch``),
        then move to bf16, lower the learning rate or clip gradients.
    Sources
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
            yield rule.finding(
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
                severity=Severity.WARNING if kind == "grad" and scaler_on else Severity.ERROR,
            )


# -- probe findings -------------------------------------------------------------------------


#: Compute dtypes an eps is judged in, by the name a ModelFacts reason uses.
_EPS_SAFE = 1e-5


def _eps_dtypes(facts: Facts, m: ModelFacts) -> list[str]:
    """The half dtypes ``m`` computes its norms in: fp16 setups, autocast or weights; bf16 weights."""
    out = ["float16"] if _fp16_reasons(facts, m) else []
    counts = m.tensors.param_dtype_counts()
    total = sum(counts.values())
    if total and counts.get("bfloat16", 0) * 2 >= total:
        out.append("bfloat16")
    return out


def _vanishes(eps: float, dtype: str) -> bool:
    import torch

    return eps > 0 and float(torch.tensor(eps, dtype=getattr(torch, dtype))) == 0.0


def eps_fixes(facts: Facts, model_name: str, paths: set[str] | None = None) -> Iterator[Fix]:
    """The fix setting the eps that vanish in fp16 (on the modules at ``paths``, or all, and on the config) to a
    representable value, in place; nothing for a model not in the facts."""
    m = next((x for x in facts.models if x.name == model_name), None)
    if m is None:
        return
    mods = tuple((path, attr) for path, _, attr, eps, _ in m.norm_eps if (paths is None or path in paths) and eps < _EPS_SAFE
                 and any(_vanishes(eps, d) for d in ("float16",)))  # fmt: skip
    if not mods:
        return
    cfgs = tuple((ref, attr) for ref, attr, eps in m.config_eps if _vanishes(eps, "float16"))
    cfg_line = "".join(f"\n{model_name}.config.{attr} = {_EPS_SAFE:g}  # new layers built from the config too"
                       for _, attr in cfgs)  # fmt: skip
    yield Fix(
        f"Set the eps of {len(mods)} normalisation layer{'s' if len(mods) != 1 else ''} to {_EPS_SAFE:g} "
        "(representable in fp16)",
        f"for module in {model_name}.modules():\n"
        f"    if getattr(module, {mods[0][1]!r}, None) is not None and module.{mods[0][1]} < {_EPS_SAFE:g}:\n"
        f"        module.{mods[0][1]} = {_EPS_SAFE:g}  # 1e-12 is 0 in fp16: 0/0 on a zero-variance row" + cfg_line,
        changes=(SetNormEps(m.inner_ref, mods, _EPS_SAFE, cfgs, model_name),),
        recipe="representable-eps",
        cost="a slightly different normalisation for near-constant rows",
    )


@check("norm-eps-underflow", Severity.ERROR, Severity.INFO, fix_safety=(Applicability.UNSAFE,))
def norm_eps_underflow(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A normalisation eps that is 0 in the dtype the layer computes in (1e-12 in fp16).

    What it does
        LayerNorm / RMSNorm / GroupNorm modules (``eps``, ``variance_epsilon``) and config fields
        (``layer_norm_eps``, ``rms_norm_eps``, ``norm_eps``) whose eps rounds to zero in the model's compute
        dtype: fp16 (fp16 weights, an fp16 autocast or fp16 mixed precision) flushes everything below
        about 3e-8 to 0; bf16 keeps fp32's range, so 1e-12 stays a normal number there.
    Why is this bad?
        A norm written as ``x / sqrt(var + eps)`` or ``x * rsqrt(var + eps)`` that computes in its input's
        dtype divides by zero on any row of zero variance (padding, a constant or all-zero row): NaN,
        then a NaN loss. torch's own LayerNorm / GroupNorm / RMSNorm kernels and norms that upcast to fp32
        add eps in fp32, so there the eps is merely meaningless.
    Example
        norm = nn.LayerNorm(4096, eps=1e-12).half()  # 1e-12 is 0 in fp16
    Use instead
        norm = nn.LayerNorm(4096, eps=1e-5).half()
    Severity
        Error when the layer computes in the half dtype itself (its forward neither is torch's kernel nor
        casts to fp32); info when torch's kernel or an fp32 upcast adds the eps (harmless here).
    Fix safety
        Set the eps to a representable value (1e-5) on the modules and the config, in place (undo restores
        the old values); or keep the norm in fp32.
    Sources
        BERT's ``layer_norm_eps=1e-12`` in fp16 (transformers discussions); mpdoctor field cases
        (runtime-batch-nan).
    """
    for m in facts.models:
        dtypes = _eps_dtypes(facts, m)
        if not dtypes:
            continue
        hits = [(e, d) for e in m.norm_eps for d in dtypes if _vanishes(e[3], d)]
        if not hits:
            continue
        own = [e for e, _ in hits if e[4] == "dtype"]
        shown = own or [e for e, _ in hits]
        yield rule.finding(
            f"{m.name}.{shown[0][0]}" if shown[0][0] else m.name,
            _eps_message(m.name, shown, hits[0][1], bool(own)),
            _eps_evidence(m, shown, hits[0][1]),
            list(eps_fixes(facts, m.name, {e[0] for e in shown})) if own else [],
            severity=Severity.ERROR if own else Severity.INFO,
        )


def _eps_message(model: str, shown: list, dtype: str, own: bool) -> str:
    """The message of norm-eps-underflow: which norms, which eps, and whether the layer's own math meets it."""
    classes = sorted({e[1] for e in shown})
    eps = sorted({e[3] for e in shown})
    how = ("computes in its input's dtype, so a zero-variance row (padding, a constant row) gives 0/0 = NaN"
           if own else "is torch's kernel or upcasts to fp32, which adds eps in fp32: harmless here")  # fmt: skip
    return (
        f"{len(shown)} normalisation layer{'s' if len(shown) != 1 else ''} of {model} ({', '.join(classes)}) "
        f"use{'s' if len(shown) == 1 else ''} eps {', '.join(f'{e:g}' for e in eps)}, which is 0 in {dtype}; "
        f"the layer {how}."
    )


def _eps_evidence(m: ModelFacts, shown: list, dtype: str) -> dict:
    """The evidence of norm-eps-underflow."""
    return {
        "modules": [e[0] for e in shown][:20],
        "eps": sorted({e[3] for e in shown}),
        "dtype": dtype,
        "kernel": sorted({e[4] for e in shown}),
        "config": {attr: v for _, attr, v in m.config_eps},
    }
