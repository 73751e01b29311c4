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
#     - probe-generation-nonfinite
#     - module:mpdoctor.attach.numerics.generation
# ---

# %% [markdown]
# # It trained, now it generates garbage: a bf16 model run in fp16
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/mpdoctor/mpdoctor/blob/main/notebooks/11_generates_garbage.ipynb) [![Binder](https://mybinder.org/badge_logo.svg)](https://mybinder.org/v2/gh/mpdoctor/mpdoctor/main?labpath=notebooks%2F11_generates_garbage.ipynb)
#
# Fine-tuning went well in bf16: the loss fell and the model answers correctly. Then it is loaded in fp16 to generate (`model.half()`, `torch_dtype=torch.float16`, or a GPU without bf16 such as a T4 or a V100), and greedy search returns the same token again and again while sampling raises ``probability tensor contains either `inf`, `nan` or element < 0``. The weights are fine in fp16; one activation is not. This lesson reproduces that with a real `generate()`, names the module with mpdoctor's generation probe, and fixes the model in place.

# %% [markdown]
# **Setup.** The next cell installs mpdoctor only if it is missing: on Colab, the `%pip install` line fetches it from GitHub (it is not on PyPI yet); on Binder and in CI it is already installed and the line is skipped. Then `%load_ext mpdoctor` registers the `%mpdoctor` magic and the hook that explains known mixed-precision errors under their traceback. Everything runs on the CPU in well under a minute, with tiny models built from configs (nothing is downloaded): on Colab the default CPU runtime is the one this lesson is written for.

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
# **What matters here: the two ceilings.** A model trained in bf16 never learns that 65504 is a limit: nothing
# in bf16 stops an activation at 100000. Such "massive activations" are common in large checkpoints trained in
# bf16 (T5's feed-forward output reached 66246 in transformers #5651; Gemma and other bf16-native models
# overflow in fp16 the same way). Cast to fp16, the same computation produces `inf`, and the next normalization
# or softmax turns it into NaN. fp16 has *more* mantissa bits than bf16, so the weights themselves survive the
# cast almost exactly: the failure is in the values computed in flight.

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
fp16_max, bf16_max = torch.finfo(torch.float16).max, torch.finfo(torch.bfloat16).max
print(f"largest fp16: {fp16_max:g} | largest bf16: {bf16_max:.4g}")
print(
    "100000 in bf16:",
    torch.tensor(100000.0).bfloat16().item(),
    "| in fp16:",
    torch.tensor(100000.0).half().item(),
    "| softmax over [inf, 1.0] in fp16:",
    torch.softmax(torch.tensor([math.inf, 1.0]).half(), dim=0).tolist(),
)

# %% [markdown]
# ## The model and its fine-tuning, in bf16
#
# A tiny Llama built from a config. A real checkpoint brings its massive activations from pretraining; a tiny
# random model has none, so we plant them, as if the checkpoint we fine-tune came with them: the MLP of layer 1
# gets larger weights (the gate and up projections ×100, the down projection ×2000). Every weight stays far
# inside fp16's range (the largest is printed below); only the values that MLP computes go past 65504.
#
# The fine-tuning task makes "sane" easy to check: continue a count (`10 11 12 13` → `14 15 16 ...`,
# wrapping at the vocabulary's 64). Weights, optimizer state and compute are all bf16, as in a typical
# `torch_dtype=torch.bfloat16` fine-tune.

# %%
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=0,
    eos_token_id=None,  # a count has no end
    pad_token_id=0,
)
model = LlamaForCausalLM(config)
mlp = model.model.layers[1].mlp
with torch.no_grad():  # plant the checkpoint's massive activations in one MLP
    mlp.gate_proj.weight.mul_(100)
    mlp.up_proj.weight.mul_(100)
    mlp.down_proj.weight.mul_(2000)
model.to(torch.bfloat16)
print("largest weight:", max(p.detach().abs().max().item() for p in model.parameters()))


def counting_batch(n=16, length=24):
    """Rows of consecutive token ids, each from a random start, wrapping at the vocabulary size."""
    ids = (torch.randint(0, config.vocab_size, (n, 1)) + torch.arange(length)) % config.vocab_size
    return {"input_ids": ids, "labels": ids}


def fine_tune(model, steps=60):
    """A plain bf16 fine-tune: bf16 weights, bf16 AdamW state; returns the losses."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = model(**counting_batch()).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


bf16_losses = fine_tune(model)
print("loss, every 10 steps:", [round(x, 3) for x in bf16_losses[::10]], "->", round(bf16_losses[-1], 3))

# %% [markdown]
# It learned. In bf16, greedy search continues the count:

# %%
model.eval()
prompt = {"input_ids": torch.tensor([[10, 11, 12, 13]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
with torch.no_grad():
    reference = model.generate(**prompt, max_new_tokens=12, do_sample=False)
print("bf16, greedy:", reference[0].tolist())

# %% [markdown]
# ## The broken setup: the same model, generated in fp16
#
# `model.half()` converts every bf16 weight to fp16. fp16 has three more mantissa bits than bf16, so a bf16
# value inside fp16's range converts exactly; only the tiniest weights, below fp16's smallest normal number,
# lose bits.

# %%
bf16_weights = [p.detach().clone() for p in model.parameters()]
model.half()
changed = sum(int((p.bfloat16() != w).sum()) for p, w in zip(model.parameters(), bf16_weights))
total = sum(w.numel() for w in bf16_weights)
print(
    f"weights the cast changed: {changed} of {total:,}; dtypes now: {sorted({str(p.dtype) for p in model.parameters()})}"
)

# %% [markdown]
# ## The measured harm: greedy search repeats one token

# %%
with torch.no_grad():
    greedy = model.generate(
        **prompt, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
fp16_tokens = greedy.sequences[0].tolist()
nan_logits = [int(torch.isnan(step).sum()) for step in greedy.logits]
print("fp16, greedy:", fp16_tokens)
print("NaN logits at each decoding step (of 64):", nan_logits)

# %% [markdown]
# No error, just garbage: every logit is NaN, and the argmax of a row of NaN is token 0, again and again.
# Sampling does not take NaN for an answer:

# %% mpdoctor={"expect": "probability tensor contains either `inf`, `nan` or element < 0"} tags=["raises-exception"]
sampled = model.generate(**prompt, max_new_tokens=12, do_sample=True)

# %% [markdown]
# That is torch's own error, from `torch.multinomial` inside `generate`. Under the traceback, mpdoctor's hook
# recognizes it (`crash-sampling-nonfinite`): the logits held NaN/Inf. Its diagnosis at rest sees fp16 weights
# with nothing wrong in them (no check can see an overflow that only happens in flight), so it says what to
# run next: the generation probe.
#
# ## Diagnose: the generation probe
#
# `%mpdoctor model --probe prompt --generate 8` runs eight decoding steps of the model's own `generate()` on the
# prompt, in eval mode and without gradients, with cheap hooks on every module and on the logits. It names the
# first module whose output left its dtype's range, and the decoding step at which the logits went NaN. It
# leaves nothing behind: hooks removed, train/eval modes and RNG streams restored, even when `generate` raises.
# Run after the failing cell, its finding becomes the cause of that `RuntimeError`. (The info finding about the
# rotary embedding's `inv_freq` is a separate, small matter: `model.half()` casts buffers too.)

# %%
# probe_report = %mpdoctor model --probe prompt --generate 8

# %% [markdown]
# The same from Python:

# %%
report = mpdoctor.probe(model, prompt, generate=True, max_new_tokens=8)
for f in report.findings:
    print(f"{f.severity:8} {f.check}  [{f.subject}]\n         {f.message}\n")

# %% [markdown]
# The per-module table, in call order, around the culprit (`fp16_headroom` below 1: past fp16's range;
# 0: non-finite). The gate and up projections stay in the tens; their product reaches about a thousand at
# `down_proj`'s input, and its larger weights carry the sum past 65504, which fp16 stores as `inf`. From there
# everything downstream is `inf` or NaN: the residual stream, the final norm, all 64 logits.

# %%
columns = ["module", "class", "output_dtypes", "out_absmax", "out_nonfinite", "fp16_headroom"]
table = report.probe_table
table[table.module.str.contains("layers.1.mlp|layers.1$|model.norm|lm_head")][columns]

# %% [markdown]
# ## Fix
#
# The finding carries its fixes; the first is in the plan (`report.fixes`), and was already run by the probe:
# "checked" means the probe's own `generate()` ran with the fix applied and its logits were finite. It is
# unsafe in mpdoctor's sense (bf16 keeps three fewer mantissa bits than fp16), so it runs only on request:
# `fix.apply()`, the call the widget's button makes.

# %%
(culprit,) = report.findings_for("probe-nonfinite")
fix = culprit.fixes[0]
print(f"fix ({'safe' if fix.safe else 'unsafe'}): {fix.title}")
print("  ", report.proof.label(fix))
print(fix.code)
print("\nalternative:", culprit.fixes[1].title)

# %% [markdown]
# The fix casts the fp16 parameters to bf16, in place (the same `Parameter` objects): bf16's range is fp32's,
# and these are the numbers the model was trained in. The alternative keeps `down_proj` alone in fp32 with
# autocast off inside it; as its code says, the modules after it must then run under autocast, because its
# fp32 output meets their fp16 weights (without autocast, the next matmul refuses the two dtypes). On a GPU
# without bf16 (T4, V100), that alternative, or fp32, is what remains.

# %%
fix.apply()
print("dtypes now:", {str(p.dtype) for p in model.parameters()})

# %% [markdown]
# ## A generation that works

# %%
with torch.no_grad():
    fixed = model.generate(
        **prompt, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    torch.manual_seed(0)
    sampled = model.generate(**prompt, max_new_tokens=12, do_sample=True)
fixed_tokens = fixed.sequences[0].tolist()
print("after the fix, greedy: ", fixed_tokens)
print("after the fix, sampled:", sampled[0].tolist())
print("non-finite logits:", sum(int((~torch.isfinite(step)).sum()) for step in fixed.logits))

# %% [markdown]
# Sampling at temperature 1 may wander off the count now and then: that is sampling, not overflow. The probe
# again, on the fixed model: nothing went non-finite, and what remains is a note that this module's output is
# past fp16's range (the value fp16 could not hold, now held by bf16), should anyone cast the model back.

# %%
after = report.refresh()
for f in after.findings:
    if f.check.startswith("probe"):
        print(f"{f.severity:8} {f.check}  [{f.subject}]\n         {f.message}\n")
down_proj = after.probe_table.set_index("module").loc["model.model.layers.1.mlp.down_proj"]
print(
    f"layers.1.mlp.down_proj, largest output in bf16: {down_proj.out_absmax:,.0f} (fp16's ceiling: {fp16_max:,.0f})"
)

# %% [markdown]
# ## The lesson's claims, checked

# %%
culprit_path = "model.model.layers.1.mlp.down_proj"
assert torch.finfo(torch.float16).max == 65504 and torch.finfo(torch.bfloat16).max > 3e38
assert bf16_losses[-1] < 0.5 * bf16_losses[0] and all(
    map(math.isfinite, bf16_losses)
)  # bf16 fine-tuning worked
assert reference[0, 4:].tolist() == [(14 + i) % 64 for i in range(12)]  # and the bf16 model counts
assert changed < 1e-3 * total  # model.half() kept the weights (all but a few tiny ones)

# fp16 generation breaks for real: NaN logits at every step, greedy repeats token 0, sampling raises torch's error.
assert all(n == 64 for n in nan_logits) and fp16_tokens[4:] == [0] * 12
assert probe_report.exception.startswith("RuntimeError: probability tensor contains either `inf`, `nan`")

# The probe names the module whose fp16 output passed 65504 (its inputs finite), at the prompt's prefill.
assert probe_report.cause.check == "probe-nonfinite" and probe_report.cause.subject == culprit_path
assert (
    culprit.subject == culprit_path and "inputs were finite" in culprit.message and "65504" in culprit.message
)
(generation,) = report.findings_for("probe-generation-nonfinite")
assert (
    "logits went NaN/Inf at the prompt's prefill (step 0)" in generation.message
    and culprit_path in generation.message
)
assert float(table.set_index("module").loc[culprit_path, "fp16_headroom"]) == 0

# The fix: checked on the probe's generate(), applied in place, and generation is finite and sane again.
assert fix in report.fixes and not fix.safe and "bf16" in fix.title
assert report.proof.label(fix).startswith("checked on the probe's generate()")
assert all(p.dtype == torch.bfloat16 for p in model.parameters())
assert all(torch.isfinite(step).all() for step in fixed.logits)
assert fixed_tokens == reference[0].tolist()  # the count again, token for token as in bf16
assert all(0 <= t < config.vocab_size for t in sampled[0].tolist())  # sampling no longer raises
assert not [f for f in after.findings if f.check in ("probe-nonfinite", "probe-generation-nonfinite")]
assert [f.subject for f in after.findings_for("probe-overflow")] == [
    culprit_path
]  # should anyone cast it back
assert down_proj.out_absmax > fp16_max  # the activation is still past 65504: bf16 holds it
print("all claims hold")
