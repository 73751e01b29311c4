"""Reported failures from the public trackers, reproduced on 2 real gloo ranks with tiny models.

- https://github.com/huggingface/peft/issues/484: FSDP on a PEFT model, fp16 base and fp32 adapters:
  ``ValueError: `FlatParameter` requires uniform dtype but got torch.float16 and torch.float32``
  (torch 2.13 words it "Must flatten tensors with uniform dtype").
- https://github.com/huggingface/trl/issues/1723: a TRL trainer with FSDP on a bf16 model with fp32 trainable
  parameters: ``ValueError: Must flatten tensors with uniform dtype but got torch.bfloat16 and torch.float32``
  at ``accelerator.prepare``.

Both: the real error first (FSDP1's wrap, as the Trainer's ``accelerator.prepare`` performs it), then the
diagnosis of the wrap the TrainingArguments plan (``fsdp-mixed-dtype-unit``), the in-place cast, a wrap and a
training step that work.
"""

from __future__ import annotations

import functools

import dist_workers as w
import pytest
from dist_harness import run_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(
    ("base", "names", "issue"),
    [
        ("float16", "torch.float16 and torch.float32", "https://github.com/huggingface/peft/issues/484"),
        ("bfloat16", "torch.bfloat16 and torch.float32", "https://github.com/huggingface/trl/issues/1723"),
    ],
)
def test_fsdp_on_a_half_base_with_fp32_adapters(base, names, issue):
    results = run_ranks(functools.partial(w.fsdp1_peft_adapters, base_dtype=base), world=2, timeout=200)
    assert sorted(results) == [0, 1], results
    for rank, (status, out) in results.items():
        assert status == "ok", f"rank {rank}: {out}"
        assert "Must flatten tensors with uniform dtype" in out["error"], issue
        assert set(out["error"].split("got ")[1].split(" and ")) == set(names.split(" and "))
        for via in ("api", "widget"):
            got = out[via]
            assert got["report"]["severities"]["fsdp-mixed-dtype-unit"] == "error", (via, got["report"])
            assert len(got["applied"]) == 1 and got["applied"][0].endswith("to float32"), got["applied"]
            assert via != "api" or "fsdp-mixed-dtype-unit" not in got["after"]["slugs"]
            assert got["dtypes"] == ["torch.float32"]
            assert got["step"]["loss_finite"] and got["step"]["moved"] > 0, (via, got["step"])
