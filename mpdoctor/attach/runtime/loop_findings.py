"""The findings of the loop reader: each :class:`LoopMistake` as a :class:`Finding` naming its cell and line.

Findings name the cell and line (``cell [7], line 12``, ``train.py:12``) and carry, as a display-only fix, the
user's own loop with the corrected lines (:mod:`mpdoctor.attach.runtime.loop_rewrite`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence

from ...objects.readers.loop_source import Source, source_of
from ...rules.engine.findings import Finding
from ...rules.engine.merge import mistake_key
from .loop_interpreter import LoopMistake, LoopReader, Names
from .loop_rewrite import corrected_code, corrected_lines
from .protocol_rules import RULES

_WHAT = {
    "amp-clip-before-unscale": "{code} clips {scaler}'s scaled gradients (scaled backward {scaled_backward}; no {scaler}.unscale_ before it)",
    "amp-step-bypasses-scaler": "{code} steps on gradients {scaler} scaled ({scaled_backward}), bypassing {scaler}.step",
    "amp-unscale-twice": "{code} runs again before {scaler}.update() (first {first_unscale})",
    "amp-update-missing": "{code} runs again with no {scaler}.update() since its step {previous_step}",
    "amp-update-per-microbatch": "{code} runs every micro-batch while {scaler}.step runs once per accumulated step "
    "({guarded_step})",
    "amp-scheduler-on-skipped-steps": "{code} steps the schedule after every {scaler}.step ({scaler_step}), also on "
    "the steps the scaler skips; harmless while no step is skipped (an fp16 run skips its first few while the scale falls)",
}


def to_finding(
    mistake: LoopMistake,
    scales: Mapping[str, float] | None = None,
    others: Sequence[LoopMistake] = (),
    names: Names | None = None,
) -> Finding:
    """The :class:`Finding` for a mistake: the rule's slug and severity, the cell and line, the corrected lines.

    ``scales`` maps scaler names to the live scaler's scale (its ``init_scale`` before its first step), when the
    reader has the namespace; a message about the scale then quotes it instead of the default's 65536.
    """
    from ...rules.engine.fixes import Applicability, Fix

    rule = RULES[mistake.slug]
    severity = "info" if mistake.slug == "amp-scheduler-on-skipped-steps" or mistake.latent else rule.severity
    at = mistake.at.location
    related = {
        k: ("on the previous iteration" if v.node is mistake.at.node else f"at {v.location}")
        for k, v in mistake.related.items()
    }
    what = _WHAT[mistake.slug].format(code=f"`{at.code}`", scaler=mistake.scaler or "the scaler", **related)
    latent = (
        f" ({mistake.scaler} is created with enabled=False: harmless until it is enabled)" if mistake.latent else ""
    )
    scale = (scales or {}).get(mistake.scaler or "")
    scale_text = f"{scale:g} now" if scale is not None else "65536 to start, by default"
    why = _WHY.get(mistake.slug, rule.why).format(scale=scale_text)
    why = re.sub(r"\bscaler\b", mistake.scaler or "scaler", why)  # the rule's words, in the user's names
    why = re.sub(r"\boptimizer\b", mistake.optimizer or "optimizer", why)
    message = f"{at}: {what}{latent}; {why}"
    fixed = corrected_code(mistake, others)  # before the evidence: rewriting a clip names the optimizer it unscales
    fixed = settled(fixed, names) if names is not None else fixed
    evidence = {
        "cell": at.place,
        "line": at.line,
        "code": at.code,
        "scaler": mistake.scaler,
        **({"optimizer": mistake.optimizer} if mistake.optimizer else {}),
        **{k: v.location.label for k, v in mistake.related.items()},
    }
    span = corrected_lines(mistake)
    if span is not None:  # what the corrected lines replace: a script's unified diff is made from it
        evidence["replaces lines"] = f"{span[0]}-{span[1]}"
    title = _FIX_TITLE[mistake.slug].format(scaler=mistake.scaler, opt=mistake.optimizer or "optimizer", where=at)
    fix = Fix(title, fixed, applicability=Applicability.DISPLAY_ONLY, recipe=mistake.slug, slug=mistake.slug)
    fix.finding_subject = at.label
    return Finding(
        check=mistake.slug, severity=severity, subject=at.label, message=message, evidence=evidence, fixes=[fix]
    )


#: Rounds of reading a corrected loop again: each round fixes what the previous fixes left (an unscale_ put
#: before a clip inside an accumulation loop must then move under the guard).
SETTLE_ROUNDS = 3


def settled(code: str, names: Names) -> str:
    """``code`` (a corrected loop) read again and corrected until the reader finds no mistake in it.

    Parameters
    ----------
    code : str
        The corrected lines.
    names : Names
        What the code read before bound (the scaler, the optimizer): the corrected loop names them only.

    Returns
    -------
    str
        The loop with every mistake the reader knows fixed, or ``code`` when a round changes nothing.
    """
    for _ in range(SETTLE_ROUNDS):
        source = source_of("<corrected>", code)
        if source is None:
            return code
        reader = LoopReader(names.copy())
        try:
            reader.read(source)
        except (RecursionError, MemoryError, ValueError, TypeError, AttributeError):  # as read_sources does
            return code
        # The corrected lines' own mistakes: the functions of other cells are neither read on their own nor
        # rewritten here (a mistake inside a function the loop calls is that function's cell's to correct).
        mistakes = [m for m in reader.finish(standalone=False)
                    if m.slug != "amp-scheduler-on-skipped-steps" and m.at.source is source]  # info: kept as written  # fmt: skip
        if not mistakes:
            return code
        again = corrected_code(mistakes[0], mistakes)
        if again == code:
            return code
        code = again
    return code


#: Measured on this CPU where it differs from the shared rule's text: a 0.1 clip on scaled gradients bites on
#: every step, then scaler.step divides the clipped gradient by the scale again (tests/test_loop_reader.py).
_WHY = {
    "amp-clip-before-unscale": "the norm it measures is the true norm x the scale ({scale}), so it clips at "
    "max_norm x scale: almost every step is clipped to max_norm, then scaler.step divides that by the scale again, and "
    "the update is thousands of times too small (with a very small scale the clip never bites)",
}

_FIX_TITLE = {
    "amp-clip-before-unscale": "Call {scaler}.unscale_({opt}) before clipping ({where})",
    "amp-step-bypasses-scaler": "Step through {scaler}.step({opt}) ({where})",
    "amp-unscale-twice": "Unscale once per real step, after the last micro-batch ({where})",
    "amp-update-missing": "Call {scaler}.update() after every {scaler}.step ({where})",
    "amp-update-per-microbatch": "Call {scaler}.update() once per real step, beside {scaler}.step ({where})",
    "amp-scheduler-on-skipped-steps": "Step the scheduler only when {scaler} did not skip the step ({where})",
}


def read_sources(
    sources: Iterable[Source], names: Names | None = None, scales: Mapping[str, float] | None = None
) -> list[Finding]:
    """The protocol mistakes in ``sources`` read in order (names bound by earlier ones are known to later ones).

    Parameters
    ----------
    sources : iterable of Source
        Cells in execution order, or one script.
    names : Names, optional
        Bindings known beforehand.
    scales : mapping of str to float, optional
        The live scale of each scaler the namespace holds by name (see :func:`to_finding`).

    Returns
    -------
    list of Finding
        One per mistake, each naming its cell and line, with the corrected lines as a display-only fix.
        The same mistake in a cell run again is reported once, at its latest run.
    """
    reader = LoopReader(names)
    for source in sources:
        saved = reader.state.copy()
        try:
            reader.read(source)
        except (
            RecursionError,
            MemoryError,
            ValueError,
            TypeError,
            AttributeError,
        ):  # a pathological cell is skipped
            reader.state = saved
            reader.reset_walk()
    latest: dict[tuple[str, int, str], LoopMistake] = {}
    for mistake in reader.finish():  # a cell run again: report its latest run only
        key = (mistake.slug, mistake.at.line, mistake.at.source.code)
        latest.pop(key, None)
        latest[key] = mistake
    # One mistake is one finding (treatment.merge): the same line run again in a later cell is kept at its latest.
    by_mistake: dict = {}
    mistakes = list(latest.values())  # each corrected loop also fixes the other mistakes of its loop
    for finding in (to_finding(mistake, scales, mistakes, reader.names) for mistake in mistakes):
        key = mistake_key(finding) or id(finding)
        by_mistake.pop(key, None)
        by_mistake[key] = finding
    findings = list(by_mistake.values())
    findings.sort(key=lambda f: f.rank)  # stable: in reading order within a severity
    return findings


def read_code(code: str, file: str = "<code>") -> list[Finding]:
    """The protocol mistakes in one code string (never executed), named as lines of ``file``."""
    source = source_of(file, code)
    return read_sources([source]) if source is not None else []


def in_the_users_loop(findings: Sequence[Finding], sources: Sequence[Source]) -> list[Finding]:
    """``findings`` of the loop watcher, each with the user's own loop corrected where the reader finds the same
    mistake in ``sources`` (the code that ran): the rule's template names objects the user may not have
    (``loader``, ``loss_fn``, ``max_norm``), the reader's corrected lines are the user's, every mistake of the
    loop fixed. One mistake keeps one fix; a finding the reader does not see keeps the template."""
    if not findings or not sources:
        return list(findings)
    try:
        read = {mistake_key(r): r for r in read_sources(sources)}
    except Exception:  # the watcher's own lines stand
        return list(findings)
    read.pop(None, None)
    out = []
    for f in findings:
        mine = read.get(mistake_key(f))
        out.append(dataclasses.replace(f, fixes=list(mine.fixes)) if mine is not None and mine.fixes else f)
    return out
