"""What the AMP-loop field cases share: a small regression batch, a model, an fp16 autocast loss, the one
finding of a slug, the norm of the gradients a step applied."""

from __future__ import annotations

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
