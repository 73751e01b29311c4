"""Checks on GradScalers: a scaler where none belongs, or one that has collapsed."""

from __future__ import annotations

from collections.abc import Iterator

from ...facts import Facts, ScalerFacts
from ...facts.scaler import ScalerStateFacts
from ..engine.changes import CastParamsTo, LoadScalerState, SetAttrTo
from ..engine.findings import Finding, Severity, count, size_delta
from ..engine.fixes import Fix
from ..engine.rules import Applicability, Rule
from . import check


def _trainable_dtypes(facts: Facts) -> dict[str, int]:
    counts: dict[str, int] = {}
    for m in facts.models:
        for d, n in m.tensors.param_dtype_counts(trainable=True).items():
            counts[d] = counts.get(d, 0) + n
    return counts


def _optimized_dtypes(facts: Facts) -> dict[str, int]:
    """Trainable parameter elements by dtype, of the parameters some optimizer holds (all trainable ones when the
    run has no optimizer): a model no optimizer steps is not what a scaler serves."""
    held = frozenset().union(*(o.param_ids for o in facts.optimizers)) if facts.optimizers else None
    if held is None:
        return _trainable_dtypes(facts)
    counts: dict[str, int] = {}
    for m in facts.models:
        for p in m.tensors.params:
            if p.requires_grad and p.id in held:
                counts[p.dtype] = counts.get(p.dtype, 0) + p.numel
    return counts


def _bf16_setups(facts: Facts) -> list[str]:
    return [p.name for p in facts.precisions if p.computes_in == "bf16"]


def _parts_a_scaler_may_serve(facts: Facts, bf16_setups: list[str]) -> str:
    """What in the run an enabled GradScaler may still be needed for (``""`` when nothing): trainable fp16
    parameters, an fp16 setup, or trainable fp32 parameters beside the bf16 ones with no bf16 setup saying how they
    compute (a loop's fp16 autocast over them needs the scaler, and is not among the objects). Only parameters an
    optimizer holds count: a model no optimizer steps is not what the scaler serves. With no optimizer among the
    diagnosed objects, fp32 parameters are not counted (nothing says they train); fp16 ones always are."""
    trainable = _optimized_dtypes(facts)
    fp16_setups = [p.name for p in facts.precisions if p.computes_in == "fp16"]
    if trainable.get("float16") or fp16_setups:
        return "fp16 parameters or an fp16 setup (" + ", ".join(fp16_setups or ["fp16 parameters"]) + ")"
    if trainable.get("float32") and not bf16_setups and facts.optimizers:
        return f"{trainable['float32']:,} fp32 parameter elements"
    return ""


def disable_scaler_fix(facts: Facts, scaler: ScalerFacts, why: str, safe: bool = True) -> Fix:
    """The fix shared by scaler checks: turn the scaler off in place (unsafe when ``safe`` is False: something the
    scaler may still serve is in the run).

    The GradScaler object is shared (an Accelerator and its AcceleratedOptimizer
    hold the same one), so it is mutated rather than rebound.
    """
    ref = facts.subject(scaler.name).ref
    owners = ", ".join(scaler.owners) if scaler.owners else None
    if owners:
        code = (
            f"# {why}: build the run without a scaler (TrainingArguments(bf16=True, fp16=False) /\n"
            f"# Accelerator(mixed_precision='bf16') create none). In place, for {owners}:\n"
            f"{scaler.name}._enabled = False"
        )
    else:
        code = f"# {why}\n{scaler.name} = torch.amp.GradScaler({scaler.device!r}, enabled=False)"
    return Fix(
        f"Disable {scaler.name} (GradScaler)" + ("" if safe else " (only if no fp16 autocast runs)"),
        code, applicability=Applicability.SAFE if safe else Applicability.UNSAFE,
        changes=(SetAttrTo(ref, "_enabled", False, f"{scaler.name}._enabled"),),
        recipe="disable-scaler",
        cost="saves a scale and an unscale pass over the gradients every step",
    )


@check("scaler-with-bf16", Severity.ERROR, Severity.WARNING, fix_safety=(Applicability.SAFE, Applicability.UNSAFE))
def scaler_with_bf16(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """An enabled GradScaler in a run whose gradients or autocast are bf16.

    What it does
        A ``GradScaler`` that is enabled while the model's trainable parameters
        (so its gradients) are bf16, or while the setup autocasts to bf16.
    Why is this bad?
        bf16 has fp32's exponent range and needs no loss scaling. Where the
        unscale kernel has no bf16 implementation (several CUDA builds) the
        first ``scaler.step`` crashes with ``"_amp_foreach_non_finite_check_and_unscale_cuda"
        not implemented for 'BFloat16'``; where it has one, every step pays for
        scaling and unscaling for nothing. mpdoctor probes the real kernel on
        the live device: error where it fails, warning where it runs.
    Example
        scaler = torch.amp.GradScaler("cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
    Use instead
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()  # bf16 needs no loss scaling
        optimizer.step()
    Severity
        Error where the live device's unscale kernel (probed) has no bf16 path and the gradients are
        bf16: the first ``scaler.step`` crashes; warning otherwise (wasted work every step).
    Fix safety
        Disable the scaler in place (``scaler._enabled = False``; the same object
        an Accelerator and its optimizer share), and build it with
        ``GradScaler(enabled=(dtype == torch.float16))`` next time. Safe only when
        nothing the scaler may serve is in the run; with trainable fp16 or fp32
        parameters beside the bf16 ones (an fp16 autocast over them needs the
        scaler) it is unsafe: applied only on an explicit request.
    Sources
        H2O LLM Studio issue #628 / PR #673; pytorch issue #127176.
    """
    bf16_params = _trainable_dtypes(facts).get("bfloat16", 0)
    setups = _bf16_setups(facts)
    if not bf16_params and not setups:
        return
    hw = facts.hardware
    others = _parts_a_scaler_may_serve(facts, setups)
    for sc in facts.scalers:
        if not sc.enabled:
            continue
        device = sc.device if hw.live else hw.kind
        if hw.unscale_dtypes is not None and hw.live:
            kernel_ok = "bfloat16" in hw.unscale_dtypes
        else:
            kernel_ok = device == "cpu"
        # bf16 autocast over fp32 weights gives fp32 grads: only wasted work, whatever the kernel.
        crashes = bool(bf16_params) and not kernel_ok
        reason = f"{bf16_params:,} trainable bf16 parameter elements" if bf16_params else f"bf16 autocast in {', '.join(setups)}"
        if others:  # the scaler may serve fp16 compute over them: turning it off is the user's call, not a safe one
            msg_tail = (f" But {others} are trained too, and an fp16 autocast over them needs this scaler: disable it "
                        "only if nothing runs in fp16.")  # fmt: skip
        else:
            msg_tail = ""
        if crashes:
            msg = (
                f"{sc.name} is enabled with {reason}; on {hw.label} the unscale kernel has no bf16 implementation, "
                "so the first scaler.step() will crash. bf16 needs no loss scaling."
            )
        else:
            msg = (
                f"{sc.name} is enabled with {reason}; bf16 needs no loss scaling, so every step scales and "
                "unscales for nothing (and crashes on CUDA builds whose unscale kernel lacks bf16)."
            ) + msg_tail
        yield rule.finding(
            sc.name,
            msg,
            {
                "scaler_enabled": True,
                "scaler_device": sc.device,
                "trainable_bf16_elements": bf16_params,
                "bf16_setups": setups,
                "unscale_kernel_bf16": kernel_ok if hw.unscale_dtypes is not None or not hw.live else None,
                "device": hw.label,
            },
            [disable_scaler_fix(facts, sc, "bf16 needs no loss scaling", safe=not others)],
            severity=Severity.ERROR if crashes else Severity.WARNING,
        )


@check("fp16-trainable-params-with-scaler", Severity.ERROR, fix_safety=(Applicability.UNSAFE,))
def fp16_trainable_params_with_scaler(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """Trainable fp16 parameters under an enabled GradScaler.

    What it does
        An enabled ``GradScaler`` while trainable parameters are stored in fp16
        (not just computed in fp16 by autocast).
    Why is this bad?
        ``scaler.unscale_`` refuses fp16 gradients: ``ValueError: Attempting to
        unscale FP16 gradients.`` at the first step. The AMP recipe keeps fp32
        master weights and lets autocast compute in fp16.
    Example
        model = model.half()
        scaler = torch.amp.GradScaler("cuda")
        scaler.scale(model(x).sum()).backward()
        scaler.step(optimizer)  # ValueError: Attempting to unscale FP16 gradients.
    Use instead
        model = model.float()  # fp32 master weights
        scaler = torch.amp.GradScaler("cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    Severity
        Error: the first ``scaler.step`` raises.
    Fix safety
        Cast the trainable fp16 parameters (with their grads and optimizer
        state) to fp32 in place, keeping the Parameter objects; run the forward
        under ``torch.autocast(..., dtype=torch.float16)``. Unsafe: it doubles
        their memory and changes the dtype layers compute in.
    Sources
        transformers issue #23165; peft issue #341.
    """
    enabled = [s for s in facts.scalers if s.enabled]
    if not enabled:
        return
    for m in facts.models:
        fp16 = [p for p in m.tensors.params if p.requires_grad and p.dtype == "float16"]
        if not fp16:
            continue
        ids = frozenset(p.id for p in fp16)
        spec = CastParamsTo(
            m.ref, ids, "float32", facts.optimizer_refs(m.tensors.param_ids),
            "trainable fp16 parameters",
        )
        code = (
            f"for p in {m.name}.parameters():\n"
            f"    if p.requires_grad and p.dtype == torch.float16:\n"
            f"        p.data = p.data.float()  # fp32 master weights; fp16 compute comes from autocast"
        )
        yield rule.finding(
            m.name,
            f"{count(len(fp16), 'trainable parameter')} of {m.name} are fp16 while {enabled[0].name} is enabled; "
            "scaler.step() will raise 'Attempting to unscale FP16 gradients.'",
            {"fp16_trainable_tensors": len(fp16), "scalers": [s.name for s in enabled]},
            [
                Fix(
                    f"Cast {count(len(ids), 'trainable fp16 parameter')} of {m.name} to fp32",
                    code,
                    changes=(spec,),
                    backup_bytes=spec.backup_bytes(facts),
                    recipe="fp32-master-weights",
                    cost=f"{size_delta(sum(p.numel for p in fp16) * 2)} of weights (fp32 master copies)",
                )
            ],
        )


#: A scale this far below where it started means the run has been overflowing for many steps.
COLLAPSE_FACTOR = 2.0**-16


@check("scaler-scale-collapsed", Severity.WARNING)
def scaler_scale_collapsed(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A loss scale driven far below where it started.

    What it does
        An enabled ``GradScaler`` whose current scale is below 1, or more than
        2^16 times below its initial scale.
    Why is this bad?
        Each step with inf/NaN gradients halves the scale and skips the
        optimizer step; a collapsed scale means the run has been skipping steps
        (repeated overflow), usually from fp16 activations past 65504 or a
        learning rate that diverged. Training silently stops learning.
    Example
        model.half()  # an fp16 run whose gradients overflow at every step
        scaler.get_scale()  # 1.5e-05: the scale has halved and halved again
    Use instead
        model.float()
        with torch.autocast("cuda", dtype=torch.bfloat16):  # fp32's range: no loss scaling
            loss = model(**batch).loss
        loss.backward()
    Severity
        Warning: steps are being skipped, so the run has stopped learning, without an error.
    Fix safety
        No automatic fix: find the overflowing layer with ``mpdoctor.probe``
        (or ``%mpdoctor --probe batch``), then switch to bf16 where the hardware
        has it, or lower the learning rate.
    Sources
        DeepSpeed "Current loss scale already at minimum"; torch.amp.GradScaler docs.
    """
    for sc in facts.scalers:
        if not sc.enabled or sc.scale is None:
            continue
        if sc.scale < 1.0 or sc.scale < sc.init_scale * COLLAPSE_FACTOR:
            yield rule.finding(
                sc.name,
                f"{sc.name}'s loss scale is {sc.scale:g} (started at {sc.init_scale:g}): steps with inf/NaN "
                "gradients are being skipped, so the model has stopped learning.",
                {"scale": sc.scale, "init_scale": sc.init_scale, "growth_tracker": sc.growth_tracker},
            )


@check("scaler-not-restored-on-resume", Severity.WARNING,
       fix_safety=(Applicability.SAFE, Applicability.UNSAFE, Applicability.DISPLAY_ONLY))
def scaler_not_restored_on_resume(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A resumed run whose GradScaler state was not restored.

    What it does
        An enabled ``GradScaler`` at a fresh constructor's state (scale 2^16, growth tracker 0, nothing
        loaded, no loss scaled yet) beside an optimizer whose state says it has already taken N > 0 steps (its
        ``load_state_dict`` ran, the scaler's did not).
    Why is this bad?
        The scale restarts at 65536 instead of the value the run had settled at: every step whose scaled
        gradients overflow is skipped while the scale halves back down, so the first steps after resume
        train nothing (measured: 7 skipped steps when the run had settled at 512), and the growth
        counter restarts.
    Example
        ckpt = torch.load("last.pt")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler = torch.amp.GradScaler("cuda")  # fresh: scale 65536 again
    Use instead
        scaler.load_state_dict(ckpt["scaler"])
        # and when saving: checkpoint['scaler'] = scaler.state_dict()
    Severity
        Warning: measurable harm (skipped steps after resume), no crash. A scaler restored to exactly
        2^16 with a tracker of 0 is indistinguishable from a fresh one and harmless.
    Fix safety
        Where a GradScaler state is held in the namespace (a dict with exactly the keys
        ``GradScaler.state_dict()`` writes, such as ``ckpt["scaler"]`` of a loaded checkpoint, one or two
        levels deep), it is loaded into the live scaler in place (``scaler.load_state_dict(state)``; undo puts
        back the scaler's previous fields and scale tensors). Safe when one such state is held; unsafe, one fix
        per state, when several different ones are (which belongs to this run is the user's call). Where none
        is held (the checkpoint never saved it) it stays advice: save ``scaler.state_dict()`` with the
        checkpoint from now on.
    Sources
        PyTorch AMP examples, "Saving/Resuming"; torch.amp.GradScaler.state_dict docs.
    """
    resumed = [o for o in facts.optimizers if o.state_steps > 0]
    if not resumed:
        return
    for sc in facts.scalers:
        # A scaler that has scaled a loss in this run (its scale is set) started here: it was not resumed.
        if not sc.enabled or not sc.fresh or sc.scale is not None:
            continue
        opt = max(resumed, key=lambda o: o.state_steps)
        held = _held_states(facts)
        yield rule.finding(
            sc.name,
            f"{opt.name} has already taken {opt.state_steps:,} steps but {sc.name} is at a fresh constructor's state "
            f"(scale {sc.scale if sc.scale is not None else sc.init_scale:g}, growth tracker 0): if the run resumed from a "
            "checkpoint, the scaler's state was not restored, and the first steps after resume are skipped while the "
            "scale falls back to where it was." + _held_sentence(sc.name, held),
            {"optimizer": opt.name, "optimizer_steps": opt.state_steps, "scale": sc.scale, "init_scale": sc.init_scale,
             "held_states": [h.name for h in held]},  # fmt: skip
            [_load_state_fix(facts, sc, h, safe=len(held) == 1) for h in held] or [_restore_advice(sc)],
        )


def _held_states(facts: Facts) -> list[ScalerStateFacts]:
    """The scaler states the user holds that a load would restore something from (a fresh one restores nothing),
    one per distinct state."""
    out: list[ScalerStateFacts] = []
    for h in facts.scaler_states:
        key = (h.scale, h.growth_tracker, h.growth_factor, h.backoff_factor, h.growth_interval)
        if not h.fresh and all(key != (o.scale, o.growth_tracker, o.growth_factor, o.backoff_factor, o.growth_interval)
                               for o in out):  # fmt: skip
            out.append(h)
    return out


def _held_sentence(scaler: str, held: list[ScalerStateFacts]) -> str:
    if not held:
        return (" No GradScaler state is held among the objects inspected (the checkpoint did not save one), so there is "
                "nothing to load in place: save scaler.state_dict() with the checkpoint from now on.")  # fmt: skip
    if len(held) == 1:
        return f" {held[0].name} holds a saved state (scale {held[0].scale:g}): loading it into {scaler} restores it."
    names = ", ".join(f"{h.name} (scale {h.scale:g})" for h in held)
    return f" Several saved states are held ({names}): load the one of this run."


def _load_state_fix(facts: Facts, sc: ScalerFacts, held: ScalerStateFacts, safe: bool) -> Fix:
    subject = facts.subject(sc.name)
    return Fix(
        f"Load {held.name} into {sc.name} (scale {held.scale:g})",
        f"{sc.name}.load_state_dict({held.name})\n# and when saving: checkpoint['scaler'] = {sc.name}.state_dict()",
        applicability=Applicability.SAFE if safe else Applicability.UNSAFE,
        changes=(LoadScalerState(subject.inner_ref, held.ref, f"{sc.name}.load_state_dict({held.name})"),),
        recipe="restore-scaler-state",
    )


def _restore_advice(sc: ScalerFacts) -> Fix:
    return Fix(
        f"Restore {sc.name}'s state from the checkpoint",
        f"{sc.name}.load_state_dict(checkpoint['scaler'])\n"
        f"# and when saving: checkpoint['scaler'] = {sc.name}.state_dict()",
        applicability=Applicability.DISPLAY_ONLY,
        recipe="restore-scaler-state",
    )
