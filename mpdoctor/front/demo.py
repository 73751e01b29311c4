"""``python -m mpdoctor demo``: diagnose and fix a small broken training setup on the CPU.

The setup is what a notebook user fine-tuning a bf16 model might hold after an
afternoon of edits: a tiny Llama built from a config (no download) in bf16
whose output head was left in fp32, still in training mode with its KV cache
on, a bf16-only optimizer (``AdamWBF16``, when installed) and a GradScaler
copied from an fp16 recipe.
"""

from __future__ import annotations

import sys

import torch


def build_broken_setup() -> dict:
    """Return the namespace of the broken setup: model, optimizer, scaler, batch."""
    from ..compat import quiet_imports

    with quiet_imports():  # transformers imports torchao when it is installed; its build's log lines are not ours
        from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        use_cache=True,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16).train()
    model.lm_head.float()  # the head left in fp32 "for stability"
    try:
        from adamw_bf16 import AdamWBF16

        optimizer = AdamWBF16(model.parameters(), lr=1e-3)
    except ImportError:  # pip users without the test extras get stock AdamW
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"model": model, "optimizer": optimizer, "scaler": scaler, "batch": {"input_ids": ids, "labels": ids}}


def training_step(ns: dict) -> float:
    """One real optimizer step through the scaler; returns the loss."""
    model, optimizer, scaler = ns["model"], ns["optimizer"], ns["scaler"]
    optimizer.zero_grad()
    loss = model(**ns["batch"]).loss
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return float(loss.detach())


#: Why the demo applies each unsafe fix: in a notebook each needs a second click, which the demo makes.
UNSAFE_REASONS = {
    "mixed-param-dtypes": "the run is meant to be bf16; the fp32 head is the leftover that makes the forward raise",
    "optimizer-dtype-requirement": "AdamWBF16 takes only bf16 parameters, so the fp32 head must become bf16",
}

INSTALL_HF = 'the demo builds a tiny Llama with transformers, which is not installed: pip install "mpdoctor[hf]" (from a clone: pip install -e ".[hf]")'


def _why_unsafe(report, fix) -> str:
    """The reason to accept an unsafe fix here: the demo's own, else the first sentence of its finding."""
    if fix.slug in UNSAFE_REASONS:
        return UNSAFE_REASONS[fix.slug]
    finding = next((f for f in report.findings if any(x is fix for x in f.fixes)), None)
    return finding.message.split(": ", 1)[-1].split(". ")[0] if finding is not None else "it clears a finding above"


def _rule(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 76 - len(title)))


def run_demo() -> int:
    """Run the demo; returns the process exit code (0 when the fixed setup trains)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(f"mpdoctor demo: {INSTALL_HF}", file=sys.stderr)
        return 2
    from ..diagnosis import diagnose

    ns = build_broken_setup()
    print(
        "The broken setup: a tiny Llama cast to bf16 with its output head left in fp32, in training mode with its "
        f"KV cache on, the optimizer {type(ns['optimizer']).__name__}, and a GradScaler copied from an fp16 recipe."
    )
    _rule("1. a broken setup: what happens when it trains")
    try:
        loss = training_step(ns)
        print(f"training step ran, loss {loss:.4f}")
    except Exception as exc:  # the point of the demo: show the real failure
        print(f"training step failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")

    _rule("2. %mpdoctor: the diagnosis")
    ns = build_broken_setup()
    report = diagnose(namespace=ns)
    print(report.to_text())

    _rule("3. the fixes, applied in place")
    for fix in report.apply_safe_fixes():
        print(f"applied (safe):   {fix.title}")
    for fix in report.fixes:
        if not fix.applied and not fix.safe:
            # In a notebook an unsafe fix needs an explicit click; the demo clicks.
            fix.apply(confirm=True)
            print(f"applied (unsafe): {fix.title}\n                  why: {_why_unsafe(report, fix)}")
    for fix in report.fixes:
        if fix.error:
            print(f"failed:           {fix.title}: {fix.error}")

    _rule("4. the re-diagnosis")
    after = report.refresh()
    print(after.to_text())

    _rule("5. the same objects, one training step")
    try:
        loss = training_step(ns)
    except Exception as exc:
        print(f"training step failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        loss = float("nan")
    else:
        print(f"training step ran, loss {loss:.4f}")
    healthy = after.ok and bool(torch.isfinite(torch.tensor(loss)))
    print("\nresult:", "fixed" if healthy else "NOT fixed")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(run_demo())
