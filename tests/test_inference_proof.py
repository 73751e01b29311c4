"""An inference step is proven by its output: ``generate()`` (or any call with no backward and no optimizer step)
that raised is replayed after each fix, and "verified" means it then ran and its output is finite."""

from __future__ import annotations

import pytest
import torch
from notebook_shell import loaded_shell

from mpdoctor.diagnosis.proof import run_step

pytestmark = pytest.mark.colab

SETUP = """
import torch, transformers
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
emb = torch.randn(1, 5, 32)
"""

GENERATE = "out = model.generate(inputs_embeds=emb, max_new_tokens=4, do_sample=False, pad_token_id=0)\n"


def test_a_generate_call_that_raised_is_replayed_and_its_fix_verified_by_its_output_then_it_generates():
    with loaded_shell(("torch", "transformers", "cfg", "model", "emb", "out", "r")) as sh:
        sh.run_cell(SETUP, store_history=True)
        failed = sh.run_cell(GENERATE, store_history=True)
        assert not failed.success and "same dtype" in str(failed.error_in_exec)  # the real error first
        sh.run_cell("r = %mpdoctor --text", store_history=True)
        report = sh.user_ns["r"]
        assert report.proof.verified and not report.proof.before.ran
        assert report.proof.plan.inference and report.proof.plan.trained
        said = "it ran and its output is finite (an inference step: no backward, no optimizer step)"
        assert said in report.proof.summary() and said in " ".join(report.to_text().split())
        (fix,) = report.fixes
        assert report.proof.label(fix).startswith("verified on your step: applied alone, it ran and its output is finite")
        assert "out" not in sh.user_ns  # the replay left the namespace as it was
        fix.apply()  # what the label names, then the user's own call again
        assert sh.run_cell(GENERATE, store_history=True).success
        out = sh.user_ns["out"]
        assert out.shape == (1, 4) and out.dtype == torch.long


def test_an_inference_step_with_non_finite_output_ran_but_is_not_cured_and_a_training_step_is_judged_as_before():
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.fill_(float("inf"))
    x = torch.randn(3, 4)

    def infer():
        with torch.no_grad():
            return {"logits": model(x) * 0}  # inf * 0: NaN

    outcome = run_step(infer, [model], [])
    assert outcome.ran and outcome.inference and not outcome.trained
    assert outcome.describe() == "it ran and its output holds inf/NaN (an inference step: no backward, no optimizer step)"
    healthy = torch.nn.Linear(4, 2)
    assert run_step(lambda: healthy(x), [healthy], []).trained  # no backward, finite output
    opt = torch.optim.SGD(healthy.parameters(), lr=0.1)

    def detached_step():  # an optimizer step with no backward is a training step that did not train
        opt.zero_grad()
        loss = healthy(x).detach().pow(2).mean()
        opt.step()
        return loss

    trained = run_step(detached_step, [healthy], [opt])
    assert not trained.inference and not trained.trained and trained.why == "no gradient reached the parameters"


def test_an_inference_cell_beside_a_model_a_wrong_loop_wrecked_is_judged_by_its_own_output():
    """A model whose weights an earlier loop made NaN, with its gradients left over, is not what an inference cell
    that raised on another module did: the cell is replayed as an inference step, and its fix verified."""
    with loaded_shell(("torch", "net", "head", "x", "logits", "r")) as sh:
        sh.run_cell("import torch\ntorch.manual_seed(0)\nnet = torch.nn.Linear(8, 1)\n"
                    "net(torch.randn(4, 8)).sum().backward()\n"
                    "with torch.no_grad():\n    net.weight.fill_(float('nan'))\n"
                    "head = torch.nn.Linear(8, 2).to(torch.bfloat16)\nx = torch.randn(16, 8)\n", store_history=True)
        assert not sh.run_cell("logits = head(x)\n", store_history=True).success
        sh.run_cell("r = %mpdoctor net head x --text", store_history=True)
        proof = sh.user_ns["r"].proof
        assert proof.verified and proof.plan.inference, proof.summary()
        assert proof.summary().startswith("Plan verified on your step (cell [2])")
