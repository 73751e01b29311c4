"""The code gates of ``make lint``: no dead code (vulture) and no function with a cyclomatic complexity above 20
(xenon). ``make test`` runs each on the code before the suite, spelled as ``make lint`` spells it (checked here:
running them again inside the suite would only repeat that work); each is shown to fail on code that breaks it."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
GATES = ("vulture", "xenon")


def _recipe(target: str) -> list[str]:
    """The command lines of a Makefile target's recipe."""
    lines = (ROOT / "Makefile").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def _gate_line(target: str, tool: str) -> str:
    return next(line for line in _recipe(target) if line.startswith(f"$(BIN)/{tool}"))


def _argv(line: str) -> list[str]:
    """A Makefile command line with ``$(BIN)`` read as this interpreter's environment."""
    return shlex.split(line.replace("$(BIN)", str(BIN)))


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.parametrize("tool", GATES)
def test_make_lint_and_make_test_run_the_same_gate(tool):
    assert _gate_line("lint", tool) == _gate_line("test-main", tool)



def _project(tmp_path: Path, source: str) -> Path:
    """A one-module project whose pyproject.toml carries the repository's vulture settings."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = config[config.index("[tool.vulture]") :].split("\n[", 1)[0]
    assert re.search(r"^paths = \[.*\]$", section, flags=re.M), section
    (tmp_path / "pyproject.toml").write_text(
        re.sub(r"^paths = \[.*\]$", 'paths = ["mpdoctor"]', section, flags=re.M), encoding="utf-8"
    )
    (tmp_path / "mpdoctor").mkdir()
    (tmp_path / "mpdoctor" / "__init__.py").write_text(textwrap.dedent(source), encoding="utf-8")
    return tmp_path


def test_the_dead_code_gate_fails_on_a_function_nobody_calls(tmp_path):
    used = "def helper():\n    return 1\n\n\nprint(helper())\n"
    assert _run(_argv(_gate_line("lint", "vulture")), _project(tmp_path / "used", used)).returncode == 0
    dead = "def helper():\n    return 1\n"
    out = _run(_argv(_gate_line("lint", "vulture")), _project(tmp_path / "dead", dead))
    assert out.returncode != 0 and "unused function 'helper'" in out.stdout


def _branches(n: int) -> str:
    """A function whose cyclomatic complexity is ``1 + n`` (one per ``if``)."""
    body = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(n))
    return f"def branchy(x):\n{body}    return -1\n\n\nprint(branchy(3))\n"


def test_the_complexity_gate_allows_20_and_fails_at_21(tmp_path):
    at_20 = _run(_argv(_gate_line("lint", "xenon")), _project(tmp_path / "at20", _branches(19)))
    assert at_20.returncode == 0, at_20.stdout + at_20.stderr
    at_21 = _run(_argv(_gate_line("lint", "xenon")), _project(tmp_path / "at21", _branches(20)))
    assert at_21.returncode != 0 and "branchy" in at_21.stderr + at_21.stdout
