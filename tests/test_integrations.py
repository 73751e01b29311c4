"""Integrations as plug-ins; one patient per object tree; one precision model for tables and findings."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from scenarios import FIELD_CASES, HEALTHY, SHARED_TARGETS, reset_accelerate, shared_diagnosis
from setups import tiny_llama

import mpdoctor
from mpdoctor.diagnosis.view_builder import precision_view
from mpdoctor.facts.hardware import PROFILES
from mpdoctor.objects import integrations
from mpdoctor.objects.gathering import gather

TARGETS = list(SHARED_TARGETS)


def test_each_library_is_one_declaration_and_the_registry_names_them():
    names = [i.name for i in integrations.registry()]
    assert names[:4] == ["torch", "transformers", "accelerate", "peft"]  # the training stack's follow (tests/stack)
    assert len(names) == len(set(names)) and "deepspeed" in names
    for integ in integrations.registry():
        packages = tuple(integ.modules) + tuple(integ.any_modules)
        assert packages, integ.name
        for path, kind in integ.kinds:
            assert kind in integrations.KINDS and path.startswith(tuple(p + "." for p in packages)), (integ.name, path)


def test_a_library_the_user_never_imported_costs_nothing_and_is_never_imported():
    code = (
        "import sys, torch, mpdoctor\n"
        "r = mpdoctor.diagnose(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))\n"
        "from mpdoctor.objects import integrations\n"
        "print([i.name for i in integrations.active()])\n"
        "print(sorted(m for m in ('transformers', 'accelerate', 'peft') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.splitlines()[-2:] == ["['torch']", "[]"]


def test_discovery_follows_the_registry_when_a_library_is_imported():
    """A TrainingArguments is a subject only once transformers is active (it is, in this process)."""
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir="/tmp/mpdoctor-unused", use_cpu=True, report_to=[])
    report = mpdoctor.diagnose(namespace={"args": args})
    assert [(s.name, s.kind) for s in report.subjects] == [("args", "training_args")]


# -- one patient per object tree -------------------------------------------------------------------------------


def test_a_submodule_bound_to_a_second_name_is_not_a_second_patient():
    """A leftover loop variable (``layer = model.model.layers[1]``) is part of the model."""
    model = tiny_llama(torch.bfloat16, use_cache=False)
    layer = model.model.layers[1]
    layer.self_attn.float()  # the layer differs from the model: as a patient of its own it would get its own fix
    report = mpdoctor.diagnose(namespace={"model": model, "layer": layer})
    assert [s.name for s in report.subjects] == ["model"]
    assert report.facts.subjects[0].aliases == ("layer = model.model.layers.1",)
    (finding,) = report.findings_for("mixed-param-dtypes")
    assert finding.subject == "model" and all(f.subject.startswith("model") for f in report.findings)
    # The treatment is for the whole model: its compute dtype is bf16, so the fp32 attention is cast to bf16.
    report.apply_safe_fixes()
    for fix in report.fixes:
        fix.apply(confirm=True)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_an_unrelated_second_model_is_still_its_own_patient():
    a, b = tiny_llama(torch.float32), tiny_llama(torch.float32)
    report = mpdoctor.diagnose(namespace={"a": a, "b": b})
    assert [s.name for s in report.subjects] == ["a", "b"]


# -- one precision model ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("scenario", FIELD_CASES + HEALTHY, ids=lambda s: s.name)
def test_the_precision_table_agrees_with_the_findings_under_every_target(scenario, target):
    report = shared_diagnosis(scenario.name, SHARED_TARGETS).report(target)  # read only: one build, every target
    table = {row["setup"]: row["effective"] for row in precision_view(report.facts)}
    for p in report.facts.precisions:
        assert table[p.name] in (p.computes_in, "fp32" if p.computes_in == "no" else p.computes_in)
    for f in report.findings_for("precision-override"):
        setup = next(p for p in report.facts.precisions if p.name == f.subject)
        assert f.evidence["computes_in"] == setup.computes_in


# -- facts built by hand: machines and setups this CPU does not have ---------------------------------------------


def _trainer_facts(requested: str, target: str):
    """Real facts of a CPU Trainer, re-targeted: only the device profile and the precision fields are by hand."""
    from setups import tiny_trainer

    reset_accelerate()
    trainer = tiny_trainer(bf16=requested == "bf16", fp16=requested == "fp16")
    facts = mpdoctor.diagnose(trainer, names={id(trainer): "trainer"}).facts
    (p,) = facts.precisions
    p = dataclasses.replace(p, device="cuda", native_amp=True, accelerator_mixed_precision=requested, args={**p.args, "use_cpu": False})
    hw = dataclasses.replace(PROFILES[target], live=True)
    from mpdoctor.facts.precision import computes_in

    p = dataclasses.replace(p, computes_in=computes_in(p, hw))
    return dataclasses.replace(facts, precisions=(p,), hardware=hw)


def test_bf16_on_a_live_v100_built_by_hand_is_an_error_and_on_a_live_a100_is_healthy():
    from mpdoctor.rules.checks import run_checks

    v100 = run_checks(_trainer_facts("bf16", "V100"))
    assert any(f.check == "bf16-unsupported" and f.severity == "error" for f in v100)
    a100 = run_checks(_trainer_facts("bf16", "A100"))
    assert not [f for f in a100 if f.severity in ("error", "warning")], [(f.check, f.message) for f in a100]


def test_fp16_on_a_live_t4_built_by_hand_computes_in_fp16_as_asked():
    facts = _trainer_facts("fp16", "T4")
    assert facts.precisions[0].computes_in == "fp16"
    from mpdoctor.rules.checks import run_checks

    assert not [f for f in run_checks(facts) if f.check == "precision-override"]


def test_gathering_twice_gives_equal_plain_facts():
    """Facts are plain data: two gatherings of the same objects compare equal field by field."""
    model = tiny_llama(torch.bfloat16)
    from mpdoctor.objects.discovery.subjects import discover

    subjects = discover([model], names={id(model): "model"})
    one, two = gather(subjects), gather(subjects)
    assert one.models == two.models and one.subjects == two.subjects
