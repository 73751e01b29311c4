"""One-batch probe: one forward and one backward with cheap hooks on every module.

``probe(model, batch)`` runs the batch under the precision the setup really
uses (a Trainer's or Accelerator's autocast and loss scale, the user's
current autocast, or ``autocast=``), records per module the dtypes and the
abs max / non-finite count of inputs, outputs, output gradients and
parameter gradients, and names the first module that goes non-finite,
passes the fp16 range or raises (a dtype mismatch is attributed to the module
running when it was raised). It returns a :class:`~mpdoctor.diagnosis.report.Report`
whose ``probe_table`` is the per-module DataFrame.

The hooks never synchronise an accelerator per tensor: statistics stay on the
device as 0-d tensors and are read out once at the end (on the CPU, where
reading a scalar costs nothing, counts are taken only where the extremes are
non-finite). The probe leaves nothing behind: hooks removed, ``.grad`` of every
parameter and batch tensor restored to the very same objects, RNG states,
train/eval flags and normalisation running statistics restored, optimizer and
scaler never touched, even when the forward raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import weakref
from collections.abc import Mapping
from typing import Any, Callable

import torch

from ...compat import GRAD_SCALER_CLASSES
from ...facts.tensors import dtype_name
from ...objects.gathering.values import FP16_MAX, no_autocast
from ...objects.live.introspect import is_a
from ...redact import redact_finding
from .generation import StepWatch, generate_call, generation_error, prompt_length
from .harness import (
    BATCH_MESSAGE,
    BATCH_TYPES,
    Snapshot,
    call_model,
    first_line,
    floating_list,
    loss_of,
    to_device,
)
from .probe_facts import (  # noqa: F401  (re-exported: the probe's data types)
    DTYPE_ERROR,
    PROBE_COLUMNS,
    ForwardCall,
    GenerationFacts,
    ModuleProbe,
    ProbeError,
    ProbeFacts,
    _past,
)

_TRAINER = ("transformers.trainer.Trainer",)
_ACCELERATOR = ("accelerate.accelerator.Accelerator",)
_SCALER = GRAD_SCALER_CLASSES

# -- statistics ------------------------------------------------------------------------

#: Dtypes reductions (``aminmax``, ``isfinite``) are implemented for on every device; others are upcast to fp32.
_REDUCIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_PLAIN_REDUCIBLE = frozenset(_REDUCIBLE)
#: ``dtype_name`` of each dtype seen, so the hooks do not format a string per tensor.
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _name(dtype: torch.dtype) -> str:
    """``dtype_name(dtype)``, computed once per dtype."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype_name(dtype)
    return name


def _finite_view(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` in a dtype ``aminmax`` / ``isfinite`` can read, or None when its values cannot be read.

    float8 tensors (every variant) have no CPU reductions: they are upcast to fp32 (a copy of that one
    tensor). A tensor subclass that stores another format (torchao's ``Float8Tensor`` has no ``aten.abs``)
    is read through its own ``dequantize()``. Packed float4 (``float4_e2m1fn_x2``) cannot even be copied
    to another dtype: None.
    """
    d = t.detach()
    if type(d) is not torch.Tensor:  # a subclass (torchao, DTensor ...): its dispatch may lack reductions
        deq = getattr(d, "dequantize", None)
        if callable(deq):
            try:
                d = deq()
            except Exception:
                return None
        if type(d) is not torch.Tensor and not d.is_floating_point():
            return None
    if d.dtype in _REDUCIBLE or not d.is_floating_point():
        return d
    try:
        return d.float()
    except Exception:  # float4_e2m1fn_x2: no copy kernel
        return None



class _Stats:
    """Abs max and non-finite counts of many tensors, read out in one go.

    On the CPU every reduction has already finished when it returns, so the
    extremes are read at once and the non-finite count is taken only when they
    are not finite. Elsewhere the min, max and count stay on the device as 0-d
    tensors until :meth:`finish` stacks them and reads them with one transfer.
    """

    #: Device types whose scalars are read at once (no sync to avoid there); the hooks test ``Tensor.is_cpu``
    #: (a flag, where ``tensor.device`` builds an object per call).
    EAGER = frozenset({"cpu"})

    def __init__(self) -> None:
        self.slots: list[list] = []  # [min, max, nonfinite] as floats/ints or 0-d tensors
        self.eager_cpu = "cpu" in self.EAGER
        self._last: tuple[Any, int, int] | None = None  # (tensor, version, slot)
        # Forward tensors measured so far: a model returning its head's logits next to the loss would
        # read the largest activation twice. Held by weak reference: an activation autograd does not save
        # is freed as soon as the model drops it, as without the probe (its memory is reused, not faulted in anew).
        self._seen: dict[int, tuple[Any, int, int]] | None = {}

    def add(self, t: torch.Tensor, remember: bool = True) -> int:
        """Queue the statistics of ``t``; returns its slot. ``remember=False``: a tensor read once for sure (a
        weight's gradient), not kept as the last one read, so nothing holds it once its owner drops it."""
        last = self._last
        # A module returning its child's output (or one gradient reaching two hooks) is measured once.
        if last is not None and last[0] is t and last[1] == t._version:
            return last[2]
        seen = self._seen
        if seen is not None:
            hit = seen.get(id(t))
            if hit is not None and hit[0]() is t and hit[1] == t._version:
                return hit[2]
        # A plain tensor in a reducible dtype (nearly every one) is read as is; others go through _finite_view.
        d = t.detach() if type(t) is torch.Tensor and t.dtype in _PLAIN_REDUCIBLE else _finite_view(t)
        if d is None or d.numel() == 0:  # unreadable (packed float4) or empty: recorded as finite zeros
            self.slots.append([0.0, 0.0, 0])
            return len(self.slots) - 1
        mn, mx = torch.aminmax(d)
        if d.is_cpu and self.eager_cpu:
            lo, hi = mn.item(), mx.item()
            nf = 0
            if not (math.isfinite(lo) and math.isfinite(hi)):
                nf = d.numel() - int(torch.count_nonzero(torch.isfinite(d)))
            self.slots.append([lo, hi, nf])
        else:
            self.slots.append([mn, mx, d.numel() - torch.isfinite(d).sum()])
        slot = len(self.slots) - 1
        if not remember:
            return slot
        self._last = (t, t._version, slot)
        if seen is not None:
            seen[id(t)] = (weakref.ref(t), t._version, slot)
        return slot

    def end_forward(self) -> None:
        """Stop remembering every tensor: gradients are freed as backward goes, and must stay so."""
        self._seen = None

    def bad(self, slot: int) -> bool:
        """True when a slot read on the CPU is non-finite or past fp16's range (False while still pending)."""
        lo, hi, _ = self.slots[slot]
        if isinstance(lo, torch.Tensor):
            return False
        return not (-FP16_MAX <= lo and hi <= FP16_MAX)

    def forget(self) -> None:
        """Drop the references to measured tensors (so none is kept alive past the probe)."""
        self._last = None
        self._seen = None

    def finish(self) -> None:
        """Read every pending device scalar with one stack and ``tolist`` per device and dtype."""
        groups: dict[tuple, list[tuple[int, int, torch.Tensor]]] = {}
        for i, slot in enumerate(self.slots):
            for j, v in enumerate(slot):
                if isinstance(v, torch.Tensor):
                    groups.setdefault((v.device, v.dtype), []).append((i, j, v))
        for items in groups.values():
            values = torch.stack([v for _, _, v in items]).tolist()
            for (i, j, _), value in zip(items, values):
                self.slots[i][j] = value

    def absmax(self, ids: list[int]) -> float | None:
        if not ids:
            return None
        out = 0.0
        for i in ids:
            lo, hi, _ = self.slots[i]
            if math.isnan(lo) or math.isnan(hi):
                return math.nan
            out = max(out, abs(lo), abs(hi))
        return out

    def nonfinite(self, ids: list[int]) -> int:
        return int(sum(self.slots[i][2] for i in ids))


class _Record:
    __slots__ = ("order", "calls", "done", "bad_done", "grad_order", "ins", "outs", "grads", "in_dt", "out_dt", "grad_dt")

    def __init__(self, order: int) -> None:
        self.order = order
        self.calls = 0
        self.done: int | None = None
        self.bad_done: int | None = None  # completion position of the first call whose output went bad (CPU)
        self.grad_order: int | None = None
        self.ins: list[int] = []
        self.outs: list[int] = []
        self.grads: list[int] = []
        self.in_dt: dict[str, None] = {}
        self.out_dt: dict[str, None] = {}
        self.grad_dt: dict[str, None] = {}


class _Recorder:
    """The hooks: a stack of running modules for attribution, and statistics per module."""

    def __init__(self, modules: list[tuple[str, torch.nn.Module]]) -> None:
        self.modules = modules
        self.index = {id(m): i for i, (_, m) in enumerate(modules)}
        self.records: dict[int, _Record] = {}
        self.stack: list[int] = []
        self.stats = _Stats()
        self.phase = "forward"
        self.done = 0
        self.grad_seen = 0
        self.last_grad: int | None = None
        self.handles: list[Any] = []
        self.grad_hooks: dict[int, Callable[[torch.Tensor], None]] = {}  # one closure per module, not per tensor
        self.trace: Any = None  # runtime.boundary.BoundaryTrace: where each batch tensor enters
        # id(parameter) -> slots of its gradient, read as backward accumulates it (see read_param_grads).
        self.param_slots: dict[int, list[int]] | None = None

    def attach(self) -> None:
        for _, m in self.modules:
            self.handles.append(m.register_forward_pre_hook(self.pre_hook, with_kwargs=True))
            self.handles.append(m.register_forward_hook(self.post_hook, with_kwargs=True))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.stats.forget()

    def _inputs(self, rec: _Record, args: tuple, kwargs: dict) -> None:
        """Measure a call's CPU inputs (done only when its output went bad)."""
        for t in floating_list((args, kwargs)):
            if t.is_cpu and self.stats.eager_cpu:
                rec.ins.append(self.stats.add(t))

    def pre_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.phase != "forward":
            return None
        i = self.index[id(module)]
        self.stack.append(i)
        rec = self.records.get(i)
        if rec is None:
            rec = self.records[i] = _Record(len(self.records))
        rec.calls += 1
        pending = self.trace.pending if self.trace is not None else None
        in_dt = rec.in_dt
        eager = self.stats.eager_cpu
        for t in floating_list((args, kwargs)):
            in_dt[_name(t.dtype)] = None
            if pending and id(t) in pending:
                self.trace.receive(i, t)
            # Accelerator inputs are measured now (queued, no sync); CPU inputs only if the output goes bad.
            if not (t.is_cpu and eager):
                rec.ins.append(self.stats.add(t))
        return None

    def post_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        i = self.index[id(module)]
        forward = self.phase == "forward"
        if forward:
            # A module whose forward raised and was caught inside the model left entries above it.
            while self.stack and self.stack.pop() != i:
                pass
            rec = self.records[i]
            # Every call completes at its own position: a module called twice (a shared dropout) goes bad at
            # the call that went bad, not at its first, harmless one.
            position = self.done
            self.done += 1
            if rec.done is None:
                rec.done = position
        else:
            rec = self.records.get(i)
            if rec is None:
                return None
        bad = False
        stats = self.stats
        for t in floating_list(output):
            if forward:
                slot = stats.add(t)
                rec.outs.append(slot)
                rec.out_dt[_name(t.dtype)] = None
                bad = bad or stats.bad(slot)
            if t.requires_grad and t.grad_fn is not None:
                hook = self.grad_hooks.get(i)
                if hook is None:
                    hook = self.grad_hooks[i] = self._grad_hook(i)
                self.handles.append(t.register_hook(hook))
        if bad and forward and rec.bad_done is None:
            rec.bad_done = position
        if bad and rec.in_dt:
            self._inputs(rec, args, kwargs)
        return None

    def _grad_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            rec = self.records[i]
            if rec.grad_order is None:
                rec.grad_order = self.grad_seen
                self.grad_seen += 1
            self.last_grad = i
            if grad is not None and grad.is_floating_point() and grad.numel() > 0:
                rec.grads.append(self.stats.add(grad))
                rec.grad_dt[_name(grad.dtype)] = None

        return hook

    def read_param_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Read each parameter's gradient the moment backward has accumulated it, then drop it.

        The user's own ``.grad`` tensors stay alive (they are restored by identity), so a gradient the probe
        kept until the end would double the gradients' memory for the length of the backward: on the CPU,
        fresh pages for every weight's gradient. Read at once, each is freed before the next is made, and is
        still in the cache when read. A gradient arriving in parts (one parameter in several reentrant
        checkpoint segments) has each part read. Only for plain parameters of a model no distributed wrapper
        holds (:func:`_early_grads_ok`): DDP, FSDP and DeepSpeed read ``.grad`` in their own hooks after this one.
        """
        slots: dict[int, list[int]] = {}
        self.param_slots = slots
        stats = self.stats

        def hook(p: torch.Tensor) -> None:
            g = p.grad
            if g is not None and g.is_floating_point():
                slots.setdefault(id(p), []).append(stats.add(g, remember=False))
            p.grad = None

        for p in params:
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(hook))

    def running(self) -> int | None:
        """The innermost module running now (forward) or last reached by the gradient (backward)."""
        if self.phase == "forward":
            return self.stack[-1] if self.stack else None
        return self.last_grad


# -- the setup's precision ----------------------------------------------------------------


def _accelerator_of(setup: Any) -> Any:
    if setup is None:
        return None
    if is_a(setup, _ACCELERATOR):
        return setup
    if is_a(setup, _TRAINER):
        return getattr(setup, "accelerator", None)
    return None


def _autocast_for(model_device: torch.device, setup: Any, autocast: Any) -> tuple[Any, str | None, str]:
    """``(context manager, dtype name or None, source)`` of the precision the forward should run under."""
    dev = model_device.type
    if autocast is False:
        return contextlib.nullcontext(), None, "none"
    if isinstance(autocast, torch.dtype):
        return torch.autocast(dev, dtype=autocast), dtype_name(autocast), "argument"
    if autocast not in (None, True):
        raise TypeError(f"autocast must be None, False or a torch.dtype, not {autocast!r}")
    acc = _accelerator_of(setup)
    if acc is not None:
        # The accelerator's own context (what it wraps forward with after prepare()).
        mp = str(getattr(acc, "mixed_precision", "no"))
        native = bool(getattr(acc, "native_amp", False))
        label = {"fp16": "float16", "bf16": "bfloat16"}.get(mp) if native else None
        return acc.autocast(), label, "accelerator"
    try:
        if torch.is_autocast_enabled(dev):
            return contextlib.nullcontext(), dtype_name(torch.get_autocast_dtype(dev)), "ambient"
    except Exception:
        pass
    return contextlib.nullcontext(), None, "none"


def _loss_scale(setup: Any, scaler: Any) -> float:
    """The current scale of the GradScaler the setup multiplies its loss by (read only)."""
    from ...objects.readers.scaler import read_scaler

    if scaler is None:
        if setup is not None and is_a(setup, _SCALER):
            scaler = setup
        else:
            acc = _accelerator_of(setup)
            scaler = getattr(acc, "scaler", None) if acc is not None else None
    if scaler is None or not is_a(scaler, _SCALER):
        return 1.0
    facts = read_scaler("scaler", scaler)
    if not facts.enabled:
        return 1.0
    return facts.scale if facts.scale is not None else facts.init_scale


# -- the probe --------------------------------------------------------------------------


def run_probe(
    model: torch.nn.Module,
    batch: Any,
    setup: Any = None,
    name: str = "model",
    autocast: Any = None,
    scaler: Any = None,
    loss_fn: Callable | None = None,
    training: bool = True,
) -> ProbeFacts:
    """Run the probe and return what it saw (no Report, no checks); see :func:`probe`."""
    if not isinstance(batch, BATCH_TYPES):
        raise TypeError(BATCH_MESSAGE.format(type(batch).__name__))
    start = time.perf_counter()
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    ctx, ac_dtype, ac_source = _autocast_for(device, setup, autocast)
    scale = _loss_scale(setup, scaler)
    modules = list(model.named_modules())
    recorder = _Recorder(modules)
    snapshot = Snapshot(model, batch)
    batch_kind = "mapping" if isinstance(batch, Mapping) else "tensor"
    batch = to_device(batch, device)
    from ..runtime.boundary import BoundaryTrace

    recorder.trace = BoundaryTrace(batch, modules)
    loss_value: float | None = None
    error: ProbeError | None = None
    ran_backward = False
    note = ""
    new_grads: list[torch.Tensor | None] = []
    try:
        model.train(training)
        snapshot.clear_grads()
        recorder.attach()
        phase = "forward"
        try:
            with torch.enable_grad(), ctx:  # a probe called under no_grad still needs its backward
                output = call_model(model, batch)
                phase = "loss"
                loss = loss_of(output, loss_fn)
            del output
            loss_value = float(loss.detach().float())
            if loss.requires_grad:
                phase = "backward"
                recorder.phase = "backward"
                recorder.stats.end_forward()
                if _early_grads_ok(modules, snapshot.params):
                    recorder.read_param_grads(snapshot.params)
                with torch.enable_grad():
                    (loss * scale if scale != 1.0 else loss).backward()
                ran_backward = True
            else:
                note = "the loss does not require grad (no trainable parameter reached it): forward only"
        except Exception as exc:  # the model's error is the finding, never a traceback
            where = recorder.running() if phase != "loss" else None
            path = modules[where][0] if where is not None else None
            mod = modules[where][1] if where is not None else None
            rec = recorder.records.get(where) if where is not None else None
            error = ProbeError(
                phase=phase,
                module=path,
                class_name=type(mod).__name__ if mod is not None else None,
                exception=type(exc).__name__,
                message=first_line(exc),
                input_dtypes=tuple(rec.in_dt) if rec is not None else (),
                param_dtypes=tuple(dict.fromkeys(dtype_name(p.dtype) for p in mod.parameters(recurse=False)))
                if mod is not None
                else (),
            )
        new_grads = [p.grad for p in snapshot.params]
    finally:
        recorder.detach()
        snapshot.restore()
    with no_autocast():
        records, grads_ok = _finish(recorder, modules, snapshot.params, new_grads, recorder.param_slots)
    fp16_weights = any(p.dtype == torch.float16 for p in snapshot.params)
    boundary = recorder.trace.facts(model)
    origin = None
    if any(m.out_nonfinite for m in records):
        boundary = recorder.trace.count_nonfinite(boundary)
        origin = _nan_origin(model, batch, modules, records, boundary, snapshot, device, setup, autocast, training)
    recorder.trace = None
    return ProbeFacts(
        model=name,
        modules=records,
        autocast=ac_dtype,
        autocast_source=ac_source,
        device=device.type,
        loss_scale=float(scale),
        loss=loss_value,
        backward=ran_backward,
        note=note,
        error=error,
        fp16_weights=fp16_weights,
        seconds=time.perf_counter() - start,
        boundary=boundary,
        origin=origin,
        batch_kind=batch_kind,
        model_ref=id(model),
        grads_trained=_trained(ran_backward, grads_ok, loss_value),
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
    watch = StepWatch(model, recorder)
    snapshot = Snapshot(model, batch)
    args, kwargs = generate_call(to_device(batch, device))
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
            length = prompt_length(args, kwargs)
            if isinstance(ids, torch.Tensor) and length is not None:
                new_tokens = int(ids.shape[-1]) - length
        except Exception as exc:  # what generate raised is a finding, never a traceback
            error = generation_error(exc, recorder, modules)
    finally:
        watch.detach()
        recorder.detach()
        snapshot.restore()
    records, _ = _finish(recorder, modules, snapshot.params, [None] * len(snapshot.params))
    generation = watch.facts(max_new_tokens, new_tokens)
    facts = ProbeFacts(
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
    return _with_fp32_span(facts, model, lambda: generate(*args, **{**kwargs, "max_new_tokens": 1, "do_sample": False}), ctx)


def _with_fp32_span(facts: ProbeFacts, model: torch.nn.Module, call: Callable[[], Any], ctx: Any) -> ProbeFacts:
    """``facts`` with the fp32 span of an fp16 overflow in a model run in fp16 without autocast (a T4's, a V100's
    only choice besides fp32): the modules the overflow passes through, measured and re-run finite
    (:mod:`mpdoctor.attach.numerics.fp32_span`); the model's modes are put back after."""
    from .fp32_span import overflow_span

    hit = facts.first_nonfinite()
    if hit is None or hit[1] != "forward" or facts.autocast is not None or not facts.fp16_weights:
        return facts
    first = hit[0]
    if first.in_nonfinite or first.param_nonfinite:  # not an overflow from finite inputs and weights
        return facts
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with ctx:
            span = overflow_span(model, call, first.path)
    finally:
        for m, was in modes:
            m.training = was
    return dataclasses.replace(facts, fp32_span=span) if span else facts


def _trained(ran_backward: bool, grads_ok: bool, loss: float | None) -> bool:
    """A step with no optimizer trained: its backward ran, its loss is finite, its gradients finite and not all zero."""
    return ran_backward and grads_ok and loss is not None and math.isfinite(loss)


def _nan_origin(model: torch.nn.Module, batch: Any, modules: list, records: tuple, boundary: tuple, snapshot: Snapshot,
                device: torch.device, setup: Any, autocast: Any, training: bool) -> Any:  # fmt: skip
    """Where the first non-finite value of the forward was produced (:mod:`mpdoctor.attach.runtime.nan_origin`)."""
    from ..runtime import nan_origin

    first = min((m for m in records if m.out_nonfinite and m.done is not None), key=lambda m: m.done, default=None)
    weights = next((m for m in records if m.param_nonfinite), None)
    known = nan_origin.from_facts({b.key: b.nonfinite for b in boundary},
                                  (weights.path, weights.class_name) if weights is not None else None)  # fmt: skip
    if known is not None or first is None:
        return known
    # Replay the same forward (same autocast, same dropout masks) with an op watch; restore all it touches.
    again = Snapshot(model, batch)
    try:
        model.train(training)
        snapshot.rewind()
        ctx, _, _ = _autocast_for(device, setup, autocast)
        return nan_origin.locate(model, lambda: call_model(model, batch), modules, ctx, first.path)
    except Exception:  # the origin is a bonus; the probe's findings stand without it
        return None
    finally:
        again.restore()


def _finish(
    recorder: _Recorder,
    modules: list[tuple[str, torch.nn.Module]],
    params: list[torch.nn.Parameter],
    grads: list[torch.Tensor | None],
    early: dict[int, list[int]] | None = None,
) -> tuple[tuple[ModuleProbe, ...], bool]:
    """Read the statistics out once and build one record per module that ran; also whether every gradient the
    backward wrote is finite and one is non-zero (each parameter's gradient is read once, whichever module uses it).

    ``early``: the slots of the gradients read while backward ran (:meth:`_Recorder.read_param_grads`), by
    parameter; the gradients in ``grads`` (those backward left in ``.grad``) are read here."""
    stats = recorder.stats
    early = early or {}
    own = {i: _own_params(modules[i][1]) for i in recorder.records}
    pgrads, every = _param_grad_slots(stats, own, params, grads, early)
    stats.finish()
    grads_ok = bool(every) and stats.nonfinite(every) == 0 and (stats.absmax(every) or 0.0) > 0.0
    stats.forget()
    out: list[ModuleProbe] = []
    for i, rec in sorted(recorder.records.items(), key=lambda kv: kv[1].order):
        path, mod = modules[i]
        own_params = own[i]
        out.append(
            ModuleProbe(
                order=rec.order,
                path=path,
                class_name=type(mod).__name__,
                calls=rec.calls,
                input_dtypes=tuple(rec.in_dt),
                output_dtypes=tuple(rec.out_dt),
                grad_dtypes=tuple(rec.grad_dt),
                param_dtypes=tuple(dict.fromkeys(_name(p.dtype) for p in own_params)),
                in_absmax=stats.absmax(rec.ins),
                out_absmax=stats.absmax(rec.outs),
                grad_absmax=stats.absmax(rec.grads),
                param_grad_absmax=stats.absmax(pgrads[i]),
                in_nonfinite=stats.nonfinite(rec.ins),
                out_nonfinite=stats.nonfinite(rec.outs),
                grad_nonfinite=stats.nonfinite(rec.grads),
                param_grad_nonfinite=stats.nonfinite(pgrads[i]),
                param_nonfinite=_nonfinite_params(own_params) if stats.nonfinite(rec.outs) else 0,
                done=rec.bad_done if rec.bad_done is not None else rec.done,
                grad_order=rec.grad_order,
            )
        )
    return tuple(out), grads_ok


def _param_grad_slots(stats: _Stats, own: dict[int, list], params: list, grads: list,
                      early: dict[int, list[int]]) -> tuple[dict[int, list[int]], list[int]]:  # fmt: skip
    """The slots of each module's own parameters' gradients (read during backward, or now from ``grads``), and
    the slots of every gradient. A tied weight's gradient (GPT-2's wte and lm_head) is read once (``grads`` keeps
    every one alive, so ids are stable)."""
    grad_of = {id(p): g for p, g in zip(params, grads) if g is not None}
    pgrads: dict[int, list[int]] = {}
    read: dict[int, int] = {}
    for i, ps in own.items():
        slots = pgrads[i] = []
        for p in ps:
            slots.extend(early.get(id(p), ()))
        for g in floating_list([grad_of[id(p)] for p in ps if id(p) in grad_of]):
            slot = read.get(id(g))
            if slot is None:
                slot = read[id(g)] = stats.add(g)
            slots.append(slot)
    # A parameter no hooked module owns (used functionally by another one) has its gradient read too.
    for g in floating_list([g for g in grads if g is not None]):
        if id(g) not in read:
            read[id(g)] = stats.add(g)
    return pgrads, list(read.values()) + [slot for slots in early.values() for slot in slots]


#: Wrappers whose own autograd hooks read ``.grad`` after the probe's post-accumulate hooks run.
_GRAD_READERS = frozenset({"DistributedDataParallel", "FullyShardedDataParallel", "DeepSpeedEngine", "PipelineModule"})


def _early_grads_ok(modules: list[tuple[str, torch.nn.Module]], params: list[torch.nn.Parameter]) -> bool:
    """Whether the gradients may be read and dropped as backward makes them: plain parameters (no DTensor,
    no FSDP2 shard) of a model no DDP / FSDP / DeepSpeed module holds, on a torch with post-accumulate hooks."""
    if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
        return False
    if any(type(m).__name__ in _GRAD_READERS or type(m).__name__.startswith("FSDP") for _, m in modules):
        return False
    return all(type(p) is torch.nn.Parameter for p in params)


def _own_params(module: torch.nn.Module) -> list:
    """A module's own parameters, each once: what ``parameters(recurse=False)`` yields, without its generators."""
    return list(dict.fromkeys(p for p in module._parameters.values() if p is not None))


def _nonfinite_params(params: list[torch.Tensor]) -> int:
    """NaN/Inf count in a module's own weights (read only for modules whose output went non-finite)."""
    total = 0
    for p in params:
        if p.is_floating_point() and p.numel() and p.device.type != "meta":
            d = _finite_view(p)
            if d is not None:
                total += d.numel() - int(torch.count_nonzero(torch.isfinite(d)))
    return total


def probe(
    model: torch.nn.Module,
    batch: Any,
    setup: Any = None,
    name: str = "model",
    *,
    autocast: Any = None,
    scaler: Any = None,
    loss_fn: Callable | None = None,
    training: bool = True,
    checks: bool = True,
    generate: bool = False,
    max_new_tokens: int = 8,
    target: str | None = None,
) -> Any:
    """Run one forward and one backward on ``batch`` and report where the numbers go wrong.

    Parameters
    ----------
    model : torch.nn.Module
        The model (PEFT, DDP and accelerate-prepared models included).
    batch : dict, tensor, tuple or list
        What a DataLoader yields: keyword arguments for ``forward`` (Hugging
        Face models), one tensor, or positional arguments. Moved to the
        model's device if needed (a copy of the batch, never of the model).
    setup : Trainer or Accelerator, optional
        Its autocast (``accelerator.autocast()``) and GradScaler scale are used,
        so the probe computes in the precision the run really uses.
    name : str
        The model's name in the report.
    autocast : torch.dtype or False, optional
        Override: run under ``torch.autocast(device, dtype=autocast)``, or
        ``False`` for no autocast. Default: the setup's, else the caller's
        current autocast, else none.
    scaler : GradScaler, optional
        Multiply the loss by its current scale before backward (default: the setup's scaler, if any).
    loss_fn : callable, optional
        ``output -> scalar loss``; default ``output.loss``, else the mean of
        the first floating tensor of the output.
    training : bool
        Run in train mode (dropout on, as in training); the modes are restored after.
    checks : bool
        Also run mpdoctor's static checks on the model and setup.
    generate : bool
        Instead of a forward and a backward, run ``max_new_tokens`` decoding steps of ``model.generate``
        on the batch's prompt (its ``labels`` left out) in eval mode, under the same hooks
        (:mod:`mpdoctor.attach.numerics.generation`): the report names the first module whose output left its
        dtype's range and the decoding step at which the logits or the probabilities went NaN/Inf. Modes,
        hooks and RNG streams are restored, also when ``generate`` raises. Its fixes are checked on that call
        (its logits finite: "checked", a stand-in for the user's own call, never "verified").
    max_new_tokens : int
        Decoding steps of a ``generate=True`` probe.
    target : str, optional
        A device profile (``"T4"``, ``"V100"``, ...) the fixes are planned for, as in :func:`mpdoctor.diagnose`
        (what-if): on a profile without bf16 an fp16 overflow is cured by the modules it passes through kept in
        fp32, not by bf16.

    Returns
    -------
    Report
        ``report.findings`` has ``probe-*`` findings (the first non-finite or
        fp16-overflowing module, the module that raised), ``report.probe_table``
        one row per module in call order and ``report.facts.probes`` the raw
        :class:`ProbeFacts`. ``report.refresh()`` probes the same batch again.
    """
    from ...diagnosis.report import Report
    from ...diagnosis.treatment import bind_fixes
    from ...facts import Facts
    from ...facts.hardware import profile_for
    from ...objects.discovery.subjects import discover
    from ...objects.gathering import gather
    from ...objects.live import Live
    from ...rules.checks import REGISTRY, load, run_checks

    start = time.perf_counter()
    if generate:
        facts_probe = run_generation_probe(model, batch, name, autocast=autocast, max_new_tokens=max_new_tokens)
    else:
        facts_probe = run_probe(model, batch, setup, name, autocast=autocast, scaler=scaler, loss_fn=loss_fn,
                                training=training)  # fmt: skip
    masks = _batch_masks(batch)  # a 4D additive mask in the batch: a fix may clamp its -inf in place
    objects = [model] + ([setup] if setup is not None else []) + [t for _, t in masks]
    subjects = discover(objects, names={id(model): name, **{id(t): key for key, t in masks}})
    live = Live()
    facts = gather(subjects, profile_for(target) if target is not None else None, live=live)
    live.add(model)
    if isinstance(batch, Mapping):  # the user's dict / BatchFeature: a fix may cast its entries in place
        facts_probe = dataclasses.replace(facts_probe, batch_ref=live.add(batch))
    facts = Facts(**{**facts.__dict__, "probes": (facts_probe,)})
    load()
    ignore = () if checks else tuple(s for s in REGISTRY if not s.startswith("probe-") and s != "batch-dtype-mismatch")
    # Probe findings quote exceptions raised by user code: redact them like diagnose() does.
    findings = [redact_finding(f) for f in run_checks(facts, ignore=ignore)]

    def again() -> Any:
        return probe(model, batch, setup, name, autocast=autocast, scaler=scaler, loss_fn=loss_fn, training=training,
                     checks=checks, generate=generate, max_new_tokens=max_new_tokens, target=target)  # fmt: skip

    plan, safe_plan = _plans(facts, findings, ignore)
    report = Report(
        findings,
        facts,
        ignore=ignore,
        elapsed=time.perf_counter() - start,
        probe_source=facts_probe.table,  # a DataFrame made when first read
        rediagnose=again,
        discovered=tuple(subjects),
        live=live,
        plan=plan,
        safe_plan=safe_plan,
        target=target,
    )
    bind_fixes(report, live, report.treatment)
    # Its fixes are checked on the batch it holds: the probe's forward and backward, or the generate() it ran.
    if any(fx.changes for fx in report.fixes):
        from ..runtime.assembly import assemble

        if generate:
            report = assemble(report, step=generation_step(model, batch, autocast, max_new_tokens))
        else:
            step = probe_step(model, batch, setup, autocast, loss_fn, training, scaler=scaler)
            report = assemble(report, step=step, before=_outcome(facts_probe))
    return report


def _batch_masks(batch: Any) -> list[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` of the batch's keyword entries that read as 4D additive attention masks."""
    from ...objects.readers.masks import is_additive_mask

    entries = batch.kwargs if isinstance(batch, ForwardCall) else batch if isinstance(batch, Mapping) else {}
    try:
        return [(str(k), v) for k, v in entries.items() if is_additive_mask(v)]
    except Exception:  # a batch that cannot be read so: the probe runs without its masks
        return []


def _outcome(facts: ProbeFacts) -> Any:
    """What the probe's own forward and backward did, judged as :func:`~mpdoctor.diagnosis.proof.run_step` judges
    :func:`probe_step` (same autocast, same loss scale, no optimizer): the proof's "before" run, not run twice."""
    from ...diagnosis.proof import StepOutcome
    from ...redact import redact

    if facts.error is not None:
        return StepOutcome(False, False, redact(f"{facts.error.exception}: {facts.error.message}"[:500]))
    if not facts.backward:  # a loss with no grad: the held step's backward raises, so it is run to say how
        return None
    return StepOutcome(True, facts.grads_trained, loss=facts.loss)


def _plans(facts: Any, findings: list, ignore: tuple) -> tuple[list | None, list | None]:
    """The probe's plan and safe-only plan, made like diagnose()'s (a cast joined by the input cast it needs);
    (None, None) when planning raises, which leaves every fix on offer as before."""
    from ...rules.checks import run_checks
    from ...rules.engine.plan import plan, plan_safe

    def run(simulated: Any) -> list:
        return run_checks(simulated, ignore=ignore)

    try:
        full = plan(facts, findings, run)
        return full, plan_safe(facts, findings, run, full)
    except Exception:  # an unplannable report keeps its raw offers; the proof below still checks them
        return None, None


def probe_step(model: torch.nn.Module, batch: Any, setup: Any = None, autocast: Any = None,
               loss_fn: Callable | None = None, training: bool = True, *, scaler: Any = None) -> Any:  # fmt: skip
    """The probe's batch as a step a fix is checked on (:class:`~mpdoctor.diagnosis.proof.HeldStep`): one forward
    under the probe's autocast, the loss, one backward of the loss times the probe's scale (the GradScaler's, as
    the run's own backward); the modules' train/eval modes are put back after each run. Returns the unscaled loss."""
    from ...diagnosis.proof import HeldStep

    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    scale = _loss_scale(setup, scaler)

    def run() -> Any:
        for p in model.parameters():  # a skipped step's inf/NaN gradients are not this backward's (the proof restores them)
            p.grad = None
        ctx, _, _ = _autocast_for(device, setup, autocast)
        with torch.enable_grad(), ctx:
            loss = loss_of(call_model(model, to_device(batch, device)), loss_fn)
        (loss * scale if scale != 1.0 else loss).backward()
        return loss

    @contextlib.contextmanager
    def modes() -> Any:
        saved = [(m, m.training) for m in model.modules()]
        model.train(training)
        try:
            yield
        finally:
            for m, was in saved:
                m.training = was

    return HeldStep(run, "the probe's batch: forward and backward", modules=(model,), around=modes,
                    stand_in="the probe's forward and backward on your batch (no optimizer step)")


def generation_step(model: torch.nn.Module, batch: Any, autocast: Any = None, max_new_tokens: int = 8) -> Any:
    """The generation probe's call as a step a fix is checked on: ``model.generate`` on the batch, as the probe ran
    it, returning the raw logits of each decoding step (an inference step: judged by its output, those logits
    being finite); the model's modes and the RNG streams are put back after each run (the proof restores them)."""
    from ...diagnosis.proof import HeldStep

    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")

    def run() -> Any:
        args, kwargs = generate_call(to_device(batch, device))
        # The raw logits of each step: the scores after the logits processors may hold -inf on purpose.
        kwargs.update(max_new_tokens=max_new_tokens, output_logits=True, return_dict_in_generate=True)
        ctx, _, _ = _autocast_for(device, None, autocast)
        model.eval()
        with torch.no_grad(), ctx:
            out = model.generate(*args, **kwargs)
        return {"logits": tuple(getattr(out, "logits", None) or ()), "sequences": getattr(out, "sequences", out)}

    return HeldStep(run, "the probe's generate() on your batch", modules=(model,),
                    stand_in=f"the probe's generate() on your batch ({max_new_tokens} new tokens)")


def probe_inputs(watcher: Any, model: torch.nn.Module, inputs: tuple[tuple, dict], name: str = "model", scaler: Any = None) -> Any:
    """Probe ``model`` on ``inputs`` a :class:`~mpdoctor.attach.runtime.losses.LossWatcher` kept (one forward +
    backward, everything restored); the watcher's hooks stand aside while the probe runs. The Report."""
    watcher.probing = True
    try:
        return probe(model, ForwardCall.of(*inputs), name=name, scaler=scaler)
    finally:
        watcher.probing = False
