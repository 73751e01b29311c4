"""The cross-rank exchange: its cost measured on 2, 4 and 8 gloo processes, modelled at 1,024 ranks.

Prints ``RESULT {json}`` lines. The measured rows run ``diagnose(model, distributed=True)``'s exchange on
real processes (started together after a barrier) and read its own counters: store operations (polls of the
arrival counter apart), bytes per rank, seconds. The 1,024-rank row is a model FED WITH THE 2-RANK
MEASUREMENT: per rank the non-poll operations and bytes measured (the reference rank, which also publishes
its fingerprint, and the others apart), plus an assumed arrival wait of ``POLLS`` polls, on a TCPStore
served by rank 0 over datacenter Ethernet (``RTT_S`` per round trip, ``SERVICE_S`` per operation served
one after another), next to one training step of Llama-2-7B data-parallel (6 * 7e9 * 4096 tokens FLOPs per
rank at 40% of an A100's 312 TFLOP/s bf16). The model is checked against the 4- and 8-rank runs: the
operation and byte counts it predicts for those worlds against the measured ones, and the exchange time it
predicts from this machine's measured store round trip and the measured polls against the measured time.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests", "distributed"), os.path.join(HERE, "..", "tests")]

RTT_S = 100e-6
SERVICE_S = 10e-6
POLLS = 3  # assumed arrival polls per rank at 1,024 ranks (20 ms apart): ranks arrive within 40-60 ms
POLL_S = 0.02  # mpdoctor.distributed._POLL


def measure(world: int) -> dict:
    """The exchange on ``world`` real gloo ranks: per-rank counters, the reference rank apart."""
    import dist_workers as w
    from dist_harness import run_ranks

    res = run_ranks(w.exchange_cost, world=world, timeout=300)
    vals = [v for s, v in res.values() if s == "ok"]
    if len(vals) != world:
        raise RuntimeError(f"{world} ranks: {res}")
    fixed = sorted(v["ops"] - v["polls"] for v in vals)  # the reference rank does one set more
    return {"world": world, "ops_reference": fixed[-1], "ops_other": fixed[0], "ops_sum": sum(fixed),
            "bytes_reference": max(v["bytes"] for v in vals), "bytes_other": min(v["bytes"] for v in vals),
            "polls_max": max(v["polls"] for v in vals), "polls_sum": sum(v["polls"] for v in vals),
            "seconds_max": max(v["seconds"] for v in vals), "rtt_s": sorted(v["rtt_s"] for v in vals)[world // 2],
            "agree": all(v["agree"] for v in vals)}  # fmt: skip


def model(world: int, fed: dict, polls: int = POLLS, rtt_s: float = RTT_S, service_s: float = SERVICE_S) -> dict:
    """The exchange at ``world`` ranks from the counts measured in ``fed`` (a :func:`measure` result).

    One rank's time: its arrival wait (``polls - 1`` sleeps), its own round trips, and the store serving every
    rank's operations one after another (the worst case: all of them queued ahead of it).
    """
    ops_rank = fed["ops_reference"] + polls
    server_ops = fed["ops_reference"] + fed["ops_other"] * (world - 1) + world * polls
    time_s = (polls - 1) * POLL_S + ops_rank * rtt_s + server_ops * service_s
    return {"world": world, "collectives": 0, "store_ops_per_rank": ops_rank, "fixed_ops_reference": fed["ops_reference"],
            "fixed_ops_other": fed["ops_other"], "polls_assumed": polls, "bytes_per_rank": fed["bytes_other"],
            "reference_rank_bytes": fed["bytes_reference"], "store_server_ops": server_ops, "exchange_s": round(time_s, 4),
            "fixed_ops_sum": fed["ops_reference"] + fed["ops_other"] * (world - 1)}  # fmt: skip


def step_s() -> float:
    return 6 * 7e9 * 4096 / (0.4 * 312e12)


def check(measured: dict, fed: dict) -> dict:
    """The model against one measured run: counts exactly, time from this machine's RTT and measured polls.

    The reference rank's bytes are compared but not required equal: its fingerprint carries the job's
    environment, whose values (a port number, the world size) differ by a few characters between runs.
    """
    local = model(measured["world"], fed, polls=measured["polls_max"], rtt_s=measured["rtt_s"], service_s=0.0)
    return {"world": measured["world"], "ops_sum_predicted": local["fixed_ops_sum"], "ops_sum_measured": measured["ops_sum"],
            "bytes_reference_predicted": fed["bytes_reference"], "bytes_reference_measured": measured["bytes_reference"],
            "bytes_other_predicted": fed["bytes_other"], "bytes_other_measured": measured["bytes_other"],
            "seconds_predicted": local["exchange_s"], "seconds_measured": round(measured["seconds_max"], 4),
            "counts_match": local["fixed_ops_sum"] == measured["ops_sum"] and fed["bytes_other"] == measured["bytes_other"]}  # fmt: skip


def rows(quick: bool) -> list[dict]:
    """The rows run_all.py tabulates (figure, mpdoctor, baseline, ratio, target, met, unit), details kept aside."""
    out = []
    runs = {world: measure(world) for world in ((2,) if quick else (2, 4, 8))}
    fed = runs[2]
    for world, m in runs.items():
        out.append({"figure": f"cross-rank exchange bytes per rank ({world} gloo ranks, healthy)",
                    "mpdoctor": m["bytes_reference"], "baseline": None, "ratio": None, "target": 1024,
                    "met": m["bytes_reference"] <= 1024, "unit": "bytes", "bench": "distributed-exchange",
                    "measured": m})  # fmt: skip
    for world in sorted(runs)[1:]:
        c = check(runs[world], fed)
        out.append({"figure": f"exchange model vs measured {world}-rank run (seconds; ops and bytes match: {c['counts_match']})",
                    "mpdoctor": c["seconds_measured"], "baseline": c["seconds_predicted"],
                    "ratio": round(c["seconds_measured"] / c["seconds_predicted"], 2) if c["seconds_predicted"] else None,
                    "target": None, "met": c["counts_match"], "unit": "s", "bench": "distributed-exchange",
                    "check": c})  # fmt: skip
    mod = model(1024, fed)
    ratio = round(mod["exchange_s"] / step_s(), 4)
    mod.update(interconnect="TCPStore on rank 0, 100 us RTT, 10 us/op", train_step_s=round(step_s(), 2),
               step_model="Llama-2-7B DDP, 4096 tokens/rank, A100 bf16 at 40% MFU", fed_from="2-rank measurement")  # fmt: skip
    out.append({"figure": f"cross-rank exchange at 1,024 ranks (model fed {fed['ops_reference']}+{POLLS} ops, "
                          f"{fed['bytes_reference']} B measured at 2 ranks) vs one 7B DDP step",
                "mpdoctor": mod["exchange_s"], "baseline": mod["train_step_s"], "ratio": ratio,
                "target": 0.1, "met": ratio <= 0.1, "unit": "s", "bench": "distributed-exchange",
                "modelled": mod})  # fmt: skip
    return out


if __name__ == "__main__":
    for row in rows("--quick" in sys.argv):
        print("RESULT " + json.dumps(row))
