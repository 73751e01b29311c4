"""Intent is evidence: a deliberate fp32 island is not an accident.

A bf16 mixture-of-experts whose router is kept in fp32 and casts its input (as DeepSeek's and Mixtral-style gates
are written) trains; the same router without the cast raises. mpdoctor reads the cast from the source and says
nothing of the first, and names the second as an error. A mixture the probe ran cleanly is at most info.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpdoctor


class CastingRouter(torch.nn.Module):
    """fp32 on purpose: routing decisions in bf16 flip between near-tied experts; its input is cast to fp32."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)


class PlainRouter(CastingRouter):
    """The same router written without the cast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MoE(torch.nn.Module):
    def __init__(self, cast: bool, hidden: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.router = (CastingRouter if cast else PlainRouter)(hidden, experts)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.router(x).softmax(-1).to(x.dtype)
        return sum(weights[..., i : i + 1] * e(x) for i, e in enumerate(self.experts))


class ParentCasts(torch.nn.Module):
    """The parent upcasts the gate's input (``self.gate(h.float())``): the fp32 gate is fed fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.gate = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return h.sum(-1, keepdim=True) * self.gate(h.float()).softmax(-1)[..., :1].to(h.dtype)


def _bf16_with_fp32_island(model: torch.nn.Module, island: torch.nn.Module) -> torch.nn.Module:
    model.to(torch.bfloat16)
    island.to(torch.float32)
    return model


def _step(model: torch.nn.Module) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    loss = model(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).mean()
    loss.backward()
    opt.step()
    return loss.item()


def test_an_fp32_router_that_casts_its_input_trains_and_draws_nothing():
    torch.manual_seed(0)
    model = MoE(cast=True)
    _bf16_with_fp32_island(model, model.router)
    assert torch.isfinite(torch.tensor(_step(model)))  # the island is deliberate: it trains
    report = mpdoctor.diagnose(model)
    assert not report.findings_for("mixed-param-dtypes"), report.to_text()


def test_the_same_router_without_the_cast_raises_and_is_named():
    torch.manual_seed(0)
    model = MoE(cast=False)
    _bf16_with_fp32_island(model, model.router)
    with pytest.raises(RuntimeError, match="dtype"):
        _step(model)  # the real error
    (finding,) = mpdoctor.diagnose(model).findings_for("mixed-param-dtypes")
    assert finding.severity == "error" and "router" in str(finding.evidence["modules"])


def test_a_gate_whose_parent_upcasts_its_input_draws_nothing():
    torch.manual_seed(0)
    model = ParentCasts()
    _bf16_with_fp32_island(model, model.gate)
    _step(model)
    assert not mpdoctor.diagnose(model).findings_for("mixed-param-dtypes")


def test_a_mixture_the_probe_ran_cleanly_is_at_most_info():
    torch.manual_seed(0)

    class Opaque(torch.nn.Module):
        """Casts around its fp32 head in a way no source pattern reads (a helper function)."""

        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(8, 8)
            self.head = torch.nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _through(self.head, self.body(x))

    model = Opaque()
    _bf16_with_fp32_island(model, model.head)
    _step(model)
    assert mpdoctor.diagnose(model).findings_for("mixed-param-dtypes")[0].severity == "error"  # at rest: unknown
    probed = mpdoctor.probe(model, torch.randn(4, 8, dtype=torch.bfloat16))
    found = probed.findings_for("mixed-param-dtypes")
    assert found and all(f.severity == "info" for f in found), probed.to_text()


def _through(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    dtype = next(layer.parameters()).dtype
    return layer(x.to(dtype)).to(x.dtype)
