# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: mpdoctor
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
#   mpdoctor:
#     requires:
#     - cache-in-training
# ---

# %% [markdown]
# # The KV cache in training: Gemma 3's nested `use_cache`
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/mpdoctor/mpdoctor/blob/main/notebooks/04_cache_in_training.ipynb) [![Binder](https://mybinder.org/badge_logo.svg)](https://mybinder.org/v2/gh/mpdoctor/mpdoctor/main?labpath=notebooks%2F04_cache_in_training.ipynb)
#
# Field case 4 (LLaMA-Factory #7373, transformers #36814): Gemma 3 LoRA training crashed with `'HybridCache' object has no attribute 'float'`. The root cause outlived the crash: a model in training mode that builds a KV cache on every forward, behind a flag that setting `model.config.use_cache = False` does not reach.

# %% [markdown]
# **Setup.** The next cell installs mpdoctor only if it is missing: on Colab, the `%pip install` line fetches it from GitHub (it is not on PyPI yet); on Binder and in CI it is already installed and the line is skipped. Then `%load_ext mpdoctor` registers the `%mpdoctor` magic. Everything runs on the CPU in well under a minute, with tiny models built from configs (nothing is downloaded): on Colab the default CPU runtime is the one this lesson is written for.

# %%
# Installs only what is missing: on Colab this fetches mpdoctor from GitHub;
# on Binder, in CI or after `pip install -e .` everything is importable and nothing runs.
try:
    import mpdoctor
except ImportError:
    # %pip install -q "mpdoctor[hf] @ git+https://github.com/mpdoctor/mpdoctor"
    import mpdoctor

# %load_ext mpdoctor
print("mpdoctor", mpdoctor.__version__)

# %% [markdown]
# ## The number formats
#
# Every float is a sign, an exponent (its **range**: how large and how small a number can get) and a mantissa (its **precision**: how many significant digits survive). The table is computed by `torch.finfo` on this machine:
#
# - **fp32**: 8 exponent bits, 23 mantissa bits. The reference.
# - **fp16**: 5 exponent bits, 10 mantissa bits: fine precision, but a tiny range (max 65504; gradients below about 6e-8 become 0).
# - **bf16**: fp32's 8 exponent bits (same range, max about 3.4e38), only 7 mantissa bits: coarse precision (about 2-3 decimal digits).
#
# **What matters here: bytes.** fp32 takes 4 bytes per number, bf16 and fp16 take 2. A KV cache holds, per layer, keys and values of batch x KV heads x tokens x head_dim numbers each, at 2 or 4 bytes each depending on the dtype they come out in (keys and values need not share one). And accelerate's mixed-precision wrapper converts a model's outputs back to fp32 (4 bytes) by calling `.float()` on anything that has a `.dtype`.

# %%
import math

import pandas as pd
import torch


def number_formats():
    """Range and precision of the three training dtypes, straight from torch.finfo."""
    rows = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        fi = torch.finfo(dtype)
        mantissa = round(-math.log2(fi.eps))  # eps = 2**-mantissa_bits
        rows[str(dtype).replace("torch.", "")] = {
            "bits": fi.bits,
            "exponent bits": fi.bits - 1 - mantissa,
            "mantissa bits": mantissa,
            "max": f"{fi.max:.4g}",
            "smallest normal": f"{fi.tiny:.3g}",
            "smallest subnormal": f"{fi.smallest_normal * fi.eps:.3g}",
            "eps (step after 1.0)": f"{fi.eps:.3g}",
            "decimal digits": round(-math.log10(fi.resolution)),
        }
    return pd.DataFrame(rows).T


number_formats()

# %% [markdown]
# ## The broken setup (LLaMA-Factory #7373, transformers #36814)
#
# `Gemma3ForConditionalGeneration` (tiny, from a config) prepared by accelerate for bf16 mixed precision.
# Its only cache flag is nested: `config.text_config.use_cache`, `True` by default. The usual advice,
# `model.config.use_cache = False`, sets a flag nothing reads.

# %%
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

torch.manual_seed(0)
config = Gemma3Config(
    text_config=dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    ),
    vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    ),
    mm_tokens_per_image=4,
)
model = Gemma3ForConditionalGeneration(config).train()


def make_batch(length, size=4):
    ids = torch.randint(0, 128, (size, length))
    return {"input_ids": ids, "labels": ids}


# (keys, values) per layer, in whichever layout the running transformers keeps its cache
from mpdoctor.compat import cache_layers


def cache_bytes(cache):
    """Bytes held by the keys and values of a returned cache (0 for no cache)."""
    if cache is None:
        return 0
    return sum(t.numel() * t.element_size() for pair in cache_layers(cache) for t in pair)


print("model.config has use_cache:", hasattr(model.config, "use_cache"),
      "| model.config.text_config.use_cache:", model.config.text_config.use_cache)

from accelerate import Accelerator

accelerator = Accelerator(mixed_precision="bf16", cpu=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
print("forward wrapped by accelerate (autocast + fp32 outputs):", hasattr(model, "_original_forward"))

# %% [markdown]
# ## The measured harm: a cache nobody reads, returned by every training forward

# %%
sizes = {}
for length in (16, 64):
    out = model(**make_batch(length))
    sizes[length] = cache_bytes(out.past_key_values)
    keys, values = cache_layers(out.past_key_values)[0]
    print(f"{length:3} tokens: {type(out.past_key_values).__name__} of {sizes[length]:,} bytes"
          f" | keys {keys.dtype}, values {values.dtype} | logits dtype {out.logits.dtype}")

# The formula reads the dtypes this transformers release caches in: one layer's keys and values.
t = config.text_config
key_bytes, value_bytes = keys.element_size(), values.element_size()
formula = t.num_hidden_layers * 4 * t.num_key_value_heads * 64 * t.head_dim * (key_bytes + value_bytes)
print(f"{t.num_hidden_layers} layers x batch 4 x {t.num_key_value_heads} KV heads x 64 tokens x head_dim {t.head_dim}"
      f" x ({key_bytes} bytes per key + {value_bytes} per value) = {formula:,} bytes")

# %% [markdown]
# The cache grows linearly with the tokens in the batch and matches the formula exactly. Note the dtypes: under
# bf16 autocast the keys come out in fp32 (4 bytes, after the fp32 rotary embedding); the values are fp32 too up
# to transformers 5.23 and bf16 (2 bytes) from 5.24, which stores 3/4 of the bytes. With Gemma 3 1B's published
# dimensions (26 layers, 1 KV head, head_dim 256), a batch of 8 sequences of 512 tokens returns
# `2 * 26 * 8 * 1 * 512 * 256` numbers = 54.5 million per forward (104 MiB in bf16, 208 MiB in fp32), kept
# alive until the output is dropped.
#
# The usual advice does not help:

# %%
model.config.use_cache = False  # what many users tried first
out = model(**make_batch(16))
print("still returned:", type(out.past_key_values).__name__)

# %% [markdown]
# ### Why it crashed before transformers 4.51
#
# The Gemma 3 cache class of the time (`HybridCache`) carried a `.dtype` attribute. accelerate's output
# conversion treats anything with a `.dtype` as a tensor and calls `.float()` on it. Here is the real
# conversion function applied to an object that, like `HybridCache` then, has a `.dtype` (today's
# `DynamicCache` has none, which is why the forward above survives):

# %% mpdoctor={"expect": "object has no attribute 'float'"} tags=["raises-exception"]
from accelerate.utils.operations import convert_to_fp32


class CacheWithDtype:  # stands in for transformers 4.50's HybridCache
    dtype = torch.bfloat16


convert_to_fp32({"logits": torch.ones(1, dtype=torch.bfloat16), "past_key_values": CacheWithDtype()})

# %% [markdown]
# ## Diagnose

# %%
# report = %mpdoctor model

# %%
finding = report.findings_for("cache-in-training")[0]
print(finding.severity, "|", finding.subject)
print(finding.message)
print(finding.evidence)

# %% [markdown]
# ## Fix
#
# The fix sets `use_cache=False` on the config, every sub-config that has the flag, and the generation
# config, in place. It is safe for this model type: the cache is only used for generation. (For recurrent or
# hybrid model types, where the uncached path computes differently, mpdoctor offers no automatic fix.) It is
# the call the widget's button makes:

# %%
fix = finding.fixes[0]
print(f"fix ({'safe' if fix.safe else 'unsafe'}): {fix.title}\n{fix.code}")
fix.apply()
print("text_config.use_cache:", model.config.text_config.use_cache)

# %%
losses = []
for _ in range(3):
    optimizer.zero_grad()
    out = model(**make_batch(64))
    accelerator.backward(out.loss)
    optimizer.step()
    losses.append(out.loss.item())
print("losses:", [round(x, 4) for x in losses], "| cache returned:", cache_bytes(out.past_key_values), "bytes")

# %% [markdown]
# When you generate later, turn it back on for generation only (`model.generate(..., use_cache=True)`), or
# `fix.undo()` restores every flag exactly.
#
# ## The lesson's claims, checked

# %%
assert sizes[64] == 4 * sizes[16] == formula and sizes[16] > 0  # linear in tokens, as the formula says
assert key_bytes == 4 and value_bytes in (2, 4)  # fp32 keys under bf16 autocast; values as the release keeps them
assert finding.subject == "model.config.text_config.use_cache"  # the nested flag is the one that counts
assert fix.safe and model.config.text_config.use_cache is False
assert not report.refresh().findings_for("cache-in-training")
assert out.past_key_values is None and all(math.isfinite(x) for x in losses)
print("all claims hold")
