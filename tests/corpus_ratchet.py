"""The public field corpus as a ratchet: what mpdoctor names and cures there never goes back.

``make test`` runs this (``make test-corpus``): each harness of ``../shared/field-corpus`` (the-run, whole-stack,
low-precision) with ``--json``, then, case by case, against ``docs/field-corpus-counts.json``:

- a fault case named before must still be named, one cured before must still be cured;
- a healthy recipe must draw no error or warning (its ``pass``), whatever the record says;
- the totals are printed beside the recorded ones.

It fails on any regression and says which case. ``--record`` writes the counts of this run as the new record
(after an improvement; a regression is never recorded over). The corpus is not part of the repository: the
project's developers and CI keep it beside the clone (``../shared/field-corpus``). A user's clone has none: the
run then says "NOT RUN" and claims nothing (under CI, ``CI=true``, a missing corpus fails the run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT.parent / "shared" / "field-corpus"
RECORD = ROOT / "docs" / "field-corpus-counts.json"
SETS = ("the-run", "whole-stack", "low-precision")


def run_set(name: str, out: Path) -> list[dict]:
    """One harness, every case, its per-case results."""
    target = out / f"{name}.json"
    proc = subprocess.run([sys.executable, str(CORPUS / name / "run.py"), "--json", str(target)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)  # fmt: skip
    if not target.exists():
        raise SystemExit(f"== corpus {name}: the harness wrote no results (exit {proc.returncode})\n{proc.stderr[-2000:]}")
    tail = [line for line in proc.stdout.splitlines() if line and not line.startswith("[")]
    print(f"== corpus {name}\n" + "\n".join(tail[-8:]))
    return json.loads(target.read_text(encoding="utf-8"))


def counts(cases: list[dict]) -> dict:
    """Per case: its kind and what this run achieved."""
    out = {}
    for c in cases:
        healthy = c.get("kind") == "healthy"
        out[c["id"]] = {
            "kind": "healthy" if healthy else "fault",
            "named": bool(c.get("detected")) if not healthy else None,
            "fixable_in_place": bool(c.get("fixable_in_place")),
            "cured": bool(c.get("fixed_and_trains")) if not healthy else None,
            "alarm": (not c.get("pass")) if healthy else None,
        }
    return out


def regressions(now: dict, record: dict) -> list[str]:
    """What got worse than the record, and every healthy recipe that alarms."""
    bad = []
    for case, got in now.items():
        was = record.get(case, {})
        if got["kind"] == "healthy":
            if got["alarm"]:
                bad.append(f"{case}: a healthy recipe draws an error or warning")
            continue
        if was.get("named") and not got["named"]:
            bad.append(f"{case}: named before, not now")
        if was.get("cured") and not got["cured"]:
            bad.append(f"{case}: cured before, not now")
    missing = sorted(set(record) - set(now))
    bad.extend(f"{case}: in the record, not run" for case in missing)
    return bad


def totals(per_case: dict) -> str:
    faults = [c for c in per_case.values() if c["kind"] == "fault"]
    fixable = [c for c in faults if c["fixable_in_place"]]
    healthy = [c for c in per_case.values() if c["kind"] == "healthy"]
    return (f"named {sum(c['named'] for c in faults)}/{len(faults)}, cured {sum(c['cured'] for c in fixable)}/"
            f"{len(fixable)} fixable in place, false alarms {sum(bool(c['alarm']) for c in healthy)}/{len(healthy)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true", help="write this run's counts as the record")
    args = ap.parse_args()
    if not CORPUS.is_dir():
        # The corpus is the project's measuring set, kept beside the repository, not shipped in it: a user's clone
        # has none. Under CI its absence is a failure; elsewhere the run says plainly that nothing was measured.
        print(f"== corpus: NOT RUN: {CORPUS} is not there (the project's field corpus lives beside its repository "
              "and is not part of a clone); nothing was measured, nothing is claimed")
        return 1 if os.environ.get("CI") else 0
    with tempfile.TemporaryDirectory() as tmp:
        now: dict = {}
        for name in SETS:
            for case, got in counts(run_set(name, Path(tmp))).items():
                now[f"{name}/{case}"] = got
    record = json.loads(RECORD.read_text(encoding="utf-8")) if RECORD.exists() else {}
    print(f"== corpus now:      {totals(now)}")
    if record:
        print(f"== corpus recorded: {totals(record)}")
    bad = regressions(now, record)
    if args.record:
        if bad:
            print("== corpus: not recorded over regressions:\n  " + "\n  ".join(bad))
            return 1
        RECORD.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        print(f"== corpus: recorded in {RECORD.relative_to(ROOT)}")
        return 0
    if bad:
        print("== corpus: regressions against docs/field-corpus-counts.json:\n  " + "\n  ".join(bad))
        return 1
    print("== corpus: no case regressed, no healthy recipe alarmed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
