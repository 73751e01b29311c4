"""Checks on Lightning's precision plugins: a request Lightning replaced, half weights under a stock Adam.

They read :class:`~mpdoctor.libraries.lightning.facts.LightningPrecisionFacts` (``facts.lightning``). A Trainer's
precision plugin is chosen in its constructor and read from its strategy at each use; before (or between)
fits the ``HalfPrecision`` plugin of a true-half Trainer is replaced in place by the one
``Trainer(precision="bf16-mixed")`` builds (:class:`~mpdoctor.rules.engine.changes.SetLightningPrecision`). What a
live object does not hold (a request Lightning replaced and forgot, a Fabric's set-up modules) stays a
display-only ``Trainer(precision=...)`` / ``Fabric(precision=...)`` to build instead.
"""

from __future__ import annotations

from collections.abc import Iterator

from ...facts import Facts
from ...rules.checks import check
from ...rules.engine.changes import SetLightningPrecision
from ...rules.engine.findings import Finding, Severity
from ...rules.engine.fixes import Fix
from ...rules.engine.rules import Applicability, Rule
from .facts import CPU_FALLBACK_WARNING, LightningPrecisionFacts

#: Stock torch optimizers whose moments follow the parameter dtype (``zeros_like(p)``).
_STOCK_ADAM = frozenset({"torch.optim.adam.Adam", "torch.optim.adamw.AdamW"})
#: The smallest positive fp16 value (subnormal): Adam's default eps=1e-8 rounds to zero below it.
FP16_TINY = 2.0**-24


def _ctor(p: LightningPrecisionFacts) -> str:
    return "Fabric" if p.kind == "fabric" else "Trainer"


def rebuild_fix(p: LightningPrecisionFacts, precision: str, title: str, cost: str, why: str) -> Fix:
    """A display-only fix: the Trainer / Fabric to build with ``precision``; ``why`` says what mpdoctor cannot reach."""
    ctor = _ctor(p)
    accel = f"accelerator={p.device!r}, " if p.device else ""
    code = (
        f"# {why}\n"
        f"{p.name} = L.{ctor}({accel}precision={precision!r}, ...)  # import lightning as L; other arguments as before"
    )
    return Fix(title, code, applicability=Applicability.DISPLAY_ONLY, recipe=f"lightning-{precision}", cost=cost)


@check("lightning-precision-replaced", Severity.WARNING, fix_safety=(Applicability.DISPLAY_ONLY,))
def lightning_precision_replaced(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """Lightning runs another precision than the one requested (``16-mixed`` on a CPU runs as ``bf16-mixed``).

    What it does
        A Lightning ``Trainer`` / ``Fabric`` whose precision plugin runs something else than the flag asked
        for. Lightning 2.x has one such rule (its accelerator connector): ``precision="16-mixed"`` with
        ``accelerator="cpu"`` becomes ``bf16-mixed`` with the warning "You passed
        `Trainer(accelerator='cpu', precision='16-mixed')` but AMP with fp16 is not supported on CPU. Using
        `precision='bf16-mixed'` instead." The connector then overwrites its own record of the request
        (``_precision_flag``), so on a built Trainer the replacement is visible only where the request is
        known: a ``target=`` what-if (the rule applied to the target's device) or facts built by hand.
    Why is this bad?
        The run computes in bf16 (8 significant bits) where fp16 (11) was asked: its losses and gradients
        differ measurably from the fp16 run the user meant to reproduce on a GPU, and nothing but a
        one-time warning says so. No crash: bf16 autocast trains on a CPU.
    Example
        trainer = L.Trainer(accelerator="cpu", precision="16-mixed")  # runs bf16 on a CPU
    Use instead
        trainer = L.Trainer(accelerator="cpu", precision="bf16-mixed")
    Severity
        Warning: the run trains, in another precision than asked (measurable, not ruinous).
    Fix safety
        Display-only, because nothing live is wrong: the Trainer's plugin already runs ``bf16-mixed`` (the
        CPU's half precision) and its connector has overwritten the request, so the finding is drawn only
        where the request is known (a ``target=`` what-if, facts built by hand), never from a live run to
        change. What differs is the ``precision=`` the user's code passes: build the Trainer with the
        precision that really runs, or run ``16-mixed`` on a GPU. mpdoctor reaches neither the script nor
        a GPU.
    Sources
        lightning ``pytorch/trainer/connectors/accelerator_connector.py`` ``_check_and_init_precision`` and
        ``fabric/connector.py`` (2.x); Lightning-AI/pytorch-lightning PR #10033 (the CPU fallback).
    """
    for p in facts.lightning:
        if p.requested is None or p.effective is None or p.requested == p.effective:
            continue
        quoted = CPU_FALLBACK_WARNING.replace("Trainer(", f"{_ctor(p)}(") if p.requested == "16-mixed" else ""
        yield rule.finding(
            p.name,
            f"{p.name} asks for precision={p.requested!r} but its {p.plugin} runs {p.effective!r} on the "
            f"{p.device or 'device'}: the run computes in another precision than asked."
            + (f" Lightning says: {quoted}" if quoted else ""),
            {"requested": p.requested, "effective": p.effective, "plugin": p.plugin, "device": p.device},
            [
                rebuild_fix(
                    p,
                    p.effective,
                    f"Build {p.name} with precision={p.effective!r}, what really runs on the {p.device}",
                    "no change to the numbers this run computes; the arguments say what runs",
                    f"the live {_ctor(p)} already runs {p.effective} and Lightning forgot the request: nothing in place "
                    f"to change; where it is built, say what runs on the {p.device} (or run {p.requested} on a GPU)",
                )
            ],
        )


@check("lightning-true-half-adam", Severity.ERROR, Severity.WARNING,
       fix_safety=(Applicability.UNSAFE, Applicability.DISPLAY_ONLY))
def lightning_true_half_adam(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """``bf16-true`` / ``16-true`` weights updated by stock torch Adam/AdamW: the update itself is half precision.

    What it does
        A Lightning ``Trainer`` / ``Fabric`` running ``bf16-true`` or ``16-true`` (``HalfPrecision``: the
        module, its inputs and so the optimizer's parameters and moments are half) whose optimizer is
        ``torch.optim.Adam`` / ``AdamW``; before ``fit`` (no optimizer yet), the one its LightningModule's
        ``configure_optimizers`` builds, read from the source.
    Why is this bad?
        ``16-true``: Adam's default ``eps=1e-8`` is below fp16's smallest value (6e-8) and rounds to zero,
        and a squared gradient below 2.4e-4 underflows to zero in ``exp_avg_sq``, so ``m / (sqrt(v) + eps)``
        divides by zero: the weights become inf/NaN at the first step where a gradient is small (measured
        here: one AdamW step with gradients of 1e-5 makes fp16 weights -inf). ``bf16-true``: every update smaller
        than half a bf16 ulp (about ``weight / 256``) is lost, so training stalls silently; the
        ``pure-bf16-adamw`` check measures that on the optimizer itself.
    Example
        trainer = L.Trainer(precision="16-true")
        # configure_optimizers returns torch.optim.Adam(self.parameters())
    Use instead
        trainer = L.Trainer(precision="bf16-mixed")  # fp32 weights and Adam state, bf16 compute
    Severity
        Warning for ``bf16-true`` (updates lost, the loss stalls); error for ``16-true`` (NaN weights).
    Fix safety
        Unsafe (it changes the numbers the run computes): a Trainer's ``HalfPrecision`` plugin is replaced in
        place, before the next ``fit``, by the ``MixedPrecision("bf16-mixed", device)`` that
        ``Trainer(precision="bf16-mixed")`` builds, where the Trainer keeps it (its strategy and accelerator
        connector), and a LightningModule an earlier ``fit`` cast to half is cast back to fp32 (parameters,
        grads, optimizer state, buffers, ``module.dtype``); the next ``fit`` then runs as a Trainer built with
        ``bf16-mixed`` would: fp32 inputs, weights and Adam state, bf16 autocast. Undo puts the very plugin
        and tensors back. Casting the weights alone would not do: the ``HalfPrecision`` plugin casts them
        back at every ``fit`` and every batch to half. Display-only for a Fabric (its set-up modules chose
        their backward for the plugin they met) and for a strategy's own plugin (FSDP, DeepSpeed): build it
        with ``precision="bf16-mixed"``; or keep true-half weights with a bf16-safe optimizer
        (``adamw_bf16.AdamWBF16``, optimi with ``kahan_sum=True``).
    Sources
        Lightning docs "N-bit precision" (true half precision "may lead to unstable training");
        Lightning-AI/pytorch-lightning issue #20619 (16-true, Adam eps=1e-8, NaN at the first step); "Revisiting BFloat16 Training" (Zamirai et al.).
    """
    by_name = {o.name: o for o in facts.optimizers}
    for p in facts.lightning:
        dtype = p.true_half
        if dtype is None:
            continue
        if p.planned_optimizer in _STOCK_ADAM:
            yield _planned_finding(facts, rule, p)
        for name in p.optimizer_names:
            o = by_name.get(name)
            if o is None or o.class_path not in _STOCK_ADAM:
                continue
            half = [q for q in o.params if q.requires_grad and q.dtype == dtype]
            if not half:
                continue
            fp16 = dtype == "float16"
            eps = o.defaults.get("eps")
            if fp16:
                msg = (
                    f"{p.name} runs {p.effective!r}: {name} ({o.class_name}) keeps {len(half)} parameters and its "
                    f"moments in fp16, where eps={eps!r} rounds to 0 and squared gradients below 2.4e-4 underflow: "
                    "the first small gradient divides by zero and the weights become inf/NaN."
                )
            else:
                msg = (
                    f"{p.name} runs {p.effective!r}: {name} ({o.class_name}) updates {len(half)} bf16 parameters "
                    "with bf16 moments, so every update smaller than about weight/256 is lost and training stalls "
                    "silently."
                )
            yield rule.finding(
                p.name,
                msg,
                {"precision": p.effective, "optimizer": o.class_path, "half_params": len(half), "eps": eps, "lr": o.defaults.get("lr")},
                _true_half_fixes(facts, p, o.class_name, o.defaults.get("lr"), fp16),
                severity=Severity.ERROR if fp16 else Severity.WARNING,
            )


def _planned_finding(facts: Facts, rule: Rule, p: LightningPrecisionFacts) -> Finding:
    """Before ``fit``: the optimizer ``configure_optimizers`` will build, read from its source, meets true-half weights."""
    fp16 = p.true_half == "float16"
    cls = p.planned_optimizer.rsplit(".", 1)[-1] if p.planned_optimizer else "Adam"
    harm = ("its moments in fp16, where eps=1e-8 rounds to 0 and squared gradients below 2.4e-4 underflow: the first "
            "small gradient divides by zero and the weights become inf/NaN" if fp16 else
            "bf16 moments and no fp32 master copy, so every update smaller than about weight/256 is lost and training "
            "stalls silently")  # fmt: skip
    return rule.finding(
        p.name,
        f"{p.name} runs {p.effective!r}: fit() casts the LightningModule's weights to {p.true_half}, and the {cls} "
        f"its configure_optimizers() builds then updates them with {harm}.",
        {"precision": p.effective, "optimizer": p.planned_optimizer, "read from": "configure_optimizers (source)"},
        _true_half_fixes(facts, p, cls, None, fp16),
        severity=Severity.ERROR if fp16 else Severity.WARNING,
    )


def mixed_in_place_fix(facts: Facts, p: LightningPrecisionFacts) -> Fix | None:
    """The Trainer's ``HalfPrecision`` plugin swapped in place for ``bf16-mixed``'s, its module back in fp32; None
    where the plugin is not one a swap keeps whole (a Fabric's, a strategy's own)."""
    if p.kind != "trainer" or p.plugin != "HalfPrecision" or p.true_half is None:
        return None
    half = p.true_half
    ids = frozenset(q.id for m in facts.models if m.name in p.model_names for q in m.tensors.params if q.dtype == half)
    device = p.device if p.device in ("cpu", "mps") else "cuda"
    code = (
        f"# before the next fit: the plugin Trainer(precision='bf16-mixed') builds, where {p.name} keeps it\n"
        "from lightning.pytorch.plugins.precision import MixedPrecision\n"
        f"plugin = MixedPrecision('bf16-mixed', {device!r})\n"
        f"{p.name}.strategy.precision_plugin = plugin\n"
        f"{p.name}._accelerator_connector.precision_plugin = plugin\n"
        f"{p.name}._accelerator_connector._precision_flag = 'bf16-mixed'"
        + (f"\n{p.name}.lightning_module.float()  # the last fit cast it to {half}" if ids else "")
    )
    return Fix(
        f"Give {p.name} the bf16-mixed precision plugin in place: fp32 weights and Adam state, bf16 compute",
        code,
        changes=(SetLightningPrecision(p.ref, p.name, "bf16-mixed", half, ids),),
        applicability=Applicability.UNSAFE,
        recipe="lightning-bf16-mixed-in-place",
        cost="twice the weight memory of true half; bf16 matmuls as before; the next fit runs as a bf16-mixed Trainer",
    )


def _rebuild_why(p: LightningPrecisionFacts, in_place: bool) -> str:
    if in_place:
        return "the same from the start, where the Trainer is built (the in-place fix does it on this one):"
    if p.kind == "fabric":
        return ("a Fabric's set-up modules chose their backward for the plugin they met (not swapped in place): "
                "build it again")
    return f"the {p.plugin} plugin belongs to its strategy (not swapped in place): build it again"


def _true_half_fixes(facts: Facts, p: LightningPrecisionFacts, cls: str, lr: object, fp16: bool) -> list[Fix]:
    in_place = mixed_in_place_fix(facts, p)
    return [
        *([in_place] if in_place is not None else []),
        rebuild_fix(
            p,
            "bf16-mixed",
            f"Build {p.name} with precision='bf16-mixed': fp32 weights and Adam state, bf16 compute",
            "twice the weight memory of true half; bf16 matmuls as before",
            _rebuild_why(p, in_place is not None),
        ),
        Fix(
            f"Keep {p.effective} weights and use a bf16-safe optimizer instead of {cls}",
            "# in configure_optimizers():\n"
            "from adamw_bf16 import AdamWBF16  # pip install adamw-bf16: stochastic rounding\n"
            f"return AdamWBF16(self.parameters(), lr={lr!r})"
            + ("\n# 16-true: also raise eps above fp16's 6e-8 (eps=1e-4), or prefer bf16-true" if fp16 else ""),
            applicability=Applicability.DISPLAY_ONLY,
            recipe="bf16-safe-optimizer",
            cost="no extra weight memory; the optimizer is re-created, so its state restarts",
        ),
    ]
