"""The README stays true to the code, and `python -m mpdoctor demo` diagnoses and fixes its setup."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from mpdoctor.checks import SECTIONS, checks_reference, load
from mpdoctor.cli.docs import readme_section

ROOT = Path(__file__).resolve().parent.parent


def test_every_check_documents_what_why_fix_and_source():
    registry = load()
    assert len(registry) >= 20
    for slug, chk in registry.items():
        assert slug == slug.lower() and " " not in slug
        assert all(chk.sections.get(s) for s in SECTIONS), slug
        assert chk.severity in ("error", "warning", "info")


def test_readme_checks_reference_is_generated_from_the_docstrings():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme_section(text) == checks_reference().strip(), (
        "README checks reference is stale: run `python -m mpdoctor checks --update-readme README.md`"
    )


def test_demo_shows_the_failure_diagnoses_fixes_and_trains():
    out = subprocess.run(
        [sys.executable, "-m", "mpdoctor", "demo"], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    # One line first says what is broken, before any section.
    assert text.splitlines()[0].startswith("The broken setup: a tiny Llama cast to bf16 with its output head left in fp32")
    assert "training step failed" in text.split("=== 2.")[0]  # the broken setup really breaks
    # Every unsafe fix the demo applies (in a notebook: a second click) comes with its reason.
    applied = text.split("=== 3.")[1].split("=== 4.")[0].splitlines()
    unsafe = [i for i, line in enumerate(applied) if line.startswith("applied (unsafe):")]
    assert unsafe
    for i in unsafe:
        assert applied[i + 1].strip().startswith("why: ") and len(applied[i + 1].strip()) > len("why: ") + 10
    assert "ERROR" in text.split("=== 3.")[0] or "WARN" in text.split("=== 3.")[0]
    after = text.split("=== 4.")[1].split("=== 5.")[0]
    assert "0 errors | 0 warnings" in after
    assert "training step ran, loss" in text.split("=== 5.")[1]
    assert text.rstrip().endswith("result: fixed")


# -- from clone to click ------------------------------------------------------------------------------


def test_make_lab_passes_allow_root_exactly_when_run_as_root():
    # `make -n` prints the commands without running them (nor the venv's install).
    out = subprocess.run(["make", "-n", "lab"], capture_output=True, text=True, timeout=60, cwd=ROOT, check=True)
    lab = [line for line in out.stdout.splitlines() if " lab " in line and "jupyter" in line]
    assert len(lab) == 1 and lab[0].endswith("notebooks/00_tour.ipynb")
    assert ("--allow-root" in lab[0]) == (os.getuid() == 0)


def test_every_installing_step_of_the_makefile_announces_itself_and_shows_pips_progress():
    recipe = (ROOT / "Makefile").read_text(encoding="utf-8")
    for venv in ("$(BIN)", "$(COLAB_VENV)/bin"):
        install = next(line for line in recipe.splitlines() if f"{venv}/python -m pip install" in line and "-e " in line)
        assert " -q " not in install, install
        before = recipe.splitlines()[recipe.splitlines().index(install) - 1]
        assert before.strip().startswith('@echo "== installing'), before


def test_ruff_covers_the_notebook_sources_in_make_test_and_make_lint():
    recipe = (ROOT / "Makefile").read_text(encoding="utf-8")
    ruff_lines = [line.strip() for line in recipe.splitlines() if "ruff check" in line]
    assert len(ruff_lines) == 2 and all(line.endswith("mpdoctor tests bench notebooks") for line in ruff_lines)


def test_pyproject_declares_an_spdx_license_and_a_setuptools_that_reads_it():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in project["build-system"]["requires"]


def test_the_readme_links_only_inside_the_repository():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets and [t for t in targets if "://" in t] == []
    for target in targets:
        assert (ROOT / target.split("#")[0]).exists(), target


def test_the_readme_install_section_names_extras_that_exist():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    install = text.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert {e for e in extras if f"`{e}`" in install or f"[{e}]" in install} == set(extras)  # each one explained
    assert set(re.findall(r"\[(\w+)\]", install)) <= set(extras)  # and none that does not exist
