"""The cross-rank exchange: its cost measured on 2 and 4 gloo processes, modelled at 1,024 ranks.

Prints ``RESULT {json}`` lines. The measured rows run ``diagnose(model, distributed=True)`` on real
processes and read the exchange's own counters (store operations and bytes per rank). The model row
assumes the healthy case (all ranks agree: no rank reads another's digest) on a TCPStore served by
rank 0 over datacenter Ethernet (``RTT_S`` per round trip, ``SERVICE_S`` per operation on the server),
next to one training step of Llama-2-7B data-parallel (6 * 7e9 * 4096 tokens FLOPs per rank at 40%
of an A100's 312 TFLOP/s bf16).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "distributed"))

RTT_S = 100e-6
SERVICE_S = 10e-6
POLLS = 3  # arrival polls per rank in the healthy case (20 ms apart)


def measure(world: int) -> dict:
    import dist_workers as w
    from dist_harness import run_ranks

    res = run_ranks(w.identical, world=world, timeout=240)
    vals = [v for s, v in res.values() if s == "ok"]
    return {"world": world, "ops_per_rank_max": max(v["ops"] for v in vals), "bytes_per_rank_max": max(v["bytes"] for v in vals),
            "ops_per_rank_median": sorted(v["ops"] for v in vals)[len(vals) // 2]}  # fmt: skip


def model(world: int, ops_per_rank: int = 6, bytes_per_rank: int = 60, reference_bytes: int = 420) -> dict:
    server_ops = world * ops_per_rank
    time_s = POLLS * 0.02 + ops_per_rank * RTT_S + server_ops * SERVICE_S
    step_s = 6 * 7e9 * 4096 / (0.4 * 312e12)
    return {"world": world, "collectives": 0, "store_ops_per_rank": ops_per_rank, "bytes_per_rank": bytes_per_rank,
            "reference_rank_bytes": reference_bytes, "store_server_ops": server_ops, "exchange_s": round(time_s, 3),
            "interconnect": "TCPStore on rank 0, 100 us RTT, 10 us/op", "train_step_s": round(step_s, 2),
            "step_model": "Llama-2-7B DDP, 4096 tokens/rank, A100 bf16 at 40% MFU",
            "ratio_exchange_to_step": round(time_s / step_s, 4)}  # fmt: skip


def _row(figure: str, mpdoctor: float, baseline: float | None, target: str, met: bool, unit: str) -> str:
    ratio = round(mpdoctor / baseline, 4) if baseline else None
    return "RESULT " + json.dumps({"figure": figure, "mpdoctor": mpdoctor, "baseline": baseline, "ratio": ratio,
                                   "target": target, "met": met, "unit": unit})  # fmt: skip


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    for world in (2,) if quick else (2, 4):
        m = measure(world)
        print(f"measured, {world} gloo ranks: {json.dumps(m)}")
        print(_row(f"cross-rank exchange on {world} gloo ranks, healthy (store ops per rank: {m['ops_per_rank_max']})",
                   m["bytes_per_rank_max"], None, "< 1 KiB per rank, independent of the model", m["bytes_per_rank_max"] < 1024,
                   "bytes per rank (max)"))  # fmt: skip
    mod = model(1024)
    print(f"modelled, 1,024 ranks: {json.dumps(mod)}")
    print(_row(f"cross-rank exchange modelled at 1,024 ranks ({mod['interconnect']}) vs one {mod['step_model']} step",
               mod["exchange_s"], mod["train_step_s"], "<= 0.1 of one step", mod["ratio_exchange_to_step"] <= 0.1, "s"))  # fmt: skip
