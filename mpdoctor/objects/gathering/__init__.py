"""Gathering: walk the subjects, ask each integration, and fill the plain :class:`~mpdoctor.facts.Facts`.

:func:`gather` turns subjects into a :class:`Facts` bundle. Gathering never mutates, never copies a tensor,
never moves one across devices and never reads ``meta`` data. A subject whose facts cannot be read is
recorded in ``Facts.errors`` and becomes an ``internal-error`` finding; the rest is still gathered. The
device profile is resolved once, at the entrance (``diagnose``, the magic, the probe), and handed in.
"""

from __future__ import annotations

import traceback
from typing import Any

from ...facts import Facts, ModelFacts, SubjectFacts
from ...facts.hardware import DeviceProfile
from ...facts.optimizer import OptimizerFacts
from ...facts.precision import PrecisionFacts
from ...facts.quantized import STORAGE_DTYPES
from ...facts.scaler import ScalerFacts, ScalerStateFacts
from ...libraries.distributed.gathering import gather_distributed
from .. import integrations
from ..discovery.subjects import Subject
from ..live import Live
from ..live.introspect import class_path, raw_attr, shared_module_walks, type_name
from ..readers.between import read_between
from ..readers.hardware import live_profile
from ..readers.loop_accumulation import with_loop_accumulations
from ..readers.norms import norm_epsilons
from ..readers.optimizer import read_optimizer
from ..readers.scaler import read_scaler, read_scaler_state
from ..readers.tensors import read_module_tensors
from .precision import gather_precision, gather_torch_state

__all__ = ["gather"]


def _summarise(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"[:500]


def _subject_facts(s: Subject, live: Live) -> SubjectFacts:
    live.add(s.obj)
    live.add(s.inner)
    return SubjectFacts(
        kind=s.kind,
        name=s.name,
        ref=id(s.obj),
        inner_ref=id(s.inner),
        inner_path=s.inner_path,
        owner=s.owner,
        class_name=type_name(s.obj),
        class_path=class_path(type(s.obj)),
        aliases=tuple(s.aliases),
    )


def _model_facts(subject: Subject, live: Live) -> ModelFacts:
    obj, inner = subject.obj, subject.inner
    cls, icls = type(obj), type(inner)
    fields = {"configs": (), "forward_wrapped": False, "is_peft": False, "is_pretrained": False, "keep_in_fp32": ()}
    fields.update(integrations.model_extras(obj, inner, subject.inner_path, live))
    tensors = read_module_tensors(subject.name, obj, integrations.casting_layers(), integrations.weight_storage_readers())
    if tensors.param_dtypes & STORAGE_DTYPES:  # float8 storage: what upcasts it (read for these models only)
        from ...libraries.torch.float8_storage import model_facts as stored_facts

        fields.update(stored_facts(obj, tensors))
    return ModelFacts(
        name=subject.name,
        config_path=subject.inner_path,
        class_name=cls.__name__,
        class_path=f"{cls.__module__}.{cls.__qualname__}",
        inner_class=icls.__name__,
        training=bool(raw_attr(obj, "training", False)),
        tensors=tensors,
        ref=id(obj),
        inner_ref=id(inner),
        owner=subject.owner,
        **fields,
        **norm_epsilons(inner, live),
    )


def _precision_setups(subjects: tuple[Subject, ...], hw: DeviceProfile) -> list[PrecisionFacts]:
    """One setup per trainer (its arguments, accelerator and model), then lone arguments and accelerators."""
    out: list[PrecisionFacts] = []
    used: set[str] = set()
    for s in subjects:
        if s.kind != "trainer":
            continue
        args, acc = _trainer_parts(subjects, s)
        model = raw_attr(s.obj, "model", None)
        models = tuple(c for c in subjects if c.kind == "model" and c.obj is model)
        out.append(gather_precision(s.name, args, acc, hw, tuple(m.name for m in models), tuple(id(m.obj) for m in models)))
        used.update(x.name for x in (args, acc) if x is not None)
    for s in subjects:
        if s.name not in used and s.kind in ("training_args", "accelerator"):
            alone = s.kind == "training_args"
            out.append(gather_precision(s.name, s if alone else None, None if alone else s, hw))
    return out


def _trainer_parts(subjects: tuple[Subject, ...], trainer: Subject) -> tuple[Subject | None, Subject | None]:
    """The trainer's arguments and accelerator subjects: those it brought, else the same objects under the
    user's own names (``args = TrainingArguments(...)``)."""
    args = next((c for c in subjects if c.owner == trainer.name and c.kind == "training_args"), None)
    acc = next((c for c in subjects if c.owner == trainer.name and c.kind == "accelerator"), None)
    if args is None:
        args = _find_by_identity(subjects, raw_attr(trainer.obj, "args", None))
    if acc is None:
        acc = _find_by_identity(subjects, raw_attr(trainer.obj, "accelerator", None))
    return args, acc


def _find_by_identity(subjects: tuple[Subject, ...], obj: Any) -> Subject | None:
    if obj is None:
        return None
    return next((s for s in subjects if s.obj is obj), None)


def _scaler_owners(subject: Subject, subjects: tuple[Subject, ...]) -> tuple[str, ...]:
    owners = []
    for s in subjects:
        if s is subject:
            continue
        if s.kind in ("accelerator", "trainer", "optimizer") and raw_attr(s.obj, "scaler", None) is subject.obj:
            owners.append(s.name)
    return tuple(owners)


def gather(
    subjects: list[Subject] | tuple[Subject, ...], profile: DeviceProfile | None = None, live: Live | None = None
) -> Facts:
    """Gather the facts of ``subjects``, on the live device or on ``profile`` (a ``target=`` resolved once
    by the entrance with :func:`mpdoctor.facts.hardware.profile_for`).

    ``live`` (a :class:`~mpdoctor.objects.live.Live`) receives every object a fact refers to by ref.
    """
    subjects = tuple(subjects)
    live = Live() if live is None else live
    with shared_module_walks():
        return _gather(subjects, profile, live)


def _gather(subjects: tuple[Subject, ...], profile: DeviceProfile | None, live: Live) -> Facts:
    errors: list[tuple[str, str]] = []
    models: list[ModelFacts] = []
    optimizers: list[OptimizerFacts] = []
    scalers: list[ScalerFacts] = []
    states: list[ScalerStateFacts] = []
    plain: list[SubjectFacts] = []
    hardware = profile if profile is not None else live_profile()
    for s in subjects:
        try:
            plain.append(_subject_facts(s, live))
            if s.kind == "model":
                models.append(_model_facts(s, live))
            elif s.kind == "optimizer":
                optimizers.append(read_optimizer(s.name, s.obj, s.inner))
            elif s.kind == "scaler":
                scalers.append(read_scaler(s.name, s.obj, _scaler_owners(s, subjects)))
            elif s.kind == "scaler_state":
                states.append(read_scaler_state(s.name, s.obj))
        except Exception as exc:  # a hostile or half-built object must not stop the report
            errors.append((s.name, _summarise(exc)))
    try:
        precisions = tuple(_precision_setups(subjects, hardware))
        for s in subjects:
            if s.kind in ("training_args", "accelerator", "trainer"):
                live.add(s.obj)
    except Exception as exc:
        precisions = ()
        errors.append(("precision", _summarise(exc)))
    extras: dict = {}
    try:
        extras = integrations.extra_facts(subjects, live, hardware)
    except Exception as exc:  # a library's own facts must not stop the report
        errors.append(("integrations", _summarise(exc)))
    try:
        distributed = gather_distributed(subjects, models)
    except Exception as exc:
        distributed = None
        errors.append(("distributed", _summarise(exc)))
    failed = {name for name, _ in errors}  # a subject that could not be read is reported once, not again here
    between = read_between(((s.name, s.kind, s.obj) for s in subjects if s.name not in failed), live, errors)
    try:  # the accumulation of the user's own loop, read from its cells or counted under watch()
        between = with_loop_accumulations(between, (s for s in subjects if s.name not in failed))
    except Exception as exc:
        errors.append(("accumulation", _summarise(exc)))
    return Facts(
        between=between,
        distributed=distributed,
        subjects=tuple(plain),
        models=tuple(models),
        optimizers=tuple(optimizers),
        scalers=tuple(scalers),
        scaler_states=tuple(states),
        precisions=precisions,
        runtime=gather_torch_state(),
        hardware=hardware,
        errors=tuple(errors),
        **extras,
    )
