"""Fix safety of turning fp8 on in place (``ConvertToFloat8``), where the stack is pinned (torchao, accelerate).

Beside ``tests/test_fix_safety.py``'s matrix, which runs in every version corner: this fix needs torchao, which only
the pinned corner installs, so its safety test lives here (a missing torchao fails, never skips).
"""

from __future__ import annotations

import pytest
import torch
import torchao  # noqa: F401  (plain import: tests/stack runs where the stack is pinned)
from fingerprint import assert_unchanged, fingerprint
from scenarios import reset_accelerate
from test_fix_safety import oom

import mpdoctor
from mpdoctor.rules.engine.fixes import FixFailed


def _fp8_run_that_converted_nothing() -> dict:
    """accelerate's fp8 with the torchao recipe on a two-Linear model: its default filter converted no layer."""
    from accelerate import Accelerator
    from accelerate.utils import AORecipeKwargs

    reset_accelerate()
    torch.manual_seed(0)
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()], cpu=True)
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)))
    return {"model": model, "opt": acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2)), "accelerator": acc}


def test_turning_fp8_on_swaps_layers_over_the_same_parameters_and_undoes_to_the_very_modules(monkeypatch):
    """``ConvertToFloat8``: each Linear becomes a Float8Linear holding the very same Parameters (the optimizer is
    untouched), a second report's matching fix adds nothing, undo puts the original module objects back with the
    fingerprint exact; a conversion failing on the second layer leaves the first unswapped."""
    import mpdoctor.libraries.torchao.integration as torchao_integration

    ns = _fp8_run_that_converted_nothing()
    model = ns["model"]
    first, second = (mpdoctor.diagnose(namespace=ns) for _ in range(2))
    fix, twin = (next(fx for fx in r.fixes if fx.recipe == "float8-convert-live") for r in (first, second))
    layers, params = list(model), list(model.parameters())
    before = fingerprint(ns)
    real, calls = torchao_integration.float8_training_layer, []

    def failing_second(linear, config):
        calls.append(1)
        if len(calls) == 2:
            raise oom("the second layer")
        return real(linear, config)

    monkeypatch.setattr(torchao_integration, "float8_training_layer", failing_second)
    with pytest.raises(FixFailed):
        fix.apply(confirm=True)
    assert list(model) == layers and all(a is b for a, b in zip(model, layers)) and fix.error
    assert_unchanged(before, fingerprint(ns), "a conversion failing half way")
    monkeypatch.undo()
    fix = next(fx for fx in mpdoctor.diagnose(namespace=ns).fixes if fx.recipe == "float8-convert-live")
    fix.apply(confirm=True)
    assert [type(m).__name__ for m in model] == ["Float8Linear", "ReLU", "Float8Linear"] and model[1] is layers[1]
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert all(a is b for a, b in zip((p for g in ns["opt"].param_groups for p in g["params"]), params))
    converted = list(model)
    assert twin.in_place
    twin.apply(confirm=True)
    assert all(a is b for a, b in zip(model, converted)), "the same conversion applied a second time"
    twin.undo()
    fix.undo()
    assert all(a is b for a, b in zip(model, layers)) and all(a is b for a, b in zip(model.parameters(), params))
    assert_unchanged(before, fingerprint(ns), "undo of the float8 conversion")
