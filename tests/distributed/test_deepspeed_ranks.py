"""DeepSpeed on two gloo processes: what each rank's diagnosis says about a real ZeRO job.

Each job is a ``torch.distributed.run`` launch bounded by a subprocess timeout (a missing peer would
otherwise wait for the 30-minute default); the shm op is built once, before, into the private
extensions dir.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from deepspeed_support import EXTENSIONS, ensure_shm_op, free_port

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("deepspeed_worker.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 150


@pytest.fixture(scope="module", autouse=True)
def shm_op():
    ensure_shm_op()


def _launch(tmp_path, stage: int, comm: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(TORCH_EXTENSIONS_DIR=str(EXTENSIONS), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port(),
           str(WORKER), str(stage), comm, str(tmp_path)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the launcher and both ranks: its own session
        proc.communicate()
        raise
    assert proc.returncode == 0, output.decode()[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_zero3_bf16_two_ranks_is_healthy_on_every_rank(tmp_path):
    """ZeRO-3 bf16, DeepSpeed's recommended recipe: bf16 module, fp32 master partitions, no error or warning."""
    ranks = _launch(tmp_path, 3, "fp32")
    for r in ranks:
        assert not [f for f in r["findings"] if f[0] in ("error", "warning")], r
        assert r["facts"] == {"zero_stage": 3, "bf16": True, "communication_data_type": "float32",
                              "master_dtype": "float32", "module_dtype": "bfloat16"}
        assert r["skipped_steps"] == 0


def test_fp16_reduction_across_ranks_skips_the_step_and_is_named(tmp_path):
    """https://github.com/deepspeedai/DeepSpeed/issues/2071 across two ranks: one rank's large bf16 gradients
    overflow the fp16 all-reduce and BOTH ranks skip the step; each rank's diagnosis names it."""
    ranks = _launch(tmp_path, 2, "fp16")
    for r in ranks:
        assert r["skipped_steps"] == 1, r
        assert ["warning", "deepspeed-low-precision-reduction"] in r["findings"]
