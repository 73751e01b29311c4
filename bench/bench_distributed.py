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


def rows(quick: bool) -> list[dict]:
    """The rows run_all.py tabulates (figure, mpdoctor, baseline, ratio, target, met, unit), details kept aside."""
    out = []
    for world in (2,) if quick else (2, 4):
        m = measure(world)
        out.append({"figure": f"cross-rank exchange bytes per rank ({world} gloo ranks, healthy)",
                    "mpdoctor": m["bytes_per_rank_max"], "baseline": None, "ratio": None, "target": 1024,
                    "met": m["bytes_per_rank_max"] <= 1024, "unit": "bytes", "bench": "distributed-exchange",
                    "measured": m})  # fmt: skip
    mod = model(1024)
    out.append({"figure": "cross-rank exchange at 1,024 ranks (modelled) vs one 7B DDP step",
                "mpdoctor": mod["exchange_s"], "baseline": mod["train_step_s"], "ratio": mod["ratio_exchange_to_step"],
                "target": 0.1, "met": mod["ratio_exchange_to_step"] <= 0.1, "unit": "s", "bench": "distributed-exchange",
                "modelled": mod})  # fmt: skip
    return out


if __name__ == "__main__":
    for row in rows("--quick" in sys.argv):
        print("RESULT " + json.dumps(row))
