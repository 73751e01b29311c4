"""Nothing is mutated while looking: diagnose(), scan, rendering, refresh() and probe().

The fingerprint (tests/fingerprint.py) covers every tensor's bytes, dtype,
device, requires_grad, storage and version counter, every ``.grad``, every
optimizer state tensor and scalar, every config attribute through nested
sub-configs, every GradScaler / Trainer / TrainingArguments / Accelerator
field, the module hook dicts, the whole environment, autocast, TF32,
``float32_matmul_precision``, the RNG state and the global module hooks. It
must be identical before and after, for every scenario: field cases, healthy
controls and generated hostile namespaces.
"""

from __future__ import annotations

import gc
import os
import types
from unittest import mock

import pytest
import torch
from fingerprint import assert_unchanged, fingerprint
from hypothesis import given, settings
from scenarios import BY_NAME, HOSTILE_CALLS, SCENARIOS, hostile_pool
from test_hostile_namespaces import HOSTILE, namespaces

import mpdoctor

HOSTILE_FINGERPRINT_EXAMPLES = 100


def _render_everything(report: mpdoctor.Report) -> None:
    report.to_text(), report.to_html(), report.to_json(), report.to_markdown(), repr(report)
    report.histogram, report.to_frame(), report._repr_mimebundle_()
    report.widget().close()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_diagnosing_scanning_rendering_and_refreshing_change_nothing(scenario):
    ns = scenario.build()
    # Earlier tests' garbage (a Trainer's DataLoaderShard, weakly held by accelerate's shared GradientState)
    # is collected now, not in the middle: a weakref dying to the garbage collector is not a mutation.
    gc.collect()
    before = fingerprint(ns)
    report = mpdoctor.diagnose(namespace=ns)
    assert_unchanged(before, fingerprint(ns), "diagnose()")
    scanned = mpdoctor.diagnose(namespace=ns, scan=True, target="T4")
    assert_unchanged(before, fingerprint(ns), "diagnose(scan=True)")
    _render_everything(report)
    _render_everything(scanned)
    assert_unchanged(before, fingerprint(ns), "rendering the report")
    report.refresh(), scanned.refresh()
    for fix in report.fixes:
        fix.preview()
    assert_unchanged(before, fingerprint(ns), "refresh() and fix previews")


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_probe_changes_nothing(scenario):
    ns = scenario.build()
    model, batch, setup = scenario.probe_inputs(ns)
    before = fingerprint(ns, objects=[batch])
    report = mpdoctor.probe(model, batch, setup=setup)
    assert_unchanged(before, fingerprint(ns, objects=[batch]), "probe()")
    _render_everything(report)
    assert_unchanged(before, fingerprint(ns, objects=[batch]), "rendering the probe report")


@pytest.fixture()
def tf32_state():
    """Restore the TF32 flags and matmul precision (legacy flag first: mixing the APIs is sticky)."""
    precision = torch.get_float32_matmul_precision()
    legacy = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = legacy
    torch.set_float32_matmul_precision(precision)
    assert torch.get_float32_matmul_precision() == precision


def test_diagnosing_inside_autocast_with_tf32_and_medium_matmul_precision_keeps_them(tf32_state):
    ns = SCENARIOS[0].build()
    torch.set_float32_matmul_precision("medium")
    torch.backends.cudnn.allow_tf32 = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = fingerprint(ns)
        report = mpdoctor.diagnose(namespace=ns, scan=True)
        _render_everything(report)
        assert_unchanged(before, fingerprint(ns), "diagnose() inside autocast")
        assert report.facts.runtime.autocast == {"cpu": "bfloat16"}
        assert report.facts.runtime.float32_matmul_precision == "medium"


def test_a_notebook_that_mixed_the_legacy_and_new_tf32_apis_is_still_diagnosed(tf32_state):
    """torch >= 2.9 raises in get_float32_matmul_precision() once both APIs were used."""
    ns = SCENARIOS[0].build()
    torch.set_float32_matmul_precision("medium")
    torch.backends.cuda.matmul.allow_tf32 = True
    before = fingerprint(ns)
    report = mpdoctor.diagnose(namespace=ns)
    assert not report.findings_for("internal-error"), report.findings_for("internal-error")[0].message
    assert report.findings_for("scaler-with-bf16")
    _render_everything(report)
    mpdoctor.env_report()
    assert_unchanged(before, fingerprint(ns), "diagnose() with mixed TF32 APIs")


def test_the_whole_hostile_pool_is_unchanged_by_a_diagnosis():
    pool = hostile_pool()
    ns = {r.key: r.value for r in pool.real} | pool.hostile | pool.huge
    HOSTILE_CALLS.clear()
    before = fingerprint(ns)
    assert HOSTILE_CALLS == [], "the fingerprint itself must not call hostile code"
    report = mpdoctor.diagnose(namespace=ns, scan=True)
    _render_everything(report)
    assert_unchanged(before, fingerprint(ns), "diagnose() of the hostile pool")
    assert HOSTILE_CALLS == []


@pytest.fixture(scope="module", autouse=True)
def _pool():
    return hostile_pool()


@settings(HOSTILE, max_examples=HOSTILE_FINGERPRINT_EXAMPLES)
@given(gen=namespaces())
def test_generated_hostile_namespaces_are_unchanged_by_a_diagnosis(gen):
    before = fingerprint(gen.namespace, objects=gen.objects)
    report = mpdoctor.diagnose(*gen.objects, namespace=gen.namespace, hidden=gen.hidden, scan=gen.scan, target=gen.target)
    report.to_text()
    assert_unchanged(before, fingerprint(gen.namespace, objects=gen.objects), f"diagnose() of {gen.describe()}")


# -- the fingerprint itself sees every kind of change ------------------------------------------------


def _first_param(ns):
    return next(ns["model"].parameters())


def _hook(ns):
    handle = ns["model"].model.layers[0].register_forward_pre_hook(lambda *a: None)
    return handle.remove


def _autocast(ns):
    torch.set_autocast_enabled("cpu", True)
    return lambda: torch.set_autocast_enabled("cpu", False)


def _tf32(ns):
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = not old
    return lambda: setattr(torch.backends.cudnn, "allow_tf32", old)


def _mock_child(ns):
    ns["mock"].some_attribute  # noqa: B018  (reading an attribute of a MagicMock creates a child)


MUTATIONS = {
    "one byte of a weight": lambda ns: _first_param(ns).data.view(-1)[0].add_(1),
    "a weight's dtype": lambda ns: setattr(_first_param(ns), "data", _first_param(ns).data.float()),
    "requires_grad": lambda ns: _first_param(ns).requires_grad_(False),
    "a grad's values": lambda ns: _first_param(ns).grad.mul_(2),
    "a grad dropped": lambda ns: setattr(_first_param(ns), "grad", None),
    "an optimizer state tensor": lambda ns: next(iter(ns["opt"].state.values()))["exp_avg"].add_(1),
    "an optimizer state scalar": lambda ns: next(iter(ns["opt"].state.values()))["step"].add_(1),
    "a param group's lr": lambda ns: ns["opt"].param_groups[0].__setitem__("lr", 0.5),
    "a config attribute": lambda ns: setattr(ns["model"].config, "use_cache", False),
    "a generation config attribute": lambda ns: setattr(ns["model"].generation_config, "use_cache", False),
    "the scaler's scale": lambda ns: ns["scaler"]._scale.fill_(2.0),
    "the scaler's enabled flag": lambda ns: setattr(ns["scaler"], "_enabled", False),
    "an environment variable": lambda ns: os.environ.__setitem__("ACCELERATE_MIXED_PRECISION", "bf16"),
    "autocast": _autocast,
    "a tf32 flag": _tf32,
    "the RNG state": lambda ns: torch.rand(1),
    "a forward pre-hook": _hook,
    "train/eval mode": lambda ns: ns["model"].eval(),
    "a Parameter replaced by an equal copy": lambda ns: setattr(
        ns["model"].lm_head, "weight", torch.nn.Parameter(ns["model"].lm_head.weight.detach().clone())
    ),
    "a mock's recorded children": _mock_child,
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_the_fingerprint_sees_every_kind_of_change(mutation):
    ns = BY_NAME["bf16_model_with_enabled_scaler"].build()
    # A user's MagicMock in the namespace (input, not a library stand-in): reading any attribute of it
    # grows a child, so it proves the fingerprint sees attribute reads on hostile objects.
    ns["mock"] = mock.MagicMock()
    before = fingerprint(ns)
    assert fingerprint(ns) == before
    cleanup = MUTATIONS[mutation](ns)
    try:
        assert fingerprint(ns) != before, f"the fingerprint missed: {mutation}"
    finally:
        if isinstance(cleanup, (types.FunctionType, types.MethodType)):  # not a returned Module or tensor
            cleanup()
