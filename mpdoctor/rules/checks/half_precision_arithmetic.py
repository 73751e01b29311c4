"""Low-precision numerics that no dtype tally shows: optimizer arithmetic and buffers in half precision."""

from __future__ import annotations

from collections.abc import Iterator

from ...facts import Facts, ModelFacts
from ..engine.changes import RecomputeRopeBuffers, SetGroupOption
from ..engine.findings import Finding, Severity, count
from ..engine.fixes import Fix
from ..engine.rules import Applicability, Rule
from . import check
from .optimizer import _cast_code, _cast_fix

#: A Python float added to an fp16 tensor is rounded to fp16 first: anything at or below half the smallest
#: subnormal (2**-24) becomes 0.
FP16_EPS_UNDERFLOW = 2.0**-25

#: Phase error (radians) at a model's last position above which a half-precision RoPE table is a warning.
ROPE_PHASE_WARNING = 0.5


@check("adam-eps-underflow", Severity.ERROR, fix_safety=(Applicability.UNSAFE,))
def adam_eps_underflow(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """An Adam-family optimizer on fp16 parameters whose ``eps`` rounds to zero in fp16.

    What it does
        A ``torch.optim`` optimizer with an ``eps`` hyperparameter (Adam, AdamW, NAdam, RAdam, Adamax,
        Adagrad, RMSprop) whose param groups hold trainable fp16 parameters, with ``eps`` at or below
        2**-25 (the default 1e-8 is), and not ``fused`` (the fused kernels compute in fp32).
    Why is this bad?
        The moments live in the parameter's dtype, so the update ``exp_avg / (sqrt(exp_avg_sq) + eps)``
        is computed in fp16, where ``eps = 1e-8`` rounds to 0. Every element whose gradient is exactly
        zero (embedding rows not in the batch, padding, a frozen-then-unfrozen layer) gets ``0 / 0 = NaN``
        at the first step, and the NaN spreads from there. Tiny ``exp_avg_sq`` values underflow too.
    Example
        model = model.half()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)  # eps=1e-8 is 0 in fp16
    Use instead
        model = model.float()  # fp32 master weights
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(**batch).loss
    Severity
        Error: the first ``step()`` writes NaN into every weight whose gradient was exactly zero. Nothing
        for the optimizer of a Lightning ``16-true`` run: ``lightning-true-half-adam`` names the cause
        there, since each ``fit`` casts the module back to fp16 and rebuilds the optimizer from
        ``configure_optimizers``, so neither fix below would last.
    Fix safety
        Keep fp32 master weights (cast the trainable fp16 parameters, their grads and state to fp32 in
        place; compute in fp16 with ``torch.autocast`` and a ``GradScaler``), or raise ``eps`` to 1e-4
        in every param group (keeps fp16 weights; changes the update slightly).
    Sources
        pytorch/pytorch #8860; afiaka87/glide-finetune #5 and PR #6 (eps 1e-4 fixes NaN in half precision);
        soumith/cudnn.torch #377; google-deepmind/optax #1754 (0/0 on zero-gradient steps).
    """
    # A Lightning true-half run re-casts the module and rebuilds the optimizer at every fit: one cause, one finding.
    lightning_owned = {n for p in facts.lightning if p.true_half for n in p.optimizer_names}
    for o in facts.optimizers:
        if not o.class_path.startswith("torch.optim.") or o.defaults.get("fused") is True or o.name in lightning_owned:
            continue
        eps_values = [e for e in o.group_eps if e is not None]
        if not eps_values or min(eps_values) > FP16_EPS_UNDERFLOW:
            continue
        half = [p for p in o.params if p.requires_grad and p.dtype == "float16"]
        if not half:
            continue
        eps = min(eps_values)
        master = _cast_fix(
            facts,
            o,
            f"Keep fp32 master weights: cast {len(half)} trainable fp16 parameters of {o.name} to fp32",
            _cast_code(o.name, "p.requires_grad and p.dtype == torch.float16", "float32", "fp32 master weights")
            + "\n# then compute in fp16 with torch.autocast(device_type, dtype=torch.float16) and a torch.amp.GradScaler",
            half,
            "float32",
            f"trainable fp16 parameters held by {o.name}",
            "fp32-master-weights",
        )
        raise_eps = Fix(
            f"Raise eps of {o.name} to 1e-4 in every param group (representable in fp16)",
            f"for group in {o.name}.param_groups:\n    group['eps'] = 1e-4  # 1e-8 rounds to 0 in fp16",
            changes=(SetGroupOption(facts.subject(o.name).inner_ref, "eps", 1e-4, o.name),),
            recipe="raise-eps",
            cost="no memory; the update's denominator grows by 1e-4 (slightly smaller steps for tiny gradients)",
        )
        yield rule.finding(
            o.name,
            f"{o.name} ({o.class_name}) updates {len(half)} trainable fp16 parameters with eps={eps:g}, which rounds "
            "to 0 in fp16: every element whose gradient is exactly zero (unused embedding rows, padding) gets "
            "exp_avg / (sqrt(exp_avg_sq) + 0) = 0/0 = NaN at the next step.",
            {
                "optimizer": o.class_path,
                "eps": eps,
                "eps_in_fp16": 0.0,
                "fp16_params": len(half),
                "fp16_elements": sum(p.numel for p in half),
            },
            [master, raise_eps],
        )


@check("half-precision-rope-buffers", Severity.WARNING, Severity.INFO, fix_safety=(Applicability.SAFE, Applicability.DISPLAY_ONLY))
def half_precision_rope_buffers(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """Rotary-embedding frequencies (``inv_freq``) cast to bf16/fp16, typically by ``model.to(dtype)``.

    What it does
        A transformers model whose rotary embedding modules hold their ``inv_freq`` buffer in bf16 or fp16,
        with the phase error that causes at the model's last position (measured against the fp32
        frequencies recomputed from the config).
    Why is this bad?
        ``model.to(torch.bfloat16)`` / ``.half()`` casts buffers too. The modeling code computes
        ``position * inv_freq`` in fp32, but from frequencies already rounded to 8 (bf16) or 11 (fp16)
        significant bits; the error grows with the position and reaches a large fraction of a radian at a
        few thousand tokens, so long-context positions are encoded wrongly (loss curves diverge from fp32).
        ``from_pretrained(dtype=...)`` keeps these buffers fp32; a cast afterwards does not.
    Example
        model = AutoModelForCausalLM.from_pretrained(name)
        model.to(torch.bfloat16)  # also casts rotary_emb.inv_freq
    Use instead
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)  # inv_freq stays fp32
    Severity
        Warning when the phase error at the last position passes 0.5 rad; info below (short contexts).
    Fix safety
        Recompute the frequencies in fp32 from the config and put them back in place (safe: the modeling
        code expects fp32 and casts cos/sin to the activation dtype itself); offered in place for the
        warning, as advice for the info. Load with ``from_pretrained(..., dtype=torch.bfloat16)`` instead
        of casting after loading.
    Sources
        huggingface/transformers #29496 and PR #29285 (RoPE loses precision in bf16); NVIDIA/Megatron-LM #744;
        EleutherAI/gpt-neox #1003; Modalities/modalities PR #462.
    """
    for m in facts.models:
        if not m.rope_buffers:
            continue
        worst = max(m.rope_buffers, key=lambda r: r[3])
        path, cls, dtype, err, positions = worst
        severity = Severity.WARNING if err > ROPE_PHASE_WARNING else Severity.INFO
        paths = tuple(r[0] for r in m.rope_buffers)
        where = f"{m.name}.{path}" if path else m.name
        spec = RecomputeRopeBuffers(m.inner_ref, paths, f"rotary embeddings of {m.name}")
        code = (
            "import torch\n"
            f"for module in {m.name}.modules():\n"
            "    if type(module).__name__.endswith('RotaryEmbedding') and module.inv_freq.dtype != torch.float32:\n"
            "        fn = (type(module).compute_default_rope_parameters if module.rope_type == 'default'\n"
            "              else transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[module.rope_type])\n"
            "        inv_freq = fn(module.config)[0].to(module.inv_freq.device)\n"
            "        module.inv_freq = inv_freq  # fp32 again; a later model.to(dtype) casts it back\n"
            "        module.original_inv_freq = inv_freq.clone()"
        )
        recompute = Fix(
            f"Recompute the rotary frequencies of {m.name} in fp32 ({count(len(paths), 'module')})",
            "import transformers\n" + code, applicability=Applicability.SAFE,
            changes=(spec,),
            recipe="fp32-rope-buffers",
            cost="a few hundred bytes per module",
        )
        load = _build_in_dtype_fix(m, dtype)
        # Harmless at this context length (info): advice only, nothing to change in place.
        fixes = [recompute, load] if severity == Severity.WARNING else [load]
        yield rule.finding(
            where,
            f"{count(len(paths), 'rotary embedding')} of {m.name} ({cls}) {'holds' if len(paths) == 1 else 'hold'} "
            f"inv_freq in {dtype} (model.to({dtype}) casts "
            f"buffers): position * inv_freq is off by {err:.2g} rad at position {positions - 1}"
            + (
                ", so long-context positions are encoded wrongly."
                if severity == Severity.WARNING
                else "; small at this context length, but the error grows with the position and is free to avoid."
            ),
            {"modules": list(paths), "class": cls, "dtype": dtype, "phase_error_rad": err, "positions": positions},
            fixes,
            severity=severity,
        )


def _build_in_dtype_fix(m: ModelFacts, dtype: str) -> Fix:
    """Create the model in ``dtype`` rather than casting it after: ``from_pretrained`` for a model loaded from a
    checkpoint, ``from_config`` for one built from a config (both keep ``inv_freq`` in fp32)."""
    if m.loaded_from:
        return Fix(
            "Load in the target dtype instead of casting after loading",
            f"{m.name} = {m.inner_class}.from_pretrained({m.loaded_from!r}, dtype=torch.{dtype})  # keeps inv_freq fp32",
            applicability=Applicability.DISPLAY_ONLY,
            recipe="load-in-dtype",
        )
    return Fix(
        "Build in the target dtype instead of casting after building",
        f"{m.name} = AutoModelForCausalLM.from_config({m.name}.config, dtype=torch.{dtype})  # keeps inv_freq fp32\n"
        "# (the Auto class of your model: AutoModel, AutoModelForSequenceClassification, ...)",
        applicability=Applicability.DISPLAY_ONLY,
        recipe="load-in-dtype",
    )
