"""``mpdoctor run`` on a real script tells each mistake once, with the cause the loop really has.

A 17-line script whose ``update()`` runs every micro-batch was told three times (the reading of the script, the
watcher at the call, the crash report, about 80 lines). A loop with no ``scaler.step`` at all crashed with "No inf
checks were recorded prior to update." blamed on "update() called per micro-batch".
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
from notebook_shell import loaded_shell
from steps import assert_step_trains, snapshot

pytestmark = pytest.mark.colab

HEAD = """
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
amp_scaler = torch.amp.GradScaler("cpu")
"""

#: 17 lines: update() every micro-batch, step once per accumulated step.
PER_MICROBATCH = HEAD + """accum = 2
for i in range(4):
    x = torch.randn(16, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    amp_scaler.scale(loss / accum).backward()
    amp_scaler.update()  # mistake: every micro-batch
    if (i + 1) % accum == 0:
        amp_scaler.step(optimizer)
        optimizer.zero_grad()
print("done")
"""

#: No scaler.step anywhere: the step is missing, there is no micro-batch.
NO_STEP = HEAD + """for i in range(4):
    x = torch.randn(16, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    amp_scaler.scale(loss).backward()
    amp_scaler.update()
    optimizer.zero_grad()
print("done")
"""

#: optimizer.step() in scaler.step's place.
OPTIMIZER_STEP = NO_STEP.replace("    amp_scaler.update()\n", "    optimizer.step()\n    amp_scaler.update()\n")


def mpdoctor_run(tmp_path, source: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    command = [sys.executable, "-m", "mpdoctor", "run", str(script)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def shown_slugs(text: str) -> list[str]:
    """Every rule a block of the output names: report rows (``ERROR   slug``) and watcher lines (``[slug]``)."""
    return re.findall(r"^(?:ERROR|WARN|INFO)\s+(\S+)\s", text, flags=re.M) + re.findall(
        r"^mpdoctor: \w+ \[([\w-]+)\]", text, flags=re.M
    )


def test_run_tells_a_per_microbatch_update_once_then_names_it_after_the_traceback(tmp_path):
    done = mpdoctor_run(tmp_path, PER_MICROBATCH)
    assert done.returncode == 1
    err = done.stderr
    assert "AssertionError: No inf checks were recorded prior to update." in err  # the real error
    assert shown_slugs(err) == ["amp-update-per-microbatch"], err
    # the crash is tied to the mistake shown, not reported again with the objects' tables
    assert "is the amp-update-per-microbatch mistake at train.py:14, shown above" in err
    assert "dtypes" not in err and "cause of" not in err
    assert len(err.splitlines()) < 40, err
    assert err.count("No inf checks were recorded prior to update.") <= 3  # the reading's why, the traceback's two


def test_the_corrected_loop_run_shows_trains_and_draws_nothing(tmp_path):
    """The fix ``mpdoctor run`` shows is a unified diff of the script: applied as printed, the script runs clean."""
    done = mpdoctor_run(tmp_path, PER_MICROBATCH.rstrip("\n") + "\nprint('done')\n")
    diff = done.stderr.split("fix (display-only):", 1)[1].split("\n", 1)[1].split("\n\n", 1)[0] + "\n"
    assert diff.startswith("--- a/train.py\n+++ b/train.py\n"), diff
    (tmp_path / "fix.diff").write_text(diff)
    applied = subprocess.run(["git", "apply", "-p1", "fix.diff"], capture_output=True, text=True, cwd=tmp_path)
    assert applied.returncode == 0, applied.stderr
    again = mpdoctor_run(tmp_path, (tmp_path / "train.py").read_text())
    assert again.returncode == 0 and "done" in again.stdout, again.stderr
    assert shown_slugs(again.stderr) == [], again.stderr


@pytest.mark.parametrize(
    ("source", "slug", "line"),
    [(NO_STEP, "amp-step-missing", 13), (OPTIMIZER_STEP, "amp-step-bypasses-scaler", 13)],
    ids=["no-step-at-all", "optimizer-step-instead"],
)
def test_no_inf_checks_prior_to_update_is_blamed_on_the_missing_scaler_step(tmp_path, source, slug, line):
    done = mpdoctor_run(tmp_path, source)
    err = done.stderr
    assert "AssertionError: No inf checks were recorded prior to update." in err
    assert shown_slugs(err) == [slug], err
    assert f"is the {slug} mistake at train.py:{line}, shown above" in err
    assert "micro-batch" not in err, err


NOTEBOOK_SETUP = HEAD + "x = torch.randn(16, 8)\n"
NOTEBOOK_NO_STEP = """
for i in range(2):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    amp_scaler.scale(loss).backward()
    amp_scaler.update()
"""


def test_in_a_notebook_the_crash_of_a_loop_with_no_scaler_step_is_the_missing_step_shown_once(capsys):
    with loaded_shell(("model", "optimizer", "amp_scaler", "x", "loss", "r", "i")) as shell:
        shell.run_cell(NOTEBOOK_SETUP, store_history=True)
        cell = shell.execution_count
        capsys.readouterr()
        result = shell.run_cell(NOTEBOOK_NO_STEP, store_history=True)
        assert isinstance(result.error_in_exec, AssertionError)
        out = capsys.readouterr()
        assert shown_slugs(out.out + out.err).count("amp-step-missing") == 2  # the line at the call, one report
        assert "amp-update-without-step" not in out.out and "micro-batch" not in out.out
        shell.run_cell("r = %mpdoctor --text", store_history=True)
        report = shell.user_ns["r"]
        assert report.cause is not None and report.cause.check == "amp-step-missing"
        line = NOTEBOOK_NO_STEP.strip().splitlines().index("    amp_scaler.update()") + 1  # IPython drops the blank first line
        assert report.cause.evidence["where"] == f"cell [{cell}], line {line}"
        assert [f.check for f in report.findings].count("amp-step-missing") == 1
        code = report.cause.fixes[0].code
        assert "amp_scaler.step(optimizer)" in code and "scaler.step" not in code.replace("amp_scaler.", "")


ADAM_SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
amp_scaler = torch.amp.GradScaler("cpu")
data = [torch.randn(16, 8) for _ in range(6)]
"""
BYPASS = """
for x in data:
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    amp_scaler.scale(loss).backward()
    optimizer.step()
"""


def test_a_run_that_never_resumed_draws_no_resume_warning_and_its_corrected_loop_trains(capsys):
    """A scaler never updated stays at 65536 with a growth tracker of 0 beside an Adam that counted its steps: it
    looked like a resumed run whose scaler was not restored. It scaled this run's losses: it was not resumed."""
    with loaded_shell(("model", "optimizer", "amp_scaler", "data", "x", "loss", "r")) as shell:
        shell.run_cell(ADAM_SETUP, store_history=True)
        assert shell.run_cell(BYPASS, store_history=True).success
        scaler, optimizer = shell.user_ns["amp_scaler"], shell.user_ns["optimizer"]
        assert scaler.get_scale() == 65536.0 and scaler._get_growth_tracker() == 0
        assert int(optimizer.state[next(iter(optimizer.state))]["step"]) == 6  # Adam took six steps
        shell.run_cell("r = %mpdoctor --text", store_history=True)
        report = shell.user_ns["r"]
        checks = [f.check for f in report.findings]
        assert "amp-step-bypasses-scaler" in checks and "scaler-not-restored-on-resume" not in checks, checks
        (bypass,) = report.findings_for("amp-step-bypasses-scaler")
        shell.run_cell(ADAM_SETUP, store_history=True)  # fresh objects, then the corrected loop as shown
        model = shell.user_ns["model"]
        before = snapshot(model.parameters())
        capsys.readouterr()
        assert shell.run_cell(bypass.fixes[0].code, store_history=True).success
        assert_step_trains(shell.user_ns["loss"], before, model.parameters())
        assert shell.user_ns["amp_scaler"]._get_growth_tracker() == 6  # six real steps, none skipped
        out = capsys.readouterr()
        assert shown_slugs(out.out + out.err) == [], out  # the watcher saw nothing wrong in the corrected loop
