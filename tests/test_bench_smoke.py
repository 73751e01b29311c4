"""The benchmark suite still runs: ``bench/run_all.py --quick`` once (figures present; targets are not asserted)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
KEYS = {"figure", "mpdoctor", "baseline", "ratio", "target", "met", "unit"}


def test_run_all_quick_prints_one_table_with_every_figure(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run_all.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert all(KEYS <= set(r) for r in rows)
    figures = " | ".join(r["figure"] for r in rows)
    for expected in (
        "value scan speed vs bare aminmax loop",
        "small bf16 tensors (scan_tensors) vs bare aminmax loop",
        "value scan speed vs naive",
        "value scan peak extra memory",
        "probe() overhead over fwd+bwd vs DebugUnderflowOverflow",
        "MPDoctorCallback per-step cost",
        "import mpdoctor on top of import torch",
        "%load_ext mpdoctor after import mpdoctor",
        "today's %load_ext vs the crash hook alone",
        "first diagnose() of an nn.Linear",
        "diagnose() on a Llama-3-70B-shaped meta model",
        "-tensor mixture-of-experts meta model",
        "report widget of the",
        "read 200 cells of history for AMP loop mistakes",
        "compare() of 5 precisions vs one plain fp32 fwd+bwd",
        "compare() peak extra memory",
    ):
        assert expected in figures
    assert all(isinstance(r["mpdoctor"], (int, float)) for r in rows)
    table = proc.stdout.split("\n\n")[-1]
    assert table.splitlines()[0].split() == ["figure", "mpdoctor", "baseline", "ratio", "target", "met", "unit"]
    assert len(table.splitlines()) == len(rows) + 2
