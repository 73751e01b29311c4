"""DeepSpeed configs beside TrainingArguments and accelerate, and the DeepSpeed engine, on one CPU process.

Every failure is the real one first (the HF integration's, accelerate's or DeepSpeed's own error, or a
measured skipped step), then the diagnosis (its slug), then the fix, then a step that trains (bf16 on
this CPU). The processes join a one-rank gloo group, as ``deepspeed`` / ``torchrun`` would set it up.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os

import deepspeed
import pytest
import torch
from deepspeed_support import (
    SINGLE_RANK_ENV,
    ensure_shm_op,
    free_port,
    tiny_llama,
    token_dataset,
    training_args,
    zero_config,
)
from transformers import Trainer

import mpdoctor
from mpdoctor.attach.crash.patterns import match_exception
from mpdoctor.libraries.deepspeed.facts import DeepSpeedFacts
from mpdoctor.libraries.deepspeed.integration import engine_facts, loss_scaler_facts


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """A one-rank process group for the module (DeepSpeed joins it); everything process-wide it leaves
    behind is undone after: the environment exactly (TrainingArguments(deepspeed=...) sets
    ``ACCELERATE_USE_DEEPSPEED``), transformers' global DeepSpeed config, ZeRO-3's replacement of
    ``torch.nn.functional.linear``, the group, DeepSpeed's comm."""
    ensure_shm_op()
    saved_env = dict(os.environ)
    os.environ.update(SINGLE_RANK_ENV, MASTER_PORT=free_port())
    yield
    import deepspeed.comm.comm as ds_comm
    from accelerate.state import AcceleratorState
    from deepspeed.runtime.zero.partition_parameters import (
        InsertPostInitMethodToModuleSubClasses as zero3_init,
    )
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    # ZeRO-3 replaces torch.nn.functional.linear process-wide ("This will persist unless manually reset.")
    torch.nn.functional.linear = getattr(zero3_init, "linear_bk", torch.nn.functional.linear)
    if torch.distributed.is_initialized():
        if ds_comm.cdb is not None:  # DeepSpeed's teardown also drops the groups it cached (its world group)
            ds_comm.destroy_process_group()
        else:
            torch.distributed.destroy_process_group()
    ds_comm.cdb = None  # DeepSpeed's own "initialised" flag: the next module starts afresh
    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ.clear()
    os.environ.update(saved_env)


@pytest.fixture(autouse=True)
def _no_deepspeed_env_leaks_between_tests():
    """Each test starts with the module's environment (a test's TrainingArguments write into it)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _trainer(args):
    return Trainer(model=tiny_llama(), args=args, train_dataset=token_dataset())


def _findings(report, slug):
    return [f for f in report.findings if f.check == slug]


def _no_error_or_warning(report):
    bad = [(f.severity, f.check, f.message) for f in report.findings if f.severity in ("error", "warning")]
    assert not bad, bad


def _apply_planned(report):
    for fix in report.fixes:
        if fix.applicability.value != "display-only":
            fix.apply()


def _trains(trainer) -> None:
    """``trainer.train()`` must train: one step, a finite loss, the model's parameters moved."""
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    before = [p.detach().float().clone() for p in params]
    loss = trainer.train().training_loss
    assert trainer.state.global_step == 1 and math.isfinite(loss), loss
    assert any(not torch.equal(b, p.detach().float()) for b, p in zip(before, params)), "no parameter moved"


def _config_fragments(code: str) -> dict:
    """The DeepSpeed config keys a display-only fix shows as JSON comment lines (``# ...: "key": value``)."""
    out: dict = {}
    for line in code.splitlines():
        text = line.lstrip("#").strip()
        for candidate in (text, text.split(": ", 1)[-1]):  # with or without a label before the keys
            try:
                out.update(json.loads("{" + candidate + "}"))
                break
            except ValueError:
                continue
    return out


def _run_display_only(code: str, namespace: dict) -> dict:
    """Execute a display-only fix's Python lines as written (its comments are the config part)."""
    exec(code, namespace)  # noqa: S102 - the report's own snippet, with the user's names bound
    return namespace


# -- field cases ---------------------------------------------------------------------------------------


def test_bf16_config_while_arguments_ask_fp32_is_fixed_before_train(tmp_path):
    """https://github.com/Ucas-HaoranWei/GOT-OCR2.0/issues/134: zero2.json enables bf16, the command line
    does not pass --bf16, and train() raises "ds bf16.enabled=True vs hf bf16|bf16_full_eval=False"."""
    cfg = zero_config(2, bf16={"enabled": True})
    del cfg["fp16"]
    original_cfg = copy.deepcopy(cfg)
    trainer = _trainer(training_args(cfg, tmp_path))
    with pytest.raises(ValueError, match=r"mismatch TrainingArguments values:\n- ds bf16.enabled=True vs hf bf16\|bf16_full_eval=False") as raised:
        trainer.train()
    assert match_exception(raised.value)[0].slug == "crash-deepspeed-config-mismatch"

    report = mpdoctor.diagnose(namespace={"trainer": trainer})
    (finding,) = _findings(report, "deepspeed-precision-mismatch")
    assert finding.severity == "error" and "bf16" in finding.message
    assert finding.fixes[0].safe and finding.fixes[1].applicability.value == "display-only"
    assert "dataclasses.replace(trainer.args, fp16=False, bf16=True)" in finding.fixes[1].code
    display_only = finding.fixes[1]

    finding.fixes[0].apply()
    assert trainer.args.hf_deepspeed_config.mismatches == []
    trainer.train()
    assert trainer.state.global_step == 1
    assert not _findings(mpdoctor.diagnose(namespace={"trainer": trainer}), "deepspeed-precision-mismatch")
    # The display-only fix, executed on a fresh twin (same config, same arguments), then "rebuild the Trainer".
    # (After the in-place case: building TrainingArguments writes process-wide state, the environment included.)
    twin = _trainer(training_args(copy.deepcopy(original_cfg), tmp_path))
    ns = _run_display_only(display_only.code, {"trainer": twin})
    rebuilt = _trainer(ns["trainer"].args)
    assert not _findings(mpdoctor.diagnose(namespace={"trainer": rebuilt}), "deepspeed-precision-mismatch")
    _trains(rebuilt)
    assert rebuilt.model_wrapped.bfloat16_enabled()


def test_fp16_config_while_arguments_ask_fp32_is_fixed_before_train(tmp_path):
    """https://github.com/shibing624/MedicalGPT/issues/191 and https://github.com/LianjiaTech/BELLE/issues/154:
    the shipped DeepSpeed json enables fp16, the user sets fp16 false, train() raises
    "ds fp16.enabled=True vs hf fp16|fp16_full_eval...=False"."""
    cfg = zero_config(2, fp16={"enabled": True})
    del cfg["bf16"]
    args = training_args(cfg, tmp_path)
    report = mpdoctor.diagnose(namespace={"args": args})  # caught on the arguments alone, before any Trainer
    (finding,) = _findings(report, "deepspeed-precision-mismatch")
    assert finding.subject == "args"

    trainer = _trainer(args)
    with pytest.raises(ValueError, match=r"- ds fp16.enabled=True vs hf fp16\|fp16_full_eval=False"):
        trainer.train()
    report = mpdoctor.diagnose(namespace={"trainer": trainer, "args": args})
    (finding,) = _findings(report, "deepspeed-precision-mismatch")
    _apply_planned(report)
    assert args.hf_deepspeed_config.config["fp16"]["enabled"] is False
    trainer.train()
    assert trainer.state.global_step == 1


def test_fp16_and_bf16_both_enabled_is_fixed_before_the_trainer_exists(tmp_path):
    """https://github.com/Snowflake-AI-Research/Arctic-Platform/pull/78: a config that ends up with fp16 and
    bf16 both enabled hits DeepSpeed's assert "bfloat16 and fp16 modes cannot be simultaneously enabled";
    through TrainingArguments(bf16=True), accelerate refuses to build the Trainer first."""
    from deepspeed.runtime.config import DeepSpeedConfig

    both = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True}, "bf16": {"enabled": True}}
    with pytest.raises(AssertionError, match="bfloat16 and fp16 modes cannot be simultaneously enabled"):
        DeepSpeedConfig(copy.deepcopy(both))
    args = training_args(zero_config(2, fp16={"enabled": True}, bf16={"enabled": True}), tmp_path, bf16=True)
    with pytest.raises(ValueError, match="cannot be set to `bf16` when `fp16` is set in the DeepSpeed config"):
        _trainer(args)
    # The refused Trainer leaves accelerate's process-wide state half set up (a later Trainer in the same
    # process would train with DDP, not DeepSpeed): start from the state a fresh process has.
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)

    report = mpdoctor.diagnose(namespace={"args": args})
    (finding,) = _findings(report, "deepspeed-precision-mismatch")
    assert "fp16 and bf16" in finding.message
    _apply_planned(report)
    assert args.hf_deepspeed_config.config["fp16"]["enabled"] is False
    assert args.hf_deepspeed_config.config["bf16"]["enabled"] is True

    trainer = _trainer(args)
    trainer.train()
    assert trainer.model_wrapped.bfloat16_enabled() and trainer.state.global_step == 1


def _onednn_fp16() -> bool:
    """The capability DeepSpeed's CPU accelerator and mpdoctor both read: torch's oneDNN fp16 query."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:
        return False


@pytest.fixture(params=["this CPU", "forced: no oneDNN fp16", "forced: oneDNN fp16"])
def onednn_fp16(request, monkeypatch) -> bool:
    """Whether this CPU's oneDNN has fp16 (avx512_fp16 / AMX-FP16 CPUs do): as this machine answers, then
    forced each way through torch's own query, which DeepSpeed's ``CPU_Accelerator.is_fp16_supported`` and
    mpdoctor's ``device_support`` both call: every CI machine proves both answers."""
    if request.param == "this CPU":
        return _onednn_fp16()
    answer = request.param == "forced: oneDNN fp16"
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: answer)
    return answer


def test_the_fp16_probe_is_the_one_deepspeed_reads(onednn_fp16):
    from deepspeed.accelerator import get_accelerator

    assert bool(get_accelerator().is_fp16_supported()) == onednn_fp16


def test_fp16_where_deepspeed_refuses_it_is_switched_to_bf16_before_train(tmp_path, onednn_fp16):
    """DeepSpeed refuses fp16 where its accelerator has none: on a CPU without oneDNN fp16,
    "ValueError: Type fp16 is not supported on your device." at train(), after the model is built. The fix
    switches the config, the arguments and the accelerator to bf16 together, in place; undo restores them.
    Where oneDNN has fp16, DeepSpeed trains in fp16 and mpdoctor finds nothing to refuse."""
    if onednn_fp16:
        trainer = _trainer(training_args(zero_config(2), tmp_path, fp16=True))
        assert not _findings(mpdoctor.diagnose(namespace={"trainer": trainer}), "deepspeed-precision-unsupported")
        trainer.train()
        assert trainer.model_wrapped.fp16_enabled() and trainer.state.global_step == 1
        return
    args = training_args(zero_config(2), tmp_path, fp16=True)
    trainer = _trainer(args)
    with pytest.raises(ValueError, match="Type fp16 is not supported on your device.") as raised:
        trainer.train()
    assert match_exception(raised.value)[0].slug == "crash-deepspeed-precision-unsupported"

    report = mpdoctor.diagnose(namespace={"trainer": trainer})
    (finding,) = _findings(report, "deepspeed-precision-unsupported")
    assert finding.severity == "error" and "Type fp16 is not supported on your device" in finding.message
    in_place, rebuild = finding.fixes
    assert in_place.applicability.value == "unsafe" and rebuild.applicability.value == "display-only"
    assert "dataclasses.replace(trainer.args, fp16=False, bf16=True)" in rebuild.code

    config = args.hf_deepspeed_config.config
    before = (copy.deepcopy(config), args.fp16, args.bf16, args.mixed_precision, trainer.accelerator.mixed_precision)
    in_place.apply()
    assert (config["fp16"]["enabled"], config["bf16"]["enabled"], args.fp16, args.bf16) == (False, True, False, True)
    assert trainer.accelerator.mixed_precision == "bf16"
    in_place.undo()
    assert (config, args.fp16, args.bf16, args.mixed_precision, trainer.accelerator.mixed_precision) == before

    in_place.apply()
    _no_error_or_warning(mpdoctor.diagnose(namespace={"trainer": trainer}))
    trainer.train()
    assert trainer.model_wrapped.bfloat16_enabled() and trainer.state.global_step == 1
    # (After the in-place case: building TrainingArguments writes process-wide state, the environment included.)
    # The display-only fix, executed on a fresh twin: its config keys into the config, its Python as written,
    # then the Trainer rebuilt from the new arguments.
    twin_cfg = zero_config(2)
    fragment = _config_fragments(rebuild.code)
    assert fragment == {"fp16": {"enabled": False}, "bf16": {"enabled": True}}
    twin = _trainer(training_args(twin_cfg, tmp_path, fp16=True))  # the user's setup, as it was built
    twin_cfg.update(fragment)  # the user's config dict, edited as the comment says
    ns = _run_display_only(rebuild.code, {"trainer": twin})
    rebuilt = _trainer(ns["trainer"].args)
    _no_error_or_warning(mpdoctor.diagnose(namespace={"trainer": rebuilt}))
    _trains(rebuilt)
    assert rebuilt.model_wrapped.bfloat16_enabled()


def test_bf16_deepspeed_on_a_v100_target_is_refused(tmp_path):
    """bf16 on a GPU below sm_80: DeepSpeed raises "Type bf16 is not supported on your device." GPU-only:
    this CPU accepts bf16, so the what-if target stands in."""
    trainer = _trainer(training_args(zero_config(2), tmp_path, bf16=True))
    report = mpdoctor.diagnose(namespace={"trainer": trainer}, target="V100")
    (finding,) = _findings(report, "deepspeed-precision-unsupported")
    assert "Type bf16 is not supported" in finding.message
    assert '"fp16": {"enabled": true}' in finding.fixes[0].code
    assert not _findings(mpdoctor.diagnose(namespace={"trainer": trainer}), "deepspeed-precision-unsupported")


def test_fp16_loss_scale_at_minimum_is_an_error():
    """https://github.com/ymcui/Chinese-LLaMA-Alpaca/issues/534, https://github.com/yangjianxin1/Firefly/issues/68:
    "Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run." (the fix
    reported there: bf16, as the checkpoint was trained). DeepSpeed refuses an fp16 engine on this CPU, so
    the real scaler its ZeRO optimizer creates stands alone here, read by the same function as the engine's."""
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler

    scaler = CreateLossScaler(dtype=torch.half, static_loss_scale=0, dynamic_scaling=True,
                              dynamic_loss_args={"init_scale": 2**4, "scale_window": 1000, "min_scale": 1,
                                                 "delayed_shift": 2, "consecutive_hysteresis": False})
    seen = []
    with pytest.raises(Exception, match="Current loss scale already at minimum - cannot decrease scale anymore") as raised:
        for _ in range(10):  # every step overflows: hysteresis, then halvings down to min_scale
            seen.append(DeepSpeedFacts("engine", "engine", fp16=True, device_bf16=True, **loss_scaler_facts(scaler)))
            scaler.update_scale(True)
    assert match_exception(raised.value)[0].checks[0] == "deepspeed-loss-scale-collapsed"
    report = mpdoctor.rules.checks.run_checks(dataclasses.replace(mpdoctor.diagnose().facts, deepspeed=(seen[-1],)))
    (finding,) = [f for f in report if f.check == "deepspeed-loss-scale-collapsed"]
    assert finding.severity == "error" and "bf16" in finding.fixes[0].code
    early = mpdoctor.rules.checks.run_checks(dataclasses.replace(mpdoctor.diagnose().facts, deepspeed=(seen[0],)))
    assert not [f for f in early if f.check == "deepspeed-loss-scale-collapsed"]

    # The fix: rebuild in bf16. The bf16 engine's scaler is static (1.0): nothing to collapse.
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}})
    engine.backward(engine(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum())
    engine.step()
    facts = engine_facts("engine", engine, mpdoctor.objects.live.Live())
    assert facts.dynamic_loss_scale is False and facts.loss_scale == 1.0 and facts.master_dtype == "float32"
    _no_error_or_warning(mpdoctor.diagnose(namespace={"engine": engine}))


def _engine(comm: str | None, stage: int = 2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    if comm is not None:
        cfg["communication_data_type"] = comm
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def _large_gradient_step(engine) -> None:
    loss = engine(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum() * 1e6  # gradients past fp16's 65504
    engine.backward(loss)
    engine.step()


def test_fp16_reduction_of_bf16_gradients_skips_steps():
    """https://github.com/deepspeedai/DeepSpeed/issues/2071 ("FP16 used for all reduce even if BFLOAT16 is
    enabled"): bf16 gradients reduced in fp16 overflow to inf above 65504 and the step is skipped. Measured
    here: one large-gradient step, skipped; the same step with an fp32 reduction is taken."""
    engine = _engine("fp16")
    _large_gradient_step(engine)
    assert engine.skipped_steps == 1

    report = mpdoctor.diagnose(namespace={"engine": engine})
    (finding,) = _findings(report, "deepspeed-low-precision-reduction")
    assert finding.severity == "warning" and "65504" in finding.message
    assert finding.fixes[0].applicability.value == "display-only"
    # The display-only fix, executed on a fresh twin: its config key into the same config, a new engine.
    fragment = _config_fragments(finding.fixes[0].code)
    assert fragment == {"communication_data_type": "fp32"}
    fixed = _engine(fragment["communication_data_type"])
    before = [p.detach().float().clone() for p in fixed.module.parameters()]
    _large_gradient_step(fixed)
    assert fixed.skipped_steps == 0
    assert any(not torch.equal(b, p.detach().float()) for b, p in zip(before, fixed.module.parameters()))
    assert all(torch.isfinite(p).all() for p in fixed.module.parameters())
    assert not _findings(mpdoctor.diagnose(namespace={"engine": fixed}), "deepspeed-low-precision-reduction")
    _no_error_or_warning(mpdoctor.diagnose(namespace={"engine": fixed}))


def test_fp16_reduction_in_a_trainer_config_is_fixed_in_place(tmp_path):
    """The same config in TrainingArguments, caught before train(): fixed in the config dict, undone exactly."""
    trainer = _trainer(training_args(zero_config(2, communication_data_type="fp16"), tmp_path, bf16=True))
    config = trainer.args.hf_deepspeed_config.config
    before = copy.deepcopy(config)
    report = mpdoctor.diagnose(namespace={"trainer": trainer})
    (finding,) = _findings(report, "deepspeed-low-precision-reduction")
    assert finding.severity == "warning" and finding.fixes[0].safe
    finding.fixes[0].apply()
    assert config["communication_data_type"] == "fp32"
    finding.fixes[0].undo()
    assert config == before
    finding.fixes[0].apply()
    trainer.train()
    assert trainer.model_wrapped.communication_data_type == torch.float32


def test_precision_fix_undo_restores_config_and_mismatch_lines(tmp_path):
    cfg = zero_config(2, bf16={"enabled": True})
    args = training_args(cfg, tmp_path)
    hf = args.hf_deepspeed_config
    before = (copy.deepcopy(hf.config), list(hf.mismatches))
    (finding,) = _findings(mpdoctor.diagnose(namespace={"args": args}), "deepspeed-precision-mismatch")
    fix = finding.fixes[0]
    fix.apply()
    assert hf.mismatches == [] and hf.config["bf16"]["enabled"] is False
    fix.undo()
    assert (hf.config, hf.mismatches) == before

    exec(fix.code, {"args": args})  # the code shown is pasteable and does the same
    assert hf.mismatches == [] and hf.config["bf16"]["enabled"] is False


# -- healthy recipes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [2, 3])
def test_healthy_zero_bf16_recipe_draws_no_error_or_warning(tmp_path, stage):
    """The HF DeepSpeed docs' recipe: "auto" precision in the config, ``bf16=True`` in the arguments
    (ZeRO-2 and ZeRO-3). Before train(): no error, no warning; the 16-bit reduction is information."""
    trainer = _trainer(training_args(zero_config(stage), tmp_path, bf16=True))
    report = mpdoctor.diagnose(namespace={"trainer": trainer})
    _no_error_or_warning(report)
    assert [f.severity for f in _findings(report, "deepspeed-low-precision-reduction")] == ["info"]
    trainer.train()
    engine = trainer.model_wrapped
    report = mpdoctor.diagnose(namespace={"trainer": trainer, "engine": engine})
    _no_error_or_warning(report)
    (facts,) = report.facts.deepspeed
    assert (facts.source, facts.bf16, facts.fp16, facts.zero_stage) == ("engine", True, False, stage)
    assert facts.master_dtype == "float32" and facts.master_partitions >= 1 and facts.module_dtype == "bfloat16"


_WAKES_ON_THE_OBJECT = r'''
import os, sys, tempfile
sys.path.insert(0, "tests")
from deepspeed_support import SINGLE_RANK_ENV, free_port, tiny_llama, token_dataset, training_args, zero_config
os.environ.update(SINGLE_RANK_ENV, MASTER_PORT=free_port())
import mpdoctor

cfg = zero_config(2, fp16={"enabled": True})  # a shipped json that enables fp16, while the arguments ask bf16
del cfg["bf16"]
args = training_args(cfg, tempfile.mkdtemp(), bf16=True, learning_rate=1e-2)
assert "deepspeed" not in sys.modules, "the arguments alone import no deepspeed"
report = mpdoctor.diagnose(namespace={"args": args})
assert "deepspeed" not in sys.modules, "mpdoctor imported deepspeed"
(finding,) = [f for f in report.findings if f.check == "deepspeed-precision-mismatch"]
print("found:", finding.severity, finding.subject)

from transformers import Trainer
try:  # the real failure: accelerate refuses the fp16 config beside bf16 arguments
    Trainer(model=tiny_llama(), args=args, train_dataset=token_dataset())
except ValueError as exc:
    print("real error:", str(exc).splitlines()[0])
else:
    raise AssertionError("the mismatched arguments built a Trainer")
from accelerate.state import AcceleratorState
AcceleratorState._reset_state(reset_partial_state=True)  # the refused Trainer left it half set up

for fix in report.fixes:
    if fix.applicability.value != "display-only":
        fix.apply()
assert args.hf_deepspeed_config.config["fp16"]["enabled"] is False
trainer = Trainer(model=tiny_llama(), args=args, train_dataset=token_dataset())
before = [p.detach().clone() for p in trainer.model.parameters()]
import math, torch
out = trainer.train()
assert trainer.state.global_step == 1 and trainer.model_wrapped.bfloat16_enabled()
assert math.isfinite(out.training_loss)
after = [p.detach() for p in trainer.model.parameters()]
assert any(not torch.equal(a.to(b.dtype), b) for a, b in zip(before, after)), "no parameter changed"
print("trained:", trainer.state.global_step)
'''


def test_a_deepspeed_config_in_training_arguments_is_checked_before_deepspeed_is_imported():
    """The DeepSpeed integration wakes on the object (``TrainingArguments(deepspeed=cfg)`` holds the config),
    not only on ``import deepspeed``: in a fresh process where nothing imported deepspeed, the fp16 config
    beside bf16 arguments is still caught."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root, TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", ""))
    proc = subprocess.run([sys.executable, "-c", _WAKES_ON_THE_OBJECT], capture_output=True, text=True,
                          timeout=600, cwd=root, env=env)
    out = proc.stdout
    assert proc.returncode == 0, out[-2000:] + proc.stderr[-4000:]
    assert "found: error args" in out
    assert "real error:" in out and "trained: 1" in out
