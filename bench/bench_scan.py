"""Throughput and extra memory of the value scan (``diagnose(..., scan=True)``) on a ~1.1B bf16 Llama.

The model is built from a config on the meta device, materialised on the CPU
with ``to_empty`` and filled in place with random normals (no download), in
bf16: ~2.2 GB of parameters. One NaN and one value past 65504 are planted so
that the scan's second look runs where it would in real life.

Timed, interleaved so that the shared machine's noise hits all alike (median):

- scan: ``mpdoctor.numerics.scan.scan_facts(facts)`` (NaN/Inf counts, abs max,
  fp16/bf16 range counts for every parameter);
- aminmax loop: ``torch.aminmax(p)`` over the same tensors (one read each:
  the floor on this machine);
- naive loop: ``torch.isfinite(p).all()`` and ``p.abs().max()`` (what people write).

Extra memory: peak RSS during each pass minus RSS before it (Linux ``VmHWM``
reset through ``/proc/self/clear_refs``; a 1 ms sampling thread elsewhere),
and the scan's own count of the buffers it allocated.

Targets: scan >= 0.8x the aminmax loop's GB/s; <= 64 MiB extra.
``--quick``: a ~7M-parameter model (seconds; only checks the script works). Prints a table and ``RESULT {json}`` lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import torch

MiB = 2**20


def build(quick: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    if quick:
        config = LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=8192, tie_word_embeddings=False)  # fmt: skip
    else:  # TinyLlama-1.1B's shape
        config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                             num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
        layers = model.model.layers
        layers[min(3, len(layers) - 1)].mlp.down_proj.weight[7, 11] = float("nan")
        layers[min(5, len(layers) - 1)].self_attn.q_proj.weight[0, 1] = 1e5
    return model.train()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_extra(fn) -> int:
    """Peak resident memory above the starting RSS while ``fn`` runs."""
    start = _rss()
    if _reset_hwm() and _hwm() is not None:
        fn()
        return max(0, _hwm() - start)
    peak = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return max(0, peak[0] - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from mpdoctor.discover import discover
    from mpdoctor.facts import gather
    from mpdoctor.numerics.scan import scan_facts

    torch.set_num_threads(1)  # the machine is shared: one thread keeps OpenMP barriers out of the noise
    t0 = time.perf_counter()
    model = build(args.quick)
    params = list(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    build_s = time.perf_counter() - t0
    facts = gather(discover([model], names={id(model): "model"}))

    def scan(underflow: bool = False):
        return scan_facts(facts, underflow=underflow, progress=False)

    def aminmax_loop():
        for p in params:
            torch.aminmax(p)

    @torch.no_grad()
    def naive_loop():
        for p in params:
            bool(torch.isfinite(p).all())
            float(p.abs().max())

    # Memory first, before the naive loop's full-size temporaries can linger in the heap.
    mem = {"scan": peak_extra(scan), "aminmax": peak_extra(aminmax_loop), "naive": peak_extra(naive_loop)}
    result = scan()
    (sf,) = result.scans
    bad = [(t.name, t.nan, t.fp16_overflow) for t in sf.tensors if t.nonfinite or t.fp16_overflow]
    assert len(bad) == 2, bad  # the planted NaN and overflow, found exactly

    repeat = 3 if args.quick else 5
    times: dict[str, list[float]] = {"scan": [], "aminmax": [], "naive": [], "scan_underflow": []}
    fns = {"scan": scan, "aminmax": aminmax_loop, "naive": naive_loop, "scan_underflow": lambda: scan(True)}
    for fn in fns.values():
        fn()  # warm-up: page in, first-use paths
    for _ in range(repeat):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    gbps = {k: nbytes / 1e9 / statistics.median(v) for k, v in times.items()}
    # Ratios of medians of per-round ratios: each round's passes ran under the same load.
    r_amm = statistics.median(a / s for s, a in zip(times["scan"], times["aminmax"]))
    r_naive = statistics.median(n / s for s, n in zip(times["scan"], times["naive"]))
    r_under = statistics.median(a / s for s, a in zip(times["scan_underflow"], times["aminmax"]))

    label = "~7M" if args.quick else "~1.1B"
    print(f"Llama {label} params, bf16, {nbytes / 1e9:.2f} GB, {len(params)} tensors, CPU, {torch.get_num_threads()} "
          f"thread(s) (built in {build_s:.1f} s), median of {repeat}")  # fmt: skip
    print(f"  {'pass':<42} {'GB/s':>7} {'peak extra MiB':>15}")
    print(f"  {'mpdoctor scan (counts, abs max, ranges)':<42} {gbps['scan']:7.2f} {mem['scan'] / MiB:15.1f}")
    print(f"  {'mpdoctor scan + flush-to-zero counts':<42} {gbps['scan_underflow']:7.2f} {'':>15}")
    print(f"  {'torch.aminmax loop (floor)':<42} {gbps['aminmax']:7.2f} {mem['aminmax'] / MiB:15.1f}")
    print(f"  {'isfinite().all() + abs().max() loop':<42} {gbps['naive']:7.2f} {mem['naive'] / MiB:15.1f}")
    print(f"  scan / aminmax = {r_amm:.2f} (target >= 0.8); scan / naive = {r_naive:.1f}x; "
          f"scan buffers allocated: {sf.peak_temp_bytes / MiB:.1f} MiB (chunk {sf.chunk_elements:,} elements)")  # fmt: skip
    rows = [
        {
            "figure": f"value scan throughput vs bare aminmax loop ({label} bf16 Llama)",
            "mpdoctor": round(gbps["scan"], 2),
            "baseline": round(gbps["aminmax"], 2),
            "ratio": round(r_amm, 3),
            "target": "ratio >= 0.8",
            "met": r_amm >= 0.8,
            "unit": "GB/s (median)",
        },
        {
            "figure": f"value scan throughput vs naive isfinite+abs().max() loop ({label})",
            "mpdoctor": round(gbps["scan"], 2),
            "baseline": round(gbps["naive"], 2),
            "ratio": round(r_naive, 2),
            "target": "ratio >= 1",
            "met": r_naive >= 1,
            "unit": "GB/s (median)",
        },
        {
            "figure": f"value scan peak extra memory vs naive loop ({label})",
            "mpdoctor": round(mem["scan"] / MiB, 1),
            "baseline": round(mem["naive"] / MiB, 1),
            "ratio": round(mem["scan"] / mem["naive"], 3) if mem["naive"] else None,
            "target": "<= 64 MiB",
            "met": mem["scan"] <= 64 * MiB,
            "unit": "MiB (peak RSS delta)",
        },
        {
            "figure": f"value scan with fp16 flush-to-zero counts vs aminmax loop ({label})",
            "mpdoctor": round(gbps["scan_underflow"], 2),
            "baseline": round(gbps["aminmax"], 2),
            "ratio": round(r_under, 3),
            "target": "info (runs only when fp16 is in play)",
            "met": None,
            "unit": "GB/s (median)",
        },
    ]
    for r in rows:
        print("RESULT " + json.dumps(r))


if __name__ == "__main__":
    main()
