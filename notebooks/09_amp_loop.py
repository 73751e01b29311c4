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
#     - module:mpdoctor.attach.runtime.loop_findings
# ---

# %% [markdown]
# # The AMP loop, step by step
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/mpdoctor/mpdoctor/blob/main/notebooks/09_amp_loop.ipynb) [![Binder](https://mybinder.org/badge_logo.svg)](https://mybinder.org/v2/gh/mpdoctor/mpdoctor/main?labpath=notebooks%2F09_amp_loop.ipynb)
#
# A hand-written fp16 loop talks to a `GradScaler` in a fixed order: `scaler.scale(loss).backward()`, then `scaler.unscale_(optimizer)` at most once per real step (only if you clip or inspect gradients), then clipping, then `scaler.step(optimizer)`, then `scaler.update()` once per real step. Four classic ways to get the order wrong, each run here for real: first the error or the measured harm, then `%mpdoctor` naming the mistake by reading the cells this kernel ran (it reads them, it never runs them), then the right loop, which is the lesson's own loop with the corrected lines.

# %% [markdown]
# **Setup.** The next cell installs mpdoctor only if it is missing: on Colab, the `%pip install` line fetches it from GitHub (it is not on PyPI yet); on Binder and in CI it is already installed and the line is skipped. Then `%load_ext mpdoctor` registers the `%mpdoctor` magic. Everything runs on the CPU in well under a minute: `torch.amp.GradScaler("cpu")` is a real, enabled scaler on the CPU, with the same protocol and the same errors as on a GPU.

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
# ## Why a scaler at all
#
# fp16 has 5 exponent bits: its largest value is 65504 and its smallest subnormal about 6e-8. Gradients are often smaller than that and flush to zero in fp16. A `GradScaler` multiplies the loss, hence every gradient, by a large factor (65536 to start) so they survive, and must divide it out again before anything reads the gradients as gradients: the clip, the optimizer. Every mistake below is a place where the scaled gradients are read as if they were the true ones, or where the scaler's bookkeeping (one `unscale_`, one `step`, one `update` per real step) is broken.

# %%
import math

import torch

fp16 = torch.finfo(torch.float16)
print(f"fp16: max {fp16.max:g}, smallest subnormal {fp16.smallest_normal * fp16.eps:.2g}")
g = torch.tensor([1e-8, 1e-6])
print("gradients in fp16:        ", g.half().tolist())
print("scaled by 65536, in fp16: ", (g * 65536).half().tolist())


# %%
def fresh(seed=0):
    """The same tiny model, optimizer, scaler and data before each lesson."""
    global model, optimizer, scaler, data, before, losses
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")  # on a GPU: torch.amp.GradScaler("cuda"), with fp16 autocast
    data = [(torch.randn(16, 8), 3 * torch.randn(16, 1)) for _ in range(8)]
    before = [p.detach().clone() for p in model.parameters()]
    losses = []


def moved():
    """How far the weights moved since fresh()."""
    return torch.cat([(p.detach() - b).flatten() for b, p in zip(before, model.parameters())]).norm().item()


# %% [markdown]
# ## 1. Clipping the scaled gradients
#
# `clip_grad_norm_` right after the backward reads the gradients still multiplied by 65536: their norm is 65536 times too large, so the 1.0 clip cuts every step to norm 1.0; then `scaler.step` divides that by 65536 again.

# %%
fresh()
for x, y in data:
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    losses.append(loss.item())
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    scaler.step(optimizer)
    scaler.update()
moved_clipping_scaled = moved()

# %% [markdown]
# The same eight steps with the clip on the true gradients (PyTorch's recipe: `scaler.unscale_(optimizer)` first), to measure the harm:

# %%
fresh()
for x, y in data:
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    losses.append(loss.item())
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    scaler.step(optimizer)
    scaler.update()
moved_clipping_right = moved()
print(f"weights moved: {moved_clipping_scaled:.2e} clipping scaled gradients, {moved_clipping_right:.2e} clipping the true ones")

# %% [markdown]
# ## 2. `optimizer.step()` on scaled gradients
#
# Calling the optimizer directly skips the unscaling (and the inf/NaN check): each update is 65536 times too large.

# %%
fresh()
for x, y in data:
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    losses.append(loss.item())
    scaler.scale(loss).backward()
    optimizer.step()
bypass_losses = losses
print("losses:", [f"{x:.3g}" for x in bypass_losses])

# %% [markdown]
# ## 3. `unscale_` on every micro-batch
#
# With gradient accumulation, a real step spans `accum` micro-batches. Unscaling (and clipping) after every micro-batch unscales the same optimizer twice before `update()`, and the scaler refuses:

# %% mpdoctor={"expect": "unscale_() has already been called on this optimizer since the last update()"} tags=["raises-exception"]
fresh()
accum = 4
for i, (x, y) in enumerate(data):
    loss = torch.nn.functional.mse_loss(model(x), y) / accum
    losses.append(loss.item())
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    if (i + 1) % accum == 0:
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

# %% [markdown]
# ## 4. `update()` on every micro-batch
#
# The step sits under the accumulation guard, the `update()` does not: on the first micro-batch without a step, the scaler has no inf check to update from.

# %% mpdoctor={"expect": "No inf checks were recorded prior to update."} tags=["raises-exception"]
fresh()
for i, (x, y) in enumerate(data):
    loss = torch.nn.functional.mse_loss(model(x), y) / accum
    losses.append(loss.item())
    scaler.scale(loss).backward()
    if (i + 1) % accum == 0:
        scaler.step(optimizer)
        optimizer.zero_grad()
    scaler.update()

# %% [markdown]
# ## mpdoctor reads the loop
#
# `%mpdoctor` inspects the live objects and, since this kernel ran the cells above, reads them too (IPython's history, parsed, never executed). Each finding names the cell and line as IPython numbers them (`cell [7], line 6`) and offers, as its fix, the lesson's own loop with the corrected lines. The correct loops of lesson 1 draw nothing. The report also holds what the loop watcher saw as the cells ran and what the crash hook explained; a mistake seen by several of them is one finding. Below, the findings the cell reader placed on a line.

# %%
# report = %mpdoctor --text

# %%
loop = {f.check: f for f in report.findings if f.check.startswith("amp-") and "cell" in f.evidence}
for f in loop.values():
    print(f"{f.severity:7} {f.check:28} {f.subject}: {f.evidence['code']}")

# %% [markdown]
# ## The right loops
#
# Each fix's code is run as it is, on fresh objects:


# %%
def run_fixed(slug):
    """Fresh objects, then the corrected lines mpdoctor shows for ``slug``."""
    fresh()
    code = loop[slug].fixes[0].code
    print(f"# {loop[slug].fixes[0].title}\n{code}")
    exec(code, globals())
    return moved(), list(losses)


fixed_clip = run_fixed("amp-clip-before-unscale")

# %%
fixed_bypass = run_fixed("amp-step-bypasses-scaler")

# %%
fixed_unscale = run_fixed("amp-unscale-twice")

# %%
fixed_update = run_fixed("amp-update-per-microbatch")

# %% [markdown]
# ## The lesson's claims, checked

# %%
ran = get_ipython().user_ns["In"]  # noqa: F821  (the cells this kernel ran, as mpdoctor read them)
assert g.half()[0].item() == 0.0 and (g * 65536).half()[0].item() > 0  # fp16 flushes 1e-8; scaled, it survives
assert moved_clipping_scaled < 1e-3 * moved_clipping_right  # clipping scaled gradients all but stops training
assert not all(map(math.isfinite, bypass_losses)) or max(bypass_losses) > 1e6 * bypass_losses[0]  # the weights blew up
assert set(loop) == {"amp-clip-before-unscale", "amp-step-bypasses-scaler", "amp-unscale-twice", "amp-update-per-microbatch"}
for f in loop.values():  # each finding names the cell that holds its line, and a fix with corrected lines
    cell = int(f.evidence["cell"][len("cell [") : -1])
    assert f.evidence["code"] in ran[cell] and f.subject == f"cell [{cell}], line {f.evidence['line']}"
    assert f.fixes[0].applicability.value == "display-only"
assert all(  # each one raises or ruins the run: GradScaler's own errors, a clip that never bites, a blown-up step
    loop[s].severity == "error"
    for s in ("amp-clip-before-unscale", "amp-step-bypasses-scaler", "amp-unscale-twice", "amp-update-per-microbatch")
)
for moved_after, fixed_losses in (fixed_clip, fixed_bypass, fixed_unscale, fixed_update):
    assert moved_after > 0 and all(map(math.isfinite, fixed_losses))  # every corrected loop trains
assert fixed_clip[0] == moved_clipping_right  # the corrected clip loop is PyTorch's recipe, step for step
assert max(fixed_bypass[1]) < 10 * fixed_bypass[1][0]  # no blow-up
print("all claims hold")
