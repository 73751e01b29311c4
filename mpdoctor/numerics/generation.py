"""The generation probe: a few decoding steps of ``model.generate`` under the one-batch probe's forward hooks.

``probe(model, batch, generate=True)`` calls :func:`run_generation_probe`. It runs ``model.generate`` on the
batch's prompt for ``max_new_tokens`` steps in eval mode without gradients, with the training probe's
statistics hooks on every module (the first module whose output leaves its dtype's range is named as the
training probe names it) and one more forward hook on the model itself, which reads the last position's
logits at every decoding step and their softmax in fp32: the step at which logits or probabilities first
held NaN/Inf. Nothing is left behind: the hooks are removed, train/eval modes, gradients and RNG streams
restored (sampling draws from them), also when ``generate`` raises.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from ..facts.tensors import dtype_name
from .harness import BATCH_MESSAGE, BATCH_TYPES, Snapshot, first_line, floating_list, to_device
from .probe import _autocast_for, _finish, _Recorder
from .probe_facts import ForwardCall, GenerationFacts, ProbeError, ProbeFacts

#: Batch keys a training batch carries that ``generate`` does not take (it makes its own labels: none).
_NOT_FOR_GENERATE = ("labels",)


class _StepWatch:
    """A forward hook on the model itself: one entry per decoding step (the prefill is step 0)."""

    def __init__(self, model: torch.nn.Module, recorder: _Recorder) -> None:
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


def _prompt(batch: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for ``generate``: a dict batch as keywords (its labels left out), a tensor as the ids."""
    if isinstance(batch, ForwardCall):
        return tuple(batch.args), dict(batch.kwargs)
    if isinstance(batch, Mapping):
        return (), {k: v for k, v in batch.items() if k not in _NOT_FOR_GENERATE}
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    return tuple(batch), {}


def _prompt_length(args: tuple, kwargs: dict) -> int | None:
    ids = kwargs.get("input_ids", args[0] if args else None)
    return int(ids.shape[-1]) if isinstance(ids, torch.Tensor) and ids.dim() >= 1 else None


def _error(exc: BaseException, recorder: _Recorder, modules: list) -> ProbeError:
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


def run_generation_probe(
    model: torch.nn.Module,
    batch: Any,
    name: str = "model",
    autocast: Any = None,
    max_new_tokens: int = 8,
    generate_kwargs: Mapping[str, Any] | None = None,
) -> ProbeFacts:
    """Run ``max_new_tokens`` decoding steps of ``model.generate`` under the probe's hooks; see the module docstring.

    Raises
    ------
    TypeError
        When the batch is not a batch, or the model has no ``generate``.
    """
    if not isinstance(batch, BATCH_TYPES):
        raise TypeError(BATCH_MESSAGE.format(type(batch).__name__))
    generate = getattr(model, "generate", None)
    if not callable(generate):
        raise TypeError(f"generate=True needs a model with a generate() method; {type(model).__name__} has none")
    start = time.perf_counter()
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    ctx, ac_dtype, ac_source = _autocast_for(device, None, autocast)
    modules = list(model.named_modules())
    recorder = _Recorder(modules)
    watch = _StepWatch(model, recorder)
    snapshot = Snapshot(model, batch)
    args, kwargs = _prompt(to_device(batch, device))
    kwargs.update(generate_kwargs or {})
    kwargs["max_new_tokens"] = max_new_tokens
    error: ProbeError | None = None
    new_tokens: int | None = None
    try:
        model.eval()
        recorder.attach()
        watch.attach()
        try:
            with torch.no_grad(), ctx:
                out = generate(*args, **kwargs)
            ids = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
            length = _prompt_length(args, kwargs)
            if isinstance(ids, torch.Tensor) and length is not None:
                new_tokens = int(ids.shape[-1]) - length
        except Exception as exc:  # what generate raised is a finding, never a traceback
            error = _error(exc, recorder, modules)
    finally:
        watch.detach()
        recorder.detach()
        snapshot.restore()
    records, _ = _finish(recorder, modules, snapshot.params, [None] * len(snapshot.params))
    generation = watch.facts(max_new_tokens, new_tokens)
    return ProbeFacts(
        model=name,
        modules=records,
        autocast=ac_dtype,
        autocast_source=ac_source,
        device=device.type,
        loss_scale=1.0,
        loss=None,
        backward=False,
        note=f"generate(): {generation.steps} decoding steps, forward only",
        error=error,
        fp16_weights=any(p.dtype == torch.float16 for p in snapshot.params),
        seconds=time.perf_counter() - start,
        batch_kind="mapping" if isinstance(batch, Mapping) else "tensor",
        model_ref=id(model),
        generation=generation,
    )
