"""The value scan: exact counts, bounded temporary memory, per-module tables and the findings it feeds."""

from __future__ import annotations

import math

import pytest
import torch
from fingerprint import assert_unchanged, fingerprint
from hypothesis import given, settings
from hypothesis import strategies as st
from setups import tiny_gemma3, tiny_llama, training_args
from torch.utils._python_dispatch import TorchDispatchMode

import mpdoctor
from mpdoctor.diagnosis.scan_rows import module_rows, scan_table
from mpdoctor.objects.gathering.values import (
    FP16_MAX,
    SMALL_ELEMENTS,
    TEMP_BUDGET,
    chunk_elements_for,
    scan_tensor,
    scan_tensors,
)

FP16_TINY = 2.0**-24


def reference(t: torch.Tensor) -> dict:
    """The same statistics, the slow obvious way (in float64)."""
    x = t.detach().double()
    finite = torch.isfinite(x)
    a = x.abs()
    nonzero_tiny = lambda limit: int(((a < limit) & (x != 0) & finite).sum())  # noqa: E731
    wide = t.dtype.itemsize > 2 or t.dtype == torch.bfloat16
    wider = t.dtype.itemsize > 2
    return {
        "numel": t.numel(),
        "nan": int(torch.isnan(x).sum()),
        "inf": int(torch.isinf(x).sum()),
        "absmax": float(a[finite].max()) if finite.any() else 0.0,
        "fp16_overflow": int(((a > FP16_MAX) & finite).sum()) if wide else 0,
        "bf16_overflow": int(((a > float(torch.finfo(torch.bfloat16).max)) & finite).sum()) if wider else 0,
        "fp16_underflow": nonzero_tiny(FP16_TINY) if wide else 0,
        "bf16_underflow": nonzero_tiny(2.0**-133) if wider else 0,
    }


PLANTS = [math.nan, math.inf, -math.inf, 7e4, -1e5, 65504.0, 65536.0, 1e-9, -3e-8, 6e-8, 0.0, 1e39, 1e-40]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    n=st.integers(1, 5000),
    chunk=st.integers(1, 700),
    read=st.integers(1, 3000),
    plants=st.lists(st.tuples(st.integers(0, 4999), st.sampled_from(PLANTS)), max_size=12),
    underflow=st.booleans(),
)
def test_scan_counts_planted_nan_inf_overflow_and_underflow_exactly_whatever_the_chunking(
    dtype, n, chunk, read, plants, underflow
):
    t = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    for i, value in plants:
        t[i % n] = value
    t = t.to(dtype)  # planted values take the dtype's rounding (1e39 -> inf in fp32, 7e4 -> inf in fp16)
    got = scan_tensor(t, underflow=underflow, chunk_elements=chunk * 2, read_elements=read)
    want = reference(t)
    if not underflow:
        want["fp16_underflow"] = want["bf16_underflow"] = None
    assert got == want


def test_scan_reads_non_contiguous_sliced_and_float8_tensors_without_missing_a_value():
    base = torch.randn(300, 400, generator=torch.Generator().manual_seed(1))
    base[17, 3] = math.nan
    base[250, 399] = 1e5
    base[299, 0] = -math.inf
    for view in (base.t(), base[:, 1:], base[::2, ::3], base.unsqueeze(0).expand(2, 300, 400)):
        assert scan_tensor(view, chunk_elements=1000, read_elements=4096) == dict(
            reference(view), fp16_underflow=None, bf16_underflow=None
        )
    f8 = base.clamp(-400, 400).nan_to_num(0.0).to(torch.float8_e4m3fn)
    f8[0, 0] = math.nan
    got = scan_tensor(f8, chunk_elements=1000)
    assert (got["nan"], got["fp16_overflow"]) == (1, 0)


def test_bf16_65536_is_past_fp16_range_although_65504_rounds_to_it_in_bf16():
    t = torch.tensor([65536.0, 1.0, -65536.0, 60000.0], dtype=torch.bfloat16)
    assert scan_tensor(t)["fp16_overflow"] == 2


def test_chunks_keep_the_scan_buffers_within_the_temporary_memory_budget():
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e5m2):
        chunk = chunk_elements_for(dtype)
        work = dtype if dtype.itemsize >= 2 else torch.float32
        # copy + abs values in the work dtype, one boolean mask: the buffers one chunk needs
        assert chunk * (2 * work.itemsize + 1) <= TEMP_BUDGET
    assert TEMP_BUDGET <= 64 * 2**20


class AllocationLog(TorchDispatchMode):
    """Records the bytes of every tensor an op allocates (outputs that alias no input)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr()
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        for o in torch.utils._pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, o.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("underflow", [False, True])
def test_no_op_of_a_scan_allocates_more_than_one_chunk_even_on_a_tensor_full_of_nan(underflow):
    big = torch.full((2048, 2048), math.nan)  # 16 MiB of fp32, every chunk gets the exact counts
    big[::7] = 1e6
    log = AllocationLog()
    with log:
        got = scan_tensor(big, underflow=underflow, chunk_elements=65536)
    assert got["nan"] + got["fp16_overflow"] == big.numel()
    assert 0 < log.largest <= 65536 * 4  # one fp32 chunk, never the tensor's 16 MiB
    assert big.numel() * 4 > 60 * log.largest


SHAPES = [(), (1,), (3,), (0,), (0, 4), (4, 5), (5, 4), (2, 3, 4), (64, 64)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _planted(shape, dtype, seed: int, plants) -> torch.Tensor:
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    for i, value in plants:
        if t.numel():
            t.view(-1)[i % t.numel()] = value
    return t.to(dtype)


def _entries(tensors):
    return [(f"m{i % 3}", "param", f"t{i}", t) for i, t in enumerate(tensors)]


@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(
        st.tuples(
            st.sampled_from(SHAPES),
            st.sampled_from(DTYPES),
            st.lists(st.tuples(st.integers(0, 4095), st.sampled_from(PLANTS)), max_size=3),
            st.booleans(),  # a transposed (non-contiguous) view instead of the tensor itself
        ),
        min_size=1,
        max_size=40,
    ),
    chunk=st.integers(1, 300),
    underflow=st.booleans(),
)
def test_the_bulk_scan_of_many_small_tensors_is_exact_per_tensor_whatever_the_mix_and_chunking(specs, chunk, underflow):
    tensors = []
    for n, (shape, dtype, plants, transpose) in enumerate(specs):
        t = _planted(shape, dtype, n, plants)
        tensors.append(t.t() if transpose and t.dim() == 2 else t)
    sf = scan_tensors(_entries(tensors), "model", "model", underflow=underflow, chunk_elements=chunk)
    assert sf.skipped == ()
    assert [r.name for r in sf.tensors] == [f"t{i}" for i in range(len(tensors))]  # input order, one row each
    for row, t in zip(sf.tensors, tensors):
        want = reference(t)
        if not underflow:
            want["fp16_underflow"] = want["bf16_underflow"] = None
        assert {k: getattr(row, k) for k in want} == want, (row, tuple(t.shape), t.dtype)
        assert (row.dtype, row.device, row.kind, row.object) == (str(t.dtype).removeprefix("torch."), "cpu", "param", "model")


def test_ten_thousand_small_tensors_keep_exact_counts_and_abs_max_per_tensor_and_per_module():
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(64, 64, generator=gen).to(torch.bfloat16) for _ in range(10_000)]
    tensors[17][3, 4] = math.nan
    tensors[17][5, 6] = math.inf
    tensors[4242][0, 0] = -1e5  # past fp16's range, in bf16
    tensors[9997][63, 63] = -12.5  # the largest finite magnitude of its module
    sf = scan_tensors(_entries(tensors), "model", "model")
    rows = {r.name: r for r in sf.tensors}
    assert len(rows) == 10_000
    assert (rows["t17"].nan, rows["t17"].inf, rows["t17"].absmax) == (1, 1, reference(tensors[17])["absmax"])
    bf16_1e5 = float(torch.tensor(1e5, dtype=torch.bfloat16))
    assert (rows["t4242"].fp16_overflow, rows["t4242"].absmax) == (1, bf16_1e5)
    assert rows["t9997"].absmax == 12.5
    for i in (0, 1, 9998):
        assert rows[f"t{i}"].absmax == float(tensors[i].abs().max())
    by_module = {r["module"]: r for r in module_rows(sf.tensors)}  # tensor i belongs to module m{i % 3}
    assert (by_module["m0"]["fp16_overflow"], by_module["m0"]["absmax"]) == (1, bf16_1e5)
    assert (by_module["m1"]["nan"], by_module["m1"]["absmax"]) == (0, 12.5)
    assert (by_module["m2"]["nan"], by_module["m2"]["inf"]) == (1, 1)


def test_tensors_the_bulk_path_cannot_read_are_skipped_or_read_one_at_a_time_with_the_reason():
    with torch.device("meta"):
        meta = torch.randn(4, 4)
    f8 = torch.tensor([1.0, -448.0, math.nan]).to(torch.float8_e4m3fn)
    big = torch.zeros(SMALL_ELEMENTS + 1)
    big[-1] = math.inf
    lazy = torch.nn.LazyLinear(4).weight  # no shape until the first forward
    tensors = [torch.ones(3), meta, torch.arange(4), f8, big, torch.ones(2, 2).to_sparse(), torch.ones(3) * 2, lazy]
    sf = scan_tensors(_entries(tensors), "model", "model")
    skipped = dict(sf.skipped)
    assert skipped.pop("t7").startswith("RuntimeError: Can't access the shape of an uninitialized parameter")
    assert skipped == {"t1": "meta", "t2": "not floating (int64)", "t5": "layout torch.sparse_coo"}
    rows = {r.name: r for r in sf.tensors}
    assert (rows["t3"].nan, rows["t3"].absmax, rows["t3"].dtype) == (1, 448.0, "float8_e4m3fn")
    assert (rows["t4"].inf, rows["t4"].numel) == (1, SMALL_ELEMENTS + 1)
    assert (rows["t0"].absmax, rows["t6"].absmax) == (1.0, 2.0)


@pytest.mark.parametrize("underflow", [False, True])
def test_the_bulk_scan_allocates_at_most_its_budget_whatever_the_number_of_small_tensors(underflow):
    gen = torch.Generator().manual_seed(5)
    tensors = [torch.randn(32, 32, generator=gen) for _ in range(2_000)]  # 8 MiB of fp32
    tensors[1234][1, 1] = math.nan
    log = AllocationLog()
    with log:
        sf = scan_tensors(_entries(tensors), "model", "model", underflow=underflow, chunk_elements=16_384)
    assert sum(r.nan for r in sf.tensors) == 1 and len(sf.tensors) == 2_000
    assert 0 < log.largest <= 16_384 * 4  # one chunk of fp32 values, never all 8 MiB
    assert sf.peak_temp_bytes <= 16_384 * (4 + 1)  # the chunk and its mask


def test_a_scan_of_many_small_tensors_and_their_grads_changes_nothing_it_reads():
    model = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(300)).to(torch.bfloat16)
    for layer in model:
        layer(torch.ones(2, 8, dtype=torch.bfloat16)).sum().backward()
    with torch.no_grad():
        model[7].weight[0, 0] = math.nan
        model[9].bias.grad[1] = -7e4
    before = fingerprint({"model": model})
    report = mpdoctor.diagnose(model, names={id(model): "model"}, scan=True)
    assert_unchanged(before, fingerprint({"model": model}), "a scan")
    rows = {t.name: t for t in report.facts.scans[0].tensors}
    assert len(rows) == 1200  # weight, bias and both grads of 300 layers
    assert rows["model.7.weight"].nan == 1 and rows["model.9.bias.grad"].fp16_overflow == 1


def _live_state(*objects) -> list:
    out = []
    for obj in objects:
        tensors = list(obj.parameters()) + [p.grad for p in obj.parameters() if p.grad is not None]
        out += [(t.data_ptr(), t._version, t.clone()) for t in tensors]
    return out


def test_diagnose_with_scan_counts_per_tensor_kind_and_module_and_mutates_nothing():
    model = tiny_llama(use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(**{"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 4, dtype=torch.long)}).loss.backward()
    opt.step()
    down = model.model.layers[1].mlp.down_proj
    with torch.no_grad():
        down.weight[0, :3] = torch.tensor([math.nan, math.inf, 1e5])
        model.model.layers[0].self_attn.q_proj.weight.grad[2, 2] = -math.inf
        opt.state[down.weight]["exp_avg_sq"][1, 1] = math.nan
    before = _live_state(model)
    state_before = {k: v.clone() for k, v in opt.state[down.weight].items()}

    report = mpdoctor.diagnose(model, opt, names={id(model): "model", id(opt): "opt"}, scan=True)

    for (ptr, version, copy), (ptr2, version2, now) in zip(before, _live_state(model)):
        assert ptr == ptr2 and version == version2 and torch.equal(copy.nan_to_num(), now.nan_to_num())
    assert all(torch.equal(v.nan_to_num(), opt.state[down.weight][k].nan_to_num()) for k, v in state_before.items())
    by_kind = {f.evidence["kind"]: f for f in report.findings_for("nonfinite-values")}
    assert set(by_kind) == {"param", "grad", "optimizer_state"}
    assert (by_kind["param"].evidence["nan"], by_kind["param"].evidence["inf"]) == (1, 1)
    assert by_kind["param"].subject == "model.model.layers.1.mlp.down_proj.weight"
    assert (by_kind["grad"].evidence["nan"], by_kind["grad"].evidence["inf"]) == (0, 1)
    assert by_kind["optimizer_state"].evidence["tensors"][0]["module"] == "model.layers.1.mlp.down_proj"
    assert all(f.severity == "error" for f in by_kind.values())  # no scaler: nothing skips the step

    table = scan_table(report.facts)
    row = table[(table.module == "model.layers.1.mlp.down_proj") & (table.kind == "param")].iloc[0]
    assert (row.nan, row.inf, row.fp16_overflow, row.absmax) == (1, 1, 1, 1e5)
    assert row.fp16_underflow is None  # nothing here runs in fp16, so flush-to-zero was not counted
    assert set(table.kind) == {"param", "grad", "optimizer_state"}


def test_meta_tensors_are_skipped_and_reported_as_such():
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    report = mpdoctor.diagnose(model, scan=True)
    (scan,) = report.facts.scans
    assert scan.tensors == () and {r for _, r in scan.skipped} == {"meta"}


def test_flush_to_zero_is_counted_when_fp16_is_in_play():
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([1e-9, 6e-8, 0.0, 1.0]).expand(4, 4))
    with torch.autocast("cpu", dtype=torch.float16):
        report = mpdoctor.diagnose(model, scan=True)
    (weight,) = [t for t in report.facts.scans[0].tensors if t.name.endswith("weight")]
    assert weight.fp16_underflow == 4  # 1e-9 flushes; 6e-8 > 2**-24 does not; zero is not counted


def _overflow(report):
    (finding,) = report.findings_for("fp16-overflow-risk")
    return finding


def test_bf16_native_family_trained_in_fp16_is_an_overflow_risk_error():
    model = tiny_gemma3(torch.bfloat16)
    report = mpdoctor.diagnose(model, training_args(fp16=True), names={id(model): "gemma"})
    finding = _overflow(report)
    assert finding.severity == "error" and finding.subject == "gemma"
    assert "gemma3" in finding.evidence["model_types"]
    assert any("fp16" in r for r in finding.evidence["fp16_reasons"])


def test_a_bf16_family_is_a_risk_only_once_something_computes_in_fp16():
    model = tiny_gemma3(torch.bfloat16)
    for target in ("A100", "T4"):  # on a T4 without fp16 in play, bf16-unsupported tells to use fp32
        assert not mpdoctor.diagnose(model, target=target).findings_for("fp16-overflow-risk")
    with torch.autocast("cpu", dtype=torch.float16):
        assert _overflow(mpdoctor.diagnose(model, target="T4")).severity == "error"


def test_bf16_weights_past_65504_on_a_device_without_bf16_are_a_warning():
    model = tiny_llama(torch.bfloat16, use_cache=False)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight[2, 3] = -7e4
    finding = _overflow(mpdoctor.diagnose(model, scan=True, target="T4"))
    assert finding.severity == "warning" and "only half precision" in finding.message


def test_llama_in_fp16_is_no_overflow_risk_without_values_past_the_range():
    model = tiny_llama(torch.float16)
    assert not mpdoctor.diagnose(model, scan=True).findings_for("fp16-overflow-risk")


def test_scanned_weights_past_65504_are_an_error_under_fp16_autocast_and_info_otherwise():
    model = tiny_llama(torch.bfloat16, use_cache=False)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = 1e5
    assert _overflow(mpdoctor.diagnose(model, scan=True)).severity == "info"
    with torch.autocast("cpu", dtype=torch.float16):
        finding = _overflow(mpdoctor.diagnose(model, scan=True))
    assert finding.severity == "error"
    assert finding.evidence["overflow_values"] == 1
    assert finding.evidence["overflow_tensors"] == ["model.model.layers.0.mlp.up_proj.weight"]
