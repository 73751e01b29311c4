"""Tiny real training setups built from configs (no downloads), shared by the test suite.

transformers / accelerate / peft are imported inside the builders so that the
Colab-pinned environment (torch + IPython 7.34 + ipywidgets 7.7.1 only) can
import this module.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

VOCAB = 64

#: Script payloads planted in user-controlled strings by the escaping tests.
PAYLOAD = "<img src=x onerror=alert(1)>"
SCRIPT = "<script>alert(1)</script>"


def bf16_model() -> torch.nn.Module:
    """A seeded bf16 MLP (torch only, so the Colab venv's widget tests can use it too)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(
        torch.bfloat16
    )


def tiny_llama(dtype: torch.dtype = torch.float32, train: bool = True, use_cache: bool = True, seed: int = 0):
    """A 2-layer Llama with hidden size 16, in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        use_cache=use_cache,
    )
    model = LlamaForCausalLM(config).to(dtype)
    return model.train(train)


def tiny_gemma3(dtype: torch.dtype = torch.float32, train: bool = True, text_use_cache: bool = True, seed: int = 0):
    """A tiny ``Gemma3ForConditionalGeneration``: its only cache flag is ``config.text_config.use_cache``."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    config = Gemma3Config(
        text_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=VOCAB,
            head_dim=8,
            use_cache=text_use_cache,
        ),
        vision_config=dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
        ),
        mm_tokens_per_image=4,
    )
    model = Gemma3ForConditionalGeneration(config).to(dtype)
    return model.train(train)


def tiny_lora(base_dtype: torch.dtype = torch.bfloat16, seed: int = 0, **lora_kwargs: Any):
    """A PEFT LoRA model on a tiny Llama; PEFT keeps the adapters fp32 by default."""
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(base_dtype, seed=seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, **lora_kwargs)
    return get_peft_model(base, config)


def batch(size: int = 2, length: int = 8, seed: int = 0) -> dict:
    """A causal-LM batch: input_ids and labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, length), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


class TinyDataset(torch.utils.data.Dataset):
    """Eight random token sequences."""

    def __init__(self, n: int = 8, length: int = 8) -> None:
        g = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, VOCAB, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i].clone()}


def training_args(**kwargs: Any):
    """TrainingArguments for a one-step CPU run with no logging or saving."""
    from transformers import TrainingArguments

    defaults = dict(
        output_dir=tempfile.mkdtemp(prefix="mpdoctor-test-"),
        use_cpu=True,
        max_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    defaults.update(kwargs)
    return TrainingArguments(**defaults)


def tiny_trainer(model=None, **kwargs: Any):
    """A real Trainer on a tiny Llama and dataset."""
    from transformers import Trainer

    model = model if model is not None else tiny_llama()
    return Trainer(model=model, args=training_args(**kwargs), train_dataset=TinyDataset())


def train_step(model, optimizer, inputs=None, scaler=None, autocast_dtype=None) -> float:
    """One real optimizer step; returns the loss."""
    inputs = inputs if inputs is not None else batch()
    optimizer.zero_grad()
    if autocast_dtype is not None:
        with torch.autocast("cpu", dtype=autocast_dtype):
            loss = model(**inputs).loss
    else:
        loss = model(**inputs).loss
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    return float(loss)

