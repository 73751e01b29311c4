"""A held dynamic KV cache that a failed call left half-updated (karpathy/nanochat#795's class, after the crash).

``generate(past_key_values=cache)`` with an fp32 cache in a bf16 model raises in the first layer's attention, after
that layer has concatenated the new tokens: layer 0 holds 5 tokens, layer 1 still 4 (measured). The cast of the
cache, the cure before the call, is then not enough: the same cell run again fails with "The size of tensor a (7)
must match the size of tensor b (8)" because every call reads layer 0's length. The report after the crash plans the
cast and the crop back to the tokens every layer holds; the proof replays the failing cell and leaves the cache
as it was.
"""

from __future__ import annotations

import pytest
import torch
from notebook_shell import loaded_shell
from test_field_inference import continue_prompt, prompt_cached

import mpdoctor

pytestmark = pytest.mark.colab


def lengths(cache) -> list[int]:
    return [int(layer.keys.shape[-2]) for layer in cache.layers]


def failed_once() -> dict:
    """The user's objects right after the failing cell: the fp32 prompt cache, half-updated by the raise."""
    ns = prompt_cached(static=False, cast_first=False)
    with pytest.raises(RuntimeError, match="Expected query, key, and value to have the same dtype"):
        continue_prompt(ns)
    assert lengths(ns["prompt_cache"]) == [5, 4]  # the first layer took the new token, the second did not
    return ns


def reference_tokens() -> torch.Tensor:
    """What the call gives with a cache the bf16 model filled itself (the healthy twin)."""
    return continue_prompt(prompt_cached(static=False, cast_first=True)).sequences


def test_the_cast_alone_does_not_cure_a_half_updated_cache():
    ns = failed_once()
    report = mpdoctor.diagnose(namespace=ns)
    (cast,) = [fx for fx in report.fixes if fx.slug == "kv-cache-dtype-mismatch"]
    cast.apply()
    with pytest.raises(RuntimeError, match=r"The size of tensor a \(\d+\) must match the size of tensor b"):
        continue_prompt(ns)  # the measured harm of the half-update itself


def test_a_half_updated_cache_is_named_and_the_plan_of_cast_and_crop_makes_the_call_give_the_healthy_tokens():
    ns = failed_once()
    report = mpdoctor.diagnose(namespace=ns)
    (f,) = report.findings_for("kv-cache-half-updated")
    assert f.severity == "error" and f.subject == "prompt_cache" and f.evidence == {"lengths": [5, 4], "keep": 4}
    crop = f.fixes[0]
    assert crop.safe and crop in report.fixes and not crop.in_place
    assert {fx.slug for fx in report.fixes} == {"kv-cache-dtype-mismatch", "kv-cache-half-updated"}
    keys = [layer.keys for layer in ns["prompt_cache"].layers]
    for fx in report.fixes:
        fx.apply()
    assert lengths(ns["prompt_cache"]) == [4, 4]
    assert mpdoctor.diagnose(namespace=ns).findings_for("kv-cache-half-updated") == []
    crop.undo()
    assert ns["prompt_cache"].layers[0].keys.shape[-2] == 5  # the very tensor back (cast since, by the other fix)
    crop.apply()
    assert torch.equal(continue_prompt(ns).sequences, reference_tokens())
    assert keys[1] is not ns["prompt_cache"].layers[1].keys  # cast copies, the user's cache object kept


def test_a_cache_every_layer_of_which_holds_the_same_tokens_draws_nothing():
    ns = prompt_cached(static=False, cast_first=True)
    continue_prompt(ns)  # a call that succeeded: every layer took its tokens
    assert len(set(lengths(ns["prompt_cache"]))) == 1
    assert mpdoctor.diagnose(namespace=ns).findings_for("kv-cache-half-updated") == []


SETUP = """
import torch
from test_field_inference import prompt_cached, continue_prompt
ns = prompt_cached(static=False, cast_first=False)
model, prompt_cache, ids = ns["model"], ns["prompt_cache"], ns["ids"]
"""
CALL = "out = continue_prompt({'model': model, 'prompt_cache': prompt_cache, 'ids': ids})\n"


def test_after_the_crash_the_plan_is_verified_on_the_failing_cell_and_the_cache_is_left_as_it_was():
    names = ("torch", "prompt_cached", "continue_prompt", "ns", "model", "prompt_cache", "ids", "out", "r")
    with loaded_shell(names) as sh:
        sh.run_cell(SETUP, store_history=True)
        failed = sh.run_cell(CALL, store_history=True)
        assert not failed.success and "same dtype" in str(failed.error_in_exec)
        cache = sh.user_ns["prompt_cache"]
        held = [(layer.keys, layer.values) for layer in cache.layers]
        assert lengths(cache) == [5, 4]
        sh.run_cell("r = %mpdoctor --text", store_history=True)
        report = sh.user_ns["r"]
        assert {fx.slug for fx in report.fixes} >= {"kv-cache-dtype-mismatch", "kv-cache-half-updated"}
        assert report.proof is not None and report.proof.verified, report.proof and report.proof.summary()
        # The replays ran the cell on the cache and gave it back: the same tensors, nothing appended.
        assert lengths(cache) == [5, 4] and all(layer.keys is k and layer.values is v
                                                  for layer, (k, v) in zip(cache.layers, held))
        for fx in report.fixes:
            fx.apply()
        assert sh.run_cell(CALL, store_history=True).success
        assert torch.equal(sh.user_ns["out"].sequences, reference_tokens())
