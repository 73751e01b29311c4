"""Every API resolved by :mod:`mpdoctor.compat`, checked against the installed libraries.

Each corner of the support matrix (``tests/corners.py``) runs this file on its own releases, so each answer
is proven on the oldest, the pinned and the newest torch, transformers and accelerate.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import mpdoctor
from mpdoctor import compat
from mpdoctor.attach.runtime import protocol as protocol_module


def _class_at(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_every_grad_scaler_class_path_names_a_class_of_this_torch_whose_methods_the_watcher_wraps():
    wrapped = compat.grad_scaler_class()
    for path in compat.GRAD_SCALER_CLASSES:
        cls = _class_at(path)
        assert issubclass(cls, wrapped), path
        assert cls.__module__.startswith(compat.GRAD_SCALER_MODULES), cls.__module__
        # The watcher wraps the base class's methods: no subclass may override them, or its calls go unseen.
        for method in ("scale", "unscale_", "step", "update"):
            assert getattr(cls, method) is getattr(wrapped, method), (path, method)


def test_the_cpu_grad_scaler_is_enabled_and_scales_a_loss():
    scaler = compat.grad_scaler("cpu", init_scale=256.0)
    assert scaler.is_enabled() and float(scaler.scale(torch.tensor(2.0))) == 512.0


def _scaled_loop_that_clips_before_unscale(steps: int = 2) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = compat.grad_scaler("cpu", init_scale=1024.0)
    with mpdoctor.watch(model, opt, scaler) as w:
        for _ in range(steps):
            opt.zero_grad()
            scaler.scale(model(torch.randn(8, 4)).pow(2).mean()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # still scaled: the mistake
            scaler.step(opt)
            scaler.update()
    return w


def test_the_watcher_attaches_to_this_torch_sees_its_clip_and_leaves_nothing_behind():
    helper = compat.clip_helper()
    clip_points = [helper] if helper else list(compat.clip_entry_points())
    scaler_cls = compat.grad_scaler_class()
    before = {m: vars(scaler_cls)[m] for m in ("scale", "unscale_", "step", "update")}
    before.update({(id(o), n): vars(o)[n] for o, n in clip_points})

    w = _scaled_loop_that_clips_before_unscale()

    assert "amp-clip-before-unscale" in [f.check for f in w.report.findings]
    after = {m: vars(scaler_cls)[m] for m in ("scale", "unscale_", "step", "update")}
    after.update({(id(o), n): vars(o)[n] for o, n in clip_points})
    assert after == before and not protocol_module.installed()


def test_the_clip_is_wrapped_where_this_torch_applies_it():
    from torch.nn.utils import clip_grad

    helper = compat.clip_helper()
    if helper is None:  # torch 2.4, 2.5: clip_grad_norm_ clips in its own body, looked up at these two places
        assert all(vars(o)[n] is vars(clip_grad)["clip_grad_norm_"] for o, n in compat.clip_entry_points())
    else:  # torch >= 2.6: every clip_grad_norm_ goes through the helper
        assert helper == (clip_grad, "_clip_grads_with_norm_") and callable(vars(clip_grad)[helper[1]])


def test_the_rope_init_function_reproduces_a_rotary_embeddings_frequencies():
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama

    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                         intermediate_size=64, vocab_size=64)
    fn = compat.rope_init_function("default")
    rope = modeling_llama.LlamaRotaryEmbedding(config=config)
    assert fn is not None or hasattr(type(rope), "compute_default_rope_parameters")
    compute = type(rope).compute_default_rope_parameters if fn is None else fn
    assert torch.equal(compute(config)[0].float(), rope.inv_freq.float())
    assert compat.rope_init_function("linear") is not None
    assert compat.rope_init_function("no-such-rope-type") is None


@pytest.mark.parametrize("layers,tokens", [(1, 3), (2, 5)])
def test_cache_layers_reads_the_keys_and_values_of_each_layer(layers, tokens):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=layers,
                         intermediate_size=64, vocab_size=64)
    out = LlamaForCausalLM(config).eval()(torch.randint(0, 64, (2, tokens)), use_cache=True)
    pairs = compat.cache_layers(out.past_key_values)
    assert len(pairs) == layers
    for keys, values in pairs:
        assert tuple(keys.shape) == tuple(values.shape) == (2, 2, tokens, 32 // 4)


def test_an_accelerator_has_one_of_the_fp8_recipe_attributes():
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    assert [a for a in compat.ACCELERATE_FP8_RECIPE_ATTRS if hasattr(acc, a)], vars(acc).keys()


def test_quiet_imports_drops_the_noise_loggers_warnings_for_the_block_only(caplog):
    import logging

    noisy = logging.getLogger(compat.IMPORT_NOISE_LOGGERS[0])
    level = noisy.level
    with caplog.at_level(logging.WARNING):
        with compat.quiet_imports():
            noisy.warning("Failed to load a kernel this machine cannot load")
        assert not caplog.records
        noisy.warning("after the block, the library speaks again")
    assert [r.getMessage() for r in caplog.records] == ["after the block, the library speaks again"]
    assert noisy.level == level


def test_the_demo_output_starts_with_mpdoctors_own_text():
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # stdout and stderr in the order they were written
    run = subprocess.run([sys.executable, "-m", "mpdoctor", "demo"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:]
    assert run.stdout.startswith("The broken setup: a tiny Llama"), run.stdout[:1000]


def test_the_config_dtype_attribute_is_the_one_save_pretrained_writes(tmp_path):
    import json

    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64,
                         vocab_size=64)
    setattr(config, compat.config_dtype_attribute(), torch.bfloat16)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved[compat.config_dtype_attribute()] == "bfloat16"
