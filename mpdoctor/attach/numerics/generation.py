"""The generation probe: a few decoding steps of ``model.generate`` under the one-batch probe's forward hooks.

``probe(model, batch, generate=True)`` calls :func:`mpdoctor.attach.numerics.probe.run_generation_probe`, which uses
the pieces here. It runs ``model.generate`` on the
batch's prompt for ``max_new_tokens`` steps in eval mode without gradients, with the training probe's
statistics hooks on every module (the first module whose output leaves its dtype's range is named as the
training probe names it) and one more forward hook on the model itself, which reads the last position's
logits at every decoding step and their softmax in fp32: the step at which logits or probabilities first
held NaN/Inf. Nothing is left behind: the hooks are removed, train/eval modes, gradients and RNG streams
restored (sampling draws from them), also when ``generate`` raises.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...facts.tensors import dtype_name
from .harness import first_line, floating_list
from .probe_facts import ForwardCall, GenerationFacts, ProbeError

#: Batch keys a training batch carries that ``generate`` does not take (it makes its own labels: none).
_NOT_FOR_GENERATE = ("labels",)


class StepWatch:
    """A forward hook on the model itself: one entry per decoding step (the prefill is step 0).

    ``recorder`` is the probe's recorder (:class:`mpdoctor.attach.numerics.probe._Recorder`): its module-completion
    counter at the end of each step places the first bad module in its step."""

    def __init__(self, model: torch.nn.Module, recorder: Any) -> None:
        self.model, self.recorder = model, recorder
        self.logits: list[int] = []
        self.probs: list[int] = []
        self.ends: list[int] = []
        self.handle: Any = None

    def attach(self) -> None:
        self.handle = self.model.register_forward_hook(self.hook)

    def detach(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def hook(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        logits = _logits_of(output)
        if logits is None:
            return
        last = logits[:, -1] if logits.dim() == 3 else logits
        with torch.no_grad():
            self.logits.append(int((~torch.isfinite(last)).sum()))
            self.probs.append(int((~torch.isfinite(torch.softmax(last.float(), dim=-1))).sum()))
        self.ends.append(self.recorder.done)

    def facts(self, requested: int, new_tokens: int | None) -> GenerationFacts:
        return GenerationFacts(requested, tuple(self.logits), tuple(self.probs), tuple(self.ends), new_tokens)


def _logits_of(output: Any) -> torch.Tensor | None:
    """The logits of a forward's output (``output.logits``, else its first floating tensor)."""
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    tensors = floating_list(output)
    return tensors[0] if tensors else None


def generate_call(batch: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for ``generate``: a dict batch as keywords (its labels left out), a tensor as the ids."""
    if isinstance(batch, ForwardCall):
        return tuple(batch.args), dict(batch.kwargs)
    if isinstance(batch, Mapping):
        return (), {k: v for k, v in batch.items() if k not in _NOT_FOR_GENERATE}
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    return tuple(batch), {}


def prompt_length(args: tuple, kwargs: dict) -> int | None:
    """The prompt's length in tokens (its ``input_ids``' last dimension), None when there are no ids."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    return int(ids.shape[-1]) if isinstance(ids, torch.Tensor) and ids.dim() >= 1 else None


def generation_error(exc: BaseException, recorder: Any, modules: list) -> ProbeError:
    """The exception ``generate`` raised, attributed to the module running then (none: generate's own code)."""
    where = recorder.running()
    path, mod = modules[where] if where is not None else (None, None)
    rec = recorder.records.get(where) if where is not None else None
    return ProbeError(
        phase="forward" if mod is not None else "generate",
        module=path,
        class_name=type(mod).__name__ if mod is not None else None,
        exception=type(exc).__name__,
        message=first_line(exc),
        input_dtypes=tuple(rec.in_dt) if rec is not None else (),
        param_dtypes=tuple(dict.fromkeys(dtype_name(p.dtype) for p in mod.parameters(recurse=False)))
        if mod is not None
        else (),
    )
