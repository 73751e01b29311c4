"""Field case 4: Gemma 3 builds a KV cache in every training forward (LLaMA-Factory #7373, transformers #36814).

``Gemma3ForConditionalGeneration`` has only the nested ``config.text_config.use_cache``;
``model.config.use_cache = False`` (what users, and transformers 5's Trainer, set) is
not enough. Under accelerate's fp32 output conversion with transformers < 4.51 the
cache crashed (``'HybridCache' object has no attribute 'float'``); transformers here
is 5.x, so the finding is the measured waste, and the crash branch is tested on
facts carrying an older version string.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from setups import batch, tiny_gemma3, tiny_trainer, train_step
from setups_dtypes import finite

import mpdoctor
from mpdoctor.objects.gathering import gather
from mpdoctor.rules.checks.cache import _transformers_before, cache_in_training


def cache_bytes(cache) -> int:
    """Bytes held by a transformers cache's key and value tensors."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def expected_cache_bytes(model, inputs) -> int:
    text = model.config.text_config
    batch_size, length = inputs["input_ids"].shape
    per_layer = 2 * batch_size * text.num_key_value_heads * length * text.head_dim * 4  # keys + values, fp32
    return text.num_hidden_layers * per_layer


def test_a_gemma3_in_train_mode_returns_a_cache_from_every_forward_that_nobody_reads():
    from transformers import DynamicCache

    model, inputs = tiny_gemma3(), batch()
    assert model.training and "use_cache" not in model.config.__dict__  # only the nested flag exists
    for _ in range(2):
        out = model(**inputs)
        assert isinstance(out.past_key_values, DynamicCache)
        assert cache_bytes(out.past_key_values) == expected_cache_bytes(model, inputs) > 0

    (finding,) = mpdoctor.diagnose(model).findings_for("cache-in-training")
    assert finding.severity == "info"  # true and measured, but harmless in this setup: no crash combination
    assert finding.subject == "model.config.text_config.use_cache"


def test_setting_only_the_top_level_flag_leaves_the_cache_and_the_finding():
    model = tiny_gemma3()
    model.config.use_cache = False
    assert model(**batch()).past_key_values is not None
    (finding,) = mpdoctor.diagnose(model).findings_for("cache-in-training")
    assert finding.evidence["use_cache_true"] == ["model.config.text_config"]
    assert "not enough" in finding.message


def test_transformers_5_trainer_sets_only_the_top_level_flag_so_the_finding_stays():
    trainer = tiny_trainer(tiny_gemma3())
    assert trainer.model.config.use_cache is False  # Trainer: model.config.use_cache = args.use_cache
    assert trainer.model.config.text_config.use_cache is True
    (finding,) = mpdoctor.diagnose(trainer).findings_for("cache-in-training")
    assert finding.subject == "trainer.model.config.text_config.use_cache"


def test_the_fix_sets_the_nested_flags_in_place_then_no_cache_is_built_and_a_step_works():
    model = tiny_gemma3()
    text_config, generation_config = model.config.text_config, model.generation_config
    report = mpdoctor.diagnose(model)
    (fix,) = report.findings_for("cache-in-training")[0].fixes
    assert fix.safe
    assert "model.config.text_config.use_cache = False" in fix.code
    before = {"text": text_config.use_cache, "generation": generation_config.use_cache, "top": "use_cache" in model.config.__dict__}

    fix.apply()
    assert model.config.text_config is text_config and text_config.use_cache is False  # same config object
    assert not report.refresh().findings_for("cache-in-training")
    fix.apply()  # idempotent
    assert model(**batch()).past_key_values is None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert finite(train_step(model, opt))

    fix.undo()
    after = {"text": text_config.use_cache, "generation": generation_config.use_cache, "top": "use_cache" in model.config.__dict__}
    assert after == before


@pytest.fixture
def accelerated_gemma3():
    from accelerate import Accelerator

    model = tiny_gemma3()
    return Accelerator(mixed_precision="bf16", cpu=True).prepare(model)


def test_accelerates_fp32_output_wrapper_is_a_fact_and_on_transformers_5_the_cache_survives_it(accelerated_gemma3):
    model = accelerated_gemma3
    assert "_original_forward" in model.__dict__
    out = model(**batch())  # accelerate's convert_to_fp32 meets the cache; since 4.51 it no longer takes it for a tensor
    assert out.past_key_values is not None and out.logits.dtype == torch.float32
    report = mpdoctor.diagnose(model)
    assert report.facts.models[0].forward_wrapped
    (finding,) = report.findings_for("cache-in-training")
    assert finding.severity == "info" and finding.evidence["forward_wrapped_fp32"] is True


def test_before_transformers_4_51_the_wrapped_forward_makes_it_an_error(accelerated_gemma3):
    facts = gather(mpdoctor.diagnose(accelerated_gemma3).subjects)
    old = dataclasses.replace(facts.runtime, versions={**facts.runtime.versions, "transformers": "4.50.3"})
    (finding,) = cache_in_training(dataclasses.replace(facts, runtime=old))
    assert finding.severity == "error" and "has no attribute 'float'" in finding.message


@pytest.mark.parametrize(
    ("version", "before"), [("4.50.3", True), ("4.51.0", False), ("5.23.0", False), ("4.9.2", True), ("dev", False)]
)
def test_the_version_gate_of_the_float_crash(version, before):
    assert _transformers_before(version, 4, 51) is before
