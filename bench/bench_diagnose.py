"""How long ``diagnose()`` takes on a Llama-3-70B-shaped model built on the meta device.

Baseline: the bare loop ``sum(p.numel() for p in model.parameters())`` over the
same model, measured in the same run (this machine is shared and noisy, so
only the ratio means anything). Target: ratio <= 10.

Also: discovery over a namespace of 100,000 plain objects, against a bare
loop reading ``type()`` of each value. Target: well under a second.

Prints a table and ``RESULT {json}`` lines for bench/run_all.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build_model(quick: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    layers = 8 if quick else 80
    config = LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return model.train()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    import mpdoctor

    repeat = 5 if args.quick else 15
    model = build_model(args.quick)
    n_tensors = sum(1 for _ in model.parameters())
    optimizer = None
    mpdoctor.diagnose(model)  # warm-up: first-use imports and the unscale-kernel probe
    t_diag = _median_time(lambda: mpdoctor.diagnose(model, optimizer) if optimizer else mpdoctor.diagnose(model), repeat)
    t_base = _median_time(lambda: sum(p.numel() for p in model.parameters()), repeat)
    ratio = t_diag / t_base
    rows = [
        {
            "figure": f"diagnose() on a Llama-3-70B-shaped meta model ({n_tensors} param tensors)",
            "mpdoctor": round(t_diag * 1000, 2),
            "baseline": round(t_base * 1000, 3),
            "ratio": round(ratio, 2),
            "target": "ratio <= 10",
            "met": ratio <= 10,
            "unit": "ms (median)",
        }
    ]
    n_objects = 10_000 if args.quick else 100_000
    ns = {f"v{i}": (i if i % 3 else [i] if i % 2 else f"s{i}") for i in range(n_objects)}
    ns["model"] = torch.nn.Linear(4, 4)
    t_ns = _median_time(lambda: mpdoctor.diagnose(namespace=ns), max(3, repeat // 3))
    t_ns_base = _median_time(lambda: [type(v) for v in ns.values()], max(3, repeat // 3))
    rows.append(
        {
            "figure": f"diagnose(namespace=...) over {n_objects:,} objects",
            "mpdoctor": round(t_ns * 1000, 1),
            "baseline": round(t_ns_base * 1000, 2),
            "ratio": round(t_ns / t_ns_base, 1),
            "target": "< 1000 ms",
            "met": t_ns < 1.0,
            "unit": "ms (median)",
        }
    )
    for r in rows:
        print(f"{r['figure']}: mpdoctor {r['mpdoctor']} {r['unit']}, baseline {r['baseline']}, ratio {r['ratio']} "
              f"(target {r['target']}: {'met' if r['met'] else 'NOT met'})")
    for r in rows:
        print("RESULT " + json.dumps(r))


if __name__ == "__main__":
    main()
