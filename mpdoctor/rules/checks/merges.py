"""Checks on adapter merges: a LoRA delta merged into a bf16 / fp16 base weight.

They read :class:`~mpdoctor.facts.between.MergedAdapter` (``facts.between.merged_adapters``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from ...facts import Facts
from ..engine.findings import Finding, Severity
from ..engine.fixes import Fix
from ..engine.island_changes import UnmergeAdapters
from ..engine.rules import Applicability, Rule
from . import check

_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
#: Below this share of the delta lost, the merge is as good as the half-precision base allows.
_NOTICEABLE = 0.01


@check("lora-merged-into-half-base", Severity.WARNING, Severity.INFO,
       fix_safety=(Applicability.SAFE, Applicability.DISPLAY_ONLY))
def lora_merged_into_half_base(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A LoRA adapter merged into a bf16 / fp16 base weight, losing part of its delta to rounding.

    What it does
        Finds PEFT LoRA layers whose adapters were merged (``merge_adapter()``, or ``merge_and_unload()``
        before the unload) into a base weight held in bf16 / fp16, and measures the share of the adapter's
        fp32 delta ``B @ A * scaling`` that the merged weight lost: ``|merged - base - delta| / |delta|``,
        the base recovered as ``round(merged - delta)``. After ``merge_and_unload()`` the LoRA layers are gone
        and nothing is left to read: the check sees a merge while the PEFT model still holds it.
    Why is this bad?
        A LoRA delta is small next to the base weight (its entries are often below the base's bf16 step), so
        ``base + delta`` rounded to bf16 keeps only part of it: the merged model answers differently from the
        adapter it came from (huggingface/peft#1388: loss 2.1178 with the adapter, 2.1214 merged;
        unslothai/unsloth#3091; QwenLM/Qwen#1168).
    Example
        base = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)
        model = PeftModel.from_pretrained(base, adapter_dir)
        merged = model.merge_and_unload()  # rounds base + delta to bf16
    Use instead
        base = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, adapter_dir)
        merged = model.merge_and_unload().to(torch.bfloat16)  # one rounding of the sum
    Fix safety
        While the PEFT model still holds the merge (``merge_adapter()``), unmerge its merged layers in place
        (PEFT's ``unmerge``; undo merges again and puts the merged weights' bytes back): the adapter adds its
        delta exactly at every forward and trains again. Safe: the model computes ``base + delta`` as the merge
        meant to, at the cost of the adapter's matmuls. A merged checkpoint to export: display-only, reload the
        base in fp32, merge there, then cast the merged model once.
    Severity
        Warning when the merge lost 1% of the delta or more; info below.
    Sources
        huggingface/peft#1388; unslothai/unsloth#3091; QwenLM/Qwen#1168; meta-pytorch/torchtune#1101.
    """
    between = facts.between
    by_model: dict[str, list] = defaultdict(list)
    for m in between.merged_adapters if between is not None else ():
        by_model[m.model].append(m)
    for model, layers in by_model.items():
        worst = max(layers, key=lambda m: m.lost_share)
        mean = sum(m.lost_share for m in layers) / len(layers)
        base = _SHORT.get(worst.base_dtype, worst.base_dtype)
        yield rule.finding(
            model,
            f"{model} merged its LoRA adapter into a {base} base in {len(layers)} layer(s): the rounding lost "
            f"{mean:.1%} of the adapter's delta on average ({worst.lost_share:.1%} at {worst.path}), so the merged "
            f"model answers differently from the adapter.",
            {
                "layers": len(layers),
                "base_dtype": worst.base_dtype,
                "adapter_dtype": worst.adapter_dtype,
                "mean_delta_lost": round(mean, 4),
                "worst_delta_lost": round(worst.lost_share, 4),
                "worst_layer": worst.path,
            },
            [
                _unmerge_fix(facts, model, layers),
                Fix(
                    "Merge into an fp32 base, then cast the merged model once",
                    "# the base's fp32 weights are in its checkpoint, a file mpdoctor does not read: merge again from it\n"
                    "import torch\n"
                    "base = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)\n"
                    "model = PeftModel.from_pretrained(base, adapter_dir)\n"
                    f"merged = model.merge_and_unload().to(torch.{worst.base_dtype})  # one rounding of base + delta",
                    applicability=Applicability.DISPLAY_ONLY,
                    recipe="merge-in-fp32",
                    cost="the base model's memory in fp32 while merging",
                )
            ],
            severity=Severity.WARNING if mean >= _NOTICEABLE else Severity.INFO,
        )


def _unmerge_fix(facts: Facts, model: str, layers: list) -> Fix:
    """Unmerge the merged LoRA layers of ``model`` in place: the adapter computes its delta exactly again."""
    paths = tuple(dict.fromkeys(m.path for m in layers))
    subject = facts.subject(model)
    return Fix(
        f"Unmerge {model}'s adapter ({len(paths)} layer{'s' if len(paths) != 1 else ''})",
        f"{model}.unmerge_adapter()  # the adapter adds its delta exactly again; merge in fp32 to export",
        applicability=Applicability.SAFE,
        changes=(UnmergeAdapters(subject.ref, paths, model),) if subject is not None else (),
        recipe="unmerge-adapter",
        cost="the adapter's two small matmuls per layer at every forward",
    )
