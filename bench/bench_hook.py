"""The cost of ``%load_ext mpdoctor`` on successful cells.

One real IPython ``InteractiveShell`` runs the same cells (a trivial
assignment, and a small forward + backward) in interleaved blocks under three
variants: no extension; what ``%load_ext mpdoctor`` installed before the run
was watched (the magic and the crash hook, which runs only when a cell
raises: the baseline "today" means in the round-3 issue); and today's
``%load_ext``, which also watches the GradScaler protocol cell by cell (the
lazy per-cell attach of ``mpdoctor.attach.runtime.session``). The figures are ratios
of the fastest block's per-cell times. Also printed: the time from a mixed-precision crash
to its report (traceback + diagnosis), for scale.

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
    from mpdoctor.attach.crash import hook
    from mpdoctor.front.magic import MPDoctorMagics

    def crash_hook_only(on: bool) -> None:  # what %load_ext installed before the protocol was watched
        if on:
            shell.register_magics(MPDoctorMagics)
            hook.install(shell)
        else:
            hook.uninstall(shell)

    def full(on: bool) -> None:
        shell.run_line_magic("load_ext" if on else "unload_ext", "mpdoctor")

    variants = {"none": None, "crash hook only": crash_hook_only, "load_ext": full}
    rows = []
    for cell, label in CELLS.items():
        times: dict[str, list[float]] = {v: [] for v in variants}
        order = list(variants)
        for i in range(blocks):
            # Rotate which variant runs first, so drift in the machine's load cancels out.
            for name in order[i % 3 :] + order[: i % 3]:
                switch = variants[name]
                if switch is not None:
                    switch(True)
                try:
                    times[name].append(per_cell(shell, cell, n))
                finally:
                    if switch is not None:
                        switch(False)
        # The fastest block of each variant: on this shared machine other tenants only ever add time, so the
        # minimum is the steadiest estimate of a cell's own cost (timeit's advice); medians swing by 10-40%.
        med = {v: min(t) for v, t in times.items()}
        a, base, before = med["load_ext"], med["none"], med["crash hook only"]
        print(f"{label:24} %load_ext {a * 1e6:8.1f} us   crash hook only {before * 1e6:8.1f} us   "
              f"none {base * 1e6:8.1f} us   ratio {a / base:.3f} (vs crash hook only {a / before:.3f})")  # fmt: skip
        rows.append({
            "figure": f"successful {label} with %load_ext mpdoctor vs no extension",
            "mpdoctor": round(a * 1e6, 1), "baseline": round(base * 1e6, 1), "ratio": round(a / base, 3),
            "target": "<= 1.1 (1 + noise)", "met": a / base <= 1.1, "unit": "us per cell (fastest of blocks)",
        })  # fmt: skip
        rows.append({
            "figure": f"successful {label}: today's %load_ext vs the crash hook alone (before the protocol was watched)",
            "mpdoctor": round(a * 1e6, 1), "baseline": round(before * 1e6, 1), "ratio": round(a / before, 3),
            "target": "<= 1.05 (no more than before, within noise)", "met": a / before <= 1.05,
            "unit": "us per cell (fastest of blocks)",
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
