"""Shared fixtures: a clean precision environment and accelerate state around every test."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _isolated_precision_state():
    """Each test starts without ACCELERATE_* variables and with accelerate's singletons reset."""
    keys = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DOWNCAST_BF16", "ACCELERATE_USE_CPU")
    saved = {k: os.environ.pop(k) for k in keys if k in os.environ}
    _reset_accelerate()
    yield
    for k in keys:
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
