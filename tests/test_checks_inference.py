"""Specifications of inference in the kernel that trained: a KV cache the user holds in another dtype
than the model computes in (kv-cache-dtype-mismatch), reproduced with a real tiny Llama and its real
``DynamicCache`` / ``StaticCache``, diagnosed, fixed in place and undone."""

from __future__ import annotations

import pytest
import torch
from setups import tiny_llama
from setups_dtypes import alarms
from transformers import StaticCache

import mpdoctor
import mpdoctor.rules.engine.changes as changes_mod
from mpdoctor.rules.engine.fixes import FixFailed

PROMPT = torch.tensor([[3, 14, 15, 9, 2, 6]])
NEXT = torch.tensor([[5]])
SAME_DTYPE = "Expected query, key, and value to have the same dtype"


def prefilled(model: torch.nn.Module):
    """The prompt's cache, filled by ``model`` as it is now (a ``DynamicCache``)."""
    with torch.no_grad():
        return model(PROMPT, use_cache=True).past_key_values


def stored(cache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def continue_from(model, cache) -> torch.Tensor:
    """The user's step: one token on the cached prompt, then ``generate`` on with the same cache."""
    with torch.no_grad():
        logits = model(NEXT, past_key_values=cache).logits
    out = model.generate(torch.cat([PROMPT, NEXT, logits[:, -1:].argmax(-1)], dim=1), past_key_values=cache,
                         max_new_tokens=3, do_sample=False)  # fmt: skip
    assert out.shape[1] == PROMPT.shape[1] + 5
    return logits


def test_an_fp32_cache_handed_to_the_model_cast_to_bf16_fails_and_the_cast_fix_makes_generate_run():
    model = tiny_llama(torch.float32, train=False)
    cache = prefilled(model)  # filled before the model was cast after fine-tuning
    model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=SAME_DTYPE):
        continue_from(model, prefilled(tiny_llama(torch.float32, train=False)))  # an untouched twin raises

    report = mpdoctor.diagnose(namespace={"model": model, "cache": cache})
    (finding,) = report.findings_for("kv-cache-dtype-mismatch")
    assert finding.severity == "error" and finding.subject == "cache"
    assert "fp32" in finding.message and "bf16" in finding.message and SAME_DTYPE in finding.message
    (fix,) = finding.fixes
    assert fix.safe

    old = stored(cache)
    fix.apply()
    assert {t.dtype for t in stored(cache)} == {torch.bfloat16}
    assert not report.refresh().findings_for("kv-cache-dtype-mismatch")
    fix.undo()
    assert all(a is b for a, b in zip(stored(cache), old))  # the very tensors are back

    fix.apply()
    fix.apply()  # idempotent
    logits = continue_from(model, cache)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    # The fixed cache continues as the bf16 model's own cache of the same prompt (up to the prompt's rounding).
    with torch.no_grad():
        own = model(NEXT, past_key_values=prefilled(model)).logits
    assert torch.allclose(logits.float(), own.float(), atol=0.1)


def test_a_cast_failing_at_its_third_allocation_leaves_the_cache_untouched(monkeypatch):
    model = tiny_llama(torch.float32, train=False)
    cache = prefilled(model)
    model.to(torch.bfloat16)
    (finding,) = mpdoctor.diagnose(namespace={"model": model, "cache": cache}).findings_for("kv-cache-dtype-mismatch")
    old = stored(cache)
    real, calls = changes_mod.cast_tensor, []

    def failing(tensor, dtype):
        calls.append(dtype)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("injected at the third allocation")
        return real(tensor, dtype)

    monkeypatch.setattr(changes_mod, "cast_tensor", failing)
    with pytest.raises(FixFailed):
        finding.fixes[0].apply()
    assert all(a is b for a, b in zip(stored(cache), old)) and len(stored(cache)) == len(old)
    monkeypatch.setattr(changes_mod, "cast_tensor", real)
    finding.fixes[0].apply()
    assert {t.dtype for t in stored(cache)} == {torch.bfloat16}


def test_a_static_cache_allocated_in_fp32_refuses_bf16_keys_and_the_fix_retypes_its_layers():
    model = tiny_llama(torch.bfloat16, train=False)
    cache = StaticCache(config=model.config, max_cache_len=16)
    cache.early_initialization(batch_size=1, num_heads=1, head_dim=8, dtype=torch.float32, device="cpu")
    twin = StaticCache(config=model.config, max_cache_len=16)
    twin.early_initialization(batch_size=1, num_heads=1, head_dim=8, dtype=torch.float32, device="cpu")
    with pytest.raises(RuntimeError, match="index_copy_"):
        model.generate(PROMPT, past_key_values=twin, max_new_tokens=3, do_sample=False)

    report = mpdoctor.diagnose(namespace={"model": model, "static": cache})
    (finding,) = report.findings_for("kv-cache-dtype-mismatch")
    assert finding.severity == "error" and "index_copy_" in finding.message
    finding.fixes[0].apply()
    assert {layer.dtype for layer in cache.layers} == {torch.bfloat16}
    out = model.generate(PROMPT, past_key_values=cache, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == PROMPT.shape[1] + 3
    finding.fixes[0].undo()
    assert {layer.dtype for layer in cache.layers} == {torch.float32}
    assert {t.dtype for t in stored(cache)} == {torch.float32}


def test_a_bf16_cache_in_an_fp32_model_runs_but_is_silently_upcast_a_warning():
    model = tiny_llama(torch.bfloat16, train=False)
    cache = prefilled(model)
    model.to(torch.float32)
    report = mpdoctor.diagnose(namespace={"model": model, "cache": cache})
    (finding,) = report.findings_for("kv-cache-dtype-mismatch")
    assert finding.severity == "warning" and "silently upcasts" in finding.message
    with torch.no_grad():
        model(NEXT, past_key_values=cache)
    assert {t.dtype for t in stored(cache)} == {torch.float32}  # what the warning says happened


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_filled_by_the_model_as_it_is_draws_no_alarm(dtype):
    model = tiny_llama(dtype, train=False)
    cache = prefilled(model)
    empty = StaticCache(config=model.config, max_cache_len=16)  # lazily allocated in the model's dtype
    report = mpdoctor.diagnose(namespace={"model": model, "cache": cache, "empty": empty})
    assert [s.name for s in report.subjects if s.kind == "kv_cache"] == ["cache", "empty"]
    assert not report.findings_for("kv-cache-dtype-mismatch")
    assert alarms(report) == []
    assert torch.isfinite(continue_from(model, cache)).all()


# -- attention-mask-overflow ---------------------------------------------------------------------------

LEFT_PADDED = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
PADDING = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])


def allowed() -> torch.Tensor:
    """Causal and not padding: the first row's two left pads allow no key at all."""
    n = LEFT_PADDED.shape[1]
    return torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None] & PADDING[:, None, None, :].bool()


def fp16_eager_llama() -> torch.nn.Module:
    """A tiny fp16 Llama on eager attention: torch's CPU SDPA keeps fully masked rows finite (docs/stack.md), eager
    attention shows what users on eager and on GPU kernels that do not guard such rows see."""
    model = tiny_llama(torch.float16, train=False)
    model.config._attn_implementation = "eager"
    return model


def logits_with(model, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(LEFT_PADDED, attention_mask=mask).logits


def test_an_fp32_min_mask_cast_to_fp16_makes_the_logits_nan_and_the_rebuilt_mask_makes_them_finite():
    model = fp16_eager_llama()
    mask = torch.zeros(2, 1, 5, 5).masked_fill(~allowed(), torch.finfo(torch.float32).min).to(torch.float16)
    assert torch.isnan(logits_with(model, mask)[0]).all()  # the padded sequence is NaN to its last token
    assert torch.isfinite(logits_with(model, mask)[1]).all()

    namespace = {"model": model, "mask": mask, "images": torch.randn(2, 1, 8, 8)}  # a 4D tensor that is no mask
    report = mpdoctor.diagnose(namespace=namespace)
    assert [s.name for s in report.subjects if s.kind == "attention_mask"] == ["mask"]
    (finding,) = report.findings_for("attention-mask-overflow")
    assert finding.severity == "error" and "2 query rows made only of -inf" in finding.message
    assert "rounds to -inf in fp16" in finding.message
    (fix,) = finding.fixes
    assert fix.safe

    old = mask.clone()
    fix.apply()
    assert namespace["mask"] is mask and mask.dtype == torch.float16  # the same tensor, nothing rebound
    assert not torch.isneginf(mask).any() and mask.min() == torch.finfo(torch.float16).min
    logits = logits_with(model, mask)
    assert torch.isfinite(logits).all()
    # What attention allows is unchanged: the real tokens get the logits of the fp16 model's own mask.
    own = torch.zeros(2, 1, 5, 5, dtype=torch.float16).masked_fill(~allowed(), torch.finfo(torch.float16).min)
    assert torch.equal(logits[:, 2:], logits_with(model, own)[:, 2:])
    assert not report.refresh().findings_for("attention-mask-overflow")
    fix.undo()
    assert torch.equal(mask, old)


def test_under_sdpa_the_same_mask_is_only_info_because_this_cpu_keeps_the_rows_finite():
    model = tiny_llama(torch.float16, train=False)
    mask = torch.zeros(2, 1, 5, 5).masked_fill(~allowed(), torch.finfo(torch.float32).min).to(torch.float16)
    assert torch.isfinite(logits_with(model, mask)).all()
    (finding,) = mpdoctor.diagnose(namespace={"model": model, "mask": mask}).findings_for("attention-mask-overflow")
    assert finding.severity == "info"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_mask_built_with_the_compute_dtypes_own_min_draws_no_alarm(dtype):
    model = tiny_llama(dtype, train=False)
    model.config._attn_implementation = "eager"
    mask = torch.zeros(2, 1, 5, 5, dtype=dtype).masked_fill(~allowed(), torch.finfo(dtype).min)
    report = mpdoctor.diagnose(namespace={"model": model, "mask": mask})
    assert [s.name for s in report.subjects if s.kind == "attention_mask"] == ["mask"]
    assert not report.findings_for("attention-mask-overflow")
    assert alarms(report) == []
    assert torch.isfinite(logits_with(model, mask)).all()


def test_a_cache_beside_two_models_of_different_dtypes_is_not_judged():
    """A policy in bf16 and its fp32 reference: which one an fp32 cache serves is not known, so nothing is said."""
    policy, reference = tiny_llama(torch.bfloat16, train=False), tiny_llama(torch.float32, train=False, seed=1)
    cache = prefilled(reference)
    report = mpdoctor.diagnose(namespace={"policy": policy, "reference": reference, "cache": cache})
    assert not report.findings_for("kv-cache-dtype-mismatch")


# -- The legacy format: a plain tuple of per-layer (key, value) pairs, converted by DynamicCache at the call ----------


def legacy_of(cache) -> tuple:
    """The legacy format of a filled cache: one ``(key, value)`` tuple per layer."""
    return tuple((layer.keys, layer.values) for layer in cache.layers)


def generate_from_legacy(model, legacy) -> torch.Tensor:
    """The user's step: the legacy cache converted at the call, as code kept across transformers versions does."""
    from transformers import DynamicCache

    with torch.no_grad():
        return model.generate(torch.cat([PROMPT, NEXT], dim=1), past_key_values=DynamicCache(ddp_cache_data=legacy),
                              max_new_tokens=3, do_sample=False)  # fmt: skip


def test_a_legacy_tuple_cache_in_fp32_beside_a_bf16_model_is_named_and_cast_in_place_keeping_each_tensor():
    model = tiny_llama(torch.float32, train=False)
    legacy = legacy_of(prefilled(model))
    model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=SAME_DTYPE):
        generate_from_legacy(model, legacy)

    report = mpdoctor.diagnose(namespace={"model": model, "prompt_kv": legacy})
    (finding,) = report.findings_for("kv-cache-dtype-mismatch")
    assert finding.subject == "prompt_kv" and finding.severity == "error"
    assert "legacy tuple of 2 layers" in finding.message and "converted to a DynamicCache" in finding.message
    (fix,) = finding.fixes
    assert fix.safe and "for layer in prompt_kv" in fix.code
    tensors = [t for layer in legacy for t in layer]
    storage = [t.data_ptr() for t in tensors]
    fix.apply()
    assert [t for layer in legacy for t in layer] == tensors  # the same tensor objects, in the same tuple
    assert {t.dtype for t in tensors} == {torch.bfloat16}
    assert generate_from_legacy(model, legacy).shape[1] == PROMPT.shape[1] + 4
    assert not report.refresh().findings_for("kv-cache-dtype-mismatch")
    fix.undo()
    assert [t.data_ptr() for t in tensors] == storage and {t.dtype for t in tensors} == {torch.float32}


def test_a_legacy_list_of_encoder_decoder_layers_is_read_and_other_containers_are_not():
    k = torch.zeros(1, 2, 4, 8)
    cross = torch.zeros(1, 2, 6, 8)
    ns = {
        "legacy_seq2seq": [(k, k.clone(), cross, cross.clone()), (k.clone(), k.clone(), cross.clone(), cross.clone())],
        "pair_of_3d": ((torch.zeros(2, 4, 8), torch.zeros(2, 4, 8)),),
        "unequal": ((torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 5, 8)),),
        "ints": ((1, 2), (3, 4)),
        "batch": (torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8)),
    }
    report = mpdoctor.diagnose(namespace=ns)
    assert [s.name for s in report.subjects if s.kind == "kv_cache"] == ["legacy_seq2seq"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_legacy_cache_in_the_models_dtype_draws_no_alarm(dtype):
    model = tiny_llama(dtype, train=False)
    legacy = legacy_of(prefilled(model))
    report = mpdoctor.diagnose(namespace={"model": model, "prompt_kv": legacy})
    assert [s.name for s in report.subjects if s.kind == "kv_cache"] == ["prompt_kv"]
    assert alarms(report) == []
    assert generate_from_legacy(model, legacy).shape[1] == PROMPT.shape[1] + 4
