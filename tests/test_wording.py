"""What the report says reads right: counts agree with their nouns and verbs, costs show a figure, empty
evidence stays out of sight, advice matches how the object was built, every renderer labels a fix the same
way, and a dtype has one name in bars and legends."""

from __future__ import annotations

import math
import re

import torch
from setups import batch, tiny_llama, train_step

import mpdoctor
from mpdoctor.attach.crash.cause import explain
from mpdoctor.render.formatting import fix_kind


def _bf16_head32():
    """A bf16 Llama with its head left fp32 and stock AdamW: mixed-param-dtypes, pure-bf16-adamw, rope."""
    model = tiny_llama(torch.bfloat16, use_cache=False)
    model.lm_head.float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, mpdoctor.diagnose(namespace={"model": model, "opt": opt})


def test_counts_of_one_take_the_singular_noun_and_verb():
    model, opt, report = _bf16_head32()
    (mixed,) = report.findings_for("mixed-param-dtypes")
    assert "model.lm_head (Linear: float32) holds other dtypes" in mixed.message
    (rope,) = report.findings_for("half-precision-rope-buffers")
    assert rope.message.startswith("1 rotary embedding of model (LlamaRotaryEmbedding) holds inv_freq")
    words = " ".join([f.message for f in report.findings] + [fx.title for f in report.findings for fx in f.fixes])
    assert not re.search(r"\b1 (parameter|tensor|module|embedding|layer|rotary embedding)s\b", words), words


def test_a_cost_shows_a_figure_never_plus_zero_mib():
    _model, _opt, report = _bf16_head32()
    costs = [fx.cost for f in report.findings for fx in f.fixes if "iB" in fx.cost or " B " in fx.cost]
    assert costs, [fx.cost for f in report.findings for fx in f.fixes]
    for cost in costs:
        assert not re.search(r"[+-]0\.0 [KMG]iB", cost), cost
    planned = report.fixes[0]
    assert planned.recipe == "fp32-master-weights" and re.match(r"\+\d+\.\d KiB of weights", planned.cost)
    text = report.to_text()
    assert "+0.0 MiB" not in text and "-0.0 MiB" not in text


def test_empty_evidence_fields_are_not_shown_but_stay_in_the_json():
    model = tiny_llama(torch.bfloat16, use_cache=False)
    scaler = torch.amp.GradScaler("cpu")
    report = mpdoctor.diagnose(namespace={"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1),
                                          "scaler": scaler})
    (finding,) = report.findings_for("scaler-with-bf16")
    assert finding.evidence["bf16_setups"] == []  # the fact is there
    assert "bf16_setups" in report.to_json()
    assert "bf16_setups" not in report.to_text() and "bf16_setups" not in report.to_html()
    assert "=[]" not in report.to_text() and "patched_forwards" not in report.to_text()
    assert "scaler_enabled=True" in report.to_text()  # the rest of the evidence still shows


def test_advice_for_a_model_built_from_a_config_uses_from_config_and_that_advice_works():
    _model, _opt, report = _bf16_head32()
    (rope,) = report.findings_for("half-precision-rope-buffers")
    advice = [fx for fx in rope.fixes if fx.recipe == "load-in-dtype"][0]
    assert "from_pretrained" not in advice.code and "from_config(model.config, dtype=torch.bfloat16)" in advice.code
    # the advice, run as written, builds a bf16 model whose rotary frequencies stay fp32: no finding, and it trains
    from transformers import AutoModelForCausalLM

    ns = {"model": _model, "torch": torch, "AutoModelForCausalLM": AutoModelForCausalLM}
    exec(advice.code, ns)
    rebuilt = ns["model"].train()
    assert rebuilt.model.rotary_emb.inv_freq.dtype == torch.float32 and rebuilt.lm_head.weight.dtype == torch.bfloat16
    assert not mpdoctor.diagnose(rebuilt).findings_for("half-precision-rope-buffers")
    opt = torch.optim.SGD(rebuilt.parameters(), lr=0.1)
    before = [p.detach().clone() for p in rebuilt.parameters()]
    assert math.isfinite(train_step(rebuilt, opt, batch()))
    assert any(not torch.equal(a, p) for a, p in zip(before, rebuilt.parameters()))


def test_advice_for_a_model_loaded_from_a_checkpoint_names_that_checkpoint():
    import shutil
    import tempfile

    from transformers import LlamaForCausalLM

    # a short path: the redactor hides long token-like strings (pytest's tmp_path is one)
    checkpoint = tempfile.mkdtemp(prefix="ck")
    try:
        _check_loaded_advice(checkpoint, LlamaForCausalLM)
    finally:
        shutil.rmtree(checkpoint)


def _check_loaded_advice(checkpoint, LlamaForCausalLM):
    tiny_llama().save_pretrained(checkpoint)
    model = LlamaForCausalLM.from_pretrained(checkpoint).to(torch.bfloat16)  # cast after loading: inv_freq bf16
    assert model.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    (rope,) = mpdoctor.diagnose(model).findings_for("half-precision-rope-buffers")
    advice = [fx for fx in rope.fixes if fx.recipe == "load-in-dtype"][0]
    assert f"LlamaForCausalLM.from_pretrained({str(checkpoint)!r}, dtype=torch.bfloat16)" in advice.code
    ns = {"torch": torch, "LlamaForCausalLM": LlamaForCausalLM}
    exec(advice.code.replace("model = ", "loaded = ", 1), ns)
    assert ns["loaded"].model.rotary_emb.inv_freq.dtype == torch.float32


def _labels_in(text: str) -> list[str]:
    return re.findall(r"fix \(((?:alternative, )?(?:safe|unsafe|display-only))\)", text)


def test_text_html_and_widget_label_planned_alternative_and_display_only_fixes_the_same_way():
    model = tiny_llama(torch.bfloat16, use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report = mpdoctor.diagnose(namespace={"model": model, "opt": opt, "scaler": torch.amp.GradScaler("cpu")})
    data = report.to_dict()
    expected = [fix_kind(fx, f["fixes"]) for f in data["findings"] for fx in f["fixes"]]
    # planned (unsafe), an alternative safe fix, a display-only alternative, and display-only advice on its own
    assert {"unsafe", "alternative, safe", "alternative, display-only", "display-only"} <= set(expected), expected
    assert _labels_in(report.to_text()) == expected
    assert _labels_in(report.to_html()) == expected
    widget_html = "".join(v for v in report.widget().html_values() if "the same fix as code" in v)
    assert _labels_in(widget_html) == expected


def test_a_dtype_has_the_same_name_in_the_bars_and_in_the_legend():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.model.layers[2].mlp.float()  # one layer differs: the strip has a legend of two dtypes
    report = mpdoctor.diagnose(model)
    html = report.to_html()
    legend = re.findall(r"<text x='[\d.]+' y='[\d.]+' style='[^']*'>(fp32|bf16|fp16|f32|f16)</text>", html)
    assert set(legend) == {"bf16", "fp32"}, legend
    bars = re.findall(r"\b(f32|fp32|bf16|f16|fp16)\b", html.split("dtypes per layer")[0].split(">dtypes<")[-1])
    assert bars and set(bars) <= {"bf16", "fp32"}, bars
    text_rows = [line.split()[2] for line in report.to_text().split("\ndtypes\n")[1].split("\n\n")[0].splitlines()]
    assert set(text_rows) == {"bf16", "fp32"}, text_rows


# -- the small faults of issue #32, each grepped in the code and tested here --------------------------------------------


def test_a_module_of_a_sequential_is_named_under_its_models_name_not_by_a_bare_index():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).to(torch.bfloat16)
    net[1].float()
    (mixed,) = mpdoctor.diagnose(namespace={"net": net}).findings_for("mixed-param-dtypes")
    assert "but net.1 (Linear: float32)" in mixed.message, mixed.message
    assert "but 1 (" not in mixed.message


def test_the_dtype_finding_quotes_the_message_torch_really_raised():
    model, opt, report = _bf16_head32()  # lm_head has no bias: torch's mm wording, not addmm's
    try:
        train_step(model, opt, batch())
    except RuntimeError as exc:
        raised = str(exc).split(", but got")[0]
    else:
        raise AssertionError("the mixed model trained")
    (mixed,) = report.findings_for("mixed-param-dtypes")
    assert f"'{raised}" in mixed.message, (raised, mixed.message)


def test_a_crash_reports_cause_heading_says_cause_once_in_every_renderer():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16))
    try:
        net(torch.randn(2, 4))
    except RuntimeError as exc:
        report = explain(exc, exc.__traceback__, namespace={"net": net})
    assert report is not None and report.cause is not None
    html = re.sub(r"<[^>]+>", " ", report.to_html())
    for text in (report.to_text(), html, report.to_markdown()):
        assert not re.search(r"\bcause\s+cause\b", text), text[:400]


def test_a_tensor_batch_in_the_wrong_dtype_is_named_with_its_dtype_in_the_evidence():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).to(torch.bfloat16)
    x = torch.randn(2, 4)
    try:
        net(x)
    except RuntimeError as exc:
        report = explain(exc, exc.__traceback__, namespace={"net": net, "x": x})
    (found,) = report.findings_for("batch-dtype-mismatch")
    assert found.evidence["inputs"] == {"x": "float32"}, found.evidence
    assert "?" not in report.to_text().split("evidence:", 1)[1].split("\n")[0]


def test_run_usage_and_help_name_the_scripts_arguments_the_same_way(capsys):
    from mpdoctor.front.cli import main

    try:
        main(["run", "-h"])
    except SystemExit:
        pass
    out = capsys.readouterr().out
    assert "script [args ...]" in out and re.search(r"^\s+args\s+the script's own arguments", out, flags=re.M)
    assert "script_args" not in out
