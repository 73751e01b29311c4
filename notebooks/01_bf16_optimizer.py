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
#     - optimizer-dtype-requirement
# ---

# %% [markdown]
# # A bf16-only optimizer fed fp32: `AssertionError: only bfloat 16 is supported.`
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/mpdoctor/mpdoctor/blob/main/notebooks/01_bf16_optimizer.ipynb) [![Binder](https://mybinder.org/badge_logo.svg)](https://mybinder.org/v2/gh/mpdoctor/mpdoctor/main?labpath=notebooks%2F01_bf16_optimizer.ipynb)
#
# Field case 1 (SimpleTuner #755): LoRA training with `AdamWBF16`, adapters left in fp32, and the optimizer's first step dies with an assertion. Why bf16 optimizers insist on bf16, how mpdoctor sees it coming, and the in-place fix.

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
try:
    import adamw_bf16
except ImportError:
    # %pip install -q adamw-bf16
    import adamw_bf16

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
# **What matters here: bf16's precision.** With 7 mantissa bits, the step after 1.0 is 2^-7 = 0.0078; an update of 0.001 to a weight of 1.0 rounds away entirely. Optimizers that keep bf16 weights compensate: `AdamWBF16` (PyPI `adamw-bf16`, vendored by SimpleTuner) keeps a bf16 correction term per weight and adds back what rounding lost (Kahan summation). That bookkeeping is built for bf16 weights, and it asserts so.

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

# %%
w = torch.tensor(1.0, dtype=torch.bfloat16)
print("bf16: 1.0 + 0.001 =", (w + 1e-3).item(), "| fp32: 1.0 + 0.001 =", (w.float() + 1e-3).item())

import inspect

import adamw_bf16

print([line.strip() for line in inspect.getsource(adamw_bf16.AdamWBF16).splitlines() if "assert" in line])

# %% [markdown]
# ## The broken setup (SimpleTuner #755)
#
# LoRA on a bf16 model. PEFT keeps adapter weights in **fp32** by default (`autocast_adapter_dtype=True`),
# which is right for most optimizers; here the trainable parameters go to `AdamWBF16`.

# %%
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    use_cache=False,
)
ids = torch.randint(0, config.vocab_size, (4, 32))
batch = {"input_ids": ids, "labels": ids}

from adamw_bf16 import AdamWBF16
from peft import LoraConfig, get_peft_model

lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
model = get_peft_model(LlamaForCausalLM(config).to(torch.bfloat16), lora)  # a bf16 base, as most checkpoints
trainable = [p for p in model.parameters() if p.requires_grad]
optimizer = AdamWBF16(trainable, lr=1e-2)
print("frozen base:", {str(p.dtype) for p in model.parameters() if not p.requires_grad},
      "| trainable adapters:", {str(p.dtype) for p in trainable})

# %% [markdown]
# The forward and backward run fine; the optimizer's first `step()` does not:

# %% mpdoctor={"expect": "only bfloat 16 is supported."} tags=["raises-exception"]
optimizer.zero_grad()
loss = model(**batch).loss
loss.backward()
optimizer.step()

# %% [markdown]
# ## Diagnose
#
# mpdoctor knows which optimizers have dtype requirements and compares them with the parameters (and
# gradients) each optimizer holds: it finds this before the first step, not after an hour of data loading.

# %%
# report = %mpdoctor model optimizer

# %%
finding = report.findings_for("optimizer-dtype-requirement")[0]
print(finding.severity, "|", finding.subject)
print(finding.message)
print(finding.evidence)
fix = finding.fixes[0]
print(f"\nfix ({'safe' if fix.safe else 'unsafe'}): {fix.title}\n{fix.code}")

# %% [markdown]
# ## Fix
#
# The fix casts the adapters (and their gradients and optimizer state) to bf16 **in place**, keeping the
# same `Parameter` objects, so the optimizer's references stay valid. It is **unsafe**: it narrows a dtype,
# so it is applied only when you ask (`fix.apply()`, the same call the widget's button makes). At creation
# time, `get_peft_model(..., autocast_adapter_dtype=False)` keeps the adapters in the base model's dtype.

# %%
held_before = [id(p) for p in optimizer.param_groups[0]["params"]]
fix.apply()
print("trainable adapters:", {str(p.dtype) for p in trainable})

# %% [markdown]
# A few training steps now work; the adapters' `lora_B` starts at zero, so any change shows the optimizer updating bf16 weights:

# %%
lora_B = next(p for n, p in model.named_parameters() if "lora_B" in n)
before = lora_B.detach().clone()
losses = []
for _ in range(3):
    optimizer.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print("losses:", [round(x, 4) for x in losses], "| lora_B changed:", not torch.equal(before, lora_B.detach()))

# %% [markdown]
# The creation-time alternative, for comparison: bf16 adapters from the start, and mpdoctor has nothing
# to say about them with `AdamWBF16` (a healthy recipe must not raise false alarms).

# %%
clean_model = get_peft_model(LlamaForCausalLM(config).to(torch.bfloat16), lora, autocast_adapter_dtype=False)
clean_optimizer = AdamWBF16([p for p in clean_model.parameters() if p.requires_grad], lr=1e-2)
# clean = %mpdoctor clean_model clean_optimizer

# %% [markdown]
# ## The lesson's claims, checked

# %%
assert finding.severity == "error" and finding.subject == "optimizer" and not fix.safe
assert not report.refresh().findings_for("optimizer-dtype-requirement")
assert all(p.dtype == torch.bfloat16 for p in trainable)
assert [id(p) for p in optimizer.param_groups[0]["params"]] == held_before  # the same Parameter objects
assert all(math.isfinite(x) for x in losses) and not torch.equal(before, lora_B.detach())
assert not clean.findings_for("optimizer-dtype-requirement") and clean.ok, clean.to_text()
print("all claims hold")
