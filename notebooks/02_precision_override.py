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
#     - precision-override
#     - bf16-unsupported
# ---

# %% [markdown]
# # The precision in effect is not the precision asked for
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/mpdoctor/mpdoctor/blob/main/notebooks/02_precision_override.ipynb) [![Binder](https://mybinder.org/badge_logo.svg)](https://mybinder.org/v2/gh/mpdoctor/mpdoctor/main?labpath=notebooks%2F02_precision_override.ipynb)
#
# Field case 2 (ms-swift #3896 / PR #3909): `fp16=False` was ignored and training ran in fp16 anyway. Three ways the precision that runs differs from the one you asked for: a stale `ACCELERATE_MIXED_PRECISION`, fp16 silently off on a CPU, and bf16 on a GPU that has none (evaluated with `--target`).

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
# **What matters here: which format actually runs.** `TrainingArguments(fp16=..., bf16=...)` is a request; accelerate decides what the forward really computes in (autocast), from the arguments, the `ACCELERATE_MIXED_PRECISION` environment variable and the device. fp16 compute over a model trained in bf16 can pass 65504 and turn the loss into NaN (ms-swift #3896, on a V100).

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
print("fp16: 70000 ->", torch.tensor(70000.0).half().item(), "| bf16: 70000 ->", torch.tensor(70000.0).bfloat16().item())

# %% [markdown]
# ## Part 1: a stale `ACCELERATE_MIXED_PRECISION`
#
# `accelerate launch --mixed_precision ...`, `notebook_launcher(..., mixed_precision=...)`, a platform's setup
# cell or a `%env` line from an earlier experiment leave `ACCELERATE_MIXED_PRECISION` in the process
# environment. transformers' `TrainingArguments` starts from that variable, and `fp16=False` / `bf16=False`
# only mean "I do not ask for it", not "no": the stale value wins. Here the earlier experiment was bf16
# (the CPU runs bf16 autocast, so the harm is measurable on this machine; in the field case it was fp16 on
# a V100).

# %%
# %env ACCELERATE_MIXED_PRECISION=bf16

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

import os
import tempfile

from transformers import Trainer, TrainingArguments


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return len(ids)

    def __getitem__(self, i):
        return {"input_ids": ids[i], "labels": ids[i]}


def make_trainer(**precision):
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), use_cpu=True, max_steps=1, per_device_train_batch_size=4,
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True, **precision,
    )
    torch.manual_seed(0)
    return Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=Rows())


def compute_dtypes(trainer):
    """Run one real training step and record the dtype the first q_proj computes in."""
    seen = []
    layer = trainer.model.get_submodule("model.layers.0.self_attn.q_proj")
    handle = layer.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    try:
        trainer.train()
    finally:
        handle.remove()
    return sorted({str(d).replace("torch.", "") for d in seen})


trainer = make_trainer(fp16=False, bf16=False)  # "train in fp32, please"
print("asked: fp16=False, bf16=False | args.mixed_precision:", trainer.args.mixed_precision,
      "| accelerator:", trainer.accelerator.mixed_precision)

# %% [markdown]
# The measured harm: a forward hook on a real layer, during one real `trainer.train()` step, records the dtype it computes in.

# %%
stale_dtypes = compute_dtypes(trainer)
print(stale_dtypes)

# %% [markdown]
# ## Diagnose

# %%
# report = %mpdoctor trainer

# %%
finding = report.findings_for("precision-override")[0]
print(finding.severity, "|", finding.subject)
print(finding.message)
fix = finding.fixes[0]
print(f"\nfix ({'safe' if fix.safe else 'unsafe'}): {fix.title}\n{fix.code}")

# %% [markdown]
# ## Fix
#
# The fix brings the accelerator (its mixed-precision state, `native_amp`, the scaler, the autocast wrapper
# of a model it already prepared), `args.mixed_precision` and the environment variable in line with the
# arguments, in place, so the next `trainer.train()` computes in what you asked for. It is unsafe (it changes
# the numerics of the next step, and accelerate's state is one per process), so it runs when you call
# `fix.apply()`, the same call the widget's button makes.

# %%
fix.apply()
print("ACCELERATE_MIXED_PRECISION:", os.environ.get("ACCELERATE_MIXED_PRECISION"),
      "| accelerator:", trainer.accelerator.mixed_precision)
fixed_dtypes = compute_dtypes(trainer)
after_fix = report.refresh()
print("computes in:", fixed_dtypes, "| precision-override findings now:", len(after_fix.findings_for("precision-override")))

# %% [markdown]
# ## Part 2: fp16 silently off on a CPU
#
# `fp16=True` on a machine where accelerate does not run fp16 autocast (this CPU) gives an accelerator that
# says `fp16` but has `native_amp == False`: the run is plain fp32, and nothing tells you. (accelerate keeps
# one `AcceleratorState` per process, so each new Trainer's setting applies to every Accelerator in the
# kernel: that is why each fix above is checked with `report.refresh()` right away.)

# %%
cpu_trainer = make_trainer(fp16=True)
silent_dtypes = compute_dtypes(cpu_trainer)
print("accelerator:", cpu_trainer.accelerator.mixed_precision, "| native_amp:", cpu_trainer.accelerator.native_amp,
      "| computes in:", silent_dtypes)

# %%
# silent = %mpdoctor cpu_trainer

# %% [markdown]
# Two fixes are offered, both unsafe because each changes something you chose: run fp16 autocast on the CPU
# as the arguments ask (torch can, with a CPU `GradScaler`, though fp16 matmuls are often slower than fp32 on
# CPUs), or make the arguments say what runs (fp32; `bf16=True` is the CPU's fast half precision). Here we
# take the first and measure again:

# %%
cpu_finding = silent.findings_for("precision-override")[0]
for f in cpu_finding.fixes:
    print(f"- ({'safe' if f.safe else 'unsafe'}) {f.title}")
cpu_finding.fixes[0].apply()
asked_dtypes = compute_dtypes(cpu_trainer)
after_cpu_fix = silent.refresh()
print("accelerator:", cpu_trainer.accelerator.mixed_precision, "| native_amp:", cpu_trainer.accelerator.native_amp,
      "| scaler:", type(cpu_trainer.accelerator.scaler).__name__, "| computes in:", asked_dtypes)

# %% [markdown]
# ## Part 3: bf16 on a GPU without bf16 (`--target`)
#
# V100, T4 (Colab's free GPU), P100 and RTX 20xx have compute capability below 8.0 and no native bf16. You
# can ask what such a GPU would make of a bf16 setup without owning one. Here on the CPU, bf16 is fine:

# %%
bf16_trainer = make_trainer(bf16=True)
# here = %mpdoctor bf16_trainer --text

# %%
# on_t4 = %mpdoctor bf16_trainer --target T4

# %% [markdown]
# The same question from Python, for a V100:

# %%
on_v100 = mpdoctor.diagnose(namespace={"bf16_trainer": bf16_trainer}, target="V100")
for f in on_v100.findings:
    print(f"{f.severity:8} {f.check}: {f.message}")

# %% [markdown]
# ## The lesson's claims, checked

# %%
assert stale_dtypes == ["bfloat16"] and finding.severity == "error"  # fp32 asked, bf16 computed
assert not fix.safe and fixed_dtypes == ["float32"] and "ACCELERATE_MIXED_PRECISION" not in os.environ
assert not after_fix.findings_for("precision-override")

assert cpu_trainer.args.fp16 and silent_dtypes == ["float32"]  # fp16 asked, fp32 computed
assert asked_dtypes == ["float16"] and not after_cpu_fix.findings_for("precision-override")

assert not here.findings_for("bf16-unsupported")  # the CPU runs bf16
assert on_t4.findings_for("bf16-unsupported") and on_v100.findings_for("bf16-unsupported")
print("all claims hold")
