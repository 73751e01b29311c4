"""Field cases of the GradScaler protocol: hand-written AMP loops that broke, as reported.

Each case runs the reported loop as a training script's lines under ``mpdoctor.watch`` and reproduces the reported
failure on this CPU first (the real error, or the measured harm) with a real ``torch.amp.GradScaler("cpu")`` (fp16
autocast on the CPU scales and overflows as on a GPU), then asserts the protocol observer names the rule at the
loop's own line. The fix is the user's own loop corrected, as ``%mpdoctor`` shows it (the watcher's finding given
the loop read from the code that ran, :func:`mpdoctor.attach.runtime.loop_findings.in_the_users_loop`): it is run on
copies of the objects as they stood before the loop, as ``%mpdoctor`` does before showing it
(:func:`mpdoctor.attach.runtime.twins.try_on_twins`), then for real, watched: it trains (finite loss, the weights move)
and draws nothing.
"""

from __future__ import annotations

import copy
import linecache
import textwrap
import warnings

import pytest
import torch
from amp_loops import X, Y, checkpoint_after, fp16_loss, grad_norm, mlp, only, resumed, scaled_step
from torch.nn.utils import clip_grad_norm_

import mpdoctor
from mpdoctor.attach.runtime.loop_findings import in_the_users_loop
from mpdoctor.attach.runtime.twins import TRIAL_STEPS, try_on_twins
from mpdoctor.objects.live import Live
from mpdoctor.objects.readers.loop_source import source_of
from mpdoctor.rules.engine.changes import LoadScalerState


def script(**objects) -> dict:
    """A training script's namespace before its loop: what it imported and the objects it built."""
    return {"torch": torch, "mpdoctor": mpdoctor, "fp16_loss": fp16_loss, "clip_grad_norm_": clip_grad_norm_,
            "X": X, "Y": Y, **objects}  # fmt: skip


def run_watched(file: str, loop: str, ns: dict, watched: str):
    """Run ``loop`` in ``ns`` as the lines of the script ``file``, under ``mpdoctor.watch(<watched>)``, for real;
    return the watch (the loop's exception propagates)."""
    code = f"with mpdoctor.watch({watched}) as w:\n" + textwrap.indent(textwrap.dedent(loop), "    ")
    linecache.cache[file] = (len(code), None, code.splitlines(True), file)  # the script's lines, as on disk
    try:
        exec(compile(code, file, "exec"), ns)  # noqa: S102 - the reported loop, run for real
    finally:
        ns.setdefault("w", None)
    return ns["w"]


def corrected_loop(w, slug: str, file: str) -> str:
    """The corrected lines ``%mpdoctor`` shows for the watcher's finding ``slug``: the user's own loop (read from the
    lines of ``file`` that ran), every mistake of it fixed; not the rule's template."""
    finding = only(w, slug)
    (mine,) = in_the_users_loop([finding], [source_of(file, "".join(linecache.cache[file][2]))])
    (fix,) = mine.fixes
    assert fix.applicability.name == "DISPLAY_ONLY" and fix.code != finding.fixes[0].code
    return fix.code


def trains_on_copies(code: str, ns: dict, model: str = "model", scaler: str = "scaler") -> bool:
    """What ``%mpdoctor`` does before it shows the corrected lines: run them on copies of the script's objects
    (:func:`mpdoctor.attach.runtime.twins.try_on_twins`), for its trial's steps; the objects themselves stay as they were."""
    params = [p.detach().clone() for p in ns[model].parameters()]
    scale = ns[scaler].get_scale()
    trial = try_on_twins(code, ns)
    assert all(torch.equal(a, b) for a, b in zip(params, ns[model].parameters()))
    assert all(p.grad is None for p in ns[model].parameters()) and ns[scaler].get_scale() == scale
    assert trial.trains and trial.steps == TRIAL_STEPS, trial.sentence()
    return True


def trains_for_real(file: str, code: str, ns: dict, watched: str, model: str = "model"):
    """Run the corrected lines for real, watched: the loss is finite, the weights moved, nothing is found."""
    before = [p.detach().clone() for p in ns[model].parameters()]
    w = run_watched(file, code, ns, watched)
    assert w.protocol.findings == [] and torch.isfinite(ns["loss"])
    assert any(not torch.equal(a, b) for a, b in zip(before, ns[model].parameters()))
    return w


NERFACC = """
for _ in range(4):
    opt.zero_grad()
    loss = fp16_loss(model)
    grad_scaler.scale(loss).backward()
    opt.step()  # the reported loop: the scaler only scales the loss
"""


def nerfacc_script() -> dict:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return script(model=model, opt=opt, grad_scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))  # nerfacc's 2**10


def test_optimizer_step_past_the_grad_scaler_applies_updates_1024_times_too_large():
    """nerfstudio-project/nerfacc#307 (``grad_scaler.scale(loss).backward(); optimizer.step()``: "the gradients
    are now 1024x larger than they should be"); same mistake fixed in IAHispano/Applio PR #860.

    https://github.com/nerfstudio-project/nerfacc/issues/307
    """
    ns = nerfacc_script()
    reference = copy.deepcopy(ns["model"])
    before = [p.detach().clone() for p in ns["model"].parameters()]
    w = run_watched("nerfacc_train.py", NERFACC, ns, "model, opt, grad_scaler")
    # Harm, measured: Adam normalises the update, so the size survives but eps is swamped and, with SGD, the
    # step is 1024x: the gradients Adam saw were 1024x the real ones.
    assert grad_norm(ns["model"].parameters()) > 100 * grad_norm_of_reference(reference)
    assert any(not torch.equal(a, b) for a, b in zip(before, ns["model"].parameters()))
    f = only(w, "amp-step-bypasses-scaler")
    assert f.evidence["code"] == "opt.step()  # the reported loop: the scaler only scales the loss"
    assert "1024 times too large" in f.message
    # Corrected: grad_scaler.step(opt), then update(); on copies of the objects as they were, then for real.
    code = corrected_loop(w, "amp-step-bypasses-scaler", "nerfacc_train.py")
    assert "grad_scaler.step(opt)" in code and "grad_scaler.update()" in code and "opt.step()" not in code
    ns = nerfacc_script()
    assert trains_on_copies(code, ns, scaler="grad_scaler")
    trains_for_real("nerfacc_fixed.py", code, ns, "model, opt, grad_scaler")
    assert int(ns["opt"].state[ns["model"][0].weight]["step"]) == 4


def grad_norm_of_reference(model) -> float:
    model.zero_grad()
    fp16_loss(model).backward()
    return grad_norm(model.parameters())


def amp_script(accumulation_steps: int = 1, init_scale: float = 1024.0, optimizer: str = "opt", **more) -> dict:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return script(model=model, scaler=torch.amp.GradScaler("cpu", init_scale=init_scale),
                  accumulation_steps=accumulation_steps, **{optimizer: opt}, **more)  # fmt: skip


SWIN = """
for idx in range(8):
    loss = fp16_loss(model) / accumulation_steps
    scaler.scale(loss).backward()
    scaler.unscale_(opt)  # Swin's train_one_epoch: unscale (and clip) at every micro-batch
    clip_grad_norm_(model.parameters(), 5.0)
    if (idx + 1) % accumulation_steps == 0:
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
"""


def test_unscale_in_every_micro_batch_raises_with_accumulation():
    """microsoft/Swin-Transformer#311 ("AMP + Accumulation-steps Fails": ``scaler.unscale_(optimizer)`` runs at
    every micro-batch and raises at the second).

    https://github.com/microsoft/Swin-Transformer/issues/311
    """
    ns = amp_script(accumulation_steps=2)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called on this optimizer since the last update"):
        run_watched("swin_train.py", SWIN, ns, "model, opt, scaler")
    finding = only(ns["w"], "amp-unscale-twice")
    assert finding.evidence["code"].startswith("scaler.unscale_(opt)  # Swin's")
    assert "With gradient accumulation, unscale once per real step" in finding.message  # no exit skipped update()
    # Corrected: unscale and clip once per real step, under the accumulation guard. The raise left that scaler
    # mid-step: the corrected loop runs on objects as they were before the loop, on copies, then for real.
    code = corrected_loop(ns["w"], "amp-unscale-twice", "swin_train.py")
    assert "    scaler.unscale_(opt)" in code.split("if (idx + 1) % accumulation_steps == 0:")[1]
    ns = amp_script(accumulation_steps=2)
    assert trains_on_copies(code, ns)
    trains_for_real("swin_fixed.py", code, ns, "model, opt, scaler")


LVSM = """
for i in range(6):
    opt.zero_grad()
    loss = fp16_loss(model, X * (100 if i == 0 else 1), Y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)  # LVSM's train.py
    norm = clip_grad_norm_(model.parameters(), 2.0)
    if norm > 5.0:  # "grad norm too large, skipping optimizer step" -- and update()
        continue
    scaler.step(opt)
    scaler.update()
"""


def test_skipping_update_with_a_skipped_step_raises_at_the_next_unscale():
    """Haian-Jin/LVSM PR #19: a step skipped for a large grad norm skipped ``scaler.update()`` too, and the next
    iteration's ``scaler.unscale_`` raised.

    https://github.com/Haian-Jin/LVSM/pull/19
    """
    ns = amp_script()
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
        run_watched("lvsm_train.py", LVSM, ns, "model, opt, scaler")
    finding = only(ns["w"], "amp-unscale-twice")
    assert finding.evidence["code"] == "scaler.unscale_(opt)  # LVSM's train.py"
    # The loop's source names the line that skipped the update, not gradient accumulation.
    assert "`continue`" in finding.message and "update() on every iteration that ran unscale_" in finding.message
    assert "accumulation" not in finding.message
    assert ns["w"].crash_report.cause.check == "amp-unscale-twice"  # explained at the crash, its `continue` notwithstanding
    # The PR's fix: update() every iteration, stepped or not (the skipped step's update backs the scale off).
    code = corrected_loop(ns["w"], "amp-unscale-twice", "lvsm_train.py")
    ns = amp_script()
    assert trains_on_copies(code, ns)
    trains_for_real("lvsm_fixed.py", code, ns, "model, opt, scaler")


MS_AMP = """
for _ in range(4):
    optimizer.zero_grad()
    loss = fp16_loss(model)
    scaler.scale(loss).backward()
    scaler.step(optimizer)  # the example, before the PR added scaler.update()
"""


def test_step_without_update_raises_at_the_second_step():
    """Azure/MS-AMP PR #45 (the MNIST example called ``scaler.step(optimizer)`` with no ``scaler.update()``:
    "step() has already been called since the last update()").

    https://github.com/Azure/MS-AMP/pull/45
    """
    ns = amp_script(optimizer="optimizer")
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update"):
        run_watched("ms_amp_mnist.py", MS_AMP, ns, "model, optimizer, scaler")
    assert only(ns["w"], "amp-update-missing").evidence["code"].startswith("scaler.step(optimizer)  # the example")
    code = corrected_loop(ns["w"], "amp-update-missing", "ms_amp_mnist.py")
    assert "scaler.update()" in code
    ns = amp_script(optimizer="optimizer")
    assert trains_on_copies(code, ns)
    trains_for_real("ms_amp_fixed.py", code, ns, "model, optimizer, scaler")


WARMUP = """
for _ in range(20):
    opt.zero_grad()
    loss = fp16_loss(model)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    scheduler.step()  # pytorch#55585's loop
"""


def warmup_script() -> dict:
    ns = amp_script(init_scale=2.0**24)  # a fresh run whose first steps overflow
    ns["scheduler"] = torch.optim.lr_scheduler.LambdaLR(ns["opt"], lambda step: min(1.0, (step + 1) / 10))
    return ns


def test_scheduler_stepping_on_skipped_amp_steps():
    """pytorch/pytorch#55585 and huggingface/transformers#11106 ("Detected call of `lr_scheduler.step()` before
    `optimizer.step()`" with a GradScaler: the scaler skipped the step, the scheduler did not); fixed in the
    Trainer by transformers PR #11144.

    https://github.com/pytorch/pytorch/issues/55585 -- https://github.com/huggingface/transformers/issues/11106
    """
    ns = warmup_script()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w = run_watched("warmup_train.py", WARMUP, ns, "model, opt, scaler")
    assert any("Detected call of `lr_scheduler.step()` before `optimizer.step()`" in str(c.message) for c in caught)
    taken = int(ns["opt"].state[ns["model"][0].weight]["step"])
    skipped = sum(r.skipped for r in w.scale_history)
    # Harm, measured: the scheduler advanced on every skipped step; the 10-step warm-up was over after 10 - skipped
    # optimizer steps (the skips are the first steps, while the scale falls from 2**24).
    assert skipped >= 5 and all(r.skipped for r in w.scale_history[:skipped])
    assert ns["scheduler"].last_epoch == 20 and taken == 20 - skipped
    assert ns["scheduler"].get_last_lr()[0] == pytest.approx(1e-3)
    f = only(w, "amp-scheduler-on-skipped-steps")
    assert f.evidence["code"] == "scheduler.step()  # pytorch#55585's loop"
    # Corrected (transformers PR #11144): step the schedule only when the scale did not fall.
    code = corrected_loop(w, "amp-scheduler-on-skipped-steps", "warmup_train.py")
    ns = warmup_script()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first, skipped steps' lr_scheduler warning is not this test's
        assert trains_on_copies(code, ns)
        trains_for_real("warmup_fixed.py", code, ns, "model, opt, scaler")
    assert ns["scheduler"].last_epoch == int(ns["opt"].state[ns["model"][0].weight]["step"]) == 20 - skipped


def test_resuming_without_the_scaler_state_skips_the_first_steps():
    """huggingface/transformers PR #11663 ("Save scaler state dict when checkpointing"), ultralytics PR #22189
    (restore GradScaler on resume), facebookresearch/co-tracker PR #101 (loss curve disrupted after resume).

    The checkpoints of the reports held no scaler state: the finding stays advice and says why.

    https://github.com/huggingface/transformers/pull/11663 -- https://github.com/ultralytics/ultralytics/pull/22189
    """
    ns = resumed(checkpoint_after(with_scaler=False))
    m, o, s = ns["model"], ns["opt"], ns["scaler"]
    (static,) = mpdoctor.diagnose(namespace=ns).findings_for("scaler-not-restored-on-resume")
    assert [f.applicability.name for f in static.fixes] == ["DISPLAY_ONLY"]
    assert "No GradScaler state is held" in static.message
    with mpdoctor.watch(m, o, s) as w:
        skipped = _skipped_steps(m, o, s, 8)
    assert sum(skipped) >= 3  # harm, measured: the first steps after resume train nothing
    assert only(w, "scaler-not-restored-on-resume").severity == "warning" and static.severity == "warning"
    ns = resumed(checkpoint_after(), load_scaler=True)  # the healthy twin: the user loaded the state
    m, o, s = ns["model"], ns["opt"], ns["scaler"]
    assert not [f for f in mpdoctor.diagnose(namespace=ns).findings if f.severity in ("error", "warning")]
    before = [p.detach().clone() for p in m.parameters()]
    with mpdoctor.watch(m, o, s) as w:
        skipped = _skipped_steps(m, o, s, 8)
    assert sum(skipped) == 0 and w.protocol.findings == []
    assert any(not torch.equal(a, b) for a, b in zip(before, m.parameters()))


def _skipped_steps(model, opt, scaler, n: int) -> list[bool]:
    """Run ``n`` of the user's scaled steps; for each, whether the scaler skipped it (its scale fell)."""
    out = []
    for _ in range(n):
        before = scaler.get_scale()
        scaled_step(model, opt, scaler)
        out.append(scaler.get_scale() < before)
    return out


def _resume_fix(report):
    (finding,) = report.findings_for("scaler-not-restored-on-resume")
    (fix,) = finding.fixes
    return finding, fix


def test_a_checkpoint_holding_the_scaler_state_is_loaded_into_the_fresh_scaler_in_place():
    """huggingface/transformers PR #11663, when the loaded checkpoint does hold the scaler's state (``ckpt["scaler"]``,
    found by its keys, not its name): the fix loads it into the live scaler in place and the resumed steps that the
    fresh scale skipped train."""
    ns = resumed(checkpoint_after())
    m, o, s = ns["model"], ns["opt"], ns["scaler"]
    finding, fix = _resume_fix(mpdoctor.diagnose(namespace=ns))
    assert finding.severity == "warning" and "ckpt['scaler'] holds a saved state (scale 256)" in finding.message
    assert fix.safe and not fix.in_place and fix.code.startswith("scaler.load_state_dict(ckpt['scaler'])")
    before = [p.detach().clone() for p in m.parameters()]
    fix.apply()
    assert fix.applied and s.state_dict() == ns["ckpt"]["scaler"]
    assert mpdoctor.diagnose(namespace=ns).findings_for("scaler-not-restored-on-resume") == []
    with mpdoctor.watch(m, o, s) as w:
        skipped = _skipped_steps(m, o, s, 8)
    assert sum(skipped) == 0 and w.protocol.findings == []  # the user's same steps now train
    assert all(not torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_undo_of_the_loaded_scaler_state_restores_the_scaler_exactly_and_an_older_report_sees_it_in_place():
    ns = resumed(checkpoint_after())
    s = ns["scaler"]
    fresh = dict(s.__dict__)
    older = _resume_fix(mpdoctor.diagnose(namespace=ns))[1]
    fix = _resume_fix(mpdoctor.diagnose(namespace=ns))[1]
    fix.apply()
    assert older.in_place and not fix.in_place  # the older card: already in place; this one: applied, with Undo
    fix.apply()  # idempotent
    fix.undo()
    assert s.__dict__ == fresh and s.state_dict()["scale"] == 65536.0
    # Once the scaler has made its scale tensors, a load fills them: undo copies the old values back into them
    # (the change itself: the check no longer fires on a scaler that has scaled a loss in this run).
    s.scale(torch.ones(()))
    tensors = {k: v for k, v in s.__dict__.items() if isinstance(v, torch.Tensor)}
    values = {k: v.clone() for k, v in tensors.items()}
    fields = {k: v for k, v in s.__dict__.items() if not isinstance(v, torch.Tensor)}
    live = Live()
    (step,) = LoadScalerState(live.add(s), live.add(ns["ckpt"]["scaler"]), "scaler").bind(live)
    step.apply()
    assert s.get_scale() == 256.0 and step.in_place
    step.revert()
    assert all(s.__dict__[k] is t and torch.equal(t, values[k]) for k, t in tensors.items())
    assert {k: v for k, v in s.__dict__.items() if not isinstance(v, torch.Tensor)} == fields


def test_a_state_nested_two_levels_deep_is_found_and_two_different_states_are_the_users_call():
    ckpt = checkpoint_after()
    ns = resumed({"model": ckpt["model"], "optimizer": ckpt["optimizer"]})
    ns["ckpt"] = {"state": {"amp": ckpt["scaler"]}, "epoch": 3}
    fix = _resume_fix(mpdoctor.diagnose(namespace=ns))[1]
    assert fix.title == "Load ckpt['state']['amp'] into scaler (scale 256)" and fix.safe
    ns["older"] = {"scaler": checkpoint_after(steps=12)["scaler"]}
    (finding,) = mpdoctor.diagnose(namespace=ns).findings_for("scaler-not-restored-on-resume")
    assert [f.applicability.name for f in finding.fixes] == ["UNSAFE", "UNSAFE"]
    assert "Several saved states are held" in finding.message
    ns["older"] = {"scaler": torch.amp.GradScaler("cpu").state_dict()}  # a fresh scaler's state restores nothing
    assert _resume_fix(mpdoctor.diagnose(namespace=ns))[1].safe


def test_the_held_scaler_state_is_loaded_through_the_widgets_button():
    ns = resumed(checkpoint_after())
    rw = mpdoctor.diagnose(namespace=ns).widget()
    (button,) = [b for b, group in rw.fix_buttons if any(f.slug == "scaler-not-restored-on-resume" for f in group)]
    button.click()
    assert "failed" not in rw.status and ns["scaler"].state_dict() == ns["ckpt"]["scaler"]
    m, o, s = ns["model"], ns["opt"], ns["scaler"]
    before = [p.detach().clone() for p in m.parameters()]
    assert not any(_skipped_steps(m, o, s, 4))
    assert all(not torch.equal(a, b) for a, b in zip(before, m.parameters()))
