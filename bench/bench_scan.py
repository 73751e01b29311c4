"""The value scan (``diagnose(..., scan=True)``) next to a bare ``torch.aminmax`` loop over the same tensors.

Two models, built from configs (no download), values filled in place:

- a ~0.5B-parameter bf16 Qwen2-shaped model (14 layers, hidden 1280, tied
  embeddings: 170 tensors, 1.05 GB), one NaN and one value past 65504 planted
  so that the scan's exact counts run where they would in real life;
- 10,000 small bf16 tensors (a ``ModuleList`` of bias-free 64x64 ``Linear``):
  there per-tensor Python work, not memory, is the cost.

Timed, interleaved so that the shared machine's noise hits all alike, best of N:

- scan: ``scan_facts(facts)`` (NaN/Inf counts, abs max, fp16/bf16 range counts
  for every parameter, the walk from the model to its tensors included); on
  the small tensors also ``scan_tensors`` (the scan's core, given the tensors);
- aminmax loop: ``torch.aminmax(p)`` over the same tensors (one read each, no
  answer about counts: the floor);
- naive loop: ``torch.isfinite(p).all()`` and ``p.abs().max()`` (what people write).

Extra memory: peak RSS during a pass minus RSS before it (Linux ``VmHWM``
reset through ``/proc/self/clear_refs``; a 1 ms sampling thread elsewhere),
and the scan's own count of the buffers it allocated.

Targets: scan >= 0.9x the aminmax loop's speed on the 0.5B model, >= 1.0x on the
10,000 small tensors; <= 64 MiB extra whatever the model. ``--quick``: a ~7M-parameter
model and 1,000 small tensors (seconds; only checks the script works). Prints a
table and ``RESULT {json}`` lines.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch

MiB = 2**20


def build_model(quick: bool) -> torch.nn.Module:
    """A Qwen2-shaped causal LM in bf16 with a NaN and a 1e5 planted."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if quick:
        config = Qwen2Config(hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=8192, tie_word_embeddings=True)  # fmt: skip
    else:  # ~0.5B parameters in 170 tensors
        config = Qwen2Config(hidden_size=1280, intermediate_size=5120, num_hidden_layers=14, num_attention_heads=10,
                             num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)  # fmt: skip
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    model.tie_weights()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
        layers = model.model.layers
        layers[min(3, len(layers) - 1)].mlp.down_proj.weight[7, 11] = float("nan")
        layers[min(5, len(layers) - 1)].self_attn.q_proj.weight[0, 1] = 1e5
    return model.train()


def build_small(count: int) -> torch.nn.Module:
    """``count`` bias-free 64x64 bf16 Linear layers."""
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Linear(64, 64, bias=False) for _ in range(count)).to(torch.bfloat16)


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


def interleaved(fns: dict, rounds: int) -> dict[str, float]:
    """Best time of each function over ``rounds`` rounds, the functions taking turns within a round."""
    for fn in fns.values():
        fn()  # warm-up: page in, first-use paths
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - start)
    return best


def facts_of(model: torch.nn.Module):
    from mpdoctor.objects.discovery.subjects import discover
    from mpdoctor.objects.gathering import gather

    subjects = discover([model], names={id(model): "model"})
    return gather(subjects), subjects


def aminmax_loop(params: list[torch.Tensor]):
    # Without autograd recording each call (as the scan does not): the fastest loop, the fairest floor.
    @torch.no_grad()
    def run() -> None:
        for p in params:
            torch.aminmax(p)

    return run


def naive_loop(params: list[torch.Tensor]):
    @torch.no_grad()
    def run() -> None:
        for p in params:
            bool(torch.isfinite(p).all())
            float(p.abs().max())

    return run


def row(figure: str, mine: float, base: float, ratio: float, target: str, met: bool | None, unit: str) -> dict:
    return {"figure": figure, "mpdoctor": round(mine, 3), "baseline": round(base, 3), "ratio": round(ratio, 3),
            "target": target, "met": met, "unit": unit}  # fmt: skip


def bench_model(quick: bool, rounds: int) -> list[dict]:
    from mpdoctor.objects.gathering.scan import scan_facts

    t0 = time.perf_counter()
    model = build_model(quick)
    params = list(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    build_s = time.perf_counter() - t0
    facts, subjects = facts_of(model)

    def scan(underflow: bool = False):
        return scan_facts(facts, subjects, underflow=underflow, progress=False)

    # Memory first, before the naive loop's full-size temporaries can linger in the heap.
    mem = {"scan": peak_extra(scan), "aminmax": peak_extra(aminmax_loop(params)), "naive": peak_extra(naive_loop(params))}
    (sf,) = scan().scans
    bad = [(t.name, t.nan, t.fp16_overflow) for t in sf.tensors if t.nonfinite or t.fp16_overflow]
    assert len(bad) == 2, bad  # the planted NaN and overflow, found exactly

    best = interleaved(
        {"scan": scan, "aminmax": aminmax_loop(params), "naive": naive_loop(params), "underflow": lambda: scan(True)},
        rounds,
    )
    gbps = {k: nbytes / 1e9 / v for k, v in best.items()}
    label = "~7M" if quick else "~0.5B"
    print(f"Qwen2-shaped {label} params, bf16, {nbytes / 1e9:.2f} GB, {len(params)} tensors, CPU, "
          f"{torch.get_num_threads()} thread(s) (built in {build_s:.1f} s), best of {rounds}")  # fmt: skip
    print(f"  {'pass':<44} {'ms':>8} {'GB/s':>7} {'peak extra MiB':>15}")
    for key, what in (("scan", "mpdoctor scan (counts, abs max, ranges)"), ("underflow", "mpdoctor scan + flush-to-zero counts"),
                      ("aminmax", "torch.aminmax loop (floor)"), ("naive", "isfinite().all() + abs().max() loop")):  # fmt: skip
        extra = f"{mem[key] / MiB:15.1f}" if key in mem else ""
        print(f"  {what:<44} {best[key] * 1e3:8.1f} {gbps[key]:7.2f} {extra}")
    ratio = best["aminmax"] / best["scan"]
    print(f"  scan speed / aminmax loop speed = {ratio:.2f} (target >= 0.9); scan buffers allocated: "
          f"{sf.peak_temp_bytes / MiB:.1f} MiB (chunk {sf.chunk_elements:,} elements)")  # fmt: skip
    return [
        row(f"value scan speed vs bare aminmax loop ({label} bf16 model, {len(params)} tensors)", gbps["scan"],
            gbps["aminmax"], ratio, "ratio >= 0.9", ratio >= 0.9, "GB/s (best)"),
        row(f"value scan speed vs naive isfinite+abs().max() loop ({label})", gbps["scan"], gbps["naive"],
            best["naive"] / best["scan"], "ratio >= 1", best["naive"] >= best["scan"], "GB/s (best)"),
        row(f"value scan peak extra memory vs naive loop ({label})", mem["scan"] / MiB, mem["naive"] / MiB,
            mem["scan"] / mem["naive"] if mem["naive"] else 0.0, "<= 64 MiB", mem["scan"] <= 64 * MiB,
            "MiB (peak RSS delta)"),
        row(f"value scan with fp16 flush-to-zero counts vs aminmax loop ({label})", gbps["underflow"],
            gbps["aminmax"], best["aminmax"] / best["underflow"], "info (runs only when fp16 is in play)", None,
            "GB/s (best)"),
    ]  # fmt: skip


def bench_small(quick: bool, rounds: int) -> list[dict]:
    from mpdoctor.objects.gathering.scan import scan_facts
    from mpdoctor.objects.gathering.values import scan_tensors

    count = 1_000 if quick else 10_000
    model = build_small(count)
    params = list(model.parameters())
    entries = [(f"{i}", "param", f"model.{i}.weight", p) for i, p in enumerate(params)]
    facts, subjects = facts_of(model)

    def core():
        return scan_tensors(entries, "model", "model")

    def scan():
        return scan_facts(facts, subjects, underflow=False, progress=False)

    mem = {"scan": peak_extra(scan), "aminmax": peak_extra(aminmax_loop(params))}
    (sf,) = scan().scans
    assert len(sf.tensors) == count and not any(t.nonfinite for t in sf.tensors)
    best = interleaved({"core": core, "scan": scan, "aminmax": aminmax_loop(params),
                        "underflow": lambda: scan_facts(facts, subjects, underflow=True, progress=False)}, rounds)  # fmt: skip
    print(f"{count:,} bf16 64x64 tensors ({count * 8192 / 1e6:.0f} MB), CPU, {torch.get_num_threads()} thread(s), "
          f"best of {rounds}")  # fmt: skip
    for key, what in (("core", "scan_tensors (the scan's core)"), ("scan", "scan_facts (walk from the model + core)"),
                      ("underflow", "scan_facts + flush-to-zero counts"), ("aminmax", "torch.aminmax loop (floor)")):  # fmt: skip
        print(f"  {what:<44} {best[key] * 1e3:8.1f} ms  ({best[key] / count * 1e6:5.2f} us a tensor)")
    r_core = best["aminmax"] / best["core"]
    r_scan = best["aminmax"] / best["scan"]
    print(f"  speed / aminmax loop: core {r_core:.2f}, with the walk {r_scan:.2f} (target >= 1.0); "
          f"peak extra memory {mem['scan'] / MiB:.1f} MiB")  # fmt: skip
    n = f"{count:,}"
    return [
        row(f"value scan of {n} small bf16 tensors (scan_tensors) vs bare aminmax loop", best["core"] * 1e3,
            best["aminmax"] * 1e3, r_core, "ratio >= 1.0", r_core >= 1.0, "ms (best); ratio = speed"),
        row(f"value scan of {n} small bf16 tensors incl. walk from the model (scan_facts) vs aminmax loop",
            best["scan"] * 1e3, best["aminmax"] * 1e3, r_scan, "info", None, "ms (best); ratio = speed"),
        row(f"value scan peak extra memory ({n} small tensors)", mem["scan"] / MiB, mem["aminmax"] / MiB,
            mem["scan"] / mem["aminmax"] if mem["aminmax"] else 0.0, "<= 64 MiB", mem["scan"] <= 64 * MiB,
            "MiB (peak RSS delta)"),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=("model", "small"), help="run one of the two benchmarks")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the machine is shared: one thread keeps OpenMP barriers out of the noise
    rows: list[dict] = []
    if args.only in (None, "small"):
        rows += bench_small(args.quick, 3 if args.quick else 9)
    if args.only in (None, "model"):
        rows += bench_model(args.quick, 3 if args.quick else 7)
    for r in rows:
        print("RESULT " + json.dumps(r))


if __name__ == "__main__":
    main()
