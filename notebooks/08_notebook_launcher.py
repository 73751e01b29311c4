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
#     - launch-world-of-one
#     - launcher-initialized-early
#     - module:accelerate
# ---

# %% [markdown]
# # Two processes from a notebook: `notebook_launcher` on the CPU
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/mpdoctor/mpdoctor/blob/main/notebooks/08_notebook_launcher.ipynb) [![Binder](https://mybinder.org/badge_logo.svg)](https://mybinder.org/v2/gh/mpdoctor/mpdoctor/main?labpath=notebooks%2F08_notebook_launcher.ipynb)
#
# accelerate's `notebook_launcher` forks N workers from the kernel and runs your training function in each, as one data-parallel job. Two pitfalls, both reproduced here on the CPU with accelerate's real behaviour: an `Accelerator()` without `cpu=True` on a machine without GPUs makes every worker train **alone** (two independent trainings, silently), and an `Accelerator` created in the kernel before the launch makes `notebook_launcher` refuse to start. mpdoctor names both, and the fix.
#
# *On Colab:* with a CPU runtime (or one GPU) `notebook_launcher` does not fork at all, it runs the function once in the kernel ("Launching training on one CPU."); this lesson is written for a Jupyter kernel (Binder, a laptop, CI), where it forks.

# %% [markdown]
# **Setup.** The next cell installs mpdoctor only if it is missing: on Colab, the `%pip install` line fetches it from GitHub (it is not on PyPI yet); on Binder and in CI it is already installed and the line is skipped. Then `%load_ext mpdoctor` registers the `%mpdoctor` magic. Everything runs on the CPU in under a minute, with a tiny model (nothing is downloaded).

# %%
# Installs only what is missing: on Colab this fetches mpdoctor from GitHub;
# on Binder, in CI or after `pip install -e .` everything is importable and nothing runs.
try:
    import mpdoctor
except ImportError:
    # %pip install -q "mpdoctor @ git+https://github.com/mpdoctor/mpdoctor"
    import mpdoctor
try:
    import accelerate
except ImportError:
    # %pip install -q accelerate
    import accelerate

# %load_ext mpdoctor
print("mpdoctor", mpdoctor.__version__, "| accelerate", accelerate.__version__)

# %% [markdown]
# ## The number formats, and why the ranks must agree
#
# Every float is a sign, an exponent (its **range**) and a mantissa (its **precision**), computed here by `torch.finfo`. In data-parallel training each rank computes gradients on its own batch in the chosen format (bf16 here: fp32's range, 8 significant bits) and the ranks **average** them, so that all ranks take the same step and stay one model. A worker that never joins the averaging is not a slower run of the same training: it is a different model.

# %%
import math

import torch

for dtype in (torch.float32, torch.bfloat16, torch.float16):
    fi = torch.finfo(dtype)
    print(f"{str(dtype):15} max {fi.max:9.3g}  eps {fi.eps:8.3g}  significant bits {round(-math.log2(fi.eps)) + 1}")

# %% [markdown]
# ## The training function
#
# Each worker builds the same model (same seed), takes one bf16 step on **its own** batch, diagnoses itself with mpdoctor, and writes what it saw to a file (a forked worker cannot draw in the notebook).

# %%
import contextlib
import io
import json
import os
import socket
import tempfile

from accelerate import Accelerator, notebook_launcher

results = tempfile.mkdtemp(prefix="mpdoctor-launch-")


def train(out, cpu):
    import torch

    import mpdoctor

    accelerator = Accelerator(cpu=True, mixed_precision="bf16") if cpu else Accelerator(mixed_precision="bf16")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    report = mpdoctor.diagnose(model, optimizer, accelerator,
                               names={id(model): "model", id(optimizer): "optimizer", id(accelerator): "accelerator"})
    model, optimizer = accelerator.prepare(model, optimizer)
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(100 + rank)  # each rank its own batch
    loss = model(torch.randn(4, 8)).float().pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    weights = [p.detach().float().flatten().tolist() for p in accelerator.unwrap_model(model).parameters()]
    with open(os.path.join(out, f"{'cpu' if cpu else 'plain'}-rank{rank}.json"), "w") as f:
        json.dump({"type": str(accelerator.distributed_type), "processes": accelerator.num_processes,
                   "slugs": sorted({x.check for x in report.findings}), "report": report.to_text(),
                   "weights": weights}, f)


def launch(cpu):
    with socket.socket() as s:  # a free port for the workers' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        notebook_launcher(train, (results, cpu), num_processes=2, use_port=str(port))
    print(printed.getvalue().strip())
    kind = "cpu" if cpu else "plain"
    return printed.getvalue(), [json.load(open(os.path.join(results, f"{kind}-rank{r}.json"))) for r in (0, 1)]


# %% [markdown]
# ## The pitfall: `Accelerator()` without `cpu=True`
#
# accelerate decides the device from what the machine has; asked for 2 processes on a machine without a GPU, it announces CUDAs, forks, and each worker's `Accelerator` finds no backend: `DistributedType.NO`, one process. `prepare()` then wraps nothing in `DistributedDataParallel`, no gradient is averaged, and nothing warns.

# %%
said, plain = launch(cpu=False)
for r, rank in enumerate(plain):
    print(f"rank {r}: {rank['type']}, num_processes={rank['processes']}")
print("same weights after one step:", plain[0]["weights"] == plain[1]["weights"])

# %% [markdown]
# ## The diagnosis
#
# Inside each worker mpdoctor compared what the launcher promised (`WORLD_SIZE=2`) with what the Accelerator says (one process): `launch-world-of-one`, an error, on both ranks. Rank 0's report:

# %%
print(plain[0]["report"])

# %% [markdown]
# ## The fix: `Accelerator(cpu=True)` inside the function
#
# accelerate's state is created once per process, so the fix is in the code the workers run (mpdoctor shows it; there is nothing to change in place). With `cpu=True` the workers form a gloo group, `prepare()` wraps the model in DDP, the gradients are averaged and the two ranks hold the same model after the step.

# %%
said_cpu, fixed = launch(cpu=True)
for r, rank in enumerate(fixed):
    print(f"rank {r}: {rank['type']}, num_processes={rank['processes']}, findings={rank['slugs']}")
print("same weights after one step:", fixed[0]["weights"] == fixed[1]["weights"])

# %% [markdown]
# ## The second pitfall: an Accelerator created in the kernel
#
# A cell that creates an `Accelerator` (to look at `accelerator.device`, say) fills accelerate's shared state in the kernel; every later `notebook_launcher` call refuses to start. mpdoctor sees it before you launch:

# %%
early = Accelerator(cpu=True)

# %%
# report = %mpdoctor

# %% mpdoctor={"expect": "the `Accelerator` should only be initialized inside your training function"} tags=["raises-exception"]
notebook_launcher(train, (results, True), num_processes=2, use_port="0")

# %% [markdown]
# The usual advice is "restart the kernel". mpdoctor's fix resets accelerate's shared state in place instead. It is unsafe (the `Accelerator` already made in this kernel loses its state), so it asks for a confirmation, and `fix.undo()` would put every entry back. The diagnosis is then clean and the launcher would start.

# %%
finding = report.findings_for("launcher-initialized-early")[0]
fix = finding.fixes[0]
print(fix.code)
fix.apply(confirm=True)
del early
after = mpdoctor.diagnose()
print("after the reset:", [f.check for f in after.findings])

# %% [markdown]
# ## The lesson's claims, checked

# %%
assert "Launching training on 2 CUDAs." in said  # accelerate's own words, on a machine without a GPU
assert [r["type"] for r in plain] == ["DistributedType.NO"] * 2 and [r["processes"] for r in plain] == [1, 1]
assert plain[0]["weights"] != plain[1]["weights"]  # two independent trainings
assert all(r["slugs"] == ["launch-world-of-one"] for r in plain)
assert [r["type"] for r in fixed] == ["DistributedType.MULTI_CPU"] * 2 and fixed[0]["weights"] == fixed[1]["weights"]
assert all(r["slugs"] == [] for r in fixed)  # the healthy recipe draws no finding
assert report.findings_for("launcher-initialized-early")[0].severity == "error"
assert not after.findings_for("launcher-initialized-early")
print("all claims hold")
