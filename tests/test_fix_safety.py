"""Fixes cannot lose data: atomic on failure, exact undo, idempotent, optimizer still wired.

Every fix that any check offers on any scenario (tests/scenarios.py), on the
live machine and on the T4 and A100 what-if profiles, is enumerated on first
use from the session's shared diagnoses (``shared_diagnosis``: read, never
applied; not at collection), so fixes added by new checks are covered without
editing this file.
The tests run per broken scenario, over each of its fixes. For each one:

- undo after apply restores the fingerprint exactly (dtype-narrowing fixes too),
  and the refreshed report no longer shows the finding while applied;
- after apply the optimizers hold the very same Parameter objects as the
  models, and one real training step runs with a finite loss (or, where the
  scenario's step already failed before the fix for another reason, fails no
  worse);
- applying a safe fix twice (the same Fix again, and the matching Fix of a
  second report taken before the first was applied) equals applying it once;
- fault injection: the n-th ``mpdoctor.objects.edits.steps.cast_tensor`` call raising
  ``torch.OutOfMemoryError``, for every n; the k-th change of the plan
  raising (also KeyboardInterrupt); the verification step failing: each
  leaves the fingerprint bit-identical, raises FixFailed (KeyboardInterrupt
  stays KeyboardInterrupt) and leaves ``fix.error`` saying it failed and why.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from fingerprint import Fingerprint, assert_unchanged, fingerprint
from scenarios import BY_NAME, SCENARIOS, gemma3_train_nested_cache, reset_accelerate, shared_diagnosis
from setups import batch, train_step

import mpdoctor
import mpdoctor.objects.edits.steps as fixes_mod
from mpdoctor.rules.engine.fixes import Applicability, Fix, FixFailed

TARGETS = (None, "T4", "A100")


def oom(message: str) -> BaseException:
    """The error a real CUDA allocation raises (constructible on CPU-only torch)."""
    try:
        return torch.OutOfMemoryError(message)
    except Exception:  # very old torch: the message is what tells the cause
        return RuntimeError(f"CUDA out of memory. {message}")


@dataclass(frozen=True)
class FixCase:
    """One fix offered on one scenario (under one target), found again by its key in a fresh build."""

    scenario: str
    target: str | None
    check: str
    subject: str
    title: str
    safe: bool
    index: int  # among fixes with the same key

    @property
    def id(self) -> str:
        return f"{self.scenario}|{self.target or 'live'}|{self.check}|{self.title}"


def _key(finding: Any, fix: Fix) -> tuple[str, str, str]:
    return (finding.check, finding.subject, fix.title)


def _keyed_fixes(report: mpdoctor.Report) -> list[tuple[tuple[str, str, str], int, Fix]]:
    counts: dict[tuple, int] = {}
    out = []
    for finding in report.findings:
        for fix in finding.fixes:
            if fix.applicability is Applicability.DISPLAY_ONLY:
                continue  # nothing to apply: its code is what to run (tested in test_treatment.py)
            key = _key(finding, fix)
            out.append((key, counts.get(key, 0), fix))
            counts[key] = counts.get(key, 0) + 1
    return out


class _saved_process_state:
    """A build outside a test (the baseline step): keep its environment variables and accelerate state out of the
    session."""

    def __enter__(self):
        self.env = dict(os.environ)

    def __exit__(self, *exc):
        os.environ.clear()
        os.environ.update(self.env)
        reset_accelerate()
        return False


@functools.cache
def fix_cases() -> tuple[FixCase, ...]:
    """Every fix offered on every scenario under every target.

    A fix of an object in the scenario is kept once per scenario (the first
    target offering it wins); a fix of process-wide state (TF32 flags, the
    environment), whose subject is no variable of the namespace, once overall.
    """
    cases: list[FixCase] = []
    seen: set[tuple] = set()
    for scenario in SCENARIOS:
        # Only read (the fixes' keys): diagnose() changes nothing (test_no_mutation), so one build serves every target.
        diagnosed = shared_diagnosis(scenario.name, TARGETS)
        for target in TARGETS:
            for key, index, fix in _keyed_fixes(diagnosed.report(target)):
                owner = key[1].split(".", 1)[0].split("[", 1)[0]
                where = scenario.name if owner in diagnosed.names else "<process>"
                if (where, key, index) in seen:
                    continue
                seen.add((where, key, index))
                cases.append(FixCase(scenario.name, target, *key, fix.safe, index))
    return tuple(cases)


#: The scenarios the fixes are tested on: a healthy one offers none (its own test says so).
BROKEN = tuple(s.name for s in SCENARIOS if not s.healthy)


def cases_of(scenario: str) -> tuple[FixCase, ...]:
    """The fix cases of ``scenario``; a broken scenario offers at least one fix that can be applied."""
    cases = tuple(c for c in fix_cases() if c.scenario == scenario)
    assert cases, f"{scenario}: no fix to apply (a scenario offering only display-only fixes belongs in test_treatment)"
    return cases


@dataclass
class Live:
    """A fresh build of a case's scenario, its report and the fix of the case."""

    case: FixCase
    ns: dict
    report: mpdoctor.Report
    fix: Fix

    def fingerprint(self) -> Fingerprint:
        return fingerprint(self.ns)

    def finding_still_reported(self) -> bool:
        again = self.report.refresh()
        return any((f.check, f.subject) == (self.case.check, self.case.subject) for f in again.findings)


def live(case: FixCase) -> Live:
    ns = BY_NAME[case.scenario].build()
    report = mpdoctor.diagnose(namespace=ns, target=case.target)
    return Live(case, ns, report, find_fix(report, case))


def find_fix(report: mpdoctor.Report, case: FixCase) -> Fix:
    for key, index, fix in _keyed_fixes(report):
        if key == (case.check, case.subject, case.title) and index == case.index:
            return fix
    raise AssertionError(f"{case.id}: the fix is not offered on a fresh build (titles must be deterministic)")


# -- models, optimizers and a training step --------------------------------------------------------


def _models_and_optimizers(ns: dict) -> tuple[list[torch.nn.Module], list[torch.optim.Optimizer]]:
    models, opts = [], []
    for value in ns.values():
        if isinstance(value, torch.nn.Module):
            models.append(value)
        elif isinstance(value, torch.optim.Optimizer):
            opts.append(getattr(value, "optimizer", value))
        elif type(value).__name__ == "Trainer":
            models.append(value.model)
            if value.optimizer is not None:
                opts.append(getattr(value.optimizer, "optimizer", value.optimizer))
    return models, opts


def optimizer_wiring(ns: dict) -> list[list[int]]:
    """``id`` of every parameter of every optimizer group, in order."""
    _, opts = _models_and_optimizers(ns)
    return [[id(p) for p in group["params"]] for opt in opts for group in opt.param_groups]


def assert_optimizers_hold_the_models_parameters(ns: dict, wiring_before: list[list[int]], what: str) -> None:
    models, opts = _models_and_optimizers(ns)
    model_params = {id(p) for m in models for p in m.parameters()}
    assert optimizer_wiring(ns) == wiring_before, f"{what}: an optimizer's parameter list changed"
    for opt in opts:
        for group in opt.param_groups:
            for p in group["params"]:
                assert id(p) in model_params, f"{what}: {type(opt).__name__} holds a parameter no model owns"
                assert isinstance(p, torch.nn.Parameter)


@functools.cache
def baseline_step(scenario: str) -> tuple[str, str]:
    """How the scenario's training step ends before any fix: ``("ok", "")`` or ``("error", type)``."""
    with _saved_process_state():
        reset_accelerate()
        ns = BY_NAME[scenario].build()
        try:
            loss = BY_NAME[scenario].step(ns)
        except Exception as exc:
            return "error", type(exc).__name__
    return ("ok", "") if math.isfinite(loss) else ("error", "non-finite loss")


_PRECISION_BACKENDS = ("backends", "backends.cuda.matmul", "backends.cudnn", "backends.mkldnn", "backends.mkldnn.matmul")


def _backend(name: str) -> Any:
    obj = torch
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.fixture(autouse=True)
def _restore_process_state():
    """Fixes may change process-wide state (environment, TF32): leave none of it to the next test."""
    with process_state_kept():
        yield


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """Restore the environment, the TF32 flags, the RNG and accelerate's state afterwards (each case of a
    scenario starts from the same process state, as each test does)."""
    env = dict(os.environ)
    legacy = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    precisions = {}
    for name in _PRECISION_BACKENDS:
        try:
            precisions[name] = _backend(name).fp32_precision
        except AttributeError:  # torch before the per-backend API
            pass
    rng = torch.get_rng_state()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(env)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = legacy
        for name, value in precisions.items():  # parents first: setting a parent resets nothing below it
            _backend(name).fp32_precision = value
        torch.set_rng_state(rng)
        reset_accelerate()


def each_case(scenario: str, cases: tuple[FixCase, ...] | None = None) -> Iterator[FixCase]:
    """The cases of ``scenario`` (or ``cases``), each run in a process state restored afterwards."""
    for case in cases if cases is not None else cases_of(scenario):
        with process_state_kept():
            yield case


# -- undo ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", BROKEN)
def test_undo_after_apply_restores_the_fingerprint_exactly(scenario):
    for case in each_case(scenario):
        _undo_restores_the_fingerprint(case)


def _undo_restores_the_fingerprint(case: FixCase) -> None:
    lv = live(case)
    before = lv.fingerprint()
    lv.fix.apply(confirm=True)
    assert lv.fix.applied and lv.fix.error is None
    after = lv.fingerprint()
    assert after != before, f"{case.id}: applying the fix changed nothing"
    assert not lv.finding_still_reported(), f"{case.id}: the finding is still reported after the fix"
    lv.fix.undo()
    assert not lv.fix.applied
    assert_unchanged(before, lv.fingerprint(), f"{case.id}: apply then undo")
    assert lv.finding_still_reported(), f"{case.id}: the finding is gone after undo"


# -- optimizer identity and a training step --------------------------------------------------------


@pytest.mark.parametrize("scenario", BROKEN)
def test_after_the_fix_optimizers_hold_the_models_own_parameters_and_a_step_runs(scenario):
    for case in each_case(scenario):
        _fixed_setup_keeps_its_optimizers_and_trains(case)


def _fixed_setup_keeps_its_optimizers_and_trains(case: FixCase) -> None:
    baseline = baseline_step(case.scenario)
    lv = live(case)
    wiring = optimizer_wiring(lv.ns)
    lv.fix.apply(confirm=True)
    assert_optimizers_hold_the_models_parameters(lv.ns, wiring, case.id)
    try:
        loss = BY_NAME[case.scenario].step(lv.ns)
    except Exception as exc:
        # The step may only fail where it already failed before the fix, for the same reason.
        assert baseline == ("error", type(exc).__name__), f"{case.id}: the step raised {exc!r} after the fix (before: {baseline})"
        return
    assert math.isfinite(loss), f"{case.id}: non-finite loss {loss} after the fix"
    assert_optimizers_hold_the_models_parameters(lv.ns, wiring, f"{case.id} after a step")


# -- idempotence --------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", BROKEN)
def test_applying_a_fix_twice_equals_applying_it_once(scenario):
    """Required of safe fixes; checked for unsafe ones too (confirm=True stands for the second click)."""
    for case in each_case(scenario):
        _second_application_changes_nothing(case)


def _second_application_changes_nothing(case: FixCase) -> None:
    lv = live(case)
    stale = find_fix(mpdoctor.diagnose(namespace=lv.ns, target=case.target), case)  # taken before the first apply
    assert not stale.in_place and not lv.fix.in_place, f"{case.id}: a fix that would change something said in place"
    lv.fix.apply(confirm=True)
    once = lv.fingerprint()
    # The older report's fix now changes nothing: it says so (its card shows it in place, with no button).
    assert stale.in_place, f"{case.id}: the same fix from an older report, its change made, is not seen in place"
    assert not lv.fix.in_place, f"{case.id}: an applied fix shows as applied (with Undo), not as in place"
    lv.fix.apply(confirm=True)
    assert_unchanged(once, lv.fingerprint(), f"{case.id}: the same fix applied again")
    stale.apply(confirm=True)
    assert_unchanged(once, lv.fingerprint(), f"{case.id}: the same fix from an older report applied after it")
    assert not lv.finding_still_reported()
    stale.undo()  # it found nothing left to change, so it has nothing to restore
    assert_unchanged(once, lv.fingerprint(), f"{case.id}: undoing the no-op second application")


@pytest.mark.parametrize("scenario", BROKEN)
def test_apply_safe_fixes_twice_equals_once_and_leaves_no_safe_fix(scenario):
    ns = BY_NAME[scenario].build()
    before = fingerprint(ns)
    first, second = mpdoctor.diagnose(namespace=ns), mpdoctor.diagnose(namespace=ns)
    applied = first.apply_safe_fixes()
    once = fingerprint(ns)
    if not any(c.safe for c in cases_of(scenario)):
        assert not applied, f"{scenario}: apply_safe_fixes() applied a fix where none is safe"
        assert_unchanged(before, once, f"{scenario}: apply_safe_fixes() with no safe fix")
        return
    assert applied
    second.apply_safe_fixes()
    assert_unchanged(once, fingerprint(ns), f"{scenario}: apply_safe_fixes() on a second report")
    assert not [f.title for f in first.refresh().fixes if f.safe]
    assert not [f.error for f in first.fixes + second.fixes if f.error]


# -- fault injection: allocation --------------------------------------------------------------------


def _count_casts(monkeypatch: pytest.MonkeyPatch, lv: Live, before: Fingerprint) -> tuple[int, bool]:
    """Apply and undo the case's fix once: how many mpdoctor.objects.edits.steps.cast_tensor calls it made, and whether it
    changed any tensor's dtype from ``before``."""
    calls = []
    real = fixes_mod.cast_tensor

    def counting(tensor, dtype):
        calls.append(1)
        return real(tensor, dtype)

    with monkeypatch.context() as m:
        m.setattr(fixes_mod, "cast_tensor", counting)
        lv.fix.apply(confirm=True)
    changed_dtypes = _dtypes(before) != _dtypes(lv.fingerprint())
    lv.fix.undo()
    return len(calls), changed_dtypes


def _dtypes(fp: Fingerprint) -> dict:
    return {k: dict(v[1])["dtype"] for k, v in fp.items() if isinstance(v, tuple) and v and v[0] == "tensor"}


@pytest.mark.parametrize("scenario", BROKEN)
def test_a_cast_failing_at_any_allocation_leaves_everything_bit_identical(scenario, monkeypatch):
    """Each casting fix, failing at each of its allocations; a fix that does not cast (a recomputed buffer, a
    flag) applies and undoes while every cast_tensor call would fail. Whether a fix casts is seen on the
    test's own build, by that apply: a fix that calls cast_tensor goes on to fail at each allocation."""
    for case in each_case(scenario):
        lv = live(case)
        before = lv.fingerprint()
        if not _applies_without_casting(lv, before, monkeypatch):
            n_casts, changed_dtypes = _count_casts(monkeypatch, lv, before)
            assert_unchanged(before, lv.fingerprint(), f"{case.id}: apply + undo while counting")
            _cast_failing_at_each_allocation(lv, before, n_casts, changed_dtypes, monkeypatch)


def _applies_without_casting(lv: Live, before: Fingerprint, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Apply the case's fix while every cast_tensor call fails: a fix that does not cast applies, and undo restores
    the fingerprint. False when the fix did call cast_tensor (a casting fix), after checking it rolled back."""
    case = lv.case
    calls = []

    def failing(tensor, dtype):
        calls.append(1)
        raise oom("a fix that does not cast allocated through cast_tensor")

    with monkeypatch.context() as m:
        m.setattr(fixes_mod, "cast_tensor", failing)
        try:
            lv.fix.apply(confirm=True)
        except FixFailed:
            if not calls:  # it failed for another reason than the allocation this test refused
                raise
    if calls:
        assert not lv.fix.applied, f"{case.id}: applied although its first allocation failed"
        assert_unchanged(before, lv.fingerprint(), f"{case.id}: the first allocation failed")
        return False
    assert lv.fix.applied and lv.fix.error is None, f"{case.id}: {lv.fix.error}"
    lv.fix.undo()
    assert_unchanged(before, lv.fingerprint(), f"{case.id}: apply then undo")
    return True


def _cast_failing_at_each_allocation(
    lv: Live, before: Fingerprint, n_casts: int, changed_dtypes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = lv.case
    assert changed_dtypes, f"{case.id}: a casting fix changed no dtype"
    assert n_casts > 0, f"{case.id}: the fix changes dtypes without allocating through mpdoctor.objects.edits.steps.cast_tensor"
    real = fixes_mod.cast_tensor
    for n in range(1, n_casts + 1):
        calls = []

        def failing(tensor, dtype, n=n, calls=calls):
            calls.append(1)
            if len(calls) == n:
                raise oom(f"injected at allocation {n} of {n_casts}")
            return real(tensor, dtype)

        with monkeypatch.context() as m:
            m.setattr(fixes_mod, "cast_tensor", failing)
            with pytest.raises(FixFailed) as info:
                lv.fix.apply(confirm=True)
        assert not lv.fix.applied
        assert f"injected at allocation {n} of {n_casts}" in lv.fix.error and "OutOfMemoryError" in lv.fix.error
        assert "rolled back" in lv.fix.error and "rolled back" in str(info.value)
        assert_unchanged(before, lv.fingerprint(), f"{case.id}: allocation {n} of {n_casts} failed")
    assert f"[failed: {lv.fix.error}" in lv.report.to_text()
    lv.fix.apply(confirm=True)  # a failed attempt does not poison the fix
    assert lv.fix.applied and lv.fix.error is None
    lv.fix.undo()
    assert_unchanged(before, lv.fingerprint(), f"{case.id}: apply + undo after the failed attempts")


# -- fault injection: any step of the plan ----------------------------------------------------------


def _plan_failing_at(fix: Fix, k: int, exc: BaseException):
    plan = fix._plan

    def failing_plan():
        changes = plan()
        target = changes[k - 1]

        def refuse():
            raise exc

        target.apply = refuse
        return changes

    return failing_plan


@pytest.mark.parametrize("scenario", BROKEN)
def test_a_failure_at_any_step_of_the_plan_rolls_back_the_steps_before_it(scenario, monkeypatch):
    for case in each_case(scenario):
        _failure_at_each_step_rolls_back(case, monkeypatch)
        monkeypatch.undo()


def _failure_at_each_step_rolls_back(case: FixCase, monkeypatch: pytest.MonkeyPatch) -> None:
    lv = live(case)
    before = lv.fingerprint()
    steps = len(lv.fix.preview())
    assert steps >= 1
    for k in range(1, steps + 1):
        monkeypatch.setattr(lv.fix, "_plan", _plan_failing_at(lv.fix, k, RuntimeError(f"injected at step {k}")))
        with pytest.raises(FixFailed):
            lv.fix.apply(confirm=True)
        assert not lv.fix.applied and f"injected at step {k}" in lv.fix.error
        assert_unchanged(before, lv.fingerprint(), f"{case.id}: step {k} of {steps} failed")
        monkeypatch.setattr(lv.fix, "_plan", _plan_failing_at(lv.fix, k, KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            lv.fix.apply(confirm=True)
        assert_unchanged(before, lv.fingerprint(), f"{case.id}: KeyboardInterrupt at step {k} of {steps}")
        monkeypatch.undo()
    # The changes all succeed but the fix's own verification says they did not take.
    monkeypatch.setattr(lv.fix, "_verify", lambda: "injected verification failure")
    with pytest.raises(FixFailed, match="injected verification failure"):
        lv.fix.apply(confirm=True)
    assert_unchanged(before, lv.fingerprint(), f"{case.id}: verification failed")


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.healthy], ids=lambda s: s.name)
def test_healthy_controls_have_no_error_no_warning_and_no_fix_on_the_live_machine(scenario):
    report = shared_diagnosis(scenario.name).report()  # read only; the step below runs on a build of its own
    assert report.ok, [(f.check, f.message) for f in report.findings]
    assert not report.fixes
    assert math.isfinite(scenario.step(scenario.build()))


# -- real objects that refuse a change ----------------------------------------------------------------


def test_a_config_refusing_the_second_setattr_rolls_back_the_first():
    """Gemma3's cache fix sets text_config then generation_config; the latter refuses via a property."""
    ns = gemma3_train_nested_cache()
    model = ns["model"]
    generation_config = model.generation_config
    base = type(generation_config)

    class ReadOnlyCacheFlag(base):
        @property
        def use_cache(self):
            return self.__dict__["use_cache"]

        @use_cache.setter
        def use_cache(self, value):
            raise PermissionError("use_cache is read-only here")

    generation_config.__class__ = ReadOnlyCacheFlag
    report = mpdoctor.diagnose(namespace=ns)
    (fix,) = report.findings_for("cache-in-training")[0].fixes
    assert len(fix.preview()) == 2
    before = fingerprint(ns)
    with pytest.raises(FixFailed, match="read-only"):
        fix.apply()
    assert "PermissionError" in fix.error
    assert model.config.text_config.use_cache is True
    assert_unchanged(before, fingerprint(ns), "a refused setattr")


class RefusingStateDict(dict):
    """An optimizer state entry that refuses new values once armed (a real dict subclass)."""

    armed = False

    def __setitem__(self, key, value):
        if RefusingStateDict.armed:
            raise RuntimeError("state refuses the new tensor")
        super().__setitem__(key, value)


def test_a_cast_whose_swap_fails_half_way_restores_every_parameter(monkeypatch):
    """Phase 2 (swapping references) failing after some parameters were swapped leaves nothing swapped."""
    ns = BY_NAME["fp16_params_with_scaler"].build()
    model, opt = ns["model"], ns["opt"]
    last = list(model.parameters())[-1]
    opt.state[last] = RefusingStateDict(opt.state[last])
    report = mpdoctor.diagnose(namespace=ns)
    (fix,) = report.findings_for("fp16-trainable-params-with-scaler")[0].fixes
    before = fingerprint(ns)
    monkeypatch.setattr(RefusingStateDict, "armed", True)
    with pytest.raises(FixFailed, match="state refuses"):
        fix.apply(confirm=True)
    monkeypatch.setattr(RefusingStateDict, "armed", False)
    assert_unchanged(before, fingerprint(ns), "a swap failing half way")
    assert all(p.dtype == torch.float16 for p in model.parameters())
    fix.apply(confirm=True)
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    assert math.isfinite(train_step(model, opt, batch(), scaler=ns["scaler"]))


def test_an_undo_that_cannot_restore_one_step_still_restores_the_others_and_says_so():
    ns = BY_NAME["bf16_model_with_enabled_scaler"].build()
    report = mpdoctor.diagnose(namespace=ns)
    (fix,) = report.findings_for("cache-in-training")[0].fixes
    before = fingerprint(ns)
    fix.apply()
    first, second = fix._done

    def refuse():
        raise RuntimeError("cannot restore")

    second.revert = refuse
    with pytest.raises(FixFailed, match="cannot restore"):
        fix.undo()
    assert not fix.applied and "undo could not restore everything" in fix.error
    after = fingerprint(ns)
    (config_key,) = [k for k in before if k.endswith(".config.use_cache")]
    assert after[config_key] == before[config_key]  # the other step was restored
    assert after["model.generation_config.use_cache"] != before["model.generation_config.use_cache"]


def test_oom_is_constructible_on_this_torch():
    assert isinstance(oom("x"), RuntimeError)


def _fp8_stored_model() -> dict:
    """Stock layers whose weights are stored in float8 (an Embedding and a Linear), biases in bf16."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 32), torch.nn.Linear(32, 8)).to(torch.bfloat16)
    for layer in model:
        layer.weight.requires_grad_(False)
        layer.weight.data = layer.weight.data.to(torch.float8_e4m3fn)
    return {"model": model, "opt": torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)}


def test_the_float8_upcast_in_forward_undoes_exactly_and_applies_once():
    """``UpcastStoredWeights``: a wrapper on each layer's forward, the float8 Parameters untouched; undo restores the
    fingerprint exactly, a second report's matching fix applied after the first adds nothing."""
    ns = _fp8_stored_model()
    model, ids = ns["model"], torch.tensor([[1, 2, 3]])
    first, second = (mpdoctor.diagnose(namespace=ns) for _ in range(2))
    (fix,) = first.findings_for("fp8-storage-not-upcast")[0].fixes
    (twin,) = second.findings_for("fp8-storage-not-upcast")[0].fixes
    stored = [layer.weight for layer in model]
    before = fingerprint(ns)
    fix.apply()
    assert [layer.weight for layer in model] == stored and all(p.dtype == torch.float8_e4m3fn for p in stored)
    applied = fingerprint(ns)
    assert applied != before
    twin.apply()
    assert_unchanged(applied, fingerprint(ns), "the same upcast applied a second time")
    with torch.no_grad():
        out = model(ids)  # the call that raised runs, and changes nothing it holds
    assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out).all())
    assert_unchanged(applied, fingerprint(ns), "a forward through the upcast layers")
    twin.undo()
    fix.undo()
    assert_unchanged(before, fingerprint(ns), "undo of the float8 upcast")
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        model(ids)


class _UpcastingLinear(torch.nn.Linear):
    """A layer that casts its stored weight up in its own forward (kohya's ``--fp8_base``, ComfyUI's manual cast)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), self.bias)


def test_freezing_float8_storage_drops_the_grads_a_failed_step_left_and_undoes_exactly():
    """``FreezeParams``: the step that raised left float8 grads; the freeze drops them (AdamW steps any parameter
    holding a grad), undo gives back each flag and each very grad tensor."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_UpcastingLinear(8, 8), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    model[0].weight.data = model[0].weight.data.to(torch.float8_e4m3fn)
    ns = {"model": model, "opt": torch.optim.AdamW(model.parameters(), lr=1e-2)}
    model(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    # torch 2.13 raises NotImplementedError ("... not implemented for 'Float8_e4m3fn'"); the oldest corner's torch a
    # RuntimeError ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'): the same refusal
    with pytest.raises((NotImplementedError, RuntimeError), match="not implemented for 'Float8_e4m3fn'"):
        ns["opt"].step()
    stale = model[0].weight.grad
    assert stale is not None and stale.dtype == torch.float8_e4m3fn
    (fix,) = mpdoctor.diagnose(namespace=ns).findings_for("fp8-storage-trainable")[0].fixes
    before = fingerprint(ns)
    fix.apply()
    assert model[0].weight.grad is None and not model[0].weight.requires_grad
    fix.undo()
    assert model[0].weight.grad is stale and model[0].weight.requires_grad
    assert_unchanged(before, fingerprint(ns), "undo of the float8 freeze")
