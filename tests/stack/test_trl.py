"""TRL: SFT / DPO / GRPO / KTO trainers discovered through transformers' Trainer, TRL's config defaults, the reference model.

Real ``SFTTrainer`` / ``DPOTrainer`` / ``GRPOTrainer`` / ``KTOTrainer`` (trl 1.16) on a tiny Llama built from a config and a word-level tokenizer
trained here on a few strings (nothing is downloaded); ``use_cpu=True``, ``max_steps=1``; no mocks.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from setups_precision import compute_dtypes
from steps import assert_step_trains, snapshot
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, KTOConfig, KTOTrainer, SFTConfig, SFTTrainer

import mpdoctor
from mpdoctor.objects.discovery.subjects import discover

TEXTS = ["the cat sat on the mat", "a dog ran in the park", "hello world this is text"] * 2
BF16_REFUSED = "Your setup doesn't support bf16/gpu"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained here on ``TEXTS`` (nothing is downloaded)."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]", "[EOS]"]))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]"
    )


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def tiny_llama(tokenizer) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=1, eos_token_id=2, bos_token_id=2,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def common(tmp_path) -> dict:
    return {
        "output_dir": str(tmp_path),
        "max_steps": 1,
        "report_to": [],
        "per_device_train_batch_size": 2,
        "save_strategy": "no",
        "logging_steps": 1,
    }


def sft(tokenizer, tmp_path, model=None, **kw) -> SFTTrainer:
    args = SFTConfig(**{**common(tmp_path), "use_cpu": True, **kw.pop("args", {})})
    return SFTTrainer(
        model=model or tiny_llama(tokenizer),
        args=args,
        train_dataset=Dataset.from_dict({"text": TEXTS}),
        processing_class=tokenizer,
        **kw,
    )


class Logs(TrainerCallback):
    def __init__(self):
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "rewards/margins" in logs:
            self.logs.append(dict(logs))


def dpo(tokenizer, tmp_path, model, ref_model, learning_rate: float = 0.0) -> tuple[DPOTrainer, Logs]:
    data = Dataset.from_dict(
        {
            "prompt": ["the cat", "a dog"],
            "chosen": [" sat on the mat", " ran in the park"],
            "rejected": [" hello world", " this is text"],
        }
    )
    # learning_rate=0 (the default): the step measures the rewards of identical policy and reference weights (they
    # must be 0); the cure registry trains with a real rate, as the reported runs did.
    args = DPOConfig(**common(tmp_path), use_cpu=True, bf16=False, learning_rate=learning_rate)
    logs = Logs()
    trainer = DPOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[logs],
    )
    return trainer, logs


def large_logit_policy_and_fp16_reference(tokenizer) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """An fp32 policy whose logits pass fp16's 65504 (as a trained model's can) and its fp16 copy as reference."""
    model = tiny_llama(tokenizer)
    with torch.no_grad():  # large activations, as a trained model's can be; every weight fits fp16
        model.model.norm.weight.mul_(1e4)
        model.lm_head.weight.mul_(100)
    model.half().float()  # weights exactly representable in fp16: the fp32 cast of the copy is exact
    return model, copy.deepcopy(model).half()


def slugs(report, *severities):
    return {f.check for f in report.findings if f.severity in severities}


def test_default_sft_config_runs_bf16_autocast_on_cpu_and_is_healthy(tokenizer, tmp_path):
    """Healthy recipe (TRL's quickstart): ``SFTTrainer(model, args=SFTConfig(...))`` on the CPU.

    ``SFTConfig`` defaults ``bf16=True`` (``bf16=None`` resolved when ``fp16`` is unset). Measured: with
    ``use_cpu=True`` accelerate runs the forward under bf16 autocast over fp32 weights (a Linear sees bf16
    inputs, autocast enabled), and mpdoctor reports requested = effective = bf16, no error, no warning.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = sft(tokenizer, tmp_path)
    assert trainer.args.bf16 is True and trainer.args.fp16 is False
    assert not [w for w in caught if "bf16" in str(w.message) or "precision" in str(w.message)]
    seen = []
    layer = trainer.model.model.layers[0].mlp.down_proj
    handle = layer.register_forward_hook(
        lambda m, i, o: seen.append((i[0].dtype, torch.is_autocast_enabled("cpu")))
    )
    trainer.train()
    handle.remove()
    assert seen and seen[0] == (torch.bfloat16, True) and trainer.model.dtype == torch.float32
    names = {id(trainer): "trainer"}
    kinds = {(s.kind, s.name) for s in discover([trainer], names=names)}
    assert {("trainer", "trainer"), ("training_args", "trainer.args"), ("model", "trainer.model")} <= kinds
    report = mpdoctor.diagnose(trainer, names=names)
    (t,) = report.facts.trl
    assert (t.trainer_class, t.config_class, t.model_name, t.ref_model_name) == (
        "SFTTrainer",
        "SFTConfig",
        "trainer.model",
        None,
    )
    (p,) = [p for p in report.facts.precisions if p.name == "trainer"]
    assert (p.requested, p.computes_in) == ("bf16", "bf16")
    assert not slugs(report, "error", "warning"), report.to_text()


def test_healthy_sft_with_lora_peft_config(tokenizer, tmp_path):
    """Healthy recipe (TRL docs, "Train adapters with PEFT"): ``SFTTrainer(..., peft_config=LoraConfig(...))``.

    TRL wraps the model with ``get_peft_model`` (PEFT's ``autocast_adapter_dtype=True``: fp32 adapters) under
    the default bf16 autocast; no reference model. No error, no warning.
    """
    trainer = sft(
        tokenizer,
        tmp_path,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    trainer.train()
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    report = mpdoctor.diagnose(trainer, names={id(trainer): "trainer"})
    (t,) = report.facts.trl
    assert t.ref_model_name is None
    assert not slugs(report, "error", "warning"), report.to_text()


def test_field_default_sft_config_on_a_t4_is_refused(tokenizer, tmp_path):
    """unslothai/unsloth#2783 (SFTTrainer / GRPOTrainer notebooks on a T4: "ValueError: Your setup doesn't
    support bf16/gpu") and gensyn-ai/rl-swarm#299 (GRPOConfig, same error).

    TRL's configs ask for bf16 by default. The real refusal is reproduced here: on this machine, which has no
    GPU with bf16, an ``SFTConfig`` without ``use_cpu`` raises transformers' error (the test it fails is
    ``not is_torch_bf16_gpu_available()``, true on a T4 as on this CPU). The T4 itself is GPU-only: the
    what-if ``target="T4"`` on a CPU-built SFTTrainer names it (``bf16-unsupported``). The report's fix is
    applied to that trainer in place: the config's own fields (``bf16=False, fp16=True``) and its accelerator
    brought to what a T4 runs (fp16 autocast, a GradScaler); the next step computes in fp16 here, trains
    (finite loss, parameters moved), and the T4 what-if is then clean of it.
    """
    with pytest.raises(ValueError, match=BF16_REFUSED):
        SFTConfig(**common(tmp_path))
    trainer = sft(tokenizer, tmp_path)
    report = mpdoctor.diagnose(trainer, names={id(trainer): "trainer"}, target="T4")
    finding = next(f for f in report.findings if f.check == "bf16-unsupported")
    assert finding.severity == "error" and BF16_REFUSED in finding.message
    code = finding.fixes[0].code
    assert "trainer.args.bf16, trainer.args.fp16 = False, True" in code
    for field in ("bf16", "fp16", "mixed_precision"):
        assert f"trainer.args.{field}" not in code or hasattr(trainer.args, field)
    finding.fixes[0].apply()
    assert (trainer.args.bf16, trainer.args.fp16) == (False, True)
    assert trainer.accelerator.mixed_precision == "fp16" and trainer.accelerator.native_amp
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    before = snapshot(params)
    with compute_dtypes(trainer.model) as seen:  # the first Linear's output dtype at every forward
        loss = trainer.train().training_loss
    assert set(seen) == {torch.float16}  # fp16 autocast, as on the T4
    assert_step_trains(loss, before, params)
    assert "bf16-unsupported" not in slugs(
        mpdoctor.diagnose(trainer, names={id(trainer): "trainer"}, target="T4"), "error", "warning"
    )


def test_field_fp16_reference_model_nan_rewards(tokenizer, tmp_path):
    """huggingface/trl#878 "DPO training produces nan for rewards": with fp16, rewards NaN from the second
    step; "tried fp32 and load reference model with float32 then seems the nan fixed". Same symptom as
    huggingface/smol-course#61 (DPO loss 0 from the second step with an fp16 model).

    Reproduced: an fp32 policy and its fp16 copy as ``ref_model``; the policy's logits are made large (the
    final norm and lm_head scaled) so that they exceed fp16's 65504, as a trained model's can: the reference's logits become
    inf and DPO's rewards NaN (measured from the trainer's own logs). Diagnosis ``trl-ref-model-dtype``
    (error); the fix casts the reference to fp32 in place; the same step then logs finite rewards, exactly 0
    (identical weights).
    """

    def pair():
        return large_logit_policy_and_fp16_reference(tokenizer)

    trainer, logs = dpo(tokenizer, tmp_path, *pair())
    trainer.train()
    first = logs.logs[-1]
    assert math.isnan(first["rewards/chosen"]) and math.isnan(first["grad_norm"])  # the harm, measured
    # (a NaN gradient step poisons the policy even at lr=0: AdamW computes 0 * NaN; so the fix is proven on
    # the same setup built again, diagnosed before its first step)
    trainer, logs = dpo(tokenizer, tmp_path, *pair())
    report = mpdoctor.diagnose(trainer, names={id(trainer): "trainer"})
    (t,) = report.facts.trl
    assert (t.trainer_class, t.config_class, t.ref_model_name) == (
        "DPOTrainer",
        "DPOConfig",
        "trainer.ref_model",
    )
    finding = next(f for f in report.findings if f.check == "trl-ref-model-dtype")
    assert finding.severity == "error" and finding.subject == "trainer.ref_model"
    assert "trainer.ref_model.to(torch.float32)" in finding.fixes[0].code
    finding.fixes[0].apply()
    assert all(p.dtype == torch.float32 for p in trainer.ref_model.parameters())
    assert "trl-ref-model-dtype" not in slugs(
        mpdoctor.diagnose(trainer, names={id(trainer): "trainer"}), "error", "warning"
    )
    trainer.train()
    assert logs.logs[-1]["rewards/chosen"] == 0.0 and logs.logs[-1]["rewards/margins"] == 0.0
    assert math.isfinite(logs.logs[-1]["grad_norm"])


def test_field_reference_in_another_dtype_biases_rewards(tokenizer, tmp_path):
    """RLHFlow/Online-DPO-R1#16 "Different dtype of model and ref_model" (policy loaded fp16, reference bf16).

    Stand-in on the CPU: an fp32 policy (no autocast) and a bf16 copy as reference. Identical weights must
    give rewards and margins of exactly 0 and a loss of ln 2 at the first step; the bf16 reference gives a
    non-zero margin (measured). Diagnosis ``trl-ref-model-dtype`` (warning: biased, not NaN); the in-place
    cast makes the margin 0 again.
    """
    model = tiny_llama(tokenizer).to(torch.bfloat16).float()  # bf16-representable: the later cast is exact
    trainer, logs = dpo(tokenizer, tmp_path, model, copy.deepcopy(model).to(torch.bfloat16))
    trainer.train()
    assert logs.logs[-1]["rewards/margins"] != 0.0  # the bias, measured
    report = mpdoctor.diagnose(trainer, names={id(trainer): "trainer"})
    finding = next(f for f in report.findings if f.check == "trl-ref-model-dtype")
    assert finding.severity == "warning"
    assert "trl-ref-model-dtype" not in slugs(report, "error")
    finding.fixes[0].apply()
    trainer.train()  # lr=0 and finite gradients: the weights are still identical
    assert logs.logs[-1]["rewards/margins"] == 0.0


def test_healthy_dpo_reference_in_policy_dtype(tokenizer, tmp_path):
    """Healthy recipe: ``DPOTrainer`` with a reference in the policy's dtype; no error, no warning."""
    model = tiny_llama(tokenizer)
    trainer, logs = dpo(tokenizer, tmp_path, model, copy.deepcopy(model))
    trainer.train()
    assert logs.logs[-1]["rewards/margins"] == 0.0
    report = mpdoctor.diagnose(trainer, names={id(trainer): "trainer"})
    assert not slugs(report, "error", "warning"), report.to_text()


def test_healthy_grpo_default_config(tokenizer, tmp_path):
    """Healthy recipe (TRL's GRPO quickstart): ``GRPOTrainer(model, reward_funcs=..., args=GRPOConfig(...))``.

    The default config asks for bf16 like every TRL config (bf16 autocast on this CPU); one step generates
    two completions per prompt, scores them and trains; no error, no warning, and no reference model (GRPO's
    default ``beta=0`` needs none)."""
    args = GRPOConfig(**common(tmp_path), use_cpu=True, num_generations=2, max_completion_length=4, generation_batch_size=2)
    assert args.bf16 is True and not args.fp16  # TRL's default, resolved in __post_init__

    def length_reward(completions, **kw):
        return [float(len(c)) for c in completions]

    trainer = GRPOTrainer(
        model=tiny_llama(tokenizer),
        reward_funcs=length_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["the cat", "a dog"]}),
        processing_class=tokenizer,
    )
    out = trainer.train()
    assert math.isfinite(out.training_loss)
    report = mpdoctor.diagnose(trainer, names={id(trainer): "trainer"})
    (trl,) = report.facts.trl
    assert (trl.trainer_class, trl.config_class, trl.ref_model_name) == ("GRPOTrainer", "GRPOConfig", None)
    assert not slugs(report, "error", "warning"), report.to_text()


def kto(tokenizer, tmp_path, model, ref_model) -> KTOTrainer:
    data = Dataset.from_dict({"prompt": ["the cat", "a dog"], "completion": [" sat on the mat", " hello world"], "label": [True, False]})
    args = KTOConfig(**common(tmp_path), use_cpu=True, bf16=False, learning_rate=0.0)
    return KTOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=data, processing_class=tokenizer)


def test_healthy_kto_reference_in_policy_dtype(tokenizer, tmp_path):
    """Healthy recipe (TRL's KTO docs): ``KTOTrainer`` with a reference copy in the policy's dtype."""
    model = tiny_llama(tokenizer)
    trainer = kto(tokenizer, tmp_path, model, copy.deepcopy(model))
    assert math.isfinite(trainer.train().training_loss)
    report = mpdoctor.diagnose(trainer, names={id(trainer): "trainer"})
    (trl,) = report.facts.trl
    assert (trl.trainer_class, trl.ref_model_name) == ("KTOTrainer", "trainer.ref_model")
    assert not slugs(report, "error", "warning"), report.to_text()


def test_kto_reference_in_another_dtype_is_the_same_finding_as_dpo(tokenizer, tmp_path):
    """The reference-dtype rule is TRL's, not DPO's: a bf16 reference beside an fp32 KTO policy draws
    ``trl-ref-model-dtype``, and the in-place cast leaves a reference that scores like the policy (the
    policy's and the reference's log-probabilities of the same batch agree exactly after it)."""
    model = tiny_llama(tokenizer).to(torch.bfloat16).float()  # bf16-representable: the cast back is exact
    trainer = kto(tokenizer, tmp_path, model, copy.deepcopy(model).to(torch.bfloat16))
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        gap = (model(ids).logits - trainer.ref_model(ids).logits.float()).abs().max().item()
    assert gap > 0  # the reference scores the batch differently: its rewards are biased
    report = mpdoctor.diagnose(trainer, names={id(trainer): "trainer"})
    finding = next(f for f in report.findings if f.check == "trl-ref-model-dtype")
    assert finding.severity == "warning"
    finding.fixes[0].apply()
    assert trainer.ref_model.model.embed_tokens.weight.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(model(ids).logits, trainer.ref_model(ids).logits)
    assert math.isfinite(trainer.train().training_loss)
