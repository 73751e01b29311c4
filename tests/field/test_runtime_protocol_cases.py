"""Field cases of the GradScaler protocol: hand-written AMP loops that broke, as reported.

Each case reproduces the reported failure on this CPU first (the real error, or the measured harm) with a real
``torch.amp.GradScaler("cpu")`` (fp16 autocast on the CPU scales and overflows as on a GPU), then asserts the
protocol observer names the rule at the loop's own line, then runs the corrected loop: it trains (finite loss,
the weights move) and draws nothing.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from amp_loops import X, Y, fp16_loss, grad_norm, mlp, only
from torch.nn.utils import clip_grad_norm_

import mpdoctor


def test_optimizer_step_past_the_grad_scaler_applies_updates_1024_times_too_large():
    """nerfstudio-project/nerfacc#307 (``grad_scaler.scale(loss).backward(); optimizer.step()``: "the gradients
    are now 1024x larger than they should be"); same mistake fixed in IAHispano/Applio PR #860.

    https://github.com/nerfstudio-project/nerfacc/issues/307
    """
    model = mlp()
    reference = copy.deepcopy(model)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # nerfacc's GradScaler(2**10)
    with mpdoctor.watch(model, opt, grad_scaler) as w:
        for _ in range(3):
            opt.zero_grad()
            grad_scaler.scale(fp16_loss(model)).backward()
            opt.step()  # the reported loop: the scaler only scales the loss
    # Harm, measured: Adam normalises the update, so the size survives but eps is swamped and, with SGD, the
    # step is 1024x: the gradients Adam saw were 1024x the real ones.
    assert grad_norm(model.parameters()) > 100 * grad_norm_of_reference(reference)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    f = only(w, "amp-step-bypasses-scaler")
    assert f.evidence["code"] == "opt.step()  # the reported loop: the scaler only scales the loss"
    assert "1024 times too large" in f.message
    # Corrected: scaler.step + update.
    model, opt, scaler = mlp(), None, torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with mpdoctor.watch(model, opt, scaler) as w:
        for _ in range(3):
            opt.zero_grad()
            loss = fp16_loss(model)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert torch.isfinite(loss) and w.protocol.findings == [] and int(opt.state[model[0].weight]["step"]) == 3


def grad_norm_of_reference(model) -> float:
    model.zero_grad()
    fp16_loss(model).backward()
    return grad_norm(model.parameters())


def test_unscale_in_every_micro_batch_raises_with_accumulation():
    """microsoft/Swin-Transformer#311 ("AMP + Accumulation-steps Fails": ``scaler.unscale_(optimizer)`` runs at
    every micro-batch and raises at the second).

    https://github.com/microsoft/Swin-Transformer/issues/311
    """
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    accumulation_steps = 2
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called on this optimizer since the last update"):
        with mpdoctor.watch(model, opt, scaler) as w:
            for idx in range(4):
                loss = fp16_loss(model) / accumulation_steps
                scaler.scale(loss).backward()
                scaler.unscale_(opt)  # Swin's train_one_epoch: unscale (and clip) at every micro-batch
                clip_grad_norm_(model.parameters(), 5.0)
                if (idx + 1) % accumulation_steps == 0:
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad()
    finding = only(w, "amp-unscale-twice")
    assert finding.evidence["code"].startswith("scaler.unscale_(opt)  # Swin's")
    assert "With gradient accumulation, unscale once per real step" in finding.message  # no exit skipped update()
    model = mlp()  # the raise left that scaler mid-step: start again with the corrected loop
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    with mpdoctor.watch(model, opt, scaler) as w:
        opt.zero_grad()
        for idx in range(4):
            loss = fp16_loss(model) / accumulation_steps
            scaler.scale(loss).backward()
            if (idx + 1) % accumulation_steps == 0:
                scaler.unscale_(opt)
                clip_grad_norm_(model.parameters(), 5.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    assert w.protocol.findings == [] and torch.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_skipping_update_with_a_skipped_step_raises_at_the_next_unscale():
    """Haian-Jin/LVSM PR #19: a step skipped for a large grad norm skipped ``scaler.update()`` too, and the next
    iteration's ``scaler.unscale_`` raised.

    https://github.com/Haian-Jin/LVSM/pull/19
    """
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
        with mpdoctor.watch(model, opt, scaler) as w:
            for _ in range(2):
                opt.zero_grad()
                scaler.scale(fp16_loss(model, X * 100, Y)).backward()
                scaler.unscale_(opt)  # LVSM's train.py
                norm = clip_grad_norm_(model.parameters(), 2.0)
                if norm > 5.0:  # "grad norm too large, skipping optimizer step" -- and update()
                    continue
                scaler.step(opt)
                scaler.update()
    finding = only(w, "amp-unscale-twice")
    assert finding.evidence["code"] == "scaler.unscale_(opt)  # LVSM's train.py"
    # The loop's source names the line that skipped the update, not gradient accumulation.
    assert "`continue`" in finding.message and "update() on every iteration that ran unscale_" in finding.message
    assert "accumulation" not in finding.message
    # The PR's fix: update() every iteration, stepped or not (the skipped step's update backs the scale off).
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    with mpdoctor.watch(model, opt, scaler) as w:
        for i in range(4):
            opt.zero_grad()
            loss = fp16_loss(model, X * (100 if i == 0 else 1), Y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norm = clip_grad_norm_(model.parameters(), 2.0)
            if norm <= 5.0:
                scaler.step(opt)
            scaler.update()
    assert w.protocol.findings == [] and torch.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_step_without_update_raises_at_the_second_step():
    """Azure/MS-AMP PR #45 (the MNIST example called ``scaler.step(optimizer)`` with no ``scaler.update()``:
    "step() has already been called since the last update()").

    https://github.com/Azure/MS-AMP/pull/45
    """
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update"):
        with mpdoctor.watch(model, optimizer, scaler) as w:
            for _ in range(2):
                optimizer.zero_grad()
                scaler.scale(fp16_loss(model)).backward()
                scaler.step(optimizer)  # the example, before the PR added scaler.update()
    assert only(w, "amp-update-missing").evidence["code"].startswith("scaler.step(optimizer)  # the example")
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with mpdoctor.watch(model, optimizer, scaler) as w:
        for _ in range(2):
            optimizer.zero_grad()
            loss = fp16_loss(model)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    assert w.protocol.findings == [] and torch.isfinite(loss)


def warmup_loop(skip_aware: bool):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)  # a fresh run whose first steps overflow
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 10))
    with mpdoctor.watch(model, opt, scaler) as w:
        for _ in range(20):
            opt.zero_grad()
            loss = fp16_loss(model)
            scaler.scale(loss).backward()
            scale_before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if not skip_aware:
                scheduler.step()  # pytorch#55585's loop
            elif scaler.get_scale() >= scale_before:  # transformers PR #11144: skip it when the step was skipped
                scheduler.step()
    return w, opt, scheduler, model, loss


def test_scheduler_stepping_on_skipped_amp_steps():
    """pytorch/pytorch#55585 and huggingface/transformers#11106 ("Detected call of `lr_scheduler.step()` before
    `optimizer.step()`" with a GradScaler: the scaler skipped the step, the scheduler did not); fixed in the
    Trainer by transformers PR #11144.

    https://github.com/pytorch/pytorch/issues/55585 -- https://github.com/huggingface/transformers/issues/11106
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w, opt, scheduler, model, _ = warmup_loop(skip_aware=False)
    assert any("Detected call of `lr_scheduler.step()` before `optimizer.step()`" in str(c.message) for c in caught)
    taken = int(opt.state[model[0].weight]["step"])
    skipped = sum(r.skipped for r in w.scale_history)
    # Harm, measured: the scheduler advanced on every skipped step; the 10-step warm-up was over after 10 - skipped
    # optimizer steps (the skips are the first steps, while the scale falls from 2**24).
    assert skipped >= 5 and all(r.skipped for r in w.scale_history[:skipped])
    assert scheduler.last_epoch == 20 and taken == 20 - skipped
    assert scheduler.get_last_lr()[0] == pytest.approx(1e-3)
    f = only(w, "amp-scheduler-on-skipped-steps")
    assert f.evidence["code"] == "scheduler.step()  # pytorch#55585's loop"
    w, opt, scheduler, model, loss = warmup_loop(skip_aware=True)
    assert w.protocol.findings == [] and torch.isfinite(loss)
    assert scheduler.last_epoch == int(opt.state[model[0].weight]["step"])


def test_resuming_without_the_scaler_state_skips_the_first_steps():
    """huggingface/transformers PR #11663 ("Save scaler state dict when checkpointing"), ultralytics PR #22189
    (restore GradScaler on resume), facebookresearch/co-tracker PR #101 (loss curve disrupted after resume).

    https://github.com/huggingface/transformers/pull/11663 -- https://github.com/ultralytics/ultralytics/pull/22189
    """

    def step(model, opt, scaler) -> bool:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.ones(8, 8)).sum() * 16  # overflows in fp16 above a scale of ~2**9
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        return scaler.get_scale() < before

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(30):
        step(model, opt, scaler)
    ckpt = {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(opt.state_dict())}  # no scaler

    def resume(with_scaler: bool):
        m = torch.nn.Linear(8, 1)
        m.load_state_dict(ckpt["model"])
        o = torch.optim.Adam(m.parameters(), lr=1e-3)
        o.load_state_dict(ckpt["optimizer"])
        s = torch.amp.GradScaler("cpu")
        if with_scaler:
            s.load_state_dict(scaler.state_dict())
        return m, o, s

    m, o, s = resume(with_scaler=False)
    (static,) = mpdoctor.diagnose(m, o, s).findings_for("scaler-not-restored-on-resume")
    with mpdoctor.watch(m, o, s) as w:
        skipped = [step(m, o, s) for _ in range(8)]
    assert sum(skipped) >= 3  # harm, measured: the first steps after resume train nothing
    assert only(w, "scaler-not-restored-on-resume").severity == "warning" and static.severity == "warning"
    m, o, s = resume(with_scaler=True)
    assert mpdoctor.diagnose(m, o, s).findings_for("scaler-not-restored-on-resume") == []
    before = [p.detach().clone() for p in m.parameters()]
    with mpdoctor.watch(m, o, s) as w:
        skipped = [step(m, o, s) for _ in range(8)]
    assert sum(skipped) == 0 and w.protocol.findings == []
    assert any(not torch.equal(a, b) for a, b in zip(before, m.parameters()))
