"""The teaching notebooks run top to bottom, from a clean kernel, and still teach the truth.

Each ``notebooks/NN_name.ipynb`` is paired with a jupytext percent source
``notebooks/NN_name.py`` (the file to edit); the two must hold the same cells.

Each notebook is executed with nbclient in a fresh kernel of *this* interpreter
(a kernelspec written to a temporary directory, so a stray ``python3`` spec on
the PATH cannot swap the interpreter), in a temporary working directory. The
executed copy lives in memory only: the committed notebooks stay output-free.
A notebook's last cell asserts its lesson; cells tagged ``raises-exception``
must really raise the error the lesson is about.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
CELL_TIMEOUT = 120  # seconds per cell
PROBE_CELL = """import json, os, sys
import mpdoctor
print(json.dumps({"prefix": os.path.realpath(sys.prefix), "mpdoctor": os.path.realpath(mpdoctor.__file__)}))"""


def notebook_paths() -> list[Path]:
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def is_stack_notebook(path: Path) -> bool:
    """Notebooks marked ``mpdoctor.stack: true`` need the training stack (bitsandbytes, diffusers, ...):
    ``tests/stack/test_stack_notebooks.py`` executes them in the main venv; the Colab venv has no stack."""
    return bool(nbformat.read(path, as_version=4).metadata.get("mpdoctor", {}).get("stack", False))


def core_notebook_paths() -> list[Path]:
    """The notebooks both venvs execute."""
    return [p for p in notebook_paths() if not is_stack_notebook(p)]


def write_kernelspec(directory: Path, python: str, name: str = "mpdoctor-under-test") -> tuple[str, Path]:
    """Write a kernelspec that launches ``python`` (absolute path) and return (name, kernels dir)."""
    kernels = directory / "kernels"
    spec_dir = kernels / name
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": f"mpdoctor test ({python})",
                "language": "python",
            }
        )
    )
    return name, kernels


def run_notebook(path: Path, python: str, workdir: Path, env: dict | None = None):
    """Execute a copy of ``path`` in a fresh kernel of ``python``; return (executed nb, kernel info, seconds).

    The kernel runs in ``workdir`` with IPython's profile directory inside it (no
    user startup files). A last cell, added to the in-memory copy only, reports
    which interpreter really ran.
    """
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    run = copy.deepcopy(nb)
    run.cells.append(nbformat.v4.new_code_cell(PROBE_CELL))
    name, kernels = write_kernelspec(workdir / "jupyter", python)
    km = AsyncKernelManager(kernel_name=name, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]))
    kernel_env = dict(os.environ if env is None else env)
    kernel_env["IPYTHONDIR"] = str(workdir / "ipython")
    kernel_env.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded
    for key in ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DOWNCAST_BF16", "ACCELERATE_USE_CPU"):
        kernel_env.pop(key, None)
    client = NotebookClient(
        run,
        km=km,
        timeout=CELL_TIMEOUT,
        startup_timeout=120,
        resources={"metadata": {"path": str(workdir)}},
    )
    start = time.perf_counter()
    client.execute(env=kernel_env)
    elapsed = time.perf_counter() - start
    probe = run.cells.pop()
    text = "".join(o.get("text", "") for o in probe.outputs if o.get("output_type") == "stream")
    return run, json.loads(text.strip().splitlines()[-1]), elapsed


def error_of(cell) -> str | None:
    """``"Name: value"`` of the error a cell raised, or None."""
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return f"{out['ename']}: {out['evalue']}"
    return None


def check_lessons(nb) -> None:
    """Every cell meant to fail did fail, with the error the lesson names; no other cell failed."""
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        error = error_of(cell)
        if "raises-exception" in cell.metadata.get("tags", []):
            expect = cell.metadata.get("mpdoctor", {}).get("expect", "")
            assert error is not None, f"cell {index} is meant to fail but did not:\n{cell.source}"
            assert expect in error, f"cell {index} raised {error!r}, the lesson says {expect!r}"
        else:
            assert error is None, f"cell {index} failed: {error}\n{cell.source}"


def missing_requirements(nb) -> list[str]:
    """Check slugs (or ``module:`` entries) a notebook needs that this installation lacks."""
    from mpdoctor.rules.checks import load

    registry = load()
    missing = []
    for req in nb.metadata.get("mpdoctor", {}).get("requires", []):
        if req.startswith("module:"):
            if importlib.util.find_spec(req.split(":", 1)[1]) is None:
                missing.append(req)
        elif req not in registry:
            missing.append(req)
    return missing


# -- the committed files --------------------------------------------------------------------


def test_every_notebook_has_a_percent_source_and_every_source_a_notebook():
    sources = sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.py"))
    assert sources == [p.stem for p in notebook_paths()]


@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.stem)
def test_each_notebook_and_its_percent_source_hold_the_same_cells(path):
    """The .py is what people edit and review, the .ipynb what Colab and Binder open: they cannot drift."""
    import jupytext

    source = path.with_suffix(".py")
    from_py, from_ipynb = jupytext.read(source), jupytext.read(path)
    stale = f"{path.stem}: the .py and the .ipynb differ; run `jupytext --sync notebooks/{source.name}`"
    assert from_ipynb.metadata["jupytext"]["formats"] == "ipynb,py:percent"
    assert [c.cell_type for c in from_py.cells] == [c.cell_type for c in from_ipynb.cells], stale
    for index, (a, b) in enumerate(zip(from_py.cells, from_ipynb.cells)):
        assert a.source == b.source, f"{stale} (cell {index})"
        assert a.metadata == b.metadata, f"{stale} (metadata of cell {index})"
    assert from_py.metadata.get("mpdoctor") == from_ipynb.metadata.get("mpdoctor"), stale
    # The other way round too: the .ipynb written as a percent source is the .py, byte for byte.
    assert jupytext.writes(from_ipynb, fmt="py:percent") == source.read_text(encoding="utf-8"), stale


@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.stem)
def test_committed_notebooks_have_no_outputs_and_no_execution_counts(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip outputs"
    assert "widgets" not in nb.metadata


@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.stem)
def test_each_notebook_opens_with_a_colab_badge_a_binder_link_and_a_guarded_install(path):
    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0].source
    assert f"https://colab.research.google.com/github/mpdoctor/mpdoctor/blob/main/notebooks/{path.name}" in first
    assert f"https://mybinder.org/v2/gh/mpdoctor/mpdoctor/main?labpath=notebooks%2F{path.name}" in first
    install = next(c.source for c in nb.cells if c.cell_type == "code")
    assert install.index("import mpdoctor") < install.index("except ImportError:") < install.index("%pip install")
    assert "%load_ext mpdoctor" in install
    assert any("torch.finfo" in c.source for c in nb.cells if c.cell_type == "code")
    assert "assert" in nb.cells[-1].source and "all claims hold" in nb.cells[-1].source


# -- execution ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", core_notebook_paths(), ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom_and_its_claims_hold(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    missing = missing_requirements(nb)
    assert not missing, f"{path.name} needs checks that are not registered: {', '.join(missing)}"
    before = path.read_bytes()
    executed, kernel, seconds = run_notebook(path, sys.executable, tmp_path)
    assert kernel["prefix"] == os.path.realpath(sys.prefix), f"the kernel ran {kernel}, not this venv"
    check_lessons(executed)
    assert path.read_bytes() == before, "executing must not write outputs back"
    print(f"{path.name}: {seconds:.1f} s")  # reported, not asserted: a wall-clock bound fails under load
