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
#     - module:torchao
#     - module:transformers
#     stack: true
# ---

# %% [markdown]
# # What fp8 would do to this model, before you buy the GPU
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/mpdoctor/mpdoctor/blob/main/notebooks/10_fp8_what_if.ipynb) [![Binder](https://mybinder.org/badge_logo.svg)](https://mybinder.org/v2/gh/mpdoctor/mpdoctor/main?labpath=notebooks%2F10_fp8_what_if.ipynb)
#
# "Which layers will underflow in fp8?", "why is my bf16 loss worse than fp32, and where?" People ask it before every move to a lower precision, and the usual answers need the GPU (TransformerEngine's debug features, torchao's helpers). `mpdoctor.compare(model, batch)` answers on any machine, this CPU included: it runs one forward and one backward of the live model per precision, emulating bf16, fp16, fp8, MXFP8 and NVFP4 at every Linear and at attention's own two matmuls (q·kᵀ and p·v, in SDPA or an eager attention), and measures, layer by layer, what each does. Then one real fp8 failure, measured with torchao's own float8 training on this CPU, caught and fixed.

# %% [markdown]
# **Setup.** The next cell installs what is missing: on Colab, the `%pip install` lines fetch mpdoctor from GitHub and torchao from PyPI; in CI they are installed already and the lines are skipped. Nothing is downloaded from a model hub: the model is built from a config.

# %%
# Installs only what is missing: on Colab this fetches mpdoctor from GitHub;
# in CI or after `pip install -e .[stack]` everything is importable and nothing runs.
try:
    import mpdoctor
except ImportError:
    # %pip install -q "mpdoctor[hf] @ git+https://github.com/mpdoctor/mpdoctor"
    import mpdoctor
try:
    import torchao
except ImportError:
    # %pip install -q torchao
    import torchao  # noqa: F401  (only checks that it is installed)

# %load_ext mpdoctor
print("mpdoctor", mpdoctor.__version__)

# %% [markdown]
# ## The number formats
#
# bf16 and fp16 are plain casts; fp8 keeps 3 (e4m3) or 2 (e5m2) mantissa bits and so little range that every recipe **scales** before casting: torchao's default multiplies a whole tensor by `448 / amax`, MXFP8 gives each block of 32 values its own power-of-two scale, NVFP4 each block of 16 an e4m3 scale for 4-bit e2m1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6). What `torch.finfo` says on this machine:

# %%
import copy
import math

import pandas as pd
import torch

rows = []
for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
    fi = torch.finfo(dtype)
    rows.append({"dtype": str(dtype).replace("torch.", ""), "max": fi.max, "smallest normal": fi.tiny, "eps": fi.eps})
formats = pd.DataFrame(rows).set_index("dtype")
formats

# %% [markdown]
# With one scale for the whole tensor, e4m3 covers about `448 / 2^-9`, some 2e5 between the largest value and the smallest one it does not flush to zero. A tensor whose values span more than that loses its small ones.

# %%
e4m3_span = torch.finfo(torch.float8_e4m3fn).max / 2.0**-9
print(f"one e4m3 scale spans {e4m3_span:.2g} from amax to the smallest subnormal")

# %% [markdown]
# ## A tiny Llama with a wide-range layer
#
# A 2-layer Llama built from a config. Trained LLMs grow a few outlier channels, orders of magnitude larger than the rest; here that is planted where we can see it: layer 1's input normalisation scales its 64 channels from 1e-6 to 1, so `q_proj`, `k_proj` and `v_proj` of layer 1 read inputs spanning six orders of magnitude.

# %%
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256, use_cache=False)  # fmt: skip
model = LlamaForCausalLM(config).train()
with torch.no_grad():
    model.model.layers[1].input_layernorm.weight.copy_(torch.logspace(-6, 0, 64))
ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
batch = {"input_ids": ids, "labels": ids.clone()}
print(sum(isinstance(m, torch.nn.Linear) for m in model.modules()), "Linear layers")

# %% [markdown]
# ## The heatmap: every Linear and attention matmul under every precision
#
# `%mpdoctor model --compare batch` runs the reference (fp32) and one forward + backward per precision. Each cell is the layer's **own** output SQNR under that precision: its output against the same matmul in fp32, on the inputs it really sees in that run (higher is better: bf16 keeps ~50 dB, fp16 ~18 dB more, e4m3 ~29, NVFP4 ~17). `▼` marks a layer that loses more of its nonzero inputs or gradients to zero than the precision's limit. Each attention module adds two rows between its projections, `self_attn [q·kᵀ]` and `self_attn [p·v]` (SDPA decomposed, softmax in fp32 as fp8 attention kernels keep it); their weight-gradient column is the gradient of K and V. In a notebook the widget lets you switch to the weight-gradient SQNR or the underflow shares.

# %%
# %mpdoctor model --compare batch

# %%
comparison = mpdoctor.compare(model, batch, precisions=("bf16", "fp16", "fp8", "fp8-rowwise", "mxfp8", "nvfp4"))
frame = comparison.to_frame()
frame[frame.module.str.startswith("model.layers.1.self_attn")].round(2)

# %% [markdown]
# Tensorwise fp8 flushes a large share of the wide-range layer's inputs to zero; rowwise scales (one per token, across all channels) do not help; MXFP8's blocks of 32 channels each get their own scale and lose almost nothing.

# %%
def share(module, precision):
    return comparison.row(module, precision).act_underflow_pct


q_proj = "model.layers.1.self_attn.q_proj"
print(f"{q_proj}: inputs flushed to zero: fp8 {share(q_proj, 'fp8'):.1f}%, fp8-rowwise {share(q_proj, 'fp8-rowwise'):.1f}%, "
      f"mxfp8 {share(q_proj, 'mxfp8'):.3f}%")  # fmt: skip
print(f"layer 0 q_proj under fp8: {share('model.layers.0.self_attn.q_proj', 'fp8'):.3f}%")

# %% [markdown]
# ## The loss under each precision
#
# The end-to-end effect of one forward in each precision, next to the fp32 reference:

# %%
losses = pd.Series(comparison.losses, name="loss").to_frame()
losses["vs fp32"] = losses["loss"] - comparison.losses["fp32"]
losses

# %% [markdown]
# ## The layers to keep in bf16
#
# `comparison.recommend("fp8")` keeps in higher precision every Linear whose output or weight-gradient SQNR falls under a documented floor (16 dB for fp8), that loses more than 1% of its nonzero inputs or output gradients to zero, or whose dims fp8 GEMMs cannot take (multiples of 16). It also writes the torchao code that converts the rest. Attention rows are never kept nor converted: torchao's recipes convert `nn.Linear` only, so attention stays in high precision under them; those rows say what an fp8 attention kernel would do.

# %%
recommendation = comparison.recommend("fp8")
for module, why in recommendation.reasons.items():
    print(f"keep {module}: {why}")
print()
print(recommendation.code)

# %% [markdown]
# ## A real fp8 failure, on this CPU
#
# torchao's float8 training converts every `nn.Linear` to a `Float8Linear`, and on torch 2.13 it runs on the CPU. Converted whole, the model trains without an error and without a warning. But the inputs the wide-range layers flush to zero make their **weight gradient exactly zero** in those input channels: those weights stop learning, silently.

# %%
from torchao.float8 import Float8LinearConfig, convert_to_float8_training


def dead_columns(net, path):
    """Input channels whose whole weight-gradient column is exactly zero."""
    grad = net.get_submodule(path).weight.grad
    return int((grad == 0).all(dim=0).sum())


def one_backward(net):
    net.zero_grad(set_to_none=True)
    loss = net(**batch).loss
    loss.backward()
    return loss.item()


reference_model = copy.deepcopy(model)
fp8_model = convert_to_float8_training(copy.deepcopy(model), config=Float8LinearConfig.from_recipe_name("tensorwise"))
print(type(fp8_model.get_submodule(q_proj)).__name__)
one_backward(reference_model)
one_backward(fp8_model)
dead_fp32 = dead_columns(reference_model, q_proj)
dead_fp8 = dead_columns(fp8_model, q_proj)
print(f"{q_proj}: input channels with an all-zero weight gradient: fp32 {dead_fp32}, torchao float8 {dead_fp8} of 64")

# %% [markdown]
# ## Caught: the finding
#
# compare's findings name it before any GPU time is spent:

# %%
for f in comparison.findings:
    print(f"[{f.severity}] {f.check}: {f.message}")
caught = [f for f in comparison.findings if f.check == "fp8-layer-underflows"]

# %% [markdown]
# ## Fixed: the recommended filter
#
# Run the code `.recommend` wrote on a fresh copy: every Linear but the kept ones becomes a `Float8Linear`. The wide-range layers keep their full weight gradient, and a training step works.

# %%
fixed = copy.deepcopy(model)
exec(recommendation.code, {"model": fixed})
kinds = {path: type(fixed.get_submodule(path)).__name__ for path in (q_proj, "model.layers.0.self_attn.q_proj")}
print(kinds)
optimizer = torch.optim.AdamW(fixed.parameters(), lr=1e-3)
before = fixed.get_submodule(q_proj).weight.detach().clone()
step_loss = one_backward(fixed)
dead_fixed = dead_columns(fixed, q_proj)
optimizer.step()
changed = not torch.equal(before, fixed.get_submodule(q_proj).weight.detach())
print(f"loss {step_loss:.4f}; all-zero gradient columns in {q_proj}: {dead_fixed}; weights changed: {changed}")
converted = sum(type(m).__name__ == "Float8Linear" for m in fixed.modules())
print(f"{converted} of {len(comparison.layers)} Linear layers in float8")

# %% [markdown]
# ## Verified: a per-layer plan, run end to end
#
# `.recommend` judges each layer alone. `.plan("fp8", budget=...)` keeps every layer `.recommend` (and the underflow warning) flags, by the same thresholds, then ranks the others by the same figures and emulates the *mixed* model, forward and backward, keeping the worst in bf16 until the loss gap against fp32 is within budget (a bisection: a handful of runs). It reports the plan's loss gap and gradient SQNR next to all-fp8 and all-bf16, and the torchao code with the `module_filter_fn` that converts exactly the planned layers. The heatmap marks the kept layers with ◆.

# %%
budget = 0.01 * comparison.losses["fp32"]
plan = comparison.plan("fp8", budget=budget)
print(plan.to_text())
print(comparison.to_text())

# %% [markdown]
# On this batch the verified answer is that fp8 costs the loss almost nothing: within a 1% budget the plan keeps only the layers `.recommend` flags and converts every other Linear, and says how far each alternative lands. The loss is one number on one batch: the weight-gradient channels the tensorwise scale freezes (above) barely move it, which is why the flagged layers are kept by their own figures, not by the loss; `compare(..., steps=N)` shows what they do to training over N steps.
#
# The plan's code on a fresh copy, with torchao's real `Float8Linear`: the loss it gives stays within the budget.

# %%
planned_model = copy.deepcopy(model)
exec(plan.code, {"model": planned_model})
planned_kinds = {n: type(m).__name__ for n, m in planned_model.named_modules() if isinstance(m, torch.nn.Linear)}
with torch.no_grad():
    real_gap = abs(planned_model(**batch).loss.item() - comparison.losses["fp32"])
print(f"verified loss gap {plan.loss_gap:.4g} (emulated), {real_gap:.4g} with torchao's Float8Linear; budget {budget:.4g}")

# %% [markdown]
# ## The lesson's claims, checked

# %%
assert share(q_proj, "fp8") > 5 and share(q_proj, "mxfp8") < 0.5  # tensorwise flushes, MX blocks almost nothing
assert share("model.layers.0.self_attn.q_proj", "fp8") < 0.1  # the ordinary layers lose nothing
assert q_proj in recommendation.keep and "model.layers.0.self_attn.q_proj" not in recommendation.keep
assert all(math.isfinite(v) for v in comparison.losses.values())
assert dead_fp32 == 0 and dead_fp8 > 0  # the real torchao run silently stops those weights learning
assert caught and caught[0].severity == "warning" and q_proj in caught[0].evidence["layers"]
assert kinds[q_proj] == "Linear" and kinds["model.layers.0.self_attn.q_proj"] == "Float8Linear"
assert dead_fixed == 0 and math.isfinite(step_loss) and changed
assert converted == len(comparison.layers) - len(recommendation.keep)
attention = [r.module for r in comparison.rows if r.kind == "attention" and r.precision == "fp8"]
assert attention == [f"model.layers.{i}.self_attn [{m}]" for i in range(2) for m in ("q·kᵀ", "p·v")]
assert not set(attention) & set(recommendation.keep)  # attention rows are measured, never kept nor converted
assert plan.within_budget and plan.loss_gap <= budget
assert {n for n, k in planned_kinds.items() if k == "Float8Linear"} == set(plan.converted)
assert set(plan.kept) == {n for n, k in planned_kinds.items() if k == "Linear"}
assert set(recommendation.keep) <= set(plan.kept)  # the plan never converts a layer the warning says to keep
assert real_gap <= budget
print("all claims hold")
