"""Changes as data: what a fix will do, as plain values, resolved against the live table when applied.

A check describes its fix as a tuple of :class:`ChangeSpec` values (refs,
parameter ids, dtype names, attribute names): no live object is captured,
so findings stay plain data. Each kind of spec knows three things:

- ``bind(live)``: the executable :class:`~mpdoctor.objects.edits.steps.Change` steps, computed
  from the live objects at the moment the fix is applied;
- ``simulate(facts)``: the Facts as they will be after the change, so the
  treatment planner can run the checks on the outcome of a plan before
  anything is touched (:mod:`mpdoctor.rules.engine`);
- ``targets()``: ``(ref, key) -> value`` pairs it sets, so two specs that set
  the same thing to different values are seen to conflict.

Adding a kind of change: a frozen dataclass here with those methods, and a
test in ``tests/test_fix_safety.py`` that applying and undoing it restores the
fingerprint exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...objects.edits.steps import (
    Call,
    CastGrads,
    CastParams,
    CastStateEntries,
    Change,
    SetAttr,
    SetEnv,
    SetItem,
    SetRequiresGrad,
    cast_tensor,
)
from ...objects.live.introspect import raw_attr

if TYPE_CHECKING:
    from ...facts import Facts
    from ...objects.live import Live


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


@dataclass(frozen=True)
class DType:
    """A dtype as a value to set (``module.compute_dtype = torch.bfloat16``), kept as its name."""

    name: str

    def resolve(self) -> torch.dtype:
        """The torch dtype."""
        return torch_dtype(self.name)


def _resolve(value: Any) -> Any:
    return value.resolve() if isinstance(value, DType) else value


class ChangeSpec:
    """Base of every change kind (see the module docstring)."""

    def bind(self, live: Live) -> list[Change]:
        """The executable steps, from the live objects now."""
        raise NotImplementedError

    def simulate(self, facts: Facts) -> Facts:
        """Facts after the change; the default is no visible change."""
        return facts

    def verify(self, live: Live) -> str | None:
        """After applying: None when the change took, else what did not."""
        return None

    def targets(self) -> dict[tuple, Any]:
        """``(ref, key) -> value`` this change sets."""
        return {}

    def backup_bytes(self, facts: Facts) -> int:
        """Bytes an undo backup of this change keeps alive."""
        return 0


def _params_of(owner: Any, ids: frozenset[int]) -> list[torch.nn.Parameter]:
    """The live parameters with these ids, from a module or an optimizer."""
    out, seen = [], set()
    if isinstance(owner, torch.nn.Module):
        candidates: Iterable = owner.parameters()
    else:
        candidates = (p for g in getattr(owner, "param_groups", ()) for p in g.get("params", ()))
    for p in candidates:
        if id(p) in ids and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _replace_params(facts: Facts, ids: frozenset[int], dtype: str | None, grad_dtype: str | None, grads_only: bool) -> Facts:
    """Facts with the parameters ``ids`` (and their grads / full-size state) in new dtypes."""
    models = []
    for m in facts.models:
        hit = [p for p in m.tensors.params if p.id in ids]
        if not hit:
            models.append(m)
            continue
        params = tuple(
            p._replace(
                dtype=p.dtype if grads_only else dtype,
                grad_dtype=(grad_dtype if p.grad_dtype is not None else None) if grad_dtype else p.grad_dtype,
            )
            if p.id in ids
            else p
            for p in m.tensors.params
        )
        tensors = dataclasses.replace(m.tensors, params=params)  # its modules derive from the params
        models.append(dataclasses.replace(m, tensors=tensors))
    optimizers = []
    for o in facts.optimizers:
        if not (o.param_ids & ids):
            optimizers.append(o)
            continue
        params = []
        for p in o.params:
            if p.id not in ids:
                params.append(p)
                continue
            new_dtype = p.dtype if grads_only else dtype
            state = tuple((k, new_dtype if (sd == p.dtype and not grads_only) else sd) for k, sd in p.state_dtypes)
            gd = (grad_dtype if p.grad_dtype is not None else None) if grad_dtype else p.grad_dtype
            params.append(p._replace(dtype=new_dtype, grad_dtype=gd, state_dtypes=state))
        optimizers.append(dataclasses.replace(o, params=tuple(params)))
    return dataclasses.replace(facts, models=tuple(models), optimizers=tuple(optimizers))


def _param_bytes(facts: Facts, ids: frozenset[int], dtype: str | None) -> int:
    total = 0
    for m in facts.models:
        for p in m.tensors.params:
            if p.id in ids and p.dtype != dtype and p.device != "meta":
                size = torch_dtype(p.dtype).itemsize if p.dtype in _SIZES else 4
                total += p.numel * size * (2 if p.grad_dtype is not None else 1)
    return total


_SIZES = frozenset({"float32", "float16", "bfloat16", "float64"})


@dataclass(frozen=True)
class PredictedDtypeError:
    """The dtype error a simulated change makes the probed forward raise (read by the checks as a probe's error).

    A cast moves a model's weights and leaves its inputs where they were: an input that reached a layer
    unchanged and no longer matches its weights raises on the next call, as ``F.linear`` / ``conv`` do.
    """

    phase: str
    module: str | None
    class_name: str | None
    exception: str
    message: str
    input_dtypes: tuple[str, ...] = ()
    param_dtypes: tuple[str, ...] = ()

    @property
    def is_dtype_error(self) -> bool:
        """Always: it is the dtype error predicted."""
        return True


def _main_dtype(params: Iterable[Any]) -> str | None:
    """The dtype most floating parameters are in."""
    counts: dict[str, int] = {}
    for q in params:
        if q.dtype in _SIZES:
            counts[q.dtype] = counts.get(q.dtype, 0) + q.numel
    return max(counts, key=counts.__getitem__) if counts else None


def _probe_after_cast(p: Any, model: Any) -> Any:
    """The probe ``p`` as the batch meets ``model`` after a cast of its weights: the inputs keep their dtype."""
    inputs = tuple(getattr(p, "boundary", ()) or ())
    if not inputs:
        return p
    params = model.tensors.params
    by_layer: dict[str, str] = {}
    for q in params:
        if q.dtype in _SIZES:
            by_layer.setdefault(q.module, q.dtype)
    main = _main_dtype(params)
    moved = tuple(
        dataclasses.replace(b, layer_dtype=by_layer.get(b.layer, b.layer_dtype) if b.layer is not None else None,
                            model_dtype=main or b.model_dtype)  # fmt: skip
        for b in inputs
    )
    # Only a mismatch the cast creates: one the probe already saw run (a CPU LayerNorm takes fp32 into bf16) stays.
    clash = [b for b, was in zip(moved, inputs) if b.layer is not None and b.mismatched(p.autocast)
             and not was.mismatched(p.autocast)]  # fmt: skip
    error = p.error
    if clash and error is None:
        b = clash[0]
        error = PredictedDtypeError(
            "forward", b.layer, b.layer_class, "RuntimeError",
            f"{b.key} ({b.dtype}) meets {b.layer} weights in {b.target}: the cast left the input's dtype",
            (b.dtype,), (str(b.target),),
        )  # fmt: skip
    elif not clash and error is not None and error.is_dtype_error and any(b.mismatched(p.autocast) for b in inputs):
        error = None  # the weights now match the input that raised
    return dataclasses.replace(p, boundary=moved, error=error)


#: Dtypes whose range holds what overflowed fp16 (65504): an fp16 overflow is predicted gone in them.
_WIDE = frozenset({"bfloat16", "float32", "float64"})


def _overflow_after_cast(p: Any, model: Any) -> Any:
    """The probe ``p`` after a cast that gives the first module whose fp16 output went inf/NaN (from finite inputs
    and finite weights) a dtype with a wider range: that overflow, and the inf/NaN it carried downstream, predicted
    gone (a prediction the planner plans on; the proof checks it on the step). Any other probe stays as it was."""
    hit = p.first_nonfinite() if hasattr(p, "first_nonfinite") else None
    if hit is None or hit[1] != "forward":
        return p
    first = hit[0]
    cast = {q.module: q.dtype for q in model.tensors.params}
    if ("float16" not in first.param_dtypes or cast.get(first.path) not in _WIDE or first.in_nonfinite
            or first.param_nonfinite):  # fmt: skip
        return p
    modules = tuple(
        dataclasses.replace(m, out_nonfinite=0, in_nonfinite=0,
                            param_dtypes=tuple(cast.get(m.path, d) for d in m.param_dtypes))  # fmt: skip
        if (m.out_nonfinite or m.in_nonfinite) and not m.param_nonfinite else m
        for m in p.modules
    )
    return dataclasses.replace(p, modules=modules, generation=_generation_finite(getattr(p, "generation", None)))


def _generation_finite(generation: Any) -> Any:
    """A generation probe's decoding steps with their logits and probabilities predicted finite (the overflow that
    made them NaN predicted gone); None stays None."""
    if generation is None:
        return None
    return dataclasses.replace(generation, logits_nonfinite=(0,) * len(generation.logits_nonfinite),
                               probs_nonfinite=(0,) * len(generation.probs_nonfinite))  # fmt: skip


def _probes_after_cast(facts: Facts, ids: frozenset[int]) -> Facts:
    """Facts whose probes of the models holding parameters ``ids`` see the batch meet the cast weights."""
    cast = {m.name: m for m in facts.models if any(q.id in ids for q in m.tensors.params)}
    if not cast or not facts.probes:
        return facts
    probes = tuple(_overflow_after_cast(_probe_after_cast(p, cast[p.model]), cast[p.model])
                   if getattr(p, "model", None) in cast else p for p in facts.probes)  # fmt: skip
    return dataclasses.replace(facts, probes=probes)


@dataclass(frozen=True)
class CastParamsTo(ChangeSpec):
    """Cast parameters (with their grads and every holder optimizer's full-size state) to ``dtype``, in place.

    The Parameter objects stay the same, so optimizers, schedulers and hooks keep their references.
    ``owner`` is the model or optimizer whose parameters are looked up by id.
    """

    owner: int
    param_ids: frozenset[int]
    dtype: str
    holders: tuple[int, ...] = ()
    label: str = "parameters"

    def bind(self, live: Live) -> list[Change]:
        params = _params_of(live.get(self.owner), self.param_ids)
        holders = [live.get(r) for r in self.holders if r in live]
        return [CastParams(params, torch_dtype(self.dtype), holders, self.label)]

    def simulate(self, facts: Facts) -> Facts:
        # The inputs keep their dtype: the probed batch meets the cast weights as the next real call will.
        cast = _replace_params(facts, self.param_ids, self.dtype, self.dtype, grads_only=False)
        return _probes_after_cast(cast, self.param_ids)

    def verify(self, live: Live) -> str | None:
        dtype = torch_dtype(self.dtype)
        left = sum(1 for p in _params_of(live.get(self.owner), self.param_ids) if p.dtype != dtype)
        return f"{left} {self.label} are not {self.dtype}" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(pid, "dtype"): self.dtype for pid in self.param_ids}

    def backup_bytes(self, facts: Facts) -> int:
        return _param_bytes(facts, self.param_ids, self.dtype)


@dataclass(frozen=True)
class FreezeParams(ChangeSpec):
    """``requires_grad_(False)`` on the parameters ``param_ids`` of the model ``owner``, and their ``.grad`` dropped;
    undo restores each flag and each grad tensor.

    An optimizer that holds them skips a parameter whose ``.grad`` is None, so it needs no rebuilding: it trains
    what still requires grad. A gradient a step that raised left on them is dropped, or the next step would still
    update them from it.
    """

    owner: int
    param_ids: frozenset[int]
    label: str = "parameters"

    def bind(self, live: Live) -> list[Change]:
        from ...objects.edits.steps import DropGrads

        held = _params_of(live.get(self.owner), self.param_ids)
        params = [p for p in held if p.requires_grad]
        steps: list[Change] = [SetRequiresGrad(params, False, self.label)] if params else []
        stale = [p for p in held if p.grad is not None]
        return steps + ([DropGrads(stale, self.label)] if stale else [])

    def simulate(self, facts: Facts) -> Facts:
        models = []
        for m in facts.models:
            hit = [p for p in m.tensors.params if p.id in self.param_ids]
            if not hit:
                models.append(m)
                continue
            params = tuple(p._replace(requires_grad=False, grad_dtype=None) if p.id in self.param_ids else p
                           for p in m.tensors.params)  # fmt: skip
            frozen = {p.name for p in hit}
            layers = tuple(
                dataclasses.replace(x, trainable=False)
                if all((f"{x.path}.{n}" if x.path else n) in frozen for n in x.params) else x
                for x in getattr(m, "stored_layers", ())
            )  # fmt: skip
            models.append(dataclasses.replace(m, tensors=dataclasses.replace(m.tensors, params=params), stored_layers=layers))
        optimizers = tuple(
            dataclasses.replace(o, params=tuple(p._replace(grad_dtype=None) if p.id in self.param_ids else p for p in o.params))
            if o.param_ids & self.param_ids else o
            for o in facts.optimizers
        )  # fmt: skip
        return dataclasses.replace(facts, models=tuple(models), optimizers=optimizers)

    def verify(self, live: Live) -> str | None:
        params = _params_of(live.get(self.owner), self.param_ids)
        left = sum(1 for p in params if p.requires_grad)
        stale = sum(1 for p in params if p.grad is not None)
        if left or stale:
            return f"{left} {self.label} still require grad, {stale} still hold a gradient"
        return None

    def targets(self) -> dict[tuple, Any]:
        return {(pid, "requires_grad"): False for pid in self.param_ids}


@dataclass(frozen=True)
class CastGradsToParams(ChangeSpec):
    """Cast each listed parameter's ``.grad`` to the parameter's dtype, keeping the grad tensor objects."""

    owner: int
    param_ids: frozenset[int]
    label: str = "parameters"

    def bind(self, live: Live) -> list[Change]:
        return [CastGrads(_params_of(live.get(self.owner), self.param_ids), self.label)]

    def simulate(self, facts: Facts) -> Facts:
        models = []
        for m in facts.models:
            params = tuple(
                p._replace(grad_dtype=p.dtype) if p.id in self.param_ids and p.grad_dtype is not None else p
                for p in m.tensors.params
            )
            models.append(dataclasses.replace(m, tensors=dataclasses.replace(m.tensors, params=params)))
        optimizers = []
        for o in facts.optimizers:
            params = tuple(
                p._replace(grad_dtype=p.dtype) if p.id in self.param_ids and p.grad_dtype is not None else p
                for p in o.params
            )
            optimizers.append(dataclasses.replace(o, params=params))
        return dataclasses.replace(facts, models=tuple(models), optimizers=tuple(optimizers))

    def verify(self, live: Live) -> str | None:
        params = _params_of(live.get(self.owner), self.param_ids)
        left = sum(1 for p in params if p.grad is not None and p.grad.dtype != p.dtype)
        return f"{left} grads still differ from their parameter's dtype" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(pid, "grad"): "param dtype" for pid in self.param_ids}


@dataclass(frozen=True)
class CastStateToParams(ChangeSpec):
    """Cast optimizer state tensors ``(param id, key)`` to their parameter's dtype, as ``load_state_dict`` does."""

    optimizer: int
    entries: frozenset[tuple[int, str]]
    label: str = "state tensors"

    def _pending(self, live: Live) -> list[tuple[dict, Any, torch.dtype]]:
        opt = live.get(self.optimizer)
        by_id = {id(p): p for p in _params_of(opt, frozenset(i for i, _ in self.entries))}
        out = []
        for pid, p in by_id.items():
            st = opt.state.get(p)
            for key, value in st.items() if isinstance(st, dict) else ():
                if (pid, str(key)) in self.entries and torch.is_tensor(value) and value.dtype != p.dtype:
                    out.append((st, key, p.dtype))
        return out

    def bind(self, live: Live) -> list[Change]:
        pending = self._pending(live)
        return [CastStateEntries(pending, self.label)] if pending else []

    def simulate(self, facts: Facts) -> Facts:
        optimizers = []
        for o in facts.optimizers:
            if id(o) and o.params and any((p.id, k) in self.entries for p in o.params for k, _ in p.state_dtypes):
                params = tuple(
                    p._replace(state_dtypes=tuple((k, p.dtype if (p.id, k) in self.entries else d) for k, d in p.state_dtypes))
                    for p in o.params
                )
                o = dataclasses.replace(o, params=params)
            optimizers.append(o)
        return dataclasses.replace(facts, optimizers=tuple(optimizers))

    def verify(self, live: Live) -> str | None:
        left = self._pending(live)
        return f"{len(left)} state tensors still differ from their parameter" if left else None


@dataclass(frozen=True)
class SetAttrTo(ChangeSpec):
    """``obj.attr = value`` on the object ``ref`` (or its submodule ``submodule``); undo restores it exactly.

    ``value`` is plain data (a bool, str, number, None or :class:`DType`).
    """

    ref: int
    attr: str
    value: Any
    label: str
    submodule: str | None = None

    def _obj(self, live: Live) -> Any:
        obj = live.get(self.ref)
        return obj.get_submodule(self.submodule) if self.submodule else obj

    def bind(self, live: Live) -> list[Change]:
        obj, value = self._obj(live), _resolve(self.value)
        if isinstance(obj, dict):
            return [SetItem(obj, self.attr, value, self.label)] if obj.get(self.attr) != value else []
        return [SetAttr(obj, self.attr, value, self.label)] if _differs(obj, self.attr, value) else []

    def simulate(self, facts: Facts) -> Facts:
        return simulate_attr(facts, self.ref, self.attr, self.value)

    def verify(self, live: Live) -> str | None:
        obj, value = self._obj(live), _resolve(self.value)
        current = obj.get(self.attr) if isinstance(obj, dict) else _read(obj, self.attr)
        return None if current == value else f"{self.label} is still {current!r}"

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, self.submodule, self.attr): self.value}


def _read(obj: Any, attr: str) -> Any:
    try:
        return getattr(obj, attr)
    except Exception:
        return raw_attr(obj, attr, None)


def _differs(obj: Any, attr: str, value: Any) -> bool:
    try:
        return getattr(obj, attr) != value
    except Exception:
        return True


def simulate_attr(facts: Facts, ref: int, attr: str, value: Any) -> Facts:
    """Facts after ``obj.attr = value`` where the facts know what that attribute means."""
    if attr in ("use_cache", "_attn_implementation_internal", "_attn_implementation"):
        models = []
        for m in facts.models:
            if any(c.ref == ref for c in m.configs):
                field = "use_cache" if attr == "use_cache" else "attn_implementation"
                configs = tuple(dataclasses.replace(c, **{field: value}) if c.ref == ref else c for c in m.configs)
                m = dataclasses.replace(m, configs=configs)
            models.append(m)
        return dataclasses.replace(facts, models=tuple(models))
    if attr == "_enabled":
        names = {s.name for s in facts.subjects if s.ref == ref}
        scalers = tuple(dataclasses.replace(s, enabled=bool(value)) if s.name in names else s for s in facts.scalers)
        return dataclasses.replace(facts, scalers=scalers)
    return facts


#: The GradScaler fields ``load_state_dict`` writes: plain numbers, and the lazily made tensors it fills.
_SCALER_FIELDS = ("_init_scale", "_growth_factor", "_backoff_factor", "_growth_interval", "_init_growth_tracker")
_SCALER_TENSORS = ("_scale", "_growth_tracker")


def _scaler_holds(scaler: Any, state: dict) -> bool:
    """The live scaler's state is the held one (what ``load_state_dict(state)`` would leave)."""
    now = scaler.state_dict()
    return bool(now) and all(float(now[k]) == float(state[k]) for k in now)  # a tensor value reads as its number


def _load_scaler_state(scaler: Any, state: dict) -> tuple[dict, dict]:
    """``scaler.load_state_dict(state)``; returns the fields and tensor values it overwrote, for the undo."""
    fields = {k: scaler.__dict__[k] for k in _SCALER_FIELDS if k in scaler.__dict__}
    tensors = {k: t.clone() for k in _SCALER_TENSORS if isinstance(t := scaler.__dict__.get(k), torch.Tensor)}
    scaler.load_state_dict(state)
    return fields, tensors


def _restore_scaler(scaler: Any, saved: tuple[dict, dict]) -> None:
    fields, tensors = saved
    scaler.__dict__.update(fields)
    for k, value in tensors.items():
        scaler.__dict__[k].copy_(value)  # the same tensor objects: a loop's reference to them stays valid


@dataclass(frozen=True)
class LoadScalerState(ChangeSpec):
    """``scaler.load_state_dict(state)`` for a GradScaler state the user holds (``ckpt["scaler"]``), in place;
    undo puts back exactly the fields and tensor values it overwrote."""

    scaler: int
    state: int
    label: str

    def bind(self, live: Live) -> list[Change]:
        scaler, state = live.get(self.scaler), live.get(self.state)
        if _scaler_holds(scaler, state):
            return []
        return [Call(lambda: _load_scaler_state(scaler, state), lambda saved: _restore_scaler(scaler, saved),
                     self.label, held=lambda: _scaler_holds(scaler, state))]  # fmt: skip

    def simulate(self, facts: Facts) -> Facts:
        held = next((h for h in facts.scaler_states if h.ref == self.state), None)
        names = {s.name for s in facts.subjects if self.scaler in (s.ref, s.inner_ref)}
        if held is None:
            return facts

        def loaded(sc: Any) -> Any:
            return dataclasses.replace(
                sc, init_scale=held.scale, scale=held.scale if sc.scale is not None else None,
                growth_tracker=held.growth_tracker if sc.growth_tracker is not None else None,
                init_growth_tracker=held.growth_tracker, growth_interval=held.growth_interval,
            )  # fmt: skip

        scalers = tuple(loaded(sc) if sc.name in names else sc for sc in facts.scalers)
        return dataclasses.replace(facts, scalers=scalers)

    def verify(self, live: Live) -> str | None:
        held = _scaler_holds(live.get(self.scaler), live.get(self.state))
        return None if held else f"{self.label}: the scaler does not hold the state"

    def targets(self) -> dict[tuple, Any]:
        return {(self.scaler, None, "state_dict"): self.state}


@dataclass(frozen=True)
class AlignPrecision(ChangeSpec):
    """Bring a setup (arguments, accelerator, prepared models) to ``precision``, autocasting iff ``native``.

    Resolved by the accelerate integration at apply time: it edits
    ``AcceleratorState._mixed_precision``, ``native_amp``, the shared GradScaler
    and the autocast wrapper of already prepared models, as
    ``Accelerator.__init__`` and ``prepare_model`` would have set them.
    """

    setup: str
    precision: str
    native: bool
    flags: tuple[tuple[str, Any], ...] = ()
    args: int = 0
    accelerator: int = 0
    args_name: str | None = None
    accelerator_name: str | None = None
    models: tuple[tuple[str, int], ...] = ()

    def _live_setup(self, live: Live) -> Any:
        from ...libraries.accelerate.integration import LiveSetup

        args = live.get(self.args) if self.args else None
        acc = live.get(self.accelerator) if self.accelerator else None
        models = [(n, live.get(r)) for n, r in self.models if r in live]
        return LiveSetup(args, self.args_name, acc, self.accelerator_name, models)

    def bind(self, live: Live) -> list[Change]:
        from ...libraries.accelerate.integration import precision_changes

        return precision_changes(self._live_setup(live), self.precision, self.native, dict(self.flags))

    def simulate(self, facts: Facts) -> Facts:
        from ...facts.precision import computes_in

        out = []
        for p in facts.precisions:
            if p.name == self.setup:
                args = dict(p.args)
                if p.args_name is not None:
                    args.update(dict(self.flags))
                    args["mixed_precision"] = self.precision
                requested = "fp16" if args.get("fp16") else "bf16" if args.get("bf16") else ("no" if args else None)
                p = dataclasses.replace(
                    p,
                    args=args,
                    requested=requested if p.requested is not None else None,
                    accelerator_mixed_precision=self.precision if p.accelerator_name else p.accelerator_mixed_precision,
                    native_amp=self.native if p.accelerator_name else p.native_amp,
                    env_mixed_precision=None if p.env_mixed_precision not in (None, self.precision) else p.env_mixed_precision,
                )
                p = dataclasses.replace(p, computes_in=computes_in(p, facts.hardware))
            out.append(p)
        return dataclasses.replace(facts, precisions=tuple(out))

    def verify(self, live: Live) -> str | None:
        setup = self._live_setup(live)
        bad = []
        if setup.args is not None and raw_attr(setup.args, "mixed_precision", None) != self.precision:
            bad.append("args.mixed_precision")
        if setup.acc is not None:
            if raw_attr(raw_attr(setup.acc, "state", None), "_mixed_precision", None) != self.precision:
                bad.append("accelerator.mixed_precision")
            if bool(raw_attr(setup.acc, "native_amp", False)) != self.native:
                bad.append("accelerator.native_amp")
        return f"{', '.join(bad)} still differ" if bad else None

    def targets(self) -> dict[tuple, Any]:
        return {("setup", self.setup): (self.precision, self.native)}


#: accelerate's process-wide Borg dicts that ``AcceleratorState._reset_state(True)`` clears, in that order.
_ACCELERATE_SHARED = ("AcceleratorState", "PartialState")


def _accelerate_shared() -> list[dict]:
    """The shared-state dicts of accelerate's state classes (every instance's ``__dict__`` is one of them); none
    when accelerate is not imported."""
    import sys

    module = sys.modules.get("accelerate.state")
    dicts = [raw_attr(raw_attr(module, name, None), "_shared_state", None) for name in _ACCELERATE_SHARED]
    return [d for d in dicts if isinstance(d, dict)] if module is not None else []


def _clear_shared(dicts: list[dict]) -> list[dict]:
    saved = [dict(d) for d in dicts]  # copied before the first clear
    for d in dicts:
        d.clear()
    return saved


def _restore_shared(dicts: list[dict], saved: list[dict]) -> None:
    for d, content in zip(dicts, saved):
        d.clear()
        d.update(content)  # the same dict objects: an Accelerator the kernel holds sees its state again


@dataclass(frozen=True)
class ResetAccelerateState(ChangeSpec):
    """What ``AcceleratorState._reset_state(True)`` does, in place: clear accelerate's shared ``AcceleratorState`` and
    ``PartialState`` dicts, so ``notebook_launcher`` sees a kernel where no Accelerator was made. Undo puts every
    entry back into the same dicts."""

    def bind(self, live: Live) -> list[Change]:
        dicts = _accelerate_shared()
        if not any(dicts):
            return []
        return [Call(lambda: _clear_shared(dicts), lambda saved: _restore_shared(dicts, saved),
                     "AcceleratorState._reset_state(True)", held=lambda: not any(dicts))]  # fmt: skip

    def simulate(self, facts: Facts) -> Facts:
        if facts.distributed is None:
            return facts
        return dataclasses.replace(facts, distributed=dataclasses.replace(facts.distributed,
                                                                          accelerator_state_initialized=False))

    def verify(self, live: Live) -> str | None:
        left = [name for name, d in zip(_ACCELERATE_SHARED, _accelerate_shared()) if d]
        return f"{', '.join(left)} still hold state" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {("accelerate", "shared_state"): "reset"}


@dataclass(frozen=True)
class SetEnvVar(ChangeSpec):
    """``os.environ[name] = value`` (None removes it); undo restores the variable as it was, or its absence."""

    name: str
    value: str | None

    def bind(self, live: Live) -> list[Change]:
        import os

        return [SetEnv(self.name, self.value)] if os.environ.get(self.name) != self.value else []

    def simulate(self, facts: Facts) -> Facts:
        env = {k: v for k, v in facts.runtime.env.items() if k != self.name}
        if self.value is not None:
            env[self.name] = self.value
        return dataclasses.replace(facts, runtime=dataclasses.replace(facts.runtime, env=env))

    def verify(self, live: Live) -> str | None:
        import os

        current = os.environ.get(self.name)
        return None if current == self.value else f"{self.name} is still {current!r}"

    def targets(self) -> dict[tuple, Any]:
        return {("env", self.name): self.value}


@dataclass(frozen=True)
class SetMatmulPrecision(ChangeSpec):
    """``torch.set_float32_matmul_precision(value)``, process-wide; undo restores every backend's setting."""

    value: str

    def bind(self, live: Live) -> list[Change]:
        from ...objects.edits.steps import Call
        from ...objects.edits.torch_state import fp32_precisions, restore_fp32_precisions

        def do() -> tuple[str, dict]:
            old = (torch.get_float32_matmul_precision(), fp32_precisions())
            torch.set_float32_matmul_precision(self.value)
            return old

        def undo(old: tuple[str, dict]) -> None:
            torch.set_float32_matmul_precision(old[0])
            restore_fp32_precisions(old[1])  # the legacy setter leaves "ieee" where "none" was

        return [Call(do, undo, f"torch.set_float32_matmul_precision({self.value!r})",
                     held=lambda: torch.get_float32_matmul_precision() == self.value)]  # fmt: skip

    def simulate(self, facts: Facts) -> Facts:
        runtime = dataclasses.replace(
            facts.runtime, float32_matmul_precision=self.value, matmul_tf32=self.value != "highest"
        )
        return dataclasses.replace(facts, runtime=runtime)

    def verify(self, live: Live) -> str | None:
        now = torch.get_float32_matmul_precision()
        return None if now == self.value else f"float32_matmul_precision is {now!r}"

    def targets(self) -> dict[tuple, Any]:
        return {("torch", "float32_matmul_precision"): self.value}


@dataclass(frozen=True)
class SetComputeDtype(SetAttrTo):
    """``SetAttrTo`` for a quantized layer's ``compute_dtype`` or a quantization config's ``bnb_4bit_compute_dtype``.

    Binds like ``SetAttrTo``; its simulation updates the facts that say what the layers compute in (the
    bitsandbytes layer facts, the config's ``bnb_compute_dtype``), so the planner sees the fix take.
    """

    def simulate(self, facts: Facts) -> Facts:
        name = self.value.name if isinstance(self.value, DType) else str(self.value)
        models = []
        for m in facts.models:
            if self.submodule is not None and m.ref == self.ref and self.attr == "compute_dtype":
                layers = tuple(
                    dataclasses.replace(x, compute_dtype=name, compute_dtype_set=True) if x.path == self.submodule else x
                    for x in m.low_bit_layers
                )
                m = dataclasses.replace(m, low_bit_layers=layers)
            elif self.attr == "bnb_4bit_compute_dtype" and any(c.quant_ref == self.ref for c in m.configs):
                configs = tuple(
                    dataclasses.replace(c, bnb_compute_dtype=name) if c.quant_ref == self.ref else c for c in m.configs
                )
                m = dataclasses.replace(m, configs=configs)
            models.append(m)
        return dataclasses.replace(facts, models=tuple(models))


@dataclass(frozen=True)
class SetGroupOption(ChangeSpec):
    """``group[key] = value`` in every param group of the optimizer ``ref`` and in its ``defaults``.

    Undo restores each group's own value exactly. ``key`` is a hyperparameter the optimizer reads at every
    step (``eps``), so the change takes effect at the next ``step()``.
    """

    ref: int
    key: str
    value: Any
    label: str

    def bind(self, live: Live) -> list[Change]:
        opt = live.get(self.ref)
        steps: list[Change] = []
        for i, group in enumerate(raw_attr(opt, "param_groups", None) or ()):
            if isinstance(group, dict) and group.get(self.key) != self.value:
                steps.append(SetItem(group, self.key, self.value, f"{self.label}.param_groups[{i}][{self.key!r}]"))
        defaults = raw_attr(opt, "defaults", None)
        if isinstance(defaults, dict) and self.key in defaults and defaults[self.key] != self.value:
            steps.append(SetItem(defaults, self.key, self.value, f"{self.label}.defaults[{self.key!r}]"))
        return steps

    def simulate(self, facts: Facts) -> Facts:
        names = {s.name for s in facts.subjects if s.inner_ref == self.ref or s.ref == self.ref}
        out = []
        for o in facts.optimizers:
            if o.name in names:
                defaults = {**o.defaults, self.key: self.value} if self.key in o.defaults else o.defaults
                eps = tuple(self.value for _ in o.group_eps) if self.key == "eps" else o.group_eps
                o = dataclasses.replace(o, defaults=defaults, group_eps=eps)
            out.append(o)
        return dataclasses.replace(facts, optimizers=tuple(out))

    def verify(self, live: Live) -> str | None:
        groups = raw_attr(live.get(self.ref), "param_groups", None) or ()
        left = sum(1 for g in groups if isinstance(g, dict) and g.get(self.key) != self.value)
        return f"{left} param groups of {self.label} still have another {self.key}" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, "param_groups", self.key): self.value}


@dataclass(frozen=True)
class RecomputeRopeBuffers(ChangeSpec):
    """Replace half-precision rotary ``inv_freq`` buffers of the model ``ref`` with fp32 ones recomputed from its config.

    Resolved by the transformers integration (``rope_fp32_changes``): the buffer dict entries are swapped,
    so undo puts the very same half-precision tensors back.
    """

    ref: int
    paths: tuple[str, ...]
    label: str = "rotary embeddings"

    def bind(self, live: Live) -> list[Change]:
        from ...libraries.transformers.integration import rope_fp32_changes

        return rope_fp32_changes(live.get(self.ref), self.paths)

    def simulate(self, facts: Facts) -> Facts:
        models = []
        for m in facts.models:
            if self.ref in (m.ref, m.inner_ref):
                kept = tuple(r for r in m.rope_buffers if r[0] not in self.paths)
                m = dataclasses.replace(m, rope_buffers=kept)
            models.append(m)
        return dataclasses.replace(facts, models=tuple(models))

    def verify(self, live: Live) -> str | None:
        from ...libraries.transformers.integration import _rope_modules

        mods = dict(_rope_modules(live.get(self.ref)))
        left = [p for p in self.paths if p in mods and mods[p].__dict__["_buffers"]["inv_freq"].dtype != torch.float32]
        return f"{len(left)} rotary inv_freq buffers are not fp32" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, p, "inv_freq"): "float32" for p in self.paths}


def _deepspeed_configs(live: Live, refs: tuple[int, ...]) -> list[dict]:
    return [c for c in (live.get(r) for r in refs if r in live) if isinstance(c, dict)]


@dataclass(frozen=True)
class SetDeepSpeedPrecision(ChangeSpec):
    """Set ``fp16.enabled`` / ``bf16.enabled`` of a DeepSpeed config before ``train()``, in place.

    ``configs`` are the config dicts that must agree (the arguments' and the accelerator's);
    ``mismatch_lists`` the HF integration's ``mismatches`` lists, from which the lines about these
    keys are dropped (``trainer_config_finalize`` raises on whatever is left).
    """

    setup: str
    configs: tuple[int, ...]
    mismatch_lists: tuple[int, ...]
    fp16: bool
    bf16: bool
    #: With ``args`` (and ``state``): the TrainingArguments' ``fp16`` / ``bf16`` / ``mixed_precision`` and the
    #: ``AcceleratorState``'s mode change with the config (a precision switch, not only the config following).
    args: int = 0
    state: int = 0

    @property
    def mode(self) -> str:
        return "fp16" if self.fp16 else "bf16" if self.bf16 else "no"

    def bind(self, live: Live) -> list[Change]:
        from ...libraries.deepspeed.integration import ConfigPrecision

        lists = [x for x in (live.get(r) for r in self.mismatch_lists if r in live) if isinstance(x, list)]
        values = {"fp16": self.fp16, "bf16": self.bf16}
        steps: list[Change] = [ConfigPrecision(_deepspeed_configs(live, self.configs), lists, values,
                                               f"{self.setup}: DeepSpeed fp16.enabled={self.fp16}, bf16.enabled={self.bf16}")]
        if self.args and self.args in live:
            args = live.get(self.args)
            for key, value in (("fp16", self.fp16), ("bf16", self.bf16), ("mixed_precision", self.mode)):
                if _differs(args, key, value):
                    steps.append(SetAttr(args, key, value, f"{self.setup} arguments.{key}"))
        if self.state and self.state in live:
            state = live.get(self.state)
            if raw_attr(state, "_mixed_precision", None) != self.mode:
                steps.append(SetAttr(state, "_mixed_precision", self.mode, f"{self.setup} accelerator mixed_precision"))
        return steps

    def simulate(self, facts: Facts) -> Facts:
        out = []
        for d in facts.deepspeed:
            if d.config_ref in self.configs:
                d = dataclasses.replace(d, fp16=self.fp16, bf16=self.bf16, mismatches=())
                if self.args:
                    d = dataclasses.replace(d, args_fp16=self.fp16, args_bf16=self.bf16)
            out.append(d)
        return dataclasses.replace(facts, deepspeed=tuple(out))

    def verify(self, live: Live) -> str | None:
        for cfg in _deepspeed_configs(live, self.configs):
            for key, want in (("fp16", self.fp16), ("bf16", self.bf16)):
                section = cfg.get(key)
                if not isinstance(section, dict) or section.get("enabled") is not want:
                    return f"DeepSpeed {key}.enabled is not {want}"
        return None

    def targets(self) -> dict[tuple, Any]:
        out: dict[tuple, Any] = {(r, key): v for r in self.configs for key, v in (("fp16.enabled", self.fp16), ("bf16.enabled", self.bf16))}
        if self.args:
            out.update({(self.args, None, "fp16"): self.fp16, (self.args, None, "bf16"): self.bf16})
        return out


@dataclass(frozen=True)
class SetDeepSpeedConfigKey(ChangeSpec):
    """Set a top-level key of DeepSpeed config dicts before ``train()`` (``communication_data_type``)."""

    setup: str
    configs: tuple[int, ...]
    key: str
    value: Any

    def bind(self, live: Live) -> list[Change]:
        from ...libraries.deepspeed.integration import ConfigKey

        cfgs = [c for c in _deepspeed_configs(live, self.configs) if c.get(self.key) != self.value]
        return [ConfigKey(cfgs, self.key, self.value, f"{self.setup}: DeepSpeed {self.key}={self.value!r}")] if cfgs else []

    def simulate(self, facts: Facts) -> Facts:
        if self.key != "communication_data_type":
            return facts
        name = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(self.value, self.value)
        out = tuple(
            dataclasses.replace(d, communication_data_type=name) if d.config_ref in self.configs else d
            for d in facts.deepspeed
        )
        return dataclasses.replace(facts, deepspeed=out)

    def verify(self, live: Live) -> str | None:
        bad = [c for c in _deepspeed_configs(live, self.configs) if c.get(self.key) != self.value]
        return f"DeepSpeed {self.key} is not {self.value!r}" if bad else None

    def targets(self) -> dict[tuple, Any]:
        return {(r, self.key): self.value for r in self.configs}


@dataclass(frozen=True)
class CastHeldTensors(ChangeSpec):
    """Cast tensors a module holds beside its weights (buffers, plain tensor attributes) to ``dtype``, in place.

    ``ref`` is the module, ``names`` its attributes. A buffer stays a buffer (its entry in ``_buffers`` is
    replaced), an attribute stays an attribute; undo puts the very tensor objects back.
    """

    ref: int
    names: tuple[str, ...]
    dtype: str
    label: str = "module"

    def _slots(self, live: Live) -> list[tuple[dict, str]]:
        module = live.get(self.ref)
        buffers = object.__getattribute__(module, "_buffers")
        own = object.__getattribute__(module, "__dict__")
        return [(buffers if name in buffers else own, name) for name in self.names]

    def bind(self, live: Live) -> list[Change]:
        dtype, steps = torch_dtype(self.dtype), []
        for slot, name in self._slots(live):
            tensor = slot.get(name)
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.dtype != dtype:
                step = SetItem(slot, name, cast_tensor(tensor, dtype), f"{self.label}.{name}")
                step.description = f"cast {self.label}.{name} to {self.dtype}"
                steps.append(step)
        return steps

    def verify(self, live: Live) -> str | None:
        dtype = torch_dtype(self.dtype)
        left = [name for slot, name in self._slots(live)
                if isinstance(slot.get(name), torch.Tensor) and slot[name].dtype != dtype]  # fmt: skip
        return f"{', '.join(left)} still not {self.dtype}" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, name, "dtype"): self.dtype for name in self.names}


# -- the batch at the model's boundary, and normalisation epsilons ---------------------------------------

#: Methods through which a model is called besides ``forward`` that run its layers directly (diffusers'
#: autoencoders: ``vae.encode(x)``, ``vae.decode(z)``): an input cast covers them too when the model's class has them.
ENTRY_METHODS = ("encode", "decode")

#: Marker of the input-casting pre-hook (one per model: applying twice never stacks two).
CAST_INPUTS_MARKER = "mpdoctor-cast-floating-inputs"


def cast_floating(value: Any, dtype: torch.dtype, depth: int = 0) -> Any:
    """``value`` with every floating tensor in ``dtype``; integer ids and bool masks are left as they are."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if depth < 3 and isinstance(value, dict):
        cast = {k: cast_floating(v, dtype, depth + 1) for k, v in value.items()}
        changed = [k for k, v in value.items() if cast[k] is not v]
        if not changed or type(value) is dict:
            return value if not changed else cast
        # A dict subclass keeps its class (generate hands the forward a ModelOutput read by index and by key).
        try:
            out = copy.copy(value)
            for k in changed:
                out[k] = cast[k]
        except Exception:  # a mapping that cannot be copied passes as it came
            return value
        return out
    if depth < 3 and type(value) in (tuple, list):
        return type(value)(cast_floating(v, dtype, depth + 1) for v in value)
    return value


def cast_inputs_hook(dtype: torch.dtype) -> Any:
    """A forward pre-hook (``with_kwargs=True``) casting floating inputs to ``dtype``."""

    def cast_floating_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return cast_floating(args, dtype), cast_floating(kwargs, dtype)

    return cast_floating_inputs


def _batch_fixed(facts: Facts, keys: frozenset[str] | None, dtype: str) -> Facts:
    """Facts whose probes saw the batch inputs ``keys`` (None: all) in ``dtype`` and no dtype error from them."""
    probes = []
    for p in facts.probes:
        inputs = tuple(getattr(p, "boundary", ()) or ())
        if not inputs:
            probes.append(p)
            continue
        fixed = tuple(
            dataclasses.replace(b, dtype=dtype) if (keys is None or b.key in keys) and b.floating else b for b in inputs
        )
        error = p.error
        if error is not None and error.is_dtype_error and any(b.mismatched(p.autocast) for b in inputs):
            error = None  # the batch's dtype was what raised
        probes.append(dataclasses.replace(p, boundary=fixed, error=error))
    return dataclasses.replace(facts, probes=tuple(probes))


def cast_arguments(dtype: torch.dtype) -> Any:
    """``(args, kwargs) -> (args, kwargs)`` with every floating tensor in ``dtype`` (for a wrapped method)."""

    def cast(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return cast_floating(args, dtype), cast_floating(kwargs, dtype)

    return cast


#: The calls into a module that its ``forward`` pre-hook already covers (``module(x)`` and ``forward`` itself).
FORWARD_CALLS = frozenset({"forward", "__call__", "_call_impl", "_wrapped_call_impl"})


@dataclass(frozen=True)
class CastInputsHook(ChangeSpec):
    """Cast the floating inputs of the model ``ref`` to ``dtype`` at every entry point the user calls; undo removes it.

    The model's ``forward`` gets a pre-hook (``model(x)``). ``entries`` are the other calls the user makes into
    it, found from a traceback or a loop: ``(submodule path, method)`` pairs such as ``("", "decode")``,
    ``("", "generate")`` or ``("encoder", "forward")``; a ``forward`` entry gets a pre-hook on that submodule,
    any other method a wrapper on the instance (:class:`~mpdoctor.objects.edits.steps.MethodInputCast`), since a call
    to ``vae.decode(z)`` never runs ``vae``'s forward hooks. Integer ids and bool masks pass unchanged.
    One cast per entry: a second application does nothing.
    """

    ref: int
    dtype: str
    label: str = "model"
    entries: tuple[tuple[str, str], ...] = ()

    def _entries(self) -> tuple[tuple[str, str], ...]:
        """The model's forward, then every other entry (each once)."""
        out = [("", "forward")]
        for path, method in self.entries:
            entry = (path, "forward" if method in FORWARD_CALLS else method)
            if entry not in out:
                out.append(entry)
        return tuple(out)

    def _live_entries(self, model: Any) -> tuple[tuple[str, str], ...]:
        """The entries, and the model's own entry methods besides forward (an autoencoder's ``encode`` and
        ``decode``): the user reaches the model through them as often as through ``model(x)``."""
        own = tuple(("", name) for name in ENTRY_METHODS
                    if callable(getattr(type(model), name, None)) and ("", name) not in self._entries())  # fmt: skip
        return self._entries() + own

    def bind(self, live: Live) -> list[Change]:
        from ...objects.edits.steps import ForwardPreHook, MethodInputCast

        model, dtype = live.get(self.ref), torch_dtype(self.dtype)
        steps: list[Change] = []
        for path, method in self._live_entries(model):
            target = model.get_submodule(path) if path else model
            where = f"{self.label}.{path}" if path else self.label
            if method == "forward":
                if not ForwardPreHook.registered(target, CAST_INPUTS_MARKER):
                    steps.append(ForwardPreHook(target, cast_inputs_hook(dtype), CAST_INPUTS_MARKER,
                                                f"{where}: cast floating inputs to {self.dtype}"))  # fmt: skip
            elif not MethodInputCast.registered(target, method, CAST_INPUTS_MARKER):
                steps.append(MethodInputCast(target, method, cast_arguments(dtype), CAST_INPUTS_MARKER,
                                             f"{where}.{method}: cast floating arguments to {self.dtype}"))  # fmt: skip
        return steps

    def simulate(self, facts: Facts) -> Facts:
        return _batch_fixed(facts, None, self.dtype)

    def covers(self, path: str, method: str) -> bool:
        """True when a call ``model.<path>.<method>(...)`` has its floating inputs cast by this change."""
        return (path, "forward" if method in FORWARD_CALLS else method) in self._entries()

    def verify(self, live: Live) -> str | None:
        from ...objects.edits.steps import ForwardPreHook, MethodInputCast

        model, missing = live.get(self.ref), []
        for path, method in self._live_entries(model):
            target = model.get_submodule(path) if path else model
            on = (ForwardPreHook.registered(target, CAST_INPUTS_MARKER) if method == "forward"
                  else MethodInputCast.registered(target, method, CAST_INPUTS_MARKER))  # fmt: skip
            if not on:
                missing.append(".".join(x for x in (path, method) if x))
        return f"no input cast at {', '.join(missing)}" if missing else None

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, path, method, "input-dtype"): self.dtype for path, method in self._entries()}


@dataclass(frozen=True)
class KeepModuleFp32(ChangeSpec):
    """Keep the submodule ``path`` of the model ``ref`` in fp32 with autocast off inside it, in place.

    Its parameters are cast to fp32 (the same Parameter objects, the holders' optimizer state with them) and its
    ``forward`` is wrapped on the instance: floating inputs to fp32 and autocast off for ``device`` while it runs
    (what ``_keep_in_fp32_modules`` gives a class). The modules after it keep autocasting. Undo removes the wrapper
    and casts the parameters back exactly.
    """

    ref: int
    path: str
    param_ids: frozenset[int]
    device: str = "cpu"
    holders: tuple[int, ...] = ()
    label: str = "module"
    #: Its floating outputs cast back to the dtype of its floating inputs (an fp32 island in a bf16 / fp16 model
    #: run without autocast: the layers after it get the dtype they compute in).
    cast_back: bool = False
    #: Its floating outputs cast to this dtype (``"float16"``), whatever its inputs were: the last module of an fp32
    #: span (:func:`mpdoctor.attach.numerics.fp32_span.overflow_span`), whose fp32 inputs come from the span and whose
    #: output is back in range.
    cast_to: str = ""
    #: The forward was run again with this module's span kept in fp32 and came out finite (the generation probe's
    #: re-probe): the planner may predict the overflow gone though no autocast takes the fp32 output downstream.
    span_checked: bool = False

    def bind(self, live: Live) -> list[Change]:
        from ...objects.edits.steps import MethodInputCast

        model = live.get(self.ref)
        module = model.get_submodule(self.path) if self.path else model
        holders = [live.get(r) for r in self.holders if r in live]
        device = self.device
        steps: list[Change] = [CastParams(_params_of(module, self.param_ids), torch.float32, holders, self.label)]
        if not MethodInputCast.registered(module, "forward", KEEP_FP32_MARKER):
            restore = outputs_in(getattr(torch, self.cast_to)) if self.cast_to else (
                outputs_in_inputs_dtype if self.cast_back else None)  # fmt: skip
            back = f", outputs cast to {self.cast_to}" if self.cast_to else ", outputs cast back" if self.cast_back else ""
            steps.append(MethodInputCast(module, "forward", cast_arguments(torch.float32), KEEP_FP32_MARKER,
                                         f"{self.label}: fp32 inputs, autocast off inside{back}",
                                         context=lambda: torch.autocast(device, enabled=False),
                                         restore=restore))  # fmt: skip
        return steps

    def simulate(self, facts: Facts) -> Facts:
        facts = _replace_params(facts, self.param_ids, "float32", "float32", grads_only=False)
        return _probes_in_fp32(facts, self.ref, self.path, self.span_checked)

    def verify(self, live: Live) -> str | None:
        from ...objects.edits.steps import MethodInputCast

        model = live.get(self.ref)
        module = model.get_submodule(self.path) if self.path else model
        if not MethodInputCast.registered(module, "forward", KEEP_FP32_MARKER):
            return f"{self.label}'s forward is not kept in fp32"
        left = sum(1 for p in _params_of(module, self.param_ids) if p.dtype != torch.float32)
        return f"{left} parameters of {self.label} are not float32" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(pid, "dtype"): "float32" for pid in self.param_ids}

    def backup_bytes(self, facts: Facts) -> int:
        return _param_bytes(facts, self.param_ids, "float32")


@dataclass(frozen=True)
class KeepCallFp32(ChangeSpec):
    """Run the ops with no half-precision kernel (``families``: torch.linalg's factorizations and solves, torch.fft)
    in fp32 inside the method ``method`` of the object ``ref``, in place: an fp32 island around a call that is no
    module's forward (an optimizer's ``step``).

    The method is wrapped on the instance (its class and every other instance are untouched); while it runs, a
    ``TorchFunctionMode`` (:class:`~mpdoctor.objects.edits.fp32_ops.Fp32Kernels`) gives those ops fp32 copies of their
    bf16 / fp16 tensors and casts their results back. Undo removes the wrapper (the attribute the instance held
    before, if any, is back). No tensor of the object is cast.
    """

    ref: int
    method: str
    families: tuple[str, ...] = ("linalg", "fft")
    label: str = "step"

    def bind(self, live: Live) -> list[Change]:
        from ...objects.edits.fp32_ops import Fp32KernelsContext
        from ...objects.edits.steps import MethodInputCast

        return [MethodInputCast(live.get(self.ref), self.method, _arguments_unchanged, FP32_OPS_MARKER,
                                f"{self.label}: {' / '.join(self.families)} ops in fp32 inside, results cast back",
                                context=Fp32KernelsContext(self.families))]  # fmt: skip

    def verify(self, live: Live) -> str | None:
        from ...objects.edits.steps import MethodInputCast

        if not MethodInputCast.registered(live.get(self.ref), self.method, FP32_OPS_MARKER):
            return f"{self.label} does not run its {' / '.join(self.families)} ops in fp32"
        return None

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, self.method, "fp32-ops"): self.families}


def _arguments_unchanged(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's arguments as given: the island is inside the call, around each op without a half kernel."""
    return args, kwargs


#: Marker of the fp32-ops wrapper around a call (one per method of an instance).
FP32_OPS_MARKER = "mpdoctor-fp32-ops"


_HALF = frozenset({"float16", "bfloat16"})


def _probes_in_fp32(facts: Facts, ref: int, path: str, span_checked: bool = False) -> Facts:
    """The probes of the model ``ref`` after its submodule ``path`` is kept in fp32: a forward NaN/Inf first made
    inside it, in half precision, from finite inputs and finite weights (fp16's 65504, an eps that is 0 in fp16)
    predicted gone with what it carried downstream and back through the backward (a prediction the planner plans on; the proof checks it)."""
    out = []
    for p in facts.probes:
        hit = p.first_nonfinite() if getattr(p, "model_ref", 0) == ref and hasattr(p, "first_nonfinite") else None
        first = hit[0] if hit is not None and hit[1] == "forward" else None
        # Without autocast, a submodule's fp32 output meets the half-precision layers after it (a dtype error, or
        # the same overflow once cast back): only autocast, which casts per op, or the whole model (its output is
        # the user's) takes the island's fp32 result.
        # A span the probe re-ran finite carries the fp32 stream itself to where it is back in range.
        downstream_ok = p.autocast in _HALF or not path or span_checked
        if (first is None or (path and first.path != path and not first.path.startswith(path + "."))
                or first.in_nonfinite or first.param_nonfinite or not downstream_ok
                or not (p.autocast in _HALF or _HALF & {*first.input_dtypes, *first.param_dtypes})):  # fmt: skip
            out.append(p)
            continue
        modules = tuple(dataclasses.replace(m, out_nonfinite=0, in_nonfinite=0, grad_nonfinite=0, param_grad_nonfinite=0)
                        if not m.param_nonfinite else m for m in p.modules)  # the backward's NaN came from it too  # fmt: skip
        out.append(dataclasses.replace(p, modules=modules, generation=_generation_finite(getattr(p, "generation", None))))
    return dataclasses.replace(facts, probes=tuple(out)) if out != list(facts.probes) else facts


def outputs_in(dtype: torch.dtype) -> Callable[[Any, tuple, dict], Any]:
    """``(out, args, kwargs) -> out`` with its floating tensors in ``dtype`` (the exit of an fp32 span)."""

    def restore(out: Any, args: tuple, kwargs: dict) -> Any:
        return cast_floating(out, dtype)

    return restore


def outputs_in_inputs_dtype(out: Any, args: tuple, kwargs: dict) -> Any:
    """``out`` with its floating tensors in the dtype of the first floating tensor of the call's arguments (as it was
    before an fp32 island upcast them); unchanged when the arguments held none, or held fp32."""
    dtype = next((t.dtype for t in _floating_tensors((args, kwargs))), None)
    if dtype is None or dtype == torch.float32:
        return out
    return cast_floating(out, dtype)


def _floating_tensors(value: Any, depth: int = 3) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif depth and isinstance(value, (list, tuple)):
        for item in value:
            yield from _floating_tensors(item, depth - 1)
    elif depth and isinstance(value, dict):
        for item in value.values():
            yield from _floating_tensors(item, depth - 1)


#: Marker of the fp32-with-autocast-off wrapper (one per module).
KEEP_FP32_MARKER = "mpdoctor-keep-fp32"


@dataclass(frozen=True)
class CastBatchItems(ChangeSpec):
    """Cast the floating entries ``keys`` of a dict batch (``dict``, ``BatchFeature``, ``BatchEncoding``) in place."""

    ref: int
    keys: tuple[str, ...]
    dtype: str
    label: str = "batch"

    def bind(self, live: Live) -> list[Change]:
        batch, dtype = live.get(self.ref), torch_dtype(self.dtype)
        steps: list[Change] = []
        for key in self.keys:
            value = batch.get(key)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
                steps.append(SetItem(batch, key, value.to(dtype), f"{self.label}[{key!r}]"))
        return steps

    def simulate(self, facts: Facts) -> Facts:
        return _batch_fixed(facts, frozenset(self.keys), self.dtype)

    def verify(self, live: Live) -> str | None:
        batch, dtype = live.get(self.ref), torch_dtype(self.dtype)
        left = [k for k in self.keys if isinstance(batch.get(k), torch.Tensor) and batch.get(k).dtype != dtype]
        return f"{', '.join(left)} still not {self.dtype}" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, key): self.dtype for key in self.keys}


@dataclass(frozen=True)
class SetNormEps(ChangeSpec):
    """Set the epsilon of normalisation modules (and of the config that names it) to ``value``, in place.

    ``modules`` are ``(submodule path, attribute)`` pairs of the model ``ref``; ``configs`` are
    ``(config ref, attribute)`` pairs. Undo restores every old value exactly.
    """

    ref: int
    modules: tuple[tuple[str, str], ...]
    value: float
    configs: tuple[tuple[int, str], ...] = ()
    label: str = "model"

    def _targets(self, live: Live) -> list[tuple[Any, str, str]]:
        model = live.get(self.ref)
        out = [(model.get_submodule(path) if path else model, attr, f"{self.label}.{path}.{attr}".replace("..", "."))
               for path, attr in self.modules]  # fmt: skip
        out += [(live.get(ref), attr, f"config.{attr}") for ref, attr in self.configs if ref in live]
        return out

    def bind(self, live: Live) -> list[Change]:
        return [SetAttr(obj, attr, self.value, label) for obj, attr, label in self._targets(live)
                if _differs(obj, attr, self.value)]  # fmt: skip

    def simulate(self, facts: Facts) -> Facts:
        paths = {p for p, _ in self.modules}
        models = []
        for m in facts.models:
            if m.inner_ref == self.ref or m.ref == self.ref:
                eps = tuple(e[:3] + (self.value,) + e[4:] if e[0] in paths else e for e in m.norm_eps)
                cfg = tuple((r, a, self.value) if (r, a) in self.configs else (r, a, v) for r, a, v in m.config_eps)
                m = dataclasses.replace(m, norm_eps=eps, config_eps=cfg)
            models.append(m)
        return dataclasses.replace(facts, models=tuple(models))

    def verify(self, live: Live) -> str | None:
        left = [label for obj, attr, label in self._targets(live) if _differs(obj, attr, self.value)]
        return f"{', '.join(left)} still differ" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, path, attr): self.value for path, attr in self.modules}


@dataclass(frozen=True)
class CropCacheLayers(ChangeSpec):
    """Crop every self-attention layer of the dynamic KV cache ``ref`` to its first ``length`` tokens, in place;
    undo puts the very tensors back.

    Each longer layer's ``keys`` / ``values`` (transformers 4.56+), or the cache's ``key_cache`` / ``value_cache``
    lists (before), are replaced by copies of their first ``length`` positions, all made before the first swap. The
    cache object stays the one the user holds. A cache with sliding-window layers (which count tokens beyond what
    they keep) is not touched.
    """

    ref: int
    length: int
    label: str = "cache"

    def bind(self, live: Live) -> list[Change]:
        from ...objects.readers.kv_cache import crop_slots

        steps: list[Change] = []
        for holder, attr, value in crop_slots(live.get(self.ref), self.length):
            step = SetAttr(holder, attr, value, "")
            step.description = f"crop {self.label}'s {attr} to {self.length} tokens"
            steps.append(step)
        return steps

    def simulate(self, facts: Facts) -> Facts:
        caches = tuple(dataclasses.replace(c, lengths=tuple(min(n, self.length) for n in c.lengths))
                       if c.ref == self.ref else c for c in facts.kv_caches)  # fmt: skip
        return dataclasses.replace(facts, kv_caches=caches)

    def verify(self, live: Live) -> str | None:
        from ...objects.readers.kv_cache import layer_lengths

        left = [n for n in layer_lengths(live.get(self.ref)) if n != self.length]
        return f"{len(left)} layers of {self.label} do not hold {self.length} tokens" if left else None


@dataclass(frozen=True)
class CastCacheTensors(ChangeSpec):
    """Cast the keys and values a KV cache ``ref`` stores to ``dtype``, in place; undo puts the old tensors back.

    Each layer's ``keys`` / ``values`` (transformers 4.56+; a ``StaticLayer``'s recorded ``dtype`` with them) or
    the cache's ``key_cache`` / ``value_cache`` lists (before) are replaced by cast copies, all allocated before
    the first swap. The cache object stays the one the user holds. A legacy cache (a plain tuple of per-layer
    ``(key, value)`` pairs) cannot take new tensors: each tensor keeps its identity and takes cast data
    (``tensor.data``), so the tuple and any cache converted from it without a copy see the cast.
    """

    ref: int
    dtype: str
    label: str = "cache"

    def bind(self, live: Live) -> list[Change]:
        from ...objects.edits.steps import ReplaceData
        from ...objects.readers.kv_cache import legacy_tensors, stored_tensors, tensor_slots

        cache, dtype = live.get(self.ref), torch_dtype(self.dtype)
        legacy = legacy_tensors(cache)
        if legacy:
            return [ReplaceData(t, cast_tensor(t.detach(), dtype), f"{self.label}: a {str(t.dtype)[6:]} tensor cast to "
                                f"{self.dtype}") for t in legacy if t.dtype != dtype]  # fmt: skip
        steps: list[Change] = []
        retyped: set[int] = set()
        for holder, attr, value in tensor_slots(cache):
            if not any(t.dtype != dtype for t in stored_tensors(value)):
                continue
            cast = [_cast_stored(t, dtype) for t in value] if type(value) is list else _cast_stored(value, dtype)
            step = SetAttr(holder, attr, cast, "")
            step.description = f"cast {self.label}'s {attr} to {self.dtype}"
            steps.append(step)
            # A StaticLayer records the dtype it allocated in; it must say the new one.
            if isinstance(raw_attr(holder, "dtype", None), torch.dtype) and id(holder) not in retyped:
                retyped.add(id(holder))
                steps.append(SetAttr(holder, "dtype", dtype, f"{self.label} layer dtype"))
        return steps

    def simulate(self, facts: Facts) -> Facts:
        caches = tuple(dataclasses.replace(c, dtypes=(self.dtype,)) if c.ref == self.ref and c.dtypes else c
                       for c in facts.kv_caches)  # fmt: skip
        return dataclasses.replace(facts, kv_caches=caches)

    def verify(self, live: Live) -> str | None:
        from ...objects.readers.kv_cache import legacy_tensors, stored_tensors, tensor_slots

        dtype, cache = torch_dtype(self.dtype), live.get(self.ref)
        held = legacy_tensors(cache) or [t for _h, _a, value in tensor_slots(cache) for t in stored_tensors(value)]
        left = sum(1 for t in held if t.dtype != dtype)
        return f"{left} tensors of {self.label} still not {self.dtype}" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, "kv-dtype"): self.dtype}


def _cast_stored(value: Any, dtype: torch.dtype) -> Any:
    """A cast copy of a stored floating tensor; anything else (None, an empty placeholder) as it is."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return cast_tensor(value, dtype)
    return value


@dataclass(frozen=True)
class ClampMaskToDtype(ChangeSpec):
    """Rebuild the additive mask ``ref`` in place with its dtype's own ``finfo.min`` where it holds ``-inf``.

    The tensor stays the object the user's name is bound to (no name is rebound: its ``.data`` is replaced); a
    fully masked row then softmaxes to a uniform, finite row, as transformers' own masks do. Undo gives it back
    its very storage.
    """

    ref: int
    label: str = "attention_mask"

    def bind(self, live: Live) -> list[Change]:
        from ...objects.edits.steps import ReplaceData

        mask = live.get(self.ref)
        if not bool(torch.isneginf(mask).any()):
            return []
        floor = torch.finfo(mask.dtype).min
        rebuilt = mask.detach().clamp(min=floor)
        return [ReplaceData(mask, rebuilt, f"{self.label}: -inf -> torch.finfo(torch.{str(mask.dtype)[6:]}).min")]

    def simulate(self, facts: Facts) -> Facts:
        masks = tuple(dataclasses.replace(m, neg_inf=0, dead_rows=0) if m.ref == self.ref else m
                      for m in facts.attention_masks)  # fmt: skip
        return dataclasses.replace(facts, attention_masks=masks)

    def verify(self, live: Live) -> str | None:
        left = int(torch.isneginf(live.get(self.ref)).sum())
        return f"{self.label} still holds {left} -inf entries" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, "mask-floor"): "finfo.min"}


@dataclass(frozen=True)
class SetConfigEntry(ChangeSpec):
    """``key = value`` in the frozen config of the diffusers model ``ref`` (its ``_internal_dict``), in place.

    diffusers' ``FrozenDict`` refuses item assignment, and ``register_to_config`` replaces it with a new one: so
    does this change (a copy of the same class with the entry set), and undo puts the very config object back.
    """

    ref: int
    key: str
    value: Any
    label: str

    def bind(self, live: Live) -> list[Change]:
        model = live.get(self.ref)
        old = raw_attr(model, "_internal_dict", None)
        if not isinstance(old, dict) or (self.key in old and dict.get(old, self.key) == self.value):
            return []
        new = type(old)({**dict(old), self.key: self.value})
        step = SetAttr(model, "_internal_dict", new, self.label)
        step.description = f"{self.label} = {self.value!r}"
        return [step]

    def simulate(self, facts: Facts) -> Facts:
        models = []
        for m in facts.models:
            if m.ref == self.ref and m.component is not None:
                flags = tuple((k, v) for k, v in m.component.flags if k != self.key) + ((self.key, self.value),)
                m = dataclasses.replace(m, component=dataclasses.replace(m.component, flags=flags))
            models.append(m)
        return dataclasses.replace(facts, models=tuple(models))

    def verify(self, live: Live) -> str | None:
        config = raw_attr(live.get(self.ref), "_internal_dict", None)
        now = dict.get(config, self.key) if isinstance(config, dict) else None
        return None if now == self.value else f"{self.label} is {now!r}"

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, "config", self.key): self.value}


@dataclass(frozen=True)
class UpcastAttention(ChangeSpec):
    """Set ``upcast_attention`` (and ``upcast_softmax``) on the diffusers ``Attention`` modules ``paths`` of the model
    ``ref``, in place: the classic processors then compute q·kᵀ and the softmax in fp32 and cast the probabilities
    back, as a UNet built from a config with ``upcast_attention=True`` (Stable Diffusion 2.x) does. The config entry
    follows (``SetConfigEntry``, beside this one in a fix). Undo restores every old value exactly."""

    ref: int
    paths: tuple[str, ...]
    label: str = "model"

    def _modules(self, live: Live) -> list[tuple[str, Any]]:
        model = live.get(self.ref)
        return [(path, model.get_submodule(path)) for path in self.paths]

    def bind(self, live: Live) -> list[Change]:
        return [SetAttr(module, attr, True, f"{self.label}.{path}.{attr}") for path, module in self._modules(live)
                for attr in ("upcast_attention", "upcast_softmax") if raw_attr(module, attr, None) is not True]  # fmt: skip

    def simulate(self, facts: Facts) -> Facts:
        models = []
        for m in facts.models:
            if m.ref == self.ref and m.component is not None:
                off = tuple(p for p in m.component.upcast_off if p not in self.paths)
                m = dataclasses.replace(m, component=dataclasses.replace(m.component, upcast_off=off))
            models.append(m)
        return dataclasses.replace(facts, models=tuple(models))

    def verify(self, live: Live) -> str | None:
        left = [path for path, module in self._modules(live) if raw_attr(module, "upcast_attention", None) is not True]
        return f"{len(left)} attention modules of {self.label} still not upcast" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, path, "upcast_attention"): True for path in self.paths}


#: Marker of the wrapper that computes a layer's forward with its float8-stored weights upcast (one per module).
def integer_masks_to_bool(signature: inspect.Signature | None) -> Any:
    """``(args, kwargs) -> (args, kwargs)`` with every integer tensor passed as an argument whose name holds
    ``mask`` made bool (a tokenizer's 1 = attend is attention's True = attend); other arguments untouched."""

    def cast(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        names = list(signature.parameters) if signature is not None else []
        args = tuple(_as_bool_mask(a) if i < len(names) and "mask" in names[i] else a for i, a in enumerate(args))
        kwargs = {k: _as_bool_mask(v) if "mask" in k else v for k, v in kwargs.items()}
        return args, kwargs

    return cast


def _as_bool_mask(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dtype != torch.bool:
        return value.bool()
    return value


#: Marker of the integer-mask-to-bool wrapper (one per module method).
BOOL_MASK_MARKER = "mpdoctor-bool-mask"


@dataclass(frozen=True)
class BoolMaskInputs(ChangeSpec):
    """Integer attention masks given to the module ``ref``'s ``method`` arrive as bool, at every call; undo removes
    the wrapper. Where the failure is: the module that receives the mask, so it holds for every batch."""

    ref: int
    method: str = "forward"
    label: str = "module"

    def bind(self, live: Live) -> list[Change]:
        from ...objects.edits.steps import MethodInputCast

        module = live.get(self.ref)
        if MethodInputCast.registered(module, self.method, BOOL_MASK_MARKER):
            return []
        try:
            signature = inspect.signature(getattr(module, self.method))
        except (TypeError, ValueError):
            signature = None
        return [MethodInputCast(module, self.method, integer_masks_to_bool(signature), BOOL_MASK_MARKER,
                                f"{self.label}.{self.method}: integer masks arrive as bool")]  # fmt: skip

    def verify(self, live: Live) -> str | None:
        from ...objects.edits.steps import MethodInputCast

        ok = MethodInputCast.registered(live.get(self.ref), self.method, BOOL_MASK_MARKER)
        return None if ok else f"{self.label}.{self.method} does not make integer masks bool"

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, f"{self.method}:masks"): "bool"}


@dataclass(frozen=True)
class SetLightningPrecision(ChangeSpec):
    """A built Lightning Trainer made to run as ``Trainer(precision=precision)`` would, before (or between) fits.

    Resolved by the lightning integration at apply time (:func:`~mpdoctor.libraries.lightning.integration.mixed_plugin_changes`):
    its ``HalfPrecision`` plugin replaced by the ``MixedPrecision`` its connector builds for ``precision``, where
    the Trainer keeps it, and a LightningModule a ``fit`` converted to ``half`` brought back to fp32 (``params``:
    the ids of those parameters, for the simulation). Undo puts the very plugin, tensors and flags back.
    """

    ref: int
    name: str
    precision: str
    half: str
    params: frozenset[int] = frozenset()

    def bind(self, live: Live) -> list[Change]:
        from ...libraries.lightning.integration import mixed_plugin_changes

        return mixed_plugin_changes(live.get(self.ref), self.name, self.precision, torch_dtype(self.half))

    def simulate(self, facts: Facts) -> Facts:
        setups = tuple(
            dataclasses.replace(p, requested=self.precision, effective=self.precision, plugin="MixedPrecision", input_dtype=None)
            if p.ref == self.ref else p
            for p in facts.lightning
        )  # fmt: skip
        facts = dataclasses.replace(facts, lightning=setups)
        return _replace_params(facts, self.params, "float32", "float32", False) if self.params else facts

    def verify(self, live: Live) -> str | None:
        from ...libraries.lightning.integration import mixed_plugin_problem

        return mixed_plugin_problem(live.get(self.ref), self.precision, torch_dtype(self.half))

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, "precision_plugin"): self.precision}

    def backup_bytes(self, facts: Facts) -> int:
        return _param_bytes(facts, self.params, "float32")
