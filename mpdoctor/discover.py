"""Turn a namespace or a list of objects into typed subjects.

Discovery is the only place that touches arbitrary user objects, so it is
defensive: it classifies values by ``type(value).__mro__`` read through
``type``'s own descriptors (never ``value.__class__`` or ``isinstance``, which
an object may fake, never a metaclass's ``__eq__`` / ``__hash__`` /
``__getattribute__``, never a user ``__getattr__``), descends only into exact
``list`` / ``tuple`` / ``dict`` containers (never subclasses, whose methods
are user code) to a small depth and width, and reads attributes only from
objects whose class it has already recognised as a torch / transformers /
accelerate / peft class. Classification is cached per class, so a namespace
of 100,000 plain objects costs about one dict lookup each.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .redact import redact

#: Kinds of subject, in the order a report lists them.
KINDS = ("trainer", "training_args", "accelerator", "model", "optimizer", "scaler")

#: How deep and how wide discovery looks into plain containers of a namespace.
CONTAINER_DEPTH = 2
CONTAINER_WIDTH = 32

# Fully qualified class names (module.qualname) that mark a kind; matched against the MRO.
_TRAINER = ("transformers.trainer.Trainer",)
_TRAINING_ARGS = ("transformers.training_args.TrainingArguments",)
_ACCELERATOR = ("accelerate.accelerator.Accelerator",)
_ACCELERATED_OPTIMIZER = ("accelerate.optimizer.AcceleratedOptimizer",)
_SCALER = ("torch.amp.grad_scaler.GradScaler", "torch.cuda.amp.grad_scaler.GradScaler")
_OPTIMIZER = ("torch.optim.optimizer.Optimizer",)
_MODULE = ("torch.nn.modules.module.Module",)
_DDP = (
    "torch.nn.parallel.distributed.DistributedDataParallel",
    "torch.nn.parallel.data_parallel.DataParallel",
)
_COMPILED = ("torch._dynamo.eval_frame.OptimizedModule",)
_PEFT_MODEL = ("peft.peft_model.PeftModel", "peft.mixed_model.PeftMixedModel")
_PEFT_TUNER = ("peft.tuners.tuners_utils.BaseTuner",)
_PRETRAINED = ("transformers.modeling_utils.PreTrainedModel",)


# ``type``'s own descriptors: calling them never runs a metaclass's attribute hooks.
_TYPE_MRO = type.__dict__["__mro__"].__get__
_TYPE_MODULE = type.__dict__["__module__"].__get__
_TYPE_QUALNAME = type.__dict__["__qualname__"].__get__
_TYPE_NAME = type.__dict__["__name__"].__get__


def type_name(obj: Any) -> str:
    """``type(obj).__name__``, read without running user code."""
    try:
        return _TYPE_NAME(type(obj))
    except Exception:
        return "?"


def class_path(cls: type) -> str:
    """Return ``module.qualname`` of a class, read without running user code."""
    try:
        module, qualname = _TYPE_MODULE(cls), _TYPE_QUALNAME(cls)
    except Exception:
        return "?"
    if type(qualname) is not str:
        qualname = "?"
    return f"{module}.{qualname}" if type(module) is str and module else qualname


#: ``id(cls) -> (cls.__mro__, class paths, kind)``. The cached MRO tuple starts with the class
#: itself, so the class stays alive and its id cannot be reused while the entry exists; a
#: class whose ``__bases__`` were reassigned has a new MRO tuple and is classified again.
_CLASS_CACHE: dict[int, tuple[tuple, tuple[str, ...], str | None]] = {}
_CLASS_CACHE_SIZE = 4096


def _classify(cls: type) -> tuple[tuple[str, ...], str | None]:
    try:
        mro = _TYPE_MRO(cls)
    except Exception:
        return (), None
    entry = _CLASS_CACHE.get(id(cls))
    if entry is not None and entry[0] is mro:
        return entry[1], entry[2]
    paths = tuple(class_path(c) for c in mro)
    kind = _kind_from_paths(paths)
    if len(_CLASS_CACHE) >= _CLASS_CACHE_SIZE:
        _CLASS_CACHE.clear()
    _CLASS_CACHE[id(cls)] = (mro, paths, kind)
    return paths, kind


def _kind_from_paths(paths: tuple[str, ...]) -> str | None:
    if _MODULE[0] in paths:
        return "model"
    if _OPTIMIZER[0] in paths:
        return "optimizer"
    if any(p in paths for p in _SCALER):
        return "scaler"
    if _TRAINER[0] in paths:
        return "trainer"
    if _TRAINING_ARGS[0] in paths:
        return "training_args"
    if _ACCELERATOR[0] in paths:
        return "accelerator"
    return None


def mro_paths(obj: Any) -> tuple[str, ...]:
    """Class paths of ``type(obj)`` and its bases; empty when the MRO cannot be read."""
    return _classify(type(obj))[0]


def is_a(obj: Any, names: Iterable[str]) -> bool:
    """True when one of ``names`` is a class path in ``type(obj)``'s MRO."""
    paths = mro_paths(obj)
    return any(n in paths for n in names)


def kind_of(obj: Any) -> str | None:
    """Return the subject kind of ``obj`` or None when mpdoctor has nothing to say about it."""
    return _classify(type(obj))[1]


@dataclass(eq=False)
class Subject:
    """An object mpdoctor inspects, with the name the user knows it by.

    Attributes
    ----------
    kind : str
        One of :data:`KINDS`.
    name : str
        The dotted path the user would type (``trainer.model``).
    obj : object
        The live object (held strongly so that fixes and ``refresh()`` can reach it).
    inner : object
        For models: the module inside DDP / ``torch.compile`` / PEFT wrappers,
        whose ``config`` describes the network; for optimizers: the optimizer
        inside accelerate's wrapper. Equal to ``obj`` when nothing wraps it.
    inner_path : str
        The attribute path from ``name`` to the object that owns ``config``
        (``model.module`` for DDP, ``model`` otherwise: PEFT and compiled
        modules forward ``config``).
    owner : str or None
        Name of the subject this one was reached through (``trainer``).
    """

    kind: str
    name: str
    obj: Any = field(repr=False)
    inner: Any = field(default=None, repr=False)
    inner_path: str = ""
    owner: str | None = None

    def __post_init__(self) -> None:
        if self.inner is None:
            self.inner = self.obj
        if not self.inner_path:
            self.inner_path = self.name

    @property
    def class_name(self) -> str:
        """The class name of the outer object."""
        return type_name(self.obj)


def _attr(obj: Any, name: str) -> Any:
    """Read an attribute of a recognised library object; None when it is absent or raises."""
    try:
        return getattr(obj, name, None)
    except Exception:
        return None


def unwrap_model(module: Any, name: str) -> tuple[Any, str]:
    """Return the innermost module behind DDP / compile / PEFT wrappers and the path users type to reach its config."""
    path = name
    current = module
    for _ in range(8):
        if is_a(current, _DDP):
            nxt = _attr(current, "module")
            path = f"{path}.module"
        elif is_a(current, _COMPILED):
            nxt = _attr(current, "_orig_mod")
        elif is_a(current, _PEFT_MODEL):
            nxt = _attr(current, "base_model")
        elif is_a(current, _PEFT_TUNER):
            nxt = _attr(current, "model")
        else:
            break
        if nxt is None or kind_of(nxt) != "model":
            break
        current = nxt
    return current, path


def _children(subject: Subject) -> Iterator[tuple[str, str, Any]]:
    """Yield ``(kind, name, obj)`` for the objects a subject brings along."""
    obj = subject.obj
    if subject.kind == "trainer":
        for attr in ("model", "optimizer", "args", "accelerator", "scaler"):
            value = _attr(obj, attr)
            if value is not None and kind_of(value) is not None:
                yield kind_of(value), f"{subject.name}.{attr}", value
    elif subject.kind == "accelerator":
        scaler = _attr(obj, "scaler")
        if scaler is not None and kind_of(scaler) == "scaler":
            yield "scaler", f"{subject.name}.scaler", scaler
    elif subject.kind == "optimizer" and is_a(obj, _ACCELERATED_OPTIMIZER):
        scaler = _attr(obj, "scaler")
        if scaler is not None and kind_of(scaler) == "scaler":
            yield "scaler", f"{subject.name}.scaler", scaler


def _make_subject(kind: str, name: str, obj: Any, owner: str | None) -> Subject:
    if kind == "model":
        inner, path = unwrap_model(obj, name)
        return Subject(kind, name, obj, inner=inner, inner_path=path, owner=owner)
    if kind == "optimizer" and is_a(obj, _ACCELERATED_OPTIMIZER):
        inner = _attr(obj, "optimizer")
        if inner is not None and kind_of(inner) == "optimizer":
            return Subject(kind, name, obj, inner=inner, inner_path=f"{name}.optimizer", owner=owner)
    return Subject(kind, name, obj, owner=owner)


def _namespace_items(namespace: Mapping[str, Any]) -> list[tuple[Any, Any]]:
    # dict.items on a dict (or subclass: IPython's user_ns may be one) never runs an overridden items().
    if dict in _TYPE_MRO(type(namespace)):
        return list(dict.items(namespace))
    return list(namespace.items())


def _key_label(key: Any) -> str | None:
    """``[key]`` for a plain str or small int dict key; None for any other key (not named, not followed)."""
    if type(key) is str:
        return f"[{key[:80]!r}]" if len(key) <= 80 else f"[{key[:77]!r}...]"
    if type(key) is int and -(10**18) < key < 10**18:  # repr of a huge int raises
        return f"[{key!r}]"
    return None


def _walk_namespace(namespace: Mapping[str, Any], hidden: Iterable[str]) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, value)`` for recognised values in a namespace and its plain containers.

    Only exact ``list`` / ``tuple`` / ``dict`` are followed, at most
    :data:`CONTAINER_DEPTH` deep and :data:`CONTAINER_WIDTH` items wide, so
    the work is bounded by the number of names, whatever the containers hold.
    """
    try:
        hidden_names = {h for h in hidden if type(h) is str}
    except Exception:
        hidden_names = set()
    try:
        items = _namespace_items(namespace)
    except Exception:
        return
    # id(class) -> kind for this walk: the namespace keeps every value, so every class, alive.
    kinds: dict[int, str | None] = {}
    seen_containers: set[int] = set()
    for name, value in items:
        if type(name) is not str or name.startswith("_") or name in hidden_names:
            continue
        cls = type(value)
        if cls is list or cls is tuple or cls is dict:
            yield from _walk_container(name, value, kinds, seen_containers)
            continue
        if _cached_kind(kinds, cls) is not None:
            # A name shown in every rendering: one that looks like a token is redacted at the source.
            yield redact(name), value


_UNSEEN: Any = object()


def _cached_kind(kinds: dict, cls: type) -> str | None:
    """The subject kind of instances of ``cls``, classified once per class and walk."""
    kind = kinds.get(id(cls), _UNSEEN)
    if kind is _UNSEEN:
        kind = kinds[id(cls)] = _classify(cls)[1]
    return kind


def _walk_container(
    name: str, container: Any, kinds: dict[int, str | None], seen_containers: set[int]
) -> Iterator[tuple[str, Any]]:
    stack: list[tuple[str, Any, int]] = [(name, container, 0)]
    while stack:
        name, value, depth = stack.pop()
        cls = type(value)
        if cls is list or cls is tuple or cls is dict:
            if depth >= CONTAINER_DEPTH or id(value) in seen_containers:
                continue
            seen_containers.add(id(value))
            pairs: list[tuple[str, Any, int]] = []
            if cls is dict:
                for i, (key, item) in enumerate(dict.items(value)):
                    if i >= CONTAINER_WIDTH:
                        break
                    label = _key_label(key)
                    if label is not None:
                        pairs.append((f"{name}{label}", item, depth + 1))
            else:
                pairs = [(f"{name}[{i}]", item, depth + 1) for i, item in enumerate(value[:CONTAINER_WIDTH])]
            stack.extend(reversed(pairs))
            continue
        if _cached_kind(kinds, cls) is not None:
            yield redact(name), value


def _default_name(kind: str, index: int) -> str:
    return f"{kind}" if index == 0 else f"{kind}_{index}"


def discover(
    objects: Iterable[Any] = (),
    namespace: Mapping[str, Any] | None = None,
    hidden: Iterable[str] = (),
    names: Mapping[int, str] | None = None,
) -> list[Subject]:
    """Return the subjects found in ``objects`` and ``namespace``, each object once.

    Parameters
    ----------
    objects
        Objects passed directly; named by ``names`` (``id -> name``) when given,
        else by their kind (``model``, ``optimizer_1``, ...).
    namespace
        A mapping such as IPython's ``user_ns``; ``_``-prefixed names and the
        names in ``hidden`` are skipped, as ``%who_ls`` does.
    hidden
        Names to skip (IPython's ``user_ns_hidden``).
    names
        Optional display names for ``objects``, keyed by ``id``.

    Returns
    -------
    list of Subject
        Top-level subjects first, then what they bring along (a Trainer's
        model, optimizer, arguments, accelerator, scaler), each object once
        under the most direct name.
    """
    names = dict(names or {})
    top: list[tuple[str, Any]] = []
    counters: dict[str, int] = {}
    for obj in objects:
        kind = kind_of(obj)
        if kind is None:
            continue
        name = names.get(id(obj))
        if name is None:
            name = _default_name(kind, counters.get(kind, 0))
            counters[kind] = counters.get(kind, 0) + 1
        top.append((name, obj))
    if namespace is not None:
        top.extend(_walk_namespace(namespace, hidden))

    subjects: list[Subject] = []
    seen: set[int] = set()
    queue: list[tuple[str, str, Any, str | None]] = []
    for name, obj in top:
        kind = kind_of(obj)
        if kind is not None and id(obj) not in seen:
            seen.add(id(obj))
            queue.append((kind, name, obj, None))
    # Mark the objects a wrapper holds as seen under their direct names first.
    i = 0
    while i < len(queue):
        kind, name, obj, owner = queue[i]
        subject = _make_subject(kind, name, obj, owner)
        subjects.append(subject)
        # A model's inner module (PEFT / DDP / compile) is the same network: never a second subject.
        if subject.kind == "model" and subject.inner is not subject.obj:
            seen.add(id(subject.inner))
        if subject.kind == "optimizer" and subject.inner is not subject.obj:
            seen.add(id(subject.inner))
        for child_kind, child_name, child in _children(subject):
            if id(child) not in seen:
                seen.add(id(child))
                queue.append((child_kind, child_name, child, subject.name))
        i += 1
    # An inner module or optimizer listed on its own before its wrapper is dropped in favour of the wrapper.
    inner_ids = {id(s.inner) for s in subjects if s.inner is not s.obj}
    subjects = [s for s in subjects if not (id(s.obj) in inner_ids and s.inner is s.obj)]
    order = {k: n for n, k in enumerate(KINDS)}
    subjects.sort(key=lambda s: order.get(s.kind, len(order)))
    return subjects


def transformers_loaded() -> bool:
    """True when the user's process has imported transformers (mpdoctor never imports it first)."""
    return "transformers" in sys.modules
