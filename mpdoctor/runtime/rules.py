"""The GradScaler protocol's rules, shared by the live protocol watcher and the static loop reader.

``scale(loss).backward()`` -> ``unscale_`` at most once per real step -> clipping -> ``scaler.step(opt)`` ->
``update()`` once per real step. Each rule has a stable slug (the finding's ``check``), a severity, a
one-line title, why it matters, and the corrected lines a finding shows as code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProtocolRule:
    """One rule of the AMP loop protocol."""

    slug: str
    severity: str
    title: str
    why: str
    corrected: str


RULES: dict[str, ProtocolRule] = {
    r.slug: r
    for r in (
        ProtocolRule(
            "amp-clip-before-unscale",
            "error",
            "Gradients clipped while still scaled",
            "clip_grad_norm_ on scaled gradients compares the scaled norm with max_norm: in real units the threshold "
            "is max_norm / scale (1/65536 of it at the default scale), so every step is shrunk far below the clipping "
            "the run asked for and training crawls.",
            "scaler.scale(loss).backward()\nscaler.unscale_(optimizer)\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\nscaler.step(optimizer)\nscaler.update()",
        ),
        ProtocolRule(
            "amp-step-bypasses-scaler",
            "error",
            "optimizer.step() applied to scaled gradients, bypassing scaler.step",
            "the update is multiplied by the loss scale (65536 by default) and inf/NaN steps are not skipped: "
            "the weights are destroyed in one step.",
            "scaler.scale(loss).backward()\nscaler.step(optimizer)  # unscales, skips inf/NaN steps\nscaler.update()",
        ),
        ProtocolRule(
            "amp-unscale-twice",
            "error",
            "unscale_ called again before update()",
            "GradScaler raises 'unscale_() has already been called on this optimizer since the last update()'; "
            "with gradient accumulation, unscale once, after the last micro-batch.",
            "for i, batch in enumerate(loader):\n    scaler.scale(loss_fn(model(batch)) / accum).backward()\n"
            "    if (i + 1) % accum == 0:\n        scaler.unscale_(optimizer)\n"
            "        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n"
            "        scaler.step(optimizer)\n        scaler.update()\n        optimizer.zero_grad()",
        ),
        ProtocolRule(
            "amp-update-missing",
            "error",
            "A step with no scaler.update()",
            "without update() the scale never adapts and the next step() raises 'step() has already been "
            "called since the last update()'.",
            "scaler.step(optimizer)\nscaler.update()",
        ),
        ProtocolRule(
            "amp-update-per-microbatch",
            "error",
            "scaler.update() called per micro-batch",
            "update() after a micro-batch with no scaler.step() raises 'No inf checks were recorded prior to "
            "update.' (an AssertionError); where it does not (a step per micro-batch), micro-batches are summed at "
            "different scales.",
            "if (i + 1) % accum == 0:\n    scaler.step(optimizer)\n    scaler.update()\n    optimizer.zero_grad()",
        ),
        ProtocolRule(
            "amp-scheduler-on-skipped-steps",
            "warning",
            "The LR scheduler steps on skipped optimizer steps",
            "every skipped step still advances the schedule, so warm-up ends early and the run follows a "
            "different learning-rate curve than the one configured.",
            "scale_before = scaler.get_scale()\nscaler.step(optimizer)\nscaler.update()\n"
            "if scaler.get_scale() >= scale_before:  # the step was not skipped\n    scheduler.step()",
        ),
        ProtocolRule(
            "amp-scale-unsettled",
            "warning",
            "The loss scale never settles",
            "a high share of skipped steps means the run trains on a fraction of its batches; the parameters "
            "with inf/NaN gradients on the overflow steps are where the overflow starts.",
            "# find the layer that overflows: mpdoctor.probe(model, batch)",
        ),
        ProtocolRule(
            "scaler-not-restored-on-resume",
            "warning",
            "A resumed run whose GradScaler state was not restored",
            "the optimizer says it has taken N > 0 steps while the scaler is fresh: the scale restarts at "
            "65536 and the first steps after resume are skipped until it falls again.",
            "scaler.load_state_dict(checkpoint['scaler'])\n# and when saving: checkpoint['scaler'] = scaler.state_dict()",
        ),
    )
}
