"""Read-only snapshots of everything checks look at.

:func:`gather` turns subjects into a :class:`Facts` bundle. Gathering never
mutates, never copies a tensor, never moves one across devices and never reads
``meta`` data. A subject whose facts cannot be read is recorded in
``Facts.errors`` and becomes an ``internal-error`` finding; the rest is still
gathered.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any

from .. import integrations
from ..discover import Subject
from ..introspect import class_path, raw_attr, shared_module_walks, type_name
from ..live import Live
from .configs import ConfigFacts
from .hardware import DeviceProfile, live_profile, profile_for
from .optimizer import OptimizerFacts, gather_optimizer
from .precision import PrecisionFacts, RuntimeFacts, gather_precision, gather_runtime
from .scaler import ScalerFacts, gather_scaler
from .tensors import ModuleTensors, TensorTally, gather_module_tensors

__all__ = [
    "ConfigFacts",
    "DeviceProfile",
    "Facts",
    "ModelFacts",
    "OptimizerFacts",
    "PrecisionFacts",
    "RuntimeFacts",
    "ScalerFacts",
    "SubjectFacts",
    "gather",
]



@dataclass(frozen=True)
class SubjectFacts:
    """An inspected object as plain data: its kind, the name the user knows it by, its ref in the live table.

    ``inner_ref`` / ``inner_path`` point at the object inside wrappers (the
    network inside DDP / ``torch.compile`` / PEFT, the optimizer inside
    accelerate's wrapper); ``aliases`` are other names the user holds it, or
    a part of it, by.
    """

    kind: str
    name: str
    ref: int
    inner_ref: int
    inner_path: str
    owner: str | None
    class_name: str
    class_path: str
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelFacts:
    """Everything about one model.

    ``forward_wrapped`` is True when accelerate replaced ``forward`` with its
    autocast + fp32-output-conversion wrapper (``_original_forward`` is set).
    """

    name: str
    config_path: str
    class_name: str
    class_path: str
    inner_class: str
    training: bool
    tensors: ModuleTensors
    configs: tuple[ConfigFacts, ...]
    forward_wrapped: bool
    is_peft: bool
    is_pretrained: bool
    #: Refs of the model (as the user holds it) and of the network inside its wrappers.
    ref: int = 0
    inner_ref: int = 0
    #: accelerate's ``prepare()`` has seen this model (it will not wrap ``forward`` again).
    accelerate_prepared: bool = False
    #: transformers' ``_supports_sdpa`` of the network (None when not a transformers model).
    supports_sdpa: bool | None = None
    #: transformers' ``_keep_in_fp32_modules`` (and ``_strict``): module names its modeling code keeps
    #: in fp32 and casts around on purpose.
    keep_in_fp32: tuple[str, ...] = ()
    #: The subject this model was reached through (``pipe`` for ``pipe.vae``), None for a top-level model.
    owner: str | None = None
    #: bitsandbytes quantized layers (:class:`~mpdoctor.facts.lowbit.LowBitLayer`), from the bitsandbytes integration.
    low_bit_layers: tuple = ()
    #: torchao float8 training layers (:class:`~mpdoctor.facts.lowbit.Float8Layer`), from the torchao integration.
    float8_layers: tuple = ()
    #: A diffusers component's class and precision flags (:class:`~mpdoctor.facts.lowbit.ComponentFacts`), or None.
    component: object = None
    #: Rotary-embedding frequency buffers held in half precision, as ``(module path, class name, dtype,
    #: phase error in radians at the last position, positions)``; read by the transformers integration.
    rope_buffers: tuple[tuple[str, str, str, float, int], ...] = ()
    #: ``config._name_or_path`` of a transformers model: the checkpoint it was loaded from, empty for a model
    #: built from a config (advice says ``from_pretrained`` only when there is something to load).
    loaded_from: str = ""

    @property
    def model_type(self) -> str | None:
        """``config.model_type`` of the root config, if any."""
        return self.configs[0].model_type if self.configs and not self.configs[0].is_generation_config else None

    @property
    def config_dtype(self) -> str | None:
        """The dtype the checkpoint was saved in (``config.dtype`` / ``torch_dtype``)."""
        for cfg in self.configs:
            if cfg.dtype and not cfg.is_generation_config:
                return cfg.dtype
        return None


@dataclass(frozen=True)
class Facts:
    """The bundle checks read: one tuple per kind of fact, plus the device and runtime."""

    subjects: tuple[SubjectFacts, ...]
    models: tuple[ModelFacts, ...]
    optimizers: tuple[OptimizerFacts, ...]
    scalers: tuple[ScalerFacts, ...]
    precisions: tuple[PrecisionFacts, ...]
    runtime: RuntimeFacts
    hardware: DeviceProfile
    scans: tuple = ()
    errors: tuple[tuple[str, str], ...] = ()
    probes: tuple = ()  # mpdoctor.numerics.probe.ProbeFacts, from a one-batch probe
    #: mpdoctor.facts.lightning.LightningPrecisionFacts, one per Lightning Trainer / Fabric
    lightning: tuple = ()
    #: mpdoctor.facts.distributed.DistributedFacts: process group, FSDP units, launcher state, other ranks.
    distributed: Any = None
    #: mpdoctor.facts.trl.TrlFacts, one per TRL trainer (SFT, DPO, GRPO ...): its config and reference model.
    trl: tuple = ()
    #: mpdoctor.facts.deepspeed.DeepSpeedFacts: DeepSpeed engines and configs (integrations' ``facts``)
    deepspeed: tuple = ()

    @property
    def tallies(self) -> tuple[TensorTally, ...]:
        """All histogram rows: models, then optimizer state."""
        rows: list[TensorTally] = []
        for m in self.models:
            rows.extend(m.tensors.tallies)
        for o in self.optimizers:
            rows.extend(o.tallies)
        return tuple(rows)

    def subject(self, name: str) -> SubjectFacts | None:
        """The subject called ``name``."""
        return next((s for s in self.subjects if s.name == name), None)

    def optimizers_of(self, model: ModelFacts) -> tuple[OptimizerFacts, ...]:
        """Optimizers holding at least one of ``model``'s parameters."""
        ids = model.tensors.param_ids
        return tuple(o for o in self.optimizers if o.param_ids & ids)

    def models_of(self, optimizer: OptimizerFacts) -> tuple[ModelFacts, ...]:
        """Models owning at least one of ``optimizer``'s parameters."""
        return tuple(m for m in self.models if m.tensors.param_ids & optimizer.param_ids)


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
    return ModelFacts(
        name=subject.name,
        config_path=subject.inner_path,
        class_name=cls.__name__,
        class_path=f"{cls.__module__}.{cls.__qualname__}",
        inner_class=icls.__name__,
        training=bool(raw_attr(obj, "training", False)),
        tensors=gather_module_tensors(
            subject.name, obj, integrations.casting_layers(), integrations.weight_storage_readers()
        ),
        ref=id(obj),
        inner_ref=id(inner),
        owner=subject.owner,
        **fields,
    )


def _precision_setups(subjects: tuple[Subject, ...], hw: DeviceProfile) -> list[PrecisionFacts]:
    """One setup per trainer (its arguments, accelerator and model), then lone arguments and accelerators."""
    out: list[PrecisionFacts] = []
    used: set[str] = set()
    for s in subjects:
        if s.kind != "trainer":
            continue
        args = next((c for c in subjects if c.owner == s.name and c.kind == "training_args"), None)
        acc = next((c for c in subjects if c.owner == s.name and c.kind == "accelerator"), None)
        # A Trainer's parts may be known by their own variable names (args = TrainingArguments(...)).
        if args is None:
            args = _find_by_identity(subjects, raw_attr(s.obj, "args", None))
        if acc is None:
            acc = _find_by_identity(subjects, raw_attr(s.obj, "accelerator", None))
        model = raw_attr(s.obj, "model", None)
        models = tuple(c for c in subjects if c.kind == "model" and c.obj is model)
        out.append(gather_precision(s.name, args, acc, hw, tuple(m.name for m in models), tuple(id(m.obj) for m in models)))
        used.update(x.name for x in (args, acc) if x is not None)
    for s in subjects:
        if s.name in used or s.kind not in ("training_args", "accelerator"):
            continue
        if s.kind == "training_args":
            out.append(gather_precision(s.name, s, None, hw))
        else:
            out.append(gather_precision(s.name, None, s, hw))
    return out


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
    subjects: list[Subject] | tuple[Subject, ...], target: str | None = None, live: Live | None = None
) -> Facts:
    """Gather the facts of ``subjects``, on the live device or the ``target`` profile.

    ``live`` (a :class:`~mpdoctor.live.Live`) receives every object a fact refers to by ref.
    """
    subjects = tuple(subjects)
    live = Live() if live is None else live
    with shared_module_walks():
        return _gather(subjects, target, live)


def _gather(subjects: tuple[Subject, ...], target: str | None, live: Live) -> Facts:
    errors: list[tuple[str, str]] = []
    models: list[ModelFacts] = []
    optimizers: list[OptimizerFacts] = []
    scalers: list[ScalerFacts] = []
    plain: list[SubjectFacts] = []
    hardware = profile_for(target) if target is not None else live_profile()
    for s in subjects:
        try:
            plain.append(_subject_facts(s, live))
            if s.kind == "model":
                models.append(_model_facts(s, live))
            elif s.kind == "optimizer":
                optimizers.append(gather_optimizer(s.name, s.obj, s.inner))
            elif s.kind == "scaler":
                scalers.append(gather_scaler(s.name, s.obj, _scaler_owners(s, subjects)))
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
        from .distributed import gather_distributed

        distributed = gather_distributed(subjects, models)
    except Exception as exc:
        distributed = None
        errors.append(("distributed", _summarise(exc)))
    return Facts(
        distributed=distributed,
        subjects=tuple(plain),
        models=tuple(models),
        optimizers=tuple(optimizers),
        scalers=tuple(scalers),
        precisions=precisions,
        runtime=gather_runtime(),
        hardware=hardware,
        errors=tuple(errors),
        **extras,
    )
