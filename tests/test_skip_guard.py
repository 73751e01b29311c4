"""The skip guard of ``tests/conftest.py``: with ``MPDOCTOR_NO_SKIPS=1`` a skipped test or module fails the run.

Run on a throwaway suite (a copy of the real conftest and two tiny test files) in a pytest subprocess.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
SKIPS_A_TEST = "import pytest\n\n\ndef test_skips():\n    pytest.skip('no thing')\n\n\ndef test_passes():\n    pass\n"
SKIPS_A_MODULE = "import pytest\n\npytest.importorskip('no_such_module_for_mpdoctor')\n\n\ndef test_x():\n    pass\n"


def _run(tmp_path: pathlib.Path, name: str, guard: bool) -> subprocess.CompletedProcess:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    shutil.copy(HERE / "corners.py", tmp_path / "corners.py")  # the conftest reads the support matrix's corners
    (tmp_path / name).write_text(SKIPS_A_TEST if name == "test_a.py" else SKIPS_A_MODULE)
    env = {k: v for k, v in os.environ.items() if k != "MPDOCTOR_NO_SKIPS"}
    if guard:
        env["MPDOCTOR_NO_SKIPS"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_without_the_guard_a_skip_is_a_skip(tmp_path):
    proc = _run(tmp_path, "test_a.py", guard=False)
    assert proc.returncode == 0, proc.stdout
    assert "1 passed, 1 skipped" in proc.stdout


def test_with_the_guard_a_skipped_test_fails_the_run(tmp_path):
    proc = _run(tmp_path, "test_a.py", guard=True)
    assert proc.returncode == 1, proc.stdout
    assert "1 failed, 1 passed" in proc.stdout and "MPDOCTOR_NO_SKIPS=1 makes a skip a failure" in proc.stdout


def test_with_the_guard_a_module_level_importorskip_fails_the_run(tmp_path):
    proc = _run(tmp_path, "test_b.py", guard=True)
    assert proc.returncode != 0, proc.stdout
    assert "no_such_module_for_mpdoctor" in proc.stdout and "1 error" in proc.stdout


def test_the_files_the_conftest_runs_first_exist_and_xdist_keeps_that_order(pytestconfig):
    """A renamed slow file would drop out of the longest-first order silently; xdist would reorder by test count."""
    import conftest

    missing = [f for f in conftest.SLOW_FILES if not (HERE.parent / f).is_file()]
    assert not missing, f"tests/conftest.py SLOW_FILES names files that do not exist: {missing}"
    assert getattr(pytestconfig.option, "loadscopereorder", False) is False
