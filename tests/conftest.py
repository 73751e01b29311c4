"""Shared fixtures: a clean precision environment and accelerate state around every test; the skip guard; the corner.

With ``MPDOCTOR_NO_SKIPS=1`` in the environment (``make test`` sets it for the main venv, where the whole stack
is installed) a skipped test, and a module skipped at collection (``pytest.importorskip`` at module level), is
reported as a failure: a run that silently left part of the suite out cannot pass.

With ``MPDOCTOR_CORNER=<name>`` (``make test`` sets it for each extra venv of the support matrix) only what
``tests/corners.py`` says that corner runs is collected, its exclusions are deselected, and the summary names
each exclusion with its reason.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from corners import CORNER_ONLY, Corner, current  # noqa: E402  (tests/ is on the path from the line above)

_CORNER = current()
_ROOT = Path(__file__).resolve().parents[1]


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


# -- the corner of the support matrix this run is (tests/corners.py) ------------------------------------------


def _relative(path: Path) -> str:
    try:
        return path.resolve().relative_to(_ROOT).as_posix()
    except ValueError:
        return path.as_posix()


def _wanted(rel: str, corner: Corner, is_dir: bool) -> bool:
    """Whether a corner collects the file or folder ``rel`` (its ``runs``, less whole paths it excludes)."""
    if any(rel == x or rel.startswith(x + "/") for x in corner.excluded if "::" not in x):
        return False
    if not corner.runs:
        return True
    files = {r.split("::", 1)[0] for r in corner.runs}
    if is_dir:
        return any(f.startswith(rel + "/") or rel == f or rel.startswith(f + "/") for f in files)
    return any(rel == f or rel.startswith(f + "/") for f in files)


def _only_elsewhere(rel: str) -> bool:
    """Whether ``rel`` lies under a path only another corner collects (``CORNER_ONLY``)."""
    name = _CORNER.name if _CORNER is not None else None
    return any((rel == path or rel.startswith(path + "/")) and owner != name for path, (owner, _) in CORNER_ONLY.items())


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """In a corner, test modules it does not run are never imported (they may need what it lacks); a path only
    another corner collects is never imported here (the pinned corner included)."""
    if _only_elsewhere(_relative(collection_path)):
        return True
    if _CORNER is None:
        return None
    if collection_path.is_file() and not collection_path.name.startswith("test_"):
        return None
    return None if _wanted(_relative(collection_path), _CORNER, collection_path.is_dir()) else True


# -- the order files run in under pytest-xdist ---------------------------------------------------------------------

#: The longest test files, in seconds of one worker's wall time under ``make test`` on two cores (measured
#: 2026-11-28; a ranking, not a claim: nothing asserts them). They run first, longest first, and every other file
#: after them by its number of tests: the longest-processing-time-first order. xdist's own order (files by number of
#: tests) put the one-test benchmark smoke, a minute long, last, while the other worker had nothing left to run.
SLOW_FILES = {
    "tests/test_browser.py": 114,
    "tests/test_bench_smoke.py": 70,
    "tests/test_notebooks.py": 62,
    "tests/test_binder.py": 51,
    "tests/test_proof_mutations.py": 34,
    "tests/distributed/test_distributed_ranks.py": 29,
    "tests/test_loop_reader.py": 25,
    "tests/test_loop_accumulation.py": 22,
    "tests/distributed/test_deepspeed_ranks.py": 22,
    "tests/distributed/test_callbacks.py": 21,
    "tests/test_fix_safety.py": 20,
    "tests/test_no_mutation.py": 19,
    "tests/test_run_script.py": 18,
    "tests/distributed/test_field_cases.py": 17,
    "tests/stack/test_deepspeed_configs.py": 17,
    "tests/test_crash_runner.py": 16,
    "tests/distributed/test_launcher.py": 15,
    "tests/stack/test_stack_notebooks.py": 14,
}


def pytest_configure(config: pytest.Config) -> None:
    """xdist keeps the order of collection (``pytest_collection_modifyitems`` below) instead of its own."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _longest_first(items: list[pytest.Item]) -> None:
    """Files in the order above, then by their number of tests; a file's own tests keep their order."""
    counts: dict[str, int] = {}
    for item in items:
        file = item.nodeid.split("::", 1)[0]
        counts[file] = counts.get(file, 0) + 1
    items.sort(key=lambda item: _weight(item.nodeid.split("::", 1)[0], counts))


def _weight(file: str, counts: dict[str, int]) -> tuple[int, int, str]:
    return (-SLOW_FILES.get(file, 0), -counts[file], file)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest files first; in a corner, deselect the tests it excludes and those outside the node ids it names."""
    _longest_first(items)
    if _CORNER is None:
        return
    ids = [r for r in _CORNER.runs if "::" in r]
    keep, drop = [], []
    for item in items:
        file = item.nodeid.split("::", 1)[0]
        named = [r for r in ids if r.split("::", 1)[0] == file]
        outside = bool(named) and not any(item.nodeid.startswith(r) for r in named)
        excluded = any(item.nodeid == x or item.nodeid.startswith((x + "::", x + "[")) for x in _CORNER.excluded)
        (drop if outside or excluded else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    here = _CORNER.name if _CORNER is not None else None
    for path, (owner, reason) in CORNER_ONLY.items():
        if owner != here:
            terminalreporter.line(f"not collected here: {path} runs in the {owner} corner ({reason})")
    if _CORNER is None:
        return
    terminalreporter.section(f"corner {_CORNER.name}: {_CORNER.versions}")
    for path, reason in _CORNER.excluded.items():
        terminalreporter.line(f"excluded {path}: {reason}")
