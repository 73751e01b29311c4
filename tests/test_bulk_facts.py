"""The bulk gathering keeps the facts a per-tensor walk would give, at per-class cost where it can.

``bench/bench_diagnose.py`` measures the speed; these tests pin what the speed must not change: the
class index answers like a per-module filter while asking each class once, the per-module dtypes derived
from the parameter records list tied weights where ``named_modules()`` meets them (and follow a simulated
cast), and the per-layer strip folds expert indices into one row per projection.
"""

from __future__ import annotations

import torch
from torch import nn

import mpdoctor
from mpdoctor.diagnosis.view_builder import layer_rows
from mpdoctor.objects.live.introspect import class_paths, modules_of, modules_where, shared_module_walks
from mpdoctor.objects.readers.tensors import read_module_tensors
from mpdoctor.render.formatting import layer_strips
from mpdoctor.rules.engine.changes import CastParamsTo


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8, bias=False)
        self.down = nn.Linear(8, 4, bias=False)


class Block(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.experts = nn.ModuleList(Expert() for _ in range(experts))


class TiedLM(nn.Module):
    def __init__(self, layers: int = 5, experts: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(Block(experts) for _ in range(layers))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter, two modules


def test_the_class_index_answers_like_a_per_module_filter_asking_each_class_once():
    model = TiedLM()
    asked: list[type] = []

    def linear(cls: type) -> bool:
        asked.append(cls)
        return "torch.nn.modules.linear.Linear" in class_paths(cls)

    with shared_module_walks():
        found = modules_where(model, linear)
        again = modules_of(model, ("torch.nn.modules.normalization.LayerNorm",))
    naive = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert [p for p, _ in found] == [p for p, _ in naive] and all(a is b for (_, a), (_, b) in zip(found, naive))
    assert len(asked) == len(set(asked)) == len({type(m) for m in model.modules()})  # once per class
    assert [p for p, _ in again] == [f"layers.{i}.norm" for i in range(5)]


def test_a_class_test_that_raises_takes_nothing():
    def broken(cls: type) -> bool:
        raise RuntimeError("hostile")

    assert modules_where(TiedLM(), broken) == []


def test_module_dtypes_derived_from_params_list_tied_weights_in_walk_order():
    model = TiedLM(layers=2, experts=1)
    tensors = read_module_tensors("m", model)
    naive = []
    for path, mod in model.named_modules():
        own = [(n, str(p.dtype)[6:], p.requires_grad) for n, p in mod._parameters.items() if p is not None]
        if own:
            naive.append((path, own))
    assert [(md.path, list(md.params)) for md in tensors.modules] == naive
    assert tensors.modules[-1].path == "head" and tensors.modules[-1].class_path == "torch.nn.modules.linear.Linear"
    assert len(tensors.params) == len(list(model.parameters()))  # the tied weight is one parameter record


def test_a_simulated_cast_of_a_tied_weight_reaches_both_modules():
    model = TiedLM(layers=1, experts=1)
    report = mpdoctor.diagnose(model)
    m = report.facts.models[0]
    spec = CastParamsTo(m.ref, frozenset({id(model.embed.weight)}), "bfloat16")
    after = spec.simulate(report.facts).models[0].tensors
    by_path = {md.path: md.dtypes for md in after.modules}
    assert by_path["embed"] == by_path["head"] == frozenset({"bfloat16"})
    assert by_path["layers.0.norm"] == frozenset({"float32"})
    assert after.param_dtype_counts()["bfloat16"] == 40 and after.main_dtype == "float32"


def test_the_layer_strip_folds_expert_indices_into_one_row_per_projection():
    model = TiedLM(layers=5, experts=3)
    with torch.no_grad():
        model.layers[2].experts[1].up.to(torch.bfloat16)
    (strip,) = layer_strips(layer_rows(mpdoctor.diagnose(model).facts))
    assert strip.kinds == ["norm", "experts.*.up", "experts.*.down"]
    assert strip.layers == [0, 1, 2, 3, 4] and strip.differing == [2]
    assert strip.cells[(2, "experts.*.up")] == ("bfloat16", "float32")
    assert strip.cells[(0, "experts.*.up")] == ("float32",)
