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


def test_checks_lists_every_rule_of_the_three_kinds_with_its_kind_and_severity():
    from mpdoctor.rules.engine.rules import load_rules

    out = _mpdoctor("checks")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    rules = load_rules()
    assert [line.split()[0] for line in lines] == sorted(rules)
    for line in lines:
        slug, kind, rest = line.split(None, 2)
        rule = rules[slug]
        assert kind == rule.kind.value and rest.startswith(rule.severity_label + " "), line
    assert {line.split()[1] for line in lines} == {"check", "runtime", "crash-family"}


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


def test_version_prints_the_package_version():
    import mpdoctor

    out = _mpdoctor("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"mpdoctor {mpdoctor.__version__}"


def test_run_usage_shows_that_the_scripts_arguments_are_optional():
    out = _mpdoctor("run", "--help")
    assert out.returncode == 0, out.stderr
    usage = out.stdout.split("\n\n")[0]
    assert usage.endswith("script [args ...]"), usage
    missing = _mpdoctor("run")
    assert missing.returncode == 2 and "script [args ...]" in missing.stderr


def test_no_restructuredtext_markup_in_cli_text_or_json_output():
    import mpdoctor

    listing = _mpdoctor("checks")
    assert listing.returncode == 0 and "``" not in listing.stdout and ":func:" not in listing.stdout
    import torch

    model = torch.nn.Linear(4, 4).half()
    opt = torch.optim.AdamW(model.parameters(), eps=1e-8)
    report = mpdoctor.diagnose(model, opt, torch.amp.GradScaler("cpu"))
    assert report.findings and any(f["why"] for f in report.to_dict()["findings"])
    for output in (report.to_text(), report.to_json()):
        assert "``" not in output and ":class:`" not in output and ":func:`" not in output


def test_the_rules_reference_is_generated_into_docs_checks_md_and_the_families_beside_it(tmp_path):
    page = tmp_path / "docs" / "checks.md"
    out = _mpdoctor("checks", "--update-docs", str(page))
    assert out.returncode == 0, out.stderr
    assert "updated" in out.stdout
    again = _mpdoctor("checks", "--update-docs", str(page))
    assert "already up to date" in again.stdout
    text = page.read_text(encoding="utf-8")
    assert "### `scaler-with-bf16` (error or warning)" in text and "### `amp-clip-before-unscale` (error)" in text
    assert (tmp_path / "docs" / "exception-families.md").read_text(encoding="utf-8") == (
        ROOT / "docs" / "exception-families.md"
    ).read_text(encoding="utf-8")
