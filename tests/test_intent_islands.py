"""Intent islands: fp32 parts a healthy setup keeps on purpose draw nothing; the same part as an accident is an error.

Evidence read from the live objects (``mpdoctor/objects/readers/intent.py``): an averaged copy (torch's ``AveragedModel``),
a frozen copy of a sibling that no optimizer holds (a hand-written EMA), PEFT's fp32 adapters, a module whose
forward casts its input. The last test measures false alarms: ``diagnose()`` on the healthy recipe of each island
kind draws no error and no warning.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from steps import assert_step_trains, snapshot
from test_intent import MoE, ParentCasts
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn
from transformers import LlamaConfig, LlamaForCausalLM

import mpdoctor

HALF = torch.float16
BF16 = torch.bfloat16


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))


def ema(source: torch.nn.Module, target: torch.nn.Module, decay: float) -> None:
    """diffae's hand-written EMA (``ema(self.model, self.ema_model, decay)``), as its LitModel runs it per step."""
    source_dict, target_dict = source.state_dict(), target.state_dict()
    for key in source_dict:
        target_dict[key].data.copy_(target_dict[key].data * decay + source_dict[key].data * (1 - decay))


class LitModel(torch.nn.Module):
    """konpatp/diffae's LitModel: the trained ``model`` and a frozen ``ema_model`` deepcopy, in one module."""

    def __init__(self, dtype: torch.dtype, ema_dtype: torch.dtype) -> None:
        super().__init__()
        self.model = _net().to(dtype)
        self.ema_model = copy.deepcopy(self.model).to(ema_dtype)
        self.ema_model.requires_grad_(False)
        self.ema_model.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def _lit_step(lit: LitModel, opt: torch.optim.Optimizer, dtype: torch.dtype = HALF) -> torch.Tensor:
    loss = lit(torch.randn(8, 16, dtype=dtype)).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _ema_moved_share(lit: LitModel, decay: float = 0.999) -> float:
    before = [p.detach().clone() for p in lit.ema_model.parameters()]
    ema(lit.model, lit.ema_model, decay)
    return sum(int((p != b).sum()) for p, b in zip(lit.ema_model.parameters(), before)) / sum(b.numel() for b in before)


def click_fix(rw, title: str) -> None:
    """Click a fix's button in the widget; an unsafe fix asks for a confirming second click."""
    (button,) = rw.buttons(title)
    button.click()
    for armed in rw.buttons("Click again to confirm"):
        armed.click()


def _loud(report) -> list:
    return [f for f in report.findings if f.severity in ("error", "warning")]


# -- konpatp/diffae#16: a hand-written EMA copy kept fp32 beside an fp16 model -----------------------------------


def test_diffae_fp32_ema_copy_beside_the_fp16_model_is_an_island_and_the_old_fix_lost_its_updates():
    """konpatp/diffae#16: "is this because the ema decay factor is too small for fp16 precision? ... the target
    model precision is also fp16 and the default ema decay factor is 0.9999". Keeping ``ema_model`` in fp32 is the
    cure; mpdoctor called that cure a mixed-param-dtypes error and offered to cast it back to fp16."""
    lit = LitModel(HALF, torch.float32)
    opt = torch.optim.SGD(lit.model.parameters(), lr=1e-2)  # AdamW's eps=1e-8 would be a real fp16 fault of its own
    params = list(lit.model.parameters())
    before = snapshot(params)
    assert_step_trains(_lit_step(lit, opt), before, params)  # the user's step trains ...
    assert _ema_moved_share(lit) > 0.5  # ... and the fp32 EMA follows it

    report = mpdoctor.diagnose(lit, opt)
    assert not report.findings_for("mixed-param-dtypes") and not _loud(report), report.to_text()

    narrowed = LitModel(HALF, HALF)  # what the old "cast the minority to float16" fix made of it
    _lit_step(narrowed, torch.optim.SGD(narrowed.model.parameters(), lr=1e-2))
    assert _ema_moved_share(narrowed) < 0.05  # measured: the reported lag, an EMA that does not move


def test_diffae_the_same_copy_made_a_trained_layer_is_an_accident_named_and_fixed_through_the_api():
    """The twin accident: the fp32 copy is trained (the optimizer holds it) and called in the forward."""

    class Student(LitModel):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x) + self.ema_model(x)

    lit = Student(HALF, torch.float32)
    lit.ema_model.requires_grad_(True)
    opt = torch.optim.SGD(lit.parameters(), lr=1e-2)
    with pytest.raises(RuntimeError, match="dtype"):
        _lit_step(lit, opt)  # the real error
    report = mpdoctor.diagnose(lit, opt)
    (finding,) = report.findings_for("mixed-param-dtypes")
    assert finding.severity == "error" and "ema_model" in str(finding.evidence["modules"])
    (fix,) = [f for f in report.fixes if f.slug == "mixed-param-dtypes"]
    fix.apply()
    params = list(lit.parameters())
    before = snapshot(params)
    assert_step_trains(_lit_step(lit, opt), before, params)


def test_diffae_the_accident_is_fixed_through_the_widget_button():
    class Student(LitModel):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x) + self.ema_model(x)

    lit = Student(HALF, torch.float32)
    lit.ema_model.requires_grad_(True)
    opt = torch.optim.SGD(lit.parameters(), lr=1e-2)
    rw = mpdoctor.diagnose(namespace={"lit": lit, "opt": opt}).widget()
    rw.confirm_delay = 0.0
    (fix,) = [f for f in rw.report.fixes if f.slug == "mixed-param-dtypes"]
    click_fix(rw, fix.title)
    assert "mixed-param-dtypes" not in {f.check for f in rw.report.findings}
    params = list(lit.parameters())
    before = snapshot(params)
    assert_step_trains(_lit_step(lit, opt), before, params)


# -- huggingface/peft#2421: PEFT keeps adapters fp32 under a bf16 base by default --------------------------------


def _bf16_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, use_cache=False)  # fmt: skip
    return LlamaForCausalLM(cfg).to(BF16)


def _lm_step(model, opt) -> torch.Tensor:
    ids = torch.randint(0, 64, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_peft_fp32_adapters_under_a_bf16_base_are_the_library_default_and_draw_nothing():
    """huggingface/peft#2421: adapters come out fp32 under a bf16 base; the maintainers: "by default, it is always
    cast to float32 because the performance will be better with higher precision" (``autocast_adapter_dtype``)."""
    model = get_peft_model(_bf16_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    params = [p for p in model.parameters() if p.requires_grad]
    before = snapshot(params)
    assert_step_trains(_lm_step(model, opt), before, params)
    report = mpdoctor.diagnose(model, opt)
    assert not report.findings_for("mixed-param-dtypes") and not _loud(report), report.to_text()


def test_peft_an_fp32_head_outside_the_adapters_is_still_an_accident_fixed_through_api_and_widget():
    for through_widget in (False, True):
        model = get_peft_model(_bf16_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        model.base_model.model.lm_head.float()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        with pytest.raises(RuntimeError, match="dtype"):
            _lm_step(model, opt)
        opt.zero_grad()
        report = mpdoctor.diagnose(namespace={"model": model, "opt": opt})
        (finding,) = report.findings_for("mixed-param-dtypes")
        assert finding.severity == "error" and "lm_head" in str(finding.evidence["modules"])
        if through_widget:
            rw = report.widget()
            rw.confirm_delay = 0.0
            (fix,) = [f for f in rw.report.fixes if f.slug == "mixed-param-dtypes"]
            click_fix(rw, fix.title)
            assert "mixed-param-dtypes" not in {f.check for f in rw.report.findings}
        else:
            (fix,) = [f for f in report.fixes if f.slug == "mixed-param-dtypes"]
            fix.apply()
        params = [p for p in model.parameters() if p.requires_grad]
        before = snapshot(params)
        assert_step_trains(_lm_step(model, opt), before, params)


# -- evidence, one kind at a time ------------------------------------------------------------------------------------


def test_a_frozen_copy_that_an_optimizer_holds_is_not_a_shadow():
    """No optimizer holding the copy is part of the evidence: held by one, it is a trained layer, and an error."""
    lit = LitModel(HALF, torch.float32)
    opt = torch.optim.SGD(lit.parameters(), lr=1e-2)  # holds ema_model too
    assert mpdoctor.diagnose(lit, opt).findings_for("mixed-param-dtypes")[0].severity == "error"


def test_inference_use_alone_is_no_evidence_a_mixed_matmul_raises_under_no_grad_too():
    """A model nobody trains (no optimizer, requires_grad False, eval) with an fp32 layer that meets bf16
    activations raises at its first call: the finding stays an error."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(BF16).eval().requires_grad_(False)
    model[1].float()
    with torch.no_grad(), pytest.raises(RuntimeError, match="dtype"):
        model(torch.randn(2, 8, dtype=BF16))
    assert mpdoctor.diagnose(model).findings_for("mixed-param-dtypes")[0].severity == "error"


def test_the_island_evidence_is_quoted_when_another_module_is_still_an_accident():
    lit = LitModel(HALF, torch.float32)
    lit.head = torch.nn.Linear(16, 1)  # fp32 and trained: the accident
    opt = torch.optim.SGD([*lit.model.parameters(), *lit.head.parameters()], lr=1e-2)
    (finding,) = mpdoctor.diagnose(lit, opt).findings_for("mixed-param-dtypes")
    assert list(finding.evidence["modules"]) == ["head"]
    assert "frozen copy of model" in finding.evidence["islands"]["ema_model"]


# -- false alarms: the healthy recipe of each island kind --------------------------------------------------------


def _moe_router() -> tuple:
    model = MoE(cast=True).to(BF16)
    model.router.float()
    return (model, torch.optim.SGD(model.parameters(), lr=1e-2)), lambda: model(torch.randn(4, 8, dtype=BF16))


def _parent_cast_gate() -> tuple:
    model = ParentCasts().to(BF16)
    model.gate.float()
    return (model, torch.optim.SGD(model.parameters(), lr=1e-2)), lambda: model(torch.randn(4, 8, dtype=BF16))


def _peft_adapters() -> tuple:
    model = get_peft_model(_bf16_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 64, (2, 8))
    return (model, opt), lambda: model(input_ids=ids, labels=ids).loss


def _averaged_copy() -> tuple:
    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net().to(BF16)
            self.ema = AveragedModel(self.net, avg_fn=get_ema_avg_fn(0.999))
            self.ema.module.float()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

    holder = Holder()
    return (holder, torch.optim.AdamW(holder.net.parameters(), lr=1e-3)), lambda: holder(torch.randn(4, 16, dtype=BF16))


def _hand_written_ema() -> tuple:
    lit = LitModel(BF16, torch.float32)
    return (lit, torch.optim.AdamW(lit.model.parameters(), lr=1e-3)), lambda: lit(torch.randn(4, 16, dtype=BF16))


HEALTHY_ISLANDS = {
    "router that casts its input": _moe_router,
    "gate whose parent upcasts its input": _parent_cast_gate,
    "PEFT fp32 adapters": _peft_adapters,
    "AveragedModel fp32 copy in the module": _averaged_copy,
    "hand-written fp32 EMA copy": _hand_written_ema,
}


@pytest.mark.parametrize("kind", HEALTHY_ISLANDS)
def test_false_alarms_the_healthy_recipe_of_each_island_kind_trains_and_draws_no_error_or_warning(kind):
    (model, opt), forward = HEALTHY_ISLANDS[kind]()
    params = [p for g in opt.param_groups for p in g["params"]]
    before = snapshot(params)
    loss = forward().float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    assert_step_trains(loss.detach(), before, params)
    report = mpdoctor.diagnose(model, opt)
    assert not _loud(report), report.to_text()


class _FrozenOnThePath(torch.nn.Module):
    """A frozen bf16 copy of ``body`` that the forward calls (written with ``s`` for ``self``): on the path."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.frozen = torch.nn.Linear(8, 8).to(torch.bfloat16).requires_grad_(False)
        self.head = torch.nn.Linear(8, 1)

    def forward(s, x):  # noqa: N805 - the user's own spelling of self
        return s.head(s.frozen(s.body(x)))


def test_a_frozen_copy_the_forward_calls_is_not_an_island_it_is_diagnosed_and_its_proven_fix_trains():
    torch.manual_seed(0)
    net = _FrozenOnThePath()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randn(4, 8)

    def step():
        opt.zero_grad()
        loss = net(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    with pytest.raises(RuntimeError, match="same dtype"):
        step()  # the real error: the forward meets the frozen copy's bf16
    report = mpdoctor.diagnose(net, opt, step=step)
    (finding,) = report.findings_for("mixed-param-dtypes")
    assert finding.severity == "error" and "frozen" in finding.message
    assert report.proof.verified
    for fx in report.fixes:
        fx.apply()
    params = [p for p in net.parameters() if p.requires_grad]
    start = snapshot(params)
    assert_step_trains(step(), start, params)


class _CopyThroughAHelper(torch.nn.Module):
    """A frozen bf16 copy the forward reaches through a method of its own, and a trainable bf16 twin it never calls
    in forward (a value head the user calls as ``net.value(x)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.frozen = torch.nn.Linear(8, 8).to(torch.bfloat16).requires_grad_(False)
        self.value_head = torch.nn.Linear(8, 8).to(torch.bfloat16)

    def forward(self, x):
        return self._through(self.body(x))

    def _through(self, h):
        return self.frozen(h)

    def value(self, x):
        return self.value_head(x)


def test_a_frozen_copy_reached_through_a_helper_and_a_trainable_twin_are_both_on_the_compute_path():
    net = _CopyThroughAHelper()
    x = torch.randn(4, 8)
    for call in (net, net.value):
        with pytest.raises(RuntimeError, match="same dtype"):
            call(x)  # the real errors: the frozen copy in forward, the trainable twin in value()
    report = mpdoctor.diagnose(net)
    assert not [i for i in report.facts.models[0].islands if i.path in ("frozen", "value_head")]
    (finding,) = report.findings_for("mixed-param-dtypes")
    assert finding.severity == "error"
