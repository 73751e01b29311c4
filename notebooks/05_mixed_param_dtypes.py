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
#     - mixed-param-dtypes
# ---

# %% [markdown]
# # Mixed parameter dtypes in one compute path: `mat1 and mat2 must have the same dtype`
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/mpdoctor/mpdoctor/blob/main/notebooks/05_mixed_param_dtypes.ipynb) [![Binder](https://mybinder.org/badge_logo.svg)](https://mybinder.org/v2/gh/mpdoctor/mpdoctor/main?labpath=notebooks%2F05_mixed_param_dtypes.ipynb)
#
# Field case 5 (Unsloth #1260, #212): fp32 adapter weights beside a bf16 base, in a code path that does not cast. Why a matmul refuses two dtypes, which mixes are legitimate (PEFT's LoRA, autocast, fp32 norms), and how mpdoctor tells them apart.

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
# **What matters here: one dtype per matmul.** Elementwise operations promote mixed inputs (bf16 + fp32 gives fp32), but matrix multiplications do not: both operands must have the same dtype. Autocast exists to choose that dtype for you; outside it, a bf16 activation meeting an fp32 weight is an error.

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
a = torch.ones(2, 4, dtype=torch.bfloat16)
w = torch.ones(4, 4)  # fp32
print("a + w (bf16 + fp32, elementwise):", (a + w[:2]).dtype)
try:
    torch.nn.functional.linear(a, w, torch.zeros(4))
except RuntimeError as exc:
    print("linear(bf16 input, fp32 weight):", exc)

# %% [markdown]
# ## The broken setup (Unsloth #1260, #212)
#
# A bf16 Llama with a hand-written adapter on each MLP, its weights in fp32 (PEFT's default for adapters).
# Unsloth hit the same thing inside fused autograd functions, where autocast is off and gradient
# checkpointing re-runs the matmul in backward.

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

class BottleneckAdapter(torch.nn.Module):
    """A hand-written adapter after an MLP: down-project, GELU, up-project, add (Houlsby style)."""

    def __init__(self, mlp, hidden, bottleneck=8):
        super().__init__()
        self.mlp = mlp
        self.down = torch.nn.Linear(hidden, bottleneck)  # fp32 "for stable training", as PEFT does
        self.up = torch.nn.Linear(bottleneck, hidden)
        torch.nn.init.zeros_(self.up.weight)
        torch.nn.init.zeros_(self.up.bias)

    def forward(self, x):
        h = self.mlp(x)
        return h + self.up(torch.nn.functional.gelu(self.down(h)))  # no cast: h is bf16, down is fp32


model = LlamaForCausalLM(config).to(torch.bfloat16).train()
model.requires_grad_(False)
for layer in model.model.layers:
    layer.mlp = BottleneckAdapter(layer.mlp, config.hidden_size)  # adapters stay fp32 and trainable
adapters = [p for p in model.parameters() if p.requires_grad]
print("base:", {str(p.dtype) for p in model.parameters() if not p.requires_grad},
      "| adapters:", {str(p.dtype) for p in adapters})

# %% mpdoctor={"expect": "mat1 and mat2 must have the same dtype"} tags=["raises-exception"]
loss = model(**batch).loss

# %% [markdown]
# ## Not every mix is a bug
#
# mpdoctor must not cry wolf. Three legitimate mixes:
#
# 1. **PEFT's LoRA layers** keep fp32 adapters on a bf16 base and cast the input to the adapter's dtype
#    (`x = self._cast_input_dtype(x, lora_A.weight.dtype)`).
# 2. **Autocast** picks one dtype per operation, so mixed weights are legal inside it.
# 3. **Norms kept in fp32** on purpose (e.g. by `prepare_model_for_kbit_training`).

# %%
from peft import LoraConfig, get_peft_model

peft_model = get_peft_model(
    LlamaForCausalLM(config).to(torch.bfloat16),
    LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
)
print("PEFT LoRA, fp32 adapters on a bf16 base:", peft_model(**batch).loss.item())
with torch.autocast("cpu", dtype=torch.bfloat16):
    print("our adapter under bf16 autocast:", model(**batch).loss.item())

# %% [markdown]
# ## Diagnose: the hand-written adapter is flagged, PEFT's LoRA is not

# %%
# report = %mpdoctor model peft_model

# %% [markdown]
# Diagnosed inside an autocast region, the same model is legal, and mpdoctor says so:

# %%
with torch.autocast("cpu", dtype=torch.bfloat16):
    under_autocast = mpdoctor.diagnose(model)  # what `%mpdoctor model` runs, here inside the region
print(under_autocast.to_text())

# %%
findings = report.findings_for("mixed-param-dtypes")
for f in findings:
    print(f.severity, "|", f.subject, "|", f.message)
fix = findings[0].fixes[0]
print(f"\nfix ({'safe' if fix.safe else 'unsafe'}): {fix.title}\n{fix.code}")

# %% [markdown]
# ## Fix
#
# The fix casts the minority parameters of the affected modules (the adapters) to the dtype the module
# computes in (bf16), in place, keeping the `Parameter` objects. Unsafe: it narrows a dtype, so it runs only
# on request (`fix.apply()`, the widget button's call). The alternatives are to run the forward under
# autocast, or to cast inside the adapter as PEFT does.

# %%
fix.apply()
print("adapters:", {str(p.dtype) for p in adapters})

# %% [markdown]
# bf16 trainable weights want an optimizer that compensates rounding (notebook 01): `AdamWBF16`.

# %%
from adamw_bf16 import AdamWBF16

optimizer = AdamWBF16(adapters, lr=1e-2)
losses = []
for _ in range(3):
    optimizer.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print("losses:", [round(x, 4) for x in losses])

# %% [markdown]
# ## The lesson's claims, checked

# %%
assert [f.subject for f in findings] == ["model"] and findings[0].severity == "error"
assert not under_autocast.findings_for("mixed-param-dtypes")  # autocast makes the mix legal
assert not [f for f in report.findings if f.subject.startswith("peft_model") and f.severity != "info"], "a false alarm on PEFT's LoRA"
assert not fix.safe and all(p.dtype == torch.bfloat16 for p in adapters)
assert not report.refresh().findings_for("mixed-param-dtypes")
assert all(math.isfinite(x) for x in losses)
print("all claims hold")
