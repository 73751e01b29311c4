"""Run a function on N real gloo processes (torch.multiprocessing's forkserver), bounded by a timeout.

Each worker returns a JSON-able value through a queue; a worker exception comes back as text.

The ranks are forked from a server process that has imported torch and torch.distributed once (started by the
first job of a test process, kept for the next ones), not spawned: a spawned rank imports torch again, about two
seconds of CPU per rank and job. A forked rank is still a process of its own that never ran a test: the server
imports and runs nothing else. It takes the environment and working directory of the test that starts it (the
server's are those of the first job), as a spawned one would.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, queue, init: bool, env: dict, cwd: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
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
    main = sys.modules["__main__"]
    if not hasattr(main, "__spec__"):
        # Under pytest-xdist (make test runs each suite on both cores) a worker's ``__main__`` is execnet's, with
        # no ``__spec__``: spawn reads it to decide how to start the child. None is what a script run directly has.
        main.__spec__ = None
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    queue = ctx.Queue()
    port = free_port()
    env, cwd = dict(os.environ), os.getcwd()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, queue, init, env, cwd), daemon=True) for r in range(world)]
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


def run_processes(worker: str, world: int = 2, timeout: float = 120.0) -> dict[int, tuple[int | None, str]]:
    """Run ``dist_workers.<worker>(rank, world)`` in ``world`` plain subprocesses; ``{rank: (returncode, output)}``.

    For failures that kill the process (a C++ ``abort`` inside gloo): a spawned child could not report them, a
    subprocess's exit status and captured stderr can. ``faulthandler`` prints the Python stack of the abort.
    A rank still running at ``timeout`` is killed and reported with returncode ``None``.
    """
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import faulthandler, sys; faulthandler.enable(); sys.path[:0] = sys.argv[1:3]; import torch.distributed as dist;"
            " dist.init_process_group('gloo'); import dist_workers;"
            f" dist_workers.{worker}(dist.get_rank(), dist.get_world_size())")  # fmt: skip
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "GLOO_SOCKET_IFNAME": "lo"}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, "-c", code, here, os.path.dirname(here)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    import time

    deadline = time.monotonic() + timeout
    out: dict[int, tuple[int | None, str]] = {}
    for rank, p in enumerate(procs):
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out[rank] = (p.returncode, text)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            out[rank] = (None, text)
    return out
