"""The GradScaler protocol's rules, shared by the live protocol watcher and the static loop reader.

``scale(loss).backward()`` -> ``unscale_`` at most once per real step -> clipping -> ``scaler.step(opt)`` ->
``update()`` once per real step. Each rule is a :class:`~mpdoctor.rules.engine.rules.Rule` of kind ``runtime``:
a stable slug (the finding's ``check``), its severity, a one-line title, why it is bad, the mistaken loop as
an example, and the corrected lines (``use_instead``) a finding shows as display-only code. The resumed run
whose scaler state was not restored is also a check at rest; both read the check's rule.
"""

from __future__ import annotations

import re

from ...rules.checks.scaler import scaler_not_restored_on_resume
from ...rules.engine.findings import Severity
from ...rules.engine.rules import Applicability, Rule, RuleKind, register

_AMP_EXAMPLES = "PyTorch docs, CUDA Automatic Mixed Precision examples (https://pytorch.org/docs/stable/notes/amp_examples.html)"
_GRAD_SCALER = "torch/amp/grad_scaler.py (GradScaler.unscale_, step, update)"
_DISPLAY = (Applicability.DISPLAY_ONLY,)
_DISPLAY_NOTE = ("Display-only: the loop is the user's code; the finding names its line and shows the corrected "
                 "lines to put there. Nothing is changed in place.")  # fmt: skip


_SEVERITY_NOTES = {
    Severity.ERROR: "Error: the loop raises, or its updates are wrong.",
    Severity.WARNING: "Warning: the run trains, but not as configured.",
}


def _runtime(slug: str, severity: Severity, title: str, detects: str, why: str, example: str, use_instead: str,
             sources: str) -> Rule:  # fmt: skip
    return register(Rule(slug=slug, title=title, kind=RuleKind.RUNTIME, severities=(severity,), why=why,
                         example=example, use_instead=use_instead, fix_safety=_DISPLAY,
                         fix_safety_note=_DISPLAY_NOTE, sources=sources, detects=detects,
                         severity_note=_SEVERITY_NOTES[severity]))  # fmt: skip


#: The protocol's rules by slug.
RULES: dict[str, Rule] = {
    r.slug: r
    for r in (
        _runtime(
            "amp-clip-before-unscale",
            Severity.ERROR,
            "Gradients clipped while still scaled",
            'In a watched loop, or a cell or script read: clip_grad_norm_ / clip_grad_value_ on the parameters of an optimizer whose GradScaler has scaled the loss but not yet unscaled it.',
            "clip_grad_norm_ on scaled gradients compares the scaled norm with max_norm: in real units the threshold "
            "is max_norm / scale (1/65536 of it at the default scale), so every step is shrunk far below the clipping "
            "the run asked for and training crawls.",
            "scaler.scale(loss).backward()\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # the gradients are still scaled\n"
            "scaler.step(optimizer)\nscaler.update()",
            "scaler.scale(loss).backward()\nscaler.unscale_(optimizer)\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\nscaler.step(optimizer)\nscaler.update()",
            f"{_AMP_EXAMPLES}, 'Working with Unscaled Gradients: Gradient clipping'.",
        ),
        _runtime(
            "amp-step-bypasses-scaler",
            Severity.ERROR,
            "optimizer.step() applied to scaled gradients, bypassing scaler.step",
            'optimizer.step() called directly on gradients a GradScaler scaled, instead of scaler.step(optimizer).',
            "the update is multiplied by the loss scale (65536 by default) and inf/NaN steps are not skipped: "
            "the weights are destroyed in one step.",
            "scaler.scale(loss).backward()\noptimizer.step()  # the gradients are 65536 times too large\n"
            "scaler.update()",
            "scaler.scale(loss).backward()\nscaler.step(optimizer)  # unscales, skips inf/NaN steps\nscaler.update()",
            f"{_AMP_EXAMPLES}, 'Typical Mixed Precision Training'; {_GRAD_SCALER}.",
        ),
        _runtime(
            "amp-unscale-twice",
            Severity.ERROR,
            "unscale_ called again before update()",
            'scaler.unscale_(optimizer) called a second time on one optimizer before scaler.update(), typically once per micro-batch under gradient accumulation, '
            "or after an iteration that skipped the step (a `continue` on a large grad norm) and the update() with it: the loop's source names that line.",
            "GradScaler raises 'unscale_() has already been called on this optimizer since the last update()'; "
            "with gradient accumulation, unscale once, after the last micro-batch; when a step is skipped, call update() anyway.",
            "for i, batch in enumerate(loader):\n    scaler.scale(loss_fn(model(batch)) / accum).backward()\n"
            "    scaler.unscale_(optimizer)  # every micro-batch\n"
            "    if (i + 1) % accum == 0:\n        scaler.step(optimizer)\n        scaler.update()",
            "for i, batch in enumerate(loader):\n    scaler.scale(loss_fn(model(batch)) / accum).backward()\n"
            "    if (i + 1) % accum == 0:\n        scaler.unscale_(optimizer)\n"
            "        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n"
            "        scaler.step(optimizer)\n        scaler.update()\n        optimizer.zero_grad()",
            f"{_AMP_EXAMPLES}, 'Gradient accumulation'; {_GRAD_SCALER}.",
        ),
        _runtime(
            "amp-update-missing",
            Severity.ERROR,
            "A step with no scaler.update()",
            'scaler.step(optimizer) followed by another scaler.step with no scaler.update() between them.',
            "without update() the scale never adapts and the next step() raises 'step() has already been "
            "called since the last update()'.",
            "scaler.scale(loss).backward()\nscaler.step(optimizer)\noptimizer.zero_grad()  # no scaler.update()",
            "scaler.step(optimizer)\nscaler.update()",
            f"{_AMP_EXAMPLES}, 'Typical Mixed Precision Training'; {_GRAD_SCALER}.",
        ),
        _runtime(
            "amp-update-per-microbatch",
            Severity.ERROR,
            "scaler.update() called per micro-batch",
            'scaler.update() called after micro-batches on which no scaler.step ran (update inside the accumulation loop).',
            "update() after a micro-batch with no scaler.step() raises 'No inf checks were recorded prior to "
            "update.' (an AssertionError); where it does not (a step per micro-batch), micro-batches are summed at "
            "different scales.",
            "scaler.scale(loss / accum).backward()\nscaler.update()  # every micro-batch\n"
            "if (i + 1) % accum == 0:\n    scaler.step(optimizer)",
            "if (i + 1) % accum == 0:\n    scaler.step(optimizer)\n    scaler.update()\n    optimizer.zero_grad()",
            f"{_AMP_EXAMPLES}, 'Gradient accumulation'; {_GRAD_SCALER}.",
        ),
        _runtime(
            "amp-step-missing",
            Severity.ERROR,
            "scaler.update() with no scaler.step(optimizer) in the loop",
            'A loop that scales the loss and calls scaler.update() but never scaler.step(optimizer) (nor optimizer.step()).',
            "the optimizer never steps, so nothing trains; GradScaler asserts 'No inf checks were recorded prior to "
            "update.' at the first update().",
            "scaler.scale(loss).backward()\nscaler.update()  # no scaler.step(optimizer) before it",
            "scaler.scale(loss).backward()\nscaler.step(optimizer)\nscaler.update()",
            f"{_AMP_EXAMPLES}, 'Typical Mixed Precision Training'; {_GRAD_SCALER}.",
        ),
        _runtime(
            "amp-scheduler-on-skipped-steps",
            Severity.WARNING,
            "The LR scheduler steps on skipped optimizer steps",
            'An LR scheduler stepped on every iteration while GradScaler skipped optimizer steps on inf/NaN gradients.',
            "every skipped step still advances the schedule, so warm-up ends early and the run follows a "
            "different learning-rate curve than the one configured.",
            "scaler.step(optimizer)  # skipped when the gradients overflowed\nscaler.update()\n"
            "scheduler.step()  # advances anyway",
            "scale_before = scaler.get_scale()\nscaler.step(optimizer)\nscaler.update()\n"
            "if scaler.get_scale() >= scale_before:  # the step was not skipped\n    scheduler.step()",
            "torch/optim/lr_scheduler.py (the 'Detected call of `lr_scheduler.step()` before `optimizer.step()`' "
            f"warning a skipped first step raises); {_GRAD_SCALER}.",
        ),
        _runtime(
            "amp-scale-unsettled",
            Severity.WARNING,
            "The loss scale never settles",
            'Over a watched run, a high share of optimizer steps skipped by the GradScaler: the loss scale keeps falling back instead of settling.',
            "a high share of skipped steps means the run trains on a fraction of its batches; the parameters "
            "with inf/NaN gradients on the overflow steps are where the overflow starts.",
            "model.half()\nfor batch in loader:  # half of the steps overflow and are skipped\n"
            "    scaler.scale(loss_fn(model(batch))).backward()\n    scaler.step(optimizer)\n    scaler.update()",
            "# find the layer that overflows: mpdoctor.probe(model, batch)",
            f"{_AMP_EXAMPLES}; {_GRAD_SCALER} (growth_interval, backoff_factor).",
        ),
        scaler_not_restored_on_resume.rule,
    )
}


def in_names(text: str, scaler: str = "", optimizer: str = "", scheduler: str = "") -> str:
    """``text`` (a rule's title or corrected lines) with ``scaler`` / ``optimizer`` / ``scheduler`` replaced by the
    names the user gave the objects (an empty name keeps the generic word)."""
    names = {"scaler": scaler or "scaler", "optimizer": optimizer or "optimizer", "scheduler": scheduler or "scheduler"}
    # One pass over the three names: a user's optimizer called ``scaler`` must not be renamed twice.
    return re.sub(r"\b(scaler|optimizer|scheduler)\b", lambda m: names[m.group(1)], text)


def corrected_template(slug: str, scaler: str = "", optimizer: str = "", scheduler: str = "") -> str:
    """The rule's corrected lines (``use_instead``) with the names the user holds the objects by.

    Parameters
    ----------
    slug : str
        A runtime rule's slug.
    scaler, optimizer, scheduler : str
        The user's names; an empty name keeps the template's (``scaler``, ``optimizer``, ``scheduler``).

    Returns
    -------
    str
        The code, ending with a newline.
    """
    return in_names(RULES[slug].use_instead, scaler, optimizer, scheduler) + "\n"
