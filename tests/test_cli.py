"""``python -m mpdoctor`` in real subprocesses: what a user typing at a shell sees."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _mpdoctor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mpdoctor", *args], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )


def test_no_subcommand_prints_the_help_and_succeeds():
    out = _mpdoctor()
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: mpdoctor")
    for command in ("demo", "env", "checks"):
        assert f"    {command} " in out.stdout
    assert out.stderr == ""


def test_an_unknown_subcommand_is_a_usage_error_without_a_traceback():
    out = _mpdoctor("diagnose")
    assert out.returncode == 2
    assert "invalid choice: 'diagnose'" in out.stderr and "Traceback" not in out.stderr


def test_checks_lists_every_registered_check():
    from mpdoctor.checks import load

    out = _mpdoctor("checks")
    assert out.returncode == 0, out.stderr
    assert [line.split()[0] for line in out.stdout.splitlines()] == sorted(load())


def test_demo_without_transformers_says_to_install_the_hf_extra(tmp_path):
    """transformers absent, simulated: a ``transformers`` package earlier on PYTHONPATH whose import raises
    ImportError, exactly what Python raises when the package is not installed. Nothing of the library's
    behaviour is imitated; only its absence."""
    fake = tmp_path / "transformers"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise ImportError("No module named \'transformers\'")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    out = _mpdoctor("demo", env=env)
    assert out.returncode == 2
    assert "Traceback" not in out.stdout + out.stderr
    assert out.stderr.strip() == (
        "mpdoctor demo: the demo builds a tiny Llama with transformers, which is not installed: "
        'pip install "mpdoctor[hf]" (from a clone: pip install -e ".[hf]")'
    )
