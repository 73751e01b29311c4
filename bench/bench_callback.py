"""What ``MPDoctorCallback`` costs a training step when nothing is wrong.

Model: a 2-layer Llama, hidden 256, fp32 on the CPU, batch 2 sequences of 64
tokens with labels, AdamW. One step = zero_grad, forward, backward, optimizer step.

Two figures:

- the callback's own per-step work, timed alone over many steps: its forward
  hook (keeps references to the inputs and the loss tensor) on a module that
  only returns a loss, minus the same module's call without the hook, plus
  ``on_pre_optimizer_step`` (reads the step's losses with one transfer),
  ``on_step_end`` and ``on_log``; as a ratio to one step of the model (best of N each);
- the same step with and without the callback on two identical copies of the
  model, interleaved, best of N (the difference is within the noise: info only).

``--quick``: fewer rounds (seconds; only checks the script works). Prints a table
and ``RESULT {json}`` lines.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args_ns = parser.parse_args()
    from bench_probe import build
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from mpdoctor.libraries.transformers.callback import MPDoctorCallback

    torch.set_num_threads(1)  # the machine is shared: one thread keeps OpenMP barriers out of the noise
    rounds = 3 if args_ns.quick else 15
    calls = 200 if args_ns.quick else 2000
    model, batch = build(layers=2, seq=64, batch=2)
    watched = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt_watched = torch.optim.AdamW(watched.parameters(), lr=1e-4)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, report_to=[], use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    callback = MPDoctorCallback()
    callback.on_train_begin(args, state, control, model=watched, optimizer=opt_watched)  # diagnoses once, then hooks
    assert callback.start_report.ok, callback.start_report.to_text()
    logs = {"loss": 1.0, "grad_norm": 1.0, "learning_rate": 1e-4}

    def step(m, o) -> torch.Tensor:
        o.zero_grad(set_to_none=True)
        out = m(**batch)
        out.loss.backward()
        return out

    def plain() -> None:
        step(model, opt)
        opt.step()

    def with_callback() -> None:
        step(watched, opt_watched)
        callback.on_pre_optimizer_step(args, state, control, model=watched, optimizer=opt_watched)
        opt_watched.step()
        state.global_step += 1
        callback.on_step_end(args, state, control, model=watched, optimizer=opt_watched)
        callback.on_log(args, state, control, logs=logs, model=watched, optimizer=opt_watched)

    class LossHead(torch.nn.Module):
        """A model reduced to what the callback sees of one: a forward returning a loss."""

        def forward(self, x: torch.Tensor) -> dict:
            return {"loss": x}

    hooked, bare = LossHead().train(), LossHead().train()
    timing = MPDoctorCallback()
    timing.on_train_begin(args, state, control, model=hooked, optimizer=None)  # its forward hook, as on the model
    loss = torch.tensor(2.5)

    def callback_only() -> None:
        # The callback's forward hook as the model calls it, then its per-step events, ``calls`` times.
        for _ in range(calls):
            hooked(loss)
            timing.on_pre_optimizer_step(args, state, control, model=hooked, optimizer=opt_watched)
            timing.on_step_end(args, state, control, model=hooked, optimizer=opt_watched)
            timing.on_log(args, state, control, logs=logs, model=hooked, optimizer=opt_watched)

    def bare_calls() -> None:
        for _ in range(calls):
            bare(loss)

    fns = {"plain": plain, "with": with_callback, "callback": callback_only, "bare": bare_calls}
    for fn in fns.values():
        fn()  # warm-up
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - start)
    callback.on_train_end(args, state, control)
    timing.on_train_end(args, state, control)
    for cb in (callback, timing):
        assert cb.events == [] and cb.probe_report is None  # nothing was wrong, nothing fired
    per_step_us = max(0.0, best["callback"] - best["bare"]) / calls * 1e6
    step_us = best["plain"] * 1e6
    ratio = per_step_us / step_us
    e2e = best["with"] / best["plain"]
    print(f"2-layer Llama (hidden 256), batch 2x64, AdamW, fp32 CPU, 1 thread, best of {rounds}")
    print(f"  one training step                               {step_us / 1e3:8.2f} ms")
    print(f"  the same step with MPDoctorCallback             {best['with'] * 1e3:8.2f} ms  ({e2e:.3f}x, noise included)")
    print(f"  the callback's own work per step                {per_step_us:8.1f} us  ({ratio:.5f} of a step)")
    rows = [
        {"figure": "MPDoctorCallback per-step cost when nothing is wrong vs one step (2-layer Llama h256, 2x64, AdamW)",
         "mpdoctor": round(per_step_us, 1), "baseline": round(step_us, 1), "ratio": round(ratio, 5),
         "target": "near zero (<= 0.01)", "met": ratio <= 0.01, "unit": "us per step (best)"},
        {"figure": "training step with MPDoctorCallback vs without (same model, interleaved)",
         "mpdoctor": round(best["with"] * 1e3, 2), "baseline": round(best["plain"] * 1e3, 2), "ratio": round(e2e, 3),
         "target": "info (within noise)", "met": None, "unit": "ms per step (best)"},
    ]  # fmt: skip
    for r in rows:
        print("RESULT " + json.dumps(r))


if __name__ == "__main__":
    main()
