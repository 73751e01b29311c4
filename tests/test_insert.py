"""``%mpdoctor insert N``: a code fix one action away, in a real ``InteractiveShell`` (Colab's IPython 7.34 too).

The card of each code fix names ``%mpdoctor insert N``; the magic puts that exact code in the next input
(``set_next_input``: a new cell below in JupyterLab, tested in the browser in ``test_browser.py``) and prints it
for front ends that drop the payload. Running the inserted code trains.
"""

from __future__ import annotations

import pytest
import torch
from notebook_shell import loaded_shell

pytestmark = pytest.mark.colab

SETUP = """
import torch
torch.manual_seed(0)
net = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(8, 4)
"""

WRONG = """
for _ in range(2):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = net(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    opt.step()
"""


def test_the_card_names_insert_and_the_inserted_code_is_the_corrected_loop_and_it_trains(capsys):
    with loaded_shell(("torch", "net", "opt", "scaler", "x", "loss", "r")) as sh:
        sh.run_cell(SETUP, store_history=True)
        sh.run_cell(WRONG, store_history=True)
        with torch.no_grad():  # the wrong steps were 65536 times too large: the user starts the weights afresh
            sh.user_ns["net"].reset_parameters()
        sh.run_cell("r = %mpdoctor --text", store_history=True)
        text = capsys.readouterr().out
        assert "%mpdoctor insert 1 puts this code in a new cell below" in text
        sh.rl_next_input = None
        result = sh.run_cell("%mpdoctor insert 1", store_history=True)
        assert result.success
        code = sh.rl_next_input
        (fix,) = [fx for fx in sh.user_ns["r"].all_fixes if fx.applicability.value == "display-only"]
        assert code == fix.code and "scaler.step(opt)" in code and "scaler.update()" in code
        assert code in capsys.readouterr().out  # printed too, for Colab and VS Code, which drop the payload
        before = sh.user_ns["net"].weight.detach().clone()
        assert sh.run_cell(code, store_history=True).success
        after = sh.user_ns["net"].weight
        assert not torch.equal(before, after) and bool(torch.isfinite(after).all())


@pytest.mark.parametrize("line", ["%mpdoctor insert", "%mpdoctor insert 9", "%mpdoctor insert one"])
def test_a_wrong_number_is_one_line_naming_the_numbers_and_never_a_traceback(line, capsys):
    with loaded_shell(("torch", "net", "opt", "scaler", "x", "loss", "r")) as sh:
        sh.run_cell(SETUP, store_history=True)
        sh.run_cell(WRONG, store_history=True)
        sh.run_cell("r = %mpdoctor --text", store_history=True)
        capsys.readouterr()
        sh.rl_next_input = None
        result = sh.run_cell(line, store_history=True)
        out = capsys.readouterr()
        assert result.success and "Traceback" not in out.out + out.err
        assert "%mpdoctor insert N: N is the number a fix's card names (1 to 1)" in out.out
        assert sh.rl_next_input is None
