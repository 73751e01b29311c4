"""The cost of ``import mpdoctor`` and ``%load_ext mpdoctor`` on top of ``import torch``, in fresh interpreters.

Each run is a new Python process that imports torch (timed: the baseline),
then ``import mpdoctor`` (timed), creates a real IPython ``InteractiveShell``
(not timed: the notebook already has one), then runs ``%load_ext mpdoctor``
(timed: registers the magic and the exception hook), and last the first
``diagnose()`` of a small model (timed: it loads what the lazy import left
for first use, and says where the deferred cost went), importing from compiled bytecode as an installed
package does (cached under the temp dir, since this machine sets
PYTHONDONTWRITEBYTECODE). It also checks that loading the extension imported
neither transformers nor accelerate (mpdoctor reads them only when the user
has already imported them). Median of N runs, in CPU time (what the import costs; on this shared
machine wall time also counts other processes) and wall time. Targets: import <= 25 ms (wall) with
no transformers import, ``%load_ext`` <= 25 ms; the first diagnosis, imports
included, is reported against a warm one.

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
import mpdoctor
t1b, c1b = time.perf_counter(), time.process_time()
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
before = set(sys.modules)
t2, c2 = time.perf_counter(), time.process_time()
shell.run_line_magic("load_ext", "mpdoctor")
t3, c3 = time.perf_counter(), time.process_time()
heavy = sorted(m for m in ("transformers", "accelerate", "peft") if m in sys.modules)
model = torch.nn.Linear(8, 8)
t4 = time.perf_counter()
mpdoctor.diagnose(model)
t5 = time.perf_counter()
mpdoctor.diagnose(model)
t6 = time.perf_counter()
print(json.dumps({
    "import_ms": (t1b - t1) * 1000,
    "import_cpu_ms": (c1b - c1) * 1000,
    "first_diagnose_ms": (t5 - t4) * 1000,
    "warm_diagnose_ms": (t6 - t5) * 1000,
    "torch_ms": (t1 - t0) * 1000,
    "load_ext_ms": (t3 - t2) * 1000,
    "torch_cpu_ms": (c1 - c0) * 1000,
    "load_ext_cpu_ms": (c3 - c2) * 1000,
    "registered": "mpdoctor" in shell.magics_manager.magics["line"],
    "heavy": heavy,
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
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k.endswith("_ms")}
    heavy = sorted({m for r in runs for m in r["heavy"]})
    registered = all(r["registered"] for r in runs)
    print(f"fresh interpreters, median of {len(runs)}")
    print(f"  {'':34} {'wall':>8} {'CPU':>8}")
    print(f"  {'import torch (baseline)':34} {med['torch_ms']:8.1f} {med['torch_cpu_ms']:8.1f} ms")
    print(f"  {'import mpdoctor on top of it':34} {med['import_ms']:8.1f} {med['import_cpu_ms']:8.1f} ms")
    print(f"  {'%load_ext mpdoctor after that':34} {med['load_ext_ms']:8.1f} {med['load_ext_cpu_ms']:8.1f} ms ({runs[0]['new_modules']} modules)")
    print(f"  {'first diagnose() (lazy imports)':34} {med['first_diagnose_ms']:8.1f} {'':>8} ms, warm: {med['warm_diagnose_ms']:.1f} ms")
    print(f"  %mpdoctor registered: {registered}; heavy libraries imported by import + %load_ext: {heavy or 'none'}")
    assert registered, "%load_ext mpdoctor did not register %mpdoctor"
    assert not heavy, f"%load_ext mpdoctor imported {heavy}"
    unit = "ms (median, fresh process)"

    def row(figure: str, ours: str, base: str, limit: float, kind: str, digits: int = 4) -> dict:
        return {
            "figure": figure,
            "mpdoctor": round(med[ours], 1),
            "baseline": round(med[base], 2),
            "ratio": round(med[ours] / med[base], digits),
            "target": f"<= {limit:g} ms",
            "met": med[ours] <= limit and not heavy,
            "unit": f"{kind} {unit}",
        }

    rows = [
        row("import mpdoctor on top of import torch, wall time (transformers not imported)", "import_ms", "torch_ms", 25, "wall"),
        row("%load_ext mpdoctor after import mpdoctor, CPU time", "load_ext_cpu_ms", "torch_cpu_ms", 25, "CPU"),
        row("first diagnose() of an nn.Linear, lazy imports included, vs a warm one", "first_diagnose_ms",
            "warm_diagnose_ms", 100, "wall", digits=1),
    ]  # fmt: skip
    for row in rows:
        print("RESULT " + json.dumps(row))


if __name__ == "__main__":
    main()
