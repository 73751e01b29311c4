"""The cause of a crash names the object that raised, found in the failing frames, and comes first.

Two GradScalers, one healthy (an fp32 model's) and one beside an fp16 model: the real
``ValueError: Attempting to unscale FP16 gradients.`` is raised by ``scaler16``; the report's cause
must say so, not blame ``scaler``. The other findings are folded under "also found (N)".
"""

from __future__ import annotations

import math

import pytest
import torch

from mpdoctor.attach.crash import explain
from mpdoctor.render.widget import iter_widgets


def _two_scalers():
    torch.manual_seed(0)  # the order tests run in (pytest-xdist's workers) must not change the weights and batches
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")  # a healthy fp32 run's scaler, listed first
    model16 = torch.nn.Linear(4, 4).half()
    opt16 = torch.optim.SGD(model16.parameters(), lr=0.1)
    scaler16 = torch.amp.GradScaler("cpu")
    return {"model": model, "opt": opt, "scaler": scaler, "model16": model16, "opt16": opt16, "scaler16": scaler16}


def _step(model, opt, scaler):
    opt.zero_grad(set_to_none=True)
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x.to(next(model.parameters()).dtype)).float().square().mean()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    return float(loss.detach())


def test_an_fp16_unscale_error_names_the_scaler_that_raised():
    ns = _two_scalers()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients") as raised:  # the real failure
        _step(ns["model16"], ns["opt16"], ns["scaler16"])
    report = explain(raised.value, namespace=ns)
    cause = report.cause
    assert cause is report.findings[0] and cause.check == "fp16-trainable-params-with-scaler"
    assert report.raised_by == "scaler16"
    assert "scaler16 is enabled" in cause.message and "while scaler is" not in cause.message
    assert cause.evidence["raised_by"].startswith("scaler16 (GradScaler.")
    assert "(raised by scaler16)" in report.to_text()
    # the fix, then a step that trains
    (fix,) = [fx for fx in cause.fixes if fx.changes]
    fix.apply(confirm=True)
    before = [p.detach().clone() for p in ns["model16"].parameters()]
    ns["scaler16"] = torch.amp.GradScaler("cpu")  # the failed unscale_ left this scaler mid-step
    # GradScaler's first steps may overflow at its initial 65536 and be skipped while it halves the scale (its
    # documented start): the run trains once it has found a scale, within a few steps.
    for _ in range(8):
        assert math.isfinite(_step(ns["model16"], ns["opt16"], ns["scaler16"]))
        if any(not torch.equal(a, p) for a, p in zip(before, ns["model16"].parameters())):
            break
    assert any(not torch.equal(a, p) for a, p in zip(before, ns["model16"].parameters()))


def _crash_with_other_findings():
    """A bf16 model with stock AdamW (a warning at rest) beside the fp16 model whose scaler raises."""
    ns = _two_scalers()
    ns["model_bf16"] = torch.nn.Linear(4, 4).to(torch.bfloat16)
    ns["opt_bf16"] = torch.optim.AdamW(ns["model_bf16"].parameters(), lr=1e-3)
    with pytest.raises(ValueError) as raised:
        _step(ns["model16"], ns["opt16"], ns["scaler16"])
    report = explain(raised.value, namespace=ns)
    assert len(report.findings) >= 2, [(f.check, f.subject) for f in report.findings]
    return report


def test_the_cause_comes_first_and_the_other_findings_are_folded_under_also_found():
    report = _crash_with_other_findings()
    n = len(report.findings) - 1
    text = report.to_text()
    assert text.index("cause of ValueError") < text.index("fp16-trainable-params-with-scaler") < text.index(f"also found ({n})")
    others = [f.check for f in report.findings[1:]]
    assert all(text.index(f"also found ({n})") < text.index(check) for check in others if check != report.cause.check)
    html = report.to_html()
    folded = html[html.index("<details class='mpdoctor-also-found'"):]
    assert f"also found ({n})" in folded and all(check in folded for check in others)
    assert html.index("fp16-trainable-params-with-scaler") < html.index("mpdoctor-also-found")


def test_the_widget_folds_the_other_findings_in_a_closed_accordion():
    import ipywidgets

    report = _crash_with_other_findings()
    widget = report.widget()
    cards = widget.findings_box.children
    (accordion,) = [c for c in cards if isinstance(c, ipywidgets.Accordion)]
    assert accordion.selected_index is None  # folded
    assert accordion.get_title(0) == f"also found ({len(report.findings) - 1})"
    assert any("raised by scaler16" in value for value in widget.html_values())


def test_the_planned_fix_that_resolves_the_cause_is_shown_beside_it_not_folded_under_also_found():
    """fp16 weights under AdamW and a GradScaler: the cause (fp16 parameters under the scaler) offers a cast of the
    model as an alternative; the planned fix, fp32 master weights through the optimizer, is on the adam-eps
    finding. It is shown open after the cause, and its button is the cause card's first."""
    import ipywidgets

    torch.manual_seed(0)
    model16 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).half()
    opt16 = torch.optim.AdamW(model16.parameters(), lr=1e-3)
    scaler16 = torch.amp.GradScaler("cpu")
    model_bf16 = torch.nn.Linear(4, 4).to(torch.bfloat16)
    opt_bf16 = torch.optim.AdamW(model_bf16.parameters(), lr=1e-3)
    ns = {"model16": model16, "opt16": opt16, "scaler16": scaler16, "model_bf16": model_bf16, "opt_bf16": opt_bf16}
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients") as raised:
        opt16.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model16(torch.randn(2, 4)).float().square().mean()
        scaler16.scale(loss).backward()
        scaler16.step(opt16)
    report = explain(raised.value, namespace=ns)
    assert report.cause.check == "fp16-trainable-params-with-scaler"
    assert not any(fx.planned for fx in report.cause.fixes)
    planned = next(f for f in report.findings if f.check == "adam-eps-underflow").fixes[0]
    assert planned.planned and "of opt16 to fp32" in planned.title
    text = report.to_text()
    assert text.index("cause of ValueError") < text.index("adam-eps-underflow") < text.index("also found (2)")
    html = report.to_html()
    assert html.index("adam-eps-underflow") < html.index("mpdoctor-also-found")
    widget = report.widget()
    cards = widget.findings_box.children
    (accordion,) = [c for c in cards if isinstance(c, ipywidgets.Accordion)]
    assert accordion.get_title(0) == "also found (2)"
    folded = {b for b in iter_widgets(accordion) if isinstance(b, ipywidgets.Button)}
    first_button = widget.fix_buttons[0][0]
    assert first_button not in folded and "of opt16 to fp32 (unsafe; not tried on your step)" in first_button.description
    widget.close()
