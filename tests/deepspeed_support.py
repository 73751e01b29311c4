"""DeepSpeed on this CPU for the tests: a private extensions dir, the shm op built once, tiny models.

The first ``deepspeed.init_distributed`` compiles ``deepspeed_shm_comm`` (about 100 s). A run killed
during that compile leaves a ``lock`` file and every later start waits forever without a message, so
the tests build into ``build/torch_extensions`` (git-ignored), in a subprocess bounded by a timeout,
and remove a lock that no live build holds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTENSIONS = ROOT / "build" / "torch_extensions"
OP_DIR = EXTENSIONS / "deepspeed_shm_comm"
BUILD_TIMEOUT_S = 480
STALE_LOCK_S = 600


def _built() -> bool:
    return any(OP_DIR.glob("deepspeed_shm_comm*.so"))


def ensure_shm_op() -> None:
    """Build DeepSpeed's shm op once into the private extensions dir (a no-op when it is there)."""
    os.environ["TORCH_EXTENSIONS_DIR"] = str(EXTENSIONS)
    if _built():
        return
    lock = OP_DIR / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink()  # left by a killed build: a later start would wait on it forever
    EXTENSIONS.mkdir(parents=True, exist_ok=True)
    code = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(EXTENSIONS))
    try:
        subprocess.run([sys.executable, "-c", code], env=env, timeout=BUILD_TIMEOUT_S, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except subprocess.TimeoutExpired:
        if lock.exists():
            lock.unlink()
        raise
    assert _built(), "deepspeed_shm_comm did not build"


SINGLE_RANK_ENV = {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}


def free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def tiny_llama():
    """A 1-layer Llama from a config (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    return LlamaForCausalLM(cfg)


def token_dataset(n: int = 4):
    import torch

    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 64, (8,), generator=g), "labels": torch.randint(0, 64, (8,), generator=g)}
            for _ in range(n)]


def training_args(ds_config: dict, tmp_path, **kw):
    """TrainingArguments on the CPU with a DeepSpeed config, one step, no saving or reporting."""
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), deepspeed=ds_config, use_cpu=True, max_steps=1, report_to=[],
                             per_device_train_batch_size=2, save_strategy="no", logging_steps=1, **kw)


def zero_config(stage: int, **extra) -> dict:
    """A DeepSpeed config as the HF docs recommend it: precision and batch sizes left to the arguments."""
    cfg = {
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
    }
    cfg.update(extra)
    return cfg
