"""Throwaway Jupyter servers on 127.0.0.1, isolated in a temporary directory.

Every Jupyter directory (config, data, runtime, settings, workspaces, IPython
profile) lives under the temporary directory, and the only kernelspec the
notebook names points at the Python given (this virtualenv's by default), so
the kernel is known whatever else is installed on the machine.

:class:`LabServer` is JupyterLab 4 from this virtualenv (ipywidgets 8);
:class:`ClassicNotebookServer` is Notebook 6.5 from the Colab-pinned virtualenv,
the ipywidgets 7.7.1 frontend (widgetsnbextension 3.6), for the same notebook.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat

KERNEL_NAME = "mpdoctor-test-venv"
TOKEN = "mpdoctor-browser-test-token"

#: The broken setup: bf16 weights under an enabled GradScaler, and a tiny Gemma 3
#: in training mode whose only cache flag (text_config.use_cache) is True.
SETUP_CELL = """\
import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(torch.bfloat16)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")  # enabled, although bf16 needs no loss scaling
loss = model(torch.randn(4, 64, dtype=torch.bfloat16)).float().pow(2).mean()
scaler.scale(loss).backward()
scaler.step(optimizer)
scaler.update()

gemma = Gemma3ForConditionalGeneration(Gemma3Config(
    text_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=64, head_dim=8, use_cache=True),
    vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                       image_size=28, patch_size=14),
    mm_tokens_per_image=4,
)).train()"""

#: Printed by the cell the test adds after clicking the fix.
STATE_LINE = 'print("STATE", scaler.is_enabled(), scaler._enabled)'


def write_notebook(path: Path) -> Path:
    """Write the notebook the browser opens: setup, ``%load_ext mpdoctor``, ``%mpdoctor``."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": KERNEL_NAME,
        "display_name": "mpdoctor test venv",
        "language": "python",
    }
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells = [
        nbformat.v4.new_code_cell(SETUP_CELL),
        nbformat.v4.new_code_cell("%load_ext mpdoctor"),
        nbformat.v4.new_code_cell("%mpdoctor"),
    ]
    nbformat.write(nb, str(path))
    return path


def free_port() -> int:
    """A port nobody listens on now (the server is told not to retry others)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _isolated_env(base: Path, kernel_python: str) -> dict:
    data = base / "jupyter-data"
    kernel_dir = data / "kernels" / KERNEL_NAME
    kernel_dir.mkdir(parents=True, exist_ok=True)
    (kernel_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [kernel_python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "mpdoctor test venv",
                "language": "python",
            }
        )
    )
    settings = base / "lab-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True, exist_ok=True)
    # No news toast and no update check: nothing may cover the report or reach the network.
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True})
    )
    config = base / "jupyter-config"
    config.mkdir(parents=True, exist_ok=True)
    (config / "jupyter_server_config.json").write_text(
        json.dumps(
            {"LabApp": {"news_url": None, "check_for_updates_class": "jupyterlab.NeverCheckForUpdate"}}
        )
    )
    env = dict(os.environ)
    env.update(
        JUPYTER_CONFIG_DIR=str(config),
        JUPYTER_DATA_DIR=str(data),
        JUPYTER_PATH=str(data),
        JUPYTER_RUNTIME_DIR=str(base / "jupyter-runtime"),
        IPYTHONDIR=str(base / "ipython"),
        JUPYTER_PLATFORM_DIRS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


class LabServer:
    """``jupyter lab`` from this virtualenv, serving ``root`` on 127.0.0.1.

    Use as a context manager: on exit the server is asked to shut down (which
    stops its kernels), then its process group is killed if it lingers, then
    any kernel whose connection file lies in this server's runtime directory
    is killed by pid, whatever happened.
    """

    def __init__(
        self,
        base: Path,
        root: Path,
        kernel_python: str = sys.executable,
        start_timeout: float = 60.0,
        attempts: int = 3,
    ) -> None:
        self.base, self.root, self.start_timeout, self.attempts = base, root, start_timeout, attempts
        self.kernel_python = kernel_python
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path = base / "jupyterlab.log"
        self.runtime_dir = base / "jupyter-runtime"
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def notebook_url(self, name: str) -> str:
        """The lab URL of a notebook in the root, with the token."""
        return f"{self.url}/lab/tree/{name}?token={TOKEN}"

    def _command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={TOKEN}",
            f"--ServerApp.root_dir={self.root}",
            f"--LabApp.user_settings_dir={self.base / 'lab-settings'}",
            f"--LabApp.workspaces_dir={self.base / 'lab-workspaces'}",
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.extension_manager=readonly",
            "--ServerApp.terminals_enabled=False",
            "--allow-root",  # containers and CI runners often run as root
        ]

    def __enter__(self) -> LabServer:
        env = _isolated_env(self.base, self.kernel_python)
        for attempt in range(1, self.attempts + 1):
            # A free port can be taken between the probe and the bind: retry on a new one.
            self.port = free_port()
            self._log = open(self.log_path, "w")
            self.proc = subprocess.Popen(
                self._command(), env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                self._wait_ready()
                return self
            except RuntimeError:
                self.__exit__(None, None, None)
                if attempt == self.attempts:
                    raise
            except BaseException:
                self.__exit__(None, None, None)
                raise
        raise AssertionError("unreachable")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/status?token={TOKEN}", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"jupyter lab did not answer within {self.start_timeout:.0f} s:\n{self.log()}")

    def log(self) -> str:
        """The server's output so far (for failure messages)."""
        try:
            return self.log_path.read_text()[-4000:]
        except OSError:
            return ""

    def __exit__(self, *exc: object) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:  # the graceful way: the server shuts its kernels down first
                request = urllib.request.Request(
                    f"{self.url}/api/shutdown", method="POST", headers={"Authorization": f"token {TOKEN}"}
                )
                urllib.request.urlopen(request, timeout=5).close()
                proc.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if proc is not None and proc.poll() is None:
            _kill_group(proc)
        self._kill_own_kernels()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _kill_own_kernels(self) -> None:
        # Kernels run in their own session; ours are the ones reading a connection file in our runtime dir.
        marker = str(self.runtime_dir).encode()
        for entry in Path("/proc").glob("[0-9]*"):
            try:
                if marker in (entry / "cmdline").read_bytes():
                    os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the process group started for the server (only the server and its helpers are in it)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


class ClassicNotebookServer(LabServer):
    """Notebook 6 (classic) run by ``server_python``: the ipywidgets 7 frontend Colab's widgets descend from."""

    def __init__(self, base: Path, root: Path, server_python: str, **kwargs) -> None:
        super().__init__(base, root, kernel_python=kwargs.pop("kernel_python", server_python), **kwargs)
        self.server_python = server_python

    def notebook_url(self, name: str) -> str:
        return f"{self.url}/notebooks/{name}?token={TOKEN}"

    def _command(self) -> list[str]:
        return [
            self.server_python,
            "-m",
            "notebook",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--NotebookApp.port_retries=0",
            f"--NotebookApp.token={TOKEN}",
            f"--NotebookApp.notebook_dir={self.root}",
            "--allow-root",
        ]


#: A 32-layer Llama in bf16 whose MLPs in every fourth layer were left in fp32: a layer strip with
#: differing columns, a flood of module evidence, and an unsafe fix to arm.
LAYERS_CELL = """\
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
llama = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=32, num_attention_heads=2,
                                     num_key_value_heads=1, vocab_size=64, use_cache=False)).to(torch.bfloat16).train()
for i in range(0, 32, 4):
    llama.model.layers[i].mlp.float()"""


def write_report_notebook(path: Path) -> Path:
    """The notebook the theme test opens: the broken setup, a 32-layer mixed model, ``%mpdoctor --scan``."""
    write_notebook(path)
    nb = nbformat.read(str(path), as_version=4)
    nb.cells = [
        nb.cells[0],
        nbformat.v4.new_code_cell(LAYERS_CELL),
        nbformat.v4.new_code_cell("%load_ext mpdoctor"),
        nbformat.v4.new_code_cell("%mpdoctor --scan"),
    ]
    nbformat.write(nb, str(path))
    return path


NOTEBOOKS = Path(__file__).resolve().parent.parent.parent / "notebooks"


def write_notebook_09(path: Path) -> Path:
    """Copy notebook 09 (the student's AMP loop) as it is, only pointed at this virtualenv's kernel."""
    nb = nbformat.read(str(next(NOTEBOOKS.glob("09_*.ipynb"))), as_version=4)
    nb.metadata["kernelspec"] = {
        "name": KERNEL_NAME,
        "display_name": "mpdoctor test venv",
        "language": "python",
    }
    nbformat.write(nb, str(path))
    return path


def lessons_of_notebook_09(path: Path) -> dict[int, str]:
    """Map the index of each lesson's mistake cell to the rule slug the notebook says names it.

    A lesson is a markdown heading ``## <n>. ...``; its mistake is the first code cell after it.
    The slugs come from the notebook's own claims cell (``assert set(loop) == {...}``), which
    lists them in lesson order.
    """
    import ast
    import re

    nb = nbformat.read(str(path), as_version=4)
    claims = next(c.source for c in nb.cells if c.cell_type == "code" and "assert set(loop) ==" in c.source)
    literal = claims.split("assert set(loop) ==", 1)[1].splitlines()[0].strip()
    slugs = [node.value for node in ast.parse(literal, mode="eval").body.elts]
    cells: list[int] = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and re.match(r"## \d+\. ", cell.source):
            cells.append(next(j for j in range(i + 1, len(nb.cells)) if nb.cells[j].cell_type == "code"))
    assert len(cells) == len(slugs), (cells, slugs)
    return dict(zip(cells, slugs))


#: The student's loop of notebook 09 in small: an fp16-autocast loop that calls opt.step() past its GradScaler.
INSERT_CELLS = (
    "import torch\n%load_ext mpdoctor\ntorch.manual_seed(0)\n"
    "net = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
    "scaler = torch.amp.GradScaler('cpu')\nx = torch.randn(8, 4)",
    "for _ in range(2):\n    opt.zero_grad()\n    with torch.autocast('cpu', dtype=torch.float16):\n"
    "        loss = net(x).float().pow(2).mean()\n    scaler.scale(loss).backward()\n    opt.step()",
    "%mpdoctor --text",
)


def write_insert_notebook(path: Path) -> Path:
    """A notebook whose loop cell steps past its GradScaler, then ``%mpdoctor --text`` (the card numbers its fix)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "mpdoctor test venv", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells = [nbformat.v4.new_code_cell(code) for code in INSERT_CELLS]
    nbformat.write(nb, str(path))
    return path


#: The new user's notebook: an fp32 net under fp16 autocast with a GradScaler, a loop calling opt.step() past it,
#: then an unrelated bf16 head fed a float32 batch (it raises), then %mpdoctor.
NEW_USER_CELLS = (
    "import torch\n%load_ext mpdoctor\ntorch.manual_seed(0)\n"
    "net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))\n"
    "opt = torch.optim.SGD(net.parameters(), lr=0.1)\nscaler = torch.amp.GradScaler('cpu')\n"
    "head = torch.nn.Linear(8, 2).to(torch.bfloat16)\nx = torch.randn(16, 8)",
    "for _ in range(3):\n    opt.zero_grad()\n    with torch.autocast('cpu', dtype=torch.float16):\n"
    "        loss = net(x).float().pow(2).mean()\n    scaler.scale(loss).backward()\n    opt.step()",
    "logits = head(x)",
    "%mpdoctor",
)
#: The same two cells as the user corrects them.
NEW_USER_LOOP_RIGHT = NEW_USER_CELLS[1].replace("    opt.step()", "    scaler.step(opt)\n    scaler.update()")
NEW_USER_HEAD_RIGHT = "logits = head(x.to(torch.bfloat16))"


def write_new_user_notebook(path: Path) -> Path:
    """The new user's notebook; the raising cell is tagged ``raises-exception`` so that Run All goes on."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "mpdoctor test venv", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells = [nbformat.v4.new_code_cell(code) for code in NEW_USER_CELLS]
    nb.cells[2].metadata["tags"] = ["raises-exception"]
    nbformat.write(nb, str(path))
    return path
