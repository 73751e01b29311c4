"""A notebook_launcher job run as ``__main__`` in a subprocess (tests/distributed/test_launcher.py).

``python launcher_job.py MODE OUT PORT`` where MODE is:

- ``world-of-one``: the launched function creates ``Accelerator()`` without ``cpu=True`` (the pitfall);
- ``cpu``: the launched function creates ``Accelerator(cpu=True)`` (the fix, accelerate's CPU recipe);
- ``early``: an Accelerator is created in the "kernel" before the launch (accelerate refuses), then mpdoctor's
  fix resets accelerate's shared state in place through the API (undone: exactly restored, refused again) and
  through the widget's confirmed button, and the launch is retried.

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


def _shared_dicts() -> list[dict]:
    from accelerate.state import AcceleratorState, PartialState

    return [AcceleratorState._shared_state, PartialState._shared_state]


def _shared_state() -> dict:
    """What accelerate's shared-state dicts hold, by class, as comparable copies."""
    return {name: {k: repr(v) for k, v in d.items()} for name, d in zip(("AcceleratorState", "PartialState"), _shared_dicts())}


def _read(out: str, rank: int) -> dict:
    with open(os.path.join(out, f"rank{rank}.json")) as f:
        return json.load(f)


def _refusal(fn, out: str, port: str) -> str | None:
    """notebook_launcher's refusal message, or None when it started and its workers ran."""
    try:
        notebook_launcher(fn, (out, True), num_processes=2, use_port=port)
    except ValueError as exc:
        return str(exc)
    return None


def _reset_fix(report):
    (fix,) = [f for f in report.fixes if f.slug == "launcher-initialized-early"]
    return fix


def main(mode: str, out: str, port: str) -> None:
    parent: dict = {}
    if mode == "early":
        acc = Accelerator(cpu=True)  # the classic pitfall: a cell creates an Accelerator before the launch
        report = mpdoctor.diagnose(acc, names={id(acc): "accelerator"})
        parent["before"] = _summary(report)
        parent["error"] = _refusal(train, out, port)  # accelerate's own refusal, for real
        shared = _shared_state()
        older = _reset_fix(mpdoctor.diagnose(acc, names={id(acc): "accelerator"}))
        fix = _reset_fix(report)
        parent["fix"] = {"applicability": fix.applicability.value, "in_place_before": fix.in_place}
        fix.apply()  # through the API
        parent["fix"].update(applied=fix.applied, older_in_place=older.in_place, cleared=not any(_shared_state().values()))
        parent["fix"]["refusal_after"] = _refusal(train, out, port)  # a real launch: it starts and trains
        parent["api_ranks"] = {r: _read(out, r) for r in (0, 1)}
        fix.undo()  # undo: the very dicts hold exactly what they held, and the refusal is back
        parent["fix"].update(undo_exact=_shared_state() == shared and acc.state.__dict__ is _shared_dicts()[0],
                             refusal_after_undo=_refusal(train, out, port))  # fmt: skip
        rw = mpdoctor.diagnose(acc, names={id(acc): "accelerator"}).widget()  # then through the widget's button
        rw.confirm_delay = 0.0
        (button,) = rw.buttons("Reset accelerate's state")
        button.click()
        (button,) = rw.buttons("Click again to confirm")  # unsafe: the second click confirms
        button.click()
        parent["widget"] = {"status": rw.status, "cleared": not any(_shared_state().values())}
        del acc
        parent["after"] = _summary(mpdoctor.diagnose())
    notebook_launcher(train, (out, mode != "world-of-one"), num_processes=2, use_port=port)
    with open(os.path.join(out, "parent.json"), "w") as f:
        json.dump(parent, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
