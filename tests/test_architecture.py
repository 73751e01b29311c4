"""The layers are a contract: no import cycle between mpdoctor's modules, nothing imports the package root,
and the 0.2 import paths still work for one release, with a DeprecationWarning.

``lint-imports`` (run by ``make test``) checks the layers contract in ``pyproject.toml``; these tests hold
what a contract cannot say: that the import graph, function-level and TYPE_CHECKING imports included, has
no cycle at all.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import grimp
import pytest

from mpdoctor._moved import MOVED


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    # Every import counts: module-level, function-level and annotations-only (TYPE_CHECKING) ones.
    return grimp.build_graph("mpdoctor", exclude_type_checking_imports=False)


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """The import cycles of the graph, as its strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if not child.startswith("mpdoctor"):
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return cycles


def test_the_finder_of_cycles_finds_a_cycle():
    graph = grimp.ImportGraph()
    for module in ("pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(module)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.a")
    graph.add_import(importer="pkg.b", imported="pkg.c")
    assert strongly_connected(graph) == []  # names outside "mpdoctor" are not followed
    cycle = grimp.ImportGraph()
    for module in ("mpdoctor.a", "mpdoctor.b", "mpdoctor.c"):
        cycle.add_module(module)
    cycle.add_import(importer="mpdoctor.a", imported="mpdoctor.b")
    cycle.add_import(importer="mpdoctor.b", imported="mpdoctor.c")
    cycle.add_import(importer="mpdoctor.c", imported="mpdoctor.a")
    assert strongly_connected(cycle) == [["mpdoctor.a", "mpdoctor.b", "mpdoctor.c"]]


def test_no_import_cycle_between_modules(graph):
    assert graph.modules, "grimp found no module of mpdoctor"
    assert strongly_connected(graph) == []


def test_no_submodule_imports_the_package_root(graph):
    # A submodule takes a name from the module defining it: the root only re-exports, lazily.
    importers = sorted(m for m in graph.find_modules_that_directly_import("mpdoctor") if m != "mpdoctor")
    assert importers == []


def test_facts_import_no_integration_no_reader_and_no_gathering(graph):
    facts = {m for m in graph.modules if m == "mpdoctor.facts" or m.startswith("mpdoctor.facts.")}
    reached = {imported for m in facts for imported in graph.find_modules_directly_imported_by(m)}
    upward = sorted(
        m for m in reached
        if m.startswith(("mpdoctor.integrations", "mpdoctor.gathering", "mpdoctor.readers", "mpdoctor.discovery"))
    )  # fmt: skip
    assert upward == []


def test_no_loose_module_left_at_the_top_but_the_bottom_tables(graph):
    top = sorted(m for m in graph.modules if m.count(".") == 1 and not graph.find_children(m))
    assert top == ["mpdoctor.__main__", "mpdoctor._moved", "mpdoctor._version", "mpdoctor.compat", "mpdoctor.knowledge",
                   "mpdoctor.redact"]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_import_path_still_works_and_warns(old):
    # A fresh interpreter: the import must really go through the finder, not a cached module.
    code = (
        "import warnings, importlib\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "import mpdoctor\n"
        f"try:\n    importlib.import_module({old!r})\nexcept DeprecationWarning as w:\n    print('warned:', w)\n"
        "else:\n    print('no warning')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"warned: {old} moved to {MOVED[old][0]}"), proc.stdout


def test_an_old_path_reads_the_same_objects_as_the_new_one():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old_fixes = importlib.import_module("mpdoctor.fixes")
        old_report = importlib.import_module("mpdoctor.report")
        old_distributed = importlib.import_module("mpdoctor.distributed")
    from mpdoctor.diagnosis.exchange import exchange
    from mpdoctor.diagnosis.ranks import diagnose_every_rank
    from mpdoctor.diagnosis.report import Report
    from mpdoctor.edits.steps import SetAttr
    from mpdoctor.treatment.fixes import Fix

    assert old_fixes.Fix is Fix and old_fixes.SetAttr is SetAttr
    assert old_report.Report is Report
    assert old_distributed.exchange is exchange and old_distributed.diagnose_every_rank is diagnose_every_rank
    with pytest.raises(AttributeError):
        old_fixes.no_such_name  # noqa: B018


def test_the_public_api_is_where_it_was():
    import mpdoctor
    from mpdoctor.diagnosis import diagnose
    from mpdoctor.diagnosis.report import Report
    from mpdoctor.numerics.probe import probe
    from mpdoctor.training.watch import watch
    from mpdoctor.treatment.fixes import Fix

    assert mpdoctor.diagnose is diagnose and mpdoctor.probe is probe and mpdoctor.watch is watch
    assert mpdoctor.Report is Report and mpdoctor.Fix is Fix
    assert mpdoctor.MPDoctorCallback.__name__ == "MPDoctorCallback"


def test_what_attaches_to_a_training_run_reads_the_same_objects_at_its_old_paths():
    from mpdoctor.training.callback_state import MPDoctorAbort
    from mpdoctor.training.runner import run_script
    from mpdoctor.training.trainer_callback import MPDoctorCallback
    from mpdoctor.training.watch import NonFiniteLoss, watch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old_watch = importlib.import_module("mpdoctor.crash.watch")
        old_runner = importlib.import_module("mpdoctor.crash.runner")
        old_callback = importlib.import_module("mpdoctor.numerics.callback")
    assert old_watch.watch is watch and old_watch.NonFiniteLoss is NonFiniteLoss
    assert old_runner.run_script is run_script
    assert old_callback.MPDoctorCallback is MPDoctorCallback and old_callback.MPDoctorAbort is MPDoctorAbort


def test_a_renamed_fact_answers_at_its_old_name_with_a_warning():
    from mpdoctor.facts import TorchStateFacts

    with pytest.warns(DeprecationWarning, match="RuntimeFacts is now TorchStateFacts"):
        from mpdoctor.facts import RuntimeFacts
    assert RuntimeFacts is TorchStateFacts
