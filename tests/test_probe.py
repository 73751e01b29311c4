"""The one-batch probe: it names the module that overflows or raises, and leaves nothing behind."""

from __future__ import annotations

import math

import pytest
import torch
from setups import batch, tiny_llama
from steps import assert_step_trains, snapshot

import mpdoctor
from mpdoctor.attach.numerics.probe_facts import PROBE_COLUMNS, ForwardCall

HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_state_dict_hooks",
)


class Everything:
    """What a probe could leave behind: hooks, grads, modes, RNG, buffers, optimizer and scaler state."""

    def __init__(self, model, optimizer=None, scaler=None) -> None:
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.hooks = self._hooks()
        self.grads = [(p, p.grad, None if p.grad is None else p.grad.clone()) for p in model.parameters()]
        self.modes = [m.training for m in model.modules()]
        self.rng = torch.get_rng_state()
        self.buffers = [b.clone() for b in model.buffers()]
        self.opt = self._optimizer_state()
        self.scale = (scaler._scale.clone(), scaler._growth_tracker.clone()) if scaler is not None else None

    def _hooks(self):
        return [{k: list(getattr(m, k, {})) for k in HOOK_DICTS} for m in self.model.modules()]

    def _optimizer_state(self):
        if self.optimizer is None:
            return None
        return [(k, v.clone()) for s in self.optimizer.state.values() for k, v in s.items() if torch.is_tensor(v)]

    def assert_unchanged(self) -> None:
        assert self._hooks() == self.hooks
        for p, grad, value in self.grads:
            assert p.grad is grad  # the very same object (or still None): nothing accumulated into it
            if value is not None:
                assert torch.equal(p.grad, value)
        assert [m.training for m in self.model.modules()] == self.modes
        assert torch.equal(torch.get_rng_state(), self.rng)
        assert all(torch.equal(a, b) for a, b in zip(self.buffers, self.model.buffers()))
        if self.optimizer is not None:
            assert all(k == k2 and torch.equal(v, v2) for (k, v), (k2, v2) in zip(self.opt, self._optimizer_state()))
        if self.scaler is not None:
            assert torch.equal(self.scaler._scale, self.scale[0])
            assert torch.equal(self.scaler._growth_tracker, self.scale[1])


def _one_step(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(**batch()).loss.backward()
    opt.step()
    model(**batch(seed=1)).loss.backward()  # leave grads in place for the probe not to touch
    return opt


def test_probe_names_the_first_module_whose_output_passes_fp16_range_and_reports_it_per_module():
    model = tiny_llama(use_cache=False)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1e9)
    report = mpdoctor.probe(model, batch())
    (finding,) = report.findings_for("probe-overflow")
    assert finding.subject == "model.model.layers.1.mlp.down_proj"
    assert finding.severity == "info"  # fp32 run: only fp16 would overflow
    table = report.probe_table
    assert list(table.columns) == PROBE_COLUMNS
    row = table.set_index("module").loc["model.model.layers.1.mlp.down_proj"]
    assert row["class"] == "Linear" and row.out_absmax > 65504 and row.fp16_headroom < 1
    assert row.output_dtypes == "float32" and row.grad_dtypes == "float32" and row.grad_absmax > 0
    order = list(table.module)
    assert order[0] == "model" and order.index("model.model.embed_tokens") < order.index("model.model.layers.0")


def _backward_amplifier():
    """A real Llama whose forward stays within fp16 (logits ~2.6e3) but whose lm_head, 10,000x too large,
    turns a loss-scaled gradient of 2**15 into ~2e6 on its way back into the final norm."""
    model = tiny_llama(use_cache=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(1e4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**15)
    scaler.scale(torch.ones(()))  # the scale tensor exists, as after a first step
    return model, scaler


def test_a_gradient_that_passes_fp16_range_only_in_backward_is_named_with_its_module():
    model, scaler = _backward_amplifier()
    report = mpdoctor.probe(model, batch(), scaler=scaler)
    (finding,) = report.findings_for("probe-overflow")
    assert finding.subject == "model.model.norm" and finding.evidence["phase"] == "backward"
    assert finding.evidence["absmax"] > 65504 and "scaled by the loss scale" in finding.message
    table = report.probe_table.set_index("module")
    assert table.out_absmax.max() < 65504  # the forward alone would have looked healthy
    assert table.loc["model.lm_head", "grad_absmax"] < 65504 < table.loc["model.model.norm", "grad_absmax"]


def test_under_fp16_autocast_the_backward_overflow_is_named_as_the_first_non_finite_gradient():
    model, scaler = _backward_amplifier()
    everything = Everything(model, scaler=scaler)
    report = mpdoctor.probe(model, batch(), scaler=scaler, autocast=torch.float16)
    everything.assert_unchanged()
    (finding,) = report.findings_for("probe-nonfinite")
    assert finding.subject == "model.model.norm" and finding.evidence["phase"] == "backward"
    table = report.probe_table.set_index("module")
    assert table.out_nonfinite.sum() == 0 and table.loc["model.lm_head", "grad_nonfinite"] == 0
    assert table.loc["model.model.norm", "grad_nonfinite"] > 0
    assert report.facts.probes[0].loss_scale == 2.0**15


def test_under_fp16_autocast_the_same_layer_is_named_as_the_first_non_finite_from_finite_inputs():
    model = tiny_llama(use_cache=False)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1e9)
    report = mpdoctor.probe(model, batch(), autocast=torch.float16)
    (finding,) = report.findings_for("probe-nonfinite")
    assert finding.subject == "model.model.layers.1.mlp.down_proj" and finding.severity == "error"
    assert finding.evidence["phase"] == "forward" and finding.evidence["input_nonfinite"] == 0
    assert finding.evidence["output_dtypes"] == ["float16"] and finding.evidence["weight_nonfinite"] == 0
    assert report.facts.probes[0].autocast == "float16"


def test_the_accelerator_path_queues_statistics_and_reads_them_once_with_the_same_verdict(monkeypatch):
    from mpdoctor.attach.numerics import probe as probe_module

    model = tiny_llama(use_cache=False)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1e9)
    eager = mpdoctor.probe(model, batch(), autocast=torch.float16)
    monkeypatch.setattr(probe_module._Stats, "EAGER", frozenset())  # as on a GPU: nothing read until the end
    queued = mpdoctor.probe(model, batch(), autocast=torch.float16)
    assert [f.subject for f in queued.findings] == [f.subject for f in eager.findings]
    cols = ["module", "out_absmax", "out_nonfinite", "grad_nonfinite", "param_grad_nonfinite"]
    assert queued.probe_table[cols].equals(eager.probe_table[cols])
    inputs_measured = [sum(m.in_absmax is not None for m in r.facts.probes[0].modules) for r in (queued, eager)]
    assert inputs_measured[0] > inputs_measured[1]  # on the CPU only where an output went bad


def test_no_probe_table_column_is_empty_on_a_healthy_cpu_run():
    table = mpdoctor.probe(tiny_llama(use_cache=False), batch()).probe_table
    assert list(table.columns) == PROBE_COLUMNS
    assert [c for c in table.columns if table[c].isna().all() or (table[c] == "").all()] == []


def test_an_inf_weight_is_named_with_its_own_weights_as_the_cause():
    model = tiny_llama(use_cache=False)
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight[3, 5] = math.inf
    (finding,) = mpdoctor.probe(model, batch()).findings_for("probe-nonfinite")
    assert finding.subject == "model.model.layers.0.self_attn.v_proj"
    assert finding.evidence["weight_nonfinite"] == 1 and "own weights" in finding.message


def test_a_dtype_error_is_attributed_to_the_module_running_and_nothing_is_left_behind():
    model = tiny_llama(use_cache=False)
    opt = _one_step(model)
    model.model.layers[1].mlp.to(torch.bfloat16)  # fp32 activations meet bf16 weights, no autocast
    model.eval()
    model.model.layers[0].train()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    everything = Everything(model, opt, scaler)

    report = mpdoctor.probe(model, batch(), scaler=scaler, name="llm")

    everything.assert_unchanged()
    (finding,) = report.findings_for("probe-dtype-error")
    assert finding.subject == "llm.model.layers.1.mlp.gate_proj"
    with pytest.raises(RuntimeError) as raised:  # the text torch gives for this very mismatch
        model.model.layers[1].mlp.gate_proj(torch.ones(2, 8, 16))
    assert str(raised.value) in finding.message and "same dtype" in finding.message
    assert "Traceback" not in finding.message and "\n" not in finding.message
    assert finding.evidence["input_dtypes"] == ["float32"] and finding.evidence["param_dtypes"] == ["bfloat16"]
    assert report.facts.probes[0].backward is False


def test_field_case_5_a_bf16_linear_feeding_an_fp32_linear_is_named_with_torchs_message():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8).to(torch.bfloat16), torch.nn.Linear(8, 2))
    (finding,) = mpdoctor.probe(model, torch.ones(3, 8, dtype=torch.bfloat16)).findings_for("probe-dtype-error")
    assert finding.subject == "model.1"
    assert "mat1 and mat2 must have the same dtype, but got BFloat16 and Float" in finding.message


class _FusedLoRA(torch.autograd.Function):
    """A fused kernel in the style of FIELD-CASES #5: its backward forgets to cast the fp32 weight."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(weight)
        return x @ weight.to(x.dtype).t()

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad @ weight, None  # bf16 grad meets fp32 weight


class _Adapter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8))  # fp32 adapter on a bf16 model

    def forward(self, x):
        return _FusedLoRA.apply(x, self.weight)


def test_a_dtype_error_raised_in_backward_is_attributed_to_the_module_the_gradient_had_reached():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _Adapter(), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    model[1].float()
    everything = Everything(model)
    (finding,) = mpdoctor.probe(model, torch.ones(3, 8, dtype=torch.bfloat16)).findings_for("probe-dtype-error")
    everything.assert_unchanged()
    assert finding.subject == "model.1" and finding.evidence["phase"] == "backward"
    assert "same dtype" in finding.message


def test_a_clean_probe_with_dropout_restores_grads_modes_rng_running_stats_optimizer_and_scaler():
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    model[0].weight.grad = None  # one parameter without a grad, the others with one
    model.eval()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))
    x = torch.randn(4, 8)
    everything = Everything(model, opt, scaler)

    report = mpdoctor.probe(model, x, scaler=scaler)

    everything.assert_unchanged()
    probe = report.facts.probes[0]
    assert probe.backward and probe.loss_scale == 1024.0 and report.ok
    rows = report.probe_table.set_index("module")
    assert rows.loc["model.3", "param_grad_absmax"] > 0  # grads were computed, then the user's put back
    assert rows.loc["model.1", "calls"] == 1


@pytest.mark.parametrize(
    "make_batch",
    [
        lambda x: x,  # one tensor
        lambda x: (x,),  # positional arguments
        lambda x: {"input": x},  # keyword arguments
        lambda x: ForwardCall(x),
    ],
)
def test_every_dataloader_batch_shape_is_accepted(make_batch):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    report = mpdoctor.probe(model, make_batch(torch.ones(2, 4)))
    assert report.facts.probes[0].backward and report.facts.probes[0].error is None


def test_the_accelerators_autocast_is_the_one_probed():
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, mixed_precision="bf16")
    model = tiny_llama(use_cache=False)
    report = mpdoctor.probe(model, batch(), setup=acc)
    probe = report.facts.probes[0]
    assert (probe.autocast, probe.autocast_source) == ("bfloat16", "accelerator")
    q = report.probe_table.set_index("module").loc["model.model.layers.0.self_attn.q_proj"]
    assert q.output_dtypes == "bfloat16" and q.param_dtypes == "float32"


def test_refresh_probes_the_same_batch_again():
    model = tiny_llama(use_cache=False)
    first = mpdoctor.probe(model, batch())
    with torch.no_grad():
        model.lm_head.weight[0, 0] = math.nan
    again = first.refresh()
    assert again.findings_for("probe-nonfinite")[0].subject == "model.lm_head"
    assert again.probe_table is not None


def test_magic_probe_runs_on_a_batch_variable():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext mpdoctor", store_history=False)
    model = tiny_llama(use_cache=False)
    with torch.no_grad():
        model.model.norm.weight[0] = math.inf
    shell.user_ns.update({"model": model, "batch": batch()})
    try:
        shell.run_cell("r = %mpdoctor model --probe batch --text", store_history=False)
        report = shell.user_ns["r"]
        assert report.findings_for("probe-nonfinite")[0].subject == "model.model.norm"
    finally:
        for name in ("model", "batch", "r"):
            shell.user_ns.pop(name, None)
        shell.run_cell("%unload_ext mpdoctor", store_history=False)


def test_the_probes_fixes_are_planned_so_applying_them_in_order_makes_its_batch_train():
    # An fp16 model whose first layer was left fp32, fed fp32: the cast alone would trade one dtype error for the next.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    model[2].half()
    model[3].half()
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="same dtype"):
        model(x)
    report = mpdoctor.probe(model, x)
    assert {"mixed-param-dtypes", "probe-dtype-error"} <= {f.check for f in report.findings}
    assert report.fixes and all(fx.planned for fx in report.fixes)
    assert report.proof is not None and report.proof.dropped == ()
    for fx in report.fixes:
        fx.apply()
    params = list(model.parameters())
    before = snapshot(params)
    loss = model(x).float().square().mean()
    loss.backward()
    torch.optim.SGD(params, lr=0.1).step()
    assert_step_trains(loss, before, params)


class _AddOne(torch.nn.Module):
    def forward(self, x):
        return x + 1  # autograd saves nothing of an add


class _Triple(torch.nn.Module):
    def forward(self, x):
        return x * 3  # nor of a product by a number


def test_the_probe_keeps_no_activation_alive_that_the_model_itself_drops_and_still_reads_a_repeat_once():
    """An activation autograd does not save is freed while the forward goes on, as without the probe: the probe
    remembers what it measured by weak reference (a strong one kept every activation of the forward alive)."""
    import weakref

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _AddOne(), _Triple(), torch.nn.Linear(8, 8))
    seen: dict = {}
    model[1].register_forward_hook(lambda m, a, out: seen.update(added=weakref.ref(out)))
    model[3].register_forward_pre_hook(lambda m, a: seen.update(alive=seen["added"]() is not None))
    model(torch.randn(4, 8)).sum().backward()
    assert seen["alive"] is False  # the model alone frees it before the last Linear runs
    model.zero_grad(set_to_none=True)
    report = mpdoctor.probe(model, torch.randn(4, 8))
    assert seen["alive"] is False
    assert not report.findings and len(report.probe_table) == 5

    # the dedupe still holds: a model returning its head's output twice has it read once
    from mpdoctor.attach.numerics import probe as probe_module

    reads = []
    real = probe_module._Stats.add

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.head(x)
            return y.sum(), y

    def counting(self, t):
        n = len(self.slots)
        slot = real(self, t)
        if len(self.slots) > n:
            reads.append(t.shape)
        return slot

    probe_module._Stats.add = counting
    try:
        probe_module.run_probe(Twice(), torch.randn(4, 8))
    finally:
        probe_module._Stats.add = real
    assert reads.count(torch.Size([4, 8])) == 2  # the head's output once in forward, its gradient once in backward


def test_the_probe_reads_each_weight_gradient_as_backward_makes_it_and_keeps_none_alive_past_its_read():
    """The user's ``.grad`` tensors stay alive while the probe runs (they come back by identity), so a probe that
    kept its own gradients to the end held the gradients twice: each is now read when backward has accumulated
    it and dropped at once. The figures are those of a plain backward, and a DDP model keeps the late read."""
    import weakref

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    x = torch.randn(8, 16)
    model(x).mean().backward()  # the user's own gradients: the probe's backward makes the same values
    params = list(model.parameters())
    users = [p.grad for p in params]
    expected = [max(m.weight.grad.abs().max().item(), m.bias.grad.abs().max().item()) for m in model]
    made: list = []  # weak references to each gradient the probe's backward makes, in the order it makes them
    alive_when_last_made: list = []

    def watch(p):  # registered before the probe's hooks, so it runs first
        made.append(weakref.ref(p.grad))
        if len(made) == len(params):
            alive_when_last_made.append(sum(ref() is not None for ref in made))

    handles = [p.register_post_accumulate_grad_hook(watch) for p in params]
    try:
        report = mpdoctor.probe(model, x, loss_fn=lambda out: out.mean())
    finally:
        for h in handles:
            h.remove()
    assert len(made) == len(params)
    assert alive_when_last_made == [1]  # only the gradient being read; the probe used to hold all 8 here
    assert all(p.grad is g for p, g in zip(params, users))
    table = report.probe_table.set_index("module")
    assert [table.loc[f"model.{i}", "param_grad_absmax"] for i in range(4)] == pytest.approx(expected, rel=0, abs=0)
    assert (table["param_grad_nonfinite"] == 0).all() and report.facts.probes[0].grads_trained

    from mpdoctor.attach.numerics.probe import _early_grads_ok

    ddp_named = [("", type("DistributedDataParallel", (torch.nn.Module,), {})())]
    assert _early_grads_ok(list(model.named_modules()), params)
    assert not _early_grads_ok(ddp_named + list(model.named_modules()), params)
