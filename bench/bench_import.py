"""The cost of ``%load_ext mpdoctor`` on top of ``import torch``, in fresh interpreters.

Each run is a new Python process that imports torch (timed: the baseline),
creates a real IPython ``InteractiveShell`` (not timed: the notebook already
has one), then runs ``%load_ext mpdoctor`` (timed: imports mpdoctor and
registers the magic), importing from compiled bytecode as an installed
package does (cached under the temp dir, since this machine sets
PYTHONDONTWRITEBYTECODE). It also checks that loading the extension imported
neither transformers nor accelerate (mpdoctor reads them only when the user
has already imported them). Median of N runs, in CPU time (what the import costs; on this shared
machine wall time also counts other processes) and wall time. Target: <= 50 ms.

Prints a table and ``RESULT {json}`` lines for bench/run_all.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
t0, c0 = time.perf_counter(), time.process_time()
import torch
t1, c1 = time.perf_counter(), time.process_time()
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
before = set(sys.modules)
t2, c2 = time.perf_counter(), time.process_time()
shell.run_line_magic("load_ext", "mpdoctor")
t3, c3 = time.perf_counter(), time.process_time()
print(json.dumps({
    "torch_ms": (t1 - t0) * 1000,
    "load_ext_ms": (t3 - t2) * 1000,
    "torch_cpu_ms": (c1 - c0) * 1000,
    "load_ext_cpu_ms": (c3 - c2) * 1000,
    "registered": "mpdoctor" in shell.magics_manager.magics["line"],
    "heavy": sorted(m for m in ("transformers", "accelerate", "peft") if m in sys.modules),
    "new_modules": len(set(sys.modules) - before),
}))
"""


def _env() -> dict:
    # An installed package imports from compiled bytecode; PYTHONDONTWRITEBYTECODE (set on this machine)
    # would make every run compile mpdoctor's sources. Cache bytecode outside the repository instead.
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = os.path.join(tempfile.gettempdir(), "mpdoctor-bench-pycache")
    return env


def run_once(env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD], check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    env = _env()
    run_once(env)  # warm-up: compiles the bytecode cache
    runs = [run_once(env) for _ in range(3 if args.quick else 9)]
    load = statistics.median(r["load_ext_ms"] for r in runs)
    torch_ms = statistics.median(r["torch_ms"] for r in runs)
    # CPU time of the child: what the import costs, without the time other processes on this shared
    # machine kept it off the CPU (equal to wall time on an idle machine).
    load_cpu = statistics.median(r["load_ext_cpu_ms"] for r in runs)
    torch_cpu = statistics.median(r["torch_cpu_ms"] for r in runs)
    heavy = sorted({m for r in runs for m in r["heavy"]})
    registered = all(r["registered"] for r in runs)
    print(f"fresh interpreters, median of {len(runs)}")
    print(f"  {'':34} {'wall':>8} {'CPU':>8}")
    print(f"  {'import torch (baseline)':34} {torch_ms:8.1f} {torch_cpu:8.1f} ms")
    print(f"  {'%load_ext mpdoctor on top of it':34} {load:8.1f} {load_cpu:8.1f} ms ({runs[0]['new_modules']} modules)")
    print(f"  %mpdoctor registered: {registered}; heavy libraries imported by it: {heavy or 'none'}")
    assert registered, "%load_ext mpdoctor did not register %mpdoctor"
    assert not heavy, f"%load_ext mpdoctor imported {heavy}"
    row = {
        "figure": "%load_ext mpdoctor on top of import torch, CPU time (transformers not imported)",
        "mpdoctor": round(load_cpu, 1),
        "baseline": round(torch_cpu, 1),
        "ratio": round(load_cpu / torch_cpu, 3),
        "target": "<= 50 ms",
        "met": load_cpu <= 50 and not heavy,
        "unit": "ms CPU (median, fresh process)",
    }
    wall = dict(row, figure="%load_ext mpdoctor on top of import torch, wall time (shared machine: noisy)",
                mpdoctor=round(load, 1), baseline=round(torch_ms, 1), ratio=round(load / torch_ms, 3),
                met=load <= 50 and not heavy, unit="ms wall (median, fresh process)")  # fmt: skip
    print("RESULT " + json.dumps(row))
    print("RESULT " + json.dumps(wall))


if __name__ == "__main__":
    main()
