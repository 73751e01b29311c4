"""Run every ``bench/bench_*.py`` and print one table: figure, mpdoctor, baseline, ratio, target, met.

Each script runs in its own process with the same ``--quick`` flag and prints
one or more lines ``RESULT {json}`` with the keys figure, mpdoctor, baseline,
ratio, target, met and unit. A script that fails or prints no RESULT line gets
a row saying so, and the exit status is 1; targets not met do not change the
exit status (benchmarks are not tests).

``make bench`` runs ``python bench/run_all.py``; ``make bench-quick`` adds ``--quick``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
KEYS = ("figure", "mpdoctor", "baseline", "ratio", "target", "met", "unit")


def parse_results(stdout: str) -> list[dict]:
    """The JSON objects of the ``RESULT `` lines of a script's output."""
    rows = []
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            row = json.loads(line[len("RESULT ") :])
            rows.append({k: row.get(k) for k in KEYS})
    return rows


def run(script: pathlib.Path, quick: bool, timeout: float) -> tuple[list[dict], str, float]:
    """Run one bench script; returns its rows, its output and how long it took."""
    cmd = [sys.executable, str(script)] + (["--quick"] if quick else [])
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE.parent)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return [_failed(script, f"timed out after {timeout:.0f} s")], out, time.perf_counter() - start
    output = proc.stdout + (proc.stderr if proc.returncode else "")
    rows = parse_results(proc.stdout)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        rows.append(_failed(script, f"exit {proc.returncode}: {last}"))
    elif not rows:
        rows.append(_failed(script, "printed no RESULT line"))
    return rows, output, time.perf_counter() - start


def _failed(script: pathlib.Path, why: str) -> dict:
    return {"figure": f"{script.name} FAILED ({why})", "mpdoctor": None, "baseline": None, "ratio": None,
            "target": None, "met": False, "unit": None, "failed": True}  # fmt: skip


def _cell(value) -> str:
    if value is None:
        return "-"
    if value is True:
        return "yes"
    if value is False:
        return "NO"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def table(rows: list[dict]) -> str:
    """The summary table as text."""
    header = ["figure", "mpdoctor", "baseline", "ratio", "target", "met", "unit"]
    cells = [header] + [[_cell(r.get(k)) for k in header] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = []
    for n, c in enumerate(cells):
        lines.append("  ".join(v.ljust(w) if i in (0, 4, 6) else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, few repeats: checks the scripts still work")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    parser.add_argument("--only", metavar="NAME", action="append", help="run only bench_NAME.py (repeatable)")
    args = parser.parse_args(argv)
    scripts = sorted(HERE.glob("bench_*.py"))
    if args.only:
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in args.only or s.stem in args.only]
    timeout = 600.0 if args.quick else 3600.0
    rows: list[dict] = []
    for script in scripts:
        print(f"== {script.name}{' --quick' if args.quick else ''}", flush=True)
        got, output, seconds = run(script, args.quick, timeout)
        print(output.rstrip())
        print(f"   ({seconds:.1f} s)", flush=True)
        rows.extend(got)
    print()
    print(table(rows))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=2))
    return 1 if any(r.get("failed") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
