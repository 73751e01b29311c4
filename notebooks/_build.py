"""Write the teaching notebooks from this one file: ``python notebooks/_build.py``.

The notebooks are authored here so that they stay consistent (same badges,
install cell, number-format table) and diff-friendly: cells get stable ids and
the .ipynb files are written without outputs or execution counts.
``tests/test_notebooks.py`` checks that the committed notebooks match this
script and executes every one of them.

Cell metadata used by the tests:

- ``tags: ["raises-exception"]``: the cell is meant to fail (nbclient and
  nbmake carry on); the test also checks that it really failed,
- ``mpdoctor.expect``: a substring of the error the cell must raise (the real
  library error the lesson is about).

Notebook metadata ``mpdoctor.requires`` lists the check slugs (and modules)
a lesson needs; the test skips a notebook whose checks are not registered yet,
and says which.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
REPO = "mpdoctor/mpdoctor"
INSTALL_SPEC = "mpdoctor[hf] @ git+https://github.com/mpdoctor/mpdoctor"


# -- shared cells --------------------------------------------------------------------------


def badges(name: str) -> str:
    """The Colab badge and the Binder link of one notebook."""
    colab = f"https://colab.research.google.com/github/{REPO}/blob/main/notebooks/{name}.ipynb"
    binder = f"https://mybinder.org/v2/gh/{REPO}/main?labpath=notebooks%2F{name}.ipynb"
    return (
        f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({colab}) "
        f"[![Binder](https://mybinder.org/badge_logo.svg)]({binder})"
    )


def install_cell(extra: tuple[tuple[str, str], ...] = ()) -> str:
    """A code cell that installs mpdoctor (and ``extra`` (module, pip name) pairs) only where missing."""
    lines = [
        "# Installs only what is missing: on Colab this fetches mpdoctor from GitHub;",
        "# on Binder, in CI or after `pip install -e .` everything is importable and nothing runs.",
        "try:",
        "    import mpdoctor",
        "except ImportError:",
        f'    %pip install -q "{INSTALL_SPEC}"',
        "    import mpdoctor",
    ]
    for module, package in extra:
        lines += [
            "try:",
            f"    import {module}",
            "except ImportError:",
            f"    %pip install -q {package}",
            f"    import {module}",
        ]
    lines += ["", "%load_ext mpdoctor", 'print("mpdoctor", mpdoctor.__version__)']
    return "\n".join(lines)


INSTALL_MD = (
    "**Setup.** The next cell installs mpdoctor only if it is missing: on Colab, the `%pip install` line "
    "fetches it from GitHub (it is not on PyPI yet); on Binder and in CI it is already installed and the "
    "line is skipped. Then `%load_ext mpdoctor` registers the `%mpdoctor` magic. Everything runs on the "
    "CPU in well under a minute, with tiny models built from configs (nothing is downloaded): on Colab the "
    "default CPU runtime is the one this lesson is written for."
)

FORMATS_CODE = '''import math

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


number_formats()'''


def formats_md(focus: str) -> str:
    """The number-format introduction, with one paragraph on what matters in this lesson."""
    return (
        "## The number formats\n\n"
        "Every float is a sign, an exponent (its **range**: how large and how small a number can get) and a "
        "mantissa (its **precision**: how many significant digits survive). The table is computed by "
        "`torch.finfo` on this machine:\n\n"
        "- **fp32**: 8 exponent bits, 23 mantissa bits. The reference.\n"
        "- **fp16**: 5 exponent bits, 10 mantissa bits: fine precision, but a tiny range "
        "(max 65504; gradients below about 6e-8 become 0).\n"
        "- **bf16**: fp32's 8 exponent bits (same range, max about 3.4e38), only 7 mantissa bits: "
        "coarse precision (about 2-3 decimal digits).\n\n" + focus
    )


def md(text: str) -> nbformat.NotebookNode:
    return new_markdown_cell(text.strip("\n"))


def code(text: str, raises: str | None = None) -> nbformat.NotebookNode:
    """A code cell; ``raises`` marks it as meant to fail with an error containing that text."""
    cell = new_code_cell(text.strip("\n"))
    if raises is not None:
        cell.metadata["tags"] = ["raises-exception"]
        cell.metadata["mpdoctor"] = {"expect": raises}
    return cell


def notebook(name: str, title: str, intro: str, cells: list, requires: list[str]) -> nbformat.NotebookNode:
    """Assemble one notebook: title with badges, setup, then ``cells``; stable ids, no outputs."""
    head = [
        md(f"# {title}\n\n{badges(name)}\n\n{intro}"),
        md(INSTALL_MD),
    ]
    nb = new_notebook()
    nb.cells = head + cells
    nb.cells.insert(2, code(install_cell(_EXTRAS.get(name, ()))))
    for i, cell in enumerate(nb.cells):
        cell.id = f"{name[:2]}-{i:02d}"
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
        "mpdoctor": {"requires": requires},
    }
    return nb


_EXTRAS = {
    "01_bf16_optimizer": (("adamw_bf16", "adamw-bf16"),),
    "03_scaler_with_bf16": (("adamw_bf16", "adamw-bf16"),),
    "05_mixed_param_dtypes": (("adamw_bf16", "adamw-bf16"),),
}

TINY_LLAMA = """from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,{extra}
)
ids = torch.randint(0, config.vocab_size, (4, 32))
batch = {{"input_ids": ids, "labels": ids}}"""


def tiny_llama(extra: str = "") -> str:
    return TINY_LLAMA.format(extra=extra)


# -- 00: the tour --------------------------------------------------------------------------


def tour() -> nbformat.NotebookNode:
    name = "00_tour"
    cells = [
        md(
            formats_md(
                "Two rules follow, and this tour breaks both: **fp16 needs loss scaling** (a `GradScaler`) "
                "because of its tiny range, and the scaler expects **fp32 master weights** with fp16 only "
                "in the compute (autocast), not fp16 weights."
            )
        ),
        code(FORMATS_CODE),
        md(
            """
## A setup with several problems at once

A tiny Llama (built from a config: nothing is downloaded), made "lighter" with `.half()`, an AMP
training loop copied from a tutorial (fp16 autocast and a `GradScaler`), and the config's default
`use_cache=True`. Nothing complains while you build it.
"""
        ),
        code(
            tiny_llama()
            + """
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


print("parameters:", {str(p.dtype) for p in model.parameters()}, "| use_cache:", model.config.use_cache)"""
        ),
        md("The first training step fails, with the error people meet in the wild (transformers #23165, peft #341):"),
        code("out = train_step()", raises="Attempting to unscale FP16 gradients."),
        md(
            """
## Diagnose

`%mpdoctor` with no argument inspects every model, optimizer, scaler, Trainer and Accelerator in the
notebook's namespace, shows the report and returns it (like `%timeit -o`), so you can keep it in a variable.
"""
        ),
        code("report = %mpdoctor"),
        md(
            """
## Reading the report

Each finding has a **severity** (`error`: will crash or silently train wrong; `warning`: wasted or risky;
`info`), a **check** slug (stable: you can ignore it with `--ignore` or look it up in the checks reference),
the **subject** it is about, a plain **message**, the **evidence** it rests on, and zero or more
**fixes**. A fix is **safe** when it keeps the meaning of the run you intended (turning off a cache nobody
reads) and **unsafe** when it changes numerics or memory (casting weights): unsafe fixes are never applied
behind your back. Each fix also knows the line of code that does the same thing, for your script.
"""
        ),
        code(
            """for finding in report.findings:
    print(f"{finding.severity.upper():8} {finding.check}  ({finding.subject})")
    print("         ", finding.message)
    for fix in finding.fixes:
        print(f"          fix ({'safe' if fix.safe else 'unsafe'}): {fix.title}")
    print()"""
        ),
        md("The dtype histogram behind the findings (one row per object, tensor kind and dtype) is a DataFrame:"),
        code("report.histogram"),
        md(
            """
## Fix

`report.apply_safe_fixes()` applies every safe fix, in place, on the live objects, and returns what it did
(the widget's **Apply all safe fixes** button runs the same call):
"""
        ),
        code(
            """applied = report.apply_safe_fixes()
print(applied)
print("use_cache now:", model.config.use_cache)"""
        ),
        md(
            """
The cast to fp32 is unsafe (it doubles the weights' memory and changes the dtype layers compute in), so it
waits for you. Read what it will do, then apply it explicitly: `fix.apply()` is exactly what the widget's
button runs. It casts in place, keeping the same `Parameter` objects, so the optimizer still holds them.
"""
        ),
        code(
            """cast = report.findings_for("fp16-trainable-params-with-scaler")[0].fixes[0]
print(cast.code)
print(cast.preview())
held_before = [id(p) for p in optimizer.param_groups[0]["params"]]
cast.apply()
print("parameters:", {str(p.dtype) for p in model.parameters()})"""
        ),
        md(
            """
Every fix can be undone exactly (`fix.undo()`), and applying it twice changes nothing. Now the clean re-run:
`%mpdoctor` again, and the very same `train_step()` that failed above.
"""
        ),
        code("after = %mpdoctor"),
        code(
            """out = train_step()
print(f"loss {out.loss.item():.4f} | cache returned: {out.past_key_values is not None}"
      f" | grads: {sorted({str(p.grad.dtype) for p in model.parameters()})}")"""
        ),
        md(
            """
This is the classic AMP recipe: fp32 master weights, fp16 compute under autocast, and a `GradScaler` that
keeps small fp16 gradients from flushing to zero.

## Export

For a bug report, a notebook of results or a dashboard: pandas, a dict (JSON) or markdown.
"""
        ),
        code("frame = report.to_frame()\nframe"),
        code(
            """markdown = report.to_markdown()
print(markdown)"""
        ),
        md(
            """
## What if: Colab's free T4

`--target` evaluates the same live objects against another device's capabilities, without owning it.
A T4 (compute capability 7.5) has fp16 tensor cores but no native bf16: the recipe we ended with is the
one it runs well. (Notebook 02 shows what `--target` says about bf16 on such a GPU.)
"""
        ),
        code("t4 = %mpdoctor --target T4"),
        md(
            """
## The lesson's claims, checked

This cell makes the notebook fail in CI the day mpdoctor, PyTorch or transformers stops behaving as this
tour says.
"""
        ),
        code(
            """assert report.findings_for("fp16-trainable-params-with-scaler"), "the fp16 weights were not diagnosed"
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
print("all claims hold")"""
        ),
    ]
    return notebook(
        name,
        "A tour of mpdoctor",
        "mpdoctor looks at the live PyTorch and Hugging Face objects in your notebook (model, optimizer, "
        "scaler, Trainer, Accelerator), finds mixed-precision faults before they crash or silently ruin a "
        "run, and fixes them in place. This tour runs on a laptop CPU in well under a minute: diagnose a "
        "setup with several problems, read the report, fix it, re-run clean, export, and ask what a GPU "
        "you do not have would say.",
        cells,
        requires=["fp16-trainable-params-with-scaler", "cache-in-training"],
    )


# -- 01: a bf16-only optimizer fed fp32 ------------------------------------------------------


def bf16_optimizer() -> nbformat.NotebookNode:
    name = "01_bf16_optimizer"
    cells = [
        md(
            formats_md(
                "**What matters here: bf16's precision.** With 7 mantissa bits, the step after 1.0 is "
                "2^-7 = 0.0078; an update of 0.001 to a weight of 1.0 rounds away entirely. Optimizers "
                "that keep bf16 weights compensate: `AdamWBF16` (PyPI `adamw-bf16`, vendored by SimpleTuner) "
                "keeps a bf16 correction term per weight and adds back what rounding lost (Kahan summation). "
                "That bookkeeping is built for bf16 weights, and it asserts so."
            )
        ),
        code(FORMATS_CODE),
        code(
            """w = torch.tensor(1.0, dtype=torch.bfloat16)
print("bf16: 1.0 + 0.001 =", (w + 1e-3).item(), "| fp32: 1.0 + 0.001 =", (w.float() + 1e-3).item())

import inspect

import adamw_bf16

print([line.strip() for line in inspect.getsource(adamw_bf16.AdamWBF16).splitlines() if "assert" in line])"""
        ),
        md(
            """
## The broken setup (SimpleTuner #755)

LoRA on a bf16 model. PEFT keeps adapter weights in **fp32** by default (`autocast_adapter_dtype=True`),
which is right for most optimizers; here the trainable parameters go to `AdamWBF16`.
"""
        ),
        code(
            tiny_llama("\n    use_cache=False,")
            + """

from adamw_bf16 import AdamWBF16
from peft import LoraConfig, get_peft_model

lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
model = get_peft_model(LlamaForCausalLM(config).to(torch.bfloat16), lora)  # a bf16 base, as most checkpoints
trainable = [p for p in model.parameters() if p.requires_grad]
optimizer = AdamWBF16(trainable, lr=1e-2)
print("frozen base:", {str(p.dtype) for p in model.parameters() if not p.requires_grad},
      "| trainable adapters:", {str(p.dtype) for p in trainable})"""
        ),
        md("The forward and backward run fine; the optimizer's first `step()` does not:"),
        code(
            """optimizer.zero_grad()
loss = model(**batch).loss
loss.backward()
optimizer.step()""",
            raises="only bfloat 16 is supported.",
        ),
        md(
            """
## Diagnose

mpdoctor knows which optimizers have dtype requirements and compares them with the parameters (and
gradients) each optimizer holds: it finds this before the first step, not after an hour of data loading.
"""
        ),
        code("report = %mpdoctor model optimizer"),
        code(
            """finding = report.findings_for("optimizer-dtype-requirement")[0]
print(finding.severity, "|", finding.subject)
print(finding.message)
print(finding.evidence)
fix = finding.fixes[0]
print(f"\\nfix ({'safe' if fix.safe else 'unsafe'}): {fix.title}\\n{fix.code}")"""
        ),
        md(
            """
## Fix

The fix casts the adapters (and their gradients and optimizer state) to bf16 **in place**, keeping the
same `Parameter` objects, so the optimizer's references stay valid. It is **unsafe**: it narrows a dtype,
so it is applied only when you ask (`fix.apply()`, the same call the widget's button makes). At creation
time, `get_peft_model(..., autocast_adapter_dtype=False)` keeps the adapters in the base model's dtype.
"""
        ),
        code(
            """held_before = [id(p) for p in optimizer.param_groups[0]["params"]]
fix.apply()
print("trainable adapters:", {str(p.dtype) for p in trainable})"""
        ),
        md("A few training steps now work; the adapters' `lora_B` starts at zero, so any change shows the optimizer updating bf16 weights:"),
        code(
            """lora_B = next(p for n, p in model.named_parameters() if "lora_B" in n)
before = lora_B.detach().clone()
losses = []
for _ in range(3):
    optimizer.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print("losses:", [round(x, 4) for x in losses], "| lora_B changed:", not torch.equal(before, lora_B.detach()))"""
        ),
        md(
            """
The creation-time alternative, for comparison: bf16 adapters from the start, and mpdoctor has nothing
to say about them with `AdamWBF16` (a healthy recipe must not raise false alarms).
"""
        ),
        code(
            """clean_model = get_peft_model(LlamaForCausalLM(config).to(torch.bfloat16), lora, autocast_adapter_dtype=False)
clean_optimizer = AdamWBF16([p for p in clean_model.parameters() if p.requires_grad], lr=1e-2)
clean = %mpdoctor clean_model clean_optimizer"""
        ),
        md("## The lesson's claims, checked"),
        code(
            """assert finding.severity == "error" and finding.subject == "optimizer" and not fix.safe
assert not report.refresh().findings_for("optimizer-dtype-requirement")
assert all(p.dtype == torch.bfloat16 for p in trainable)
assert [id(p) for p in optimizer.param_groups[0]["params"]] == held_before  # the same Parameter objects
assert all(math.isfinite(x) for x in losses) and not torch.equal(before, lora_B.detach())
assert not clean.findings_for("optimizer-dtype-requirement") and clean.ok, clean.to_text()
print("all claims hold")"""
        ),
    ]
    return notebook(
        name,
        "A bf16-only optimizer fed fp32: `AssertionError: only bfloat 16 is supported.`",
        "Field case 1 (SimpleTuner #755): LoRA training with `AdamWBF16`, adapters left in fp32, and the "
        "optimizer's first step dies with an assertion. Why bf16 optimizers insist on bf16, how mpdoctor "
        "sees it coming, and the in-place fix.",
        cells,
        requires=["optimizer-dtype-requirement"],
    )


# -- 02: the precision in effect is not the precision asked for ------------------------------

PROBE_DTYPE = '''def compute_dtypes(trainer):
    """Run one real training step and record the dtype the first q_proj computes in."""
    seen = []
    layer = trainer.model.get_submodule("model.layers.0.self_attn.q_proj")
    handle = layer.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    try:
        trainer.train()
    finally:
        handle.remove()
    return sorted({str(d).replace("torch.", "") for d in seen})'''


def precision_override() -> nbformat.NotebookNode:
    name = "02_precision_override"
    cells = [
        md(
            formats_md(
                "**What matters here: which format actually runs.** `TrainingArguments(fp16=..., bf16=...)` "
                "is a request; accelerate decides what the forward really computes in (autocast), from the "
                "arguments, the `ACCELERATE_MIXED_PRECISION` environment variable and the device. fp16 compute "
                "over a model trained in bf16 can pass 65504 and turn the loss into NaN (ms-swift #3896, on a V100)."
            )
        ),
        code(FORMATS_CODE),
        code(
            """print("fp16: 70000 ->", torch.tensor(70000.0).half().item(), "| bf16: 70000 ->", torch.tensor(70000.0).bfloat16().item())"""
        ),
        md(
            """
## Part 1: a stale `ACCELERATE_MIXED_PRECISION`

`accelerate launch --mixed_precision ...`, `notebook_launcher(..., mixed_precision=...)`, a platform's setup
cell or a `%env` line from an earlier experiment leave `ACCELERATE_MIXED_PRECISION` in the process
environment. transformers' `TrainingArguments` starts from that variable, and `fp16=False` / `bf16=False`
only mean "I do not ask for it", not "no": the stale value wins. Here the earlier experiment was bf16
(the CPU runs bf16 autocast, so the harm is measurable on this machine; in the field case it was fp16 on
a V100).
"""
        ),
        code("%env ACCELERATE_MIXED_PRECISION=bf16"),
        code(
            tiny_llama("\n    use_cache=False,")
            + """

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


"""
            + PROBE_DTYPE
            + """


trainer = make_trainer(fp16=False, bf16=False)  # "train in fp32, please"
print("asked: fp16=False, bf16=False | args.mixed_precision:", trainer.args.mixed_precision,
      "| accelerator:", trainer.accelerator.mixed_precision)"""
        ),
        md(
            "The measured harm: a forward hook on a real layer, during one real `trainer.train()` step, "
            "records the dtype it computes in."
        ),
        code("stale_dtypes = compute_dtypes(trainer)\nprint(stale_dtypes)"),
        md("## Diagnose"),
        code("report = %mpdoctor trainer"),
        code(
            """finding = report.findings_for("precision-override")[0]
print(finding.severity, "|", finding.subject)
print(finding.message)
fix = finding.fixes[0]
print(f"\\nfix ({'safe' if fix.safe else 'unsafe'}): {fix.title}\\n{fix.code}")"""
        ),
        md(
            """
## Fix

The fix brings the accelerator (its mixed-precision state, `native_amp`, the scaler, the autocast wrapper
of a model it already prepared), `args.mixed_precision` and the environment variable in line with the
arguments, in place, so the next `trainer.train()` computes in what you asked for. It is unsafe (it changes
the numerics of the next step, and accelerate's state is one per process), so it runs when you call
`fix.apply()`, the same call the widget's button makes.
"""
        ),
        code(
            """fix.apply()
print("ACCELERATE_MIXED_PRECISION:", os.environ.get("ACCELERATE_MIXED_PRECISION"),
      "| accelerator:", trainer.accelerator.mixed_precision)
fixed_dtypes = compute_dtypes(trainer)
after_fix = report.refresh()
print("computes in:", fixed_dtypes, "| precision-override findings now:", len(after_fix.findings_for("precision-override")))"""
        ),
        md(
            """
## Part 2: fp16 silently off on a CPU

`fp16=True` on a machine where accelerate does not run fp16 autocast (this CPU) gives an accelerator that
says `fp16` but has `native_amp == False`: the run is plain fp32, and nothing tells you. (accelerate keeps
one `AcceleratorState` per process, so each new Trainer's setting applies to every Accelerator in the
kernel: that is why each fix above is checked with `report.refresh()` right away.)
"""
        ),
        code(
            """cpu_trainer = make_trainer(fp16=True)
silent_dtypes = compute_dtypes(cpu_trainer)
print("accelerator:", cpu_trainer.accelerator.mixed_precision, "| native_amp:", cpu_trainer.accelerator.native_amp,
      "| computes in:", silent_dtypes)"""
        ),
        code("silent = %mpdoctor cpu_trainer"),
        md(
            """
Two fixes are offered, both unsafe because each changes something you chose: run fp16 autocast on the CPU
as the arguments ask (torch can, with a CPU `GradScaler`, though fp16 matmuls are often slower than fp32 on
CPUs), or make the arguments say what runs (fp32; `bf16=True` is the CPU's fast half precision). Here we
take the first and measure again:
"""
        ),
        code(
            """cpu_finding = silent.findings_for("precision-override")[0]
for f in cpu_finding.fixes:
    print(f"- ({'safe' if f.safe else 'unsafe'}) {f.title}")
cpu_finding.fixes[0].apply()
asked_dtypes = compute_dtypes(cpu_trainer)
after_cpu_fix = silent.refresh()
print("accelerator:", cpu_trainer.accelerator.mixed_precision, "| native_amp:", cpu_trainer.accelerator.native_amp,
      "| scaler:", type(cpu_trainer.accelerator.scaler).__name__, "| computes in:", asked_dtypes)"""
        ),
        md(
            """
## Part 3: bf16 on a GPU without bf16 (`--target`)

V100, T4 (Colab's free GPU), P100 and RTX 20xx have compute capability below 8.0 and no native bf16. You
can ask what such a GPU would make of a bf16 setup without owning one. Here on the CPU, bf16 is fine:
"""
        ),
        code(
            """bf16_trainer = make_trainer(bf16=True)
here = %mpdoctor bf16_trainer --text"""
        ),
        code("on_t4 = %mpdoctor bf16_trainer --target T4"),
        md("The same question from Python, for a V100:"),
        code(
            """on_v100 = mpdoctor.diagnose(namespace={"bf16_trainer": bf16_trainer}, target="V100")
for f in on_v100.findings:
    print(f"{f.severity:8} {f.check}: {f.message}")"""
        ),
        md("## The lesson's claims, checked"),
        code(
            """assert stale_dtypes == ["bfloat16"] and finding.severity == "error"  # fp32 asked, bf16 computed
assert not fix.safe and fixed_dtypes == ["float32"] and "ACCELERATE_MIXED_PRECISION" not in os.environ
assert not after_fix.findings_for("precision-override")

assert cpu_trainer.args.fp16 and silent_dtypes == ["float32"]  # fp16 asked, fp32 computed
assert asked_dtypes == ["float16"] and not after_cpu_fix.findings_for("precision-override")

assert not here.findings_for("bf16-unsupported")  # the CPU runs bf16
assert on_t4.findings_for("bf16-unsupported") and on_v100.findings_for("bf16-unsupported")
print("all claims hold")"""
        ),
    ]
    return notebook(
        name,
        "The precision in effect is not the precision asked for",
        "Field case 2 (ms-swift #3896 / PR #3909): `fp16=False` was ignored and training ran in fp16 anyway. "
        "Three ways the precision that runs differs from the one you asked for: a stale "
        "`ACCELERATE_MIXED_PRECISION`, fp16 silently off on a CPU, and bf16 on a GPU that has none "
        "(evaluated with `--target`).",
        cells,
        requires=["precision-override", "bf16-unsupported"],
    )


# -- 03: GradScaler with bf16 ----------------------------------------------------------------

COUNT_OPS = '''import collections

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
    return counter.ops'''


def scaler_with_bf16() -> nbformat.NotebookNode:
    name = "03_scaler_with_bf16"
    cells = [
        md(
            formats_md(
                "**What matters here: range at the small end.** fp16's smallest subnormal is about 6e-8: "
                "smaller gradients flush to zero. A `GradScaler` multiplies the loss (hence every gradient) by "
                "a large factor (65536 to start) so they survive in fp16, then divides it out before the "
                "optimizer step. bf16 has fp32's exponent: its smallest normal number is about 1.2e-38, so "
                "there is nothing to rescue."
            )
        ),
        code(FORMATS_CODE),
        code(
            """g = torch.tensor([1e-8, 1e-6, 1e-4])
print("fp16           ", g.half().tolist())
print("fp16, scaled   ", ((g * 65536).half().float() / 65536).tolist())
print("bf16, unscaled ", g.bfloat16().float().tolist())"""
        ),
        md(
            """
## The broken setup (H2O LLM Studio #628)

A bf16 model, and a training loop that creates `GradScaler()` whenever "mixed precision" is on, whatever
the dtype. The optimizer is `AdamWBF16`, the right one for bf16 weights (notebook 01).
"""
        ),
        code(
            tiny_llama("\n    use_cache=False,")
            + """

from adamw_bf16 import AdamWBF16

model = LlamaForCausalLM(config).to(torch.bfloat16).train()
optimizer = AdamWBF16(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")  # created unconditionally
"""
            + COUNT_OPS
        ),
        md(
            """
## The harm

On CUDA builds whose unscale kernel has no bf16 implementation (pytorch #127176), the first `scaler.step`
crashes: `"_amp_foreach_non_finite_check_and_unscale_cuda" not implemented for 'BFloat16'`. This CPU's
kernel does accept bf16 (mpdoctor probes the real kernel on the live device rather than assuming), so here
the harm is wasted work. Count the operators one step runs with the scaler and without it:
"""
        ),
        code(
            """step(use_scaler=False)  # warm up: the optimizer's first step creates its state
with_scaler, without = ops_of(True), ops_of(False)
extra = {op: n - without.get(op, 0) for op, n in with_scaler.items() if n > without.get(op, 0)}
extra"""
        ),
        md(
            """
`_amp_foreach_non_finite_check_and_unscale_` reads every gradient again, `_local_scalar_dense` is a
`.item()` (on a GPU, a device-to-host synchronisation every step), and the `mul`s scale the loss (and, in
backward, the gradient flowing from it), all to protect bf16 gradients from an underflow they cannot have.

## Diagnose
"""
        ),
        code("report = %mpdoctor model optimizer scaler"),
        code(
            """print("unscale kernel on this device accepts:", report.facts.hardware.unscale_dtypes)
finding = report.findings_for("scaler-with-bf16")[0]
print(finding.severity, "|", finding.message)"""
        ),
        md(
            """
A warning here, because this CPU's kernel runs. What about a GPU? mpdoctor cannot run the kernel of a GPU
it does not have, so a `--target` what-if takes the documented worst case, a crash, and says so as an error:
"""
        ),
        code("on_a100 = %mpdoctor model optimizer scaler --target A100"),
        md(
            """
## Fix

The fix disables the scaler in place (`scaler._enabled = False`: the same object an `Accelerator` and its
optimizer would share). The training loop does not change: a disabled scaler's `scale()` returns the loss
as it is and its `step()` calls `optimizer.step()`. It is safe: bf16 training means the same thing without
loss scaling. `fix.apply()` is the call the widget's button makes.
"""
        ),
        code(
            """fix = finding.fixes[0]
print(f"fix ({'safe' if fix.safe else 'unsafe'}): {fix.title}\\n{fix.code}")
fix.apply()
print("scaler enabled:", scaler.is_enabled())"""
        ),
        code(
            """losses = [step().item() for _ in range(3)]
after_fix = ops_of(True)
print("losses:", [round(x, 4) for x in losses])
print("unscale passes per step now:", after_fix.get("_amp_foreach_non_finite_check_and_unscale_", 0))"""
        ),
        md(
            """
Next time, build it right: `torch.amp.GradScaler("cuda", enabled=(dtype == torch.float16))`, or let
accelerate decide. Since 2023 accelerate and transformers create no scaler for bf16:
"""
        ),
        code(
            """from accelerate import Accelerator

accelerate_scaler = Accelerator(mixed_precision="bf16", cpu=True).scaler
print("Accelerator(mixed_precision='bf16').scaler:", accelerate_scaler)"""
        ),
        md("## The lesson's claims, checked"),
        code(
            """assert g.half()[0].item() == 0.0 and g.bfloat16()[0].item() > 0  # fp16 flushes 1e-8, bf16 keeps it
assert extra.get("_amp_foreach_non_finite_check_and_unscale_") == 1 and extra.get("_local_scalar_dense", 0) >= 1
assert "bfloat16" in report.facts.hardware.unscale_dtypes and finding.severity == "warning"
assert on_a100.findings_for("scaler-with-bf16")[0].severity == "error"
assert fix.safe and not scaler.is_enabled()
assert not report.refresh().findings_for("scaler-with-bf16")
assert all(math.isfinite(x) for x in losses) and "_amp_foreach_non_finite_check_and_unscale_" not in after_fix
assert accelerate_scaler is None
print("all claims hold")"""
        ),
    ]
    return notebook(
        name,
        "A GradScaler with bf16",
        "Field case 3 (H2O LLM Studio #628 / PR #673): a `GradScaler` created for a bf16 model. On some CUDA "
        "builds the first `scaler.step` crashes; everywhere else it is work for nothing. Why bf16 needs no "
        "loss scaling, the measured cost on this CPU, a what-if for a GPU, and the in-place fix.",
        cells,
        requires=["scaler-with-bf16"],
    )


# -- 04: the KV cache in training (Gemma 3's nested flag) ------------------------------------

GEMMA = """from transformers import Gemma3Config, Gemma3ForConditionalGeneration

torch.manual_seed(0)
config = Gemma3Config(
    text_config=dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    ),
    vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    ),
    mm_tokens_per_image=4,
)
model = Gemma3ForConditionalGeneration(config).train()


def make_batch(length, size=4):
    ids = torch.randint(0, 128, (size, length))
    return {"input_ids": ids, "labels": ids}


def cache_bytes(cache):
    \"\"\"Bytes held by the keys and values of a returned cache (0 for no cache).\"\"\"
    if cache is None:
        return 0
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


print("model.config has use_cache:", hasattr(model.config, "use_cache"),
      "| model.config.text_config.use_cache:", model.config.text_config.use_cache)"""


def cache_in_training() -> nbformat.NotebookNode:
    name = "04_cache_in_training"
    cells = [
        md(
            formats_md(
                "**What matters here: bytes.** fp32 takes 4 bytes per number, bf16 and fp16 take 2. A KV "
                "cache holds 2 (keys and values) x layers x batch x KV heads x tokens x head_dim numbers, "
                "at 2 or 4 bytes each depending on the dtype they come out in. And accelerate's mixed-precision wrapper converts a model's "
                "outputs back to fp32 (4 bytes) by calling `.float()` on anything that has a `.dtype`."
            )
        ),
        code(FORMATS_CODE),
        md(
            """
## The broken setup (LLaMA-Factory #7373, transformers #36814)

`Gemma3ForConditionalGeneration` (tiny, from a config) prepared by accelerate for bf16 mixed precision.
Its only cache flag is nested: `config.text_config.use_cache`, `True` by default. The usual advice,
`model.config.use_cache = False`, sets a flag nothing reads.
"""
        ),
        code(
            GEMMA
            + """

from accelerate import Accelerator

accelerator = Accelerator(mixed_precision="bf16", cpu=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
print("forward wrapped by accelerate (autocast + fp32 outputs):", hasattr(model, "_original_forward"))"""
        ),
        md("## The measured harm: a cache nobody reads, returned by every training forward"),
        code(
            """sizes = {}
for length in (16, 64):
    out = model(**make_batch(length))
    sizes[length] = cache_bytes(out.past_key_values)
    print(f"{length:3} tokens: {type(out.past_key_values).__name__} of {sizes[length]:,} bytes"
          f" | keys dtype {out.past_key_values.layers[0].keys.dtype} | logits dtype {out.logits.dtype}")

t = config.text_config
bytes_per_number = out.past_key_values.layers[0].keys.element_size()
formula = 2 * t.num_hidden_layers * 4 * t.num_key_value_heads * 64 * t.head_dim * bytes_per_number
print(f"2 x {t.num_hidden_layers} layers x batch 4 x {t.num_key_value_heads} KV heads x 64 tokens"
      f" x head_dim {t.head_dim} x {bytes_per_number} bytes = {formula:,} bytes")"""
        ),
        md(
            """
The cache grows linearly with the tokens in the batch and matches the formula exactly. Note the dtype: under
bf16 autocast the keys and values come out in fp32 here, 4 bytes each. With Gemma 3 1B's published
dimensions (26 layers, 1 KV head, head_dim 256), a batch of 8 sequences of 512 tokens returns
`2 * 26 * 8 * 1 * 512 * 256` numbers = 54.5 million per forward (104 MiB in bf16, 208 MiB in fp32), kept
alive until the output is dropped.

The usual advice does not help:
"""
        ),
        code(
            """model.config.use_cache = False  # what many users tried first
out = model(**make_batch(16))
print("still returned:", type(out.past_key_values).__name__)"""
        ),
        md(
            """
### Why it crashed before transformers 4.51

The Gemma 3 cache class of the time (`HybridCache`) carried a `.dtype` attribute. accelerate's output
conversion treats anything with a `.dtype` as a tensor and calls `.float()` on it. Here is the real
conversion function applied to an object that, like `HybridCache` then, has a `.dtype` (today's
`DynamicCache` has none, which is why the forward above survives):
"""
        ),
        code(
            """from accelerate.utils.operations import convert_to_fp32


class CacheWithDtype:  # stands in for transformers 4.50's HybridCache
    dtype = torch.bfloat16


convert_to_fp32({"logits": torch.ones(1, dtype=torch.bfloat16), "past_key_values": CacheWithDtype()})""",
            raises="object has no attribute 'float'",
        ),
        md("## Diagnose"),
        code("report = %mpdoctor model"),
        code(
            """finding = report.findings_for("cache-in-training")[0]
print(finding.severity, "|", finding.subject)
print(finding.message)
print(finding.evidence)"""
        ),
        md(
            """
## Fix

The fix sets `use_cache=False` on the config, every sub-config that has the flag, and the generation
config, in place. It is safe for this model type: the cache is only used for generation. (For recurrent or
hybrid model types, where the uncached path computes differently, mpdoctor offers no automatic fix.) It is
the call the widget's button makes:
"""
        ),
        code(
            """fix = finding.fixes[0]
print(f"fix ({'safe' if fix.safe else 'unsafe'}): {fix.title}\\n{fix.code}")
fix.apply()
print("text_config.use_cache:", model.config.text_config.use_cache)"""
        ),
        code(
            """losses = []
for _ in range(3):
    optimizer.zero_grad()
    out = model(**make_batch(64))
    accelerator.backward(out.loss)
    optimizer.step()
    losses.append(out.loss.item())
print("losses:", [round(x, 4) for x in losses], "| cache returned:", cache_bytes(out.past_key_values), "bytes")"""
        ),
        md(
            """
When you generate later, turn it back on for generation only (`model.generate(..., use_cache=True)`), or
`fix.undo()` restores every flag exactly.

## The lesson's claims, checked
"""
        ),
        code(
            """assert sizes[64] == 4 * sizes[16] == formula and sizes[16] > 0  # linear in tokens, as the formula says
assert bytes_per_number == 4  # the cached keys are fp32 under bf16 autocast, as the text says
assert finding.subject == "model.config.text_config.use_cache"  # the nested flag is the one that counts
assert fix.safe and model.config.text_config.use_cache is False
assert not report.refresh().findings_for("cache-in-training")
assert out.past_key_values is None and all(math.isfinite(x) for x in losses)
print("all claims hold")"""
        ),
    ]
    return notebook(
        name,
        "The KV cache in training: Gemma 3's nested `use_cache`",
        "Field case 4 (LLaMA-Factory #7373, transformers #36814): Gemma 3 LoRA training crashed with "
        "`'HybridCache' object has no attribute 'float'`. The root cause outlived the crash: a model in "
        "training mode that builds a KV cache on every forward, behind a flag that setting "
        "`model.config.use_cache = False` does not reach.",
        cells,
        requires=["cache-in-training"],
    )


# -- 05: mixed parameter dtypes in one compute path ------------------------------------------

ADAPTER = '''class BottleneckAdapter(torch.nn.Module):
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
        return h + self.up(torch.nn.functional.gelu(self.down(h)))  # no cast: h is bf16, down is fp32'''


def mixed_param_dtypes() -> nbformat.NotebookNode:
    name = "05_mixed_param_dtypes"
    cells = [
        md(
            formats_md(
                "**What matters here: one dtype per matmul.** Elementwise operations promote mixed inputs "
                "(bf16 + fp32 gives fp32), but matrix multiplications do not: both operands must have the "
                "same dtype. Autocast exists to choose that dtype for you; outside it, a bf16 activation "
                "meeting an fp32 weight is an error."
            )
        ),
        code(FORMATS_CODE),
        code(
            """a = torch.ones(2, 4, dtype=torch.bfloat16)
w = torch.ones(4, 4)  # fp32
print("a + w (bf16 + fp32, elementwise):", (a + w[:2]).dtype)
try:
    torch.nn.functional.linear(a, w, torch.zeros(4))
except RuntimeError as exc:
    print("linear(bf16 input, fp32 weight):", exc)"""
        ),
        md(
            """
## The broken setup (Unsloth #1260, #212)

A bf16 Llama with a hand-written adapter on each MLP, its weights in fp32 (PEFT's default for adapters).
Unsloth hit the same thing inside fused autograd functions, where autocast is off and gradient
checkpointing re-runs the matmul in backward.
"""
        ),
        code(
            tiny_llama("\n    use_cache=False,")
            + """

"""
            + ADAPTER
            + """


model = LlamaForCausalLM(config).to(torch.bfloat16).train()
model.requires_grad_(False)
for layer in model.model.layers:
    layer.mlp = BottleneckAdapter(layer.mlp, config.hidden_size)  # adapters stay fp32 and trainable
adapters = [p for p in model.parameters() if p.requires_grad]
print("base:", {str(p.dtype) for p in model.parameters() if not p.requires_grad},
      "| adapters:", {str(p.dtype) for p in adapters})"""
        ),
        code("loss = model(**batch).loss", raises="mat1 and mat2 must have the same dtype"),
        md(
            """
## Not every mix is a bug

mpdoctor must not cry wolf. Three legitimate mixes:

1. **PEFT's LoRA layers** keep fp32 adapters on a bf16 base and cast the input to the adapter's dtype
   (`x = self._cast_input_dtype(x, lora_A.weight.dtype)`).
2. **Autocast** picks one dtype per operation, so mixed weights are legal inside it.
3. **Norms kept in fp32** on purpose (e.g. by `prepare_model_for_kbit_training`).
"""
        ),
        code(
            """from peft import LoraConfig, get_peft_model

peft_model = get_peft_model(
    LlamaForCausalLM(config).to(torch.bfloat16),
    LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
)
print("PEFT LoRA, fp32 adapters on a bf16 base:", peft_model(**batch).loss.item())
with torch.autocast("cpu", dtype=torch.bfloat16):
    print("our adapter under bf16 autocast:", model(**batch).loss.item())"""
        ),
        md("## Diagnose: the hand-written adapter is flagged, PEFT's LoRA is not"),
        code("report = %mpdoctor model peft_model"),
        md("Diagnosed inside an autocast region, the same model is legal, and mpdoctor says so:"),
        code(
            """with torch.autocast("cpu", dtype=torch.bfloat16):
    under_autocast = %mpdoctor model --text"""
        ),
        code(
            """findings = report.findings_for("mixed-param-dtypes")
for f in findings:
    print(f.severity, "|", f.subject, "|", f.message)
fix = findings[0].fixes[0]
print(f"\\nfix ({'safe' if fix.safe else 'unsafe'}): {fix.title}\\n{fix.code}")"""
        ),
        md(
            """
## Fix

The fix casts the minority parameters of the affected modules (the adapters) to the dtype the module
computes in (bf16), in place, keeping the `Parameter` objects. Unsafe: it narrows a dtype, so it runs only
on request (`fix.apply()`, the widget button's call). The alternatives are to run the forward under
autocast, or to cast inside the adapter as PEFT does.
"""
        ),
        code(
            """fix.apply()
print("adapters:", {str(p.dtype) for p in adapters})"""
        ),
        md("bf16 trainable weights want an optimizer that compensates rounding (notebook 01): `AdamWBF16`."),
        code(
            """from adamw_bf16 import AdamWBF16

optimizer = AdamWBF16(adapters, lr=1e-2)
losses = []
for _ in range(3):
    optimizer.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print("losses:", [round(x, 4) for x in losses])"""
        ),
        md("## The lesson's claims, checked"),
        code(
            """assert [f.subject for f in findings] == ["model"] and findings[0].severity == "error"
assert not under_autocast.findings_for("mixed-param-dtypes")  # autocast makes the mix legal
assert not [f for f in report.findings if f.subject.startswith("peft_model")], "a false alarm on PEFT's LoRA"
assert not fix.safe and all(p.dtype == torch.bfloat16 for p in adapters)
assert not report.refresh().findings_for("mixed-param-dtypes")
assert all(math.isfinite(x) for x in losses)
print("all claims hold")"""
        ),
    ]
    return notebook(
        name,
        "Mixed parameter dtypes in one compute path: `mat1 and mat2 must have the same dtype`",
        "Field case 5 (Unsloth #1260, #212): fp32 adapter weights beside a bf16 base, in a code path that "
        "does not cast. Why a matmul refuses two dtypes, which mixes are legitimate (PEFT's LoRA, autocast, "
        "fp32 norms), and how mpdoctor tells them apart.",
        cells,
        requires=["mixed-param-dtypes"],
    )


# -- 06: the one-batch probe: the first layer that overflows fp16 ----------------------------

TRAIN_STEP = '''def train_step(dtype, scaler=None):
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
    return loss.item()'''


def numerics_probe() -> nbformat.NotebookNode:
    name = "06_numerics_probe"
    cells = [
        md(
            formats_md(
                "**What matters here: fp16's ceiling.** Anything past 65504 becomes inf in fp16, and one inf "
                "in a forward turns the loss into NaN. bf16 shares fp32's ceiling (about 3.4e38). Models "
                "trained in bf16 sometimes carry activations past 65504 in a few layers (T5's feed-forward "
                "output reached 66246 in transformers #5651): fine in bf16, fatal in fp16."
            )
        ),
        code(FORMATS_CODE),
        code(
            """print("fp16: 65504 ->", torch.tensor(65504.0).half().item(), "| 70000 ->", torch.tensor(70000.0).half().item(),
      "| bf16: 70000 ->", torch.tensor(70000.0).bfloat16().item())"""
        ),
        md(
            """
## The broken setup

A tiny Llama with four layers, fp32 weights, trained with the classic fp16 AMP recipe (autocast and a
`GradScaler`). To have a layer with large activations without downloading a checkpoint, we plant one: the
MLP of layer 2 gets larger weights. Every weight stays well inside fp16's range; only the values
computed in flight go past it.
"""
        ),
        code(
            tiny_llama("\n    use_cache=False,").replace("num_hidden_layers=2", "num_hidden_layers=4")
            + """
model = LlamaForCausalLM(config).train()
mlp = model.model.layers[2].mlp
with torch.no_grad():  # plant large activations in one layer
    mlp.gate_proj.weight.mul_(100)
    mlp.up_proj.weight.mul_(100)
    mlp.down_proj.weight.mul_(2000)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
print("largest weight:", max(p.detach().abs().max().item() for p in model.parameters()))


"""
            + TRAIN_STEP
        ),
        md("## The measured harm: NaN losses, skipped steps, a shrinking scale"),
        code(
            """before = [p.detach().clone() for p in model.parameters()]
fp16_losses, scales = [], []
for _ in range(3):
    fp16_losses.append(train_step(torch.float16, scaler))
    scales.append(scaler.get_scale())
unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
print("losses:", fp16_losses, "| scale:", scales, "| weights unchanged:", unchanged)"""
        ),
        md(
            """
The scaler sees inf/NaN gradients, skips every step and halves its scale: the model has stopped learning,
and the loss says NaN without saying where it came from.

## The static checks see nothing wrong

The dtypes are right (fp32 master weights, fp16 autocast, a scaler), and a value scan of every weight
(`--scan`) finds nothing past 65504, because the overflow happens in flight:
"""
        ),
        code("static = %mpdoctor model optimizer scaler --scan --text"),
        md(
            """
## The probe: one forward and one backward with hooks on every module

`%mpdoctor model --probe batch` runs one forward and one backward on the batch, with cheap hooks on every
module, and names the first module whose output goes non-finite or past fp16's range. It leaves nothing
behind: hooks removed, gradients, RNG state and train/eval modes restored, optimizer and scaler untouched.
No autocast is active in this cell, so it computes in fp32 and reports what *would* overflow in fp16:
"""
        ),
        code("probe_fp32 = %mpdoctor model --probe batch"),
        md("The same from Python, under the fp16 autocast the run really uses:"),
        code(
            """probe_fp16 = mpdoctor.probe(model, batch, autocast=torch.float16)
for f in probe_fp16.findings:
    print(f"{f.severity:8} {f.check}: {f.message}")"""
        ),
        md(
            "The per-module table, most endangered first (`fp16_headroom` below 1: past fp16's range; 0: "
            "non-finite). To keep the probe cheap, a module's inputs are measured only where its output went "
            "bad; elsewhere `in_absmax` is empty."
        ),
        code(
            """table = probe_fp32.probe_table
columns = ["module", "class", "output_dtypes", "in_absmax", "out_absmax", "fp16_headroom"]
table.sort_values("fp16_headroom")[columns].head(6)"""
        ),
        md(
            """
## Fix

There is no automatic fix: the choices trade memory and speed. Use bf16 where the hardware has it (its
range is fp32's, and it needs no loss scaling: notebook 03), keep the overflowing module in fp32
(`_keep_in_fp32_modules` in transformers), or train in fp32 on a GPU without bf16 (V100, T4). Here, bf16:
"""
        ),
        code(
            """probe_bf16 = mpdoctor.probe(model, batch, autocast=torch.bfloat16)
bf16_losses = [train_step(torch.bfloat16) for _ in range(3)]
changed = not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
print("probe under bf16:", [f.check for f in probe_bf16.findings])
print("losses:", [round(x, 4) for x in bf16_losses], "| weights changed:", changed)"""
        ),
        md("## The lesson's claims, checked"),
        code(
            """assert all(math.isnan(x) for x in fp16_losses) and scales == [32768.0, 16384.0, 8192.0] and unchanged
assert static.ok, static.to_text()  # dtypes and weights look fine: only values in flight overflow

culprit = "model.model.layers.2.mlp.down_proj"
assert [f.subject for f in probe_fp32.findings_for("probe-overflow")] == [culprit]
nonfinite = probe_fp16.findings_for("probe-nonfinite")
assert [f.subject for f in nonfinite] == [culprit] and "inputs were finite" in nonfinite[0].message
assert float(table.set_index("module").loc[culprit, "fp16_headroom"]) < 1

assert not probe_bf16.findings_for("probe-nonfinite")
assert all(math.isfinite(x) for x in bf16_losses) and changed
assert all(p.grad is None for p in model.parameters())  # the probes left no gradients behind
print("all claims hold")"""
        ),
    ]
    return notebook(
        name,
        "The one-batch probe: which layer overflows fp16?",
        "A NaN loss says nothing about where it started. The static checks look at dtypes and flags; this "
        "lesson uses mpdoctor's one-batch probe to find the first module whose activations pass fp16's "
        "65504, and fixes the run by moving to bf16.",
        cells,
        requires=["probe-nonfinite", "probe-overflow", "module:mpdoctor.numerics.probe"],
    )


# -- write -----------------------------------------------------------------------------------

BUILDERS = {
    "00_tour": tour,
    "01_bf16_optimizer": bf16_optimizer,
    "02_precision_override": precision_override,
    "03_scaler_with_bf16": scaler_with_bf16,
    "04_cache_in_training": cache_in_training,
    "05_mixed_param_dtypes": mixed_param_dtypes,
    "06_numerics_probe": numerics_probe,
}


def build() -> dict[str, nbformat.NotebookNode]:
    """Every notebook, by file stem."""
    out = {}
    for stem, builder in BUILDERS.items():
        nb = builder()
        nbformat.validate(nb)
        out[stem] = nb
    return out


def render(nb: nbformat.NotebookNode) -> str:
    """The exact text written to disk."""
    return nbformat.writes(nb) + "\n"


def main(argv: list[str]) -> int:
    stems = argv or list(BUILDERS)
    for stem, nb in build().items():
        if stem in stems:
            (HERE / f"{stem}.ipynb").write_text(render(nb), encoding="utf-8")
            print(f"wrote notebooks/{stem}.ipynb ({len(nb.cells)} cells)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
