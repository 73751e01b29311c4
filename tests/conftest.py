"""Shared fixtures: a clean precision environment and accelerate state around every test; the skip guard.

With ``MPDOCTOR_NO_SKIPS=1`` in the environment (``make test`` sets it for the main venv, where the whole stack
is installed) a skipped test, and a module skipped at collection (``pytest.importorskip`` at module level), is
reported as a failure: a run that silently left part of the suite out cannot pass.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _isolated_precision_state():
    """Each test starts without ACCELERATE_* precision variables (the launcher's fp8 ones too) and with
    accelerate's singletons reset."""
    base = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DOWNCAST_BF16", "ACCELERATE_USE_CPU")

    def keys() -> list[str]:  # the launcher's fp8 variables by prefix: those a test set are found at teardown
        return [*base, *(k for k in os.environ if k.startswith("ACCELERATE_FP8_"))]

    saved = {k: os.environ.pop(k) for k in keys() if k in os.environ}
    _reset_accelerate()
    yield
    for k in keys():
        os.environ.pop(k, None)
    os.environ.update(saved)
    _reset_accelerate()


def _reset_accelerate() -> None:
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture()
def shell():
    """A real IPython InteractiveShell with ``%load_ext mpdoctor`` done (unloaded afterwards)."""
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    before = set(ip.user_ns)
    ip.run_cell("%load_ext mpdoctor", store_history=False)
    yield ip
    ip.run_cell("%unload_ext mpdoctor", store_history=False)
    for name in set(ip.user_ns) - before:  # the shell is shared by the suite: leave no variable behind
        ip.user_ns.pop(name, None)


def _no_skips() -> bool:
    return os.environ.get("MPDOCTOR_NO_SKIPS") == "1"


def _skip_as_failure(report, what: str) -> None:
    reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"{what} was skipped, and MPDOCTOR_NO_SKIPS=1 makes a skip a failure: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _no_skips() and report.skipped and not hasattr(report, "wasxfail"):
        _skip_as_failure(report, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if _no_skips() and report.skipped:
        _skip_as_failure(report, collector.nodeid)
