"""Checks on what happens between steps: an EMA / weight-averaging copy whose updates round away."""

from __future__ import annotations

from collections.abc import Iterator

from ...facts import Facts
from ...facts.intent import ShadowFacts
from ..engine.findings import Finding, Severity, count, size_delta
from ..engine.fixes import Fix
from ..engine.rules import Applicability, Rule
from ..engine.shadow_changes import KeepShadowFp32, lerp_update_code, shadow_fix_code
from . import check

#: A shadow that registers an update only where the online weight is this far (relative) from it has stopped.
_STOPPED = 0.5
#: Below this relative gap an update registers for ordinary training steps: no harm worth a warning.
_NOTICEABLE = 0.01


def _harm(s: ShadowFacts) -> str:
    low = "/".join(d for d in s.shadow_dtypes if d != "float32")
    gap = f"an update registers only where the online weight differs from the shadow by at least {s.min_gap:.0%} of its value"
    if s.lost_share is not None:
        return (
            f"one real update toward {s.source_name or s.source} (decay {s.decay}) leaves {s.lost_share:.0%} of the "
            f"{count(s.changed_in_fp32, 'element')} fp32 would change unchanged in {low}: {gap}"
        )
    return f"with decay {s.decay} in {low}, {gap}, so the average stops following {s.source_name or s.source or 'the model'}"


@check("low-precision-ema", Severity.ERROR, Severity.WARNING, fix_safety=(Applicability.SAFE, Applicability.DISPLAY_ONLY))
def low_precision_ema(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """An EMA / weight-averaging copy kept in bf16 or fp16, whose updates round away.

    What it does
        Reads every averaging object (torch's ``AveragedModel``, diffusers'
        ``EMAModel``, ema-pytorch's ``EMA``, timm's ``ModelEmaV2`` / ``ModelEmaV3``,
        held directly or inside a model;
        and a model the user's own code averages into, read from the notebook's
        cells or the script: ``ema_p.lerp_(p, 1 - decay)`` or
        ``ema_p.mul_(decay).add_(p, alpha=1 - decay)`` over
        ``zip(ema.parameters(), model.parameters())``, or into a dict of
        shadow tensors over ``model.named_parameters()``, the decay resolved
        from the code or the namespace) whose shadow tensors are bf16 or fp16, and measures what one update
        ``s + (1 - decay) * (p - s)`` loses: on copies of the shadow and of the
        online model's parameters, the update is computed in fp32 and rounded
        once to the shadow's dtype; an element is lost when fp32 changes it and
        the rounded result is the old value. Without the online model, it
        states the exact bound: an update registers only where ``|p - s|`` is
        at least ``eps / 4 / (1 - decay)`` of the weight.
    Why is this bad?
        bf16 keeps 8 significant bits: with decay 0.999 an update of a weight
        registers only where the online weight differs from the shadow by about
        twice its own value, so the EMA never moves from its first copy; the
        weights saved and sampled from are the initial ones. fp16 (11 bits)
        fails the same way at decay 0.9999. timm's ``ModelEmaV3`` rounds a
        bf16 shadow's updates stochastically (its default): they register in
        expectation, and it is not reported; an fp16 shadow, or
        ``stochastic_rounding=False``, is.
    Example
        unet.to(torch.bfloat16)
        ema_unet = EMAModel(unet.parameters(), decay=0.9999)  # shadow_params copied in bf16
        ...
        ema_unet.step(unet.parameters())  # rounds back to the same values
    Use instead
        unet.to(torch.bfloat16)
        ema_unet = EMAModel(unet.parameters(), decay=0.9999)
        ema_unet.to(dtype=torch.float32)  # the shadow in fp32: each update registers
    Fix safety
        Safe: cast the shadow tensors to fp32 in place (a widening, exact);
        where the library's update takes one dtype on both sides (ema-pytorch
        without ``coerce_dtype``, ``AveragedModel`` with a ``multi_avg_fn``,
        whose ``torch._foreach_lerp_`` raises ``expected dtype float for `end`
        but got dtype c10::BFloat16``), the fix also makes it cast the online
        weights (``coerce_dtype=True``; the per-tensor ``avg_fn`` with the same
        decay). Undo restores the tensors and the functions exactly. For a
        hand-written ``mul_`` / ``add_`` update the cast alone is the fix
        (``add_`` promotes the bf16 weights into the fp32 shadow); a
        hand-written ``lerp_`` takes one dtype, so that fix is display-only:
        the cast, and the user's line lerping toward ``p.float()``.
    Severity
        Error when most updates are lost (measured share at least 50%, or,
        unmeasured, an update needs a gap of half the weight); warning when an
        update needs a gap of at least 1% of the weight.
    Sources
        d8ahazard/sd_dreambooth_extension pull requests #1415 and #1417 ("almost
        all EMA weight updates get rounded down to 0"); lucidrains/ema-pytorch
        pull request #18 and issue #36; NUS-HPC-AI-Lab/VideoSys pull request #6
        ("use fp32 for ema model"); konpatp/diffae issue #16 (a hand-written
        EMA at decay 0.9999 in fp16).
    """
    for s in facts.averaging:
        if not s.low_elements or s.min_gap is None:
            continue
        if s.stochastic_rounding and set(s.shadow_dtypes) <= {"bfloat16", "float32"}:
            continue  # each bf16 update is rounded stochastically: it registers in expectation
        measure = s.lost_share if s.lost_share is not None else s.min_gap  # measured harm first, else the exact bound
        if measure < _NOTICEABLE:
            continue
        stopped = measure >= _STOPPED
        low = "/".join(d for d in s.shadow_dtypes if d != "float32")
        # A hand-written lerp_ takes one dtype: an fp32 shadow needs the user's own line changed too.
        in_place = not (s.kind == "hand-written" and s.update_op == "lerp_")
        fix = Fix(
            f"Keep the shadow of {s.name} in fp32",
            shadow_fix_code(s),
            changes=(KeepShadowFp32(s.ref, s.name),) if in_place else (),
            applicability=Applicability.SAFE if in_place else Applicability.DISPLAY_ONLY,
            backup_bytes=2 * s.low_elements,
            recipe="keep-shadow-fp32",
            cost=f"{size_delta(2 * s.low_elements)} of shadow weights",
        )
        yield rule.finding(
            s.name,
            f"{s.name} averages into {low} shadow tensors ({s.shadow_path}): {_harm(s)}.",
            {
                "update": f"{s.update_where}: {s.update_line}" if s.update_line else None,
                "shadow": s.shadow_path,
                "shadow_dtypes": list(s.shadow_dtypes),
                "shadow_elements": s.shadow_elements,
                "decay": s.decay,
                "online_model": s.source_name or s.source,
                "lost_share": s.lost_share,
                "changed_in_fp32": s.changed_in_fp32,
                "min_gap": s.min_gap,
            },
            [fix],
            severity=Severity.ERROR if stopped else Severity.WARNING,
        )


#: The shadow dtypes a cast to fp32 cures.
LOW_DTYPES = frozenset({"bfloat16", "float16"})
#: How torch's ``lerp_`` names a dtype in its error (``c10::toString`` of the scalar type).
_TORCH_DTYPE_WORDS = {"float32": "float", "float64": "double", "bfloat16": "c10::BFloat16", "float16": "c10::Half"}


def lerp_error(shadow: str, online: str) -> str:
    """The error ``shadow_tensor.lerp_(online_tensor, w)`` raises, as torch words it."""
    word = _TORCH_DTYPE_WORDS
    return f"expected dtype {word.get(shadow, shadow)} for `end` but got dtype {word.get(online, online)}"


@check("ema-update-dtype-mismatch", Severity.ERROR, fix_safety=(Applicability.SAFE, Applicability.DISPLAY_ONLY))
def ema_update_dtype_mismatch(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """An fp32 EMA / averaged copy of a lower-precision model whose update takes one dtype: it raises.

    What it does
        An averaging object whose update runs ``lerp_`` on the shadow and the
        online weights as they are (a hand-written ``ema_p.lerp_(p, 1 - decay)``
        over ``zip(ema.parameters(), model.parameters())``; ema-pytorch's ``EMA`` without
        ``coerce_dtype``; ``AveragedModel`` with a ``multi_avg_fn``, which
        groups the tensors for ``torch._foreach_lerp_``), while the online
        model it follows holds another dtype than the shadow: an fp32 EMA of a
        model DeepSpeed or ``.to(torch.bfloat16)`` made bf16.
    Why is this bad?
        The fp32 shadow is right (a bf16 one loses its updates), but
        ``lerp_`` takes one dtype: the first update raises ``expected dtype
        float for `end` but got dtype c10::BFloat16``.
    Example
        ema = EMA(model, beta=0.999)  # built while the model was fp32
        model.to(torch.bfloat16)       # or DeepSpeed's bf16 engine
        ema.update()                   # raises
    Use instead
        ema = EMA(model, beta=0.999, coerce_dtype=True)  # casts the online weights to the shadow's dtype
    Fix safety
        Safe: keep the shadow in fp32 (it already is) and make the update cast
        the online weights (``coerce_dtype=True`` with the update functions
        rebuilt; the per-tensor ``avg_fn`` with the same decay). Undo restores
        the functions exactly. A hand-written ``ema_p.lerp_(p, 1 - decay)``
        (read from the cells or the script) is the user's own line: the fix is
        display-only, their function or loop lerping toward ``p.float()``.
    Severity
        Error: the update raises.
    Sources
        lucidrains/ema-pytorch issue #36 ("expected dtype float for `end` but
        got dtype c10::BFloat16", with DeepSpeed bf16; "the solution is to set
        `coerce_dtype=True`").
    """
    for s in facts.averaging:
        if not s.same_dtype_update or not s.source_dtypes or set(s.source_dtypes) == set(s.shadow_dtypes):
            continue
        shadow, online = "/".join(s.shadow_dtypes), "/".join(s.source_dtypes)
        # A low-precision shadow of an fp32 model: the shadow cast to fp32 (in place) makes the update's two dtypes
        # one, the user's line unchanged. An fp32 shadow of a low-precision model: only the update can cast.
        low_shadow = set(s.shadow_dtypes) <= LOW_DTYPES and set(s.source_dtypes) == {"float32"}
        hand = s.kind == "hand-written" and not low_shadow  # the user's own lerp_: only their line can cast
        fix = Fix(
            f"Keep {s.name}'s shadow in fp32" if low_shadow else f"Make {s.name}'s update cast the online weights",
            lerp_update_code(s) if hand else shadow_fix_code(s, with_update=not low_shadow),
            changes=() if hand else (KeepShadowFp32(s.ref, s.name),),
            applicability=Applicability.DISPLAY_ONLY if hand else Applicability.SAFE,
            backup_bytes=0 if hand else 2 * s.low_elements,
            recipe="keep-shadow-fp32",
        )
        update = f"your update ({s.update_where}: {s.update_line})" if s.kind == "hand-written" else "its update"
        yield rule.finding(
            s.name,
            f"{s.name} keeps a {shadow} shadow ({s.shadow_path}) of {s.source_name or s.source}, which is {online}, and {update} lerps "
            f"the two as they are: the next update raises {lerp_error(s.shadow_dtypes[0], s.source_dtypes[0])!r}.",
            {"shadow": s.shadow_path, "shadow_dtypes": list(s.shadow_dtypes), "online_model": s.source_name or s.source,
             "online_dtypes": list(s.source_dtypes), "update": f"{s.update_where}: {s.update_line}" if hand else None},
            [fix],
            severity=Severity.ERROR,
        )
