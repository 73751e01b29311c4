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
#     - bnb-compute-dtype-fp32
#     - module:bitsandbytes
#     - module:peft
#     stack: true
# ---

# %% [markdown]
# # QLoRA's compute dtype: 4-bit weights that quietly compute in fp32
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/mpdoctor/mpdoctor/blob/main/notebooks/07_qlora_compute_dtype.ipynb) [![Binder](https://mybinder.org/badge_logo.svg)](https://mybinder.org/v2/gh/mpdoctor/mpdoctor/main?labpath=notebooks%2F07_qlora_compute_dtype.ipynb)
#
# h2ogpt PR #682 went from 5 to 16 tokens/s by changing one argument: `BitsAndBytesConfig`'s `bnb_4bit_compute_dtype` defaults to fp32, so every 4-bit matmul of a half-precision model upcasts to fp32. bitsandbytes PR #2077 shows that when the dtype is passed explicitly there is no warning at all. How a 4-bit layer computes, how to measure it, and the in-place fix.

# %% [markdown]
# **Setup.** The next cell installs what is missing: on Colab, the `%pip install` lines fetch mpdoctor from GitHub and bitsandbytes from PyPI; in CI they are installed already and the lines are skipped. Then `%load_ext mpdoctor` registers the `%mpdoctor` magic. bitsandbytes runs on the CPU: a tiny Llama is saved to a temporary folder and loaded back in 4-bit (nothing is downloaded).

# %%
# Installs only what is missing: on Colab this fetches mpdoctor from GitHub;
# in CI or after `pip install -e .[stack]` everything is importable and nothing runs.
try:
    import mpdoctor
except ImportError:
    # %pip install -q "mpdoctor[hf] @ git+https://github.com/mpdoctor/mpdoctor"
    import mpdoctor
try:
    import bitsandbytes
except ImportError:
    # %pip install -q bitsandbytes
    import bitsandbytes  # noqa: F401  (only checks that it is installed)

# %load_ext mpdoctor
print("mpdoctor", mpdoctor.__version__)

# %% [markdown]
# ## The number formats
#
# A 4-bit (nf4) weight is not a number a matmul can use: each layer **dequantizes** its weights to a float dtype, its `compute_dtype`, and multiplies in that dtype. The weights' memory is 4 bits per value; the **speed** of every matmul is that of the compute dtype. `torch.finfo` on this machine:

# %%
import math

import pandas as pd
import torch


def number_formats():
    """Range and precision of the three training dtypes, straight from torch.finfo."""
    rows = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        fi = torch.finfo(dtype)
        mantissa = round(-math.log2(fi.eps))
        rows[str(dtype).replace("torch.", "")] = {
            "bits": fi.bits,
            "mantissa bits": mantissa,
            "max": f"{fi.max:.4g}",
            "eps (step after 1.0)": f"{fi.eps:.3g}",
            "bytes per activation": fi.bits // 8,
        }
    return pd.DataFrame(rows).T


number_formats()

# %% [markdown]
# bf16 is what QLoRA computes in: fp32's range with half its bytes, and tensor-core speed on Ampere and later.
# fp32 compute means twice the activation bytes and (on a GPU) no fast 4-bit GEMM kernel.
#
# ## The broken setup: the default `BitsAndBytesConfig` on a bf16 model

# %%
import tempfile
from collections import Counter

from torch.overrides import TorchFunctionMode
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
checkpoint = tempfile.mkdtemp()
LlamaForCausalLM(
    LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=4)
).save_pretrained(checkpoint)
quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")  # compute dtype left at its default
model = LlamaForCausalLM.from_pretrained(checkpoint, quantization_config=quant, device_map="cpu", dtype=torch.bfloat16)
print("bnb_4bit_compute_dtype:", quant.bnb_4bit_compute_dtype)

# %% [markdown]
# ## Measure: which dtype do the 4-bit matmuls run in?
#
# A `TorchFunctionMode` sees every torch call of a forward. Forward hooks on each 4-bit layer (`Linear4bit`)
# tell it which layer is running, so we count the 4-bit layers that produce a large fp32 result in a model
# that is otherwise bf16, whatever kernel bitsandbytes picks on this machine (`gemm_4bit`, `gemv_4bit`, or a
# dequantize and a plain matmul).

# %%
import bitsandbytes as bnb


class Fp32Ops(TorchFunctionMode):
    """Counts torch calls returning a large fp32 tensor during a forward, and the 4-bit layers they ran in."""

    def __init__(self, model):
        super().__init__()
        self.calls = Counter()
        self.layers = set()
        self.current = None
        self.handles = []
        for name, module in model.named_modules():
            if isinstance(module, bnb.nn.Linear4bit):
                self.handles.append(module.register_forward_pre_hook(lambda m, a, name=name: self._enter(name)))
                self.handles.append(module.register_forward_hook(lambda m, a, o: self._enter(None)))

    def _enter(self, name):
        self.current = name

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.numel() >= 1024:
            self.calls[getattr(func, "__name__", str(func))] += 1
            if self.current is not None:
                self.layers.add(self.current)
        return out

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return super().__exit__(*exc)


four_bit_layers = [name for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
ids = torch.randint(0, 64, (2, 16))
with torch.no_grad(), Fp32Ops(model) as before:
    model(input_ids=ids)
print("fp32 results during one forward:", dict(before.calls))
print(f"4-bit layers computing in fp32: {len(before.layers)} of {len(four_bit_layers)}")
fp32_layers_before = len(before.layers)

# %% [markdown]
# Every 4-bit layer (q, k, v, o, gate, up and down projections) computed in fp32, although the model is
# bf16: each one casts its bf16 input up, dequantizes to fp32, multiplies, and casts the result back. And bitsandbytes
# said nothing: the compute dtype was given, so its "Input type into Linear4bit is ..." warning never runs.
#
# ## Diagnose

# %%
# report = %mpdoctor model

# %%
findings = report.findings_for("bnb-compute-dtype-fp32")
for f in findings:
    print(f.severity, "|", f.subject, "|", f.message)
fix = findings[0].fixes[0]
print(f"\nfix ({'safe' if fix.safe else 'unsafe'}): {fix.title}\n{fix.code}")

# %% [markdown]
# ## Fix
#
# The fix sets the compute dtype to bf16 on the quantization config and on every live `Linear4bit`
# (the attribute its forward reads), in place: the same model, no reload. Unsafe, because the 4-bit matmuls
# then compute in bf16 (which is QLoRA's recipe). When loading, the same is
# `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)`.

# %%
fix.apply()
with torch.no_grad(), Fp32Ops(model) as after:
    model(input_ids=ids)
print("fp32 results during one forward:", dict(after.calls))
print(f"4-bit layers computing in fp32: {len(after.layers)} of {len(four_bit_layers)}")
fp32_layers_after = len(after.layers)

# %% [markdown]
# The fp32 results left are outside the 4-bit layers: RMSNorm's variance, which transformers computes in fp32
# on purpose.
#
# ## Train: QLoRA as its docs give it

# %%
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
losses = []
for _ in range(3):
    optimizer.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print("losses:", [round(x, 4) for x in losses])
healthy = mpdoctor.diagnose(model)
print(healthy.to_text())

# %% [markdown]
# ## The lesson's claims, checked

# %%
# measured on this machine, whichever 4-bit kernel bitsandbytes chose: every 4-bit layer in fp32 before, none after
assert four_bit_layers and fp32_layers_before == len(four_bit_layers) and fp32_layers_after == 0
assert [f.severity for f in findings] == ["warning"] and not fix.safe
assert model.config.quantization_config.bnb_4bit_compute_dtype == torch.bfloat16
assert all(math.isfinite(x) for x in losses)
assert not [f for f in healthy.findings if f.severity in ("error", "warning")]
print("all claims hold")
