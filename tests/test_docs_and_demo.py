"""The README and docs/ stay true to the code, the package is what people meet on an index page, and
`python -m mpdoctor demo` diagnoses and fixes its setup."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from mpdoctor.attach.crash.catalogue import catalogue_markdown
from mpdoctor.front.docs import reference_section, rules_reference
from mpdoctor.rules.checks import SECTIONS, load

ROOT = Path(__file__).resolve().parent.parent


def test_every_check_documents_ruffs_sections_severity_and_sources():
    registry = load()
    assert len(registry) >= 20
    for slug, chk in registry.items():
        assert slug == slug.lower() and " " not in slug
        assert all(chk.sections.get(s) for s in SECTIONS), slug
        assert chk.severity in ("error", "warning", "info")


def test_the_rules_reference_in_docs_is_generated_from_the_rules():
    text = (ROOT / "docs" / "checks.md").read_text(encoding="utf-8")
    assert reference_section(text) == rules_reference().strip(), (
        "docs/checks.md is stale: run `python -m mpdoctor checks --update-docs`"
    )
    for slug in list(load()) + ["amp-clip-before-unscale"]:
        assert f"### `{slug}` (" in text, slug
    families = (ROOT / "docs" / "exception-families.md").read_text(encoding="utf-8")
    assert families == catalogue_markdown(), "run `python -m mpdoctor checks --update-docs`"


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


REPO = "https://github.com/mpdoctor/mpdoctor"
RAW = "https://raw.githubusercontent.com/mpdoctor/mpdoctor/main/"


def _repo_path(url: str) -> str | None:
    """The repository path a link or image URL points at, or None when it points outside the repository."""
    for prefix in (f"{REPO}/blob/main/", f"{REPO}/tree/main/", RAW):
        if url.startswith(prefix):
            return url[len(prefix):].split("#")[0]
    return None


def test_the_readme_links_and_images_are_absolute_and_point_at_files_of_the_repository():
    """The README is the package's long description: on an index page a relative link or image is broken."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"<img[^>]*src=\"([^\"]+)\"", text)
    assert targets
    for target in targets:
        assert "://" in target, f"relative link or image (broken on an index page): {target}"
        path = _repo_path(target)
        assert path is not None and (ROOT / path).exists(), target
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    # The report's picture at the top, and the compare() heatmap in its own section.
    assert [i.rsplit("/", 1)[-1] for i in images] == ["widget-light.png", "compare-heatmap.png"]
    assert all(i.startswith(RAW) for i in images)


def test_the_readme_is_short_and_keeps_what_a_newcomer_needs():
    raw = (ROOT / "README.md").read_bytes()
    assert len(raw) <= 30 * 1024, f"README is {len(raw)} bytes"
    text = raw.decode("utf-8")
    for must in ("## Who it is for", "## Install", "## Start in 60 seconds", "## Two commands from a clone",
                 "## When it crashes", "## Documentation", "make demo", "make test"):
        assert must in text, must
    assert "local mirror" not in text and "checks-reference:start" not in text
    for page in ("checks", "guarantees", "benchmarks", "stack", "distributed", "field-cases"):
        assert f"{REPO}/blob/main/docs/{page}.md" in text, page
    # the first make demo, measured on a fresh clone: a time and a venv size
    assert re.search(r"first `make demo` took \d+ min \d+ s and left a [\d.]+ [MG]B `\.venv`", text)


def test_the_moved_sections_live_in_docs():
    guarantees = (ROOT / "docs" / "guarantees.md").read_text(encoding="utf-8")
    assert "never raises on user objects" in guarantees and "tests/test_treatment.py" in guarantees
    bench = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert "| figure | mpdoctor | baseline | ratio | target |" in bench
    assert not re.search(r"\bwas\b", bench), "figures only: no 'was' history"
    assert "DeepSpeed" in (ROOT / "docs" / "stack.md").read_text(encoding="utf-8")
    assert "distributed=True" in (ROOT / "docs" / "distributed.md").read_text(encoding="utf-8")
    for page in ("stack", "distributed", "guarantees", "benchmarks"):
        text = (ROOT / "docs" / f"{page}.md").read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if "://" not in target:
                assert (ROOT / "docs" / target.split("#")[0]).exists(), (page, target)


def test_the_readme_install_section_names_extras_that_exist():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    install = text.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert {e for e in extras if f"`{e}`" in install or f"[{e}]" in install} == set(extras)  # each one explained
    assert set(re.findall(r"\[(\w+)\]", install)) <= set(extras)  # and none that does not exist


# -- packaging as people meet it -------------------------------------------------------------------------


def test_the_package_ships_a_license_urls_classifiers_and_type_hints():
    import tomllib

    license_text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    meta = project["project"]
    assert meta["license"] == "Apache-2.0" and meta["license-files"] == ["LICENSE"]
    assert {"Source", "Documentation"} <= set(meta["urls"])
    assert all(url.startswith(REPO) for url in meta["urls"].values())
    assert "Typing :: Typed" in meta["classifiers"]
    assert (ROOT / "mpdoctor" / "py.typed").exists()
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["mpdoctor"]
    ignored = (ROOT / ".gitignore").read_text(encoding="utf-8").split()
    assert "dist/" in ignored and "build/" in ignored


def test_the_built_wheel_holds_py_typed_the_license_and_a_long_description_without_relative_links(tmp_path):
    import zipfile

    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = tmp_path.glob("mpdoctor-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert "mpdoctor/py.typed" in names
        assert any(n.endswith("licenses/LICENSE") for n in names)
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode("utf-8")
    description = metadata.split("\n\n", 1)[1]
    links = re.findall(r"\]\(([^)\s]+)\)", description)
    assert links and all("://" in link for link in links), [link for link in links if "://" not in link]
    assert "Project-URL: Source, https://github.com/mpdoctor/mpdoctor" in metadata


def test_make_demo_installs_what_the_demo_needs_and_nothing_more():
    import tomllib

    out = subprocess.run(["make", "-n", "-B", "demo"], capture_output=True, text=True, timeout=60, cwd=ROOT, check=True)
    installs = [line for line in out.stdout.splitlines() if "pip install" in line and "--upgrade pip" not in line]
    assert installs == ['.venv/bin/python -m pip install --progress-bar off -c constraints.txt -e ".[demo]"'], installs
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    demo = " ".join(extras["demo"]).lower()
    assert set(extras["hf"]) <= set(extras["demo"]) and "adamw-bf16" in demo
    for heavy in ("jupyterlab", "playwright", "lightning", "diffusers", "deepspeed", "bitsandbytes", "pytest"):
        assert heavy not in demo
    # make test installs the rest, and every install of every target is pinned by the constraints
    full = subprocess.run(["make", "-n", "-B", "test"], capture_output=True, text=True, timeout=60, cwd=ROOT, check=True)
    pip_lines = [line for line in full.stdout.splitlines() if "pip install" in line and "--upgrade pip" not in line]
    assert any('".[test,browser,stack]"' in line for line in pip_lines) and any("deepspeed" in line for line in pip_lines)
    assert all("-c constraints" in line for line in pip_lines), pip_lines
    # when make test is what creates .venv, its demo install does not byte-compile torch either
    assert any('DEMO_PIP_INSTALL="--no-compile"' in line for line in full.stdout.splitlines())
