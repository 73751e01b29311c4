"""The modules an fp16 overflow passes through, measured, and the smallest set of them that makes the forward finite
when kept in fp32.

Keeping only the overflowing module in fp32 is not enough in a model that runs in fp16 without autocast (no bf16 on a
T4 or a V100): its output, cast back to fp16, overflows again, and in a pre-norm transformer the residual stream that
receives it carries the value past 65504 through every later block, up to the final norm. What ``_keep_in_fp32_modules``
does for T5's ``wo`` and the fp32-residual recipes do by hand, this finds by running the model:

1. the model's call (one decoding step of ``generate``) is run once with the half weights temporarily in fp32 (the
   very tensors given back), recording each module's largest output and the order modules start and end;
2. the span: the outermost modules whose fp32 output passes 65504 (those the overflow passes through), and after
   each, the module that receives its output when that one is back in range (the final norm), whose output is cast
   back to the compute dtype;
3. the candidates, smallest first (that span; the span's common ancestor with its output cast back; the whole model)
   are each kept in fp32 on the live model, the call run in its own dtype, the change undone: the first whose every
   module output is finite is the answer. At most three rounds; none finite: no span.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ...objects.gathering.values import FP16_MAX

_HALF = (torch.float16, torch.bfloat16)

#: A span: ``(path, cast_to)`` per module kept in fp32; ``cast_to`` is the dtype its output is cast to ("" for none).
Span = tuple[tuple[str, str], ...]


@dataclass
class _Run:
    path: str
    start: int
    end: int = -1
    absmax: float = 0.0
    finite: bool = True


@contextlib.contextmanager
def _weights_in_fp32(model: torch.nn.Module) -> Iterator[None]:
    """The model's half parameters and buffers in fp32 while the block runs; the very tensors back after it."""
    saved = []
    try:
        for t in (*model.parameters(), *model.buffers()):
            if t.dtype in _HALF:
                saved.append((t, t.data))
                t.data = t.data.float()
        yield
    finally:
        for t, data in saved:
            t.data = data


def _recorded(model: torch.nn.Module, call: Callable[[], Any]) -> list[_Run] | None:
    """Each module's run (its first call's order, its largest finite output over every call, whether every output
    was finite) while ``call`` runs; None when the call raised."""
    runs: dict[str, _Run] = {}
    clock = [0]
    handles = []

    def pre(path: str) -> Callable:
        def hook(module: torch.nn.Module, args: Any) -> None:
            clock[0] += 1
            runs.setdefault(path, _Run(path, clock[0]))

        return hook

    def post(path: str) -> Callable:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            clock[0] += 1
            run = runs[path]
            if run.end < 0:
                run.end = clock[0]
            for t in _floating(out):
                finite = torch.isfinite(t)
                if not bool(finite.all()):
                    run.finite = False
                if t.numel():
                    run.absmax = max(run.absmax, float(torch.where(finite, t, 0).abs().max()))

        return hook

    for path, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(pre(path)))
        handles.append(module.register_forward_hook(post(path)))
    try:
        with torch.no_grad():
            call()
    except Exception:  # a call that does not run here is no measurement: the caller offers no span
        return None
    finally:
        for h in handles:
            h.remove()
    return sorted(runs.values(), key=lambda r: r.start)


def _floating(value: Any, depth: int = 2) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value.detach()
    elif depth and isinstance(value, (tuple, list)):
        for item in value:
            yield from _floating(item, depth - 1)
    elif depth and hasattr(value, "to_tuple"):  # a library's output object (logits, hidden states)
        yield from _floating(value.to_tuple(), depth - 1)


def _inside(path: str, outer: str) -> bool:
    return not outer or path == outer or path.startswith(outer + ".")


def measured_span(runs: list[_Run], first: str, dtype: str) -> Span:
    """The span from the fp32 run: the outermost modules (the root aside) whose output passed 65504, each followed by
    the module that starts after it ends when that one's output is back in range (cast to ``dtype``); only the
    overflowing module ``first`` (its output cast to ``dtype``) when no output passed 65504 in fp32 (the overflow
    was inside it)."""
    over = [r for r in runs if r.path and r.absmax > FP16_MAX]
    tops = [r for r in over if not any(o is not r and _inside(r.path, o.path) for o in over)]
    if not tops:
        return ((first, dtype),)
    span: list[tuple[str, str]] = []
    top_paths = {r.path for r in tops}
    for top in tops:
        span.append((top.path, ""))
        after = next((r for r in runs if r.start > top.end and r.path and not _inside(r.path, top.path)), None)
        if after is not None and after.path not in top_paths and after.absmax <= FP16_MAX:
            span.append((after.path, dtype))
    return tuple(dict.fromkeys(span))


def _ancestor(span: Span, dtype: str) -> Span:
    """The span's innermost common ancestor below the root, its output cast to ``dtype`` (empty: only the root)."""
    parts = [p.split(".") for p, _ in span]
    common = []
    for names in zip(*parts):
        if len(set(names)) != 1:
            break
        common.append(names[0])
    path = ".".join(common)
    if path in {p for p, _ in span} and len(span) == 1:
        path = path.rpartition(".")[0]
    return ((path, dtype),) if path else ()


def _finite_with(model: torch.nn.Module, span: Span, call: Callable[[], Any]) -> bool:
    """Whether every module output is finite when ``call`` runs with ``span`` kept in fp32 (applied, then undone)."""
    from ...objects.live import Live
    from ...rules.engine.changes import KeepModuleFp32

    live = Live()
    ref = live.add(model)
    device = next(model.parameters()).device.type
    done = []
    try:
        for path, cast_to in span:
            module = model.get_submodule(path) if path else model
            ids = frozenset(id(p) for p in module.parameters())
            for step in KeepModuleFp32(ref, path, ids, device, (), path or "model", cast_to=cast_to).bind(live):
                step.apply()
                done.append(step)
        runs = _recorded(model, call)
    finally:
        for step in reversed(done):
            step.revert()
    return runs is not None and all(r.finite for r in runs)


def overflow_span(model: torch.nn.Module, call: Callable[[], Any], first: str) -> Span:
    """The smallest span of ``model`` that, kept in fp32, makes ``call`` finite (see the module docstring); empty
    when the model holds no half weights, when the call does not run, or when no candidate cures it in three rounds.
    ``first`` is the module the probe named; the model and the RNG streams are left as they were."""
    half = next((p.dtype for p in model.parameters() if p.dtype in _HALF), None)
    if half is None:
        return ()
    dtype = str(half).removeprefix("torch.")
    rng = torch.get_rng_state()
    try:
        with _weights_in_fp32(model):
            runs = _recorded(model, call)
        if runs is None:
            return ()
        span = measured_span(runs, first, dtype)
        for candidate in dict.fromkeys((span, _ancestor(span, dtype), (("", ""),))):
            if candidate and _finite_with(model, candidate, call):
                return candidate
        return ()
    finally:
        torch.set_rng_state(rng)
