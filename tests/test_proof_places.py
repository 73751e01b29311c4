"""Fixes proven where mpdoctor holds the failing step: the cell that raised, the batch watch() held, the probe's batch.

Each place: the real error first, the diagnosis, the plan checked on that step with everything it touches restored
(fingerprints: parameters, gradients, optimizer state, RNG streams, the data iterator's position), then the fix
applied and the user's own step training.
"""

from __future__ import annotations

import ast
import random

import pytest
import torch
from fingerprint import fingerprint, values_only
from notebook_shell import loaded_shell
from steps import assert_step_trains, snapshot

import mpdoctor
from mpdoctor.diagnosis.replay import refusal

pytestmark = pytest.mark.colab


def _iterator_position(it) -> int:
    """How many items a list iterator or a DataLoader iterator has handed out (read, not advanced)."""
    if hasattr(it, "_num_yielded"):
        return it._num_yielded
    return it.__reduce__()[-1]


_SETUP = """
import torch
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
adam = torch.optim.Adam(net.parameters(), lr=1e-2)
data = torch.utils.data.TensorDataset(torch.randn(12, 8))
batches = iter(torch.utils.data.DataLoader(data, batch_size=4))
batch = torch.randn(4, 8)
seen = []
for _ in range(2):  # Adam's moments exist, the RNG has moved
    adam.zero_grad(); net(batch).float().pow(2).mean().backward(); adam.step()
net[2].to(torch.bfloat16)  # the head is cast to bf16: the next step raises
"""

_STEP_ON_BATCH = """
adam.zero_grad()
loss = net(batch).float().pow(2).mean()
seen.append(loss.item())
loss.backward()
adam.step()
loss
"""

_STEP_ON_NEXT = """
(x,) = next(batches)
adam.zero_grad()
loss = net(x).float().pow(2).mean()
loss.backward()
adam.step()
"""

_NAMES = ("torch", "net", "adam", "data", "batches", "batch", "seen", "loss", "r", "x", "_")


def _state(ns: dict) -> dict:
    return values_only(fingerprint({k: ns[k] for k in ("net", "adam", "batch", "seen")}))


# -- the crash cell ------------------------------------------------------------------------------------------------


def test_the_cell_that_raised_is_replayed_to_prove_the_fix_then_the_widget_applies_it_and_the_cell_trains(capsys):
    with loaded_shell(_NAMES) as sh:
        sh.run_cell(_SETUP, store_history=True)
        result = sh.run_cell(_STEP_ON_BATCH, store_history=True)
        assert isinstance(result.error_in_exec, RuntimeError)  # the real error first
        assert "must have the same dtype" in str(result.error_in_exec)
        cell = sh.execution_count - 1
        ns = sh.user_ns
        before, rng = _state(ns), torch.get_rng_state()
        random.seed(3)
        py_rng = random.getstate()
        capsys.readouterr()

        sh.run_cell("r = %mpdoctor net adam --text", store_history=True)
        report = ns["r"]
        # the diagnosis, proven on the cell: it raised before the fix, trained after it
        assert "mixed-param-dtypes" in {f.check for f in report.findings}
        assert report.proof.step == f"cell [{cell}]"
        assert not report.proof.before.ran and report.proof.verified
        assert f"Plan verified on your step (cell [{cell}])" in capsys.readouterr().out
        assert report.proof.label(report.fixes[0]).startswith("verified on your step")
        # the replay left everything as it was: parameters, grads, Adam's moments, the list the cell appends to,
        # the random streams, and no name the replay bound (loss) is left behind
        assert _state(ns) == before and ns["seen"] == []
        assert torch.equal(torch.get_rng_state(), rng) and random.getstate() == py_rng
        assert "loss" not in ns
        assert report.view.data["proof"]["verified"] is True

        rw = report.widget()
        rw.confirm_delay = 0.0
        assert any("verified on your step" in html for html in rw.html_values())
        rw.buttons("Cast 2 parameters")[0].click()  # the fix through the widget's button
        assert net_dtype(ns) == torch.float32

        params = list(ns["net"].parameters())
        start = snapshot(params)
        sh.run_cell(_STEP_ON_BATCH, store_history=True)  # the user's own cell, run again: it trains
        assert_step_trains(ns["loss"], start, params)


def net_dtype(ns: dict) -> torch.dtype:
    return ns["net"][2].weight.dtype


def test_a_cell_that_reads_a_data_iterator_is_not_replayed_and_the_iterator_stays_where_it_was(capsys):
    with loaded_shell(_NAMES) as sh:
        sh.run_cell(_SETUP, store_history=True)
        result = sh.run_cell(_STEP_ON_NEXT, store_history=True)
        assert isinstance(result.error_in_exec, RuntimeError)  # the real error, on the first batch
        ns = sh.user_ns
        position = _iterator_position(ns["batches"])
        assert position == 1
        before = _state(ns)
        capsys.readouterr()

        sh.run_cell("r = %mpdoctor net adam --text", store_history=True)
        report = ns["r"]
        assert report.proof.refused.startswith("the cell reads a data iterator (next(...), line 1)")
        assert not report.proof.verified and report.proof.before is None
        out = capsys.readouterr().out
        assert "Fixes not verified on your step (cell [" in out and "reads a data iterator" in out
        # nothing was replayed: the iterator hands out the batch it would have, the rest is as it was
        assert _iterator_position(ns["batches"]) == position and _state(ns) == before

        fix = report.fixes[0]
        fix.apply()  # the fix through the API, unproven but offered
        params = list(ns["net"].parameters())
        start = snapshot(params)
        sh.run_cell(_STEP_ON_NEXT, store_history=True)  # the user's cell again: the second batch, and it trains
        assert _iterator_position(ns["batches"]) == 2
        assert_step_trains(ns["loss"], start, params)


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("x = next(it)\nmodel(x).sum().backward()", "the cell reads a data iterator (next(...), line 1)"),
        ("for x in loader:\n    model(x).sum().backward()", "the cell reads a data iterator (a loop over loader, line 1)"),
        ("for i, x in enumerate(it):\n    model(x).sum().backward()", "the cell reads a data iterator (a loop over it"),
        ("model = torch.nn.Linear(4, 4)\nmodel(x).sum().backward()", "the cell builds model anew (line 1)"),
        ("get_ipython().run_line_magic('time', 'model(x)')", "the cell runs IPython magics"),
        ("for _ in range(3):\n    model(x).sum().backward()", ""),
        ("for x in xs:\n    model(x).sum().backward()", ""),  # a list: iterating it consumes nothing
    ],
)
def test_what_a_cell_replay_refuses_is_read_from_its_source_and_the_objects_its_names_hold(source, reason):
    xs = [torch.randn(2, 4)]
    ns = {"model": torch.nn.Linear(4, 4), "x": xs[0], "xs": xs, "it": iter(xs),
          "loader": torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 4)), batch_size=2)}  # fmt: skip
    got = refusal(ast.parse(source), ns)
    assert got.startswith(reason) and bool(got) == bool(reason), got


# -- the watched loop ----------------------------------------------------------------------------------------------


def _watched_setup(scaler=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = [torch.randn(4, 8) for _ in range(4)]
    for x in data[:2]:  # Adam's moments exist, the scaler's scale and growth tracker too
        _loop_step(model, opt, x, scaler)
    model[2].to(torch.bfloat16)
    return model, opt, data


def _loop_step(model, opt, x, scaler=None):
    opt.zero_grad()
    loss = model(x).float().pow(2).mean()
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return loss


def test_watch_proves_the_fix_on_the_batch_it_held_leaves_the_run_as_it_was_and_the_next_step_trains():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    model, opt, data = _watched_setup(scaler)
    it = iter(data)
    w = mpdoctor.watch(model, opt, scaler)
    try:
        x = next(it)
        exc = _raised(lambda: _loop_step(model, opt, x, scaler))
        assert isinstance(exc, RuntimeError) and "must have the same dtype" in str(exc)  # the real error, in the loop
        ns = {"model": model, "opt": opt, "scaler": scaler}
        before, rng, position = values_only(fingerprint(ns)), torch.get_rng_state(), _iterator_position(it)
        history = list(w.scale_history)
        report = w.explain(exc, exc.__traceback__)  # what leaving the watched block runs
        # parameters, grads, Adam's moments, the scaler's scale and tracker, the RNG, the data: all as they were;
        # the watch saw none of the proof's steps
        assert values_only(fingerprint(ns)) == before
        assert torch.equal(torch.get_rng_state(), rng) and _iterator_position(it) == position
        assert w.scale_history == history and w._steps == 0
        assert "mixed-param-dtypes" in {f.check for f in report.findings}
        # mpdoctor's own step on the held batch, not the user's loop: checked, never called verified on the user's step
        assert report.proof.step.startswith("the watched batch") and report.proof.checked and not report.proof.verified
        assert not report.proof.before.ran and "must have the same dtype" in report.proof.before.error
        assert "Plan not verified on your step: checked on mpdoctor's own step on the watched batch" in report.to_text()

        report.fixes[0].apply()  # the proven fix, through the API
        params = list(model.parameters())
        start = snapshot(params)
        loss = _loop_step(model, opt, next(it), scaler)  # the loop's next step, on the next batch: it trains
        assert_step_trains(loss, start, params)
    finally:
        w.close()


def _raised(fn) -> BaseException:
    try:
        fn()
    except Exception as exc:  # the loop's exception, kept for explain()
        return exc
    raise AssertionError("the step did not raise")


def test_the_watched_block_that_raises_is_proven_on_its_own_loop_body_and_the_proof_runs_no_optimizer_hook_of_the_loop():
    model, opt, data = _watched_setup()
    with pytest.raises(RuntimeError), mpdoctor.watch(model, opt) as w:
        for x in data[2:]:
            _loop_step(model, opt, x)
    proof = w.crash_report.proof
    # The proof ran the user's own loop body (this block's `_loop_step(model, opt, x)`) on the batch that raised.
    assert proof.step.startswith("your loop's body (") and "test_proof_places.py:" in proof.step and proof.verified
    assert not proof.before.ran and "must have the same dtype" in proof.before.error
    assert w._steps == 0, "the proof's optimizer steps are not the loop's"
    assert model[2].weight.dtype == torch.bfloat16  # the trial was undone
    # What it verified, done by the user: the plan applied, the loop's step on the same batch trains.
    for fx in w.crash_report.fixes:
        fx.apply()
    params = list(model.parameters())
    start = snapshot(params)
    assert_step_trains(_loop_step(model, opt, data[2]), start, params)


def test_a_watched_loop_body_that_skips_batches_with_continue_is_explained_and_proven_on_itself():
    """A body holding its loop's own ``continue`` (a skipped batch) or ``break`` does not compile on its own: it is
    replayed as one iteration, and the crash is explained and proven on it (it was not explained at all)."""
    model, opt, data = _watched_setup()
    with pytest.raises(RuntimeError), mpdoctor.watch(model, opt) as w:
        for x in data[2:]:
            if x is None:  # a batch the loop skips
                continue
            _loop_step(model, opt, x)
            if not x.isfinite().all():
                break
    proof = w.crash_report.proof
    assert proof.step.startswith("your loop's body (") and proof.verified
    assert not proof.before.ran and "must have the same dtype" in proof.before.error
    assert model[2].weight.dtype == torch.bfloat16 and "__mpdoctor_one_iteration" not in globals()


# -- the probe's batch ---------------------------------------------------------------------------------------------


def test_the_probe_proves_its_fix_on_its_batch_restores_everything_and_a_training_step_then_trains():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
    model[2].to(torch.bfloat16)
    batch = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        model(batch).float().mean().backward()  # the real error first
    model.eval()  # the probe runs in train mode and must put the modes back
    ns = {"model": model, "batch": batch}
    before, rng = values_only(fingerprint(ns)), torch.get_rng_state()
    report = mpdoctor.probe(model, batch)
    assert values_only(fingerprint(ns)) == before and torch.equal(torch.get_rng_state(), rng)
    assert {"probe-dtype-error", "mixed-param-dtypes"} <= {f.check for f in report.findings}
    assert report.proof.step == "the probe's batch: forward and backward"
    assert report.proof.checked and not report.proof.verified and not report.proof.before.ran
    assert "Plan not verified on your step: checked on the probe's forward and backward" in report.to_text()
    assert report.view.data["proof"]["verified"] is False and report.view.data["proof"]["checked"] is True

    report.fixes[0].apply()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(model.parameters())
    start = snapshot(params)
    loss = _loop_step(model, opt, batch)  # a training step on the probe's batch
    assert_step_trains(loss, start, params)


def test_a_gpt2_block_cast_to_bf16_is_cured_whole_its_layernorms_with_its_projections():
    """One block of an fp32 GPT-2 cast to bf16: its LayerNorm raises first ('mixed dtype (CPU)': torch's LayerNorm
    takes a weight as wide as its input or wider, never narrower). The cast mpdoctor plans takes the block's norms
    along with its projections, is verified on the probe's batch, and a training step on it then trains (before,
    it cast the 4 projections alone and the step still raised in ln_1)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=512, n_positions=64, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).train()
    model.transformer.h[1].to(torch.bfloat16)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    with pytest.raises(RuntimeError, match="mixed dtype \\(CPU\\): expect parameter to have scalar type of Float"):
        model(**batch).loss.backward()  # the real error first
    model.zero_grad(set_to_none=True)
    report = mpdoctor.probe(model, batch)
    (finding,) = report.findings_for("mixed-param-dtypes")
    assert {"transformer.h.1.ln_1", "transformer.h.1.ln_2"} <= set(finding.evidence["modules"])
    assert "mixed dtype (CPU)" in finding.message
    assert report.proof.checked, report.to_text()
    (fix,) = [fx for fx in report.fixes if fx.slug == "mixed-param-dtypes"]
    assert fix.title == "Cast 12 parameters of 6 modules of model to float32"
    fix.apply()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = [p for p in model.parameters() if p.requires_grad]
    start = snapshot(params)
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    assert_step_trains(loss.detach(), start, params)


def test_torchs_norms_with_weights_wider_than_their_input_are_its_mixed_path_and_draw_nothing():
    """The healthy twin: a bf16 GPT-2 whose LayerNorms are kept fp32 (torch's mixed path: bf16 input, fp32 weight,
    bf16 output) runs, and mixed-param-dtypes says nothing about the norms."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=64, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).to(torch.bfloat16).train()
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.float()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()  # runs
    report = mpdoctor.diagnose(namespace={"model": model})
    assert report.findings_for("mixed-param-dtypes") == [], report.to_text()


def test_a_probe_fix_that_leaves_the_step_failing_is_not_called_a_cure():
    # a bf16 batch into an fp32 body with a bf16 head: casting the head to fp32 leaves the batch in bf16 and the
    # first Linear still raises; the probe's trial shows it instead of offering it as the cure
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    model[1].to(torch.bfloat16)
    batch = torch.randn(4, 8, dtype=torch.bfloat16)
    report = mpdoctor.probe(model, batch)
    cast = report.findings_for("mixed-param-dtypes")[0].fixes[0]
    label = report.proof.label(cast)  # the proof's record of the cast, kept by the report, not by the fix
    assert label.startswith("not verified (checked on the probe's forward and backward on your batch"), label
    assert "it raised RuntimeError: mat1 and mat2 must have the same dtype" in label
    assert not report.proof.checked and not report.proof.verified
    assert "Plan not verified on your step: checked on the probe's forward and backward" in report.to_text()
    assert model[1].weight.dtype == torch.bfloat16


def test_a_cell_that_loops_over_many_steps_is_replayed_for_one_round_through_its_failing_line():
    from torch.optim.optimizer import register_optimizer_step_post_hook

    loop = "for step in range(50):\n" + "".join(f"    {line}\n" for line in _STEP_ON_BATCH.strip().splitlines()[:-1])
    with loaded_shell(_NAMES + ("step",)) as sh:
        sh.run_cell(_SETUP, store_history=True)
        assert isinstance(sh.run_cell(loop, store_history=True).error_in_exec, RuntimeError)
        steps: list = []
        handle = register_optimizer_step_post_hook(lambda opt, args, kwargs: steps.append(opt))
        try:
            sh.run_cell("r = %mpdoctor net adam --json", store_history=True)
        finally:
            handle.remove()
        report = sh.user_ns["r"]
        assert report.proof.verified
        # one round per trial that ran: the replay stopped as the failing line came round again, not after 50
        assert len(steps) == sum(outcome.ran for _, outcome in report.proof.after) == 1
        report.fixes[0].apply()
        params = list(sh.user_ns["net"].parameters())
        start = snapshot(params)
        sh.run_cell(loop, store_history=True)  # the user's cell: all 50 steps now
        assert len(sh.user_ns["seen"]) == 50
        assert_step_trains(sh.user_ns["loss"], start, params)


def _zero_output(model):
    model.register_forward_hook(lambda m, a, out: out * 0.0)
    return model


def _inf_weight(model):
    with torch.no_grad():
        model[0].weight[0, 0] = float("inf")
    return model


def _bf16_head(model):
    model[1].to(torch.bfloat16)
    return model


@pytest.mark.parametrize(
    ("make", "scaler_scale", "ran", "trained"),
    [
        (lambda m: m, None, True, True),  # healthy
        (_bf16_head, None, False, False),  # raises in the head
        (_inf_weight, None, True, False),  # non-finite loss
        (_zero_output, None, True, False),  # every gradient zero
        (lambda m: m, 3e38, True, False),  # the GradScaler's scale overflows the gradients
    ],
    ids=["healthy", "raises", "nonfinite-loss", "zero-grads", "scaled-overflow"],
)
def test_the_probes_own_run_is_judged_as_its_held_step_would_be(make, scaler_scale, ran, trained):
    """The proof's "before" is the probe's own forward and backward, not a second run: judged from it, the outcome
    is the one run_step gives on the held step itself, under the same loss scale."""
    from mpdoctor.attach.numerics.probe import _outcome, probe_step, run_probe
    from mpdoctor.diagnosis.proof import run_step

    torch.manual_seed(0)
    model = make(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))
    batch = torch.randn(4, 8) * 100
    scaler = torch.amp.GradScaler("cpu", init_scale=scaler_scale) if scaler_scale else None
    seen = _outcome(run_probe(model, batch, scaler=scaler))
    model.zero_grad(set_to_none=True)
    held = run_step(probe_step(model, batch, scaler=scaler).run, [model], [])
    assert (seen.ran, seen.trained) == (held.ran, held.trained) == (ran, trained)
    assert (seen.error is None) == (held.error is None)
    if not ran:
        assert seen.error.split(":")[0] == held.error.split(":")[0] == "RuntimeError"
    if scaler_scale:  # the held step scales its backward as the probe does: unscaled, the same step trains
        model.zero_grad(set_to_none=True)
        assert run_step(probe_step(model, batch).run, [model], []).trained


def test_the_probe_runs_its_step_once_before_the_fixes_not_twice():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    model[1].to(torch.bfloat16)
    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    report = mpdoctor.probe(model, torch.randn(4, 8))
    trials = len(report.proof.after) + len(report.proof.dropped)
    assert trials >= 1 and not report.proof.before.ran and report.proof.checked
    assert len(calls) == 1 + trials  # the probe's own forward, then one per fix tried
    assert report.proof.before.error.startswith("RuntimeError: ")
