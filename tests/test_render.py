"""Text and static HTML renderings: golden files, escaping, the MIME bundle.

Goldens live in ``tests/golden/``; ``MPDOCTOR_UPDATE_GOLDEN=1`` rewrites them
from the current output (review the diff before committing). The setups are
seeded, evaluated on fixed ``target`` profiles and rendered with a fixed
``elapsed``, so the text does not depend on the machine or the clock.
"""

from __future__ import annotations

import difflib
import os
import re
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


def _library_versions_as_placeholders(text: str) -> str:
    """The running transformers' version, which a finding's evidence names, as ``{transformers}``: a golden file
    holds on every corner of the support matrix."""
    import transformers

    return text.replace(f"transformers={transformers.__version__};", "transformers={transformers};")


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_text_rendering_matches_the_golden_file(name):
    report = SETUPS[name]().evolve(elapsed=0.0042)
    text = _library_versions_as_placeholders(report.to_text() + "\n")
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
    assert "Disable scaler (GradScaler)" in html and "enabled=False" in html
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


# -- the view model: summaries, words, pictures --------------------------------------------------

from mpdoctor.diagnosis.view_builder import layer_rows  # noqa: E402
from mpdoctor.render.formatting import (  # noqa: E402
    layer_strips,
    plural,
    precision_word,
    probe_bars,
    rst_to_plain,
    singular_counts,
    summarize_evidence,
)
from mpdoctor.render.svg import layer_strip_svg, probe_chart_svg  # noqa: E402


def mixed_llama(layers: int = 32):
    """A bf16 Llama whose MLPs in every fourth layer were left in fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, use_cache=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16).train()
    for i in range(0, layers, 4):
        model.model.layers[i].mlp.float()
    return model


def test_a_32_layer_module_flood_is_one_sentence_with_the_full_list_folded():
    report = mpdoctor.diagnose(namespace={"llama": mixed_llama()})
    (finding,) = report.findings_for("mixed-param-dtypes")
    assert len(finding.evidence["modules"]) == 24
    items = {i.key: i for i in summarize_evidence(finding.evidence)}
    assert "roles" not in items, "roles are folded into the modules summary"
    assert items["modules"].summary == "24 MLP projections in 8 layers are fp32: layers 0, 4, 8, 12, 16, 20, ..."
    assert items["modules"].full.count("\n") == 23 and "model.layers.28.mlp.down_proj: [float32]" in items["modules"].full
    text = report.to_text()
    assert "24 MLP projections in 8 layers are fp32" in text and "'model.layers.28.mlp.up_proj': " not in text
    html = report.to_html()
    assert "all modules (24 lines)</summary>" in html, "the full list is folded in a <details>"


def test_words_for_people():
    assert plural(1, "error") == "1 error" and plural(2, "error") == "2 errors" and plural(3, "safe fix", "safe fixes") == "3 safe fixes"
    assert singular_counts("Cast 1 parameters of 1 modules of m to bf16") == "Cast 1 parameter of 1 module of m to bf16"
    assert singular_counts("Cast 11 parameters of 21 modules") == "Cast 11 parameters of 21 modules"
    assert precision_word("no") == "fp32" and precision_word("bf16") == "bf16"
    assert rst_to_plain("set ``use_cache=False``; see :func:`torch.autocast`") == "set use_cache=False; see torch.autocast"


def test_the_layer_strip_marks_the_layers_that_differ():
    report = mpdoctor.diagnose(namespace={"llama": mixed_llama(8)})
    rows = layer_rows(report.facts)
    assert {r.dtype for r in rows} == {"bfloat16", "float32"} and all(r.model == "llama" for r in rows)
    (strip,) = layer_strips(rows)
    assert strip.layers == list(range(8)) and strip.differing == [0, 4]
    assert strip.cells[(0, "mlp.up_proj")] == ("float32",) and strip.cells[(1, "mlp.up_proj")] == ("bfloat16",)
    svg = layer_strip_svg(strip)
    assert svg.startswith("<svg") and svg.count("<title>layer 0 mlp.up_proj: fp32</title>") == 1
    assert "var(--jp-content-font-color1,#1f2328)" in svg, "text drawn in the theme's colour"
    assert "dtypes per layer" in report.to_html()
    two_layers = mpdoctor.diagnose(namespace={"llama": mixed_llama(2)})
    assert layer_strips(layer_rows(two_layers.facts)) == [] and "dtypes per layer" not in two_layers.to_html()


def test_the_probe_chart_draws_both_half_precision_limits_and_non_finite_values():
    rows = [
        {"module": "m.embed", "out_absmax": 3.5, "grad_absmax": 0.01},
        {"module": "m.layers.0.mlp", "out_absmax": 70000.0, "grad_absmax": None},
        {"module": "m.layers.1.mlp", "out_absmax": float("inf"), "grad_absmax": float("nan")},
        {"module": "m.dropout", "out_absmax": None, "grad_absmax": None},
    ]
    svg = probe_chart_svg(probe_bars(rows))
    assert "fp16 max 65504" in svg and "bf16 max 3.4e38" in svg
    assert "m.dropout" not in svg, "a module that saw no floating tensor is left out"
    assert ">70,000<" in svg and "m.layers.1.mlp output: inf" in svg


def test_scan_numbers_show_even_when_no_finding_fires():
    torch.manual_seed(0)
    report = mpdoctor.diagnose(namespace={"model": torch.nn.Linear(8, 8)}, scan=True)
    assert not [f for f in report.findings if f.severity != "info"]
    html = report.to_html()
    assert ">numerics</div>" in html and "NaN / Inf" in html and "fp16 headroom" in html
    headroom = re.search(r"fp16 headroom</td><td[^>]*>([^<]+)</td>", html).group(1)
    assert re.fullmatch(r"[\d,.e+]+x", headroom) and len(headroom) <= 10, f"rounded: {headroom}"
