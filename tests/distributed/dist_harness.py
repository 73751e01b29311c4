"""Run a function on N real gloo processes (torch.multiprocessing spawn), bounded by a timeout.

Each worker returns a JSON-able value through a queue; a worker exception comes back as text.
"""

from __future__ import annotations

import os
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, queue, init: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), GLOO_SOCKET_IFNAME="lo")  # fmt: skip
    import torch.distributed as dist

    try:
        if init:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        queue.put((rank, "ok", fn(rank, world)))
    except BaseException as exc:  # the test reads it
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"))
    finally:
        if init and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(fn, world: int = 2, timeout: float = 120.0, init: bool = True) -> dict[int, tuple[str, object]]:
    """``{rank: ("ok", value) | ("error", text)}``; ranks that neither returned nor raised are missing."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, queue, init), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, tuple[str, object]] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    while len(out) < world and time.monotonic() < deadline:
        try:
            rank, status, value = queue.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            out[rank] = (status, value)
        except queue_mod.Empty:
            if all(not p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    return out
