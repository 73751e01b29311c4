"""Real gloo jobs on this CPU: the cross-rank report, FSDP1/FSDP2 units, and the harm it prevents.

Each job is bounded by a timeout (``run_ranks``); workers live in ``dist_workers.py``.
"""

from __future__ import annotations

import functools

import dist_workers as w
import pytest
from dist_harness import run_processes, run_ranks

pytestmark = pytest.mark.distributed


def _ok(results: dict, world: int) -> dict:
    assert sorted(results) == list(range(world)), results
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
    return {r: v for r, (_s, v) in results.items()}


def _assert_cured_on_every_rank(out: dict, world: int, odd: int, dtype: str, vias: tuple = ("api", "widget")) -> None:
    """Each rank named ``ranks-disagree`` on rank ``odd``; the odd rank's plan (and only it) cast its model, through
    the API and on a twin through the widget's button; then DDP's constructor and a step trained on every rank."""
    for via in vias:
        for rank in range(world):
            got = out[rank][via]
            assert got["before"]["severities"]["ranks-disagree"] == "error", (via, rank, got["before"])
            assert got["before"]["ranks_of"]["ranks-disagree"] == [odd]
            assert [r["agrees"] for r in got["before"]["table"]] == [r != odd for r in range(world)]
            assert got["frame_has_ranks"]
            assert bool(got["applied"]) == (rank == odd), (via, rank, got["applied"])
            assert via != "api" or "ranks-disagree" not in got["after"]["slugs"]
            assert got["dtype"] == dtype
            assert got["step"]["loss_finite"] and got["step"]["moved"] > 0, (via, rank, got["step"])


def test_ddp_ranks_with_different_dtypes_corrupt_weights_silently():
    """The harm first: fp16 on rank 0, bf16 on rank 1; DDP's constructor does not fail, it overwrites rank 1.
    Then the cure on twins of the setup, through the API and the widget: DDP's constructor and a step train."""
    out = _ok(run_ranks(w.ddp_fp16_vs_bf16, world=2, timeout=180), 2)
    assert out[0]["drift"] == 0.0
    assert out[1]["drift"] > 0.0  # rank 1's bf16 weights now hold rank 0's fp16 bytes
    odd = out[0]["api"]["before"]["ranks_of"]["ranks-disagree"][0]
    _assert_cured_on_every_rank(out, 2, odd, "torch.float16" if odd == 1 else "torch.bfloat16")


def test_with_no_majority_the_plan_follows_the_wider_range_so_adamw_ranks_get_a_plan_and_train():
    """fp16 on rank 0, bf16 on rank 1, AdamW on both: a tie. The plan casts rank 0 to bf16 (bf16 keeps fp32's
    range, and AdamW's eps stays representable), on every rank the same answer; the step trains on both."""
    out = _ok(run_ranks(w.ddp_fp16_vs_bf16_adamw, world=2, timeout=180), 2)
    assert out[0]["api"]["before"]["ranks_of"]["ranks-disagree"] == [0] == out[1]["api"]["before"]["ranks_of"]["ranks-disagree"]
    _assert_cured_on_every_rank(out, 2, 0, "torch.bfloat16")
    for rank in (0, 1):  # the tie going to fp16 traded the finding for adam-eps-underflow (an error) on both ranks
        after = out[rank]["api"]["after"]["severities"]
        assert not [slug for slug, sev in after.items() if sev in ("error", "warning")], (rank, after)


def test_ddp_with_fp32_and_bf16_ranks_aborts_the_bf16_rank():
    """The real failure without mpdoctor: fp32 weights on rank 0, bf16 on rank 1, each in its own process.

    DDP's start-up broadcast sends rank 0's 360 fp32 bytes into rank 1's 180-byte bf16 buffer: gloo aborts rank 1
    inside the constructor (a C++ abort, no Python exception), and rank 0, which got through the constructor,
    fails at its first backward all-reduce because its peer is gone.
    """
    out = run_processes("ddp_fp32_vs_bf16", world=2, timeout=150)
    code1, text1 = out[1]
    assert code1 is not None and code1 != 0, text1  # the process died (SIGABRT), it did not hang
    assert "gloo::EnforceNotMet" in text1 and "Received data size doesn't match expected size" in text1, text1
    assert "360 vs 180" in text1  # the 90 parameters in fp32 (360 bytes) sent into their 180-byte bf16 buffer
    assert "_sync_module_states" in text1 and "DDP constructed" not in text1  # aborted inside the constructor
    code0, text0 = out[0]
    assert code0 is not None and code0 != 0, text0
    assert "rank 0: DDP constructed" in text0 and "Connection reset by peer" in text0, text0
    assert "backward done" not in text0


def test_odd_rank_dtype_is_named_on_every_rank_and_fixed_in_place_before_ddp():
    out = _ok(run_ranks(w.odd_rank_dtype, world=2, timeout=180), 2)
    _assert_cured_on_every_rank(out, 2, 1, "torch.float32")


def test_identical_ranks_stay_quiet_and_the_exchange_is_small():
    out = _ok(run_ranks(w.identical, world=2, timeout=120), 2)
    for rank in (0, 1):
        assert out[rank]["slugs"] == []
        assert all(r["agrees"] and r["answered"] for r in out[rank]["table"])
        assert out[rank]["bytes"] < 1024  # a digest, counters and one reference fingerprint


def test_an_absent_rank_is_named_within_the_timeout():
    out = _ok(run_ranks(w.absent_rank, world=2, timeout=120), 2)
    assert out[0]["severities"]["rank-did-not-answer"] == "error"
    assert out[0]["ranks_of"]["rank-did-not-answer"] == [1]
    assert [r["answered"] for r in out[0]["table"]] == [True, False]


def test_fsdp2_mixed_unit_is_caught_before_the_first_forward_raises():
    out = _ok(run_ranks(w.fsdp2_mixed_unit, world=2, timeout=150), 2)
    for rank in (0, 1):
        assert out[rank]["report"]["severities"]["fsdp-mixed-dtype-unit"] == "error"
        assert "FSDP expects uniform original parameter dtype" in out[rank]["error"]
        assert out[rank]["healthy"]["slugs"] == []  # fp32 units + bf16 policy + fp32 reduce: the healthy recipe
        assert out[rank]["loss_finite"]
        assert out[rank]["half_reduce"]["severities"] == {"fsdp-reduce-in-half": "info"}


def test_fsdp1_wrap_error_and_policy_read_from_the_handle():
    """The plain FSDP1 wrap of a model with one bf16 layer raises; the crash explanation of that error names
    ``mixed-param-dtypes`` on every rank, its cast (API, then the widget on a twin) lets the same wrap train."""
    out = _ok(run_ranks(w.fsdp1_units, world=2, timeout=180), 2)
    for rank in (0, 1):
        assert "Must flatten tensors with uniform dtype" in out[rank]["error"]
        for via in ("api", "widget"):
            got = out[rank][via]
            assert got["report"]["severities"]["mixed-param-dtypes"] == "error", (via, got["report"])
            assert got["applied"] and got["applied"][0].endswith("to float32"), got["applied"]
            assert via != "api" or "mixed-param-dtypes" not in got["after"]["slugs"]
            assert got["dtypes"] == ["torch.float32"]
            assert got["step"]["loss_finite"] and got["step"]["moved"] > 0, (via, got["step"])
        assert out[rank]["units"] == [["fsdp1", ["float32"], "bfloat16", "bfloat16"]]
        assert out[rank]["report"]["severities"] == {"fsdp-reduce-in-half": "info"}


def test_four_ranks_one_odd():
    """The same on 4 ranks, through the API (the widget's button is proven on 2 ranks)."""
    out = _ok(run_ranks(functools.partial(w.odd_rank_dtype, vias=("api",)), world=4, timeout=300), 4)
    _assert_cured_on_every_rank(out, 4, 3, "torch.float32", vias=("api",))
