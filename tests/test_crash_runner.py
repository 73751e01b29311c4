"""``python -m mpdoctor run``: real scripts that crash and that succeed, exit codes preserved."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.colab

CRASHING = """
import sys
import torch

def main():
    print("argv", sys.argv[1:])
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()

if __name__ == "__main__":
    main()
"""


def mpdoctor_run(tmp_path, source: str, *script_args: str, options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    command = [sys.executable, "-m", "mpdoctor", "run", *options, str(script), *script_args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_a_crashing_script_prints_its_traceback_then_the_report_and_exits_1(tmp_path):
    done = mpdoctor_run(tmp_path, CRASHING, "--lr", "3", "-x")
    assert done.returncode == 1
    assert "argv ['--lr', '3', '-x']" in done.stdout  # the script's own arguments, untouched
    err = done.stderr
    assert err.startswith("Traceback (most recent call last):")
    assert "runpy" not in err and "mpdoctor/attach/crash" not in err  # only the script's frames
    assert f'File "{tmp_path / "train.py"}", line' in err
    traceback_at = err.index("RuntimeError: mat1 and mat2 must have the same dtype, but got Float and BFloat16")
    assert traceback_at < err.index(">> cause of RuntimeError") < err.index("ERROR   mixed-param-dtypes  model")
    assert "inspected: model (Sequential), optimizer (SGD)" in err


def test_a_script_that_succeeds_runs_unchanged_and_exits_0(tmp_path):
    done = mpdoctor_run(tmp_path, "import sys\nprint('ok', __name__, sys.argv[1:])\n", "a", "--b")
    assert (done.returncode, done.stdout, done.stderr) == (0, "ok __main__ ['a', '--b']\n", "")


@pytest.mark.parametrize(("exit_call", "code"), [("sys.exit(3)", 3), ("sys.exit()", 0), ("sys.exit('bad config')", 1)])
def test_system_exit_codes_are_preserved(tmp_path, exit_call, code):
    done = mpdoctor_run(tmp_path, f"import sys\n{exit_call}\n")
    assert done.returncode == code
    assert ("bad config" in done.stderr) == (code == 1)


def test_an_unrelated_crash_is_a_plain_traceback(tmp_path):
    done = mpdoctor_run(tmp_path, "def f():\n    return 1 / 0\nf()\n")
    assert done.returncode == 1
    assert done.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "mpdoctor" not in done.stderr


def test_probe_on_nan_names_the_first_layer_that_goes_non_finite(tmp_path):
    source = """
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(1e38)
    loss = torch.nn.MSELoss()(model(torch.full((2, 4), 1e10)), torch.zeros(2, 1))
    print("loss", loss.item())
    """
    done = mpdoctor_run(tmp_path, source, options=("--probe-on-nan",))
    assert done.returncode == 0 and done.stdout in ("loss nan\n", "loss inf\n")
    assert "probe-nonfinite  Sequential.0" in done.stderr
    assert "first module whose output went non-finite" in done.stderr


def test_scan_adds_the_value_scan_to_the_crash_report(tmp_path):
    done = mpdoctor_run(tmp_path, CRASHING, options=("--scan",))
    assert done.returncode == 1 and "value scan:" in done.stderr
