"""The corpus's cure, proven on the user's failing step, through the API and through the widget's button.

A field case "fixed in place" is cured only when the very call that raised or did harm (same function, same
inputs) runs again after the fix and trains: a finite loss and parameters that moved (``steps.assert_step_trains``).
An inference case (``kind="inference"``: a pipeline's ``pipe(...)``, a ``generate()``) trains nothing: its cure is the
same call running and returning finite output (``assert_output_finite``).
A :class:`Case` holds what that proof needs: a builder of the user's objects as they stand right before the failing
step, the step itself, what it does before the fix, the diagnosis the user runs and the slug it must name.

Each proof builds the objects afresh (same builder, same seeds), as a user re-running the cell would: a step that
wrote NaN into the weights cannot be undone by any fix, so the failure and the cure are shown on twin objects.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from steps import assert_step_trains, snapshot

import mpdoctor
from mpdoctor.render.widget import ReportWidget, iter_widgets
from mpdoctor.rules.engine.fixes import Applicability, Fix

Namespace = dict[str, Any]


def _namespace_diagnosis(ns: Namespace) -> Any:
    return mpdoctor.diagnose(namespace=ns)


def _optimizer_params(ns: Namespace) -> list[torch.Tensor]:
    # The parameters the user's optimizer holds: what a training step must move.
    opts = [v for v in ns.values() if isinstance(v, torch.optim.Optimizer)]
    assert opts, "the namespace holds no optimizer: give the case its params"
    return [p for opt in opts for group in opt.param_groups for p in group["params"]]


@dataclass(frozen=True)
class Case:
    """One fixed-in-place field case, as the registry of cures holds it.

    Attributes
    ----------
    name : str
        The registry id, named in the fragment's ``verified on failing step`` column.
    source : str
        The fragment row's first source (``"pytorch/pytorch#8860"``).
    slug : str
        The check (or crash pattern) the diagnosis must name; its planned fixes are the cure.
    build : callable
        A fresh namespace: the user's objects right before the failing step.
    step : callable
        The failing step on that namespace (forward, backward, optimizer step); returns the loss.
    failure : str
        A regex the step's outcome before the fix matches (:func:`outcome`: the exception, ``loss is not finite``,
        ``changed no parameter``, or ``trains`` for a step whose harm is measured by ``harm``).
    diagnose : callable
        The diagnosis the user runs on the namespace (``diagnose(namespace=...)``, a probe of the batch, ...).
    params : callable or None
        The parameters the step must move (default: every parameter of the namespace's optimizers). None for a step
        that creates what it trains (an adapter the step adds): the step asserts itself that those parameters moved,
        and its loss must be finite.
    harm : callable or None
        Asserts the measured harm on the namespace (after the failing step), where the step itself runs.
    healed : callable or None
        Asserts the harm is gone after the cured step.
    recipe : str
        Only the planned fixes of this recipe are applied (empty: every planned fix of the slug).
    fixed_by : str
        The slug whose planned fix is the cure, where the plan treats two findings with one fix (empty: ``slug``).
    kind : str
        ``"training"`` (the step must train) or ``"inference"`` (the step must run and return finite output).
    """

    name: str
    source: str
    slug: str
    build: Callable[[], Namespace]
    step: Callable[[Namespace], Any]
    failure: str
    diagnose: Callable[[Namespace], Any] = _namespace_diagnosis
    params: Callable[[Namespace], list[torch.Tensor]] | None = _optimizer_params
    harm: Callable[[Namespace], None] | None = None
    healed: Callable[[Namespace], None] | None = None
    recipe: str = ""
    fixed_by: str = ""
    kind: str = "training"


def _tensors(out: Any) -> list[torch.Tensor]:
    # An inference call's output: a tensor, a tuple / list / dict of them, or a library's output object.
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _tensors(v)]
    if hasattr(out, "to_tuple"):  # transformers' / diffusers' ModelOutput / BaseOutput
        return _tensors(out.to_tuple())
    return []


def assert_output_finite(out: Any) -> None:
    """Fail unless an inference call returned at least one floating tensor and every value of them is finite."""
    floats = [t for t in _tensors(out) if t.is_floating_point()]
    assert floats, f"the call returned no floating tensor: {type(out).__name__}"
    assert all(bool(torch.isfinite(t).all()) for t in floats), "output is not finite"


def assert_loss_finite(loss: Any) -> None:
    """Fail unless a step that creates what it trains returned a finite loss."""
    assert isinstance(loss, torch.Tensor) and bool(torch.isfinite(loss).all()), f"loss is not finite: {loss}"


def outcome(case: Case, ns: Namespace) -> str:
    """What the failing step does on ``ns``: the exception it raises, ``loss is not finite``,
    ``changed no parameter``, ``output is not finite``, ``trains`` or, for an inference step, ``runs``."""
    params = list(case.params(ns)) if case.kind == "training" and case.params is not None else []
    before = snapshot(params)
    try:
        loss = case.step(ns)
    except Exception as exc:  # the reported error is the outcome being asserted
        return f"{type(exc).__name__}: {exc}"
    try:
        if case.kind == "inference":
            assert_output_finite(loss)
        elif case.params is None:
            assert_loss_finite(loss)
        else:
            assert_step_trains(loss, before, params)
    except AssertionError as exc:
        return str(exc)
    return "runs" if case.kind == "inference" else "trains"


def assert_broken(case: Case) -> None:
    """The real error or the measured harm, on a fresh namespace, before any fix."""
    ns = case.build()
    got = outcome(case, ns)
    assert re.search(case.failure, got, re.S), f"{case.name}: before the fix the step gave {got!r}"
    if case.harm is not None:
        case.harm(ns)


def planned(case: Case, report: Any) -> list[Fix]:
    """The plan's in-place fixes for the case's slug (of its recipe, when the case names one)."""
    assert report.findings_for(case.slug), f"{case.name}: {case.slug} not named; got {[f.check for f in report.findings]}"
    fixes = [
        f
        for f in report.fixes
        if f.slug == (case.fixed_by or case.slug) and f.applicability is not Applicability.DISPLAY_ONLY and f.recipe.startswith(case.recipe)
    ]
    assert fixes, f"{case.name}: no in-place fix planned for {case.slug}: {report.fixes}"
    return fixes


def assert_step_trains_now(case: Case, ns: Namespace) -> None:
    """The failing step, run again on the fixed objects, trains (an inference step: runs, finite output);
    the harm is gone."""
    if case.kind == "inference":
        assert_output_finite(case.step(ns))
    elif case.params is None:
        assert_loss_finite(case.step(ns))  # the step asserts that the parameters it created moved
    else:
        params = list(case.params(ns))
        before = snapshot(params)
        loss = case.step(ns)
        assert_step_trains(loss, before, params)
    if case.healed is not None:
        case.healed(ns)


def cure_through_api(case: Case) -> None:
    """Diagnose, apply the planned fixes with ``fix.apply()``, run the failing step again: it trains."""
    ns = case.build()
    fixes = planned(case, case.diagnose(ns))
    older = planned(case, case.diagnose(ns))  # the same plan in a report taken before (a card still on screen)
    assert not any(fix.in_place for fix in fixes), f"{case.name}: a fix that changes something said in place"
    for i, fix in enumerate(fixes):
        fix.apply()  # re-planned on the live objects first: one made unnecessary by an earlier fix does nothing
        assert fix.applied or (i > 0 and fix.note), f"{case.name}: {fix} did not apply: {fix.error}"
    # Its change made, the older report's fix would change nothing: it says so, and its card draws no button.
    missed = [old for old, fix in zip(older, fixes, strict=True) if fix.applied and not old.in_place]
    assert not missed, f"{case.name}: an applied change is not seen in place by the older report's fix: {missed}"
    assert_step_trains_now(case, ns)


def fix_buttons(rw: ReportWidget) -> list[tuple[Fix, Any]]:
    """Each in-place fix of the open findings with its button, in the order the widget draws them (two fixes that
    make the same change share one button)."""
    views = rw.report.view.data["findings"]
    fixes = {
        id(fx)
        for finding, view in zip(rw.report.findings, views)
        for fx, fv in zip(finding.fixes, view["fixes"])
        if fv.get("applicability") != "display-only" and not fv.get("in_place")
    }
    pairs = [(fx, button) for button, group in rw.fix_buttons for fx in group]
    assert {id(fx) for fx, _ in pairs} == fixes, [b.description for b, _ in rw.fix_buttons]
    assert all(b in list(iter_widgets(rw.findings_box)) for _, b in pairs)
    return pairs


def click_fix(rw: ReportWidget, key: tuple[str, str, str]) -> bool:
    """Click the button of the fix ``key`` (and confirm an unsafe one); False when no open finding offers it now."""
    found = [(fx, b) for fx, b in fix_buttons(rw) if fx.key == key]
    if not found:
        return False
    fix, button = found[0]
    applied = len(rw.applied)
    button.click()
    if not fix.safe:  # the first click arms it; the second, on the same button, confirms
        (armed,) = [b for fx, b in fix_buttons(rw) if fx.key == key and b.description.startswith("Click again to confirm")]
        armed.click()
    assert len(rw.applied) == applied + 1, f"the click applied nothing: {rw.status}"
    return True


def cure_through_widget(case: Case) -> None:
    """Diagnose, click each planned fix's button in the widget, run the failing step again: it trains."""
    ns = case.build()
    report = case.diagnose(ns)
    keys = [fix.key for fix in planned(case, report)]
    rw = report.widget()
    rw.confirm_delay = 0.0  # a test's second click is a confirmation, not the tail of a double-click
    clicked = [click_fix(rw, key) for key in keys]
    assert clicked[0], f"{case.name}: no button for the planned fix {keys[0]}"
    assert "failed" not in rw.status, rw.status
    assert_step_trains_now(case, ns)
