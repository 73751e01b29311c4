"""One assembly, then the proof: every front end builds its final report in one place, and a proof is of one plan.

The proof's labels are the proof's record, kept by the report that holds it: a fix is a value that carries none, a
trial leaves nothing on it, and a report whose plan changed after the proof holds no proof at all.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
import torch

import mpdoctor
from mpdoctor.attach.runtime.assembly import Observed, assemble

pytestmark = pytest.mark.colab

PACKAGE = Path(mpdoctor.__file__).parent


def _setup():
    """An fp32 body with a bf16 head: the step raises ``mat1 and mat2 must have the same dtype``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    model[1].to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8)

    def train_step():
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    return model, opt, train_step


@functools.cache
def _calls_by_module() -> dict[str, frozenset[str]]:
    """The names each of the package's modules calls (a plain or attribute call), parsed once for every question."""
    calls = {}
    for path in PACKAGE.rglob("*.py"):
        called = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                func = node.func
                called.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None))
        calls[path.relative_to(PACKAGE).as_posix()] = frozenset(called)
    return calls


def _callers(name: str) -> set[str]:
    """The package's modules that call ``name`` (a plain or attribute call)."""
    return {module for module, called in _calls_by_module().items() if name in called}


def test_every_front_end_proves_and_folds_observations_through_the_one_assembly():
    # %mpdoctor, watch(), the crash hook, mpdoctor run, the probe and the callbacks all call assemble(); the
    # proof of an assembled report and the folding of the cells' findings happen nowhere else.
    assert _callers("proven_report") == {"attach/runtime/assembly.py"}
    assert _callers("add_to_report") == {"attach/runtime/assembly.py"}
    front_ends = {"front/magic.py", "attach/training/watch.py", "attach/crash/hook.py", "attach/training/script_runner.py",
                  "attach/numerics/probe.py", "attach/runtime/protocol.py"}  # fmt: skip
    assert front_ends <= _callers("assemble")


def test_a_report_whose_plan_changes_after_its_proof_holds_no_proof_and_shows_no_label():
    model, opt, train_step = _setup()
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        train_step()
    proven = mpdoctor.diagnose(model, opt, step=train_step)
    fix = proven.fixes[0]
    assert proven.proof.verified and proven.proof.label(fix).startswith("verified on your step")
    shown = [v for f in proven.view.data["findings"] for v in f["fixes"] if v["title"] == fix.title]
    assert shown and shown[0]["proof"].startswith("verified on your step")
    # No fix, or the same fixes in another order: another plan, not the one that ran.
    others = [[]] + ([list(reversed(proven.fixes))] if len(proven.fixes) > 1 else [])
    for plan in others:
        other = proven.evolve(plan=plan, safe_plan=[])
        assert other.proof is None
        assert "verified on your step" not in other.to_text()
        labels = [v["proof"] for f in other.view.data["findings"] for v in f["fixes"]]
        assert labels and not any(labels)
    # A change that keeps the plan keeps the proof.
    assert proven.evolve(notes=("a note",)).proof is proven.proof


def test_a_trial_records_nothing_on_the_fix_it_tried_and_a_fix_carries_no_label():
    model, opt, train_step = _setup()
    report = mpdoctor.diagnose(model, opt)
    fix = report.fixes[0]
    proven = assemble(report, step=train_step)  # the user's step, through the one assembly
    assert proven.proof.verified and proven.proof.label(fix)
    assert not fix.applied and fix.error is None and "proof" not in fix.to_dict()
    assert not hasattr(fix, "proof")  # the label is the proof's, not the fix's
    assert model[1].weight.dtype == torch.bfloat16  # every trial was undone
    # A trial that cannot apply the fix: the fix is dropped, its record says so, the fix itself is untouched.
    broken = mpdoctor.diagnose(model, opt)
    failing = broken.fixes[0]

    def refuse():
        raise RuntimeError("this tensor cannot be cast now")

    failing._plan = refuse  # fault injection on mpdoctor's own fix (the attribute exists for such tests)
    dropped = assemble(broken, step=train_step)
    assert dropped.proof.dropped == (failing.title,) and failing not in dropped.fixes
    assert dropped.proof.label(failing) == "tried on your step: it could not be applied"
    assert not failing.applied and failing.error is None
    view = [v for f in dropped.view.data["findings"] for v in f["fixes"] if v["title"] == failing.title][0]
    assert view["planned"] is False and view["note"] == "not planned: tried on your step: it could not be applied"
    assert not any(v["proof"] for f in broken.view.data["findings"] for v in f["fixes"])  # unproven: no label


def test_observations_join_before_the_proof_and_a_watched_finding_alone_never_drops_it():
    # The cell reader's findings join the report in the assembly, before the proof: a report proven first and
    # given findings later would hold a proof of another report.
    model, opt, train_step = _setup()
    report = mpdoctor.diagnose(model, opt)
    from mpdoctor.rules.engine.findings import Finding

    read = Finding("amp-update-missing", "warning", "cell [3]", "scaler.update() is never called", {"where": "cell [3]"})
    whole = assemble(report, Observed(code=(read,)), step=train_step)
    assert any(f.check == "amp-update-missing" for f in whole.findings)
    assert whole.proof is not None and whole.proof.verified
    assert assemble(report, Observed(code=(read,), ignore=("amp-update-missing",))).hidden == {"amp-update-missing": 1}


def test_a_fix_verified_only_with_another_names_it_and_applying_it_applies_both_as_one_undoable_action():
    # Two models in one step, each with a bf16 head: each cast alone leaves the other raising.
    torch.manual_seed(0)
    first = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    second = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    first[1].to(torch.bfloat16)
    second[1].to(torch.bfloat16)
    opt = torch.optim.Adam([*first.parameters(), *second.parameters()], lr=1e-2)
    x = torch.randn(4, 8)

    def train_step():
        opt.zero_grad()
        loss = (first(x).float() + second(x).float()).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    with pytest.raises(RuntimeError, match="must have the same dtype"):
        train_step()
    report = mpdoctor.diagnose(first, second, opt, step=train_step,
                               names={id(first): "first", id(second): "second", id(opt): "opt"})  # fmt: skip
    assert report.proof.verified and len(report.fixes) == 2
    one, other = report.fixes
    label = report.proof.label(one)
    assert label.startswith(f"verified on your step together with {other.title}"), label
    assert "applied alone, it raised RuntimeError" in label and label.endswith("(applying it applies them too, in that order)")
    assert report.proof.prerequisites(one) == (one, other)
    shown = [v for f in report.view.data["findings"] for v in f["fixes"] if v["title"] == one.title]
    assert shown and shown[0]["applies_with"] == [other.title]
    # The user clicks that one fix: what its label names is applied, and the user's own step runs and trains.
    one.apply()
    assert one.applied and other.applied
    params = [p for p in opt.param_groups[0]["params"]]
    start = [p.detach().clone() for p in params]
    loss = train_step()
    assert torch.isfinite(loss) and any(not torch.equal(a, p) for a, p in zip(start, params))
    # Undo puts back both: the step raises as it did.
    one.undo()
    assert not one.applied and not other.applied
    assert first[1].weight.dtype == torch.bfloat16 and second[1].weight.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        train_step()


def test_when_the_proof_drops_a_findings_planned_fix_its_next_in_place_fix_is_proven_in_its_place():
    """adam-eps-underflow plans fp32 master weights and offers a larger eps as well. When the planned fix cannot be
    applied on the step (fault injection on mpdoctor's own fix), the finding would be left with no planned fix: the
    proof tries its next in-place fix on the same step, adopts it because the step then trains, and puts it first."""
    from scenarios import fp16_weights_adamw_eps

    ns = fp16_weights_adamw_eps()
    model, opt = ns["model"], ns["opt"]
    batch = torch.randint(0, 64, (2, 8))

    def train_step():
        opt.zero_grad()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        return loss

    report = mpdoctor.diagnose(model, opt, names={id(model): "model", id(opt): "opt"})
    (finding,) = report.findings_for("adam-eps-underflow")
    planned, alternative = finding.fixes[0], finding.fixes[1]
    assert planned in report.fixes and alternative not in report.fixes and alternative.changes

    def refuse():
        raise RuntimeError("this tensor cannot be cast now")

    planned._plan = refuse  # fault injection on mpdoctor's own fix (the attribute exists for such tests)
    proven = assemble(report, step=train_step)
    (now,) = proven.findings_for("adam-eps-underflow")
    assert now.fixes[0] is alternative and alternative in proven.fixes and planned not in proven.fixes
    assert proven.proof.checked and proven.proof.label(alternative).startswith("verified on your step")
    assert proven.proof.label(planned) == "tried on your step: it could not be applied"
    assert not alternative.applied and opt.param_groups[0]["eps"] == ns["opt"].defaults["eps"]  # trials undone
