"""The cost of the crash hook on successful cells: ``%load_ext mpdoctor`` vs no extension.

One real IPython ``InteractiveShell`` runs the same cells (a trivial
assignment, and a small forward + backward) in interleaved blocks with the
extension loaded and unloaded; the figure is the ratio of median per-cell
times. The hook is IPython's ``set_custom_exc``: it runs only when a cell
raises, so the expected ratio is 1 (noise). Also printed: the time from a
mixed-precision crash to its report (traceback + diagnosis), for scale.

Prints a table and ``RESULT {json}`` lines for bench/run_all.py.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import time

CELLS = {
    "x = 1": "trivial cell",
    "loss = model(batch).sum(); loss.backward()": "forward+backward cell",
}

SETUP = """
import torch
torch.set_num_threads(1)  # this shared machine's other processes make multi-threaded timings noisy
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
batch = torch.randn(32, 64)
def crash():
    bad = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16))
    bad(torch.randn(2, 4))
"""


def per_cell(shell, cell: str, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        shell.run_cell(cell, store_history=False)
    return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell(SETUP, store_history=False)
    blocks, n = (5, 50) if args.quick else (21, 200)
    rows = []
    for cell, label in CELLS.items():
        with_ext, without = [], []
        for i in range(blocks):
            # Alternate which variant runs first, so drift in the machine's load cancels out.
            for loaded in (True, False) if i % 2 else (False, True):
                if loaded:
                    shell.run_line_magic("load_ext", "mpdoctor")
                with_ext_or_not = with_ext if loaded else without
                with_ext_or_not.append(per_cell(shell, cell, n))
                if loaded:
                    shell.run_line_magic("unload_ext", "mpdoctor")
        a, b = statistics.median(with_ext), statistics.median(without)
        print(f"{label:24} with mpdoctor {a * 1e6:8.1f} us   without {b * 1e6:8.1f} us   ratio {a / b:.3f}")
        rows.append({
            "figure": f"successful {label} with %load_ext mpdoctor vs no extension (crash hook installed)",
            "mpdoctor": round(a * 1e6, 1), "baseline": round(b * 1e6, 1), "ratio": round(a / b, 3),
            "target": "<= 1.1 (1 + noise)", "met": a / b <= 1.1, "unit": "us per cell (median of blocks)",
        })  # fmt: skip
    shell.run_line_magic("load_ext", "mpdoctor")
    crash_times = []
    for _ in range(3 if args.quick else 7):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            start = time.perf_counter()
            shell.run_cell("crash()", store_history=False)
            crash_times.append(time.perf_counter() - start)
        assert "cause of RuntimeError" in out.getvalue(), "the crash was not diagnosed"
    shell.run_line_magic("unload_ext", "mpdoctor")
    crash_ms = statistics.median(crash_times) * 1000
    print(f"mixed-precision crash -> traceback + report: {crash_ms:.1f} ms")
    rows.append({
        "figure": "mixed-precision crash in a cell -> traceback + report",
        "mpdoctor": round(crash_ms, 1), "baseline": None, "ratio": None,
        "target": "", "met": True, "unit": "ms (median)",
    })  # fmt: skip
    for row in rows:
        print("RESULT " + json.dumps(row))


if __name__ == "__main__":
    main()
