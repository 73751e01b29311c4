"""Mutation tests of the corrected loops: a loop mutated by one classic mistake must fail the execution check.

``tests/test_corrected_loops.py`` runs every corrected loop mpdoctor shows and passes it when it runs, breaks no
protocol rule and trains. Here each runtime rule's corrected lines (the live watcher's, in the user's names) and
the static reader's corrected loops are mutated in-process, one mistake at a time (clip before ``unscale_``, drop
``update()``, drop ``scaler.step``, ``optimizer.step()`` instead of ``scaler.step``, ``zero_grad`` before the step,
``update()`` out of the accumulation guard), and that check must fail on every mutant: a corrected template
rewritten to clip before ``unscale_`` can no longer pass the suite.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from corrected_loops import OPTIMIZER, SCALER, SCHEDULER, fails, in_a_loop
from test_corrected_loops import LOOP_RULES, MISTAKEN, corrected_loops

from mpdoctor.attach.runtime.protocol_rules import corrected_template

STEP = f"{SCALER}.step({OPTIMIZER})"


def _lines(code: str) -> list[str]:
    return code.splitlines()


def _index(lines: list[str], pattern: str) -> int | None:
    return next((i for i, line in enumerate(lines) if re.search(pattern, line)), None)


def swap_clip_and_unscale(code: str) -> str | None:
    lines = _lines(code)
    u, c = _index(lines, r"\.unscale_\("), _index(lines, r"clip_grad_norm_\(")
    if u is None or c is None or c != u + 1:
        return None
    indent_u = lines[u][: len(lines[u]) - len(lines[u].lstrip())]
    lines[u], lines[c] = indent_u + lines[c].lstrip(), indent_u + lines[u].lstrip()
    return "\n".join(lines) + "\n"


def drop_line(pattern: str) -> Callable[[str], str | None]:
    def mutate(code: str) -> str | None:
        lines = _lines(code)
        i = _index(lines, pattern)
        if i is None:
            return None
        indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
        lines[i] = indent + "pass"  # keeps the block valid
        return "\n".join(lines) + "\n"

    return mutate


def optimizer_step_instead(code: str) -> str | None:
    return code.replace(STEP, f"{OPTIMIZER}.step()") if STEP in code else None


def zero_grad_before_step(code: str) -> str | None:
    lines = _lines(code)
    z, s = _index(lines, r"\.zero_grad\(\)"), _index(lines, re.escape(STEP))
    if z is None or s is None or z < s:
        return None
    indent = lines[s][: len(lines[s]) - len(lines[s].lstrip())]
    moved = lines.pop(z)
    lines.insert(s, indent + moved.lstrip())
    return "\n".join(lines) + "\n"


def update_out_of_the_guard(code: str) -> str | None:
    lines = _lines(code)
    g, u = _index(lines, r"if \(i \+ 1\) % accum == 0:"), _index(lines, r"\.update\(\)")
    if g is None or u is None or u < g:
        return None
    guard_indent = lines[g][: len(lines[g]) - len(lines[g].lstrip())]
    moved = lines.pop(u)
    lines.append(guard_indent + moved.lstrip())  # after the guarded block, every micro-batch
    return "\n".join(lines) + "\n"


MUTATIONS: dict[str, Callable[[str], str | None]] = {
    "clip before unscale_": swap_clip_and_unscale,
    "no update()": drop_line(rf"{SCALER}\.update\(\)"),
    "no scaler.step": drop_line(re.escape(STEP)),
    "optimizer.step() instead of scaler.step": optimizer_step_instead,
    "zero_grad before the step": zero_grad_before_step,
    "update() every micro-batch": update_out_of_the_guard,
}


def mutants(code: str) -> list[tuple[str, str]]:
    """``(mutation, mutated code)`` for each mutation that applies to ``code`` and compiles."""
    out = []
    for name, mutate in MUTATIONS.items():
        mutated = mutate(code)
        if mutated is None or mutated == code:
            continue
        compile(mutated, "<mutant>", "exec")  # a mutant that does not compile would fail for the wrong reason
        out.append((name, mutated))
    return out


def survivors(code: str) -> list[str]:
    """The mutations of ``code`` that the execution check does not catch."""
    return [name for name, mutated in mutants(code) if not fails(mutated)]


@pytest.mark.parametrize("slug", LOOP_RULES)
def test_every_mutant_of_each_rules_corrected_lines_fails_the_execution_check(slug):
    code = in_a_loop(corrected_template(slug, SCALER, OPTIMIZER, SCHEDULER))
    assert not fails(code), "the unmutated loop must pass"
    found = mutants(code)
    assert len(found) >= 2, (slug, [name for name, _ in found])  # each template is mutated at least twice
    assert survivors(code) == [], slug


@pytest.mark.parametrize("case", ["clip-and-update-per-microbatch", "unscale-twice", "clip-and-bypass"])
def test_every_mutant_of_the_readers_corrected_loops_fails_the_execution_check(case):
    for slug, code in corrected_loops(MISTAKEN[case]):
        assert not fails(code)
        names = [name for name, _ in mutants(code)]
        assert "clip before unscale_" in names and "no update()" in names, names
        assert survivors(code) == [], (case, slug)


def test_the_harness_mutates_what_it_says():
    code = in_a_loop(corrected_template("amp-clip-before-unscale", SCALER, OPTIMIZER))
    swapped = swap_clip_and_unscale(code)
    assert swapped is not None
    assert swapped.index("clip_grad_norm_") < swapped.index(".unscale_(")
    dropped = drop_line(rf"{SCALER}\.update\(\)")(code)
    assert dropped is not None and f"{SCALER}.update()" not in dropped
