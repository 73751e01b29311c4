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
#     - probe-nonfinite
#     - probe-overflow
#     - module:mpdoctor.attach.numerics.probe
# ---

# %% [markdown]
# # The one-batch probe: which layer overflows fp16?
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/mpdoctor/mpdoctor/blob/main/notebooks/06_numerics_probe.ipynb) [![Binder](https://mybinder.org/badge_logo.svg)](https://mybinder.org/v2/gh/mpdoctor/mpdoctor/main?labpath=notebooks%2F06_numerics_probe.ipynb)
#
# A NaN loss says nothing about where it started. The static checks look at dtypes and flags; this lesson uses mpdoctor's one-batch probe to find the first module whose activations pass fp16's 65504, and fixes the run by moving to bf16.

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
# **What matters here: fp16's ceiling.** Anything past 65504 becomes inf in fp16, and one inf in a forward turns the loss into NaN. bf16 shares fp32's ceiling (about 3.4e38). Models trained in bf16 sometimes carry activations past 65504 in a few layers (T5's feed-forward output reached 66246 in transformers #5651): fine in bf16, fatal in fp16.

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
print("fp16: 65504 ->", torch.tensor(65504.0).half().item(), "| 70000 ->", torch.tensor(70000.0).half().item(),
      "| bf16: 70000 ->", torch.tensor(70000.0).bfloat16().item())

# %% [markdown]
# ## The broken setup
#
# A tiny Llama with four layers, fp32 weights, trained with the classic fp16 AMP recipe (autocast and a
# `GradScaler`). To have a layer with large activations without downloading a checkpoint, we plant one: the
# MLP of layer 2 gets larger weights. Every weight stays well inside fp16's range; only the values
# computed in flight go past it.

# %%
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    use_cache=False,
)
ids = torch.randint(0, config.vocab_size, (4, 32))
batch = {"input_ids": ids, "labels": ids}
model = LlamaForCausalLM(config).train()
mlp = model.model.layers[2].mlp
with torch.no_grad():  # plant large activations in one layer
    mlp.gate_proj.weight.mul_(100)
    mlp.up_proj.weight.mul_(100)
    mlp.down_proj.weight.mul_(2000)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
print("largest weight:", max(p.detach().abs().max().item() for p in model.parameters()))


def train_step(dtype, scaler=None):
    """One step under autocast to ``dtype``, with loss scaling when a scaler is given."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype):
        loss = model(**batch).loss
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # skipped when the gradients hold inf/NaN
        scaler.update()  # ... and then the scale is halved
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


# %% [markdown]
# ## The measured harm: NaN losses, skipped steps, a shrinking scale

# %%
before = [p.detach().clone() for p in model.parameters()]
fp16_losses, scales = [], []
for _ in range(3):
    fp16_losses.append(train_step(torch.float16, scaler))
    scales.append(scaler.get_scale())
unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
print("losses:", fp16_losses, "| scale:", scales, "| weights unchanged:", unchanged)

# %% [markdown]
# The scaler sees inf/NaN gradients, skips every step and halves its scale: the model has stopped learning,
# and the loss says NaN without saying where it came from.
#
# ## The static checks see nothing wrong
#
# The dtypes are right (fp32 master weights, fp16 autocast, a scaler), and a value scan of every weight
# (`--scan`) finds nothing past 65504, because the overflow happens in flight:

# %%
# static = %mpdoctor model optimizer scaler --scan --text

# %% [markdown]
# ## The probe: one forward and one backward with hooks on every module
#
# `%mpdoctor model --probe batch` runs one forward and one backward on the batch, with cheap hooks on every
# module, and names the first module whose output goes non-finite or past fp16's range. It leaves nothing
# behind: hooks removed, gradients, RNG state and train/eval modes restored, optimizer and scaler untouched.
# No autocast is active in this cell, so it computes in fp32 and reports what *would* overflow in fp16:

# %%
# probe_fp32 = %mpdoctor model --probe batch

# %% [markdown]
# The same from Python, under the fp16 autocast the run really uses:

# %%
probe_fp16 = mpdoctor.probe(model, batch, autocast=torch.float16)
for f in probe_fp16.findings:
    print(f"{f.severity:8} {f.check}: {f.message}")

# %% [markdown]
# The per-module table, most endangered first (`fp16_headroom` below 1: past fp16's range; 0: non-finite). To keep the probe cheap, a module's inputs are measured only where its output went bad, so the table has no input column: the finding above says whether the first bad module's inputs were finite.

# %%
table = probe_fp32.probe_table
columns = ["module", "class", "output_dtypes", "out_absmax", "grad_absmax", "fp16_headroom"]
table.sort_values("fp16_headroom")[columns].head(6)

# %% [markdown]
# ## Fix
#
# There is no automatic fix: the choices trade memory and speed. Use bf16 where the hardware has it (its
# range is fp32's, and it needs no loss scaling: notebook 03), keep the overflowing module in fp32
# (`_keep_in_fp32_modules` in transformers), or train in fp32 on a GPU without bf16 (V100, T4). Here, bf16:

# %%
probe_bf16 = mpdoctor.probe(model, batch, autocast=torch.bfloat16)
bf16_losses = [train_step(torch.bfloat16) for _ in range(3)]
changed = not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
print("probe under bf16:", [f.check for f in probe_bf16.findings])
print("losses:", [round(x, 4) for x in bf16_losses], "| weights changed:", changed)

# %% [markdown]
# ## The lesson's claims, checked

# %%
assert all(math.isnan(x) for x in fp16_losses) and scales == [32768.0, 16384.0, 8192.0] and unchanged
assert static.ok, static.to_text()  # dtypes and weights look fine: only values in flight overflow

culprit = "model.model.layers.2.mlp.down_proj"
assert [f.subject for f in probe_fp32.findings_for("probe-overflow")] == [culprit]
nonfinite = probe_fp16.findings_for("probe-nonfinite")
assert [f.subject for f in nonfinite] == [culprit] and "inputs were finite" in nonfinite[0].message
assert float(table.set_index("module").loc[culprit, "fp16_headroom"]) < 1

assert not probe_bf16.findings_for("probe-nonfinite")
assert all(math.isfinite(x) for x in bf16_losses) and changed
assert all(p.grad is None for p in model.parameters())  # the probes left no gradients behind
print("all claims hold")
