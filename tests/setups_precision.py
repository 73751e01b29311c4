"""Helpers for the optimizer / precision / hardware check tests: exact snapshots and compute-dtype probes."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

ENV = "ACCELERATE_MIXED_PRECISION"


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Run each test on one intra-op thread, then restore the count.

    The models are tiny, so a second thread only adds OpenMP hand-offs; on a 2-core machine shared by
    parallel test runs those hand-offs stall (a 10 ms forward/backward measured at up to 1 s).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tensor_snapshot(*objects: Any) -> dict:
    """Every parameter, grad and optimizer state tensor of ``objects``, by identity, with a copy of its bytes.

    Identity is part of the snapshot: a fix that replaced a Parameter object shows up as a difference.
    """
    snap: dict = {}
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for name, p in obj.named_parameters():
                snap[("param", id(obj), name)] = (id(p), p.dtype, p.detach().clone())
                if p.grad is not None:
                    snap[("grad", id(obj), name)] = (id(p.grad), p.grad.dtype, p.grad.detach().clone())
        elif isinstance(obj, torch.optim.Optimizer):
            for gi, group in enumerate(obj.param_groups):
                for pi, p in enumerate(group["params"]):
                    snap[("opt_param", id(obj), gi, pi)] = (id(p),)
                    for key, value in obj.state.get(p, {}).items():
                        if torch.is_tensor(value):
                            snap[("state", id(obj), gi, pi, key)] = (id(value), value.dtype, value.clone())
                        else:
                            snap[("state", id(obj), gi, pi, key)] = (value,)
    return snap


def assert_same_snapshot(before: dict, after: dict) -> None:
    """Equal keys, identities, dtypes and bytes (``torch.equal`` with NaN-safe byte comparison)."""
    assert before.keys() == after.keys()
    for key, old in before.items():
        new = after[key]
        if torch.is_tensor(old[-1]):
            assert old[:-1] == new[:-1], key  # same object, same dtype
            a, b = old[-1].reshape(-1), new[-1].reshape(-1)
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), key
        else:
            assert old == new, key


@contextlib.contextmanager
def compute_dtypes(model: torch.nn.Module) -> Iterator[list]:
    """Record the output dtype of the first Linear of ``model`` (what it computes in) for every forward."""
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    seen: list = []
    handle = linear.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    try:
        yield seen
    finally:
        handle.remove()


def accelerate_snapshot(trainer: Any) -> dict:
    """The precision-relevant state of a Trainer, its accelerator, optimizer, model and the environment."""
    acc = trainer.accelerator
    opt = trainer.optimizer
    model = trainer.model
    scaler = acc.__dict__.get("scaler")
    return {
        "args": {k: trainer.args.__dict__.get(k) for k in ("fp16", "bf16", "mixed_precision")},
        "env": os.environ.get(ENV),
        "state": acc.state.__dict__.get("_mixed_precision"),
        "native_amp": acc.__dict__.get("native_amp"),
        "scaler": (id(scaler), scaler.__dict__.get("_enabled")) if scaler is not None else None,
        "optimizer": None if opt is None else {k: opt.__dict__.get(k) for k in ("scaler", "_optimizer_patched_step_method")},
        "model_dict": {k: model.__dict__.get(k, "absent") for k in ("forward", "_original_forward")},
    }


def clean_optimizer_view(optimizer: Any) -> list[int]:
    """Ids of the parameters an optimizer holds, in order."""
    return [id(p) for g in optimizer.param_groups for p in g["params"]]
