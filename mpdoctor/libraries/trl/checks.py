"""Checks on TRL trainers: a reference model held in another precision than the policy computes in.

They read :class:`~mpdoctor.libraries.trl.facts.TrlFacts` (``facts.trl``) and the two models' tensor facts.
TRL's configs and trainers are transformers ``TrainingArguments`` / ``Trainer`` subclasses: their
precision request (``SFTConfig``'s default ``bf16=True``) is judged by the transformers checks
(``bf16-unsupported`` on a GPU without bf16).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from ...facts import Facts, ModelFacts
from ...rules.checks import check
from ...rules.engine.changes import CastParamsTo
from ...rules.engine.findings import Finding, Severity
from ...rules.engine.fixes import Fix
from ...rules.engine.rules import Applicability, Rule

_FLOATS = ("float32", "bfloat16", "float16", "float64")
_AUTOCAST = {"bf16": "bfloat16", "fp16": "float16"}
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


def dominant_dtype(m: ModelFacts) -> str | None:
    """The floating dtype holding most of a model's parameter elements."""
    counts: Counter = Counter()
    for p in m.tensors.params:
        if p.dtype in _FLOATS:
            counts[p.dtype] += p.numel
    return counts.most_common(1)[0][0] if counts else None


def _policy_computes(facts: Facts, trainer: str, policy_dtype: str) -> str:
    for p in facts.precisions:
        if p.name == trainer and p.computes_in in _AUTOCAST:
            return _AUTOCAST[p.computes_in]
    return policy_dtype


@check("trl-ref-model-dtype", Severity.ERROR, Severity.WARNING, fix_safety=(Applicability.SAFE,))
def trl_ref_model_dtype(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A TRL reference model held in another dtype than the policy model computes in.

    What it does
        A ``DPOTrainer`` / ``KTOTrainer`` / ``GRPOTrainer`` / ``RLOOTrainer`` whose ``ref_model`` parameters
        are in another floating dtype than the precision the policy model computes in (its parameter dtype,
        or the autocast dtype when the config asks for bf16/fp16 mixed precision). TRL builds its own
        reference in the policy's dtype (``ref_model_init_kwargs.setdefault("dtype", self.model.dtype)``);
        a reference passed by the user is used as it is.
    Why is this bad?
        The loss compares the policy's log-probabilities with the reference's (DPO's implicit reward is
        ``beta * (logp_policy - logp_ref)``). With identical weights the rewards and margins must be exactly 0
        at the first step; a reference computed in another precision adds a bias to every reward from the
        first step (measured here with an fp16 copy of an fp32 policy: margins of -2.6e-4, loss 0.69328
        instead of ln 2). An fp16 reference is worse: logits beyond 65504 become inf and the rewards NaN
        (huggingface/trl#878: "tried fp32 and load reference model with float32 then seems the nan fixed").
    Example
        policy = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)
        ref = AutoModelForCausalLM.from_pretrained(name)  # fp32
        trainer = DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=ds)
    Use instead
        ref = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)
        trainer = DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=ds)
    Severity
        Error for an fp16 reference under a policy that does not compute in fp16 (NaN rewards and loss);
        warning for any other mismatch (rewards biased from step 0, training goes on).
    Fix safety
        Cast the reference model in place to the policy's compute dtype (the same Parameter objects; it is
        frozen, so no optimizer state follows). Costs the memory of the wider dtype.
    Sources
        huggingface/trl#878 (DPO NaN rewards with an fp16 reference); trl ``trainer/dpo_trainer.py``
        (``ref_model_init_kwargs.setdefault("dtype", self.model.dtype)``); RLHFlow/Online-DPO-R1#16.
    """
    models = {m.name: m for m in facts.models}
    for t in facts.trl:
        policy, ref = models.get(t.model_name or ""), models.get(t.ref_model_name or "")
        if policy is None or ref is None:
            continue
        policy_dtype, ref_dtype = dominant_dtype(policy), dominant_dtype(ref)
        if policy_dtype is None or ref_dtype is None or ref_dtype == policy_dtype:
            continue
        computes = _policy_computes(facts, t.name, policy_dtype)
        if ref_dtype == computes:
            continue  # e.g. a bf16 reference beside an fp32 policy under bf16 autocast: same matmul precision
        fp16 = ref_dtype == "float16" and computes != "float16"
        ids = frozenset(p.id for p in ref.tensors.params if p.dtype in _FLOATS and p.dtype != computes)
        harm = (
            "its logits overflow fp16's 65504 to inf and the rewards and loss become NaN"
            if fp16
            else "every reward carries a bias from the first step, where identical weights must give 0"
        )
        yield rule.finding(
            t.ref_model_name,
            f"{t.name} ({t.trainer_class}) computes the policy {t.model_name} in {_SHORT.get(computes, computes)} but "
            f"its reference {t.ref_model_name} holds {_SHORT.get(ref_dtype, ref_dtype)} weights: the reference "
            f"log-probabilities are computed in another precision, so {harm}.",
            {
                "policy_dtype": policy_dtype,
                "policy_computes": computes,
                "ref_dtype": ref_dtype,
                "ref_params": len(ids),
            },
            [
                Fix(
                    f"Cast {t.ref_model_name} to {computes}, the precision the policy computes in",
                    f"import torch\n{t.ref_model_name}.to(torch.{computes})  # frozen: no optimizer state to follow\n"
                    f"# or build it so: AutoModelForCausalLM.from_pretrained(..., dtype=torch.{computes})", applicability=Applicability.SAFE,
                    changes=(CastParamsTo(ref.ref, ids, computes, (), "reference model parameters"),),
                    recipe="trl-ref-model-policy-dtype",
                    cost=f"the reference model's memory in {_SHORT.get(computes, computes)}",
                )
            ],
            severity=Severity.ERROR if fp16 else Severity.WARNING,
        )
