"""Specifications of the generation probe: ``mpdoctor.probe(model, batch, generate=True)`` runs a few decoding
steps of the real ``generate`` under the probe's hooks, names the first module out of its dtype's range and
the decoding step at which logits and probabilities went NaN/Inf, and leaves the model as it was.

Tiny random models never overflow fp16 by themselves (docs/stack.md): each failing model has one weight set inside
fp16's range so that one activation passes 65504; the same weights in bf16 and fp32 are the healthy twins."""

from __future__ import annotations

import pytest
import torch
from setups import tiny_llama
from setups_dtypes import alarms
from transformers import GPT2Config, GPT2LMHeadModel

import mpdoctor

PROMPT = {"input_ids": torch.tensor([[3, 14, 15, 9, 2, 6]]), "labels": torch.tensor([[3, 14, 15, 9, 2, 6]])}
TOKEN = 7  # the token whose embedding overflows in the GPT-2 below


def overflowing_llama(dtype: torch.dtype) -> torch.nn.Module:
    """A tiny Llama whose layer-1 up_proj has one row of 40000: its output passes 65504 in fp16 at every token."""
    model = tiny_llama(dtype, train=True)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0] = 40000.0
    return model


def gpt2_overflowing_at_its_first_new_token(dtype: torch.dtype) -> torch.nn.Module:
    """A tiny GPT-2 where only ``TOKEN`` overflows, and greedy search picks it as the first new token.

    Its embedding (40000) plus the position embeddings (30000) is 70000: past fp16's 65504 at the sum GPT-2 makes
    before its first module; every other token sums to about 0. ``suppress_tokens`` leaves ``TOKEN`` the only
    choice, so the prompt's prefill (step 0) is finite and decoding step 1, which feeds ``TOKEN``, is not.
    """
    torch.manual_seed(0)
    config = GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        wte = model.transformer.wte.weight
        others = torch.arange(64) != TOKEN
        wte[others] = -30000.0 + 0.01 * wte[others]
        wte[TOKEN] = 40000.0
        model.transformer.wpe.weight[:] = 30000.0
    model.generation_config.suppress_tokens = [i for i in range(64) if i != TOKEN]
    model.generation_config.pad_token_id = 0
    return model.to(dtype).eval()


def state(model: torch.nn.Module) -> dict:
    """What the probe must leave as it found it: modes, hooks, RNG, weights, the generation config."""
    return {
        "modes": [m.training for m in model.modules()],
        "hooks": [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()],
        "global_hooks": (len(torch.nn.modules.module._global_forward_hooks),
                         len(torch.nn.modules.module._global_forward_pre_hooks)),  # fmt: skip
        "rng": torch.get_rng_state(),
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "generation_config": model.generation_config.to_json_string(),
    }


def assert_same(before: dict, after: dict) -> None:
    assert before["modes"] == after["modes"] and before["hooks"] == after["hooks"]
    assert before["global_hooks"] == after["global_hooks"]
    assert torch.equal(before["rng"], after["rng"])
    assert before["generation_config"] == after["generation_config"]
    assert all(torch.equal(before["weights"][k], v) for k, v in after["weights"].items())


def test_an_fp16_overflow_is_named_at_the_prefill_with_its_module_and_the_model_is_left_as_it_was():
    model = overflowing_llama(torch.float16)
    with torch.no_grad():
        assert torch.isnan(model.generate(PROMPT["input_ids"], max_new_tokens=1, output_logits=True,
                                          return_dict_in_generate=True).logits[0]).all()  # fmt: skip
    model.train()
    before = state(model)
    report = mpdoctor.probe(model, PROMPT, generate=True, max_new_tokens=4)
    assert_same(before, state(model))

    (finding,) = report.findings_for("probe-generation-nonfinite")
    assert finding.severity == "error"
    assert "logits went NaN/Inf at the prompt's prefill (step 0)" in finding.message
    assert "model.model.layers.1.mlp.up_proj (Linear), at the prompt's prefill (step 0)" in finding.message
    (first,) = report.findings_for("probe-nonfinite")
    assert first.evidence["module"] == "model.layers.1.mlp.up_proj"
    generation = report.facts.probes[0].generation
    assert generation.steps == 4 and generation.new_tokens == 4


def test_the_overflowing_modules_bf16_fix_applied_from_the_generation_probe_makes_generate_finite():
    model = overflowing_llama(torch.float16)
    report = mpdoctor.probe(model, PROMPT, generate=True, max_new_tokens=4)
    (first,) = report.findings_for("probe-nonfinite")
    bf16 = next(fx for fx in first.fixes if fx.changes and "bf16" in fx.title)
    # The plan (the planner predicts the overflow gone in bf16's range) is checked on the probe's own generate(),
    # a stand-in for the user's call ("checked", never "verified"), judged by its logits: NaN before, finite after.
    proof = report.proof
    assert proof.stand_in.startswith("the probe's generate() on your batch") and not proof.verified
    assert proof.before.ran and proof.before.inference and not proof.before.trained
    assert bf16 in report.fixes and proof.checked and proof.plan.inference, proof.summary()
    assert proof.label(bf16).startswith("checked on the probe's generate() on your batch"), proof.label(bf16)
    assert "applied alone, it ran and its output is finite (an inference step" in proof.label(bf16)
    bf16.apply()
    again = report.refresh()  # the same generation probe, on the fixed model
    assert not again.findings_for("probe-generation-nonfinite") and not again.findings_for("probe-nonfinite")
    with torch.no_grad():
        out = model.generate(PROMPT["input_ids"], max_new_tokens=4, output_logits=True, return_dict_in_generate=True)
    assert all(torch.isfinite(step).all() for step in out.logits)  # the user's own generate()
    bf16.undo()
    assert {p.dtype for p in model.parameters()} == {torch.float16}


def test_an_overflow_only_at_a_later_decoding_step_is_placed_at_that_step():
    model = gpt2_overflowing_at_its_first_new_token(torch.float16)
    report = mpdoctor.probe(model, {"input_ids": torch.tensor([[3, 14, 15, 9]])}, generate=True, max_new_tokens=4)
    (finding,) = report.findings_for("probe-generation-nonfinite")
    assert "logits went NaN/Inf at decoding step 1" in finding.message
    assert "model.transformer.drop (Dropout), at decoding step 1" in finding.message
    generation = report.facts.probes[0].generation
    assert generation.logits_nonfinite[0] == 0 and generation.first_bad_logits == 1


def test_when_sampling_refuses_nan_probabilities_the_error_is_reported_and_everything_is_restored():
    model = overflowing_llama(torch.float16)
    model.generation_config.do_sample = True
    model.eval()
    before = state(model)
    report = mpdoctor.probe(model, PROMPT, generate=True, max_new_tokens=4)
    assert_same(before, state(model))  # hooks gone, modes and RNG streams back, though generate raised
    assert report.facts.probes[0].error.exception == "RuntimeError"
    assert "probability tensor contains either" in report.facts.probes[0].error.message
    (finding,) = report.findings_for("probe-generation-nonfinite")
    assert "of 1 step run" in finding.message  # the prefill ran; sampling from it raised


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("build", [overflowing_llama, gpt2_overflowing_at_its_first_new_token])
def test_the_same_weights_in_fp32_and_bf16_generate_with_no_alarm(build, dtype):
    model = build(dtype)
    batch = PROMPT if build is overflowing_llama else {"input_ids": torch.tensor([[3, 14, 15, 9]])}
    report = mpdoctor.probe(model, batch, generate=True, max_new_tokens=4)
    generation = report.facts.probes[0].generation
    assert generation.steps == 4 and generation.first_bad_logits is None and generation.first_bad_probs is None
    assert not report.findings_for("probe-generation-nonfinite") and not report.findings_for("probe-nonfinite")
    assert [a for a in alarms(report) if a.startswith("probe")] == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_healthy_llama_generates_under_the_probe_with_no_alarm(dtype):
    model = tiny_llama(dtype, train=False)
    report = mpdoctor.probe(model, PROMPT, generate=True, max_new_tokens=4)
    assert alarms(report) == []
    assert report.facts.probes[0].generation.new_tokens == 4


def test_a_model_without_generate_is_refused_with_the_reason():
    with pytest.raises(TypeError, match="generate=True needs a model with a generate"):
        mpdoctor.probe(torch.nn.Linear(4, 4), torch.randn(2, 4), generate=True)


def test_a_sampling_crash_is_explained_and_the_generation_probe_it_asks_for_becomes_its_cause(capsys):
    """The crash hook knows torch's refusal to sample NaN probabilities, but no check sees an overflow in flight at
    rest: its cause is a note that says which probe to run. The probe run after it names the module, and that
    finding, with its fixes, becomes the cause of the exception the cell raised."""
    from notebook_shell import loaded_shell

    with loaded_shell(("torch", "overflowing_llama", "model", "prompt", "out", "r")) as sh:
        sh.user_ns.update(torch=torch, overflowing_llama=overflowing_llama)
        sh.run_cell("model = overflowing_llama(torch.float16).eval()\n"
                    "prompt = {'input_ids': torch.tensor([[3, 14, 15, 9, 2, 6]])}", store_history=True)  # fmt: skip
        failed = sh.run_cell("out = model.generate(**prompt, max_new_tokens=4, do_sample=True, pad_token_id=0)",
                             store_history=True)  # fmt: skip
        assert "probability tensor contains either `inf`, `nan` or element < 0" in str(failed.error_in_exec)
        shown = capsys.readouterr().out
        assert "crash-sampling-nonfinite" in shown and "--probe prompt --generate" in shown
        sh.run_cell("r = %mpdoctor model --probe prompt --generate 4 --text", store_history=True)
        report = sh.user_ns["r"]
    assert report.exception.startswith("RuntimeError: probability tensor contains either")
    assert report.cause is report.findings[0] and report.cause.check == "probe-nonfinite"
    assert report.cause.evidence["module"] == "model.layers.1.mlp.up_proj" and report.cause.fixes
    assert not report.findings_for("crash-sampling-nonfinite")  # the note gave way: one cause, not two
