"""``mpdoctor.compare``: what each precision does to each Linear of a live model, measured, leaving it untouched.

Runs in both venvs (no torchao here: ``tests/stack/test_compare_oracles.py`` checks the quantizers
bit for bit against torchao's reference implementations).
"""

from __future__ import annotations

import math

import pytest
import torch
from fingerprint import assert_unchanged, fingerprint
from setups import batch, tiny_llama

import mpdoctor
from mpdoctor.attach.emulation import formats
from mpdoctor.attach.emulation.compare import COLUMNS, KEEP_BELOW_DB, Comparison, compare

ALL = ("bf16", "fp16", "fp8", "fp8-rowwise", "mxfp8", "nvfp4")


def wide_range_input(rows: int = 128, features: int = 256, seed: int = 0) -> torch.Tensor:
    """Activations whose input channels span six orders of magnitude (1e-6 .. 1), Gaussian within each."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, features, generator=g) * torch.logspace(-6, 0, features)


def plain_layer(features: int = 256, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(features, features)


def gaussian(rows: int = 128, features: int = 256, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, features, generator=torch.Generator().manual_seed(seed))


# -- it leaves the model exactly as it was ------------------------------------------------------


def test_compare_leaves_weights_buffers_grads_rng_and_hooks_as_they_were():
    model = tiny_llama(use_cache=False)
    model.config.attention_dropout = 0.5  # dropout draws from the RNG in every run
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    b = batch()
    model(**b).loss.backward()  # the user's own grads, which compare must not touch
    handle = model.model.layers[0].mlp.register_forward_hook(lambda m, a, o: None)
    torch.manual_seed(123)
    before = fingerprint({"model": model, "batch": b})
    c = compare(model, b, precisions=ALL)
    after = fingerprint({"model": model, "batch": b})
    assert c.error is None and not c.errors
    assert_unchanged(before, after, "compare()")
    handle.remove()


def test_each_run_starts_from_the_same_rng_state_so_dropout_masks_match_across_precisions():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.5), torch.nn.Linear(64, 64))
    x = gaussian(32, 64)
    c = compare(model, x, precisions=("fp32", "bf16"))
    # The reference precision emulated again gives the same numbers: same masks, exact matmuls.
    assert c.row("0", "fp32").out_sqnr_db == math.inf
    assert c.losses["fp32"] == pytest.approx(compare(model, x, precisions=("fp32",)).losses["fp32"], rel=1e-6)
    assert abs(c.losses["bf16"] - c.losses["fp32"]) < 1e-2 * abs(c.losses["fp32"]) + 1e-4


# -- the per-layer measurements ---------------------------------------------------------------------


def test_wide_dynamic_range_tensorwise_fp8_underflows_a_large_share_and_mx_blocks_almost_none():
    c = compare(plain_layer(), wide_range_input(), precisions=("fp8", "fp8-rowwise", "mxfp8"))
    fp8, mx = c.row("(model)", "fp8"), c.row("(model)", "mxfp8")
    print(f"wide range: tensorwise fp8 underflow {fp8.act_underflow_pct:.2f}%, MXFP8 {mx.act_underflow_pct:.4f}%")
    assert fp8.act_underflow_pct > 10.0  # one scale for the whole tensor: the 1e-6 channels fall under e4m3's range
    assert mx.act_underflow_pct < 0.1  # one scale per 32 channels: each block spans under a decade
    # Rowwise scales are per token, across all channels: no help against a range spread over channels.
    assert c.row("(model)", "fp8-rowwise").act_underflow_pct > 10.0
    # The same layer on activations of one magnitude loses nothing.
    healthy = compare(plain_layer(), gaussian(), precisions=("fp8",)).row("(model)", "fp8")
    assert healthy.act_underflow_pct < 0.01


def test_the_underflowed_channels_get_exactly_zero_weight_gradient_under_fp8():
    """The harm of the underflow: the weights reading those channels stop learning."""
    x = wide_range_input()
    q = formats.quantize_tensorwise(x).values
    dead = (q == 0).all(dim=0) & (x != 0).any(dim=0)
    assert dead.sum() > 10  # whole input channels quantize to zero in every row
    grad = torch.randn(x.shape[0], 256).t() @ q
    assert torch.all(grad[:, dead] == 0)


def test_the_amax_element_of_a_tensorwise_fp8_tensor_is_never_counted_as_saturated():
    """``amax * (448 / amax)`` in float32 lands an ulp past 448 in about one tensor of eight: not a saturation."""
    counted = [formats.quantize_tensorwise(gaussian(64, 16, seed=s)).saturated.item() for s in range(400)]
    assert sum(counted) == 0
    # A value really past the scale's range (a stale scale: delayed scaling) still counts.
    x = gaussian(64, 16)
    assert formats.quantize_fp8(x, formats.tensorwise_scale(x) * 2).saturated > 0


def test_fp16_keeps_about_18_db_more_sqnr_than_bf16_on_a_plain_layer():
    c = compare(plain_layer(), gaussian(), precisions=("bf16", "fp16"))
    bf16, fp16 = c.row("(model)", "bf16"), c.row("(model)", "fp16")
    gain = fp16.out_sqnr_db - bf16.out_sqnr_db
    print(f"bf16 {bf16.out_sqnr_db:.1f} dB, fp16 {fp16.out_sqnr_db:.1f} dB: fp16 keeps {gain:.1f} dB more")
    assert 15.0 <= gain <= 21.0  # three more mantissa bits: 3 x 6.02 dB
    assert 15.0 <= fp16.wgrad_sqnr_db - bf16.wgrad_sqnr_db <= 21.0


def test_typical_sqnr_of_each_format_sits_above_its_keep_threshold_on_a_plain_layer():
    """The thresholds of recommend() are calibrated: a healthy Gaussian layer keeps nothing."""
    c = compare(plain_layer(), gaussian(), precisions=ALL)
    for p in ALL:
        r = c.row("(model)", p)
        assert r.out_sqnr_db > KEEP_BELOW_DB[p] + 5, (p, r)
        assert r.wgrad_sqnr_db > KEEP_BELOW_DB[p] + 5, (p, r)
    assert c.row("(model)", "nvfp4").out_sqnr_db < c.row("(model)", "mxfp8").out_sqnr_db < c.row("(model)", "bf16").out_sqnr_db
    for p in ("bf16", "fp8", "mxfp8"):
        assert c.recommend(p).keep == ()


def test_recommend_keeps_the_wide_range_layer_and_writes_torchao_code_with_its_filter():
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("wide", torch.nn.Linear(256, 256))
    model.add_module("act", torch.nn.GELU())
    model.add_module("plain", torch.nn.Linear(256, 256))
    c = compare(model, wide_range_input(), precisions=("fp8", "mxfp8"))
    rec = c.recommend("fp8")
    assert rec.keep == ("wide",)
    assert "underflow" in rec.reasons["wide"]
    assert "convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)" in rec.code
    assert "'wide'" in rec.code
    filt = rec.module_filter_fn()
    assert filt(model.plain, "plain") and not filt(model.wide, "wide")
    assert c.recommend("mxfp8").keep == ()
    assert "MXFP8TrainingOpConfig" in c.recommend("mxfp8").code
    finding = next(f for f in c.findings if f.check == "fp8-layer-underflows")
    assert finding.severity == "warning" and finding.evidence["layers"] == ["wide"]
    assert not any(f.check == "mxfp8-layer-underflows" for f in c.findings)


def test_recommend_keeps_layers_whose_dims_fp8_kernels_cannot_take():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 40), torch.nn.ReLU(), torch.nn.Linear(40, 64))
    c = compare(model, gaussian(32, 64), precisions=("fp8",))
    assert set(c.recommend("fp8").keep) == {"0", "2"}
    assert "not multiples of 16" in c.recommend("fp8").reasons["0"]


# -- models and batches ---------------------------------------------------------------------------


def test_tiny_llama_every_linear_and_attention_matmul_every_precision_finite_losses_and_the_frame_columns():
    model = tiny_llama(use_cache=False)
    c = mpdoctor.compare(model, batch())
    assert isinstance(c, Comparison) and c.error is None
    frame = c.to_frame()
    assert tuple(frame.columns) == COLUMNS
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    attention = [f"model.layers.{i}.self_attn [{which}]" for i in range(2) for which in ("q·kᵀ", "p·v")]
    assert sorted(set(frame.module)) == sorted(linears + attention)
    assert len(frame) == (len(linears) + len(attention)) * 5
    assert [p for p, _, _ in c.layers] == linears  # the Linears alone, for recommend()
    assert set(c.losses) == {"fp32", "bf16", "fp16", "fp8", "mxfp8", "nvfp4"}
    assert all(math.isfinite(v) for v in c.losses.values())
    assert frame.out_sqnr_db.notna().all() and frame.wgrad_sqnr_db.notna().all()
    # bf16 moves the loss less than NVFP4 does.
    ref = c.losses["fp32"]
    assert abs(c.losses["bf16"] - ref) < abs(c.losses["nvfp4"] - ref)


def test_a_bf16_model_runs_its_high_precision_parts_in_bf16():
    model = tiny_llama(dtype=torch.bfloat16, use_cache=False)
    c = compare(model, batch(), precisions=("bf16", "fp8"))
    assert c.error is None and c.dtype == "bfloat16"
    assert all(math.isfinite(v) for v in c.losses.values())
    # Rounding bf16 operands to bf16 changes nothing: only the outputs are rounded.
    assert (c.to_frame().query("precision == 'bf16'").act_underflow_pct == 0).all()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_a_plain_sequential_given_a_tuple_batch_and_a_loss_function():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    x, y = gaussian(16, 32), gaussian(16, 1, seed=2)
    c = compare(model, (x,), precisions=("bf16", "fp8"), loss=lambda out: torch.nn.functional.mse_loss(out, y))
    assert c.error is None
    assert c.losses["fp32"] == pytest.approx(torch.nn.functional.mse_loss(model(x), y).item(), rel=1e-6)


def test_a_batch_the_model_rejects_gives_a_clear_message_never_a_traceback():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    c = compare(model, torch.randn(4, 7))
    assert c.error.startswith("the model rejected the batch in the fp32 reference run: RuntimeError:")
    assert "nothing compared" in c.to_text() and "nothing compared" in c.to_html()
    assert c.to_frame().empty


def test_a_model_with_no_linear_a_non_module_a_bad_batch_and_an_unknown_precision_are_named():
    assert "has no nn.Linear" in compare(torch.nn.Sequential(torch.nn.ReLU()), torch.randn(2, 2)).error
    assert "needs a torch.nn.Module" in compare("model", torch.randn(2, 2)).error
    assert "batch must be" in compare(torch.nn.Linear(2, 2), 3).error
    err = compare(torch.nn.Linear(2, 2), torch.randn(2, 2), precisions=("fp6",)).error
    assert "unknown precision 'fp6'" in err and "mxfp8" in err


def test_fp16_overflow_makes_a_nonfinite_loss_and_a_finding():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
    with torch.no_grad():
        model[0].weight.mul_(1e4)  # activations past fp16's 65504
    c = compare(model, gaussian(8, 16) * 100, precisions=("bf16", "fp16"))
    assert math.isfinite(c.losses["bf16"]) and not math.isfinite(c.losses["fp16"])
    assert c.row("0", "fp16").act_saturation_pct == 0 and c.row("1", "fp16").act_saturation_pct > 0
    assert any(f.check == "low-precision-loss-nonfinite" and f.evidence["precision"] == "fp16" for f in c.findings)


# -- rendering --------------------------------------------------------------------------------------


def _wide_comparison() -> Comparison:
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("<b>wide</b>", torch.nn.Linear(256, 256))
    model.add_module("plain", torch.nn.Linear(256, 256))
    return compare(model, wide_range_input(), precisions=("bf16", "fp8", "mxfp8"))


def test_text_table_marks_the_underflowing_cell():
    text = _wide_comparison().to_text()
    line = next(x for x in text.splitlines() if x.strip().startswith("<b>wide</b>"))
    assert "▼" in line and line.count("▼") == 1  # fp8 only
    assert "loss: fp32 (reference)" in text
    assert "fp8-layer-underflows" in text


def test_html_heatmap_escapes_module_names_and_marks_underflow():
    html = _wide_comparison().to_html()
    assert "<b>wide</b>" not in html and "&lt;b&gt;wide&lt;/b&gt;" in html
    assert "▼" in html and "hsl(" in html
    assert html.count("<tr>") == 3  # header + two layers (+ the loss row)


def test_widget_is_real_ipywidgets_and_its_metric_selector_redraws_the_heatmap():
    import ipywidgets

    w = _wide_comparison().to_widget()
    assert isinstance(w, ipywidgets.VBox)
    selector, view = w.children
    first = view.value
    selector.value = "act_underflow_pct"
    assert view.value != first and "activations underflowing to zero" in view.value


def test_the_renderers_never_import_torch():
    import ast
    import pathlib

    source = pathlib.Path(mpdoctor.__file__).parent / "render" / "comparison.py"
    names = {a.name for n in ast.walk(ast.parse(source.read_text())) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(ast.parse(source.read_text())) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(n == "torch" or n.startswith("torch.") for n in names)


def test_magic_compare_option_shows_the_table_and_returns_the_comparison(shell, capsys):
    torch.manual_seed(0)
    shell.user_ns["net"] = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    shell.user_ns["xb"] = wide_range_input(32, 64)
    result = shell.run_cell("c = %mpdoctor net --compare xb --text")
    assert result.error_in_exec is None
    out = capsys.readouterr().out
    assert "mpdoctor.compare: net" in out and "fp8" in out and "▼" in out
    assert isinstance(shell.user_ns["c"], Comparison)
    shell.user_ns["bad"] = torch.randn(3, 5)
    result = shell.run_cell("%mpdoctor net --compare bad")
    assert result.error_in_exec is None
    out = capsys.readouterr().out
    assert out.startswith("mpdoctor: --compare bad: the model rejected the batch") and "Traceback" not in out
    shell.run_cell("%mpdoctor net --compare nothing_here")
    assert "no such variable: nothing_here" in capsys.readouterr().out


def test_a_healthy_model_draws_no_warning():
    """No false alarms: a plain tiny Llama under every precision gets no error and no warning."""
    c = compare(tiny_llama(use_cache=False), batch(size=4, length=16), precisions=ALL)
    assert c.error is None
    assert not [f for f in c.findings if f.severity in ("error", "warning")], [f.message for f in c.findings]
    assert c.recommend("bf16").keep == ()
    # Its 8-wide k/v projections fit no fp8 GEMM, its 16-wide layers no MX block of 32: the only reasons to keep.
    assert {"model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"} <= set(c.recommend("fp8").keep)
    assert all(why == f"dims {why.split()[1]} not multiples of 16" for why in c.recommend("fp8").reasons.values())
    assert all(why.startswith("dims") and "not multiples of 32" in why for why in c.recommend("mxfp8").reasons.values())


@pytest.mark.parametrize("name, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_the_bf16_and_fp16_emulation_errs_as_much_as_real_cpu_autocast(name, dtype):
    """The emulated Linear and torch's own autocast Linear are the same distance from fp32 (within 1.5 dB)."""
    from mpdoctor.attach.emulation.sites import Emulation as _Emulation
    from mpdoctor.attach.emulation.sites import linears as _linears

    layer, x = plain_layer(), gaussian()
    exact = layer(x)
    with torch.autocast("cpu", dtype=dtype):
        real = layer(x).float()
    with _Emulation(_linears(layer), formats.precision(name)):
        emulated = layer(x)

    def sqnr(y):
        return 20 * math.log10(exact.norm() / (y - exact).norm())

    assert abs(sqnr(real) - sqnr(emulated)) < 1.5, (sqnr(real), sqnr(emulated))
    assert (real == emulated).float().mean() > 0.9  # most elements bit-identical


def test_batch_norm_running_statistics_are_the_same_before_every_run_and_after_compare():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 32))
    before = [b.clone() for b in model.buffers()]
    c = compare(model, gaussian(16, 32) + 3.0, precisions=("fp32", "bf16"))
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))
    # The emulated fp32 run saw the very statistics the reference saw: the same loss.
    assert c.losses["fp32"] == pytest.approx(compare(model, gaussian(16, 32) + 3.0, precisions=()).losses["fp32"])
