"""``mpdoctor.compare`` with five precisions next to one plain fp32 forward + backward of the same model.

Model: a 4-layer Llama, hidden 256, built from a config (no download), fp32 on
the CPU; batch: 4 sequences of 128 tokens with labels (as ``bench_probe.py``).

Timed, interleaved so that the machine's noise hits both alike, best of N:

- plain: ``model(**batch).loss.backward()`` with the grads cleared first;
- compare: ``mpdoctor.compare(model, batch)``: the reference run plus bf16, fp16,
  fp8 (tensorwise), MXFP8 and NVFP4, each a forward and a backward with every
  Linear and each layer's SDPA emulated (both operands of each of their matmuls
  quantized, forward and backward, plus the float32 matmuls their SQNR is
  measured against; SDPA decomposed into q·kᵀ, softmax and p·v), the Comparison built.

Six forward + backward passes set a floor of 6x; the target is <= 18x.

Also, with ``--cases`` (the default; ``--llama-only`` skips them): the same ratio on a compute-bound
MLP (4 Linear 1024x1024 with GELU, batch 512; target <= 10x) and on a 3-layer toy (Linear 64, batch 32),
and the cost of a plan: ``Comparison.plan("fp8")`` on the Llama, its one verification run of the
planned mixed model (target <= 3 plain steps) and the whole search (every candidate run), in plain steps.
MX figures assume FLOOR scales.

Extra memory: peak RSS during a call minus RSS before it (Linux ``VmHWM`` reset
through ``/proc/self/clear_refs``, as ``bench_scan.py``; a 1 ms sampling thread
elsewhere), for the plain step and for compare, quoted against the size of the
model's fp32 weights. ``--quick``: 2 layers, batch 2x32, 2 rounds (seconds; only checks the script
works). ``--cpu-time``: every timing in the process's CPU time (on a loaded machine). Prints a table and ``RESULT {json}`` lines for bench/run_all.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_probe import build, plain_step  # noqa: E402
from bench_scan import peak_extra  # noqa: E402

MiB = 2**20
#: The clock of every timing: wall time, or with ``--cpu-time`` this process's CPU time (one thread, so
#: the same work whatever else loads the machine's cores).
CLOCK = time.perf_counter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--llama-only", action="store_true")
    parser.add_argument("--cpu-time", action="store_true", help="time in process CPU time (for a loaded machine; the plan rows keep the plan's own wall-clock seconds)")
    args = parser.parse_args()
    global CLOCK
    if args.cpu_time:
        CLOCK = time.process_time
    import mpdoctor

    torch.set_num_threads(1)  # the machine is shared: one thread keeps OpenMP barriers out of the noise
    rounds = 2 if args.quick else 5
    shape = dict(layers=2, seq=32, batch=2) if args.quick else dict(layers=4, seq=128, batch=4)
    model, batch = build(**shape)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())

    def run_compare() -> None:
        mpdoctor.compare(model, batch)

    # Warm-up: allocator, first-use imports.
    plain_step(model, batch)
    run_compare()
    best = {"plain": float("inf"), "compare": float("inf")}
    for _ in range(rounds):
        for key, fn in (("plain", lambda: plain_step(model, batch)), ("compare", run_compare)):
            gc.collect()
            start = CLOCK()
            fn()
            best[key] = min(best[key], CLOCK() - start)
    model.zero_grad(set_to_none=True)
    gc.collect()
    mem_plain = peak_extra(lambda: plain_step(model, batch))
    model.zero_grad(set_to_none=True)
    gc.collect()
    mem_compare = peak_extra(run_compare)
    ratio = best["compare"] / best["plain"]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    c = mpdoctor.compare(model, batch)
    print(f"{shape['layers']}-layer Llama (hidden 256, {n_linear} Linear, {len(c.attention)} attention matmuls), batch {shape['batch']}x{shape['seq']}, "
          f"fp32 CPU, 1 thread, best of {rounds}")  # fmt: skip
    print(f"  plain forward+backward                    {best['plain'] * 1000:9.1f} ms   peak extra {mem_plain / MiB:7.1f} MiB")
    print(f"  mpdoctor.compare ({', '.join(c.precisions)})  {best['compare'] * 1000:9.1f} ms   peak extra {mem_compare / MiB:7.1f} MiB")
    print(f"  ratio {ratio:.2f}x one plain step (floor 6x for six runs, target <= 18x)")
    print(f"  model weights {weights / MiB:.1f} MiB; compare's peak extra is {mem_compare / weights:.2f}x that "
          "(a plain step after warm-up reuses freed memory, so its peak extra reads near zero)")  # fmt: skip
    print(f"  losses: {', '.join(f'{k} {v:.4f}' for k, v in c.losses.items())}")
    rows = [
        {
            "figure": f"compare() of 5 precisions vs one plain fp32 fwd+bwd ({shape['layers']}-layer Llama h256, {n_linear} Linear, {len(c.attention)} attention matmuls)",
            "mpdoctor": round(best["compare"] * 1000, 1),
            "baseline": round(best["plain"] * 1000, 1),
            "ratio": round(ratio, 2),
            "target": "6 <= ratio <= 18",
            "met": ratio <= 18.0,
            "unit": "ms (best)",
        },
        {
            "figure": "compare() peak extra memory (peak RSS over the start) vs the model's fp32 weights",
            "mpdoctor": round(mem_compare / MiB, 1),
            "baseline": round(weights / MiB, 1),
            "ratio": round(mem_compare / weights, 2),
            "target": "reported",
            "met": True,
            "unit": "MiB",
        },
    ]
    plain_best = best["plain"]
    plan = c.plan("fp8")
    print(f"  plan fp8: {len(plan.kept)} kept; one verification run {plan.planned.seconds * 1000:.1f} ms = "
          f"{plan.planned.seconds / plain_best:.2f} plain steps (target <= 3); whole search ({len(plan.tried)} runs + reference) "
          f"{plan.seconds * 1000:.1f} ms = {plan.seconds / plain_best:.2f} plain steps")  # fmt: skip
    rows.append({
        "figure": "plan('fp8') verification: one run of the planned mixed model vs one plain fp32 fwd+bwd (Llama above)",
        "mpdoctor": round(plan.planned.seconds * 1000, 1), "baseline": round(plain_best * 1000, 1),
        "ratio": round(plan.planned.seconds / plain_best, 2), "target": "ratio <= 3", "met": plan.planned.seconds / plain_best <= 3.0,
        "unit": "ms",
    })  # fmt: skip
    if not args.llama_only:
        rows.extend(other_cases(rounds))
    for r in rows:
        print("RESULT " + json.dumps(r))


def timed_ratio(plain, run, rounds: int) -> tuple[float, float]:
    """Best of ``rounds`` interleaved timings of ``plain`` and ``run`` (seconds)."""
    plain()
    run()
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, fn in enumerate((plain, run)):
            gc.collect()
            start = CLOCK()
            fn()
            best[i] = min(best[i], CLOCK() - start)
    return best[0], best[1]


def other_cases(rounds: int) -> list[dict]:
    """compare() of five precisions on a compute-bound MLP (hidden 1024, batch 512) and on a 3-layer toy."""
    import mpdoctor

    out = []
    for label, width, batch, layers, target in (("MLP 4x Linear 1024, batch 512", 1024, 512, 4, 10.0), ("3-layer toy, Linear 64, batch 32", 64, 32, 3, None)):
        torch.manual_seed(0)
        mods = []
        for _ in range(layers):
            mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
        model = torch.nn.Sequential(*mods)
        x = torch.randn(batch, width)

        def plain(model=model, x=x) -> None:
            model.zero_grad(set_to_none=True)
            model(x).float().mean().backward()

        t_plain, t_compare = timed_ratio(plain, lambda model=model, x=x: mpdoctor.compare(model, x), rounds)
        ratio = t_compare / t_plain
        print(f"  {label}: plain {t_plain * 1000:.1f} ms, compare {t_compare * 1000:.1f} ms, ratio {ratio:.2f}x")
        out.append({
            "figure": f"compare() of 5 precisions vs one plain fp32 fwd+bwd ({label})",
            "mpdoctor": round(t_compare * 1000, 1), "baseline": round(t_plain * 1000, 1), "ratio": round(ratio, 2),
            "target": f"ratio <= {target:g}" if target else "reported", "met": ratio <= target if target else True, "unit": "ms (best)",
        })  # fmt: skip
    return out


if __name__ == "__main__":
    main()
