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
#     - fp16-trainable-params-with-scaler
#     - cache-in-training
# ---

# %% [markdown]
# # A tour of mpdoctor
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/mpdoctor/mpdoctor/blob/main/notebooks/00_tour.ipynb) [![Binder](https://mybinder.org/badge_logo.svg)](https://mybinder.org/v2/gh/mpdoctor/mpdoctor/main?labpath=notebooks%2F00_tour.ipynb)
#
# mpdoctor looks at the live PyTorch and Hugging Face objects in your notebook (model, optimizer, scaler, Trainer, Accelerator), finds mixed-precision faults before they crash or silently ruin a run, and fixes them in place. This tour runs on a laptop CPU in well under a minute: diagnose a setup with several problems, read the report, fix it, re-run clean, export, and ask what a GPU you do not have would say.

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
# Two rules follow, and this tour breaks both: **fp16 needs loss scaling** (a `GradScaler`) because of its tiny range, and the scaler expects **fp32 master weights** with fp16 only in the compute (autocast), not fp16 weights.

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
# ## A setup with several problems at once
#
# A tiny Llama (built from a config: nothing is downloaded), made "lighter" with `.half()`, an AMP
# training loop copied from a tutorial (fp16 autocast and a `GradScaler`), and the config's default
# `use_cache=True`. Nothing complains while you build it.

# %%
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
)
ids = torch.randint(0, config.vocab_size, (4, 32))
batch = {"input_ids": ids, "labels": ids}
model = LlamaForCausalLM(config).half().train()  # fp16 weights "to save memory"
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")  # from an fp16 AMP recipe


def train_step():
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(**batch)
    scaler.scale(out.loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return out


print("parameters:", {str(p.dtype) for p in model.parameters()}, "| use_cache:", model.config.use_cache)

# %% [markdown]
# The first training step fails, with the error people meet in the wild (transformers #23165, peft #341):

# %% mpdoctor={"expect": "Attempting to unscale FP16 gradients."} tags=["raises-exception"]
out = train_step()

# %% [markdown]
# ## Diagnose
#
# `%mpdoctor` with no argument inspects every model, optimizer, scaler, Trainer and Accelerator in the
# notebook's namespace, shows the report and returns it (like `%timeit -o`), so you can keep it in a variable.

# %%
# report = %mpdoctor

# %% [markdown]
# ## Reading the report
#
# Each finding has a **severity** (`error`: will crash or silently train wrong; `warning`: wasted or risky;
# `info`), a **check** slug (stable: you can ignore it with `--ignore` or look it up in the checks reference),
# the **subject** it is about, a plain **message**, the **evidence** it rests on, and zero or more
# **fixes**. A fix is **safe** when it keeps the meaning of the run you intended (turning off a cache nobody
# reads) and **unsafe** when it changes numerics or memory (casting weights): unsafe fixes are never applied
# behind your back. Each fix also knows the line of code that does the same thing, for your script.

# %%
for finding in report.findings:
    print(f"{finding.severity.upper():8} {finding.check}  ({finding.subject})")
    print("         ", finding.message)
    for fix in finding.fixes:
        print(f"          fix ({'safe' if fix.safe else 'unsafe'}): {fix.title}")
    print()

# %% [markdown]
# The dtype histogram behind the findings (one row per object, tensor kind and dtype) is a DataFrame:

# %%
report.histogram

# %% [markdown]
# ## Fix
#
# `report.apply_safe_fixes()` applies every safe fix, in place, on the live objects, and returns what it did
# (the widget's **Apply all safe fixes** button runs the same call):

# %%
applied = report.apply_safe_fixes()
print(applied)
print("use_cache now:", model.config.use_cache)

# %% [markdown]
# The cast to fp32 is unsafe (it doubles the weights' memory and changes the dtype layers compute in), so it
# waits for you. Read what it will do, then apply it explicitly: `fix.apply()` is exactly what the widget's
# button runs. It casts in place, keeping the same `Parameter` objects, so the optimizer still holds them.

# %%
cast = report.findings_for("fp16-trainable-params-with-scaler")[0].fixes[0]
print(cast.code)
print(cast.preview())
held_before = [id(p) for p in optimizer.param_groups[0]["params"]]
cast.apply()
print("parameters:", {str(p.dtype) for p in model.parameters()})

# %% [markdown]
# Every fix can be undone exactly (`fix.undo()`), and applying it twice changes nothing. Now the clean re-run:
# `%mpdoctor` again, and the very same `train_step()` that failed above.

# %%
# after = %mpdoctor

# %%
out = train_step()
print(f"loss {out.loss.item():.4f} | cache returned: {out.past_key_values is not None}"
      f" | grads: {sorted({str(p.grad.dtype) for p in model.parameters()})}")

# %% [markdown]
# This is the classic AMP recipe: fp32 master weights, fp16 compute under autocast, and a `GradScaler` that
# keeps small fp16 gradients from flushing to zero.
#
# ## Export
#
# For a bug report, a notebook of results or a dashboard: pandas, a dict (JSON) or markdown.

# %%
frame = report.to_frame()
frame

# %%
markdown = report.to_markdown()
print(markdown)

# %% [markdown]
# ## What if: Colab's free T4
#
# `--target` evaluates the same live objects against another device's capabilities, without owning it.
# A T4 (compute capability 7.5) has fp16 tensor cores but no native bf16: the recipe we ended with is the
# one it runs well. (Notebook 02 shows what `--target` says about bf16 on such a GPU.)

# %%
# t4 = %mpdoctor --target T4

# %% [markdown]
# ## When it crashes
#
# After `%load_ext mpdoctor`, a cell that raises a known mixed-precision error shows IPython's usual
# traceback and then the diagnosis: the objects of the namespace and of the failing function's own frames,
# with the finding that explains the exception first ("cause of RuntimeError: ...") and its fix button.
# Any other error is shown exactly as IPython shows it; `%config MPDoctorMagics.on_error = False` turns this
# off. Here an fp32 head sits after a bf16 layer, and the training step is a function:

# %%
net = torch.nn.Sequential(torch.nn.Linear(16, 16).to(torch.bfloat16), torch.nn.Linear(16, 2))


def train_step():
    return net(torch.randn(4, 16, dtype=torch.bfloat16)).float().sum()


# %% tags=["raises-exception"]
train_step()

# %% [markdown]
# The report under the traceback is what the hook showed. The same diagnosis through the API, the fix the
# button applies, and the step that runs afterwards:

# %%
import sys  # noqa: E402

from mpdoctor.attach.crash import explain  # noqa: E402

crash = explain(sys.last_value, namespace={"net": net})
assert crash.cause is crash.findings[0] and crash.cause.check == "mixed-param-dtypes", crash.cause
assert crash.exception.startswith("RuntimeError"), crash.exception
crash.cause.fixes[0].apply()  # what the fix button runs
train_step().backward()
assert {p.dtype for p in net.parameters()} == {torch.bfloat16}
print("the step runs now")

# %% [markdown]
# ## The lesson's claims, checked
#
# This cell makes the notebook fail in CI the day mpdoctor, PyTorch or transformers stops behaving as this
# tour says.

# %%
assert report.findings_for("fp16-trainable-params-with-scaler"), "the fp16 weights were not diagnosed"
assert report.findings_for("cache-in-training"), "the cache in training was not diagnosed"
assert [f.safe for f in applied] == [True] and not cast.safe

final = report.refresh()
assert not final.findings_for("fp16-trainable-params-with-scaler")
assert not final.findings_for("cache-in-training")
assert final.ok and after.ok, final.to_text()
assert [id(p) for p in optimizer.param_groups[0]["params"]] == held_before  # same Parameter objects

assert torch.isfinite(out.loss) and out.past_key_values is None
assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())

assert {"fp16-trainable-params-with-scaler", "cache-in-training"} <= set(frame["check"])
assert "fp16-trainable-params-with-scaler" in markdown and "cache-in-training" in markdown
assert t4.facts.hardware.name == "T4" and t4.ok, t4.to_text()
assert t4.facts.hardware.fp16_tensor_cores and not t4.facts.hardware.bf16_native
print("all claims hold")
