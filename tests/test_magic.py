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
    for name in ("model", "scaler", "opt", "r", "batch", "nothing", "t", "cfg", "trainer"):
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


# -- a user's mistake is said as the user's mistake -------------------------------------------------------


def test_help_lists_every_target(ip, capsys):
    from mpdoctor.facts.hardware import PROFILES

    ip.run_cell("%mpdoctor?")
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--target GPU" in help_text
    for name in PROFILES:
        assert f" {name}," in help_text or f" {name}." in help_text, name


def test_naming_a_tensor_or_a_config_says_why_nothing_was_inspected(ip, capsys):
    from transformers import LlamaConfig

    ip.user_ns["t"] = torch.zeros(3, dtype=torch.float16)
    ip.user_ns["cfg"] = LlamaConfig(hidden_size=64, num_hidden_layers=1)
    result = ip.run_cell("r = %mpdoctor t cfg")
    out = capsys.readouterr().out.splitlines()
    assert result.error_in_exec is None and ip.user_ns["r"] is None
    assert out == [
        "mpdoctor: t is a tensor (float16): nothing to inspect on its own; name the model or optimizer that holds it",
        "mpdoctor: cfg is a LlamaConfig: a config is read through the model built from it; name the model",
    ]


def test_a_name_holding_nothing_is_explained_and_the_others_are_still_diagnosed(ip, capsys):
    _bf16_setup(ip)
    ip.user_ns["t"] = 3
    ip.run_cell("r = %mpdoctor model t --text")
    out = capsys.readouterr().out
    assert out.startswith("mpdoctor: t is an int: nothing to inspect (mpdoctor inspects models, optimizers,")
    assert [s.name for s in ip.user_ns["r"].subjects] == ["model"]


def test_a_trainer_brings_its_model_so_naming_both_explains_nothing(ip, capsys, tmp_path):
    from transformers import Trainer, TrainingArguments

    _bf16_setup(ip)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    ip.user_ns["trainer"] = Trainer(model=ip.user_ns["model"], args=args)
    ip.run_cell("r = %mpdoctor trainer model --text")
    assert "nothing to inspect" not in capsys.readouterr().out


def test_an_unknown_ignore_slug_is_an_error_with_close_matches(ip, capsys):
    _bf16_setup(ip)
    result = ip.run_cell("r = %mpdoctor --ignore scaler-bf16,cache-in-training --text")
    assert result.error_in_exec is None and ip.user_ns["r"] is None
    assert capsys.readouterr().out.strip() == (
        "mpdoctor: --ignore: unknown check 'scaler-bf16'; did you mean scaler-with-bf16? "
        "(python -m mpdoctor checks lists them)"
    )


def test_an_unknown_slug_in_the_configured_ignore_list_is_named_as_coming_from_there(ip, capsys):
    _bf16_setup(ip)
    ip.run_cell("%config MPDoctorMagics.ignore = ['cache-in-trainning']")
    try:
        ip.run_cell("r = %mpdoctor --text")
        assert ip.user_ns["r"] is None
        out = capsys.readouterr().out
        assert out.startswith("mpdoctor: MPDoctorMagics.ignore: unknown check 'cache-in-trainning'; did you mean cache-in-training?")
    finally:
        ip.run_cell("%config MPDoctorMagics.ignore = []")


def test_the_report_says_how_many_findings_the_ignore_list_hid(ip, capsys):
    _bf16_setup(ip)
    ip.run_cell("r = %mpdoctor --ignore scaler-with-bf16 --text")
    out = capsys.readouterr().out
    assert not ip.user_ns["r"].findings_for("scaler-with-bf16")
    assert out.rstrip().splitlines()[-1] == "mpdoctor: 1 finding hidden by the ignore list (scaler-with-bf16 1)"


def test_the_hidden_count_keeps_json_parseable(ip, capsys):
    import json

    _bf16_setup(ip)
    ip.run_cell("r = %mpdoctor --ignore scaler-with-bf16 --json")
    assert json.loads(capsys.readouterr().out)["findings"] == []


def test_probe_with_a_non_batch_says_it_is_not_a_batch(ip, capsys):
    from transformers import LlamaConfig

    _bf16_setup(ip)
    ip.user_ns["cfg"] = LlamaConfig(hidden_size=64, num_hidden_layers=1)
    result = ip.run_cell("r = %mpdoctor model --probe cfg")
    out = capsys.readouterr().out
    assert result.error_in_exec is None and ip.user_ns["r"] is None
    assert "internal error" not in out
    assert out.strip() == (
        "mpdoctor: --probe cfg: cfg is a LlamaConfig, not a batch; give a dict of keyword arguments for forward, "
        "a tensor, or a tuple/list of positional arguments"
    )


def test_probe_says_that_it_ran_and_what_it_found_when_nothing_is_wrong(ip, capsys):
    _bf16_setup(ip)
    ip.user_ns["batch"] = torch.randn(2, 4, dtype=torch.bfloat16)
    ip.run_cell("r = %mpdoctor model --probe batch --text")
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    report = ip.user_ns["r"]
    assert report.facts.probes and report.facts.probes[0].backward
    assert last.startswith("mpdoctor: probed model on batch: one forward and backward, no autocast, 4 modules, loss ")
    assert last.endswith("; no module raised, went NaN/Inf or passed fp16's 65504")


def test_probe_names_what_it_found(ip, capsys):
    _bf16_setup(ip)
    with torch.no_grad():
        ip.user_ns["model"][0].weight[0, 0] = float("inf")
    ip.user_ns["batch"] = torch.ones(2, 4, dtype=torch.bfloat16)
    ip.run_cell("r = %mpdoctor model --probe batch --text")
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert "; found probe-nonfinite at model.0" in last


def test_probe_with_generate_runs_decoding_steps_and_names_the_step(ip, capsys):
    from test_probe_generate import PROMPT, overflowing_llama

    ip.user_ns["model"] = overflowing_llama(torch.float16)
    ip.user_ns["prompt"] = PROMPT
    ip.run_cell("r = %mpdoctor model --probe prompt --generate 3 --text")
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    generation = ip.user_ns["r"].facts.probes[0].generation
    assert generation.steps == 3 and generation.first_bad_logits == 0
    assert last.startswith("mpdoctor: probed model on prompt: one generate() of 3 decoding steps, no autocast")
    assert "found probe-generation-nonfinite at model" in last


def test_explaining_a_name_that_holds_nothing_runs_none_of_its_code(ip, capsys):
    from scenarios import HOSTILE_CALLS, MetaHostile

    ip.user_ns["t"] = MetaHostile()  # its metaclass records every attribute read on the class
    HOSTILE_CALLS.clear()
    result = ip.run_cell("%mpdoctor t --text")
    assert result.error_in_exec is None and HOSTILE_CALLS == []
    assert capsys.readouterr().out.startswith("mpdoctor: t is a MetaHostile: nothing to inspect")


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_dash_h_and_dash_dash_help_print_the_usage(ip, capsys, flag):
    result = ip.run_cell(f"%mpdoctor {flag}")
    out = capsys.readouterr().out
    assert result.error_in_exec is None and result.result is None
    assert "unrecognized" not in out
    assert out.lstrip().startswith("usage: %mpdoctor") and "--target GPU" in out and "--step FUNCTION" in out


def test_hints_name_only_what_the_users_namespace_holds(ip, capsys):
    _bf16_setup(ip)  # model and scaler: a fix to offer, no step given
    ip.run_cell("r = %mpdoctor --text")
    out = capsys.readouterr().out
    assert "Fixes not verified (no step held)" in out and "train_step" not in out  # no function of that name exists
    ip.user_ns["batch"] = torch.ones(2, 4)
    ip.run_cell("%mpdoctor --compare batch")
    assert capsys.readouterr().out.strip() == "mpdoctor: --compare needs exactly one model: %mpdoctor model --compare batch"
    ip.user_ns["net"] = ip.user_ns.pop("model")
    ip.run_cell("%mpdoctor --plan fp8 batch")
    assert capsys.readouterr().out.strip() == "mpdoctor: --plan needs exactly one model: %mpdoctor net --plan fp8 batch"
    ip.user_ns.pop("net")
    ip.run_cell("%mpdoctor --compare batch")
    assert capsys.readouterr().out.strip() == "mpdoctor: --compare needs exactly one model"  # none to name
    ip.user_ns["model"] = torch.nn.Linear(4, 4)
    ip.user_ns["nothing"] = torch.nn.Linear(4, 4)
    ip.run_cell("%mpdoctor model nothing --probe batch")
    line = capsys.readouterr().out.strip()
    assert line.startswith("mpdoctor: --probe needs exactly one model; found 2 (name it: %mpdoctor model --probe batch")
    assert "%mpdoctor nothing --probe batch" in line
