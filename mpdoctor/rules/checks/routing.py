"""Checks on mixture-of-experts routing: a router's correction bias cast to half precision with the model.

They read :class:`~mpdoctor.facts.between.RouterBias` (``facts.between.router_biases``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from ...facts import Facts
from ..engine.findings import Finding, Severity
from ..engine.fixes import Fix
from ..engine.island_changes import CastBuffersTo
from ..engine.rules import Applicability, Rule
from . import check

_SHORT = {"bfloat16": "bf16", "float16": "fp16"}


@check("router-bias-half", Severity.WARNING, fix_safety=(Applicability.SAFE,))
def router_bias_half(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A mixture-of-experts routing correction bias held in bf16 / fp16.

    What it does
        Finds routers whose correction bias (DeepSeek-V3 / GLM / Kimi ``e_score_correction_bias``, Megatron's
        ``expert_bias``) is bf16 or fp16. transformers keeps it fp32 when loading
        (``_keep_in_fp32_modules_strict``), but ``model.to(torch.bfloat16)`` casts it with everything else.
    Why is this bad?
        The bias is added to the sigmoid scores before top-k, so it decides which experts get each token. Its
        values sit in a narrow band (GLM-5.2: 6.817 to 7.063) where bf16 steps by 0.03125, so distinct biases
        collapse together and tokens go to other experts (sglang#37133 measured 98.5% of tokens with another
        top-8). In training, the auxiliary-loss-free balancing nudges it by 0.001 per step: in bf16 every
        nudge on an entry above 0.5 in magnitude rounds away, so the load stops being balanced
        (NVIDIA/Megatron-LM#1482).
    Example
        model = DeepseekV3ForCausalLM.from_pretrained(name)
        model.to(torch.bfloat16)  # the correction bias goes to bf16 too
    Use instead
        model = DeepseekV3ForCausalLM.from_pretrained(name, dtype=torch.bfloat16)  # keeps the bias fp32
        # or, after a cast: put the bias back in fp32
        for module in model.modules():
            if "e_score_correction_bias" in module._buffers:
                module.e_score_correction_bias.data = module.e_score_correction_bias.float()
    Fix safety
        Safe: the bias buffers go back to fp32 in place (the router adds it to fp32 scores already), so later
        updates and routing happen in fp32. Values already rounded stay rounded: reload them from the checkpoint
        to get the exact routing back.
    Severity
        Warning: routing differs from the checkpoint's and bias updates are lost.
    Sources
        sgl-project/sglang#37133 and #8729; NVIDIA/Megatron-LM#1482; transformers ``DeepseekV3PreTrainedModel.
        _keep_in_fp32_modules_strict``; DeepSeek-V3 report section 2.1.2 (bias update speed 0.001).
    """
    between = facts.between
    by_model: dict[tuple[str, int], list] = defaultdict(list)
    for r in between.router_biases if between is not None else ():
        if r.dtype in _SHORT:
            by_model[(r.model, r.model_ref)].append(r)
    for (model, ref), biases in by_model.items():
        dtype = biases[0].dtype
        lost = sum(r.lost_updates * r.experts for r in biases) / max(1, sum(r.experts for r in biases))
        yield rule.finding(
            model,
            f"{model} holds {len(biases)} router correction bias{'es' if len(biases) > 1 else ''} "
            f"({biases[0].attr} of {biases[0].class_name}) in {_SHORT[dtype]}: the bias picks the experts of every "
            f"token, and in {_SHORT[dtype]} nearby values collapse and a {biases[0].update:g} balancing update is "
            f"lost on {lost:.0%} of its entries.",
            {
                "biases": [f"{r.path}.{r.attr}" for r in biases][:8],
                "dtype": dtype,
                "max_abs": max(r.max_abs for r in biases),
                "lost_update_share": round(lost, 4),
            },
            [
                Fix(
                    f"Keep {model}'s router correction biases in fp32",
                    "import torch\n"
                    f"for module in {model}.modules():\n"
                    f"    if \"{biases[0].attr}\" in module._buffers:\n"
                    f"        module._buffers[\"{biases[0].attr}\"] = module._buffers[\"{biases[0].attr}\"].float()\n"
                    "# values already rounded stay rounded: reload with from_pretrained(..., dtype=torch.bfloat16)",
                    applicability=Applicability.SAFE,
                    changes=(CastBuffersTo(ref, tuple((r.path, r.attr) for r in biases), "float32", "router biases"),),
                    recipe="router-bias-fp32",
                    cost="4 bytes per expert and layer",
                )
            ],
        )
