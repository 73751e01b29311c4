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
#     - scaler-with-bf16
# ---

# %% [markdown]
# # A GradScaler with bf16
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/mpdoctor/mpdoctor/blob/main/notebooks/03_scaler_with_bf16.ipynb) [![Binder](https://mybinder.org/badge_logo.svg)](https://mybinder.org/v2/gh/mpdoctor/mpdoctor/main?labpath=notebooks%2F03_scaler_with_bf16.ipynb)
#
# Field case 3 (H2O LLM Studio #628 / PR #673): a `GradScaler` created for a bf16 model. On some CUDA builds the first `scaler.step` crashes; everywhere else it is work for nothing. Why bf16 needs no loss scaling, the measured cost on this CPU, a what-if for a GPU, and the in-place fix.

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
    import adamw_bf16  # noqa: F401  (only checks that it is installed)

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
# **What matters here: range at the small end.** fp16's smallest subnormal is about 6e-8: smaller gradients flush to zero. A `GradScaler` multiplies the loss (hence every gradient) by a large factor (65536 to start) so they survive in fp16, then divides it out before the optimizer step. bf16 has fp32's exponent: its smallest normal number is about 1.2e-38, so there is nothing to rescue.

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
g = torch.tensor([1e-8, 1e-6, 1e-4])
print("fp16           ", g.half().tolist())
print("fp16, scaled   ", ((g * 65536).half().float() / 65536).tolist())
print("bf16, unscaled ", g.bfloat16().float().tolist())

# %% [markdown]
# ## The broken setup (H2O LLM Studio #628)
#
# A bf16 model, and a training loop that creates `GradScaler()` whenever "mixed precision" is on, whatever
# the dtype. The optimizer is `AdamWBF16`, the right one for bf16 weights (notebook 01).

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

model = LlamaForCausalLM(config).to(torch.bfloat16).train()
optimizer = AdamWBF16(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")  # created unconditionally
import collections

from torch.utils._python_dispatch import TorchDispatchMode


class CountOps(TorchDispatchMode):
    """Count the ATen operators a block of code runs (forward, backward and optimizer)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def step(use_scaler=True):
    """One training step, written the AMP way (scale, backward, step, update) or plainly."""
    optimizer.zero_grad()
    loss = model(**batch).loss
    if use_scaler:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    return loss.detach()


def ops_of(use_scaler):
    with CountOps() as counter:
        step(use_scaler)
    return counter.ops


# %% [markdown]
# ## The harm
#
# On CUDA builds whose unscale kernel has no bf16 implementation (pytorch #127176), the first `scaler.step`
# crashes: `"_amp_foreach_non_finite_check_and_unscale_cuda" not implemented for 'BFloat16'`. This CPU's
# kernel does accept bf16 (mpdoctor probes the real kernel on the live device rather than assuming), so here
# the harm is wasted work. Count the operators one step runs with the scaler and without it:

# %%
step(use_scaler=False)  # warm up: the optimizer's first step creates its state
with_scaler, without = ops_of(True), ops_of(False)
extra = {op: n - without.get(op, 0) for op, n in with_scaler.items() if n > without.get(op, 0)}
extra

# %% [markdown]
# `_amp_foreach_non_finite_check_and_unscale_` reads every gradient again, `_local_scalar_dense` is a
# `.item()` (on a GPU, a device-to-host synchronisation every step), and the `mul`s scale the loss (and, in
# backward, the gradient flowing from it), all to protect bf16 gradients from an underflow they cannot have.
#
# ## Diagnose

# %%
# report = %mpdoctor model optimizer scaler

# %%
print("unscale kernel on this device accepts:", report.facts.hardware.unscale_dtypes)
finding = report.findings_for("scaler-with-bf16")[0]
print(finding.severity, "|", finding.message)

# %% [markdown]
# A warning here, because this CPU's kernel runs. What about a GPU? mpdoctor cannot run the kernel of a GPU
# it does not have, so a `--target` what-if takes the documented worst case, a crash, and says so as an error:

# %%
# on_a100 = %mpdoctor model optimizer scaler --target A100

# %% [markdown]
# ## Fix
#
# The fix disables the scaler in place (`scaler._enabled = False`: the same object an `Accelerator` and its
# optimizer would share). The training loop does not change: a disabled scaler's `scale()` returns the loss
# as it is and its `step()` calls `optimizer.step()`. It is safe: bf16 training means the same thing without
# loss scaling. `fix.apply()` is the call the widget's button makes.

# %%
fix = finding.fixes[0]
print(f"fix ({'safe' if fix.safe else 'unsafe'}): {fix.title}\n{fix.code}")
fix.apply()
print("scaler enabled:", scaler.is_enabled())

# %%
losses = [step().item() for _ in range(3)]
after_fix = ops_of(True)
print("losses:", [round(x, 4) for x in losses])
print("unscale passes per step now:", after_fix.get("_amp_foreach_non_finite_check_and_unscale_", 0))

# %% [markdown]
# Next time, build it right: `torch.amp.GradScaler("cuda", enabled=(dtype == torch.float16))`, or let
# accelerate decide. Since 2023 accelerate and transformers create no scaler for bf16:

# %%
from accelerate import Accelerator

accelerate_scaler = Accelerator(mixed_precision="bf16", cpu=True).scaler
print("Accelerator(mixed_precision='bf16').scaler:", accelerate_scaler)

# %% [markdown]
# ## The lesson's claims, checked

# %%
assert g.half()[0].item() == 0.0 and g.bfloat16()[0].item() > 0  # fp16 flushes 1e-8, bf16 keeps it
assert extra.get("_amp_foreach_non_finite_check_and_unscale_") == 1 and extra.get("_local_scalar_dense", 0) >= 1
assert "bfloat16" in report.facts.hardware.unscale_dtypes and finding.severity == "warning"
assert on_a100.findings_for("scaler-with-bf16")[0].severity == "error"
assert fix.safe and not scaler.is_enabled()
assert not report.refresh().findings_for("scaler-with-bf16")
assert all(math.isfinite(x) for x in losses) and "_amp_foreach_non_finite_check_and_unscale_" not in after_fix
assert accelerate_scaler is None
print("all claims hold")
