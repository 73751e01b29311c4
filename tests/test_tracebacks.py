"""What mpdoctor attaches to a run stays out of the user's tracebacks.

With ``%load_ext mpdoctor`` the GradScaler's methods are wrapped (``mpdoctor/attach/runtime/dispatch.py``), so every
scaler traceback passed through a wrapper. Each wrapper marks its frame with ``__tracebackhide__``, which IPython 8
and later honour; the crash hook also unlinks those frames before IPython shows the traceback (IPython 7.34, Colab's,
ignores the mark), and ``watch()`` and ``mpdoctor run`` do for a plain Python traceback: the user's traceback shows
their code and torch's frames, not mpdoctor's.
"""

from __future__ import annotations

import re

import pytest
from notebook_shell import loaded_shell

pytestmark = pytest.mark.colab

_SETUP = """
import torch
model = torch.nn.Linear(4, 4).half()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
"""

_STEP = """
opt.zero_grad()
scaler.scale(model(torch.ones(2, 4, dtype=torch.float16)).float().sum()).backward()
scaler.step(opt)
"""


def test_a_gradscaler_traceback_shows_the_users_cell_and_torch_not_mpdoctors_wrappers(capsys):
    with loaded_shell(("torch", "model", "opt", "scaler")) as sh:
        sh.run_cell(_SETUP, store_history=True)
        result = sh.run_cell(_STEP, store_history=True)
        assert isinstance(result.error_in_exec, ValueError)  # the real error: fp16 gradients under the scaler
        out = capsys.readouterr()
        text = re.sub(r"\x1b\[[0-9;]*m", "", out.out + out.err)
        assert "Attempting to unscale FP16 gradients" in text and "grad_scaler.py" in text
        assert "dispatch.py" not in text and "mpdoctor/attach/runtime" not in text


# -- plain Python: a script under watch() or `mpdoctor run`, its traceback printed by Python itself ---------------

_SCRIPT = """
import torch
import mpdoctor
model = torch.nn.Linear(4, 4).half()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
opt.zero_grad()
scaler.scale(model(torch.ones(2, 4, dtype=torch.float16)).float().sum()).backward()
scaler.step(opt)
"""

_WATCHED = """
import torch
import mpdoctor
model = torch.nn.Linear(4, 4).half()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
with mpdoctor.watch(model, opt, scaler):
    opt.zero_grad()
    scaler.scale(model(torch.ones(2, 4, dtype=torch.float16)).float().sum()).backward()
    scaler.step(opt)
"""


def _python(tmp_path, script: str, *command: str) -> str:
    import subprocess
    import sys

    path = tmp_path / "train.py"
    path.write_text(script)
    cmd = [sys.executable, *command, str(path)] if command else [sys.executable, str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode != 0, done.stdout + done.stderr  # the real error
    return done.stderr


def test_in_a_script_under_watch_the_traceback_python_prints_shows_no_mpdoctor_wrapper(tmp_path):
    err = _python(tmp_path, _WATCHED)
    assert "Attempting to unscale FP16 gradients" in err and "grad_scaler.py" in err and 'train.py", line' in err
    assert "dispatch.py" not in err, err


def test_under_mpdoctor_run_the_scripts_traceback_shows_no_mpdoctor_wrapper(tmp_path):
    err = _python(tmp_path, _SCRIPT, "-m", "mpdoctor", "run")
    assert "Attempting to unscale FP16 gradients" in err and "grad_scaler.py" in err and 'train.py", line' in err
    assert "dispatch.py" not in err, err
