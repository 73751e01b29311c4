"""One coherent treatment per report: fixes planned together, by simulating them on the facts.

Checks offer fixes one finding at a time; two of them can pull in opposite
directions (cast a bf16 model's fp32 head to bf16; cast its bf16 weights to
fp32 for stock AdamW). Because facts are plain data and every fix is a plan of
:mod:`mpdoctor.rules.engine.changes` specs that can be simulated on them, the planner runs
the checks on the outcome of each candidate before anything is touched:

1. Score the findings: (errors, warnings, infos).
2. Among the fixes on offer, pick the one whose simulated outcome scores
   best (safe before unsafe, then the order the checks offered them), and
   only if it improves the score. Apply it to the simulated facts.
3. Repeat from the new simulated state until no fix improves it.

The chosen fixes, in order, are the plan (``Report.fixes``): applied one
after another they never undo each other. Every other fix is kept on its
finding as an alternative, with a note saying why it is not planned (the
plan already resolves its finding, or it would not improve the setup).
Work: at most a few rounds of the checks per fix on offer, all on plain data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .findings import Finding
from .fixes import Applicability, Fix

if TYPE_CHECKING:
    from ...facts import Facts

#: Bound on planning rounds (each round runs the checks once per fix on offer).
MAX_ROUNDS = 12


def score(findings: Sequence[Finding]) -> tuple[int, int, int]:
    """(errors, warnings, infos): lower is healthier."""
    counts = {"error": 0, "warning": 0, "info": 0}
    for f in findings:
        counts[f.severity] = counts.get(f.severity, 0) + 1
    return counts["error"], counts["warning"], counts["info"]


def _simulate(facts: Facts, fix: Fix) -> Facts:
    for spec in fix.changes:
        facts = spec.simulate(facts)
    return facts


def _key(f: Finding) -> tuple[str, str]:
    return (f.check, f.subject)


def _candidates(findings: list[Finding]) -> list[Fix]:
    out = []
    for f in findings:
        for fx in f.fixes:
            fx.finding_subject = f.subject
            if fx.changes and fx.applicability is not Applicability.DISPLAY_ONLY:
                out.append(fx)
    return out


def plan(facts: Facts, findings: list[Finding], run: Callable[[Facts], list[Finding]]) -> list[Fix]:
    """Choose the fixes to apply, in order; annotate every fix's ``planned`` and ``note``.

    Each round draws its candidates from the findings of the simulated state,
    so a fix chosen late is computed against what the earlier ones leave
    (the parameters a cast must cover after another cast, say).

    Parameters
    ----------
    facts
        The facts the findings were drawn from.
    findings
        What the checks found; their fix lists are updated in place so that a
        planned fix is the same object in ``finding.fixes`` and in the plan.
    run
        Runs the checks on (simulated) facts.

    Returns
    -------
    list of Fix
        The plan: apply in this order.
    """
    chosen, unsimulated, current = _greedy(facts, findings, run, admit=lambda fx: True)
    remaining = {_key(f) for f in current}
    planned_keys = {fx.key: fx for fx in chosen}
    plan_out = list(chosen)
    for f in findings:
        for i, fx in enumerate(list(f.fixes)):
            fx.finding_subject = f.subject
            if fx.applicability is Applicability.DISPLAY_ONLY:
                fx.planned, fx.note = False, "display-only: run its code where the objects are built"
            elif not fx.changes:  # built by hand with a live plan: planned as offered
                fx.planned, fx.note = True, ""
                if fx not in plan_out:
                    plan_out.append(fx)
            elif fx.key in planned_keys:
                match = planned_keys[fx.key]
                match.planned, match.note = True, ""
                f.fixes[i] = match
            else:
                fx.planned = False
                if _key(f) not in remaining:
                    resolver = next((c for c in chosen if _owns(findings, c) is not f), None)
                    fx.note = (
                        f"alternative: the planned fix '{resolver.title}' already resolves this finding"
                        if resolver is not None
                        else "alternative: the plan already resolves this finding"
                    )
                else:
                    fx.note = unsimulated.get(fx.key, "alternative: not planned, it would not make the setup healthier")
    return plan_out


def _greedy(
    facts: Facts, findings: list[Finding], run: Callable[[Facts], list[Finding]], admit: Callable[[Fix], bool]
) -> tuple[list[Fix], dict[tuple, str], list[Finding]]:
    """Rounds of "simulate every admitted fix, keep the one that helps most": the chosen fixes, the fixes whose
    outcome could not be simulated (with why), and the findings of the final simulated state."""
    chosen: list[Fix] = []
    unsimulated: dict[tuple, str] = {}
    state, current = facts, list(findings)
    for _round in range(MAX_ROUNDS):
        base = score(current)
        best: tuple | None = None
        for order, fx in enumerate(_candidates(current)):
            if fx.key in unsimulated or not admit(fx):
                continue
            try:
                after_facts = _simulate(state, fx)
                after = run(after_facts)
                after_facts, after, whole = _whole_chain(fx, state, current, after_facts, after, run)
            except Exception as exc:  # judged unplannable; it stays on offer as an alternative
                unsimulated[fx.key] = f"not planned: its outcome could not be simulated ({type(exc).__name__})"
                continue
            s = score(after)
            if s >= base:
                continue
            rank = (s, 0 if fx.safe else 1, order)
            if best is None or rank < best[0]:
                best = (rank, whole, after_facts, after)
        if best is None:
            break
        _rank, fx, state, current = best
        _swap(findings, fx)
        chosen.append(fx)
    return chosen, unsimulated, current


#: The check naming a floating input that meets weights of another dtype, and the recipe of its input cast.
INPUT_MISMATCH, INPUT_CAST = "batch-dtype-mismatch", "cast-inputs-hook"


def _input_casts(before: list[Finding], after: list[Finding]) -> tuple:
    """The input-cast changes offered by the input mismatches that ``after`` has and ``before`` had not."""
    had = {_key(f) for f in before if f.check == INPUT_MISMATCH}
    out: list = []
    for f in after:
        if f.check != INPUT_MISMATCH or _key(f) in had:
            continue
        cast = next((fx for fx in f.fixes if fx.recipe == INPUT_CAST and fx.changes), None)
        if cast is not None:
            out.extend(c for c in cast.changes if c not in out)
    return tuple(out)


def _whole_chain(fx: Fix, state: Facts, before: list[Finding], after_facts: Facts, after: list[Finding],
                 run: Callable[[Facts], list[Finding]]) -> tuple[Facts, list[Finding], Fix]:  # fmt: skip
    """The outcome of ``fx`` covering the inputs its casts meet: a plan never trades one dtype error for the next.

    A cast of a model's weights leaves its inputs' dtype (the simulation says so); when that makes an input
    meet weights of another dtype, the input cast those mismatches offer joins the fix, and so do the averaged
    copies that follow the cast: ``(facts, findings, the whole fix)``, the whole fix another value than ``fx``
    when anything joined it, the outcome judged with it.
    """
    extra = tuple(c for c in _input_casts(before, after) if c not in fx.changes)
    shadows = tuple(c for c in _shadow_followers(fx, state) if c not in fx.changes)
    if not extra and not shadows:
        return after_facts, after, fx
    for spec in extra + shadows:
        after_facts = spec.simulate(after_facts)
    return after_facts, run(after_facts), _with_followers(fx, extra, shadows)


def _swap(findings: list[Finding], whole: Fix) -> None:
    """Put ``whole`` (a chosen fix with the casts that joined it) where the fix of its key was offered."""
    for f in findings:
        for i, x in enumerate(f.fixes):
            if x is not whole and x.key == whole.key:
                f.fixes[i] = whole


def _shadow_followers(fx: Fix, state: Facts) -> tuple:
    """The averaging objects (EMA, ``AveragedModel``) whose online model ``fx`` casts: each keeps its shadow in fp32
    with an update that takes the cast model (:class:`KeepShadowFp32`), so the next ``update_parameters`` runs."""
    from .changes import CastParamsTo
    from .shadow_changes import KeepShadowFp32, shadow_fix_code

    cast = frozenset().union(*(c.param_ids for c in fx.changes if isinstance(c, CastParamsTo)))
    if not cast:
        return ()
    out = []
    for s in state.averaging:
        followed = [m for m in state.models if s.source is not None and (s.source == m.name or s.source.startswith(m.name + "."))]
        if any(cast & {p.id for p in m.tensors.params} for m in followed):
            out.append(KeepShadowFp32(s.ref, s.name, code=shadow_fix_code(s)))
    return tuple(out)


def _with_followers(fx: Fix, extra: tuple, shadows: tuple) -> Fix:
    """The chosen fix with the input casts and averaged copies its simulation needed (changes, title, code): another
    value (a fix is not changed once made)."""
    changes, title, code = tuple(fx.changes), fx._given_title, fx.code
    if shadows:  # the averaged copies follow the cast, so their next update keeps running
        changes += tuple(shadows)
        title += f", and keep {', '.join(c.label for c in shadows)} in fp32 so its update accepts the cast model"
        code += "".join(f"\n{c.code}" if c.code else f"\n# {c.label}: shadow cast to fp32, its update made per-tensor"
                        for c in shadows)  # fmt: skip
    if extra:
        changes += tuple(extra)
        dtypes = sorted({c.dtype for c in extra})
        title += f", and cast the floating inputs it meets to {', '.join(dtypes)}"
        code += "".join(f"\n{getattr(c, 'label', 'model')}.register_forward_pre_hook(cast_floating_inputs, "
                        "with_kwargs=True)  # its inputs follow the cast" for c in extra)  # fmt: skip
    return fx.replace(changes=changes, title=title, code=code)


def plan_safe(
    facts: Facts, findings: list[Finding], run: Callable[[Facts], list[Finding]], full_plan: Sequence[Fix]
) -> list[Fix]:
    """The best plan that uses safe fixes only: what "Apply all safe fixes" applies, in order.

    It is planned with the same simulator as :func:`plan`, on safe fixes alone, so a safe fix that the
    full plan leaves as an alternative (disable the scaler, when the full plan prefers an unsafe fp32
    cast that also resolves it) is still applied. When the full plan is safe throughout it is also the
    best safe plan (each round's best fix was safe), and it is returned as is.

    Parameters
    ----------
    facts, findings, run
        As for :func:`plan` (the findings' fixes are not annotated again).
    full_plan
        What :func:`plan` returned.

    Returns
    -------
    list of Fix
        Safe fixes, in the order to apply them; a fix that is in ``findings`` is that same object.
    """
    if all(fx.safe for fx in full_plan):
        return list(full_plan)
    chosen, _unsimulated, _current = _greedy(facts, findings, run, admit=lambda fx: fx.safe)
    offered = {fx.key: fx for f in findings for fx in f.fixes}
    out = [offered.get(fx.key, fx) for fx in chosen]
    # Fixes built by hand with a live plan are planned as offered (see plan()).
    out += [fx for fx in full_plan if fx.safe and not fx.changes and all(fx is not x for x in out)]
    return out


def _owns(findings: list[Finding], fx: Fix) -> Finding | None:
    return next((f for f in findings if any(x is fx for x in f.fixes)), None)
