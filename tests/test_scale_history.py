"""Loss scale and loss over time: watch() and the callbacks keep each GradScaler's scale, skips and loss per
step; ``report.scale_history`` exposes them and every renderer draws them (SVG, HTML, widget, text, JSON)."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from setups import tiny_llama, tiny_trainer

import mpdoctor
from mpdoctor.attach.runtime import protocol as protocol_module
from mpdoctor.facts.scale_history import ScaleRecord


def overflowing_run(steps: int = 12):
    """A real fp16-autocast loop on the CPU whose scale starts too high: the first steps overflow and are skipped."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    seen = []
    with mpdoctor.watch(model, opt, scaler) as w:
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = F.mse_loss(out.float(), y)
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            seen.append((scale, scaler.get_scale() < scale, loss.item()))
    return w, seen


def test_watch_keeps_the_scale_the_skips_and_the_loss_of_every_step_as_the_scaler_saw_them():
    w, seen = overflowing_run()
    history = w.scale_history
    assert [(r.scale, r.skipped) for r in history] == [(s, k) for s, k, _ in seen]
    assert [r.loss for r in history] == [loss for _, _, loss in seen]
    assert [r.step for r in history] == list(range(1, len(seen) + 1)) and {r.scaler for r in history} == {"scaler"}
    assert 3 <= sum(r.skipped for r in history) < len(history)  # the start overflowed, then the scale settled
    assert list(w.report.scale_history) == history


def test_every_renderer_draws_the_history_and_json_carries_it():
    w, _ = overflowing_run()
    report = w.report
    skipped = sum(r.skipped for r in report.scale_history)
    data = json.loads(report.to_json())
    assert data["scale_history"] == [r.to_dict() for r in report.scale_history]
    html = report.to_html()
    assert "loss scale and loss over steps" in html and "<svg" in html
    assert html.count("\u2715<title>step") == skipped  # one mark per skipped step
    assert f"\u2715 {skipped} skipped steps" in html
    text = report.to_text()
    assert "loss scale and loss over steps" in text and f"{skipped} skipped" in text
    assert "skipped      " + "x" * skipped in text  # the skipped steps are the first ones
    panel = report.widget().scaler_panel.value
    assert "<svg" in panel and "loss scale (log2 axis)" in panel


def test_a_report_without_a_watch_has_an_empty_history_and_draws_nothing_extra():
    model = torch.nn.Linear(2, 2)
    report = mpdoctor.diagnose(model)
    assert report.scale_history == ()
    assert "loss scale and loss over steps" not in report.to_text() + report.to_html()


def test_the_svg_escapes_the_scaler_name_and_thins_long_histories():
    from mpdoctor.render.svg import SCALE_POINTS, scale_history_svg

    rows = [ScaleRecord("<b>s</b>", i + 1, 2.0 ** (16 - (i % 3 == 0)), i % 97 == 0, 1.0 / (i + 1)).to_dict() for i in range(5000)]
    svg = scale_history_svg(rows, "<b>s</b>")
    assert "<b>" not in svg and "&lt;b&gt;s&lt;/b&gt;" in svg
    assert svg.count("\u2715<title>") == sum(r["skipped"] for r in rows)  # skips always kept
    assert svg.count(" L") <= 2 * (SCALE_POINTS + 60) + 2


def test_the_trainer_callback_keeps_the_history_of_the_accelerators_scaler_and_detaches():
    model = tiny_llama(use_cache=False)
    trainer = tiny_trainer(model, max_steps=3, max_grad_norm=0.0)
    # accelerate makes no scaler on a CPU; give its backward and optimizer a real CPU GradScaler (used by both).
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    callback = mpdoctor.MPDoctorCallback()
    trainer.add_callback(callback)
    trainer.train()
    assert [r.step for r in callback.scale_history] == [1, 2, 3]
    assert all(r.scale == 1024.0 and not r.skipped for r in callback.scale_history)
    assert callback.protocol.findings == [] and not protocol_module.installed()
    assert list(callback.report.scale_history) == list(callback.scale_history)
