"""The crash diagnosis in a real IPython InteractiveShell (also run on Colab's IPython 7.34)."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.colab

_ANSI = re.compile(r"\x1b\[[0-9;]*m")

DEFINE_TRAIN = """
import torch
def train():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
"""


@pytest.fixture()
def ip():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext mpdoctor", store_history=False)
    shell.run_cell(DEFINE_TRAIN, store_history=False)
    yield shell
    shell.run_cell("%config MPDoctorMagics.on_error = True", store_history=False)
    shell.run_cell("%unload_ext mpdoctor", store_history=False)
    shell.user_ns.pop("train", None)


def run(shell, capsys, cell: str) -> tuple[object, str]:
    result = shell.run_cell(cell, store_history=False)
    captured = capsys.readouterr()
    return result, _ANSI.sub("", captured.out + captured.err)


def test_a_dtype_crash_inside_a_function_shows_the_traceback_then_the_diagnosis_naming_the_cause(ip, capsys):
    result, out = run(ip, capsys, "train()")
    assert type(result.error_in_exec).__name__ == "RuntimeError"  # the cell still failed, as without mpdoctor
    traceback_at = out.index("RuntimeError: mat1 and mat2 must have the same dtype, but got Float and BFloat16")
    assert "in train()" in out[:traceback_at]
    cause_at = out.index(">> cause of RuntimeError: mat1 and mat2 must have the same dtype")
    assert traceback_at < cause_at < out.index("ERROR   mixed-param-dtypes  model")
    assert "inspected: model (Sequential), optimizer (SGD)" in out  # the function's locals
    assert "fix (safe): Cast 2 parameters" in out


def _without_mpdoctor(shell, capsys, cell: str) -> str:
    shell.run_cell("%unload_ext mpdoctor", store_history=False)
    try:
        return run(shell, capsys, cell)[1]
    finally:
        shell.run_cell("%load_ext mpdoctor", store_history=False)


@pytest.mark.parametrize(
    "cell", ["1 / 0", "raise KeyboardInterrupt", "raise SystemExit(3)", "def f(:", "  x = 1", "undefined_name"]
)
def test_any_other_exception_shows_exactly_what_ipython_shows(ip, capsys, cell):
    capsys.readouterr()
    with_hook = run(ip, capsys, cell)[1]
    assert "mpdoctor" not in with_hook
    assert with_hook == _without_mpdoctor(ip, capsys, cell)


def test_a_mixed_precision_traceback_itself_is_exactly_ipythons(ip, capsys):
    out = run(ip, capsys, "train()")[1]
    plain = _without_mpdoctor(ip, capsys, "train()")
    assert out.startswith(plain)


def test_on_error_false_turns_the_diagnosis_off(ip, capsys):
    ip.run_cell("%config MPDoctorMagics.on_error = False", store_history=False)
    out = run(ip, capsys, "train()")[1]
    assert "RuntimeError: mat1 and mat2" in out and "mpdoctor" not in out
    ip.run_cell("%config MPDoctorMagics.on_error = True", store_history=False)
    assert "cause of RuntimeError" in run(ip, capsys, "train()")[1]


def test_a_failure_inside_the_hook_leaves_the_traceback_intact_and_is_one_line(ip, capsys, monkeypatch):
    import mpdoctor.attach.crash.cause

    def broken(*args, **kwargs):
        raise MemoryError("simulated failure inside mpdoctor")

    monkeypatch.setattr(mpdoctor.attach.crash.cause, "explain", broken)
    result, out = run(ip, capsys, "train()")
    assert type(result.error_in_exec).__name__ == "RuntimeError"
    assert out.index("RuntimeError: mat1 and mat2") < out.index("mpdoctor: could not diagnose this exception")
    assert [line for line in out.splitlines() if line.startswith("mpdoctor")] == [
        "mpdoctor: could not diagnose this exception (MemoryError: simulated failure inside mpdoctor);"
        " the traceback above is intact"
    ]
    assert "Custom TB Handler failed" not in out
    from mpdoctor.attach.crash.hook import installed

    assert installed(ip)  # IPython did not unregister it


def test_successful_cells_run_no_crash_code_and_leave_only_the_resident_scale_wrapper_in_torch(ip, capsys):
    # The crash handler is reached only through IPython's `except custom_exceptions`. The only per-cell
    # callbacks are the GradScaler protocol watcher's (mpdoctor.attach.runtime.session): between cells the one thing
    # of mpdoctor's in torch is GradScaler.scale's resident wrapper, a pass-through until %unload_ext.
    from torch.amp.grad_scaler import GradScaler

    from mpdoctor.attach.runtime import protocol

    callbacks = {event: list(cbs) for event, cbs in ip.events.callbacks.items()}
    modules = {getattr(cb, "__module__", "") or "" for cbs in callbacks.values() for cb in cbs}
    ours = {m for m in modules if m.startswith("mpdoctor")}
    assert ours == {"mpdoctor.attach.runtime.session"}
    result, out = run(ip, capsys, "x_ok = 1 + 1")
    assert result.success and out == ""
    assert not protocol.installed() and protocol.resident()
    assert GradScaler.scale.__wrapped__ is protocol._DISPATCH.resident[1]
    for name in ("unscale_", "step", "update"):
        assert not hasattr(vars(GradScaler)[name], "__wrapped__")
    ip.user_ns.pop("x_ok", None)


def test_unload_removes_the_handler_and_another_handler_is_never_replaced(ip, capsys):
    from mpdoctor.attach.crash.hook import installed

    assert ip.custom_exceptions == (Exception,) and installed(ip)
    ip.run_cell("%unload_ext mpdoctor", store_history=False)
    assert ip.custom_exceptions == () and not installed(ip)

    def theirs(self, etype, value, tb, tb_offset=None):
        print("their handler")

    ip.set_custom_exc((ZeroDivisionError,), theirs)
    try:
        ip.run_cell("%load_ext mpdoctor", store_history=False)
        assert "another custom exception handler is set" in capsys.readouterr().out
        assert ip.custom_exceptions == (ZeroDivisionError,)
        assert "their handler" in run(ip, capsys, "1 / 0")[1]
        ip.run_cell("%unload_ext mpdoctor", store_history=False)
        assert ip.custom_exceptions == (ZeroDivisionError,)  # unload leaves their handler alone
    finally:
        ip.set_custom_exc((), None)
        ip.run_cell("%load_ext mpdoctor", store_history=False)
