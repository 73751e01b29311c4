"""The diffusers, bitsandbytes and torchao integrations read the installed versions' objects correctly.

Semi-private state is read in one place per library (``mpdoctor/libraries/<library>/integration.py``); these tests pin
those reads to the installed versions, check that a pipeline is one patient with parts, and that the new
fixes are in place, atomic and exactly undoable (fingerprints).
"""

from __future__ import annotations

import subprocess
import sys

import bitsandbytes as bnb
import pytest
import torch
from fingerprint import assert_unchanged, fingerprint
from test_field_diffusers import overflowing_vae, tiny_pipe, tiny_vae
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

import mpdoctor
from mpdoctor.libraries.bitsandbytes import integration as bnb_integration
from mpdoctor.libraries.torchao import integration as torchao_integration


def test_a_pipeline_is_one_patient_whose_components_are_child_models():
    pipe = tiny_pipe()
    report = mpdoctor.diagnose(namespace={"pipe": pipe})
    kinds = {s.name: (s.kind, s.owner) for s in report.facts.subjects}
    assert kinds["pipe"] == ("pipeline", None)
    assert {n for n, (k, o) in kinds.items() if o == "pipe"} == {"pipe.unet", "pipe.vae", "pipe.text_encoder"}
    # A component the user also holds by its own name is diagnosed once, under that name (as a Trainer's model is).
    both = {s.name for s in mpdoctor.diagnose(namespace={"pipe": pipe, "vae": pipe.vae}).facts.subjects}
    assert "vae" in both and "pipe.vae" not in both
    models = {m.name: m for m in report.facts.models}
    assert models["pipe.vae"].component.is_vae and models["pipe.vae"].component.flag("force_upcast") is True
    assert models["pipe.unet"].component.flag("upcast_attention") is False
    assert models["pipe.text_encoder"].component is None  # a transformers model, not a diffusers one
    assert all(models[n].owner == "pipe" for n in models)


def test_linear4bit_facts_match_bitsandbytes_state():
    layer = bnb.nn.Linear4bit(32, 32, compute_dtype=torch.bfloat16, quant_type="fp4")
    facts = bnb_integration.layer_facts("q", layer)
    assert (facts.bits, facts.compute_dtype, facts.compute_dtype_set, facts.quant_type, facts.quantized) == (4, "bfloat16", True, "fp4", False)
    layer.to("cpu")  # quantizes
    facts = bnb_integration.layer_facts("q", layer)
    assert facts.quantized and facts.storage_dtype == "uint8"
    unset = bnb_integration.layer_facts("k", bnb.nn.Linear4bit(32, 32))
    assert unset.compute_dtype is None and not unset.compute_dtype_set
    eight = bnb_integration.layer_facts("o", bnb.nn.Linear8bitLt(32, 32, has_fp16_weights=False).to("cpu"))
    assert (eight.bits, eight.quantized, eight.storage_dtype) == (8, True, "int8")
    assert bnb_integration.layer_facts("x", torch.nn.Linear(2, 2)) is None


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_float8_recipe_is_read_from_the_layer_config(recipe):
    config = Float8LinearConfig.from_recipe_name(recipe)
    assert torchao_integration.recipe_of(config) == recipe
    m = convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(16, 32)), config=config)
    (layer,) = mpdoctor.diagnose(m).facts.models[0].float8_layers
    assert (layer.path, layer.in_features, layer.out_features, layer.recipe) == ("0", 16, 32, recipe)


def test_the_integrations_cost_nothing_when_their_libraries_are_not_imported():
    code = (
        "import sys, torch, mpdoctor\n"
        "r = mpdoctor.diagnose(torch.nn.Linear(2, 2))\n"
        "print(sorted(m for m in ('diffusers', 'bitsandbytes', 'torchao') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def _apply_and_undo(report, slug, namespace):
    before = fingerprint(namespace)
    fix = next(f for f in report.findings if f.check == slug).fixes[0]
    fix.apply()
    fix.undo()
    assert_unchanged(before, fingerprint(namespace), f"{slug}: apply then undo")


def test_vae_upcast_and_pipeline_cast_are_exactly_undoable():
    vae = overflowing_vae().half()
    report = mpdoctor.probe(vae, torch.randn(1, 3, 16, 16).half(), name="vae", loss_fn=lambda o: o.sample.float().mean())
    _apply_and_undo(report, "vae-fp16-overflow", {"vae": vae})
    pipe = tiny_pipe()
    pipe.unet.half()
    report = mpdoctor.diagnose(pipe, names={id(pipe): "pipe"})
    _apply_and_undo(report, "pipeline-component-dtypes", {"pipe": pipe, "te": pipe.text_encoder})


def test_the_static_vae_finding_is_info_and_a_force_upcast_vae_draws_none():
    assert "vae-fp16-overflow" not in {f.check for f in mpdoctor.diagnose(tiny_vae(True).half()).findings}
    assert {f.check: f.severity for f in mpdoctor.diagnose(tiny_vae(False).half()).findings}["vae-fp16-overflow"] == "info"


def test_the_stack_integrations_are_registered_after_the_core_ones():
    names = [i.name for i in mpdoctor.objects.integrations.registry()]
    assert {"diffusers", "bitsandbytes", "torchao"} <= set(names[4:])
    assert "pipeline" in mpdoctor.objects.integrations.KINDS
