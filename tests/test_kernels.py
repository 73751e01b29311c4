"""The CPU kernels a run uses are the ones it says: the ``kernels`` corner forces them, and this checks it took.

``make test`` runs the numerics-sensitive tests (``KERNELS`` in ``tests/corners.py``) again under
``ATEN_CPU_CAPABILITY=default`` and ``=avx2``. An environment variable that torch ignored would make that corner
a third copy of the pinned run; this test fails instead.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from corners import KERNEL_CAPABILITIES

#: What torch.backends.cpu.get_cpu_capability() answers, lowest first.
_KNOWN = ("DEFAULT", "VSX", "ZVECTOR", "SVE256", "NEON", "AVX2", "AVX512")


def test_the_cpu_capability_torch_runs_is_the_forced_one_or_one_it_knows():
    running = torch.backends.cpu.get_cpu_capability()
    forced = os.environ.get("ATEN_CPU_CAPABILITY", "")
    if forced:
        assert running == forced.upper(), f"ATEN_CPU_CAPABILITY={forced} but torch runs {running}"
        assert os.environ.get("ONEDNN_MAX_CPU_ISA") == KERNEL_CAPABILITIES[forced.lower()]
    else:
        assert running in _KNOWN


def test_forcing_a_capability_changes_the_kernels_torch_picks():
    # The mechanism the corner relies on, checked in a fresh interpreter: the variable is read at import.
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": KERNEL_CAPABILITIES["default"]}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "DEFAULT"
