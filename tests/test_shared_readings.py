"""Readings every layer shares, held once: a class's path (discovery, the integrations and the crash frames
read it the same way) and the optimizers a parameter cast must reach (every check that casts asks the facts)."""

from __future__ import annotations

import torch
from torch import nn

import mpdoctor
from mpdoctor.attach.crash import frames
from mpdoctor.objects.live.introspect import class_path


def test_a_class_path_is_its_module_and_qualname():
    class Inner:
        pass

    assert class_path(nn.Linear) == "torch.nn.modules.linear.Linear"
    assert class_path(int) == "builtins.int"
    assert class_path(Inner) == f"{__name__}.test_a_class_path_is_its_module_and_qualname.<locals>.Inner"


def test_the_crash_frames_read_class_paths_with_the_same_function():
    assert frames.class_path is class_path


def test_a_class_path_is_read_without_running_the_metaclass():
    calls = []

    class Loud(type):
        def __getattribute__(cls, name):
            calls.append(name)
            return super().__getattribute__(name)

    class Patient(metaclass=Loud):
        pass

    calls.clear()
    assert class_path(Patient).endswith(".Patient")
    assert calls == []


def test_a_class_without_a_string_module_is_named_by_its_qualname():
    namespace: dict = {"__builtins__": {"type": type}}
    exec("Orphan = type('Orphan', (), {})", namespace)  # globals without __name__: the class gets no __module__
    assert class_path(namespace["Orphan"]) == "Orphan"

    class Numbered:
        __module__ = 7  # type: ignore[assignment]

    assert class_path(Numbered) == Numbered.__qualname__


def test_a_non_class_has_no_path():
    assert class_path(nn.Linear(2, 2)) == "?"  # type: ignore[arg-type]
    assert class_path(None) == "?"  # type: ignore[arg-type]


def test_the_optimizers_a_cast_must_reach_are_those_holding_the_parameters_each_once():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    first = torch.optim.AdamW(model[0].parameters())
    second = torch.optim.SGD(model[1].parameters(), lr=0.1)
    report = mpdoctor.diagnose(model, first, second, names={id(model): "model", id(first): "first", id(second): "second"})
    facts = report.facts
    ids = {name: frozenset(id(p) for p in layer.parameters()) for name, layer in (("first", model[0]), ("second", model[1]))}

    assert [report.live.get(r) for r in facts.optimizer_refs(ids["first"])] == [first]
    assert [report.live.get(r) for r in facts.optimizer_refs(ids["first"] | ids["second"])] == [first, second]
    assert facts.optimizer_refs(frozenset()) == ()
    (m,) = facts.models
    assert facts.optimizer_refs(m.tensors.param_ids) == facts.optimizer_refs(ids["first"] | ids["second"])
