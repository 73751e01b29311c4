"""notebook_launcher on this CPU, end to end: the pitfalls reproduced first, then the diagnosis, the fix, a launch that works.

Each launch runs ``launcher_job.py`` as ``__main__`` of a subprocess (notebook_launcher refuses to start in a
process whose accelerate state is already filled, which a shared pytest process may be), bounded by a timeout.
notebook_launcher forks its two workers itself (its start method on a CPU).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_harness import free_port

import mpdoctor
from mpdoctor.libraries.distributed.facts import DistributedFacts
from mpdoctor.rules.checks import run_checks

pytestmark = pytest.mark.distributed
HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def _launch(mode: str, tmp_path: Path) -> tuple[str, dict, dict[int, dict]]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(HERE / "launcher_job.py"), mode, str(tmp_path), str(free_port())],
                          env=env, capture_output=True, text=True, timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    return proc.stdout, json.loads((tmp_path / "parent.json").read_text()), ranks


def test_launch_without_cpu_true_trains_two_independent_copies_and_is_named(tmp_path):
    """The pitfall: ``Accelerator()`` (no ``cpu=True``) inside the launched function, on a CPU."""
    stdout, _parent, ranks = _launch("world-of-one", tmp_path)
    # The real behaviour first (accelerate 1.15): it announces CUDAs, each child trains alone.
    assert "Launching training on 2 CUDAs." in stdout
    for r in (0, 1):
        assert ranks[r]["distributed_type"] == "DistributedType.NO"
        assert ranks[r]["num_processes"] == 1
        assert ranks[r]["world_size"] == 2  # a 2-rank process group exists, yet prepare() wrapped nothing
        assert ranks[r]["loss_finite"]
    assert ranks[0]["weights"] != ranks[1]["weights"]  # no gradient averaging: two different models after one step
    # The diagnosis on each rank names the root cause and shows the fix.
    for r in (0, 1):
        report = ranks[r]["report"]
        assert report["severities"] == {"launch-world-of-one": "error"}
        assert f"rank {r} of 2" in report["messages"]["launch-world-of-one"]
        assert "Accelerator(cpu=True" in report["fix_code"]["launch-world-of-one"][0]


def test_launch_with_cpu_true_is_distributed_and_quiet(tmp_path):
    """The fix (accelerate's CPU recipe, a healthy recipe): ``Accelerator(cpu=True)`` inside the function."""
    stdout, _parent, ranks = _launch("cpu", tmp_path)
    for r in (0, 1):
        assert ranks[r]["distributed_type"] == "DistributedType.MULTI_CPU"
        assert ranks[r]["num_processes"] == 2
        assert ranks[r]["report"]["slugs"] == []  # no error, no warning
        assert ranks[r]["loss_finite"]
    assert ranks[0]["weights"] == ranks[1]["weights"]  # DDP averaged the gradients: one model


def test_accelerator_created_before_the_launch_is_named_reset_and_the_launch_works(tmp_path):
    """The classic pitfall: a cell creates an Accelerator, then notebook_launcher refuses to start."""
    _stdout, parent, ranks = _launch("early", tmp_path)
    # accelerate's real refusal, reproduced first
    assert parent["error"] == (
        "To launch a multi-device training from your notebook, the `Accelerator` should only be initialized inside "
        "your training function. Restart your notebook and make sure no cells initializes an `Accelerator`."
    )
    assert parent["before"]["severities"] == {"launcher-initialized-early": "error"}
    assert "AcceleratorState._reset_state(True)" in parent["before"]["fix_code"]["launcher-initialized-early"][0]
    # The fix, in place through the API: accelerate's shared state cleared, a report taken before reads it in place,
    # and a real notebook_launcher(num_processes=2) call starts and trains on both ranks.
    fix = parent["fix"]
    assert fix["applicability"] == "unsafe" and not fix["in_place_before"]
    assert fix["applied"] and fix["cleared"] and fix["older_in_place"]
    assert fix["refusal_after"] is None
    # Undo: the very dicts the kernel's Accelerator reads hold exactly what they held; accelerate refuses again.
    assert fix["undo_exact"] and fix["refusal_after_undo"] == parent["error"]
    # Through the widget's button (unsafe: clicked, then confirmed): cleared, and nothing is left to say.
    assert "failed" not in parent["widget"]["status"] and parent["widget"]["cleared"]
    assert parent["after"]["slugs"] == []
    for launch in (parent["api_ranks"], ranks):  # each retried launch is a real 2-process training
        for r in (0, 1):
            r = launch[r] if r in launch else launch[str(r)]
            assert r["num_processes"] == 2 and r["report"]["slugs"] == [] and r["loss_finite"]
        assert (launch.get(0) or launch["0"])["weights"] == (launch.get(1) or launch["1"])["weights"]


def test_cuda_initialised_before_the_launch_is_named_from_facts():
    """GPU-only: CUDA cannot be initialised on this CPU, so the device fact is built by hand.

    On a GPU, forked workers then fail with "Cannot re-initialize CUDA in forked subprocess", which
    notebook_launcher re-raises as "CUDA has been initialized before the `notebook_launcher` could create a
    forked subprocess" (accelerate ``launchers.py``); not reproduced here.
    """
    base = mpdoctor.diagnose().facts
    facts = dataclasses.replace(base, distributed=DistributedFacts(launcher_imported=True, cuda_initialized=True))
    found = [f for f in run_checks(facts) if f.check == "launcher-initialized-early"]
    assert [(f.severity, f.subject) for f in found] == [("error", "torch.cuda")]
    # a launched worker (WORLD_SIZE set) is not the kernel: nothing to say there
    worker = dataclasses.replace(base, distributed=DistributedFacts(launcher_imported=True, cuda_initialized=True, env_world_size=2))
    assert not [f for f in run_checks(worker) if f.check == "launcher-initialized-early"]
