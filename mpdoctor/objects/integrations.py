"""The integrations registry: what mpdoctor knows about each library, read from ``libraries/<name>/integration.py``.

An :class:`Integration` says which classes of its library mpdoctor recognises
(and as which kind of subject), how its wrappers unwrap, which child subjects
an object brings along (a Trainer brings its model, optimizer, arguments,
accelerator and scaler), which facts it adds to a model, and how it states
precision (what the arguments request, what the accelerator will run).

:mod:`mpdoctor.objects.discovery` and :mod:`mpdoctor.objects.gathering` iterate the registry and
hold no library-specific branches. An integration is active only when its
library is already imported by the user (``name in sys.modules``), or, for its
facts, when an inspected object holds something of its kind before the library
is imported (``Integration.wakes_on``: ``TrainingArguments(deepspeed=cfg)``):
a missing or unused library costs nothing, and mpdoctor never imports one first.

Adding a library is one new package ``mpdoctor/libraries/<name>/`` plus its tests: its ``integration.py``
declares an ``INTEGRATION``; list the library in :data:`MODULES`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

#: Subject kinds, in the order a report lists them.
KINDS = ("trainer", "training_args", "accelerator", "model", "optimizer", "scaler", "pipeline", "averaging", "kv_cache",
         "attention_mask", "adapter_config", "scaler_state")

#: The integration modules, in registry order (torch first: its kinds are the base of all others).
MODULES = (
    "torch", "transformers", "accelerate", "peft", "lightning", "diffusers", "bitsandbytes", "torchao", "trl",
    "deepspeed",
)


@dataclass(frozen=True)
class Unwrap:
    """A wrapper class whose attribute holds the wrapped object.

    ``suffix`` is what the user types to reach the inner object's config
    (``.module`` for DDP; empty where the wrapper forwards attribute access).
    """

    class_path: str
    attr: str
    suffix: str = ""


@dataclass(frozen=True)
class Integration:
    """What mpdoctor knows about one library.

    Attributes
    ----------
    name : str
        The library (``"transformers"``).
    modules : tuple of str
        Top-level modules that must already be in ``sys.modules`` for the integration to be active.
    kinds : tuple of (str, str)
        ``(class path, kind)``: instances of a class with that path in their MRO are subjects of that kind.
    model_unwraps, optimizer_unwraps : tuple of Unwrap
        Wrappers to look through to the network (DDP, ``torch.compile``, PEFT) or the optimizer
        (accelerate's ``AcceleratedOptimizer``); the wrapper stays the subject, under the user's name.
    brings : tuple of (str, tuple of str)
        ``(class path, attributes)``: an instance brings the recognised objects in these attributes
        along as child subjects.
    casting_layers : tuple of str
        Module classes that cast their input to their own weights' dtype (PEFT tuner layers).
    model_facts : callable, optional
        ``(outer, inner, inner_path, live) -> dict`` of extra :class:`~mpdoctor.facts.ModelFacts` fields.
    requested : callable, optional
        ``obj -> dict`` of the precision-related fields of an arguments object of this library.
    effective : callable, optional
        ``obj -> AcceleratorView`` of what an accelerator object of this library will run.
    facts : callable, optional
        ``(subjects, live, hardware) -> dict`` of extra :class:`~mpdoctor.facts.Facts` fields (a tuple
        of the library's own plain facts, such as ``{"deepspeed": (DeepSpeedFacts, ...)}``).
    weight_storage : callable, optional
        ``tensor -> (class path, storage dtype, storage bytes) or None`` for a parameter whose type is a
        tensor subclass of this library that stores its data in another format than its ``dtype``
        says (torchao's quantized weights dequantize to ``dtype`` but hold int8 / float8 data).
        Called only for parameters that are not plain ``nn.Parameter`` objects.
    """

    name: str
    modules: tuple[str, ...]
    kinds: tuple[tuple[str, str], ...] = ()
    model_unwraps: tuple[Unwrap, ...] = ()
    optimizer_unwraps: tuple[Unwrap, ...] = ()
    brings: tuple[tuple[str, tuple[str, ...]], ...] = ()
    casting_layers: tuple[str, ...] = ()
    model_facts: Callable[..., dict] | None = None
    requested: Callable[[Any], dict] | None = None
    effective: Callable[[Any], Any] | None = None
    #: Active when any of these is imported too (a library published under several names: Lightning).
    any_modules: tuple[str, ...] = ()
    #: ``(subjects, live, device profile) -> dict`` of extra :class:`~mpdoctor.facts.Facts` fields, for a
    #: library with facts of its own (Lightning's precision plugins, DeepSpeed's engines and configs).
    facts: Callable[..., dict] | None = None
    weight_storage: Callable[[Any], tuple[str, str, int] | None] | None = None
    #: ``subjects -> bool``: True when an object of this library's kind is among the subjects although
    #: the library is not imported yet (``TrainingArguments(deepspeed=cfg)`` holds a DeepSpeed config before
    #: anything imports deepspeed). Reads the subjects' own fields; never imports the library.
    wakes_on: Callable[[tuple], bool] | None = None
    #: ``(exact class path, predicate, kind)``: an instance of exactly that class (no subclass) is a subject of
    #: that kind when ``predicate(obj)`` holds, read from its values: a 4D floating ``torch.Tensor`` holding an
    #: additive attention mask is kind ``attention_mask``, any other tensor none.
    value_kinds: tuple[tuple[str, Callable[[Any], bool], str], ...] = ()

    @property
    def active(self) -> bool:
        """True when the user's process has imported the library."""
        if self.any_modules and not any(m in sys.modules for m in self.any_modules):
            return False
        return all(m in sys.modules for m in self.modules)

    def active_for(self, subjects: tuple) -> bool:
        """True when the library is imported, or an object of its kind is among ``subjects``."""
        if self.active:
            return True
        if self.wakes_on is None:
            return False
        try:
            return bool(self.wakes_on(subjects))
        except Exception:  # a subject that cannot be read wakes nothing
            return False


_REGISTRY: list[Integration] = []


def registry() -> tuple[Integration, ...]:
    """Every known integration (imported on first use; importing one never imports its library)."""
    if not _REGISTRY:
        for name in MODULES:
            _REGISTRY.append(importlib.import_module(f"mpdoctor.libraries.{name}.integration").INTEGRATION)
    return tuple(_REGISTRY)


def active() -> tuple[Integration, ...]:
    """The integrations whose library is imported now."""
    return tuple(i for i in registry() if i.active)


def active_key() -> tuple[str, ...]:
    """Names of the active integrations: classification caches are valid for one key."""
    return tuple(i.name for i in registry() if i.active)


def kind_from_paths(paths: tuple[str, ...]) -> str | None:
    """The subject kind of a class whose MRO has ``paths``, or None.

    The first kind in :data:`KINDS` order wins: a class that is both a Module and
    something else (never seen, but possible) is a model.
    """
    pathset = set(paths)
    found = {kind for integ in active() for path, kind in integ.kinds if path in pathset}
    for kind in ("model", "optimizer", "scaler", "trainer", "training_args", "accelerator", "pipeline", "averaging",
                 "kv_cache", "adapter_config"):
        if kind in found:
            return kind
    return None


def value_kind_rules(path: str) -> tuple[tuple[Callable[[Any], bool], str], ...]:
    """``(predicate, kind)`` of the active integrations for instances of exactly the class ``path``."""
    return tuple((pred, kind) for integ in active() for cls, pred, kind in integ.value_kinds if cls == path)


def model_unwraps() -> Iterator[Unwrap]:
    """Model wrapper rules of the active integrations."""
    for integ in active():
        yield from integ.model_unwraps


def optimizer_unwraps() -> Iterator[Unwrap]:
    """Optimizer wrapper rules of the active integrations."""
    for integ in active():
        yield from integ.optimizer_unwraps


def brought_attrs(paths: tuple[str, ...]) -> tuple[str, ...]:
    """Attributes whose objects a subject with these class paths brings along."""
    pathset = set(paths)
    out: list[str] = []
    for integ in active():
        for path, attrs in integ.brings:
            if path in pathset:
                out.extend(a for a in attrs if a not in out)
    return tuple(out)


def weight_storage_readers() -> tuple[Callable[[Any], tuple[str, str, int] | None], ...]:
    """The ``weight_storage`` readers of the active integrations."""
    return tuple(integ.weight_storage for integ in active() if integ.weight_storage is not None)


def casting_layers() -> frozenset[str]:
    """Module classes that cast their inputs to their own dtype."""
    return frozenset(c for integ in active() for c in integ.casting_layers)


def _declaring(obj_paths: tuple[str, ...], attr: str) -> Callable | None:
    pathset = set(obj_paths)
    for integ in active():
        fn = getattr(integ, attr)
        if fn is not None and any(path in pathset for path, _kind in integ.kinds):
            return fn
    return None


def requested_of(obj: Any, paths: tuple[str, ...]) -> dict:
    """The precision an arguments object requests, read by the integration that recognises it."""
    fn = _declaring(paths, "requested")
    return fn(obj) if fn is not None else {}


def effective_of(obj: Any, paths: tuple[str, ...]) -> Any:
    """What an accelerator object will run, read by the integration that recognises it; None if none does."""
    fn = _declaring(paths, "effective")
    return fn(obj) if fn is not None else None


def model_extras(outer: Any, inner: Any, inner_path: str, live: Any) -> dict:
    """Extra ModelFacts fields contributed by every active integration."""
    out: dict = {}
    for integ in active():
        if integ.model_facts is not None:
            out.update(integ.model_facts(outer, inner, inner_path, live))
    return out


def extra_facts(subjects: tuple, live: Any, hardware: Any) -> dict:
    """Extra Facts fields contributed by every integration active for ``subjects`` (``Integration.facts``):
    its library is imported, or one of the subjects holds an object of its kind (``Integration.wakes_on``)."""
    out: dict = {}
    for integ in registry():
        if integ.facts is not None and integ.active_for(subjects):
            out.update(integ.facts(subjects, live, hardware))
    return out
