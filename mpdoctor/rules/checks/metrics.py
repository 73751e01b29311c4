"""Checks on metric states: a torchmetrics ``Metric`` whose running states were cast to half precision.

They read :class:`~mpdoctor.facts.between.MetricStates` (``facts.between.metrics``).
"""

from __future__ import annotations

from collections.abc import Iterator

from ...facts import Facts
from ..engine.findings import Finding, Severity
from ..engine.fixes import Fix
from ..engine.island_changes import SetMetricStatesDtype
from ..engine.rules import Applicability, Rule
from . import check

_SHORT = {"bfloat16": "bf16", "float16": "fp16"}


@check("metric-states-half", Severity.WARNING, fix_safety=(Applicability.SAFE,))
def metric_states_half(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A torchmetrics metric whose running states are held in bf16 / fp16.

    What it does
        Finds torchmetrics ``Metric`` modules (alone, or submodules of a model) whose floating states (the
        running sums, counts and means ``compute()`` reads) are bf16 or fp16. torchmetrics keeps them in fp32
        and refuses ``.half()`` / ``.bfloat16()`` / ``.float()`` on purpose, but ``model.to(torch.bfloat16)``
        and ``metric.set_dtype(torch.float16)`` do cast them.
    Why is this bad?
        A running sum in bf16 stops moving once it reaches 256 times the size of each update (2048 in fp16):
        every later update rounds away, so an epoch mean or an accuracy counts a fraction of the batches
        (measured: ``SumMetric`` fed 5,000 ones answers 256 in bf16 and 2048 in fp16). Nothing raises; the
        logged metric is simply wrong (Lightning-AI/pytorch-lightning#18620, pytorch/xla#2425).
    Example
        module = LitModel()  # holds self.val_loss = MeanMetric()
        module.to(torch.bfloat16)  # casts the metric's states too
    Use instead
        module.to(torch.bfloat16)
        module.val_loss.set_dtype(torch.float32)  # torchmetrics' own way to move states back
    Fix safety
        Safe: ``metric.set_dtype(torch.float32)`` casts the states back in place (bf16 and fp16 values are exact
        in fp32); updates keep working, since torchmetrics casts incoming values to the state. What was lost
        before the fix stays lost: ``metric.reset()`` to start the epoch's figures over.
    Severity
        Warning: the metric's figures are wrong from a few hundred updates on.
    Sources
        Lightning-AI/pytorch-lightning#18620; pytorch/xla#2425; torchmetrics ``Metric._apply`` / ``set_dtype``.
    """
    between = facts.between
    for m in between.metrics if between is not None else ():
        half = m.half_states
        if not half:
            continue
        dtype = next(d for n, d in m.states if n in half)
        where = f"{m.model}.{m.path}" if m.path else m.model
        yield rule.finding(
            where,
            f"{where} ({m.class_name}) holds its states {', '.join(half)} in {_SHORT.get(dtype, dtype)}: a running "
            f"sum stops moving after {m.stall} updates of equal size, so every later batch rounds away and "
            f"compute() answers a wrong figure.",
            {"metric": m.class_name, "half_states": list(half), "dtype": dtype, "sum_stalls_after_updates": m.stall},
            [
                Fix(
                    f"Move {where}'s states back to fp32 with set_dtype",
                    f"import torch\n{where}.set_dtype(torch.float32)\n{where}.reset()  # drop the figures the half "
                    "states already lost",
                    applicability=Applicability.SAFE,
                    changes=(SetMetricStatesDtype(m.ref, "float32"),),
                    recipe="metric-states-fp32",
                    cost="a few fp32 scalars",
                )
            ],
        )
