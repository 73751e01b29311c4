"""Running a corrected AMP loop for real: the namespace it runs in and what "it runs and trains" means.

Shared by ``tests/test_corrected_loops.py`` (every corrected loop mpdoctor shows runs and trains) and
``tests/test_rule_mutations.py`` (a mutated loop fails that same check).
"""

from __future__ import annotations

import re
import textwrap

import torch
import torch.nn.functional as F
from steps import moved, snapshot

from mpdoctor.attach.runtime.protocol import ProtocolObserver

#: The names the user holds the objects by in these loops (not the templates' ``scaler`` / ``optimizer``).
SCALER, OPTIMIZER, SCHEDULER = "amp_scaler", "opt", "sched"


def namespace() -> dict:
    """Fresh objects for one loop: a small MLP, SGD, a CPU GradScaler, a scheduler, 8 batches, ``accum`` 2."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(8)]

    def loss_fn(out: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return F.mse_loss(out.float(), y) if y is not None else out.float().pow(2).mean()

    return {
        "torch": torch, "model": model, "loss_fn": loss_fn, "data": data, "loader": [x for x, _ in data],
        "accum": 2, "max_norm": 1.0, OPTIMIZER: opt, SCALER: torch.amp.GradScaler("cpu", init_scale=1024.0),
        SCHEDULER: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s),
    }  # fmt: skip


def in_a_loop(code: str) -> str:
    """A rule's corrected lines as a whole loop over ``loader``: the forward and the scaled backward they assume are
    put before them (a template that is already a loop runs as it is)."""
    code = textwrap.dedent(code).strip("\n")
    if code.startswith(("for ", "while ")):
        return code + "\n"
    head = []
    if re.search(r"\bloss\b", code) and not re.search(r"^\s*loss\s*=", code, flags=re.M):
        head.append("loss = loss_fn(model(batch)) / accum")
    if ".backward()" not in code:
        head.append(f"{SCALER}.scale(loss_fn(model(batch)) / accum).backward()")
    return "for i, batch in enumerate(loader):\n" + textwrap.indent("\n".join([*head, code]), "    ") + "\n"


def run_and_check(code: str) -> dict:
    """Run ``code`` on fresh objects under the protocol watcher; fail unless it runs, breaks no protocol rule,
    updates the scale and moves the weights to a finite loss. Returns the namespace it ran in."""
    with torch.random.fork_rng(devices=[]):  # seeded objects, and the process's RNG left as it was for other tests
        ns = namespace()
        model = ns["model"]
        before = snapshot(model.parameters())
        with ProtocolObserver(on_finding=lambda finding: None) as watcher:
            exec(compile(code, "<corrected loop>", "exec"), ns)
    assert [f.check for f in watcher.findings] == [], [f.message for f in watcher.findings]
    assert watcher.scale_history, "no scaler.update() after a scaler.step: the scale never moved"
    assert not any(r.skipped for r in watcher.scale_history), "a step was skipped"
    assert moved(before, model.parameters()) > 0, "the weights did not move"
    x, y = ns["data"][0]
    assert torch.isfinite(ns["loss_fn"](model(x), y)), "the loss is not finite"
    return ns


def fails(code: str) -> bool:
    """True when :func:`run_and_check` fails on ``code`` (an error, a protocol finding, no training)."""
    try:
        run_and_check(code)
    except (AssertionError, RuntimeError) as exc:  # GradScaler's own errors are AssertionError / RuntimeError
        return bool(str(exc) or type(exc).__name__)
    return False
