"""Every corrected loop mpdoctor shows is executed: it runs, breaks no rule of the protocol, and trains.

Two sources of corrected loops: the static reader rewrites the user's own loop (``runtime/loop_rewrite.py``, read
again until no mistake is left), and the live watcher shows each rule's corrected lines in the user's names
(``runtime/protocol_rules.py``, ``corrected_template``). A loop with two mistakes is corrected for both at once, and the
user's stale ``# mistake`` comments are gone from the corrected lines.
"""

from __future__ import annotations

import re

import pytest
from corrected_loops import OPTIMIZER, SCALER, SCHEDULER, fails, in_a_loop, run_and_check

from mpdoctor.attach.runtime.loop_findings import read_code
from mpdoctor.attach.runtime.protocol_rules import RULES, corrected_template

SETUP = f"""\
import torch
{SCALER} = torch.amp.GradScaler("cpu", init_scale=1024.0)
{OPTIMIZER} = torch.optim.SGD(model.parameters(), lr=0.05)
{SCHEDULER} = torch.optim.lr_scheduler.LambdaLR({OPTIMIZER}, lambda s: 0.9 ** s)
"""

#: A mistaken loop per rule the reader rewrites, plus loops with two mistakes; each line's comment is stale once
#: the line is corrected.
MISTAKEN = {
    "clip-before-unscale": f"""\
for x, y in data:
    {OPTIMIZER}.zero_grad()
    {SCALER}.scale(loss_fn(model(x), y)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # mistake: clipped while scaled
    {SCALER}.step({OPTIMIZER})
    {SCALER}.update()
""",
    "step-bypasses-scaler": f"""\
for x, y in data:
    {OPTIMIZER}.zero_grad()
    {SCALER}.scale(loss_fn(model(x), y)).backward()
    {OPTIMIZER}.step()  # mistake: bypasses the scaler
    {SCALER}.update()
""",
    "unscale-twice": f"""\
for i, (x, y) in enumerate(data):
    {SCALER}.scale(loss_fn(model(x), y) / accum).backward()
    {SCALER}.unscale_({OPTIMIZER})  # mistake: every micro-batch
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if (i + 1) % accum == 0:
        {SCALER}.step({OPTIMIZER})
        {SCALER}.update()
        {OPTIMIZER}.zero_grad()
""",
    "unscale-twice-skip-exit": f"""\
for i, (x, y) in enumerate(data):
    {OPTIMIZER}.zero_grad()
    {SCALER}.scale(loss_fn(model(x), y)).backward()
    {SCALER}.unscale_({OPTIMIZER})  # mistake: the skip below leaves without update()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if i == 0 or not torch.isfinite(grad_norm):  # the norm decides: the unscale and the clip cannot move past it
        continue
    {SCALER}.step({OPTIMIZER})
    {SCALER}.update()
""",
    "update-missing": f"""\
for x, y in data:
    {OPTIMIZER}.zero_grad()
    {SCALER}.scale(loss_fn(model(x), y)).backward()
    {SCALER}.step({OPTIMIZER})  # mistake: no update after it
""",
    "update-per-microbatch": f"""\
for i, (x, y) in enumerate(data):
    {SCALER}.scale(loss_fn(model(x), y) / accum).backward()
    if (i + 1) % accum == 0:
        {SCALER}.step({OPTIMIZER})
        {OPTIMIZER}.zero_grad()
    {SCALER}.update()  # mistake: every micro-batch
""",
    "clip-and-update-per-microbatch": f"""\
for i, (x, y) in enumerate(data):
    {SCALER}.scale(loss_fn(model(x), y) / accum).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # mistake: clipped while scaled
    if (i + 1) % accum == 0:
        {SCALER}.step({OPTIMIZER})
        {OPTIMIZER}.zero_grad()
    {SCALER}.update()  # mistake: every micro-batch
""",
    "bypass-without-update": f"""\
for x, y in data:
    {OPTIMIZER}.zero_grad()
    {SCALER}.scale(loss_fn(model(x), y)).backward()
    {OPTIMIZER}.step()  # mistake: bypasses the scaler, and nothing updates its scale
""",
    "clip-and-bypass": f"""\
for x, y in data:
    {OPTIMIZER}.zero_grad()
    {SCALER}.scale(loss_fn(model(x), y)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # mistake: clipped while scaled
    {OPTIMIZER}.step()  # mistake: bypasses the scaler
    {SCALER}.update()
""",
}


def corrected_loops(loop: str) -> list[tuple[str, str]]:
    """``(slug, corrected code)`` of every finding the reader makes on ``loop`` (after the setup lines)."""
    findings = read_code(SETUP + loop, "train.py")
    return [(f.check, f.fixes[0].code) for f in findings if f.severity in ("error", "warning")]


@pytest.mark.parametrize("case", sorted(MISTAKEN))
def test_the_mistaken_loop_really_fails_the_check(case):
    assert fails(MISTAKEN[case]), f"{case}: the mistaken loop passes run_and_check; the check proves nothing"


@pytest.mark.parametrize("case", sorted(MISTAKEN))
def test_every_corrected_loop_the_reader_shows_runs_and_trains_and_keeps_no_mistake(case):
    loops = corrected_loops(MISTAKEN[case])
    assert loops, f"{case}: no finding"
    for slug, code in loops:
        assert "# mistake" not in code, code
        run_and_check(code)
        # read again, the corrected loop holds no mistake the reader knows
        assert corrected_loops(code) == [], (slug, code)


def test_a_loop_with_two_mistakes_is_corrected_for_both_in_each_findings_loop():
    loops = corrected_loops(MISTAKEN["clip-and-update-per-microbatch"])
    assert sorted(slug for slug, _ in loops) == ["amp-clip-before-unscale", "amp-update-per-microbatch"]
    for _, code in loops:
        lines = [line.strip() for line in code.splitlines()]
        guard = lines.index("if (i + 1) % accum == 0:")
        unscale = next(i for i, line in enumerate(lines) if line.startswith(f"{SCALER}.unscale_({OPTIMIZER})"))
        clip = next(i for i, line in enumerate(lines) if line.startswith("torch.nn.utils.clip_grad_norm_"))
        step = lines.index(f"{SCALER}.step({OPTIMIZER})")
        update = next(i for i, line in enumerate(lines) if line.startswith(f"{SCALER}.update()"))
        assert guard < unscale < clip < step < update, code  # under the guard, in the protocol's order


#: A script of two functions that step the same scaler: the mistaken loop's step is nested deeper than the other
#: function's, which a walk of the whole script reaches first.
TWO_FUNCTIONS = f"""\
def train():
    for i, (x, y) in enumerate(data):
        {SCALER}.scale(loss_fn(model(x), y) / accum).backward()
        {SCALER}.unscale_({OPTIMIZER})  # mistake: every micro-batch
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if (i + 1) % accum == 0:
            {SCALER}.step({OPTIMIZER})
            {SCALER}.update()
            {OPTIMIZER}.zero_grad()


def finetune(head_opt):
    for x, y in data:
        head_opt.zero_grad()
        {SCALER}.scale(loss_fn(model(x), y)).backward()
        {SCALER}.step(head_opt)
        {SCALER}.update()
"""


def test_a_mistaken_loop_is_corrected_within_its_own_function_not_in_another_that_steps_the_same_scaler():
    ((_, code),) = corrected_loops(TWO_FUNCTIONS)
    assert "head_opt" not in code and "def finetune" not in code, code
    run_and_check(code)


#: The runtime rules whose corrected lines are a loop step (the others are advice: probe the model, restore
#: the scaler from a checkpoint).
LOOP_RULES = sorted(slug for slug in RULES if slug not in ("amp-scale-unsettled", "scaler-not-restored-on-resume"))


@pytest.mark.parametrize("slug", LOOP_RULES)
def test_the_watchers_corrected_lines_for_each_rule_run_and_train_in_the_users_names(slug):
    code = corrected_template(slug, SCALER, OPTIMIZER, SCHEDULER)
    assert "scaler." not in code.replace(f"{SCALER}.", "") and "optimizer" not in code.replace("zero_grad", "")
    run_and_check(in_a_loop(code))


def test_the_watchers_example_of_each_rule_fails_the_same_check():
    """The rule's Example is the mistake: the check that passes the corrected lines fails it."""
    for slug in LOOP_RULES:
        if slug == "amp-scheduler-on-skipped-steps":
            continue  # harmless while no step is skipped: its harm needs an overflowing model
        example = re.sub(r"\bscaler\b", SCALER, re.sub(r"\boptimizer\b", OPTIMIZER, RULES[slug].example))
        assert fails(in_a_loop(example)), slug
