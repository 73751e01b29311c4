"""Where a NaN is born: each cause reproduced for real on the CPU, named, fixed to match, then trained.

The probe's replay names the op and module that produced the first non-finite value (not only where it
first shows) and why; the fix offered matches the cause.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import mpdoctor
from mpdoctor.attach.numerics.probe import ForwardCall


class HandLayerNorm(nn.Module):
    """A LayerNorm written by hand (as many repos do): it computes, eps included, in its input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-12) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return self.weight * (x - mean) / torch.sqrt(var + self.eps)


class Net(nn.Module):
    def __init__(self, norm: nn.Module | None = None, scale: float = 1.0) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = norm if norm is not None else nn.Identity()
        self.head = nn.Linear(8, 2)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc(x) * self.scale))


def _train_step(
    model: nn.Module, x: torch.Tensor, loss_of=lambda out: out.float().pow(2).mean()
) -> tuple[float, bool]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    loss = loss_of(model(x))
    loss.backward()
    opt.step()
    return float(loss.detach()), any(
        not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters())
    )


def _zero_row_net() -> Net:
    torch.manual_seed(0)
    net = Net(HandLayerNorm(8)).half()
    with (
        torch.no_grad()
    ):  # the first two rows of fc's output are all zero: zero variance, as padding rows are
        net.fc.weight[:] = 0.1
    return net


def _nonfinite(report) -> mpdoctor.Finding:
    return next(f for f in report.findings if f.check == "probe-nonfinite")


def test_eps_1e12_in_fp16_is_named_as_eps_underflow_in_the_norm_and_the_eps_fix_trains():
    net = _zero_row_net()
    x = torch.zeros(4, 8, dtype=torch.float16)
    x[2:] = torch.randn(2, 8, dtype=torch.float16)
    with torch.no_grad():
        net.fc.bias.zero_()
    assert torch.isnan(net(x)).any()  # the real harm: 0/0 on the zero rows

    report = mpdoctor.probe(net, x, name="net", loss_fn=lambda out: out.float().pow(2).mean())
    f = _nonfinite(report)
    assert (
        f.evidence["origin"] == "eps-underflow"
        and f.evidence["module"] == "norm"
        and f.evidence["op"] == "div"
    )
    assert f.evidence["eps"] == 1e-12 and "0 in float16" in f.message
    static = next(g for g in report.findings if g.check == "norm-eps-underflow")
    assert static.severity == "error" and static.evidence["kernel"] == ["dtype"]

    fix = next(fx for fx in f.fixes if fx.recipe == "representable-eps")
    fix.apply()
    assert net.norm.eps == 1e-5
    loss, moved = _train_step(net, x)
    assert math.isfinite(loss) and moved
    fix.undo()
    assert net.norm.eps == 1e-12


def test_an_fp16_overflow_is_born_in_the_op_past_65504_and_the_bf16_cast_trains():
    torch.manual_seed(0)
    net = Net(scale=1e5).half()
    x = torch.randn(4, 8, dtype=torch.float16)
    assert torch.isinf(net.fc(x) * 1e5).any()  # the real harm: x * 1e5 passes 65504

    report = mpdoctor.probe(net, x, name="net", loss_fn=lambda out: out.float().pow(2).mean())
    f = _nonfinite(report)
    assert f.evidence["origin"] == "overflow" and f.evidence["op"] == "mul" and f.evidence["module"] == ""
    assert f.evidence["cause"] == "activation-overflow-fp16" and "its inputs were finite" in f.message
    assert f.evidence["first_shows_in"] == "norm"  # it first shows in the Identity after; born in the parent
    assert f.evidence["max"] == 65504.0
    fix = next(fx for fx in f.fixes if fx.recipe == "bf16")
    fix.apply()
    assert net.fc.weight.dtype == torch.bfloat16
    loss, moved = _train_step(net, x.to(torch.bfloat16))
    assert math.isfinite(loss) and moved


class LogLoss(nn.Module):
    """Binary cross-entropy by hand, inside the model as HF models compute their loss."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, clamp: bool = False) -> torch.Tensor:
        p = torch.sigmoid(self.fc(x)).squeeze(-1)
        if clamp:
            p = p.clamp(1e-3, 1 - 1e-3)
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


def test_log_of_zero_in_a_loss_is_named_and_the_clamp_trains():
    torch.manual_seed(0)
    model = LogLoss().half()
    with torch.no_grad():
        model.fc.weight.fill_(2.0)  # sigmoid saturates to exactly 1.0 in fp16
    x = torch.ones(4, 8, dtype=torch.float16)
    x[2:] *= 0.1  # two rows far from saturation, so the clamped loss still has a gradient
    y = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float16)
    assert not torch.isfinite(model(x, y))  # the real harm: log(1 - 1) = -inf, 0 * -inf = NaN

    report = mpdoctor.probe(model, ForwardCall(x, y), name="model", loss_fn=lambda out: out.float())
    f = _nonfinite(report)
    assert f.evidence["origin"] == "log-nonpositive" and f.evidence["op"] == "log"
    assert "clamp" in f.fixes[0].code
    opt = torch.optim.SGD(
        model.parameters(), lr=0.5
    )  # fp16 weights: a step smaller than 2's ulp would vanish
    before = model.fc.weight.detach().clone()
    loss = model(x, y, clamp=True)  # the fix's clamp
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and not torch.equal(before, model.fc.weight)


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ x.transpose(-1, -2) + mask
        return torch.softmax(scores, -1) @ x


def test_inf_minus_inf_on_a_fully_masked_row_is_named_and_a_finite_mask_trains():
    torch.manual_seed(0)
    model = Masked()
    x = torch.randn(3, 4)
    mask = torch.zeros(3, 3)
    mask[0] = -math.inf  # a fully masked row
    assert torch.isnan(model(x, mask)).any()  # the real harm: softmax computes -inf - (-inf)

    report = mpdoctor.probe(model, ForwardCall(x, mask), name="model")
    f = _nonfinite(report)
    assert f.evidence["origin"] == "inf-minus-inf" and f.evidence["op"] == "softmax"
    assert "finfo" in f.fixes[0].code
    finite = mask.clamp_min(torch.finfo(torch.float32).min)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    before = model.q.weight.detach().clone()
    loss = model(x, finite).pow(2).mean()
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and not torch.equal(before, model.q.weight)


def test_nan_already_in_the_batch_or_in_the_weights_is_named_as_such():
    torch.manual_seed(0)
    net = Net()
    batch = {"x": torch.randn(2, 8)}
    batch["x"][0, 0] = math.nan
    wrapped = nn.ModuleDict({"net": net})

    class ByKey(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = wrapped

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner["net"](x)

    report = mpdoctor.probe(ByKey(), batch, name="model")
    f = _nonfinite(report)
    assert f.evidence["origin"] == "nan-in-batch" and f.evidence["key"] == "x"
    assert "isfinite" in f.fixes[0].code

    with torch.no_grad():
        net.head.weight[0, 0] = math.nan
    report = mpdoctor.probe(net, torch.randn(2, 8), name="net")
    f = _nonfinite(report)
    assert f.evidence["origin"] == "nan-in-weights" and f.evidence["module"] == "head"
    assert f.fixes[0].recipe == "reload-weights"


def test_f_normalize_default_eps_vanishes_in_fp16_and_is_named():
    class Proj(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.normalize(self.fc(x), dim=-1)

    model = Proj().half()
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.bias.zero_()
    x = torch.randn(2, 4, dtype=torch.float16)
    assert torch.isnan(model(x)).all()  # the real harm: 0 / max(0, 1e-12 -> 0)
    f = _nonfinite(mpdoctor.probe(model, x, loss_fn=lambda out: out.float().sum()))
    assert (
        f.evidence["origin"] == "eps-underflow"
        and f.evidence["op"] == "normalize"
        and f.evidence["eps"] == 1e-12
    )


def test_no_eps_finding_in_bf16_nor_an_error_for_torch_kernels_that_add_eps_in_fp32():
    torch.manual_seed(0)
    bf16 = Net(HandLayerNorm(8)).to(torch.bfloat16)
    assert not [
        f for f in mpdoctor.diagnose(bf16).findings if f.check == "norm-eps-underflow"
    ]  # 1e-12 is normal in bf16
    fused = Net(nn.LayerNorm(8, eps=1e-12)).half()
    x = torch.zeros(2, 8, dtype=torch.float16)
    with torch.no_grad():
        fused.fc.weight.zero_()
        fused.fc.bias.zero_()
    assert torch.isfinite(fused(x)).all()  # torch's kernel adds eps in fp32: no NaN on a zero row
    found = [f for f in mpdoctor.diagnose(fused).findings if f.check == "norm-eps-underflow"]
    assert [f.severity for f in found] == ["info"] and not found[0].fixes


def test_a_healthy_probe_replays_nothing_and_reports_no_origin():
    torch.manual_seed(0)
    net = Net(HandLayerNorm(8, eps=1e-5)).half()
    report = mpdoctor.probe(
        net, torch.randn(4, 8, dtype=torch.float16), loss_fn=lambda out: out.float().mean()
    )
    assert report.facts.probes[0].origin is None
    assert not [f for f in report.findings if f.severity in ("error", "warning")]
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in net.modules())


def test_the_eps_fix_sets_the_config_field_too_and_undo_restores_both():
    from transformers import BertConfig

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = BertConfig(hidden_size=8, layer_norm_eps=1e-12)
            self.fc = nn.Linear(8, 8)
            self.norm = HandLayerNorm(8, eps=self.config.layer_norm_eps)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.fc(x))

    model = Encoder().half()
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.bias.zero_()
    x = torch.randn(2, 8, dtype=torch.float16)
    assert torch.isnan(model(x)).all()  # zero-variance rows, eps 0 in fp16
    report = mpdoctor.diagnose(model)
    (finding,) = report.findings_for("norm-eps-underflow")
    assert finding.evidence["config"] == {"layer_norm_eps": 1e-12} and finding.severity == "error"
    (fix,) = finding.fixes
    fix.apply(confirm=True)
    assert model.norm.eps == 1e-5 and model.config.layer_norm_eps == 1e-5
    assert not mpdoctor.diagnose(model).findings_for("norm-eps-underflow")
    with torch.no_grad():
        model.fc.bias.copy_(torch.linspace(-1, 1, 8))  # a trainable signal; the zero-variance rows stay possible
    loss, moved = _train_step(model, x)
    assert math.isfinite(loss) and moved
    fix.undo()
    assert model.norm.eps == 1e-12 and model.config.layer_norm_eps == 1e-12


# -- a NaN born on the user's own line: that code corrected ----------------------------------------------------------


def mean_per_count(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """A user's helper of this file (a script's function): a per-slot mean whose count can reach 0."""
    return total / count


class Pooled(nn.Module):
    def __init__(self, signed: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.signed = signed

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return mean_per_count(self.fc(x).sum(0), counts - 1 if self.signed else counts).sum()


def test_a_division_by_a_count_that_reached_0_in_a_script_function_gets_the_function_corrected_and_it_trains():
    from mpdoctor.attach.runtime.domain_rewrite import clamped_source

    torch.manual_seed(0)
    model = Pooled()
    x, counts = torch.randn(2, 4), torch.tensor([2.0, 0.0, 1.0])  # an empty slot: its count is 0
    assert not torch.isfinite(model(x, counts))  # the real harm

    f = next(f for f in mpdoctor.probe(model, ForwardCall(x, counts), loss_fn=lambda out: out).findings
             if f.check == "probe-nonfinite")  # fmt: skip
    assert f.evidence["origin"] == "zero-division" and f.evidence["line"].startswith("tests/test_nan_origin.py:")
    (fix,) = [fx for fx in f.fixes if fx.recipe == "corrected-cell"]
    assert fix.title.startswith("Replace mean_per_count in tests/test_nan_origin.py")
    assert "return total / count.clamp_min(torch.finfo(count.dtype).tiny)" in fix.code
    namespace: dict = {"torch": torch}
    exec(fix.code, namespace)  # noqa: S102 - the corrected function, as the user pastes it into the file
    assert torch.isfinite(namespace["mean_per_count"](model.fc(x).sum(0), counts)).all()

    # A signed denominator (counts - 1 holds 1, -1 and 0): clamp_min would change its sign, so only the advice stands.
    signed = Pooled(signed=True)
    g = next(f for f in mpdoctor.probe(signed, ForwardCall(x, counts), loss_fn=lambda out: out).findings
             if f.check == "probe-nonfinite")  # fmt: skip
    assert g.evidence["origin"] == "zero-division" and [fx.recipe for fx in g.fixes] == ["zero-division"]

    src = "a = torch.log(p) + torch.log(1 - p)\nb = x.rsqrt()\nc = torch.pow(q, -2)\nd = u / v\ne = torch.log(\n    p)\n"
    assert "torch.log(p.clamp_min(torch.finfo(p.dtype).tiny)) + torch.log((1 - p).clamp_min(" in clamped_source(
        src, 1, 19, 35, "log", "float32", True)  # fmt: skip
    assert "x.clamp_min(torch.finfo(x.dtype).tiny).rsqrt()" in clamped_source(src, 2, None, None, "rsqrt", "float16", True)
    assert "torch.pow(q.clamp_min(torch.finfo(q.dtype).tiny ** (1 / 2)), -2)" in clamped_source(
        src, 3, None, None, "pow", "float32", True)  # fmt: skip
    assert clamped_source(src, 4, None, None, "__truediv__", "float32", False) is None  # signed: not well defined
    assert clamped_source(src, 5, None, None, "log", "float32", True) is None  # a call over two lines


def test_an_op_in_library_code_is_not_offered_as_corrected_code():
    import json

    from mpdoctor.attach.runtime.nan_origin import _users_file

    assert not _users_file(torch.__file__) and not _users_file(json.__file__)
    assert _users_file(__file__)

    class Waiting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            rate = self.fc(x).relu()  # a rate of 0: torch's own log_prob takes rate.log() in its file
            return torch.distributions.Exponential(rate, validate_args=False).log_prob(torch.ones_like(rate)).sum()

    model = Waiting()
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.bias.zero_()
    report = mpdoctor.probe(model, torch.ones(2, 4), loss_fn=lambda out: out)
    f = next(f for f in report.findings if f.check == "probe-nonfinite")
    assert f.evidence["op"] == "log" and f.evidence["line"] == ""  # torch's line, not the user's
    assert all(fx.recipe != "corrected-cell" for fx in f.fixes)
