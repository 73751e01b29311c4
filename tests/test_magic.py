"""%mpdoctor through a real IPython InteractiveShell (also run on Colab's IPython 7.34)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.colab


@pytest.fixture()
def ip():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext mpdoctor", store_history=False)
    yield shell
    for name in ("model", "scaler", "opt", "r", "batch", "nothing"):
        shell.user_ns.pop(name, None)
    shell.run_cell("%unload_ext mpdoctor", store_history=False)


def _bf16_setup(ip):
    ip.user_ns["model"] = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).to(
        torch.bfloat16
    )
    ip.user_ns["scaler"] = torch.amp.GradScaler("cpu")


def test_bare_magic_discovers_the_namespace_and_returns_a_report(ip, capsys):
    _bf16_setup(ip)
    result = ip.run_cell("r = %mpdoctor --text")
    assert result.success and result.error_in_exec is None
    report = ip.user_ns["r"]
    assert [s.name for s in report.subjects] == ["model", "scaler"]
    assert report.findings_for("scaler-with-bf16")
    out = capsys.readouterr().out
    assert "scaler-with-bf16" in out and "inspected: model (Sequential), scaler (GradScaler)" in out


def test_named_objects_only_are_inspected(ip):
    _bf16_setup(ip)
    ip.run_cell("r = %mpdoctor model --text")
    assert [s.name for s in ip.user_ns["r"].subjects] == ["model"]


def test_a_missing_name_gives_one_clear_line_and_no_traceback(ip, capsys):
    result = ip.run_cell("%mpdoctor nothing")
    assert result.error_in_exec is None and result.result is None
    assert capsys.readouterr().out.strip() == "mpdoctor: no such variable: nothing"


def test_names_are_looked_up_never_evaluated(ip, capsys):
    ip.user_ns["touched"] = []
    result = ip.run_cell("%mpdoctor touched.append(1)")
    out = capsys.readouterr().out
    assert result.error_in_exec is None
    assert ip.user_ns["touched"] == []
    assert out.startswith("mpdoctor: no such variable") or out.startswith("mpdoctor: unrecognized")


def test_import_os_system_is_a_no_such_variable_line(ip, capsys):
    result = ip.run_cell("%mpdoctor __import__('os').system('x')")
    assert result.error_in_exec is None
    assert "mpdoctor:" in capsys.readouterr().out


def test_json_and_markdown_outputs(ip, capsys):
    import json

    _bf16_setup(ip)
    ip.run_cell("r = %mpdoctor --json")
    data = json.loads(capsys.readouterr().out)
    assert any(f["check"] == "scaler-with-bf16" for f in data["findings"])
    ip.run_cell("r = %mpdoctor --markdown")
    assert "## mpdoctor report" in capsys.readouterr().out


def test_target_and_ignore_options(ip, capsys):
    _bf16_setup(ip)
    ip.run_cell("r = %mpdoctor --target T4 --ignore scaler-with-bf16 --text")
    report = ip.user_ns["r"]
    assert report.target == "T4" and not report.findings_for("scaler-with-bf16")
    assert "T4 (sm_75, what-if)" in capsys.readouterr().out


def test_unknown_target_is_one_line(ip, capsys):
    result = ip.run_cell("%mpdoctor --target Z80")
    assert result.error_in_exec is None
    assert capsys.readouterr().out.strip().startswith("mpdoctor: unknown target 'Z80'")


def test_bad_option_is_one_line(ip, capsys):
    result = ip.run_cell("%mpdoctor --no-such-option")
    assert result.error_in_exec is None
    assert "mpdoctor:" in capsys.readouterr().out


def test_magic_docstring_documents_the_options(ip):
    doc = ip.find_line_magic("mpdoctor").__doc__
    for option in ("--text", "--json", "--markdown", "--target", "--scan", "--ignore"):
        assert option in doc


def test_last_line_magic_is_displayed_once(ip, capsys):
    _bf16_setup(ip)
    ip.run_cell("%mpdoctor")
    out = capsys.readouterr().out
    assert out.count("inspected: model") == 1


def test_config_sets_a_default_target(ip):
    _bf16_setup(ip)
    ip.run_cell("%config MPDoctorMagics.target = 'V100'")
    try:
        ip.run_cell("r = %mpdoctor --text")
        assert ip.user_ns["r"].target == "V100"
    finally:
        ip.run_cell("%config MPDoctorMagics.target = None")
