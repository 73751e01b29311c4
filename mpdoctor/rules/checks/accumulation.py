"""Checks on gradient accumulation: micro-batch gradients summed into bf16 / fp16 ``.grad``.

They read :class:`~mpdoctor.facts.between.HalfGradReplay` and the accumulation settings
(``facts.between``).
"""

from __future__ import annotations

from collections.abc import Iterator

from ...facts import Facts
from ..engine.changes import CastParamsTo
from ..engine.findings import Finding, Severity
from ..engine.fixes import Fix
from ..engine.rules import Applicability, Rule
from . import check

_SHORT = {"bfloat16": "bf16", "float16": "fp16"}


@check("half-grad-accumulation", Severity.WARNING, fix_safety=(Applicability.UNSAFE,))
def half_grad_accumulation(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """Gradients accumulated over several micro-batches into bf16 / fp16 ``.grad``.

    What it does
        Finds trainable parameters held in bf16 / fp16 (so autograd writes and sums their ``.grad`` in that
        dtype) while the run accumulates several micro-batches per optimizer step
        (``TrainingArguments.gradient_accumulation_steps``, ``Accelerator(gradient_accumulation_steps=...)``,
        Lightning's ``accumulate_grad_batches``, or a hand-written loop: its ``optimizer.step()`` guard read from
        the notebook's cells or the script that calls ``diagnose()``, or its ``backward()`` calls per step counted
        by ``watch()`` and ``mpdoctor run``), and measures the relative error of the accumulated gradient
        against the same sum in fp32: on the model's own ``.grad`` when it has one, else on a representative
        gradient.
    Why is this bad?
        Each ``.grad += micro_grad`` rounds to 8 significant bits in bf16; over N micro-batches the errors add
        up, and a small micro-batch gradient next to a large running sum rounds away entirely. The step then
        follows a gradient that is off by the measured error, more so the more micro-batches are summed
        (deepspeedai/DeepSpeed#1800, #2768: "training occasionally diverges ... accumulation is also done in
        BF16"; Megatron accumulates in fp32 for bf16 runs).
    Example
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)
        args = TrainingArguments(..., gradient_accumulation_steps=16)
    Use instead
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)  # fp32 master weights and grads
        args = TrainingArguments(..., bf16=True, gradient_accumulation_steps=16)  # bf16 compute under autocast
    Fix safety
        Unsafe: the fix casts the trainable parameters (with their grads and optimizer state) to fp32 in place,
        so ``.grad`` accumulates in fp32; this doubles their memory and makes the forward compute in fp32 unless
        the loop runs under ``torch.autocast(dtype=torch.bfloat16)`` (``bf16=True``), which keeps bf16 matmuls.
    Severity
        Warning: the accumulated gradient is off by the measured relative error at every optimizer step.
    Sources
        deepspeedai/DeepSpeed#1800, #2768, #2352; NVIDIA/Megatron-LM#372 (bf16 requires fp32 accumulation).
    """
    between = facts.between
    if between is None or not between.accumulations:
        return
    setting = max(between.accumulations, key=lambda a: a.steps)
    dtypes = {p.id: p.dtype for m in facts.models for p in m.tensors.params}
    for r in between.grad_replays:
        # The replay was measured when the facts were read; a simulated cast since then moves params out of it.
        half = frozenset(i for i in r.param_ids if dtypes.get(i, r.dtype) == r.dtype)
        if not half:
            continue
        short = _SHORT.get(r.dtype, r.dtype)
        yield rule.finding(
            r.model,
            f"{r.model} accumulates {r.steps} micro-batches ({setting.name}: {setting.setting}) into {short} .grad: "
            f"the summed gradient is off by {r.relative_error:.2%} from the same sum in fp32 (measured on "
            f"{r.measured_on}).",
            {
                "accumulation_steps": r.steps,
                "grad_dtype": r.dtype,
                "relative_error": round(r.relative_error, 5),
                "measured_on": r.measured_on,
                "setting": f"{setting.name}: {setting.setting}",
                "params": len(half),
            },
            [
                Fix(
                    f"Keep {r.model}'s trainable parameters and grads in fp32 (compute in {short} under autocast)",
                    f"import torch\n{r.model}.float()  # fp32 master weights: .grad accumulates in fp32\n"
                    f"# then run the forward under torch.autocast('cuda', dtype=torch.{r.dtype}) "
                    "(TrainingArguments(bf16=True))",
                    applicability=Applicability.UNSAFE,
                    changes=(CastParamsTo(r.model_ref, half, "float32",
                                          facts.optimizer_refs(half), "trainable parameters"),),
                    recipe="fp32-grad-accumulation",
                    cost="the trainable parameters' memory, doubled",
                )
            ],
        )
