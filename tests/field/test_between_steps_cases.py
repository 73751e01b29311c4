"""Field cases of the places between steps: metric states, merges, router biases, accumulation, linalg and FFT.

Each case rebuilds a public report on this CPU from tiny configs. In order: the real error or the measured
harm (as a figure), mpdoctor naming it with its slug, the fix applied in place through the API and through
the widget's button (or, where nothing can be done in place, the advised code run), then the user's own
failing step run again and training. Each has a healthy twin, the same setup done right, that draws no error
and no warning.
"""

from __future__ import annotations

import math

import pytest
import torch
from between_steps_raisers import fft_rfft_bf16_features, linalg_qr_bf16_grads, linalg_svd_bf16_delta
from steps import assert_step_trains, snapshot
from test_exception_families import raised

import mpdoctor
from mpdoctor.attach.crash import explain

# -- shared setups ---------------------------------------------------------------------------------------------


def loud(report) -> list[str]:
    """The slugs of the report's errors and warnings."""
    return [f.check for f in report.findings if f.severity in ("error", "warning")]


def widget(**namespace):
    rw = mpdoctor.diagnose(namespace=namespace).widget()
    rw.confirm_delay = 0.0
    return rw


def click(rw, label: str, confirm: bool = False) -> None:
    """Click the one fix button whose label holds ``label`` (twice for an unsafe fix, which asks to confirm)."""
    (button,) = rw.buttons(label)
    button.click()
    if confirm:
        (button,) = rw.buttons("Click again to confirm")
        button.click()


class Regressor(torch.nn.Module):
    """A user's module that logs its running loss with a torchmetrics metric held as a submodule."""

    def __init__(self, metric: torch.nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(8, 1)
        self.running_loss = metric


def metric_step(module: Regressor, opt: torch.optim.Optimizer, value: float):
    """The user's step: a training step that also feeds the epoch metric."""
    x = torch.randn(4, 8, dtype=module.net.weight.dtype)
    loss = module.net(x).float().pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    module.running_loss.update(torch.tensor(value))
    return loss


def epoch_figure(module: Regressor) -> float:
    """The epoch's metric: 300 steps logging 1.0, then 700 logging 3.0 (mean 2.4, sum 2400)."""
    module.running_loss.reset()
    for i in range(1000):
        module.running_loss.update(torch.tensor(1.0 if i < 300 else 3.0))
    return float(module.running_loss.compute())


# -- metric states cast to half ----------------------------------------------------------------------------------


def test_lightning_18620_epoch_mean_in_bf16_is_wrong_then_set_dtype_fixes_it_and_the_step_trains():
    """Lightning-AI/pytorch-lightning#18620: "on_epoch=True reduction of low precision types (bf16, etc) results
    in very inaccurate metrics". Rebuilt with the torchmetrics ``MeanMetric`` a module holds, cast with the
    module by ``module.to(torch.bfloat16)``.

    https://github.com/Lightning-AI/pytorch-lightning/issues/18620
    """
    from torchmetrics.aggregation import MeanMetric

    module = Regressor(MeanMetric()).to(torch.bfloat16)
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    wrong = epoch_figure(module)
    assert abs(wrong - 2.4) > 0.3  # measured harm: the epoch mean of 2.4 comes out as 4.0 in bf16

    report = mpdoctor.diagnose(namespace={"module": module, "opt": opt})
    (finding,) = report.findings_for("metric-states-half")
    assert finding.subject == "module.running_loss" and finding.evidence["sum_stalls_after_updates"] == 256
    finding.fixes[0].apply()
    assert module.running_loss.mean_value.dtype == torch.float32
    assert report.refresh().findings_for("metric-states-half") == []

    before = snapshot(module.parameters())
    assert abs(epoch_figure(module) - 2.4) < 1e-3  # the user's epoch, again: the right figure
    assert_step_trains(metric_step(module, opt, 1.0), before, module.parameters())


def test_lightning_18620_through_the_widget_button():
    from torchmetrics.aggregation import MeanMetric

    module = Regressor(MeanMetric()).to(torch.bfloat16)
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    rw = widget(module=module, opt=opt)
    click(rw, "Move module.running_loss")
    assert module.running_loss.mean_value.dtype == torch.float32
    before = snapshot(module.parameters())
    assert abs(epoch_figure(module) - 2.4) < 1e-3
    assert_step_trains(metric_step(module, opt, 1.0), before, module.parameters())


def test_xla_2425_a_bf16_running_loss_sum_stops_growing_then_is_fixed_in_place():
    """pytorch/xla#2425: "the numerator stops growing due to lack of precision but denom. keeps growing" (losses
    accumulated in bf16). Rebuilt with a torchmetrics ``SumMetric`` moved to bf16 with ``set_dtype``.

    https://github.com/pytorch/xla/pull/2425
    """
    from torchmetrics.aggregation import SumMetric

    module = Regressor(SumMetric())
    module.running_loss.set_dtype(torch.bfloat16)
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    assert epoch_figure(module) < 1200  # measured harm: the sum of 2400 stalls at 1024

    rw = widget(module=module, opt=opt)
    assert [f.check for f in rw.report.findings] == ["metric-states-half"]
    click(rw, "Move module.running_loss")
    before = snapshot(module.parameters())
    assert epoch_figure(module) == 2400.0
    assert_step_trains(metric_step(module, opt, 1.0), before, module.parameters())


def test_healthy_twin_metric_states_kept_fp32_after_the_cast_draw_nothing():
    from torchmetrics.aggregation import MeanMetric

    module = Regressor(MeanMetric()).to(torch.bfloat16)
    module.running_loss.set_dtype(torch.float32)  # torchmetrics' own recipe after a cast
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    assert abs(epoch_figure(module) - 2.4) < 1e-3
    report = mpdoctor.diagnose(namespace={"module": module, "opt": opt})
    assert loud(report) == [] and report.findings_for("metric-states-half") == []


# -- LoRA merged into a half-precision base ----------------------------------------------------------------------


def lora_model(dtype: torch.dtype, seed: int = 0):
    """A tiny Llama with a trained-looking LoRA adapter (fp32, PEFT's default) on ``q_proj`` / ``v_proj``."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, use_cache=False)  # fmt: skip
    base = LlamaForCausalLM(config)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    model = get_peft_model(base.to(dtype), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.05)  # a fine-tuned adapter: small next to the base
    return model, state


def lora_layers(model):
    """``(name, layer)`` of each LoRA layer of a PEFT model."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]


def delta_lost(model, base_dtype, bases=None):
    """The share of the adapters' delta a merge did not realize in the base weights, in float64: ``|realized -
    delta| / |delta|`` over every LoRA layer, where ``delta = B @ A * scaling`` and ``realized = merged - base``.
    ``bases``: each layer's base weight before the merge, by name; by default the unmerged base that
    ``lora_model(base_dtype)`` builds (the same seed, so the same weights)."""
    if bases is None:
        rebuilt, _ = lora_model(base_dtype)
        bases = {n: m.base_layer.weight.detach().double().clone() for n, m in lora_layers(rebuilt)}
    num = den = 0.0
    for name, layer in lora_layers(model):
        a, b = layer.lora_A["default"].weight.detach().double(), layer.lora_B["default"].weight.detach().double()
        delta = (b @ a) * layer.scaling["default"]
        realized = layer.base_layer.weight.detach().double() - bases[name]
        num += float((realized - delta).norm() ** 2)
        den += float(delta.norm() ** 2)
    return math.sqrt(num / den)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_peft_1388_merging_into_a_bf16_base_loses_part_of_the_delta_then_the_fp32_merge_matches():
    """huggingface/peft#1388: "merge_and_unload() raises the loss of accuracy" (bf16 Llama, LoRA r=8 on q/k/v:
    loss 2.1178 with the adapter, 2.1214 merged). Rebuilt with ``merge_adapter()`` on a bf16 tiny Llama.

    https://github.com/huggingface/peft/issues/1388
    """
    from transformers import LlamaForCausalLM

    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    model, state = lora_model(torch.bfloat16)
    adapter_out = logits(model, ids)
    model.merge_adapter()
    merged_err = (logits(model, ids) - adapter_out).abs().max().item()

    report = mpdoctor.diagnose(namespace={"model": model})
    (finding,) = report.findings_for("lora-merged-into-half-base")
    assert finding.severity == "warning" and finding.evidence["mean_delta_lost"] > 0.05  # measured: ~16% lost
    (fix,) = [f for f in finding.fixes if f.recipe == "merge-in-fp32"]  # a merged checkpoint to export
    assert fix.applicability.value == "display-only" and "dtype=torch.float32" in fix.code

    # The harm, measured against float64 (no low-precision kernel in the reference): the share of each adapter's
    # delta the bf16 merge did not realize in the weights. Kernel rounding moves it by far less than the margin.
    lost_bf16 = delta_lost(model, base_dtype=torch.bfloat16)
    assert lost_bf16 > 0.05 and merged_err > 0

    # The advice, run: the same adapter merged into the fp32 base. The fp32 merge realizes the delta (lost share
    # ~1e-7, three orders of magnitude under the bf16 merge's), and its logits are the adapter's.
    fp32_model, _ = lora_model(torch.float32)
    fp32_model.base_model.model.load_state_dict(state, strict=False)
    reference = logits(fp32_model, ids)
    fp32_base = {n: m.base_layer.weight.detach().double().clone() for n, m in lora_layers(fp32_model)}
    fp32_model.merge_adapter()
    assert delta_lost(fp32_model, base_dtype=torch.float32, bases=fp32_base) < lost_bf16 / 1000
    assert (logits(fp32_model, ids) - reference).abs().max().item() < 1e-3 * reference.abs().max().item()
    fp32_model.unmerge_adapter()
    # ... then cast once, as the fix's code says: the model the user keeps draws no finding.
    merged = fp32_model.merge_and_unload().to(torch.bfloat16)
    assert isinstance(merged, LlamaForCausalLM)
    assert mpdoctor.diagnose(namespace={"merged": merged}).findings_for("lora-merged-into-half-base") == []

    # The user's next step on the merged model (a further fine-tune) trains.
    merged.requires_grad_(True)  # PEFT froze the base; the merged weights are the model now
    opt = torch.optim.AdamW(merged.parameters(), lr=1e-3)
    before = snapshot(merged.parameters())
    loss = merged(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    assert_step_trains(loss, before, merged.parameters())


def adapter_step(model, ids):
    """The user's step on the PEFT model: forward, backward, AdamW over the trainable (adapter) parameters."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    params = [p for p in model.parameters() if p.requires_grad]
    before = snapshot(params)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    return loss, before, params


def effective_delta_lost(model, bases) -> float:
    """The share of the adapters' delta the model's weights do not realize, in float64, as ``delta_lost`` measures
    it: a merged layer realizes ``merged - base``; an unmerged one ``base_now + B @ A * scaling`` (its adapter adds
    the delta in fp32 at every forward), so only the base's own rounding counts."""
    num = den = 0.0
    for name, layer in lora_layers(model):
        a, b = layer.lora_A["default"].weight.detach().double(), layer.lora_B["default"].weight.detach().double()
        delta = (b @ a) * layer.scaling["default"]
        weight = layer.base_layer.weight.detach().double()
        realized = (weight if layer.merged_adapters else weight + delta) - bases[name]
        num += float((realized - delta).norm() ** 2)
        den += float(delta.norm() ** 2)
    return math.sqrt(num / den)


def test_unsloth_3091_fp16_merged_weights_do_not_match_base_plus_lora():
    """unslothai/unsloth#3091: "Merged model with bfloat16 is not matching the adapter + lora weight" (the merged
    weights reloaded in fp16 differ from base + B @ A). Rebuilt with an fp16 base and ``merge_adapter()``: the PEFT
    model still holds the merge, so the fix unmerges it in place and the adapter adds its delta exactly again.

    https://github.com/unslothai/unsloth/issues/3091
    """
    model, _ = lora_model(torch.float16)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    delta = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight).detach() * layer.scaling["default"]
    base = layer.base_layer.weight.detach().float().clone()
    bases = {n: m.base_layer.weight.detach().double().clone() for n, m in lora_layers(model)}
    model.merge_adapter()
    realized = layer.base_layer.weight.detach().float() - base
    lost = ((realized - delta).norm() / delta.norm()).item()
    assert lost > 0.01  # measured harm: the merge kept only part of the delta
    merged_lost = effective_delta_lost(model, bases)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    # The user's step on the merged model: the merged layers bypass the adapter, so nothing trainable is reached.
    with pytest.raises(RuntimeError, match="does not require grad and does not have a grad_fn"):
        adapter_step(model, ids)

    report = mpdoctor.diagnose(namespace={"model": model})
    (finding,) = report.findings_for("lora-merged-into-half-base")
    assert finding.evidence["base_dtype"] == "float16"
    assert abs(finding.evidence["worst_delta_lost"] - lost) < 0.05 or finding.evidence["worst_delta_lost"] >= lost
    fix = next(f for f in report.fixes if f.slug == "lora-merged-into-half-base")
    assert fix.recipe == "unmerge-adapter" and fix.safe and not fix.in_place
    older = next(f for f in mpdoctor.diagnose(namespace={"model": model}).fixes if f.slug == fix.slug)
    merged_bytes = [m.base_layer.weight.detach().clone() for _, m in lora_layers(model)]
    fix.apply()
    assert fix.applied and not any(m.merged_adapters for _, m in lora_layers(model))
    assert older.in_place  # a report taken before now reads the change as made
    assert report.refresh().findings_for("lora-merged-into-half-base") == []
    # The adapter adds the exact fp32 delta again: what is lost now is only the base's bits the merge rounded away
    # (the base is recovered as the nearest fp16 to merged - delta), a fraction of what the merge lost.
    assert effective_delta_lost(model, bases) < merged_lost / 4
    loss, before, params = adapter_step(model, ids)  # the user's same step trains
    assert_step_trains(loss, before, params)

    fix.undo()  # merged again, the merged weights bit for bit
    assert all(m.merged_adapters == ["default"] for _, m in lora_layers(model))
    assert all(torch.equal(m.base_layer.weight, w) for (_, m), w in zip(lora_layers(model), merged_bytes))


def test_unsloth_3091_through_the_widget_button():
    model, _ = lora_model(torch.float16)
    model.merge_adapter()
    rw = widget(model=model)
    click(rw, "Unmerge model's adapter")
    assert "failed" not in rw.status and not any(m.merged_adapters for _, m in lora_layers(model))
    loss, before, params = adapter_step(model, torch.randint(0, 64, (2, 8)))
    assert_step_trains(loss, before, params)


def test_healthy_twin_adapter_unmerged_or_merged_in_fp32_draws_nothing():
    model, _ = lora_model(torch.bfloat16)  # PEFT's default: fp32 adapter under a bf16 base, unmerged
    assert loud(mpdoctor.diagnose(namespace={"model": model})) == []
    fp32_model, _ = lora_model(torch.float32)
    fp32_model.merge_adapter()
    assert loud(mpdoctor.diagnose(namespace={"model": fp32_model})) == []


# -- router correction bias cast to bf16 ----------------------------------------------------------------------


def deepseek(bias_center: float, seed: int = 0):
    """A tiny DeepSeek-V3 whose routers hold a learned-looking correction bias around ``bias_center``."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                              num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
                              num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=4, n_group=1,
                              topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                              qk_nope_head_dim=8, v_head_dim=8, use_cache=False)  # fmt: skip
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for module in model.modules():
            if "e_score_correction_bias" in module._buffers:
                module.weight.normal_(0, 0.02)  # scores close together: the bias decides the experts
                module.e_score_correction_bias.copy_(bias_center + 0.25 * torch.rand(16))
    return model


def routers(model):
    return [m for m in model.modules() if "e_score_correction_bias" in m._buffers]


def balance_update(model, gamma: float = 1e-3) -> int:
    """DeepSeek-V3's auxiliary-loss-free balancing: nudge every bias by gamma; how many entries moved."""
    moved = 0
    with torch.no_grad():
        for r in routers(model):
            before = r.e_score_correction_bias.clone()
            r.e_score_correction_bias.add_(gamma)
            moved += int((r.e_score_correction_bias != before).sum())
    return moved


def train_step(model, ids):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    before = snapshot(model.parameters())
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    assert_step_trains(loss, before, model.parameters())
    return loss


def test_megatron_1482_expert_bias_in_bf16_loses_every_balancing_update_then_fp32_keeps_them():
    """NVIDIA/Megatron-LM#1482: "TopKRouter expert_bias get wrong dtype when updated" ("Expert bias should always
    use the float32 format, especially it might be updated at a very small rate"). Rebuilt with a tiny
    DeepSeek-V3 cast by ``model.to(torch.bfloat16)`` and its 0.001 bias update.

    https://github.com/NVIDIA/Megatron-LM/issues/1482
    """
    model = deepseek(1.0).to(torch.bfloat16)
    assert balance_update(model) == 0  # measured harm: every 0.001 update rounds away

    report = mpdoctor.diagnose(namespace={"model": model})
    (finding,) = report.findings_for("router-bias-half")
    assert finding.evidence["lost_update_share"] == 1.0
    finding.fixes[0].apply()
    assert all(r.e_score_correction_bias.dtype == torch.float32 for r in routers(model))
    assert report.refresh().findings_for("router-bias-half") == []

    assert balance_update(model) == 16  # the user's step, again: the update takes
    train_step(model, torch.randint(0, 64, (2, 8)))


def test_megatron_1482_through_the_widget_button():
    model = deepseek(1.0).to(torch.bfloat16)
    rw = widget(model=model)
    click(rw, "Keep model's router")
    assert balance_update(model) == 16
    train_step(model, torch.randint(0, 64, (2, 8)))


def test_sglang_37133_bf16_bias_collapses_and_reroutes_tokens_reload_keeps_it_fp32():
    """sgl-project/sglang#37133: GLM-5.2's correction bias (6.817 to 7.063) cast to bf16 collapses 238 distinct
    values into 8 and "98.5% of tokens select a different top-8 set". Rebuilt with biases in [7, 7.25] on a tiny
    DeepSeek-V3 and a real batch routed both ways.

    https://github.com/sgl-project/sglang/pull/37133
    """
    model = deepseek(7.0)
    router = routers(model)[0]
    hidden = torch.randn(256, 32, generator=torch.Generator().manual_seed(2))
    fp32_experts = router(hidden)[2].sort(dim=-1).values
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.to(torch.bfloat16)
    bf16_experts = router(hidden.to(torch.bfloat16))[2].sort(dim=-1).values
    rerouted = (fp32_experts != bf16_experts).any(dim=-1).float().mean().item()
    assert rerouted > 0.2  # measured harm: a share of the tokens goes to another top-4

    report = mpdoctor.diagnose(namespace={"model": model})
    (finding,) = report.findings_for("router-bias-half")
    assert finding.evidence["max_abs"] > 7
    finding.fixes[0].apply()  # keeps later updates and routing in fp32; the rounded values need the checkpoint
    model.load_state_dict({k: v for k, v in state.items() if k.endswith("e_score_correction_bias")}, strict=False)
    assert router.e_score_correction_bias.dtype == torch.float32
    again = router(hidden.to(torch.bfloat16))[2].sort(dim=-1).values
    rerouted_after = (fp32_experts != again).any(dim=-1).float().mean().item()
    assert rerouted_after < rerouted / 4  # only the bf16 router weight's own rounding is left
    train_step(model, torch.randint(0, 64, (2, 8)))


def test_healthy_twin_from_pretrained_in_bf16_keeps_the_bias_fp32_and_draws_nothing(tmp_path):
    from transformers import DeepseekV3ForCausalLM

    deepseek(7.0).save_pretrained(tmp_path)
    model = DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert {r.e_score_correction_bias.dtype for r in routers(model)} == {torch.float32}
    report = mpdoctor.diagnose(namespace={"model": model})
    assert loud(report) == [] and report.findings_for("router-bias-half") == []


# -- gradients accumulated in bf16 ----------------------------------------------------------------------------


def accumulate(model, accelerator, opt, micro_batches: list) -> torch.Tensor:
    """The user's accumulation loop (accelerate's recipe); returns the last micro-batch's loss."""
    loss = None
    for x, y in micro_batches:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x.to(model.weight.dtype)).float(), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
    return loss


def test_deepspeed_1800_bf16_grads_accumulated_over_micro_batches_drift_then_fp32_grads_fix_it():
    """deepspeedai/DeepSpeed#1800: "ZeRO/bf16 grad accumulation in bf16 needs fixing" ("using GAS ... the
    accumulated error could be quite significant"); #2768: "training occasionally diverges ... accumulation is
    also done in BF16". Rebuilt with a bf16 model under ``Accelerator(gradient_accumulation_steps=32)``.

    https://github.com/deepspeedai/DeepSpeed/issues/1800 -- https://github.com/deepspeedai/DeepSpeed/issues/2768
    """
    from accelerate import Accelerator

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    micro = [(torch.randn(16, 64, generator=gen), torch.randn(16, 64, generator=gen)) for _ in range(32)]
    model = torch.nn.Linear(64, 64).to(torch.bfloat16)
    grads16 = torch.zeros(64, 64, dtype=torch.bfloat16)
    grads32 = torch.zeros(64, 64, dtype=torch.float64)
    for x, y in micro:  # measured harm: the same micro-batch grads summed in bf16 vs in fp64
        model.zero_grad()
        (torch.nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y) / 32).backward()
        grads16 += model.weight.grad
        grads32 += model.weight.grad.double()
    harm = ((grads16.double() - grads32).norm() / grads32.norm()).item()
    assert harm > 1e-3

    accelerator = Accelerator(gradient_accumulation_steps=32, cpu=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    report = mpdoctor.diagnose(namespace={"model": model, "opt": opt, "accelerator": accelerator})
    (finding,) = report.findings_for("half-grad-accumulation")
    assert finding.evidence["accumulation_steps"] == 32 and finding.evidence["relative_error"] > 1e-3
    finding.fixes[0].apply()
    assert model.weight.dtype == torch.float32 and report.refresh().findings_for("half-grad-accumulation") == []

    before = snapshot(model.parameters())
    assert_step_trains(accumulate(model, accelerator, opt, micro), before, model.parameters())


def test_deepspeed_1800_through_the_widget_button():
    from accelerate import Accelerator

    model = torch.nn.Linear(64, 64).to(torch.bfloat16)
    accelerator = Accelerator(gradient_accumulation_steps=8, cpu=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    rw = widget(model=model, opt=opt, accelerator=accelerator)
    click(rw, "Keep model's trainable", confirm=True)
    assert model.weight.dtype == torch.float32
    micro = [(torch.randn(16, 64), torch.randn(16, 64)) for _ in range(8)]
    before = snapshot(model.parameters())
    assert_step_trains(accumulate(model, accelerator, opt, micro), before, model.parameters())


def test_healthy_twin_fp32_weights_under_bf16_autocast_with_accumulation_draw_nothing():
    from accelerate import Accelerator

    model = torch.nn.Linear(64, 64)
    accelerator = Accelerator(gradient_accumulation_steps=32, mixed_precision="bf16", cpu=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    report = mpdoctor.diagnose(namespace={"model": model, "opt": opt, "accelerator": accelerator})
    assert loud(report) == [] and report.findings_for("half-grad-accumulation") == []


# -- linear algebra and FFT in half precision --------------------------------------------------------------------


def orthogonalized_step(weight: torch.nn.Parameter, upcast: bool) -> torch.Tensor:
    """An orthogonalizing optimizer step (SOAP / Shampoo style): the update is Q of the gradient's QR."""
    loss = (weight.float() ** 2).sum()
    loss.backward()
    grad = weight.grad.float() if upcast else weight.grad
    q, _ = torch.linalg.qr(grad)
    with torch.no_grad():
        weight -= 0.01 * q.to(weight.dtype)
    weight.grad = None
    return loss


class OrthogonalSOAP(torch.optim.Optimizer):
    """A SOAP / Shampoo-style optimizer as HeavyBall's ForeachSOAP runs it: momentum in the parameters' dtype, the
    update of each matrix the Q of its momentum's QR (library code: the QR runs inside ``step``, no module's
    forward)."""

    def __init__(self, params, lr: float = 0.01, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # torch's optimizer contract: the closure recomputes the loss
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                momentum = state.setdefault("momentum", torch.zeros_like(p))
                momentum.mul_(group["beta"]).add_(p.grad)
                if p.ndim < 2:
                    p.add_(momentum, alpha=-group["lr"])
                    continue
                q, _ = torch.linalg.qr(momentum)  # no bf16 kernel
                p.add_(q, alpha=-group["lr"])
        return loss


def soap_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    """The user's step, the optimizer's own step the one that raises."""
    opt.zero_grad()
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    return loss


def heavyball_at_the_crash(dtype: torch.dtype = torch.bfloat16):
    """A bf16 model, its SOAP optimizer, a batch, and the error the optimizer's step raises."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).to(dtype)
    opt = OrthogonalSOAP(model.parameters())
    x = torch.randn(4, 8, dtype=dtype)
    exc = raised(lambda: soap_step(model, opt, x))
    assert str(exc) == "\"geqrf_cpu\" not implemented for 'BFloat16'"  # the real error
    return model, opt, x, exc


def _soap_island(report):
    (fix,) = [fx for fx in report.fixes if fx.recipe == "fp32-ops-island"]  # the plan's, led by the cause
    return fix


def test_heavyball_57_qr_of_bf16_grads_is_refused_then_the_fp32_island_trains():
    """HomebrewML/HeavyBall#57: "torch.linalg.qr does not support bfloat16" (ForeachSOAP with bf16 and AMP:
    ``"geqrf_cuda" not implemented for 'BFloat16'``). The QR runs inside the optimizer's own ``step``: the cause's
    fix wraps ``opt.step`` on the instance so its linalg ops run on fp32 copies, their results cast back to bf16,
    in place; the same step trains; undo gives the error back and every object exactly as it was.

    https://github.com/HomebrewML/HeavyBall/issues/57
    """
    from fingerprint import assert_unchanged, fingerprint

    from mpdoctor.attach.runtime.assembly import assemble
    from mpdoctor.attach.runtime.twins import try_on_twins

    assert explain(raised(linalg_qr_bf16_grads)).cause.check == "crash-linalg-half"
    model, opt, x, exc = heavyball_at_the_crash()
    report = explain(exc, namespace={"model": model, "opt": opt, "x": x})
    assert report.cause.check == "crash-linalg-half"
    fix = _soap_island(report)
    assert "opt.step (OrthogonalSOAP.step)" in fix.title and not fix.safe and fix is report.cause.fixes[0]
    fix.apply()
    assert fix.applied, fix.error
    assert model.weight.dtype == torch.bfloat16 and opt.state[model.weight]["momentum"].dtype == torch.bfloat16
    twin = try_on_twins("for _ in range(3):\n    soap_step(model, opt, x)\n",
                        {"model": model, "opt": opt, "x": x, "soap_step": soap_step})  # the island follows a copy
    assert twin.trains and twin.steps == 3, twin.sentence()
    params = list(model.parameters())
    before = snapshot(params)
    assert_step_trains(soap_step(model, opt, x), before, params)
    assert model.weight.dtype == torch.bfloat16  # the update was cast back: the model stays bf16

    again = explain(exc, namespace={"model": model, "opt": opt, "x": x})  # the crash seen again, the island held
    assert _soap_island(again).in_place and _soap_island(assemble(again).cause).in_place
    assert all(fx.recipe != "fp32-ops-island" for fx in assemble(again).fixes)  # not offered again
    fix.undo()
    assert "step" not in vars(opt) and "geqrf_cpu" in str(raised(lambda: soap_step(model, opt, x)))

    model, opt, x, exc = heavyball_at_the_crash()  # exact undo, on objects the step has not moved
    fix = _soap_island(explain(exc, namespace={"model": model, "opt": opt}))
    held = fingerprint({"model": model, "opt": opt})
    fix.apply()
    fix.undo()
    assert_unchanged(held, fingerprint({"model": model, "opt": opt}), "fp32-ops island apply then undo")


def test_heavyball_57_through_the_widget_button():
    model, opt, x, exc = heavyball_at_the_crash()
    rw = explain(exc, namespace={"model": model, "opt": opt, "x": x}).widget()
    rw.confirm_delay = 0.0
    click(rw, "Run the linalg and FFT ops inside opt.step", confirm=True)
    assert "failed" not in rw.status, rw.status
    params = list(model.parameters())
    before = snapshot(params)
    assert_step_trains(soap_step(model, opt, x), before, params)


def test_heavyball_57_the_crash_cell_replayed_verifies_the_island():
    """In a notebook: the step cell raises in ``opt.step``; ``%mpdoctor`` replays that cell after the fix (the proof),
    labels it verified, and the user's cell then trains."""
    from notebook_shell import loaded_shell

    setup = ("import torch\nfrom test_between_steps_cases import OrthogonalSOAP\ntorch.manual_seed(0)\n"
             "model = torch.nn.Linear(8, 8).to(torch.bfloat16)\nopt = OrthogonalSOAP(model.parameters())\n"
             "x = torch.randn(4, 8, dtype=torch.bfloat16)\n")  # fmt: skip
    cell = "opt.zero_grad()\nloss = model(x).float().pow(2).mean()\nloss.backward()\nopt.step()\n"
    with loaded_shell(("torch", "OrthogonalSOAP", "model", "opt", "x", "loss", "r")) as sh:
        sh.run_cell(setup, store_history=True)
        assert "geqrf_cpu" in str(sh.run_cell(cell, store_history=True).error_in_exec)
        sh.run_cell("r = %mpdoctor --text", store_history=True)
        report = sh.user_ns["r"]
        fix = _soap_island(report)
        assert report.proof.label(fix).startswith("verified on your step: applied alone, it ran and trained")
        fix.apply()
        params = list(sh.user_ns["model"].parameters())
        before = snapshot(params)
        assert sh.run_cell(cell, store_history=True).error_in_exec is None
        assert_step_trains(sh.user_ns["loss"], before, params)


PEFT_SETUP = ("import torch\ntorch.manual_seed(0)\nbase = torch.randn(16, 8, dtype=torch.bfloat16)\n"
              "tuned = base + 0.01 * torch.randn(16, 8, dtype=torch.bfloat16)\n")  # fmt: skip
PEFT_CELL = ("u, s, vh = torch.linalg.svd(tuned - base, full_matrices=False)\n"
             "lora_b = torch.nn.Parameter(u[:, :4] * s[:4])\nlora_a = torch.nn.Parameter(vh[:4])\n")  # fmt: skip


def test_peft_1052_svd_of_a_bf16_delta_is_refused_then_runs_in_fp32():
    """huggingface/peft#1052 and arcee-ai/mergekit#304: ``"svd_cuda_gesvdj" not implemented for 'BFloat16'``
    (a LoRA extracted from a bf16 weight delta by SVD). Rebuilt with mergekit's low-rank decomposition of a bf16
    fine-tune's delta written in a notebook cell, then the extracted LoRA trained a step. The fix is the cell
    corrected (the SVD on an fp32 copy, its factors cast back to bf16), run on copies before it is shown, then for
    real.

    https://github.com/huggingface/peft/issues/1052 -- https://github.com/arcee-ai/mergekit/issues/304
    """
    from notebook_shell import loaded_shell

    from mpdoctor.attach.runtime.twins import try_on_twins

    assert explain(raised(linalg_svd_bf16_delta)).cause.check == "crash-linalg-half"
    with loaded_shell(("torch", "base", "tuned", "u", "s", "vh", "lora_a", "lora_b", "r")) as sh:
        sh.run_cell(PEFT_SETUP, store_history=True)
        exc = sh.run_cell(PEFT_CELL, store_history=True).error_in_exec
        assert str(exc) == "\"linalg_svd_cpu\" not implemented for 'BFloat16'"  # the real error
        cause = explain(exc, namespace=sh.user_ns).cause
        assert cause.check == "crash-linalg-half"
        (fix,) = [fx for fx in cause.fixes if fx.recipe == "corrected-cell"]
        assert "torch.linalg.svd((tuned - base).float(), full_matrices=False)" in fix.code
        assert "lora_a = torch.nn.Parameter(vh[:4])" in fix.code  # the rest of the cell as the user wrote it
        sh.run_cell("r = %mpdoctor --text", store_history=True)
        report = sh.user_ns["r"]
        (trial,) = [t for fx, t in report.trials if fx.recipe == "corrected-cell"]  # run on twins before it is shown
        assert trial.ran, trial.sentence()
        assert "ran on copies of your objects" in report.to_text()
        assert "lora_a" not in sh.user_ns  # the copies ran it, not the user's namespace
        assert try_on_twins(fix.code, sh.user_ns).ran
        assert sh.run_cell(fix.code, store_history=True).error_in_exec is None  # then for real
        ns = sh.user_ns
        lora_a, lora_b, base, tuned = ns["lora_a"], ns["lora_b"], ns["base"], ns["tuned"]
        assert lora_a.dtype == lora_b.dtype == torch.bfloat16
        recon = (lora_b.float() @ lora_a.float() - (tuned - base).float()).norm() / (tuned - base).float().norm()
        assert recon < 0.9  # the rank-4 factors carry the delta
        opt = torch.optim.SGD([lora_a, lora_b], lr=0.1)
        before = snapshot([lora_a, lora_b])
        loss = ((base + lora_b @ lora_a - tuned).float() ** 2).sum()
        loss.backward()
        opt.step()
        assert_step_trains(loss, before, [lora_a, lora_b])


class FourierMixer(torch.nn.Module):
    """An FNet / FourierFT-style token mixer: the real part of an FFT over the sequence, then a Linear."""

    def __init__(self, upcast: bool) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.upcast = upcast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.upcast:  # the advice: the transform in fp32, the real result cast back
            mixed = torch.fft.fft(x.float(), dim=1).real.to(x.dtype)
        else:
            mixed = torch.fft.fft(x, dim=1).real
        return self.proj(mixed)


def test_pytorch_117844_fft_in_a_bf16_model_is_refused_then_the_fp32_island_trains():
    """pytorch/pytorch#117844 "torch.fft.rfft: Unsupported dtype BFloat16" and Chaos96/fourierft#17
    ("Unsupported dtype BFloat16" from ``torch.fft.ifft2`` in bf16 instruction tuning).

    https://github.com/pytorch/pytorch/issues/117844 -- https://github.com/Chaos96/fourierft/issues/17
    """
    x = torch.randn(2, 12, 16, dtype=torch.bfloat16)
    model = FourierMixer(upcast=False).to(torch.bfloat16)
    exc = raised(lambda: model(x))
    assert str(exc) == "Unsupported dtype BFloat16"
    cause = explain(exc).cause
    assert cause.check == "crash-fft-half" and "x.float()" in cause.fixes[0].code
    assert explain(raised(fft_rfft_bf16_features)).cause.check == "crash-fft-half"

    model.upcast = True
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model.parameters())
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    assert_step_trains(loss, before, model.parameters())


GPTQ_SETUP = ("import torch\ntorch.manual_seed(0)\nlayer = torch.nn.Linear(8, 8).to(torch.bfloat16)\n"
              "inputs = torch.randn(64, 8, dtype=torch.bfloat16)\n"
              "hessian = inputs.T @ inputs + 0.01 * torch.eye(8, dtype=torch.bfloat16)\n")  # fmt: skip
GPTQ_CELL = ("factor = torch.linalg.cholesky(hessian)\nhinv = torch.cholesky_inverse(factor)\n"
             "hinv = torch.linalg.cholesky(hinv, upper=True)\n")  # fmt: skip


def test_gptqmodel_1777_cholesky_of_a_bf16_hessian_is_refused_then_runs_in_fp32():
    """ModelCloud/GPTQModel#1777: ``cholesky_cusolver" not implemented for 'BFloat16'`` (a GPTQ Hessian in bf16).
    Rebuilt with GPTQ's damped Hessian of a layer's bf16 inputs, its Cholesky factor, inverse and upper factor
    written in a notebook cell. The fix is the cell corrected: each factorization on fp32 copies, cast back (the
    lines after the failing one feed its result to more ops without a bf16 kernel), run on copies, then for real.

    https://github.com/ModelCloud/GPTQModel/issues/1777
    """
    from notebook_shell import loaded_shell

    from mpdoctor.attach.runtime.twins import try_on_twins

    with loaded_shell(("torch", "layer", "inputs", "hessian", "factor", "hinv", "r")) as sh:
        sh.run_cell(GPTQ_SETUP, store_history=True)
        exc = sh.run_cell(GPTQ_CELL, store_history=True).error_in_exec
        assert str(exc) == "\"cholesky_cpu\" not implemented for 'BFloat16'"  # the real error
        cause = explain(exc, namespace=sh.user_ns).cause
        assert cause.check == "crash-linalg-half"
        (fix,) = [fx for fx in cause.fixes if fx.recipe == "corrected-cell"]
        assert "factor = torch.linalg.cholesky(hessian.float()).to(torch.bfloat16)" in fix.code
        assert "hinv = torch.cholesky_inverse(factor.float()).to(torch.bfloat16)" in fix.code
        sh.run_cell("r = %mpdoctor --text", store_history=True)
        (trial,) = [t for fx, t in sh.user_ns["r"].trials if fx.recipe == "corrected-cell"]
        assert trial.ran, trial.sentence()
        assert "factor" not in sh.user_ns
        assert try_on_twins(fix.code, sh.user_ns).ran
        assert sh.run_cell(fix.code, store_history=True).error_in_exec is None  # then for real
        ns = sh.user_ns
        factor, hessian, hinv = ns["factor"], ns["hessian"], ns["hinv"]
        assert factor.dtype == hinv.dtype == torch.bfloat16 and torch.isfinite(hinv.float()).all()
        scale = hessian.float().abs().max().item()
        assert torch.allclose(factor.float() @ factor.float().T, hessian.float(), atol=2e-2 * scale)
        assert torch.allclose(hinv.float().T @ hinv.float() @ hessian.float(), torch.eye(8), atol=0.1)
        layer, inputs = ns["layer"], ns["inputs"]
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        before = snapshot(layer.parameters())
        loss = layer(inputs).float().pow(2).mean()
        loss.backward()
        opt.step()
        assert_step_trains(loss, before, layer.parameters())


def test_healthy_twin_fp32_islands_for_linalg_and_fft_draw_nothing():
    model = FourierMixer(upcast=True).to(torch.bfloat16)
    model(torch.randn(2, 12, 16, dtype=torch.bfloat16))
    weight = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.bfloat16))
    orthogonalized_step(weight, upcast=True)
    assert loud(mpdoctor.diagnose(namespace={"model": model})) == []
    linear = torch.nn.Linear(8, 8)  # the SOAP optimizer on an fp32 model: its QR runs, nothing to say
    opt = OrthogonalSOAP(linear.parameters())
    soap_step(linear, opt, torch.randn(4, 8))
    assert loud(mpdoctor.diagnose(namespace={"model": linear, "opt": opt})) == []


class LoReFT(torch.nn.Module):
    """A LoReFT intervention as ReFT builds it: an orthogonal rank-r projection R, a learned source, h + R^T(Wh + b - Rh)."""

    def __init__(self, hidden: int, rank: int) -> None:
        super().__init__()
        from torch.nn.utils.parametrizations import orthogonal

        self.rotate = orthogonal(torch.nn.Linear(hidden, rank, bias=False))  # R: (rank, hidden), householder
        self.source = torch.nn.Linear(hidden, rank)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        r = self.rotate.weight
        return h + (self.source(h) - h @ r.T) @ r


class ReftModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(16, 16)
        self.intervention = LoReFT(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.intervention(self.body(x))


def reft_step(model: torch.nn.Module, x: torch.Tensor):
    params = [p for p in model.intervention.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    before = snapshot(params)
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    assert_step_trains(loss, before, params)


def test_adapters_772_reft_orthogonality_in_bf16_is_refused_named_then_the_fp32_island_trains():
    """adapter-hub/adapters#772: "ReFT does not support BFloat16" (``orthogonality=True`` under ``model.bfloat16()``;
    the maintainers: "orthogonal parametrization does not support half precision, you can convert the adapter to
    float32"). Rebuilt with a LoReFT intervention (torch's ``orthogonal`` on a rank-2 projection) in a bf16 model.

    https://github.com/adapter-hub/adapters/issues/772
    """
    model = ReftModel().to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    exc = raised(lambda: model(x))
    assert "not implemented for 'BFloat16'" in str(exc) and explain(exc).cause.check == "crash-linalg-half"

    (finding,) = mpdoctor.diagnose(namespace={"model": model}).findings_for("orthogonal-parametrization-half")
    assert finding.severity == "error" and finding.evidence["orthogonal_map"] == "householder"
    assert finding.subject == "model.intervention.rotate"
    code = finding.fixes[0].code
    exec(code, {"__name__": "advice", "model": model})  # the advice, run with the user's names: an fp32 island
    assert model.intervention.rotate.parametrizations.weight.original.dtype == torch.float32
    assert mpdoctor.diagnose(namespace={"model": model}).findings_for("orthogonal-parametrization-half") == []
    reft_step(model, x)  # the user's forward and step, again


def reft_user_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    """The user's step on a ReFT model: the intervention's parameters trained, the base frozen."""
    opt.zero_grad()
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    return loss


def reft_at_the_crash():
    """A bf16 ReFT model, its optimizer, its batch, and the error its forward raises."""
    model = ReftModel().to(torch.bfloat16)
    opt = torch.optim.SGD(model.intervention.parameters(), lr=0.1)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    exc = raised(lambda: reft_user_step(model, opt, x))
    assert str(exc) == "\"orgqr_cpu\" not implemented for 'BFloat16'"  # the real error
    return model, opt, x, exc


def test_adapters_772_the_intervention_runs_as_an_fp32_island_in_place_and_the_same_step_trains():
    """adapter-hub/adapters#772 at the crash: the cause's planned fix runs the intervention whose forward raised in
    fp32 (its parameters, the parametrization's ``original`` and its ``base`` buffer), its output cast back to bf16,
    in place; the same step trains; undo gives back every tensor object and the error."""
    from fingerprint import assert_unchanged, fingerprint

    model, opt, x, exc = reft_at_the_crash()
    report = explain(exc, namespace={"model": model, "opt": opt, "x": x})
    assert report.cause.check == "crash-linalg-half"
    (fix,) = [fx for fx in report.fixes if fx.recipe == "fp32-island"]  # the plan's, led by the cause
    assert "model.intervention" in fix.title and not fix.safe
    fix.apply()
    assert fix.applied, fix.error
    base = model.intervention.rotate.parametrizations.weight[0].base
    assert base.dtype == torch.float32 and model.intervention.source.weight.dtype == torch.float32
    assert model.body.weight.dtype == torch.bfloat16 and model(x).dtype == torch.bfloat16  # only the island moved
    params = list(model.intervention.parameters())
    before = snapshot(params)
    assert_step_trains(reft_user_step(model, opt, x), before, params)
    fix.undo()
    assert model.intervention.rotate.parametrizations.weight.original.dtype == torch.bfloat16
    assert "orgqr_cpu" in str(raised(lambda: model(x)))  # the island is gone: the forward raises again

    model, opt, x, exc = reft_at_the_crash()  # exact undo, on objects the step has not moved
    fix = next(fx for fx in explain(exc, namespace={"model": model, "opt": opt}).fixes if fx.recipe == "fp32-island")
    held = fingerprint({"model": model, "opt": opt})
    fix.apply()
    assert fingerprint({"model": model, "opt": opt}) != held
    fix.undo()
    assert_unchanged(held, fingerprint({"model": model, "opt": opt}), "island apply then undo")


def test_adapters_772_through_the_widget_button():
    model, opt, x, exc = reft_at_the_crash()
    rw = explain(exc, namespace={"model": model, "opt": opt, "x": x}).widget()
    rw.confirm_delay = 0.0
    click(rw, "Run model.intervention in fp32", confirm=True)
    assert "failed" not in rw.status, rw.status
    params = list(model.intervention.parameters())
    before = snapshot(params)
    assert_step_trains(reft_user_step(model, opt, x), before, params)


def test_healthy_twin_reft_adapter_kept_fp32_draws_nothing():
    model = ReftModel().to(torch.bfloat16)
    model.intervention.float()  # the maintainers' recipe: the adapter in fp32
    model.intervention.register_forward_pre_hook(lambda m, args: tuple(a.float() for a in args))
    model.intervention.register_forward_hook(lambda m, args, out: out.to(torch.bfloat16))
    reft_step(model, torch.randn(4, 16, dtype=torch.bfloat16))
    report = mpdoctor.diagnose(namespace={"model": model})
    assert loud(report) == []  # mixed-param-dtypes reads the hooks' casts: an fp32 island on purpose
    (island,) = [i for m in report.facts.models for i in m.islands if i.kind == "cast-island"]
    assert island.path == "intervention" and "forward hook casts its output to bfloat16" in island.evidence


def test_the_fp32_reft_adapter_without_the_casts_is_still_an_error_and_raises():
    """The same fp32 intervention with no hook casting around it: the bf16 hidden state meets fp32 weights."""
    model = ReftModel().to(torch.bfloat16)
    model.intervention.float()
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    assert "dtype" in str(raised(lambda: model(x)))
    (finding,) = mpdoctor.diagnose(namespace={"model": model}).findings_for("mixed-param-dtypes")
    assert finding.severity == "error" and "intervention.source" in finding.evidence["modules"]
    # A pre-hook alone (the output left fp32) is no evidence either: the cast back is half of the island.
    model.intervention.register_forward_pre_hook(lambda m, args: tuple(a.float() for a in args))
    (finding,) = mpdoctor.diagnose(namespace={"model": model}).findings_for("mixed-param-dtypes")
    assert finding.severity == "error"


# -- a hand-written EMA kept in bf16 ---------------------------------------------------------------------------

SETUP = """
import copy
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).to({dtype})
ema = copy.deepcopy(model).requires_grad_(False)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
decay = 0.999
"""

STEP = """
def train_step():
    loss = model(torch.randn(8, 16, dtype=torch.bfloat16)).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        for ema_p, p in zip(ema.parameters(), model.parameters()):
            {update}
    return loss.detach()
"""

MUL_ADD, LERP = "ema_p.mul_(decay).add_(p, alpha=1 - decay)", "ema_p.lerp_(p, 1 - decay)"


class Notebook:
    """The user's cells run in a real IPython shell (history stored, as a notebook stores it)."""

    def __init__(self, update: str, shadow_dtype: str = "torch.bfloat16") -> None:
        from IPython.core.interactiveshell import InteractiveShell

        self.sh = InteractiveShell.instance()
        self.run(SETUP.format(dtype="torch.bfloat16") + f"ema.to({shadow_dtype})\n")
        self.run(STEP.format(update=update))
        self.ns = self.sh.user_ns

    def run(self, code: str) -> None:
        result = self.sh.run_cell(code, store_history=True)
        if result.error_in_exec is not None:
            raise result.error_in_exec

    def objects(self) -> dict:
        return {k: self.ns[k] for k in ("model", "ema", "opt")}

    def share_moved(self) -> float:
        """The share of the EMA's elements one of the user's steps (training step + EMA update) moves."""
        before = [p.detach().clone() for p in self.ns["ema"].parameters()]
        self.ns["train_step"]()
        after = list(self.ns["ema"].parameters())
        return sum(int((a != b).sum()) for a, b in zip(after, before)) / sum(b.numel() for b in before)

    def close(self) -> None:
        self.sh.reset(new_session=True)  # the next test starts with an empty history


def _trains_and_keeps_updates(nb: Notebook) -> None:
    params = list(nb.ns["model"].parameters())
    before = snapshot(params)
    assert_step_trains(nb.ns["train_step"](), before, params)
    assert all(p.dtype == torch.float32 for p in nb.ns["ema"].parameters())
    assert nb.share_moved() > 0.5  # the EMA update now registers


def test_diffae_16_hand_written_bf16_ema_loses_its_updates_then_an_fp32_shadow_keeps_them():
    """konpatp/diffae#16: a hand-written EMA ("the target model precision is also fp16 and the default ema decay
    factor is 0.9999") lags. Rebuilt as a notebook: ``ema = copy.deepcopy(model)`` of a bf16 model, updated each
    step with ``ema_p.mul_(decay).add_(p, alpha=1 - decay)`` under ``torch.no_grad()`` at decay 0.999.

    https://github.com/konpatp/diffae/issues/16
    """
    nb = Notebook(MUL_ADD)
    try:
        nb.ns["train_step"]()
        assert nb.share_moved() < 0.05  # measured: the bf16 EMA moves under 5% of its elements per update
        report = mpdoctor.diagnose(namespace=nb.objects())
        (finding,) = report.findings_for("low-precision-ema")
        assert finding.severity == "error" and finding.subject == "ema" and finding.evidence["online_model"] == "model"
        assert finding.evidence["lost_share"] > 0.9 and "ema_p.mul_(decay).add_(p, alpha=1 - decay)" in finding.evidence["update"]
        (fix,) = [f for f in report.fixes if f.slug == "low-precision-ema"]
        assert fix.applicability == "safe"

        twin = Notebook(MUL_ADD)  # the shown code, run with the user's names, does what the in-place fix does
        twin.ns["train_step"]()
        exec(compile(fix.code, "<fix code>", "exec"), dict(twin.objects()))
        fix.apply()
        for a, b in zip(nb.ns["ema"].parameters(), twin.ns["ema"].parameters(), strict=True):
            assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)

        _trains_and_keeps_updates(nb)  # the user's own step (training and EMA update), again
        assert mpdoctor.diagnose(namespace=nb.objects()).findings_for("low-precision-ema") == []
    finally:
        nb.close()


def test_diffae_16_through_the_widget_button():
    nb = Notebook(MUL_ADD)
    try:
        rw = widget(**nb.objects())
        click(rw, "Keep the shadow of ema in fp32")
        assert "low-precision-ema" not in {f.check for f in rw.report.findings}
        _trains_and_keeps_updates(nb)
    finally:
        nb.close()


def test_a_hand_written_bf16_lerp_ema_is_named_and_its_advised_code_run_then_the_update_keeps_its_updates():
    """``ema_p.lerp_(p, 1 - decay)``: ``Tensor.lerp_`` takes one dtype, so an fp32 shadow needs the user's line to
    lerp toward ``p.float()``; the fix is advice (cast + the corrected line), its code run with the user's names."""
    nb = Notebook(LERP)
    try:
        nb.ns["train_step"]()
        assert nb.share_moved() < 0.05
        (finding,) = mpdoctor.diagnose(namespace=nb.objects()).findings_for("low-precision-ema")
        (fix,) = finding.fixes
        assert finding.severity == "error" and fix.applicability == "display-only"
        assert "ema_p.lerp_(p.float(), 1 - decay)" in fix.code
        exec(compile(fix.code, "<fix code>", "exec"), dict(nb.objects()))
        assert "expected dtype float" in str(raised(nb.ns["train_step"]))  # the old line after the cast alone
        nb.run(STEP.format(update="ema_p.lerp_(p.float(), 1 - decay)"))  # the line as the fix says
        _trains_and_keeps_updates(nb)
        assert loud(mpdoctor.diagnose(namespace=nb.objects())) == []
    finally:
        nb.close()


def test_an_fp32_hand_written_lerp_ema_of_a_bf16_model_raises_then_is_named_and_its_shown_update_trains():
    """The EMA kept in fp32, as the advice says, with the update still ``ema_p.lerp_(p, 1 - decay)``: ``Tensor.lerp_``
    takes one dtype, so the user's step raises. mpdoctor names it from the cells before the step runs, and shows the
    user's own function lerping toward ``p.float()``; run as shown in the notebook, the step trains and the fp32
    EMA keeps its updates."""
    nb = Notebook(LERP, shadow_dtype="torch.float32")
    try:
        assert "expected dtype float for `end` but got dtype c10::BFloat16" in str(raised(nb.ns["train_step"]))
        report = mpdoctor.diagnose(namespace=nb.objects())
        (finding,) = report.findings_for("ema-update-dtype-mismatch")
        assert finding.severity == "error" and finding.subject == "ema" and finding.evidence["online_model"] == "model"
        assert finding.evidence["update"].endswith(LERP) and LERP in finding.message
        assert loud(report) == ["ema-update-dtype-mismatch"]  # the fp32 copy itself is no mistake
        (fix,) = finding.fixes
        assert fix.applicability == "display-only" and not fix.changes
        assert "def train_step():" in fix.code and "ema_p.lerp_(p.float(), 1 - decay)" in fix.code
        nb.run(fix.code)  # the shown code, in a cell of the user's notebook
        _trains_and_keeps_updates(nb)
        assert loud(mpdoctor.diagnose(namespace=nb.objects())) == []
    finally:
        nb.close()


def test_a_top_level_lerp_loop_is_shown_corrected_with_its_no_grad_and_one_inside_a_training_loop_as_a_line():
    """A loop that is its cell's statement (bare or under ``with torch.no_grad()``) is shown whole, corrected, and runs;
    one inside a training loop is shown as the corrected line (running the training loop again would train)."""
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    top = "with torch.no_grad():\n    for ema_p, p in zip(ema.parameters(), model.parameters()):\n        ema_p.lerp_(p, 1 - decay)\n"
    nested = ("for step in range(0):\n    with torch.no_grad():\n"
              "        for ema_p, p in zip(ema.parameters(), model.parameters()):\n            ema_p.lerp_(p, 1 - decay)\n")
    try:
        for body, whole in ((top, True), (nested, False)):
            sh.reset(new_session=True)
            assert sh.run_cell(SETUP.format(dtype="torch.bfloat16") + "ema.float()\n", store_history=True).error_in_exec is None
            sh.run_cell(body, store_history=True)
            ns = sh.user_ns
            (finding,) = mpdoctor.diagnose(namespace={k: ns[k] for k in ("model", "ema", "opt")}).findings_for("ema-update-dtype-mismatch")
            (fix,) = finding.fixes
            if whole:
                assert "with torch.no_grad():" in fix.code and "ema_p.lerp_(p.float(), 1 - decay)" in fix.code
                ns["model"][0].weight.data.add_(1.0)  # the online model moved: the next update must register
                before = ns["ema"][0].weight.detach().clone()
                assert sh.run_cell(fix.code, store_history=True).error_in_exec is None
                assert not torch.equal(before, ns["ema"][0].weight) and ns["ema"][0].weight.dtype == torch.float32
            else:
                assert "#     ema_p.lerp_(p.float(), 1 - decay)" in fix.code and "for step in range" not in fix.code
    finally:
        sh.reset(new_session=True)


def test_healthy_twin_hand_written_fp32_ema_and_a_bf16_reference_copy_draw_nothing():
    for update in (MUL_ADD, "ema_p.lerp_(p.float(), 1 - decay)"):
        nb = Notebook(update, shadow_dtype="torch.float32")
        try:
            nb.ns["train_step"]()
            assert nb.share_moved() > 0.5
            assert loud(mpdoctor.diagnose(namespace=nb.objects())) == []
        finally:
            nb.close()
    # A frozen bf16 copy no code averages into (a DPO reference model, a teacher) is no EMA: nothing is said.
    nb = Notebook("pass")
    try:
        nb.ns["train_step"]()
        report = mpdoctor.diagnose(namespace=nb.objects())
        assert report.findings_for("low-precision-ema") == [] and loud(report) == []
    finally:
        nb.close()


DICT_STEP = """
shadow = {n: p.detach().clone() for n, p in model.named_parameters()}

def train_step():
    loss = model(torch.randn(8, 16, dtype=torch.bfloat16)).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        for n, p in model.named_parameters():
            shadow[n].mul_(decay).add_(p, alpha=1 - decay)
    return loss.detach()
"""


EMA_UTILS = """
import torch


@torch.no_grad()
def update_ema(ema_model, model, decay):
    for ema_p, p in zip(ema_model.parameters(), model.parameters()):
        ema_p.mul_(decay).add_(p, alpha=1 - decay)
"""


def test_an_ema_update_imported_from_the_users_own_module_is_read_from_its_file_and_fixed_in_place(tmp_path, monkeypatch):
    """The update lives in the user's ``ema_utils.py`` (``from ema_utils import update_ema``), called from a cell:
    its source file is read (never run), the bf16 EMA is named with the file and the cell, fixed in place, and the
    user's step trains with the EMA's updates registering."""
    from IPython.core.interactiveshell import InteractiveShell

    (tmp_path / "ema_utils.py").write_text(EMA_UTILS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sh = InteractiveShell.instance()
    step = STEP.replace("""with torch.no_grad():
        for ema_p, p in zip(ema.parameters(), model.parameters()):
            {update}""", "update_ema(ema, model, decay)")
    try:
        for cell in (SETUP.format(dtype="torch.bfloat16") + "from ema_utils import update_ema\n", step):
            assert sh.run_cell(cell, store_history=True).error_in_exec is None
        nb = Notebook.__new__(Notebook)
        nb.sh, nb.ns = sh, sh.user_ns
        nb.ns["train_step"]()
        assert nb.share_moved() < 0.05  # measured: the bf16 EMA's updates round away
        report = mpdoctor.diagnose(namespace=nb.objects())
        (finding,) = report.findings_for("low-precision-ema")
        assert finding.subject == "ema" and finding.evidence["online_model"] == "model"
        assert finding.evidence["update"].startswith("ema_utils.update_ema (ema_utils.py:5), called in cell [")
        (fix,) = finding.fixes
        assert fix.applicability == "safe"
        fix.apply()
        _trains_and_keeps_updates(nb)
        # A helper of a library (no update op in its source) is never taken for one.
        monkeypatch.setitem(nb.ns, "update_ema", torch.nn.init.zeros_)
        assert mpdoctor.diagnose(namespace=nb.objects()).findings_for("low-precision-ema") == []
    finally:
        sh.reset(new_session=True)


def test_a_dict_of_bf16_shadow_tensors_loses_its_updates_then_is_fixed_in_place_and_the_step_trains():
    """The other hand-written form: ``shadow = {n: p.detach().clone() ...}`` of a bf16 model, updated by name."""
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    try:
        for cell in (SETUP.format(dtype="torch.bfloat16"), DICT_STEP):
            assert sh.run_cell(cell, store_history=True).error_in_exec is None
        ns = sh.user_ns
        shadow, step = ns["shadow"], ns["train_step"]

        def moved() -> float:
            before = {k: v.clone() for k, v in shadow.items()}
            step()
            return sum(int((shadow[k] != v).sum()) for k, v in before.items()) / sum(v.numel() for v in before.values())

        step()
        assert moved() < 0.05
        objects = {k: ns[k] for k in ("model", "opt")}
        (finding,) = mpdoctor.diagnose(namespace=objects).findings_for("low-precision-ema")
        assert finding.subject == "shadow" and finding.evidence["lost_share"] > 0.9
        (fix,) = finding.fixes
        twin = {k: v.clone() for k, v in shadow.items()}
        exec(compile(fix.code, "<fix code>", "exec"), {"shadow": twin})
        fix.apply()
        assert all(v.dtype == twin[k].dtype == torch.float32 and torch.equal(v, twin[k]) for k, v in shadow.items())
        params = list(ns["model"].parameters())
        before = snapshot(params)
        assert_step_trains(step(), before, params)
        assert moved() > 0.5
    finally:
        sh.reset(new_session=True)


def test_a_bf16_lerp_ema_of_an_fp32_model_quotes_its_real_error_and_its_in_place_cast_makes_the_step_run():
    """The other direction of ``ema-update-dtype-mismatch``: the shadow is the bf16 one, the model fp32. The message
    quotes the error ``lerp_`` really raises (the dtypes in its order), and the fix is the shadow cast to fp32 in
    place: the user's ``ema_p.lerp_(p, 1 - decay)`` then meets one dtype, unchanged."""
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    step = STEP.replace("dtype=torch.bfloat16", "dtype=torch.float32").format(update=LERP)
    try:
        for cell in (SETUP.format(dtype="torch.float32") + "ema.to(torch.bfloat16)\n", step):
            assert sh.run_cell(cell, store_history=True).error_in_exec is None
        ns = sh.user_ns
        error = str(raised(ns["train_step"]))
        assert error == "expected dtype c10::BFloat16 for `end` but got dtype float"
        report = mpdoctor.diagnose(namespace={k: ns[k] for k in ("model", "ema", "opt")})
        (finding,) = report.findings_for("ema-update-dtype-mismatch")
        assert repr(error) in finding.message
        (fix,) = finding.fixes
        assert fix.applicability == "safe" and fix.changes and "lerp_(p.float()" not in fix.code
        fix.apply()
        assert all(p.dtype == torch.float32 for p in ns["ema"].parameters())
        params = list(ns["model"].parameters())
        before = snapshot(params)
        assert_step_trains(ns["train_step"](), before, params)
    finally:
        sh.reset(new_session=True)
