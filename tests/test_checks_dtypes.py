"""Specifications of the dtype checks: mixed-param-dtypes, grad-dtype-mismatch, load-dtype-mismatch.

Each legitimate case is proven to run before it is asserted silent; each
reported case is proven to fail (or to waste) before it is asserted reported.
"""

from __future__ import annotations

import pytest
import torch
from setups import batch, tiny_gemma3, tiny_llama, tiny_trainer
from setups_dtypes import assert_same_state, finite, tensor_state

import mpdoctor
from mpdoctor import compat
from mpdoctor.objects.edits.steps import CastGrads, Change
from mpdoctor.rules.checks.dtypes import compute_dtype, compute_units, widens
from mpdoctor.rules.engine.fixes import Fix, FixFailed

SAME_DTYPE = r"(mat1|self|m1) and (mat2|m2).*same dtype"


def mixed(*objects, **kwargs):
    return mpdoctor.diagnose(*objects, **kwargs).findings_for("mixed-param-dtypes")


def norms_to_fp32(model) -> list[str]:
    names = [n for n, m in model.named_modules() if type(m).__name__.endswith("Norm")]
    for n in names:
        model.get_submodule(n).float()
    return names


# -- mixed-param-dtypes: what is legitimate ------------------------------------------------------


def test_fp32_gemma_rmsnorms_in_a_bf16_model_return_the_input_dtype_and_are_not_reported():
    model = tiny_gemma3(torch.bfloat16)
    norms_to_fp32(model)
    model(**batch()).loss.backward()  # Gemma's RMSNorm computes in fp32 and returns type_as(x)
    assert not mixed(model)


def test_torch_layernorm_kept_in_fp32_returns_the_input_dtype_and_is_not_reported():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8)).bfloat16()
    model[1].float()
    assert model(torch.randn(2, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert not mixed(model)


def test_bf16_norms_in_an_fp32_llama_promote_to_fp32_and_are_not_reported():
    model = tiny_llama()
    for n in norms_to_fp32(model):
        model.get_submodule(n).bfloat16()
    model(**batch()).loss.backward()
    assert not mixed(model)


def test_modules_transformers_keeps_in_fp32_are_not_reported():
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=64, decoder_start_token_id=0)
    model = T5ForConditionalGeneration(config).bfloat16()
    for name, module in model.named_modules():
        if name.endswith(".wo"):
            module.float()  # what from_pretrained(dtype=torch.float16) does for _keep_in_fp32_modules
    ids = batch()["input_ids"]
    model(input_ids=ids, labels=ids).loss.backward()  # T5's FF layer casts to wo's dtype
    report = mpdoctor.diagnose(model)
    assert report.facts.models[0].keep_in_fp32 == ("wo",)
    assert not report.findings_for("mixed-param-dtypes")


@pytest.fixture
def fp32_head_on_bf16_llama():
    model = tiny_llama(torch.bfloat16, use_cache=False)
    model.lm_head.float()
    return model


def test_an_fp32_lm_head_on_a_bf16_llama_raises_and_is_an_error(fp32_head_on_bf16_llama):
    model = fp32_head_on_bf16_llama
    with pytest.raises(RuntimeError, match=SAME_DTYPE):
        model(**batch())
    (finding,) = mixed(model)
    assert finding.severity == "error" and finding.evidence["modules"] == {"lm_head": ["float32"]}


def test_autocast_makes_mixed_weights_legal(fp32_head_on_bf16_llama):
    model = fp32_head_on_bf16_llama
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(**batch()).loss.backward()
        assert not mixed(model)


def test_accelerates_autocast_wrapper_makes_mixed_weights_legal(fp32_head_on_bf16_llama):
    from accelerate import Accelerator

    model = Accelerator(mixed_precision="bf16", cpu=True).prepare(fp32_head_on_bf16_llama)
    model(**batch()).loss.backward()
    assert not mixed(model)


def test_a_trainer_that_autocasts_its_model_makes_mixed_weights_legal_in_its_steps_but_not_in_generate(fp32_head_on_bf16_llama):
    trainer = tiny_trainer(fp32_head_on_bf16_llama, bf16=True)
    (covered,) = mixed(trainer)  # the Trainer autocasts its own steps; generate() outside them raises
    assert covered.severity == "warning" and "generate" in covered.message
    with pytest.raises(RuntimeError, match=SAME_DTYPE):
        trainer.model.generate(input_ids=batch()["input_ids"][:1, :4], max_new_tokens=1, do_sample=False)
    (without_trainer,) = mixed(trainer.model)  # the same model on its own: nothing autocasts it
    assert without_trainer.severity == "error"


# -- mixed-param-dtypes: what is reported ---------------------------------------------------------


def test_fp32_llama_rmsnorms_in_a_bf16_llama_really_raise_so_they_are_a_warning():
    model = tiny_llama(torch.bfloat16, use_cache=False)
    norms = norms_to_fp32(model)
    with pytest.raises(RuntimeError, match=SAME_DTYPE):
        model(**batch())  # LlamaRMSNorm returns weight * x: fp32, into a bf16 q_proj
    (finding,) = mixed(model)
    assert finding.severity == "warning"
    assert set(finding.evidence["roles"].values()) == {"norm"} and set(finding.evidence["modules"]) == set(norms)
    (fix,) = finding.fixes
    assert not fix.safe
    fix.apply()
    assert finite(model(**batch()).loss.item())


def test_a_linear_whose_weight_and_bias_differ_is_an_error():
    layer = torch.nn.Linear(8, 8).bfloat16()
    layer.bias.data = layer.bias.data.float()
    with pytest.raises(RuntimeError):
        layer(torch.randn(2, 8, dtype=torch.bfloat16))
    (finding,) = mixed(layer)
    assert finding.severity == "error" and finding.evidence["modules"] == {"": ["bfloat16", "float32"]}


def test_widening_a_bf16_minority_in_an_fp32_model_is_a_safe_fix():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 4))
    model[1].bfloat16()
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match=SAME_DTYPE):
        model(x)
    report = mpdoctor.diagnose(model)
    (fix,) = report.findings_for("mixed-param-dtypes")[0].fixes
    assert fix.safe
    before = tensor_state(model)
    assert report.apply_safe_fixes() == [fix]
    assert model(x).dtype == torch.float32 and not report.refresh().findings_for("mixed-param-dtypes")
    fix.undo()
    assert_same_state(before, tensor_state(model), same_objects=True)


def test_the_compute_dtype_is_the_dtype_of_most_elements_with_ties_to_the_first_module():
    big_first = torch.nn.Sequential(torch.nn.Linear(4, 4).bfloat16(), torch.nn.Linear(64, 64))
    tie = torch.nn.Sequential(torch.nn.Linear(4, 4).bfloat16(), torch.nn.Linear(4, 4))
    for model, expected in ((big_first, "float32"), (tie, "bfloat16")):
        m = mpdoctor.diagnose(model).facts.models[0]
        assert compute_dtype(m, compute_units(m)) == expected


def test_widens_means_every_value_survives():
    assert widens("bfloat16", "float32") and widens("float16", "float32")
    assert not widens("float32", "bfloat16") and not widens("float16", "bfloat16") and not widens("float32", "float32")


# -- grad-dtype-mismatch -----------------------------------------------------------------------------


def narrowed_after_backward(opt_class=torch.optim.AdamW, **opt_kwargs):
    """``p.data = p.data.bfloat16()`` after a backward: the fp32 grads stay behind."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    opt = opt_class(layer.parameters(), lr=0.01, **opt_kwargs)
    layer(torch.randn(4, 8)).square().mean().backward()
    for p in layer.parameters():
        p.data = p.data.bfloat16()
    return layer, opt


def test_a_stale_fp32_grad_on_a_narrowed_parameter_makes_adamw_raise():
    layer, opt = narrowed_after_backward()
    assert {p.grad.dtype for p in layer.parameters()} == {torch.float32}
    with pytest.raises(RuntimeError, match=r"expected dtype c10::BFloat16 for `end` but got dtype float"):
        opt.step()


def test_grad_dtype_mismatch_is_an_error_under_adamw_and_the_fix_lets_it_step():
    layer, opt = narrowed_after_backward()
    grads = [p.grad for p in layer.parameters()]
    report = mpdoctor.diagnose(layer, opt)
    (finding,) = report.findings_for("grad-dtype-mismatch")
    assert finding.severity == "error" and finding.evidence["raises_in"] == ["optimizer"]
    assert finding.evidence["pairs"] == ["float32 grads on bfloat16 parameters"]
    (fix,) = finding.fixes
    assert not fix.safe  # the grads narrow
    assert "p.grad.data = p.grad.data.to(p.dtype)" in fix.code

    before = tensor_state(layer, opt)
    fix.apply()
    assert [p.grad for p in layer.parameters()] == grads  # the same grad tensors ...
    assert {p.grad.dtype for p in layer.parameters()} == {torch.bfloat16}  # ... in the parameter's dtype
    assert not report.refresh().findings_for("grad-dtype-mismatch")
    fix.undo()
    assert_same_state(before, tensor_state(layer, opt), same_objects=True)
    fix.apply().apply()
    opt.step()
    assert all(torch.isfinite(p).all() for p in layer.parameters())


def test_a_grad_cast_rolled_back_by_a_later_failing_step_leaves_every_grad_as_it_was():
    layer, opt = narrowed_after_backward()

    class Refuse(Change):
        description = "a step that fails after the grads were cast"

        def apply(self) -> None:
            raise RuntimeError("refused")

        def revert(self) -> None:
            pass

    fix = Fix("cast grads, then fail", "")
    fix._plan = lambda: [CastGrads(list(layer.parameters())), Refuse()]  # the fault-injection hook
    before = tensor_state(layer, opt)
    with pytest.raises(FixFailed, match="refused"):
        fix.apply()
    assert not fix.applied
    assert_same_state(before, tensor_state(layer, opt), same_objects=True)


def test_fp32_grads_on_bf16_params_make_sgd_momentum_silently_fp32_which_is_a_warning():
    def gradient_precision_fp32():
        torch.manual_seed(0)
        layer = torch.nn.Linear(8, 8).bfloat16()
        opt = torch.optim.SGD(layer.parameters(), lr=0.01, momentum=0.9)
        layer(torch.randn(4, 8, dtype=torch.bfloat16)).square().mean().backward()
        for p in layer.parameters():
            p.grad.data = p.grad.data.float()  # SimpleTuner's --gradient_precision=fp32
        return layer, opt

    layer, opt = gradient_precision_fp32()
    opt.step()
    assert {opt.state[p]["momentum_buffer"].dtype for p in layer.parameters()} == {torch.float32}

    layer, opt = gradient_precision_fp32()
    (finding,) = mpdoctor.diagnose(layer, opt).findings_for("grad-dtype-mismatch")
    assert finding.severity == "warning" and finding.evidence["raises_in"] == []
    finding.fixes[0].apply()
    opt.step()
    assert {opt.state[p]["momentum_buffer"].dtype for p in layer.parameters()} == {torch.bfloat16}


def test_a_bf16_grad_on_an_fp32_parameter_is_widened_by_a_safe_fix():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    opt = torch.optim.Adam(layer.parameters())
    layer(torch.randn(4, 8)).square().mean().backward()
    for p in layer.parameters():
        p.grad.data = p.grad.data.bfloat16()
    report = mpdoctor.diagnose(opt)  # an optimizer on its own is checked too
    (finding,) = report.findings_for("grad-dtype-mismatch")
    assert finding.subject == "optimizer" and finding.severity == "error"
    (fix,) = finding.fixes
    assert fix.safe and "optimizer.param_groups" in fix.code
    report.apply_safe_fixes()
    opt.step()
    assert {p.grad.dtype for p in layer.parameters()} == {torch.float32}


# -- load-dtype-mismatch -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A tiny Llama saved in bf16: its config.json says dtype bfloat16."""
    path = tmp_path_factory.mktemp("bf16-llama")
    model = tiny_llama(torch.bfloat16, use_cache=False)
    setattr(model.config, compat.config_dtype_attribute(), torch.bfloat16)
    model.save_pretrained(path)
    return path


def load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def test_a_model_loaded_in_its_checkpoint_dtype_is_not_reported(bf16_checkpoint):
    model = load(bf16_checkpoint)
    assert model.dtype == model.config.dtype == torch.bfloat16
    assert not mpdoctor.diagnose(model).findings_for("load-dtype-mismatch")


def test_a_bf16_checkpoint_held_in_fp32_for_inference_is_info_with_an_unsafe_cast(bf16_checkpoint):
    model = load(bf16_checkpoint).float()  # what transformers 4.x did by default
    report = mpdoctor.diagnose(model)
    (finding,) = report.findings_for("load-dtype-mismatch")
    assert finding.severity == "info" and "2x the memory" in finding.message
    assert finding.evidence == {"model_dtype": "float32", "config_dtype": "bfloat16", "held_by_optimizer": False}
    (fix,) = finding.fixes
    assert not fix.safe
    before = tensor_state(model)
    fix.apply()
    assert model.dtype == torch.bfloat16 and not report.refresh().findings_for("load-dtype-mismatch")
    fix.undo()
    assert_same_state(before, tensor_state(model), same_objects=True)


def test_fp32_master_weights_of_a_bf16_checkpoint_under_an_optimizer_are_info_without_a_fix(bf16_checkpoint):
    model = load(bf16_checkpoint).float()
    opt = torch.optim.AdamW(model.parameters())
    (finding,) = mpdoctor.diagnose(model, opt).findings_for("load-dtype-mismatch")
    assert finding.severity == "info" and finding.fixes == [] and "master weights" in finding.message


def test_a_bf16_checkpoint_held_in_fp16_is_a_warning(bf16_checkpoint):
    model = load(bf16_checkpoint).half()
    (finding,) = mpdoctor.diagnose(model).findings_for("load-dtype-mismatch")
    assert finding.severity == "warning" and "65504" in finding.message
    assert finding.fixes and not finding.fixes[0].safe


def test_an_fp32_checkpoint_held_in_bf16_is_info_without_a_fix():
    model = tiny_llama(torch.bfloat16)
    model.config.dtype = torch.float32
    (finding,) = mpdoctor.diagnose(model).findings_for("load-dtype-mismatch")
    assert finding.severity == "info" and finding.fixes == []
