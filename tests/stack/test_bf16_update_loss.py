"""``pure-bf16-adamw`` calibrated on the weights at hand: the share of bf16 weights whose Adam step rounds away.

An Adam step moves each weight by about ``lr`` (exactly ``lr`` in magnitude at the first step, where
``m / sqrt(v) = sign(g)``); in bf16 the step is lost when it is below half a unit in the last place of the weight.
The tests measure the lost share with one real step and compare it with the share mpdoctor predicts from the
weights' magnitudes and ``lr``.
"""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import mpdoctor


def tiny_llama(hidden: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=32)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def measured_lost_share(model, opt, steps: int = 1) -> float:
    """The share of trainable elements with a nonzero gradient that did not move at the last of ``steps`` steps."""
    params = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(0, 64, (2, 16))
    for _ in range(steps):
        opt.zero_grad()
        before = [p.detach().clone() for p in params]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    moved = total = 0
    for p, b in zip(params, before):
        live = p.grad != 0
        total += int(live.sum())
        moved += int((p.detach() != b)[live].sum())
    return 1 - moved / total


def test_full_bf16_weights_at_a_small_lr_lose_most_steps_a_warning():
    """A whole bf16 Llama under stock AdamW at lr=1e-5: most weights are larger than 2**-8, so most steps round
    away (measured), and the finding is a warning whose predicted share matches the measured one."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    report = mpdoctor.diagnose(model, opt, names={id(model): "model", id(opt): "optimizer"})
    (f,) = report.findings_for("pure-bf16-adamw")
    predicted = f.evidence["lost_share"]
    assert f.severity == "warning" and predicted > 0.5
    lost = measured_lost_share(model, opt)
    assert lost > 0.5 and abs(lost - predicted) < 0.1, (lost, predicted)


def test_fresh_bf16_lora_adapters_lose_almost_nothing_an_info():
    """bf16 LoRA adapters (``autocast_adapter_dtype=False`` keeps them in the base's bf16) at LoRA's usual lr=2e-4
    on a 1024-wide layer: B starts at zero and A within +-1/sqrt(1024) = 0.031, below the 2**-4 from which a
    2e-4 step rounds away, so the steps land (measured over three steps, A included once B has moved); info,
    with the fp32-master fix kept as advice only."""
    model = get_peft_model(tiny_llama(1024), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), autocast_adapter_dtype=False)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.bfloat16}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    report = mpdoctor.diagnose(model, opt, names={id(model): "model", id(opt): "optimizer"})
    (f,) = report.findings_for("pure-bf16-adamw")
    assert f.severity == "info" and f.evidence["lost_share"] < 0.01
    assert not [x for x in report.fixes if x.slug == "pure-bf16-adamw"]  # nothing planned in place
    assert measured_lost_share(model, opt, steps=3) < 0.01


def test_bf16_lora_adapters_on_a_narrow_layer_lose_a_quarter_of_their_steps_a_warning():
    """The same adapters on a 64-wide layer: A starts within +-1/8, half of it above 2**-4, so half of A's steps
    (a quarter of all adapter steps) round away: predicted 25%, measured 25% at the third step."""
    model = get_peft_model(tiny_llama(64), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), autocast_adapter_dtype=False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    (f,) = mpdoctor.diagnose(model, opt).findings_for("pure-bf16-adamw")
    assert f.severity == "warning" and 0.2 < f.evidence["lost_share"] < 0.3
    assert abs(measured_lost_share(model, opt, steps=3) - f.evidence["lost_share"]) < 0.05
