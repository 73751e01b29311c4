"""What the AMP-loop field cases share: a small regression batch, a model, an fp16 autocast loss, the one
finding of a slug, the norm of the gradients a step applied, and the notebook cells of a bf16 loop that clips
before ``unscale_``."""

from __future__ import annotations

import io

import torch
import torch.nn.functional as F

X = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
Y = torch.randn(32, 1, generator=torch.Generator().manual_seed(2))


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def fp16_loss(model, x=X, y=Y) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    return F.mse_loss(out.float(), y)


def only(w, slug):
    found = [f for f in w.protocol.findings if f.check == slug]
    assert len(found) == 1, w.protocol.findings
    return found[0]


def grad_norm(params) -> float:
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])))


#: A notebook cell: a bf16 model, its optimizer, a GradScaler named ``amp_scaler`` and four batches.
BF16_SETUP_CELL = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(torch.bfloat16)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
amp_scaler = torch.amp.GradScaler("cpu")
data = [torch.randn(16, 4, dtype=torch.bfloat16) for _ in range(4)]
"""
#: A bf16 model's loop that clips before unscale_: the clip is only fixable in code; the scaler is a safe fix at rest.
BF16_CLIP_LOOP_CELL = """
for x in data:
    optimizer.zero_grad()
    loss = model(x).float().pow(2).mean()
    amp_scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    amp_scaler.step(optimizer)
    amp_scaler.update()
"""


# -- a run resumed from a checkpoint (huggingface/transformers PR #11663) --------------------------------------

#: The resumed run's batch: its scaled fp16 loss overflows above a scale of about 2**9.
RESUME_X = torch.ones(8, 8)


def scaled_step(model, opt, scaler) -> torch.Tensor:
    """The user's AMP step: fp16 autocast, ``scaler.scale(loss).backward()``, ``scaler.step``, ``scaler.update``;
    returns the loss (its parameters do not move when the scaler skips the step)."""
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(RESUME_X).sum() * 16
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss.detach()


def checkpoint_after(steps: int = 30, with_scaler: bool = True) -> dict:
    """A checkpoint as ``torch.save`` wrote it after ``steps`` scaled steps (the scale settles at 256), and as
    ``torch.load`` gives it back: plain dicts (``ckpt["scaler"]`` when ``with_scaler``)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(steps):
        scaled_step(model, opt, scaler)
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    if with_scaler:
        ckpt["scaler"] = scaler.state_dict()
    buffer = io.BytesIO()
    torch.save(ckpt, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def resumed(ckpt: dict, load_scaler: bool = False) -> dict:
    """The resume cell: model and optimizer restored from ``ckpt``, a fresh GradScaler (its state loaded only when
    ``load_scaler``), the checkpoint still held under ``ckpt``."""
    model = torch.nn.Linear(8, 1)
    model.load_state_dict(ckpt["model"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt.load_state_dict(ckpt["optimizer"])
    scaler = torch.amp.GradScaler("cpu")
    if load_scaler:
        scaler.load_state_dict(ckpt["scaler"])
    return {"model": model, "opt": opt, "scaler": scaler, "ckpt": ckpt}
