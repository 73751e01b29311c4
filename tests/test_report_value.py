"""The Report is a value, made once; applying fixes is the Treatment's job; renderers read one view, built once."""

from __future__ import annotations

import ast
import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from setups import bf16_model, tiny_gemma3

import mpdoctor
from mpdoctor.diagnosis import view_builder as view_module
from mpdoctor.diagnosis.report import Report
from mpdoctor.diagnosis.treatment import Treatment
from mpdoctor.render import view as render_view

ROOT = Path(__file__).resolve().parents[1] / "mpdoctor"
#: The packages below the diagnosis in the import-linter layers (pyproject.toml).
BELOW_DIAGNOSIS = ("render", "checks", "treatment", "gathering", "discovery", "integrations", "readers", "edits",
                   "facts", "live")  # fmt: skip


def stepped(model: torch.nn.Module) -> tuple[torch.amp.GradScaler, torch.optim.Optimizer]:
    """An enabled CPU GradScaler beside a bf16 model, and an AdamW, after one real step."""
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(torch.ones(2, 8, dtype=model[0].weight.dtype)).float().sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return scaler, opt


def _broken_setup():
    model = bf16_model()
    scaler, opt = stepped(model)
    return model, scaler, opt


def test_a_report_cannot_be_changed_after_it_is_made():
    model, scaler, opt = _broken_setup()
    report = mpdoctor.diagnose(model, opt, scaler)
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'findings'"):
        report.findings = ()
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'cause'"):
        report.cause = report.findings[0]
    assert isinstance(report.findings, tuple) and isinstance(report.scale_history, tuple)


def test_evolve_makes_a_new_report_sharing_the_treatment_and_leaves_the_old_one_as_it_was():
    model, scaler, opt = _broken_setup()
    report = mpdoctor.diagnose(model, opt, scaler)
    before = report.to_dict()
    watched = report.evolve(watched="the AMP loop", findings=report.findings[:1])
    assert watched is not report and watched.treatment is report.treatment
    assert watched.watched == "the AMP loop" and len(watched.findings) == 1
    assert report.to_dict() == before and report.watched is None
    with pytest.raises(TypeError, match="no field"):
        report.evolve(colour="red")


def test_refresh_returns_a_new_report_of_the_same_objects_with_the_same_treatment():
    model, scaler, opt = _broken_setup()
    report = mpdoctor.diagnose(model, opt, scaler)
    fixes = [fx for fx in report.fixes if fx.safe]
    assert fixes, "the bf16 model with an enabled scaler offers a safe fix"
    fixes[0].apply()
    fresh = report.refresh()
    assert fresh is not report and fresh.treatment is report.treatment
    assert fixes[0] in report.treatment.applied
    # The old report still says what it said when it was made; the new one sees the fix.
    assert {f.check for f in fresh.findings} != {f.check for f in report.findings}


def test_the_old_doors_go_through_the_treatment_and_undo_restores_exactly():
    model, scaler, opt = _broken_setup()
    report = mpdoctor.diagnose(model, opt, scaler)
    assert scaler.is_enabled()
    applied = report.apply_safe_fixes()
    assert applied and all(fx.applied for fx in applied)
    assert report.treatment.applied == applied
    assert not scaler.is_enabled()
    undone = report.treatment.undo()
    assert undone is applied[-1] and not undone.applied
    while report.treatment.undo() is not None:
        pass
    assert scaler.is_enabled() and report.treatment.applied == []
    # and a training step still runs with the objects as they were
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def test_a_fix_holds_no_report_and_no_module_below_the_diagnosis_imports_one():
    model, scaler, opt = _broken_setup()
    report = mpdoctor.diagnose(model, opt, scaler)
    for fx in report.all_fixes:
        held = list(vars(fx).values())
        assert not any(isinstance(v, Report) for v in held), fx
        assert isinstance(fx._door, Treatment)
    offenders = []
    for package in BELOW_DIAGNOSIS:
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and "diagnosis" in node.module:
                    offenders.append(f"{path.relative_to(ROOT)}: from {node.module}")
                if isinstance(node, ast.Attribute) and node.attr in ("scan_rows", "scan_table", "probe_table", "facts"):
                    if package == "render":
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: reaches .{node.attr}")
    assert offenders == []


def test_a_widget_display_builds_the_view_once_and_renders_text_and_html_once_each():
    pytest.importorskip("ipywidgets")
    from mpdoctor.render.bundles import static_bundle, widget_bundle
    from mpdoctor.render.widget import ReportWidget

    model = bf16_model()
    scaler, opt = stepped(model)
    gemma = tiny_gemma3(text_use_cache=True)
    report = mpdoctor.diagnose(model, opt, scaler, gemma)
    builds = view_module.BUILDS
    renders = dict(render_view.RENDERS)
    widget = ReportWidget(report)
    # What frontend.show() sends for one display: the widget view, then the static copy for exports.
    bundles = [widget_bundle(widget), static_bundle(report), widget.mimebundle()]
    assert all(b["text/plain"] for b in bundles)
    assert view_module.BUILDS - builds == 1
    assert render_view.RENDERS["text"] - renders.get("text", 0) == 1
    assert render_view.RENDERS["html"] - renders.get("html", 0) == 1
    widget.close()


def test_applying_a_fix_builds_a_new_view_with_the_fix_state():
    model, scaler, opt = _broken_setup()
    report = mpdoctor.diagnose(model, opt, scaler)
    first = report.view
    assert report.view is first
    fix = next(fx for fx in report.fixes if fx.safe)
    fix.apply()
    assert report.view is not first and "[applied]" in report.to_text()


def test_the_renderers_run_on_a_view_where_torch_cannot_be_imported(tmp_path):
    model = bf16_model()
    scaler, opt = stepped(model)
    report = mpdoctor.diagnose(model, opt, scaler, scan=True)
    path = tmp_path / "view.pickle"
    path.write_bytes(pickle.dumps(report.view))
    script = f"""
import pickle, sys
sys.modules["torch"] = None  # any import of torch now raises
from mpdoctor.render.html import render_html
from mpdoctor.render.markdown import render_markdown
from mpdoctor.render.text import render_text
view = pickle.loads(open({str(path)!r}, "rb").read())
text, html, md = render_text(view), render_html(view), render_markdown(view)
assert "scaler-with-bf16" in text and "scaler-with-bf16" in html and "scaler-with-bf16" in md, text
print("rendered", len(text), len(html), len(md))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("rendered")


def test_a_fix_is_a_value_its_title_code_and_changes_are_fixed_and_replace_makes_another():
    model = bf16_model()
    scaler, opt = stepped(model)
    report = mpdoctor.diagnose(model, opt, scaler)
    fix = next(fx for fx in report.all_fixes if fx.changes)
    for name, value in (("title", "x"), ("code", "pass"), ("changes", ()), ("applicability", fix.applicability),
                        ("recipe", "other"), ("cost", "free")):  # fmt: skip
        with pytest.raises(AttributeError, match="a Fix is a value"):
            setattr(fix, name, value)
    # Its address (check, finding) is written once, when it is filed, never moved.
    assert fix.slug and fix.finding_subject
    fix.slug = fix.slug  # the same address: nothing moves
    with pytest.raises(AttributeError, match="a Fix is a value"):
        fix.finding_subject = "another object"
    other = fix.replace(title="Another title")
    assert other is not fix and other.title == "Another title" and other.changes == fix.changes
    assert other.key[:2] == fix.key[:2] and not other.applied and fix.title != "Another title"
    with pytest.raises(TypeError, match="Fix has no value"):
        fix.replace(proof="verified")


def test_what_happens_to_a_fix_is_a_record_its_treatment_keeps_keyed_by_the_fix():
    model = bf16_model()
    scaler, opt = stepped(model)
    report = mpdoctor.diagnose(model, opt, scaler)
    fix = next(fx for fx in report.safe_fixes if fx.changes)
    with pytest.raises(AttributeError):
        fix.applied = True  # the application is the treatment's record, not an attribute of the value
    fix.apply()
    entry = report.treatment.records[id(fix)]
    assert entry[0] is fix and entry[1] is fix.record and fix.record.applied and fix.record.steps
    view = [v for f in report.view.data["findings"] for v in f["fixes"] if v["title"] == fix.title]
    assert view and view[0]["applied"] is True  # the view is built from the treatment's state
    fix.undo()
    assert not report.treatment.records[id(fix)][1].applied and not fix.record.steps
