"""``mpdoctor.watch`` in a hand-written training loop."""

from __future__ import annotations

import pytest
import torch

import mpdoctor
from mpdoctor.attach.training.watch import NonFiniteLoss

pytestmark = pytest.mark.colab


class Regressor(torch.nn.Module):
    """Returns its loss, as Hugging Face models do when given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        return {"loss": torch.nn.functional.mse_loss(self.body(x), y)}


def shown(capsys) -> str:
    """What watch showed: stderr in plain Python, IPython's display (stdout) when a shell exists."""
    captured = capsys.readouterr()
    return captured.out + captured.err


def hooks_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
    return (dict(model._forward_hooks), dict(model._forward_pre_hooks), dict(optimizer._optimizer_step_pre_hooks))


def test_a_crash_in_the_block_is_explained_and_still_raised_and_every_hook_is_removed(capsys):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="mat1 and mat2 must have the same dtype"):
        with mpdoctor.watch(model, optimizer) as w:
            model(torch.randn(2, 4)).sum().backward()
    assert w.crash_report.cause.check == "mixed-param-dtypes"
    assert ">> cause of RuntimeError" in shown(capsys)
    assert hooks_of(model, optimizer) == ({}, {}, {})


class _HalfHead(torch.nn.Module):
    """An fp32 layer feeding a bf16 one inside the user's own forward, through a local activation."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 4).to(torch.bfloat16)

    def forward(self, x):
        hidden = self.body(x)
        return self.head(hidden)


def test_an_activation_local_to_the_users_forward_is_not_taken_for_the_batch(capsys):
    # The forward's local ``hidden`` is the fp32 layer's output: the mistake is the mixed model, not a batch entry.
    model = _HalfHead()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="mat1 and mat2 must have the same dtype"):
        with mpdoctor.watch(model, optimizer) as w:
            model(torch.randn(2, 4)).sum().backward()
    assert w.crash_report.cause.check == "mixed-param-dtypes"
    assert not w.crash_report.findings_for("batch-dtype-mismatch")
    assert hooks_of(model, optimizer) == ({}, {}, {})


def test_the_setup_is_diagnosed_before_the_first_optimizer_step(capsys):
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    w = mpdoctor.watch(model, optimizer, scaler)
    assert w.start_report is None
    model(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    optimizer.step()
    assert w.start_report.findings_for("scaler-with-bf16")
    assert "mpdoctor before the first optimizer step" in shown(capsys)
    optimizer.step()
    assert shown(capsys) == ""  # once, not at every step
    w.close()
    assert hooks_of(model, optimizer) == ({}, {}, {})


def test_the_first_non_finite_loss_is_probed_before_the_step_and_names_the_layer(capsys):
    torch.manual_seed(0)
    model = Regressor()
    with torch.no_grad():
        model.body[0].weight.fill_(1e38)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteLoss):
        with mpdoctor.watch(model, optimizer, stop_on_nonfinite=True) as w:
            loss = model(torch.full((2, 4), 1e10), torch.zeros(2, 1))["loss"]
            loss.backward()
            optimizer.step()
    assert w.events == [{"step": 1, "event": "nonfinite-loss", "detail": "loss = nan"}]
    finding = w.probe_report.findings_for("probe-nonfinite")[0]
    assert finding.subject == "model.body.0"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the step never ran
    assert hooks_of(model, optimizer) == ({}, {}, {})


def test_a_loss_computed_outside_the_model_is_watched_through_observe():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(1e38)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with mpdoctor.watch(model, optimizer) as w:
        loss = w.observe(torch.nn.functional.mse_loss(model(torch.full((2, 4), 1e10)), torch.zeros(2, 1)))
        loss.backward()
        optimizer.step()
    assert w.probe_report.findings_for("probe-nonfinite")[0].subject == "model.0"


def test_a_healthy_loop_is_silent(capsys):
    model = Regressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with mpdoctor.watch(model, optimizer) as w:
        for _ in range(3):
            model(torch.randn(2, 4), torch.zeros(2, 1))["loss"].backward()
            optimizer.step()
            optimizer.zero_grad()
    assert w.start_report.ok and w.probe_report is None and w.events == []
    assert shown(capsys) == ""


def test_an_accelerate_prepared_optimizer_is_watched_through_the_optimizer_it_wraps(capsys):
    # AcceleratedOptimizer subclasses torch.optim.Optimizer without its hook tables: registering a step
    # pre-hook on it raises AttributeError ('_optimizer_step_pre_hooks'); watch hooks the wrapped optimizer.
    from accelerate import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = Regressor()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(AttributeError, match="_optimizer_step_pre_hooks"):
        optimizer.register_step_pre_hook(lambda *a: None)
    with torch.no_grad():
        model.body[0].weight.fill_(1e38)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteLoss):
        with mpdoctor.watch(model, optimizer, stop_on_nonfinite=True) as w:
            accelerator.backward(model(torch.full((2, 4), 1e10), torch.zeros(2, 1))["loss"])
            optimizer.step()
    assert w.start_report is not None and w.events[0]["event"] == "nonfinite-loss"
    assert w.probe_report.findings_for("probe-nonfinite")[0].subject == "model.body.0"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the step never ran
    assert hooks_of(model, optimizer.optimizer) == ({}, {}, {})
    accelerator.free_memory()


def test_a_healthy_accelerate_loop_is_silent_and_steps(capsys):
    from accelerate import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = Regressor()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    first = model.body[0].weight.detach().clone()
    with mpdoctor.watch(model, optimizer) as w:
        for _ in range(3):
            accelerator.backward(model(torch.randn(2, 4), torch.zeros(2, 1))["loss"])
            optimizer.step()
            optimizer.zero_grad()
    assert w._steps == 3 and w.start_report.ok and w.events == []
    assert not torch.equal(first, model.body[0].weight)
    assert shown(capsys) == ""
    assert hooks_of(model, optimizer.optimizer) == ({}, {}, {})
    accelerator.free_memory()


def test_findings_evidence_and_fix_code_use_the_names_the_loop_holds_its_objects_by(capsys):
    net = torch.nn.Linear(4, 4).to(torch.bfloat16)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    amp_scaler = torch.amp.GradScaler("cpu")
    w = mpdoctor.watch(net, opt, amp_scaler)
    assert w.object_names == {"model": "net", "optimizer": "opt", "scaler": "amp_scaler"}
    net(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    w.close()
    (finding,) = w.start_report.findings_for("scaler-with-bf16")
    assert finding.subject == "amp_scaler"
    assert "amp_scaler" in finding.message + str(finding.evidence) + "".join(fx.code for fx in finding.fixes)
    names = {s.name for s in w.start_report.facts.subjects}
    assert {"net", "opt", "amp_scaler"} <= names and not {"model", "optimizer", "scaler"} & names
    assert "amp_scaler" in shown(capsys)
