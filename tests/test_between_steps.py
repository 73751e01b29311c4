"""The between-steps checks as specifications: what each reads, the harm it measures, and its fix's safety.

Real objects from tiny configs (torch modules, torchmetrics metrics, a PEFT LoRA model, a tiny DeepSeek-V3);
the field reports they come from are in ``tests/field/test_between_steps_cases.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fingerprint import assert_unchanged, fingerprint

import mpdoctor
from mpdoctor.facts.between import BetweenFacts, MetricStates, RouterBias
from mpdoctor.objects.readers.between import accumulation_error, merge_loss, stall_count
from mpdoctor.rules.checks import REGISTRY, load


class Holder(torch.nn.Module):
    """A module holding a torchmetrics metric as a submodule, as a LightningModule does."""

    def __init__(self) -> None:
        super().__init__()
        from torchmetrics.aggregation import MeanMetric

        self.net = torch.nn.Linear(4, 4)
        self.val_loss = MeanMetric()


# -- the measurements ----------------------------------------------------------------------------------------


def test_a_running_sum_stalls_after_256_equal_updates_in_bf16_and_2048_in_fp16():
    for dtype, stall in ((torch.bfloat16, 256), (torch.float16, 2048)):
        assert stall_count(dtype) == stall
        total = torch.zeros((), dtype=dtype)
        for _ in range(stall + 10):
            total += 1.0
        assert float(total) == stall  # the figure the check reports is the one torch produces
    assert stall_count(torch.float32) == 0


def test_accumulation_error_grows_with_the_micro_batches_and_is_zero_in_fp32():
    grad = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    few, many = accumulation_error(grad, 4, torch.bfloat16), accumulation_error(grad, 64, torch.bfloat16)
    assert 0 < few < many
    assert accumulation_error(grad, 64, torch.float32) == 0.0


def test_merge_loss_is_the_share_of_the_delta_the_rounding_dropped():
    base = torch.randn(32, 32).to(torch.bfloat16)
    delta = 1e-3 * torch.randn(32, 32)
    merged = (base.float() + delta).to(torch.bfloat16)
    realized = merged.float() - base.float()
    expected = ((realized - delta).norm() / delta.norm()).item()
    assert merge_loss(merged, delta) == pytest.approx(expected, rel=0.05)
    assert merge_loss((base.float() + delta).to(torch.float32), delta) < 1e-3  # an fp32 merge keeps it


# -- the checks on facts built by hand -------------------------------------------------------------------------


def test_the_checks_read_hand_built_facts():
    load()
    report = mpdoctor.diagnose(torch.nn.Linear(2, 2))
    facts = dataclasses.replace(
        report.facts,
        between=BetweenFacts(
            metrics=(MetricStates("m", "", "SumMetric", 1, (("sum_value", "float16"),), 2048),),
            router_biases=(RouterBias("moe", 2, "layers.1.gate", "Router", "e_score_correction_bias", "bfloat16", 8,
                                      7.2, 1.0),),  # fmt: skip
        ),
    )
    (metric,) = REGISTRY["metric-states-half"].func(facts)
    assert metric.severity == "warning" and metric.evidence["sum_stalls_after_updates"] == 2048
    (router,) = REGISTRY["router-bias-half"].func(facts)
    assert router.evidence["lost_update_share"] == 1.0
    assert list(REGISTRY["half-grad-accumulation"].func(facts)) == []  # no accumulation asked for


def test_fp32_states_biases_and_unaccumulated_bf16_grads_draw_nothing():
    load()
    report = mpdoctor.diagnose(torch.nn.Linear(2, 2))
    facts = dataclasses.replace(
        report.facts,
        between=BetweenFacts(metrics=(MetricStates("m", "", "SumMetric", 1, (("sum_value", "float32"),)),)),
    )
    for slug in ("metric-states-half", "router-bias-half", "half-grad-accumulation", "lora-merged-into-half-base"):
        assert list(REGISTRY[slug].func(facts)) == []


def test_model_half_leaves_metric_states_fp32_and_draws_nothing_but_model_to_bf16_casts_them():
    holder = Holder().half()  # torchmetrics refuses .half() on its states
    assert mpdoctor.diagnose(namespace={"holder": holder}).findings_for("metric-states-half") == []
    holder = Holder().to(torch.bfloat16)  # .to(dtype) reaches them
    (finding,) = mpdoctor.diagnose(namespace={"holder": holder}).findings_for("metric-states-half")
    assert finding.subject == "holder.val_loss"
    assert set(finding.evidence["half_states"]) == {"mean_value", "weight"}


def test_a_metric_held_alone_and_inside_a_model_is_one_finding():
    holder = Holder().to(torch.bfloat16)
    report = mpdoctor.diagnose(namespace={"holder": holder, "metric": holder.val_loss})
    assert len(report.findings_for("metric-states-half")) == 1


# -- the fixes: in place, exact undo, idempotent -----------------------------------------------------------------


def test_the_metric_fix_is_undone_exactly_and_applying_it_twice_changes_nothing_more():
    holder = Holder().to(torch.bfloat16)
    holder.val_loss.update(torch.tensor(3.0))
    before = fingerprint({"holder": holder})
    report = mpdoctor.diagnose(namespace={"holder": holder})
    (finding,) = report.findings_for("metric-states-half")
    fix = finding.fixes[0]
    fix.apply()
    assert holder.val_loss.mean_value.dtype == torch.float32 and float(holder.val_loss.compute()) == 3.0
    fix.undo()
    assert_unchanged(before, fingerprint({"holder": holder}), "metric fix undone")
    fix.apply()
    after_once = fingerprint({"holder": holder})
    assert report.refresh().findings_for("metric-states-half") == []
    assert_unchanged(after_once, fingerprint({"holder": holder}), "re-diagnosis after the fix")


def tiny_moe():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                              num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
                              num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                              topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                              qk_nope_head_dim=8, v_head_dim=8, use_cache=False)  # fmt: skip
    return DeepseekV3ForCausalLM(config)


def test_the_router_fix_casts_every_layers_bias_and_undo_restores_the_same_tensors():
    model = tiny_moe().to(torch.bfloat16)
    biases = [m._buffers["e_score_correction_bias"] for m in model.modules() if "e_score_correction_bias" in m._buffers]
    assert len(biases) == 2
    before = fingerprint({"model": model})
    (finding,) = mpdoctor.diagnose(namespace={"model": model}).findings_for("router-bias-half")
    assert len(finding.evidence["biases"]) == 2
    fix = finding.fixes[0]
    assert fix.safe
    fix.apply()
    now = [m._buffers["e_score_correction_bias"] for m in model.modules() if "e_score_correction_bias" in m._buffers]
    assert {b.dtype for b in now} == {torch.float32}
    fix.undo()
    after = [m._buffers["e_score_correction_bias"] for m in model.modules() if "e_score_correction_bias" in m._buffers]
    assert all(a is b for a, b in zip(after, biases))
    assert_unchanged(before, fingerprint({"model": model}), "router fix undone")


def test_the_accumulation_fix_casts_the_optimizer_state_with_the_parameters_and_undoes_exactly():
    from transformers import TrainingArguments

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    args = TrainingArguments(output_dir="unused-between-steps", gradient_accumulation_steps=8, report_to=[])
    before = fingerprint({"model": model, "opt": opt})
    report = mpdoctor.diagnose(namespace={"model": model, "opt": opt, "args": args})
    (finding,) = report.findings_for("half-grad-accumulation")
    assert finding.evidence["measured_on"] == "the model's own gradients"
    assert finding.evidence["setting"] == "args: TrainingArguments.gradient_accumulation_steps"
    fix = finding.fixes[0]
    assert not fix.safe
    fix.apply()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {s["exp_avg"].dtype for s in opt.state.values()} == {torch.float32}
    fix.undo()
    assert_unchanged(before, fingerprint({"model": model, "opt": opt}), "accumulation fix undone")


def test_without_accumulation_bf16_grads_draw_no_accumulation_finding():
    from transformers import TrainingArguments

    model = torch.nn.Linear(8, 8).to(torch.bfloat16)
    args = TrainingArguments(output_dir="unused-between-steps", gradient_accumulation_steps=1, report_to=[])
    assert mpdoctor.diagnose(namespace={"model": model, "args": args}).findings_for("half-grad-accumulation") == []


def test_diagnosing_changes_nothing_it_reads():
    holder = Holder().to(torch.bfloat16)
    model = tiny_moe().to(torch.bfloat16)
    before = fingerprint({"holder": holder, "model": model})
    mpdoctor.diagnose(namespace={"holder": holder, "model": model})
    assert_unchanged(before, fingerprint({"holder": holder, "model": model}), "diagnose")


def test_an_orthogonal_weight_in_bf16_is_measured_off_orthogonal_or_refused_and_fp32_draws_nothing():
    from torch.nn.utils.parametrizations import orthogonal

    square = torch.nn.Sequential(orthogonal(torch.nn.Linear(8, 8))).to(torch.bfloat16)  # matrix_exp: runs
    (finding,) = mpdoctor.diagnose(namespace={"model": square}).findings_for("orthogonal-parametrization-half")
    assert finding.severity == "warning" and finding.evidence["orthogonality_error"] > 1e-4
    wide = torch.nn.Sequential(orthogonal(torch.nn.Linear(16, 4))).to(torch.bfloat16)  # householder: refused
    (finding,) = mpdoctor.diagnose(namespace={"model": wide}).findings_for("orthogonal-parametrization-half")
    assert finding.severity == "error" and "not implemented for 'BFloat16'" in finding.evidence["refused"]
    healthy = torch.nn.Sequential(orthogonal(torch.nn.Linear(8, 8)))
    assert mpdoctor.diagnose(namespace={"model": healthy}).findings_for("orthogonal-parametrization-half") == []
