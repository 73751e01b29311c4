"""The public API contract: diagnose(), Report, Finding, Fix, env_report()."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
from setups import batch, tiny_gemma3, tiny_llama, tiny_lora, tiny_trainer, train_step

import mpdoctor
from mpdoctor.diagnosis.report import HISTOGRAM_COLUMNS


def test_importing_mpdoctor_imports_no_heavy_library():
    code = (
        "import sys, mpdoctor\n"
        "heavy = [m for m in ('transformers', 'accelerate', 'peft', 'pandas', 'ipywidgets', 'IPython') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_diagnose_names_objects_by_their_variable_names_and_inspects_each_once():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters())
    ns = {"model": model, "same_model": model, "opt": opt, "_private": torch.nn.Linear(2, 2), "x": 3}
    report = mpdoctor.diagnose(namespace=ns)
    names = [s.name for s in report.subjects]
    assert names == ["model", "opt"]
    assert set(report.histogram["object"]) == {"model", "opt"} - {"opt"} | {"model"}


def test_a_trainer_brings_its_model_args_accelerator_and_optimizer_along():
    trainer = tiny_trainer()
    trainer.create_optimizer()
    report = mpdoctor.diagnose(namespace={"trainer": trainer, "model": trainer.model})
    kinds = {s.name: s.kind for s in report.subjects}
    assert kinds["trainer"] == "trainer"
    assert kinds["model"] == "model"  # the direct name wins over trainer.model
    assert kinds["trainer.args"] == "training_args"
    assert kinds["trainer.accelerator"] == "accelerator"
    assert kinds["trainer.optimizer"] == "optimizer"
    assert len([s for s in report.subjects if s.kind == "model"]) == 1
    (setup,) = report.facts.precisions
    assert setup.name == "trainer" and setup.args_name == "trainer.args"


def test_peft_model_is_one_subject_under_its_outer_name_with_the_inner_config():
    lora = tiny_lora()
    report = mpdoctor.diagnose(namespace={"peft_model": lora})
    (model,) = report.facts.models
    assert model.name == "peft_model" and model.is_peft
    assert model.configs[0].path == "peft_model.config"
    trainable = report.histogram.query("kind == 'param' and trainable")
    assert set(trainable["dtype"]) == {"float32"}  # PEFT's adapters stay fp32 on a bf16 base
    assert "bfloat16" in set(report.histogram.query("kind == 'param' and not trainable")["dtype"])


def test_compiled_module_is_unwrapped_and_keeps_the_outer_name():
    model = tiny_llama()
    compiled = torch.compile(model)
    report = mpdoctor.diagnose(namespace={"compiled": compiled})
    (m,) = report.facts.models
    assert m.name == "compiled" and m.inner_class == "LlamaForCausalLM"
    assert m.configs[0].path == "compiled.config"


def test_accelerated_optimizer_is_unwrapped_and_brings_its_scaler():
    from accelerate import Accelerator

    model = tiny_llama()
    acc = Accelerator(cpu=True)
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.scaler = torch.amp.GradScaler("cpu")
    report = mpdoctor.diagnose(namespace={"opt": opt, "model": model})
    (o,) = report.facts.optimizers
    assert o.class_name == "SGD" and o.wrapper.endswith("AcceleratedOptimizer")
    assert [s.name for s in report.subjects if s.kind == "scaler"] == ["opt.scaler"]


def test_nested_sub_configs_are_gathered_with_their_cache_flags():
    model = tiny_gemma3()
    report = mpdoctor.diagnose(namespace={"model": model})
    flags = {c.path: (c.has_use_cache, c.use_cache) for c in report.facts.models[0].configs}
    assert flags["model.config"] == (False, None)
    assert flags["model.config.text_config"] == (True, True)
    assert "model.config.vision_config" in flags


def test_histogram_has_one_row_per_object_kind_dtype_and_trainability():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters())
    train_step(model, opt)
    model.lm_head.weight.requires_grad_(False)
    hist = mpdoctor.diagnose(model, opt).histogram
    assert list(hist.columns) == HISTOGRAM_COLUMNS
    assert set(hist["kind"]) == {"param", "grad", "buffer", "optimizer_state"}
    params = hist.query("kind == 'param'")
    assert params["elements"].sum() == sum(p.numel() for p in model.parameters())
    assert params["bytes"].sum() == sum(p.numel() * p.element_size() for p in model.parameters())
    assert set(params["trainable"]) == {True, False}


def test_meta_tensors_are_counted_without_touching_data():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8))
    hist = mpdoctor.diagnose(model).histogram
    assert int(hist["meta"].sum()) == 4 and int(hist["elements"].sum()) == 1024 * 1024 + 1024 + 8 * 1024 + 8


@pytest.mark.parametrize(
    ("target", "bf16"),
    [("T4", False), ("V100", False), ("A10G", True), ("A100", True), ("L4", True), ("H100", True), ("cpu", True)],
)
def test_target_profiles_say_which_devices_have_native_bf16(target, bf16):
    report = mpdoctor.diagnose(tiny_llama(), target=target)
    assert report.facts.hardware.bf16_native is bf16
    assert report.facts.hardware.live is False
    assert report.to_dict()["device"]["bf16_native"] is bf16


def test_unknown_target_is_a_clear_value_error():
    with pytest.raises(ValueError, match="unknown target 'Z80'"):
        mpdoctor.diagnose(target="Z80")


def test_exports_are_complete_and_serialisable():
    model = tiny_llama(torch.bfloat16)
    scaler = torch.amp.GradScaler("cpu")
    report = mpdoctor.diagnose(namespace={"model": model, "scaler": scaler})
    data = json.loads(report.to_json())
    assert data["summary"] == report.counts()
    assert {f["check"] for f in data["findings"]} >= {"scaler-with-bf16", "cache-in-training"}
    frame = report.to_frame()
    assert isinstance(frame, pd.DataFrame) and len(frame) == len(report.findings)
    md = report.to_markdown()
    assert "torch 2." in md and "transformers" in md and "`scaler-with-bf16`" in md and "cpu (live)" in md
    bundle = report._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"}
    assert set(report._repr_mimebundle_(include=["text/html"])) == {"text/html"}


def test_findings_and_fixes_carry_the_contracted_fields():
    report = mpdoctor.diagnose(namespace={"model": tiny_gemma3()})
    (finding,) = report.findings_for("cache-in-training")
    assert finding.severity in ("error", "warning", "info")
    assert finding.subject == "model.config.text_config.use_cache"
    assert "model.config.text_config" in finding.evidence["use_cache_true"]
    (fix,) = finding.fixes
    assert fix.safe and not fix.applied
    assert "model.config.text_config.use_cache = False" in fix.code
    assert fix.title.startswith("Set use_cache=False")


def test_apply_safe_fixes_then_refresh_shows_a_clean_report_and_undo_restores():
    model = tiny_gemma3()
    report = mpdoctor.diagnose(namespace={"model": model})
    applied = report.apply_safe_fixes()
    assert applied and all(f.applied for f in applied)
    assert model.config.text_config.use_cache is False
    assert not report.refresh().findings_for("cache-in-training")
    for f in applied:
        f.undo()
    assert model.config.text_config.use_cache is True
    assert report.refresh().findings_for("cache-in-training")


def test_diagnose_never_raises_when_an_object_cannot_be_read():
    class Broken(torch.nn.Module):
        def named_modules(self, *a, **k):
            raise RuntimeError("boom")

    report = mpdoctor.diagnose(namespace={"broken": Broken(), "model": tiny_llama()})
    (err,) = report.findings_for("internal-error")
    assert err.subject == "broken" and "boom" in err.message
    assert report.findings_for("cache-in-training")  # the rest of the report still happened


def test_env_report_lists_allowlisted_variables_and_never_a_token(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    monkeypatch.setenv("HF_TOKEN", "hf_" + "a1B2c3D4" * 4)
    env = mpdoctor.env_report()
    text = str(env)
    assert env["environment"] == {"ACCELERATE_MIXED_PRECISION": "fp16"}
    assert "hf_a1B2" not in text and "HF_TOKEN" not in text
    assert "torch" in env["versions"] and "bf16 native" in env


def test_python_m_mpdoctor_env_prints_the_env_report():
    out = subprocess.run(
        [sys.executable, "-m", "mpdoctor", "env"], capture_output=True, text=True, check=True, env=dict(os.environ)
    ).stdout
    assert "bf16 native" in out and "versions" in out


def test_report_refresh_keeps_target_scan_and_ignore():
    report = mpdoctor.diagnose(tiny_llama(), target="T4", ignore=["cache-in-training"])
    again = report.refresh()
    assert again.target == "T4" and again.ignore == ("cache-in-training",)
    assert not again.findings_for("cache-in-training")


def test_a_training_step_still_works_after_diagnosing():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mpdoctor.diagnose(model, opt)
    assert torch.isfinite(torch.tensor(train_step(model, opt, batch())))


# -- a first hour without friction: introspection, optional libraries, diagnose() with no arguments -------------

_BLOCK_OPTIONAL = '''
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    """Simulates an environment without these libraries: importing them raises ImportError."""
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric", "transformers"):
            raise ImportError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, Absent())
'''


def _run_python(code: str) -> subprocess.CompletedProcess:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root, env=env)


def test_help_dir_star_import_and_getattr_work_without_lightning_or_transformers():
    code = _BLOCK_OPTIONAL + '''
import pydoc, mpdoctor
pydoc.render_doc(mpdoctor)  # help(mpdoctor) without a pager
ns = {}
exec("from mpdoctor import *", ns)
assert set(mpdoctor.__all__) <= set(ns), set(mpdoctor.__all__) - set(ns)
for name in dir(mpdoctor):
    getattr(mpdoctor, name, None)
for name, extra in (("MPDoctorCallback", "hf"), ("MPDoctorLightningCallback", "lightning")):
    try:
        getattr(mpdoctor, name)()
    except ImportError as exc:
        assert f'pip install "mpdoctor[{extra}]"' in str(exc), str(exc)
        print("said:", exc)
    else:
        raise AssertionError(name + " built without its library")
assert "transformers" not in sys.modules and "lightning" not in sys.modules
print("ok")
'''
    proc = _run_python(code)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("said:") == 2


def test_tab_completion_shows_only_public_names():
    names = dir(mpdoctor)
    assert set(mpdoctor.__all__) <= set(names)
    private = [n for n in names if n.startswith("_") and n != "__version__"]
    assert not private, private
    assert not {"importlib", "annotations", "Any", "TYPE_CHECKING"} & set(names)


def test_the_callbacks_are_the_real_classes_when_their_libraries_are_installed():
    from transformers import TrainerCallback

    assert issubclass(mpdoctor.MPDoctorCallback, TrainerCallback)


def test_diagnose_without_arguments_in_a_script_inspects_the_callers_globals_and_locals():
    code = '''
import torch, mpdoctor
model = torch.nn.Linear(4, 4)
def train():
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    return mpdoctor.diagnose()
print(sorted(s.name for s in mpdoctor.diagnose().subjects))
print(sorted(s.name for s in train().subjects))
'''
    proc = _run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    module_level, in_function = proc.stdout.strip().splitlines()[-2:]
    assert module_level == "['model']"
    assert in_function == "['model', 'opt', 'scaler']"


def test_diagnose_of_something_it_does_not_inspect_says_what_it_was_given():
    report = mpdoctor.diagnose(42)
    assert not report.subjects
    (note,) = report.notes
    assert note.startswith("argument 1 is an int: nothing to inspect")
    assert note in report.to_text(width=1000) and note in report.to_dict()["notes"]
    assert "argument 1 is an int" in report.to_html() and note in report.to_markdown()
    tensor_note = mpdoctor.diagnose(torch.zeros(2, dtype=torch.float16), names=None).notes[0]
    assert "is a tensor (float16)" in tensor_note
