"""The transformers and Lightning callbacks on a real 2-process gloo job under torchrun.

Every rank runs the cross-rank start diagnosis (the same findings on each rank, the rank table filled);
only rank 0 renders the report. Single-process behaviour is covered by tests/test_callback.py and
tests/stack/test_lightning.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_harness import free_port

pytestmark = pytest.mark.distributed
HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def _torchrun(mode: str, tmp_path: Path) -> dict[int, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(HERE / "callback_job.py"), mode, str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = {}
    for r in (0, 1):
        out[r] = json.loads((tmp_path / f"rank{r}.json").read_text())
        out[r]["log"] = (tmp_path / f"rank{r}.log").read_text()
    return out


@pytest.mark.parametrize(
    ("mode", "expected", "header"),
    [
        # A bf16 Llama also holds its rotary frequencies in bf16: true, harmless at this length (info).
        ("hf", {"pure-bf16-adamw", "half-precision-rope-buffers"}, "mpdoctor at the start of training:"),
        ("lightning", {"lightning-true-half-adam"}, "mpdoctor at the start of fit:"),
    ],
)
def test_every_rank_diagnoses_across_ranks_and_only_rank_zero_renders(mode, expected, header, tmp_path):
    out = _torchrun(mode, tmp_path)
    for r in (0, 1):
        assert out[r]["world"] == 2 and out[r]["loss_finite"]  # a real 2-process DDP run trained
        assert out[r]["report"]["exchanged"]  # the cross-rank diagnosis ran on this rank
        assert out[r]["report"]["ranks"] == [0, 1]
        assert {f[0] for f in out[r]["report"]["findings"]} == expected
    assert out[0]["report"]["findings"] == out[1]["report"]["findings"]  # the same findings on both ranks
    assert header in out[0]["log"] and "WARN" in out[0]["log"]
    assert out[1]["log"] == ""  # rank 1 diagnosed but rendered nothing
