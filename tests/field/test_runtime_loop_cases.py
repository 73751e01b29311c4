"""Field cases of the AMP loop order: each reported loop is run for real on this CPU first (the real
GradScaler error, or the measured harm), then read statically: the rule is named at the reported line and its
corrected lines train.

``torch.amp.GradScaler("cpu")`` is an enabled scaler on this CPU: its RuntimeErrors and assertions are the
ones the reports quote from CUDA runs. The loops are written in the shape each report shows, with a tiny model.
"""

from __future__ import annotations

import math
import textwrap
import warnings

import pytest
import torch

from mpdoctor.attach.runtime.loop_findings import read_code
from mpdoctor.attach.runtime.twins import TRIAL_STEPS, try_on_twins

SETUP = """\
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu")
data = [(torch.randn(16, 8), 3 * torch.randn(16, 1)) for _ in range(8)]
before = [p.detach().clone() for p in model.parameters()]
losses = []
"""


def run_loop(loop: str, setup: str = SETUP) -> dict:
    """Run setup + loop as a script would; return its namespace (the exception propagates)."""
    ns: dict = {}
    exec(compile(setup + textwrap.dedent(loop), "train.py", "exec"), ns)  # the reported loop, run for real
    return ns


def moved(ns: dict) -> float:
    return (
        torch.cat([(b - a).flatten() for a, b in zip(ns["before"], ns["model"].parameters())]).norm().item()
    )


def trains(ns: dict) -> bool:
    return bool(ns["losses"]) and all(math.isfinite(x) for x in ns["losses"]) and moved(ns) > 0


def trains_on_copies(code: str, setup: str = SETUP) -> bool:
    """What ``%mpdoctor`` does before it shows the corrected lines: run them on copies of the objects the setup
    built (:func:`mpdoctor.attach.runtime.twins.try_on_twins`); the objects themselves stay as they were."""
    ns = run_loop("", setup)
    held = [p.detach().clone() for p in ns["model"].parameters()]
    trial = try_on_twins(code, ns)
    assert all(torch.equal(a, b) for a, b in zip(held, ns["model"].parameters()))
    return trial.trains and trial.steps == TRIAL_STEPS


def finding_at(loop: str, slug: str, setup: str = SETUP):
    (finding,) = [f for f in read_code(setup + textwrap.dedent(loop), "train.py") if f.check == slug]
    return finding


def line_of(loop: str, text: str, setup: str = SETUP) -> int:
    lines = (setup + textwrap.dedent(loop)).splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.strip() == text)


CLIP_BEFORE_UNSCALE = """\
for x, y in data:
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    losses.append(loss.item())
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
"""


def test_clipping_scaled_gradients_halts_training_unet_468_everydream_175():
    """milesial/Pytorch-UNet#468 (fixed by PR #470), victorchall/EveryDream2trainer PR #175: clip_grad_norm_ on the
    scaled gradients "effectively halting training".

    https://github.com/milesial/Pytorch-UNet/issues/468 -- https://github.com/victorchall/EveryDream2trainer/pull/175
    """
    broken = run_loop(CLIP_BEFORE_UNSCALE)
    reference = run_loop(
        CLIP_BEFORE_UNSCALE.replace(
            "    torch.nn.utils.clip", "    scaler.unscale_(optimizer)\n    torch.nn.utils.clip"
        )
    )
    assert moved(broken) < 1e-3 * moved(reference)  # measured: the weights barely move

    finding = finding_at(CLIP_BEFORE_UNSCALE, "amp-clip-before-unscale")
    assert (
        finding.subject
        == f"train.py:{line_of(CLIP_BEFORE_UNSCALE, 'torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)')}"
    )
    assert trains_on_copies(finding.fixes[0].code)
    fixed = run_loop(finding.fixes[0].code)
    assert trains(fixed) and moved(fixed) == pytest.approx(moved(reference))


SWIN_ACCUMULATION = """\
for idx, (x, y) in enumerate(data):
    loss = torch.nn.functional.mse_loss(model(x), y)
    losses.append(loss.item())
    loss = loss / 2
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
    if (idx + 1) % 2 == 0:
        scaler.step(optimizer)
        optimizer.zero_grad()
        scaler.update()
"""


def test_unscale_every_micro_batch_raises_swin_transformer_311():
    """microsoft/Swin-Transformer#311: AMP + accumulation steps > 1 fails in ``scaler.unscale_(optimizer)`` with
    "unscale_() has already been called on this optimizer since the last update()".

    https://github.com/microsoft/Swin-Transformer/issues/311
    """
    with pytest.raises(
        RuntimeError,
        match=r"unscale_\(\) has already been called on this optimizer since the last update\(\)",
    ):
        run_loop(SWIN_ACCUMULATION)
    finding = finding_at(SWIN_ACCUMULATION, "amp-unscale-twice")
    assert finding.severity == "error"
    assert finding.subject == f"train.py:{line_of(SWIN_ACCUMULATION, 'scaler.unscale_(optimizer)')}"
    assert trains_on_copies(finding.fixes[0].code)
    assert trains(run_loop(finding.fixes[0].code))


SKIP_WITHOUT_UPDATE = """\
for x, y in data:
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    losses.append(loss.item())
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if grad_norm > 5.0:
        print("grad norm too large, skipping the optimizer step")
    else:
        scaler.step(optimizer)
        scaler.update()
"""


def test_update_skipped_with_the_step_makes_the_next_unscale_raise_lvsm_19_espnet_2362():
    """Haian-Jin/LVSM PR #19, espnet/espnet PR #2362: ``scaler.update()`` only called when the step is taken;
    after a skipped step the next ``unscale_`` raises.

    https://github.com/Haian-Jin/LVSM/pull/19 -- https://github.com/espnet/espnet/pull/2362
    """
    skip_first = SKIP_WITHOUT_UPDATE.replace(
        "grad_norm > 5.0", "grad_norm > 0.0"
    )  # make the first step a skip
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
        run_loop(skip_first)
    finding = finding_at(SKIP_WITHOUT_UPDATE, "amp-unscale-twice")
    assert finding.subject == f"train.py:{line_of(SKIP_WITHOUT_UPDATE, 'scaler.unscale_(optimizer)')}"
    assert "update" in finding.message
    assert trains_on_copies(finding.fixes[0].code)
    assert trains(run_loop(finding.fixes[0].code))


MS_AMP_NO_UPDATE = """\
for x, y in data:
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    losses.append(loss.item())
    scaler.scale(loss).backward()
    scaler.step(optimizer)
"""


def test_step_without_update_raises_on_the_second_step_ms_amp_45():
    """Azure/MS-AMP PR #45: the MNIST example lost ``scaler.update()``: "step() has already been called since
    the last update()".

    https://github.com/Azure/MS-AMP/pull/45
    """
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update\(\)"):
        run_loop(MS_AMP_NO_UPDATE)
    finding = finding_at(MS_AMP_NO_UPDATE, "amp-update-missing")
    assert finding.subject == f"train.py:{line_of(MS_AMP_NO_UPDATE, 'scaler.step(optimizer)')}"
    assert trains_on_copies(finding.fixes[0].code)
    assert trains(run_loop(finding.fixes[0].code))


SCHEDULER_SETUP = """\
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 if s < 4 else 0.1)  # 4 warm steps
real_steps = 0
"""
SCHEDULER_ON_SKIPS = """\
for x, y in data:
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    losses.append(loss.item())
    scaler.scale(loss).backward()
    scale_seen = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    real_steps += scaler.get_scale() >= scale_seen
    scheduler.step()
"""


def test_the_schedule_runs_ahead_on_skipped_steps_watchmal_106():
    """WatChMaL/WatChMaL PR #106: "only do scheduler.step() when the optimizer actually updated under AMP ...
    to avoid LR advancing on skipped overflow steps".

    https://github.com/WatChMaL/WatChMaL/pull/106
    """
    # The first steps overflow: a scaled gradient past fp32's 3.4e38 is inf, the step is skipped, the scale halves.
    overflowing = (
        SETUP.replace('GradScaler("cpu")', 'GradScaler("cpu", init_scale=2.0**127)') + SCHEDULER_SETUP
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own "lr_scheduler.step() before optimizer.step()" warning
        ns = run_loop(SCHEDULER_ON_SKIPS, overflowing)
    skipped = len(ns["data"]) - ns["real_steps"]
    assert skipped >= 1 and ns["scheduler"].last_epoch == len(
        ns["data"]
    )  # measured: the schedule counted every skip
    finding = finding_at(SCHEDULER_ON_SKIPS, "amp-scheduler-on-skipped-steps", overflowing)
    assert (
        finding.severity == "info"
    )  # statically, PyTorch's own recipe: the run's skips are the watcher's to show
    assert finding.subject == f"train.py:{line_of(SCHEDULER_ON_SKIPS, 'scheduler.step()', overflowing)}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert trains_on_copies(finding.fixes[0].code, overflowing)
        fixed = run_loop(finding.fixes[0].code, overflowing)
    assert (
        fixed["scheduler"].last_epoch == len(fixed["data"]) - skipped
    )  # the schedule counts real steps only
    assert trains(fixed)
