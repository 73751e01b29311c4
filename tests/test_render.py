"""Text and static HTML renderings: golden files, escaping, the MIME bundle.

Goldens live in ``tests/golden/``; ``MPDOCTOR_UPDATE_GOLDEN=1`` rewrites them
from the current output (review the diff before committing). The setups are
seeded, evaluated on fixed ``target`` profiles and rendered with a fixed
``elapsed``, so the text does not depend on the machine or the clock.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest
import torch
from setups import PAYLOAD, SCRIPT, bf16_model, tiny_gemma3

import mpdoctor

pytestmark = pytest.mark.colab

GOLDEN = Path(__file__).parent / "golden"


def bf16_scaler_on_t4() -> mpdoctor.Report:
    """bf16 weights under an enabled GradScaler, evaluated for Colab's T4 (the unscale kernel lacks bf16)."""
    return mpdoctor.diagnose(
        namespace={"model": bf16_model(), "scaler": torch.amp.GradScaler("cpu")}, target="T4"
    )


def gemma3_cache_in_training() -> mpdoctor.Report:
    """A tiny Gemma 3 in training mode whose only cache flag, text_config.use_cache, is True."""
    return mpdoctor.diagnose(namespace={"gemma": tiny_gemma3(text_use_cache=True)}, target="cpu")


def fp32_sgd_after_a_step() -> mpdoctor.Report:
    """A healthy fp32 run after one step: grads and optimizer state in the histogram, nothing to fix."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    model[1].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    model(torch.ones(4, 8)).sum().backward()
    opt.step()
    return mpdoctor.diagnose(namespace={"model": model, "opt": opt}, target="T4")


SETUPS = {f.__name__: f for f in (bf16_scaler_on_t4, gemma3_cache_in_training, fp32_sgd_after_a_step)}


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_text_rendering_matches_the_golden_file(name):
    report = SETUPS[name]()
    report.elapsed = 0.0042
    text = report.to_text() + "\n"
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("MPDOCTOR_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    expected = path.read_text() if path.exists() else ""
    diff = "".join(
        difflib.unified_diff(expected.splitlines(True), text.splitlines(True), str(path), "rendered")
    )
    assert text == expected, f"rendering differs from {path} (MPDOCTOR_UPDATE_GOLDEN=1 rewrites it):\n{diff}"


def test_print_and_str_give_the_text_rendering():
    report = bf16_scaler_on_t4()
    assert str(report) == report.to_text()
    assert report.to_text().splitlines()[0].startswith("mpdoctor | 1 error | ")


def test_text_lines_keep_to_the_width_except_code():
    report = gemma3_cache_in_training()
    for line in report.to_text(width=80).splitlines():
        assert len(line) <= 80 or line.startswith("            "), line


def test_repr_mimebundle_offers_the_text_and_the_static_html_and_honours_include_exclude():
    report = bf16_scaler_on_t4()
    bundle = report._repr_mimebundle_()
    assert bundle == {"text/plain": report.to_text(), "text/html": report.to_html()}
    assert set(report._repr_mimebundle_(include=["text/html"])) == {"text/html"}
    assert set(report._repr_mimebundle_(exclude=["text/html"])) == {"text/plain"}


def test_static_html_shows_the_same_content_as_the_widget_without_buttons():
    report = bf16_scaler_on_t4()
    html = report.to_html()
    assert "<button" not in html.lower()
    assert "scaler-with-bf16" in html and "ERROR" in html and "why it matters" in html
    assert "Disable the GradScaler scaler" in html and "enabled=False" in html
    for section in ("dtypes", "precision: requested vs effective", "caches", "scalers"):
        assert f">{section}</div>" in html
    assert "target <code" in html and "T4 (sm_75, what-if)" in html


def test_every_string_from_user_objects_is_escaped_in_the_static_html():
    evil_cls = type(PAYLOAD, (torch.nn.Linear,), {})
    gemma = tiny_gemma3(text_use_cache=True)
    gemma.config.vision_config.use_cache = SCRIPT
    gemma.config.text_config.model_type = SCRIPT
    namespace = {
        PAYLOAD: torch.amp.GradScaler("cpu"),
        "model": evil_cls(4, 4).to(torch.bfloat16),
        "gemma": gemma,
    }
    html = mpdoctor.diagnose(namespace=namespace).to_html()
    assert "<img" not in html.lower() and "<script" not in html.lower()
    assert (
        html.count("&lt;img src=x onerror=alert(1)&gt;") >= 4
    )  # subject, class, finding, fix title and code
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
