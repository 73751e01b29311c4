"""What ``mpdoctor.probe`` adds to one forward + backward, next to transformers' ``DebugUnderflowOverflow``.

Model: a 4-layer Llama, hidden 256, built from a config (no download), fp32
on the CPU; batch: 4 sequences of 128 tokens with labels. Three timings,
interleaved so that the machine's noise hits them alike (the best, i.e. minimum, of N):

- plain: ``model(**batch).loss.backward()`` with the grads cleared first;
- probe: ``mpdoctor.probe(model, batch)`` (hooks on every module, forward and
  backward statistics, grads/RNG/modes saved and restored, report built);
- DebugUnderflowOverflow: the same plain forward + backward on an identical
  copy of the model carrying transformers' forward hooks (they cannot be
  removed, hence the copy). It checks forward only; the probe also records
  every module's output gradient and its parameters' gradients in backward.

Overhead = the median over N rounds (each round running the four in turn) of a run's time minus the same round's
plain step; the ratio of the two bests' differences is printed beside it. Target: probe overhead <= 0.2x
DebugUnderflowOverflow's.
``--kind gpt2``: the same on a GPT-2 (LayerNorm, GELU MLP, Conv1D projections, learned positions) of the
same size, a model kind other than Llama. What the figures include: the probe's hooks, its statistics,
the batch trace and the report; the NaN-origin replay runs only when a forward goes non-finite, which a
healthy model never does, so it is measured apart: ``run_probe`` on a copy whose one Linear weight is set
to 1e38 (activations overflow to inf, then NaN, with finite weights: the replay runs) against ``run_probe``
on the healthy model, the difference being the non-finite read-out and the replay.
``--quick``: 2 layers, batch 2x32, 3 rounds (seconds; only checks the script works).
``--cpu-time``: every timing in this process's CPU time (one torch thread), for a machine loaded by other jobs.
``--rounds N``: N interleaved rounds instead of 21.
Prints a table and ``RESULT {json}`` lines for bench/run_all.py.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import statistics
import time

import torch

#: The clock of every timing: wall time, or with ``--cpu-time`` this process's CPU time.
CLOCK = time.perf_counter


def build(layers: int = 4, hidden: int = 256, seq: int = 128, batch: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=8192,
        use_cache=False,
    )
    model = LlamaForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids.clone()}


def plain_step(model, batch) -> None:
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--kind", choices=("llama", "gpt2"), default="llama")
    parser.add_argument("--cpu-time", action="store_true", help="time in process CPU time (for a loaded machine)")
    parser.add_argument("--rounds", type=int, default=21, help="interleaved rounds (default 21; 3 with --quick)")
    args = parser.parse_args()
    global CLOCK
    if args.cpu_time:
        CLOCK = time.process_time
    from transformers.debug_utils import DebugUnderflowOverflow

    import mpdoctor
    from mpdoctor.attach.numerics.probe import run_probe

    torch.set_num_threads(1)  # the machine is shared: one thread keeps OpenMP barriers out of the noise
    repeat = 3 if args.quick else args.rounds
    shape = dict(layers=2, seq=32, batch=2) if args.quick else dict(layers=4, seq=128, batch=4)
    model, batch = (build if args.kind == "llama" else build_gpt2)(**shape)
    duo_model = copy.deepcopy(model)
    DebugUnderflowOverflow(duo_model)
    n_modules = sum(1 for _ in model.modules())

    # Warm-up: allocator, first-use imports (pandas for the table), the unscale-kernel probe.
    for _ in range(1 if args.quick else 2):
        plain_step(model, batch)
        plain_step(duo_model, batch)
        mpdoctor.probe(model, batch)
    timings: dict[str, list[float]] = {"plain": [], "probe": [], "hooks": [], "duo": []}
    sink = io.StringIO()
    for _ in range(repeat):
        for key, fn in (
            ("plain", lambda: plain_step(model, batch)),
            ("probe", lambda: mpdoctor.probe(model, batch)),
            ("hooks", lambda: run_probe(model, batch)),
            ("duo", lambda: plain_step(duo_model, batch)),
        ):
            with contextlib.redirect_stdout(sink):  # DebugUnderflowOverflow prints when it detects something
                start = CLOCK()
                fn()
                timings[key].append(CLOCK() - start)
    med = {k: min(v) * 1000 for k, v in timings.items()}  # the best of N: the run least disturbed by the shared machine
    # Each overhead is the median, over the rounds, of (this round's time - the same round's plain step): the
    # rounds interleave the four, so a slow stretch of the shared machine shifts both terms of a difference. The
    # difference of two bests (printed beside it) rests on two extreme values and swings by +-10 ms run to run.
    paired = {k: 1000 * statistics.median(t - p for t, p in zip(timings[k], timings["plain"])) for k in ("probe", "hooks", "duo")}
    probe_over, hooks_over, duo_over = paired["probe"], paired["hooks"], paired["duo"]
    ratio = probe_over / duo_over if duo_over > 0 else float("inf")
    hooks_ratio = hooks_over / duo_over if duo_over > 0 else float("inf")
    best_ratio = (med["probe"] - med["plain"]) / (med["duo"] - med["plain"]) if med["duo"] > med["plain"] else float("inf")
    print(f"{shape['layers']}-layer {args.kind} (hidden 256, {n_modules} modules), batch {shape['batch']}x{shape['seq']}, "
          f"fp32 CPU, 1 thread, {repeat} interleaved rounds{', CPU time' if args.cpu_time else ''}")  # fmt: skip
    print(f"  plain forward+backward                     {med['plain']:8.1f} ms (best)")
    print(f"  mpdoctor.probe (fwd+bwd, report)           {med['probe']:8.1f} ms  overhead {probe_over:7.1f} ms (median of rounds)")
    print(f"  mpdoctor run_probe (fwd+bwd, hooks only)   {med['hooks']:8.1f} ms  overhead {hooks_over:7.1f} ms")
    print(f"  DebugUnderflowOverflow (forward hooks)     {med['duo']:8.1f} ms  overhead {duo_over:7.1f} ms")
    print(f"  probe overhead / DebugUnderflowOverflow overhead = {ratio:.3f} (target <= 0.2, with backward covered; "
          f"from the bests: {best_ratio:.3f})")  # fmt: skip
    rows = [
        {
            "figure": f"probe() overhead over fwd+bwd vs DebugUnderflowOverflow's ({shape['layers']}-layer {args.kind} h256; "
            "the probe records backward too, DUO forward only)",
            "mpdoctor": round(probe_over, 2),
            "baseline": round(duo_over, 2),
            "ratio": round(ratio, 3),
            "target": "ratio <= 0.2",
            "met": ratio <= 0.2,
            "unit": "ms added (median of paired rounds)",
            "from_bests": round(best_ratio, 3),
        },
        {
            "figure": "probe hooks only (run_probe) overhead vs DebugUnderflowOverflow's",
            "mpdoctor": round(hooks_over, 2),
            "baseline": round(duo_over, 2),
            "ratio": round(hooks_ratio, 3),
            "target": "ratio <= 0.2",
            "met": hooks_ratio <= 0.2,
            "unit": "ms added (median of paired rounds)",
        },
    ]
    rows.append(replay_cost(model, batch, 3 if args.quick else 7))
    for r in rows:
        print("RESULT " + json.dumps(r))


def replay_cost(model, batch, repeat: int) -> dict:
    """``run_probe`` on a copy whose forward goes non-finite (one Linear weight set to 1e38, weights still
    finite: the NaN-origin replay runs) vs on the healthy model: what a NaN adds to the probe."""
    from mpdoctor.attach.numerics.probe import run_probe

    broken = copy.deepcopy(model)
    linear = [m for m in broken.modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"]
    with torch.no_grad():
        linear[len(linear) // 2].weight.fill_(1e38)  # finite, but its outputs pass float32's max: inf, then NaN
    facts = run_probe(broken, batch)
    assert facts.origin is not None, "the broken copy must trigger the NaN-origin replay"
    best = {"healthy": float("inf"), "nan": float("inf")}
    for _ in range(repeat):
        for key, m in (("healthy", model), ("nan", broken)):
            start = CLOCK()
            run_probe(m, batch)
            best[key] = min(best[key], CLOCK() - start)
    extra = (best["nan"] - best["healthy"]) * 1000
    print(f"  run_probe with a NaN (replay included) {best['nan'] * 1000:8.1f} ms vs healthy {best['healthy'] * 1000:8.1f} ms: "
          f"the NaN's read-out and replay add {extra:.1f} ms")  # fmt: skip
    return {
        "figure": "run_probe on a forward that goes non-finite (NaN-origin replay included) vs on the healthy model",
        "mpdoctor": round(best["nan"] * 1000, 1),
        "baseline": round(best["healthy"] * 1000, 1),
        "ratio": round(best["nan"] / best["healthy"], 2),
        "target": "reported",
        "met": True,
        "unit": "ms (best)",
    }


def build_gpt2(layers: int = 4, hidden: int = 256, seq: int = 128, batch: int = 4):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, vocab_size=8192, n_positions=max(seq, 128), use_cache=False)
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids.clone()}


if __name__ == "__main__":
    main()
