"""Binder builds from ``binder/`` and the tour runs there.

repo2docker sees a ``binder/`` folder, ignores the root ``pyproject.toml`` and
runs ``pip install -r binder/requirements.txt`` from the repository root in a
fresh environment that already holds Jupyter and ipykernel. This test does the
same in a fresh venv (no system site-packages) and executes ``00_tour.ipynb``
with that venv's interpreter as the kernel.

Offline, the ``--extra-index-url`` of PyTorch's CPU wheels cannot be reached:
pip warns and takes torch 2.13.0 from its other sources (this machine's pip
configuration points at local wheels). Each unreachable lookup is retried 5
times by default, which alone costs about ten minutes over ~80 packages, so the
test runs pip with ``PIP_RETRIES=0``: the same install, without the waiting.
It also passes ``--no-compile``: pip then leaves the byte-compiling of the ~80
packages (torch's and transformers' thousands of modules) to the imports that
need it, which halves the install (111 s to 62 s here) and installs the same
files. pip's cache is reused. ``MPDOCTOR_SKIP_BINDER=1`` skips this test (about two
minutes on two cores). Those minutes are not silent: each step and each package
pip collects is printed as it happens, past pytest's output capture.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_notebooks import NOTEBOOKS, ROOT, check_lessons, run_notebook

BINDER = ROOT / "binder"

pytestmark = pytest.mark.skipif(os.environ.get("MPDOCTOR_SKIP_BINDER") == "1", reason="MPDOCTOR_SKIP_BINDER=1")


def requirement_lines() -> list[str]:
    lines = (BINDER / "requirements.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def test_binder_files_pin_python_and_a_cpu_torch_and_install_this_repository():
    assert (BINDER / "runtime.txt").read_text().strip() == "python-3.11"
    lines = requirement_lines()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines
    assert "torch==2.13.0" in lines
    assert ".[hf]" in lines  # the repository itself: repo2docker ignores pyproject.toml once binder/ exists
    assert not (BINDER / "postBuild").exists() or os.access(BINDER / "postBuild", os.X_OK)


def _say(capsys, text: str) -> None:
    """A progress line on the terminal now, even while pytest captures the test's output."""
    with capsys.disabled():
        print(f"\n[binder] {text}", end="", flush=True)


def _pip_with_progress(capsys, args: list[str], timeout: float, **kwargs) -> tuple[int, str]:
    """Run pip, echoing the lines that show progress (one per package); return (exit code, full output)."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(("Collecting", "Installing collected", "Successfully installed")):
                _say(capsys, "pip: " + line.strip()[:150])
        proc.wait()
    finally:
        timer.cancel()
    return proc.returncode, "".join(lines)


def test_a_fresh_venv_installed_from_binder_requirements_runs_the_tour(tmp_path, capsys):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    cfg = (venv / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in cfg
    python = str(venv / "bin" / "python")

    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"))}
    env.update(PIP_RETRIES="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
    # As repo2docker: from the repository root; ipykernel stands in for its base environment.
    _say(capsys, "installing binder/requirements.txt into a fresh venv, as repo2docker does (a few minutes)")
    code, output = _pip_with_progress(
        capsys,
        [python, "-m", "pip", "install", "--no-compile", "--progress-bar", "off", "-r", "binder/requirements.txt", "ipykernel"],
        timeout=900,
        cwd=ROOT,
        env=env,
    )
    assert code == 0, output[-4000:]
    versions = subprocess.run(
        [python, "-c", "import sys, torch; print(sys.version_info[:2], torch.__version__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert versions.startswith("(3, 11)") and "2.13.0" in versions, versions

    workdir = tmp_path / "run"
    workdir.mkdir()
    _say(capsys, "running notebooks/00_tour.ipynb in that venv's kernel\n")
    executed, kernel, seconds = run_notebook(NOTEBOOKS / "00_tour.ipynb", python, workdir, env=env)
    assert kernel["prefix"] == os.path.realpath(venv), kernel
    assert Path(kernel["mpdoctor"]).is_relative_to(os.path.realpath(venv)), f"mpdoctor came from {kernel['mpdoctor']}"
    check_lessons(executed)
    print(f"00_tour.ipynb in the Binder venv: {seconds:.1f} s")


def test_binder_requirements_install_every_library_a_notebook_imports():
    """Binder runs every lesson, the stack one included: each top-level module a notebook imports is either the
    standard library, mpdoctor's own dependencies (with the hf extra), or a line of binder/requirements.txt."""
    import ast

    import tomllib

    provided = {"mpdoctor", "torch", "pandas", "IPython", "ipywidgets", "tqdm"}  # mpdoctor and its dependencies
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    lines = requirement_lines()
    if ".[hf]" in lines:
        provided |= {re.split(r"[<>=\[ ]", req)[0] for req in extras["hf"]}
    provided |= {re.split(r"[<>=\[ ]", line)[0].replace("-", "_") for line in lines if not line.startswith(("-", "."))}
    imported: dict[str, set[str]] = {}
    for source in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py")):
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for name in names:
                imported.setdefault(name.split(".")[0], set()).add(source.stem)
    missing = {m: sorted(nbs) for m, nbs in imported.items() if m not in provided and m not in sys.stdlib_module_names}
    assert not missing, f"binder/requirements.txt installs nothing for {missing}"
    assert "bitsandbytes" in imported and "07_qlora_compute_dtype" in imported["bitsandbytes"]
