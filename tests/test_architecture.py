"""The layers are a contract: no import cycle between mpdoctor's modules, nothing imports the package root,
and the public API is where it was.

``lint-imports`` (run by ``make test``) checks the layers contract in ``pyproject.toml``; these tests hold
what a contract cannot say: that the import graph, function-level and TYPE_CHECKING imports included, has
no cycle at all.
"""

from __future__ import annotations

from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent


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


def _library_modules(graph: grimp.ImportGraph, kind: str) -> set[str]:
    """The modules of kind ``kind`` (``facts``, ``integration`` ...) of every package under ``mpdoctor/libraries``."""
    return {m for m in graph.modules if m.startswith("mpdoctor.libraries.") and m.rsplit(".", 1)[-1] == kind}


def test_facts_import_no_integration_no_reader_and_no_gathering(graph):
    facts = {m for m in graph.modules if m == "mpdoctor.facts" or m.startswith("mpdoctor.facts.")}
    facts |= _library_modules(graph, "facts")
    reached = {imported for m in facts for imported in graph.find_modules_directly_imported_by(m)}
    readers = ("mpdoctor.objects.integrations", "mpdoctor.objects.gathering", "mpdoctor.objects.readers",
               "mpdoctor.objects.discovery", *_library_modules(graph, "integration"), *_library_modules(graph, "gathering"))
    upward = sorted(m for m in reached if m.startswith(readers))
    assert upward == []


#: The wings, top to bottom, as ARCHITECTURE.md draws them and the first layers contract orders them.
WINGS = ("front", "attach", "diagnosis", "render", "rules", "objects", "facts")


def _contracts() -> list[dict]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_the_package_is_eight_wings_in_pipeline_order_with_at_most_four_loose_modules(graph):
    packages = sorted(m.split(".")[1] for m in graph.modules if m.count(".") == 1 and graph.find_children(m))
    assert packages == sorted([*WINGS, "libraries"])
    wings = _contracts()[0]["layers"]
    assert [layer.split(" : ")[0].removeprefix("mpdoctor.") for layer in wings[: len(WINGS)]] == list(WINGS)
    loose = sorted(m for m in graph.modules if m.count(".") == 1 and not graph.find_children(m))
    assert [m for m in loose if not m.startswith("mpdoctor.__")] == [
        "mpdoctor._version", "mpdoctor.compat", "mpdoctor.knowledge", "mpdoctor.redact"]


def test_every_module_of_a_library_is_placed_in_the_layer_of_its_kind(graph):
    """A library's package spans layers (its checks sit with the rules, its integration with the objects): each
    of its modules must be named in both layers contracts, or nothing would guard its imports."""
    library = {m for m in graph.modules if m.startswith("mpdoctor.libraries.") and not graph.find_children(m)}
    assert library, "no library module found"
    for contract in _contracts()[:2]:
        named = {part.strip() for layer in contract["layers"] for part in layer.replace("|", ":").split(":")}
        assert sorted(library - named) == [], contract["name"]


def test_the_public_api_is_where_it_was():
    import mpdoctor
    from mpdoctor.attach.numerics.probe import probe
    from mpdoctor.attach.training.watch import watch
    from mpdoctor.diagnosis import diagnose
    from mpdoctor.diagnosis.report import Report
    from mpdoctor.rules.engine.fixes import Fix

    assert mpdoctor.diagnose is diagnose and mpdoctor.probe is probe and mpdoctor.watch is watch
    assert mpdoctor.Report is Report and mpdoctor.Fix is Fix
    assert mpdoctor.MPDoctorCallback.__name__ == "MPDoctorCallback"


def test_a_renamed_fact_answers_at_its_old_name_with_a_warning():
    from mpdoctor.facts import TorchStateFacts

    with pytest.warns(DeprecationWarning, match="RuntimeFacts is now TorchStateFacts"):
        from mpdoctor.facts import RuntimeFacts
    assert RuntimeFacts is TorchStateFacts


#: The actions a report offers; a renderer calls none of them (it acts through the controller it is given).
_REPORT_ACTIONS = {"refresh", "apply_safe_fixes", "apply", "undo"}


def test_the_widget_acts_only_through_its_controller():
    """``render/widget.py`` draws a report and acts through ``self.controller`` (``Report.controller()``): no call of
    a report's or a fix's action on anything else, so a renderer never reaches up into the diagnosis."""
    import ast
    from pathlib import Path

    import mpdoctor.render.widget as widget

    tree = ast.parse(Path(widget.__file__).read_text(encoding="utf-8"))
    reaching = [
        (node.lineno, ast.unparse(node.func))
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _REPORT_ACTIONS
        and ast.unparse(node.func.value) != "self.controller"
    ]
    assert reaching == []
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert {"self.controller.apply", "self.controller.undo", "self.controller.apply_safe"} <= calls


def test_a_widget_given_a_report_or_its_controller_shows_the_same_report_and_follows_the_controller():
    pytest.importorskip("ipywidgets")
    import torch

    import mpdoctor
    from mpdoctor.render.widget import ReportWidget

    model = torch.nn.Linear(4, 4).half()
    optimizer = torch.optim.AdamW(model.parameters())
    report = mpdoctor.diagnose(model, optimizer)
    controller = report.controller()
    assert ReportWidget(report).report is report and ReportWidget(controller).controller is controller
    rw = ReportWidget(controller)
    fresh = controller.refresh()  # the notebook layer re-diagnoses: the widget draws what its controller holds
    assert rw.report is fresh and fresh is not report
