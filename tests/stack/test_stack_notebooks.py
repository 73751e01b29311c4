"""The teaching notebooks that need the training stack (``mpdoctor.stack: true``) run top to bottom here.

``tests/test_notebooks.py`` checks every notebook's pairing, badges and outputs in both venvs but executes
only the core ones; these run in the main venv, where the stack libraries are pinned, and must pass (never
skip) there.
"""

from __future__ import annotations

import os
import sys

import nbformat
import pytest
from test_notebooks import (
    check_lessons,
    is_stack_notebook,
    missing_requirements,
    notebook_paths,
    run_notebook,
)

STACK_NOTEBOOKS = [p for p in notebook_paths() if is_stack_notebook(p)]


def test_the_qlora_notebook_is_a_stack_notebook():
    assert {"07_qlora_compute_dtype", "10_fp8_what_if"} <= {p.stem for p in STACK_NOTEBOOKS}


@pytest.mark.parametrize("path", STACK_NOTEBOOKS, ids=lambda p: p.stem)
def test_stack_notebook_runs_top_to_bottom_and_its_claims_hold(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    assert not missing_requirements(nb), f"{path.name} needs {missing_requirements(nb)}"
    before = path.read_bytes()
    executed, kernel, seconds = run_notebook(path, sys.executable, tmp_path)
    assert kernel["prefix"] == os.path.realpath(sys.prefix)
    check_lessons(executed)
    assert path.read_bytes() == before
    print(f"{path.name}: {seconds:.1f} s")  # reported, not asserted: a wall-clock bound fails under load
