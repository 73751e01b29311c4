"""``mpdoctor.compare`` at attention's own matmuls, q·kᵀ and p·v: SDPA decomposed, eager attention's matmuls caught.

Real objects only: torch's own ``F.scaled_dot_product_attention`` is the oracle of the decomposition, tiny
Llamas built from configs run their ``sdpa`` and ``eager`` attention, ``nn.TransformerEncoderLayer`` and
``nn.MultiheadAttention`` run their SDPA and bmm paths.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from fingerprint import assert_unchanged, fingerprint
from setups import VOCAB, batch

from mpdoctor.attach.emulation.compare import KEEP_BELOW_DB, Comparison, compare
from mpdoctor.attach.emulation.formats import precision
from mpdoctor.attach.emulation.matmuls import LayerStats, emulated_sdpa

ALL = ("bf16", "fp16", "fp8", "fp8-rowwise", "mxfp8", "nvfp4")
QK, PV = "q·kᵀ", "p·v"
GLOBAL_MODULE_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called")


def llama(impl: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    """A 2-layer Llama, hidden 64, 4 query heads sharing 2 key/value heads (GQA), attention ``impl``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, use_cache=False, attn_implementation=impl,
    )  # fmt: skip
    return LlamaForCausalLM(config).train()


def qkv(heads: int = 4, kv_heads: int = 4, length: int = 16, keys: int = 16, dim: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((2, heads, length, dim), (2, kv_heads, keys, dim), (2, kv_heads, keys, dim))
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


def sqnr(exact: torch.Tensor, got: torch.Tensor) -> float:
    return 20 * math.log10(float(exact.norm() / (got - exact).norm()))


def attention_rows(c: Comparison) -> list:
    return [r for r in c.rows if r.kind == "attention"]


def global_module_hooks() -> dict:
    from torch.nn.modules import module

    return {name: dict(getattr(module, name)) for name in GLOBAL_MODULE_HOOKS}


# -- the decomposition is SDPA's own math ----------------------------------------------------------


def _mask(kind: str, length: int, keys: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    if kind == "bool":
        mask = torch.rand(2, 1, length, keys, generator=g) > 0.3
        mask[0, 0, 3] = False  # a query that may attend to nothing: SDPA gives zeros, not NaN
        return mask
    mask = torch.randn(length, keys, generator=g)
    mask[5] = -math.inf
    return mask


CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "causal, more keys than queries": {"is_causal": True, "keys": 24},
    "scale given": {"scale": 0.3},
    "grouped-query (enable_gqa)": {"enable_gqa": True, "kv_heads": 2},
    "bool mask with a dead row": {"mask": "bool"},
    "float mask with a -inf row": {"mask": "float"},
    "dropout": {"dropout_p": 0.3},
}


@pytest.mark.parametrize("case", list(CASES))
def test_emulated_sdpa_in_fp32_equals_torchs_sdpa_forward_and_backward(case):
    kwargs = dict(CASES[case])
    shape = {k: kwargs.pop(k) for k in ("kv_heads", "keys") if k in kwargs}
    mask = kwargs.pop("mask", None)
    q, k, v = qkv(**shape)
    if mask:
        kwargs["attn_mask"] = _mask(mask, q.shape[-2], k.shape[-2])
    torch.manual_seed(5)  # the same dropout mask: the decomposition draws as torch's math does on this CPU
    ref = F.scaled_dot_product_attention(q, k, v, **kwargs)
    ref_grads = torch.autograd.grad((ref * ref.detach().sin()).sum(), (q, k, v))
    torch.manual_seed(5)
    scores, mix = LayerStats(), LayerStats()
    out = emulated_sdpa(q, k, v, **kwargs, prec=precision("fp32"), scores=scores, mix=mix)
    grads = torch.autograd.grad((out * out.detach().sin()).sum(), (q, k, v))
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert scores.calls == mix.calls == 1 and len(scores.wgrad) == len(mix.wgrad) == 1  # both backward matmuls ran


def test_each_format_errs_at_attention_about_as_much_as_at_a_plain_gaussian_linear():
    """Per-format SQNR of both attention matmuls sits where the Linear calibration of KEEP_BELOW_DB puts the
    format (bf16 ~ 51, fp16 ~ 69, fp8 ~ 29, MXFP8 ~ 27, NVFP4 ~ 17 dB), above the keep threshold."""
    q, k, v = (t.detach() for t in qkv(length=64, keys=64, dim=64))
    sqnrs = {}
    for name in ALL:
        scores, mix = LayerStats(), LayerStats()
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        emulated_sdpa(qq, kk, vv, is_causal=True, prec=precision(name), scores=scores, mix=mix).square().sum().backward()
        from mpdoctor.attach.emulation.measurements import sqnr_db as _db

        sqnrs[name] = [_db(scores.out), _db(scores.wgrad), _db(mix.out), _db(mix.wgrad)]
        print(name, [f"{x:.1f}" for x in sqnrs[name]])
        assert all(x > KEEP_BELOW_DB[name] + 5 for x in sqnrs[name]), (name, sqnrs[name])
    assert min(sqnrs["nvfp4"]) > 12 and max(sqnrs["nvfp4"][:3]) < 25
    assert 45 < sqnrs["bf16"][0] < 58 and 63 < sqnrs["fp16"][0] < 76
    assert sqnrs["nvfp4"][0] < sqnrs["mxfp8"][0] < sqnrs["bf16"][0] < sqnrs["fp16"][0]


def test_emulated_bf16_sdpa_errs_as_much_as_real_cpu_autocast_sdpa():
    """Autocast runs SDPA in bf16 (a fused kernel: float32 scores, bf16 operands and output): within 1.5 dB."""
    q, k, v = (t.detach() for t in qkv(length=64, keys=64, dim=64))
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        real = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert real.dtype == torch.bfloat16
    emulated = emulated_sdpa(q, k, v, is_causal=True, prec=precision("bf16"), scores=LayerStats(), mix=LayerStats())
    assert abs(sqnr(exact, real.float()) - sqnr(exact, emulated)) < 1.5, (sqnr(exact, real.float()), sqnr(exact, emulated))


# -- real models --------------------------------------------------------------------------------------


def test_a_llama_gets_two_attention_rows_per_layer_between_its_projections_and_a_close_bf16_loss():
    model = llama()
    c = compare(model, batch(length=16), precisions=("bf16", "fp8", "nvfp4"))
    assert c.error is None and not c.errors
    modules = c.to_dict()["modules"]
    i = modules.index("model.layers.0.self_attn.v_proj")
    assert modules[i + 1 : i + 4] == [f"model.layers.0.self_attn [{QK}]", f"model.layers.0.self_attn [{PV}]", "model.layers.0.self_attn.o_proj"]
    assert [a[0] for a in c.attention] == [f"model.layers.{n}.self_attn [{w}]" for n in range(2) for w in (QK, PV)]
    # The rotary embedding's own matmul (inv_freq @ positions) is no attention matmul.
    assert not any("rotary" in m for m in modules)
    assert "2 attention modules" in c.reached and "not reached" in c.reached and "flash-attn" in c.reached
    assert all(math.isfinite(r.out_sqnr_db) and math.isfinite(r.wgrad_sqnr_db) for r in attention_rows(c))
    assert abs(c.losses["bf16"] - c.losses["fp32"]) < 2e-3 * abs(c.losses["fp32"])
    assert abs(c.losses["bf16"] - c.losses["fp32"]) < abs(c.losses["nvfp4"] - c.losses["fp32"])


def test_eager_and_sdpa_llamas_give_the_same_attention_rows():
    """transformers' eager attention (torch.matmul with repeated K/V heads) and its SDPA attention (enable_gqa)
    are the same matmuls: same labels, same measurements. Only bf16's q·kᵀ differs, by design: eager's
    autocast matmul rounds the scores to bf16, a fused SDPA kernel keeps them in float32."""
    b = batch(length=16)
    sdpa = compare(llama("sdpa"), b, precisions=("bf16", "fp8", "mxfp8", "nvfp4"))
    eager = compare(llama("eager"), b, precisions=("bf16", "fp8", "mxfp8", "nvfp4"))
    assert [a[0] for a in sdpa.attention] == [a[0] for a in eager.attention] and len(sdpa.attention) == 4
    assert {p: v for p, v in eager.losses.items() if p != "bf16"} == pytest.approx({p: v for p, v in sdpa.losses.items() if p != "bf16"}, rel=1e-5)
    assert eager.losses["bf16"] == pytest.approx(sdpa.losses["bf16"], rel=1e-4)
    for r in attention_rows(sdpa):
        e = eager.row(r.module, r.precision)
        if r.precision == "bf16":
            if r.module.endswith(f"[{QK}]"):
                assert r.out_sqnr_db > e.out_sqnr_db  # float32 scores against bf16-rounded ones
            else:
                assert r.out_sqnr_db == pytest.approx(e.out_sqnr_db, abs=0.5)
            continue
        assert r.out_sqnr_db == pytest.approx(e.out_sqnr_db, abs=0.01), r
        assert r.wgrad_sqnr_db == pytest.approx(e.wgrad_sqnr_db, abs=0.01), r
        assert r.act_underflow_pct == pytest.approx(e.act_underflow_pct, abs=1e-9)
        assert r.grad_underflow_pct == pytest.approx(e.grad_underflow_pct, abs=1e-9)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_padding_mask_reaches_sdpa_and_the_fp32_emulation_is_exact(impl):
    """Left padding: transformers passes SDPA a bool mask (rows of padded queries attend to nothing) and eager
    a float one. Emulated in fp32, the run reproduces the plain model's loss."""
    b = batch(length=16)
    b["attention_mask"] = torch.ones_like(b["input_ids"])
    b["attention_mask"][0, :5] = 0
    model = llama(impl)
    plain = compare(model, b, precisions=()).losses["fp32"]
    c = compare(model, b, precisions=("fp32", "fp8"))
    assert c.losses["fp32"] == pytest.approx(plain, rel=1e-6)
    assert all(r.out_sqnr_db == math.inf for r in attention_rows(c) if r.precision == "fp32")
    assert all(math.isfinite(r.out_sqnr_db) for r in attention_rows(c) if r.precision == "fp8")


def test_transformer_encoder_layer_attention_is_reached_inside_multi_head_attention_forward():
    """nn.TransformerEncoderLayer calls F.multi_head_attention_forward, a Python composite the mode re-enters:
    its SDPA and its out-projection are reached, with the layer's dropout masks unchanged."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1))
    target = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(2))

    def loss(out):
        return F.mse_loss(out, target)

    c = compare(layer, x, precisions=("fp32", "bf16", "fp8"), loss=loss)
    assert c.error is None
    assert c.to_dict()["modules"] == [f"self_attn [{QK}]", f"self_attn [{PV}]", "self_attn.out_proj", "linear1", "linear2"]
    # The emulated fp32 run (decomposed SDPA, its own dropout draw) gives the plain layer's loss exactly.
    assert c.losses["fp32"] == pytest.approx(compare(layer, x, precisions=(), loss=loss).losses["fp32"], rel=1e-6)
    assert abs(c.losses["bf16"] - c.losses["fp32"]) < 1e-3 * c.losses["fp32"]
    assert 20 < c.row(f"self_attn [{PV}]", "fp8").out_sqnr_db < 40


@pytest.mark.parametrize("with_mask", [False, True])
def test_multihead_attention_returning_its_weights_is_reached_through_bmm_and_baddbmm(with_mask):
    """nn.MultiheadAttention with need_weights=True multiplies with torch.bmm (torch.baddbmm with a float mask)."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(64, 4, batch_first=True, dropout=0.2)

        def forward(self, x, mask=None):
            out, weights = self.attn(x, x, x, attn_mask=mask)  # need_weights defaults to True
            return out + weights.sum()

    torch.manual_seed(0)
    block = Block()
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))
    args = (x, torch.randn(16, 16, generator=torch.Generator().manual_seed(2))) if with_mask else (x,)
    c = compare(block, args, precisions=("fp32", "bf16"), loss=lambda out: out.square().mean())
    assert [a[0] for a in c.attention] == [f"attn [{QK}]", f"attn [{PV}]"]
    assert c.losses["fp32"] == pytest.approx(compare(block, args, precisions=(), loss=lambda out: out.square().mean()).losses["fp32"], rel=1e-6)
    assert all(r.out_sqnr_db == math.inf for r in attention_rows(c) if r.precision == "fp32")
    assert all(40 < r.out_sqnr_db < 60 for r in attention_rows(c) if r.precision == "bf16")


def test_matmuls_outside_attention_modules_and_with_weights_are_not_taken_for_attention():
    class Mixer(torch.nn.Module):  # no "attention" in its name: its batched matmul is not attention's
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(16, 16)
            self.table = torch.nn.Parameter(torch.randn(4, 16, 16))

        def forward(self, x):
            h = self.proj(x)
            return torch.matmul(h, h.transpose(-2, -1)) @ h + h @ self.table

    c = compare(Mixer(), torch.randn(4, 8, 16), precisions=("fp8",))
    assert c.attention == () and [r.module for r in c.rows] == ["proj"]
    assert "no attention matmul" in c.reached


# -- advice, findings, rendering ----------------------------------------------------------------------


def test_recommend_never_keeps_an_attention_row_and_its_code_says_attention_stays_in_high_precision():
    c = compare(llama(), batch(length=16), precisions=("fp8", "nvfp4", "bf16"))
    for name in ("fp8", "nvfp4", "bf16"):
        rec = c.recommend(name, min_sqnr_db=1000)  # every measured row would fail this floor
        assert not any("[" in k for k in rec.keep)
        assert set(rec.keep) == {p for p, _, _ in c.layers}
    assert "attention's q·kᵀ and p·v are not converted" in c.recommend("fp8").code
    assert "autocast runs attention" in c.recommend("bf16").code
    filt = c.recommend("fp8").module_filter_fn()
    assert filt(torch.nn.Linear(64, 64), "model.layers.0.self_attn.q_proj")


def test_queries_spanning_six_decades_underflow_under_tensorwise_fp8_and_the_finding_is_info_about_attention():
    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.kv = torch.nn.Linear(256, 512)

        def forward(self, x):
            k, v = self.kv(x).chunk(2, dim=-1)
            heads = lambda t: t.unflatten(-1, (4, 64)).transpose(1, 2)  # noqa: E731
            return F.scaled_dot_product_attention(heads(x), heads(k), heads(v), is_causal=True)

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 32, 256, generator=g) * torch.logspace(-6, 0, 256)
    c = compare(Attention(), x, precisions=("fp8", "mxfp8"))
    assert c.row(f"(model) [{QK}]", "fp8").act_underflow_pct > 10
    assert c.row(f"(model) [{QK}]", "mxfp8").act_underflow_pct < 0.1
    finding = next(f for f in c.findings if f.check == "fp8-attention-underflows")
    assert finding.severity == "info" and f"(model) [{QK}]" in finding.evidence["matmuls"]
    assert "torchao's float8 and MX recipes convert nn.Linear only" in finding.message
    linear_findings = [f for f in c.findings if f.check == "fp8-layer-underflows"]
    assert all("[" not in m for f in linear_findings for m in f.evidence["layers"])


def test_text_html_and_widget_show_the_attention_rows():
    import ipywidgets

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    c = compare(layer, torch.randn(2, 16, 64), precisions=("bf16", "fp8"), loss=lambda out: out.square().mean())
    text = c.to_text()
    assert "per Linear and attention matmul" in text
    line = next(x for x in text.splitlines() if x.strip().startswith(f"self_attn [{QK}]"))
    assert len(line.split()) == 4  # label (two words) and one cell per precision
    html = c.to_html()
    assert f"self_attn [{PV}]" in html and "K/V grad (2nd operand)" in html and "Attention rows" in html
    widget = c.to_widget()
    assert isinstance(widget, ipywidgets.VBox)
    selector, view = widget.children
    selector.value = "wgrad_sqnr_db"
    assert "weight-gradient SQNR" in view.value and f"self_attn [{QK}]" in view.value
    frame = c.to_frame()
    assert set(frame.module) >= {f"self_attn [{QK}]", f"self_attn [{PV}]"} and frame.wgrad_sqnr_db.notna().all()


# -- it leaves everything as it was ---------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["sdpa", "eager", "encoder"])
def test_compare_leaves_models_with_attention_and_the_global_hooks_as_they_were(impl):
    if impl == "encoder":
        torch.manual_seed(0)
        model = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.3, batch_first=True)
        b = torch.randn(2, 16, 64)
        model(b).square().mean().backward()
    else:
        model = llama(impl)
        model.config.attention_dropout = 0.3  # dropout draws from the RNG in every run
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.3
        b = batch(length=16)
        model(**b).loss.backward()
    handle = next(m for n, m in model.named_modules() if n.endswith("self_attn")).register_forward_hook(lambda m, a, o: None)
    torch.manual_seed(123)
    hooks = global_module_hooks()
    before = fingerprint({"model": model, "batch": b})
    c = compare(model, b, precisions=ALL)
    after = fingerprint({"model": model, "batch": b})
    assert c.error is None and not c.errors and len(c.attention) >= 2
    assert_unchanged(before, after, "compare()")
    assert global_module_hooks() == hooks
    handle.remove()


def test_the_global_module_hooks_come_off_when_an_emulated_run_raises():
    class Flaky(torch.nn.Module):
        """Fine in the plain reference run, raises inside its attention module in the first emulated one."""

        def __init__(self) -> None:
            super().__init__()
            self.self_attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("boom")
            return self.self_attn(x, x, x, need_weights=False)[0]

    hooks = global_module_hooks()
    c = compare(Flaky(), torch.randn(2, 8, 16), precisions=("bf16", "fp8"))
    assert c.errors == {"bf16": "RuntimeError: boom"} and math.isfinite(c.losses["fp8"])
    assert global_module_hooks() == hooks
    assert [a[0] for a in c.attention] == [f"self_attn [{QK}]", f"self_attn [{PV}]"]
