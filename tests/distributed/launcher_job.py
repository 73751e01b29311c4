"""A notebook_launcher job run as ``__main__`` in a subprocess (tests/distributed/test_launcher.py).

``python launcher_job.py MODE OUT PORT`` where MODE is:

- ``world-of-one``: the launched function creates ``Accelerator()`` without ``cpu=True`` (the pitfall);
- ``cpu``: the launched function creates ``Accelerator(cpu=True)`` (the fix, accelerate's CPU recipe);
- ``early``: an Accelerator is created in the "kernel" before the launch, then the fix is applied and the
  launch retried.

Each launched rank trains one step on rank-specific data and writes ``OUT/rank{N}.json`` (its diagnosis
and its weights); the parent writes ``OUT/parent.json``. notebook_launcher forks its workers (the start
method it picks on a CPU), so the function needs no pickling.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate import Accelerator, notebook_launcher

import mpdoctor


def _summary(report) -> dict:
    return {
        "slugs": sorted({f.check for f in report.findings}),
        "severities": {f.check: f.severity for f in report.findings},
        "messages": {f.check: f.message for f in report.findings},
        "fix_code": {f.check: [fx.code for fx in f.fixes] for f in report.findings},
    }


def train(out: str, cpu: bool) -> None:
    acc = Accelerator(cpu=cpu, mixed_precision="bf16") if cpu else Accelerator(mixed_precision="bf16")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    report = mpdoctor.diagnose(model, opt, acc, names={id(model): "model", id(opt): "opt", id(acc): "accelerator"})
    model, opt = acc.prepare(model, opt)
    torch.manual_seed(100 + acc.process_index + int(os.environ.get("RANK", "0")))  # each rank its own batch
    loss = model(torch.randn(4, 8)).float().pow(2).mean()
    acc.backward(loss)
    opt.step()
    weights = [p.detach().float().flatten().tolist() for p in acc.unwrap_model(model).parameters()]
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"distributed_type": str(acc.distributed_type), "num_processes": acc.num_processes,
                   "world_size": report.facts.distributed.world_size, "report": _summary(report),
                   "weights": weights, "loss_finite": bool(torch.isfinite(loss))}, f)  # fmt: skip


def main(mode: str, out: str, port: str) -> None:
    parent: dict = {}
    if mode == "early":
        acc = Accelerator(cpu=True)  # the classic pitfall: a cell creates an Accelerator before the launch
        parent["before"] = _summary(mpdoctor.diagnose(acc, names={id(acc): "accelerator"}))
        try:
            notebook_launcher(train, (out, True), num_processes=2, use_port=port)
            parent["error"] = None
        except ValueError as exc:
            parent["error"] = str(exc)
        # The fix mpdoctor displays, run as shown:
        exec(parent["before"]["fix_code"]["launcher-initialized-early"][0], {})
        del acc
        parent["after"] = _summary(mpdoctor.diagnose())
    notebook_launcher(train, (out, mode != "world-of-one"), num_processes=2, use_port=port)
    with open(os.path.join(out, "parent.json"), "w") as f:
        json.dump(parent, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
