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

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...redact import redact
from .. import integrations
from ..live.introspect import attr_of_known, class_path, class_paths, is_a, mro_paths, type_mro, type_name

__all__ = ["KINDS", "Subject", "class_path", "discover", "is_a", "subject_kind", "mro_paths", "type_name"]

#: Kinds of subject, in the order a report lists them.
KINDS = integrations.KINDS

#: How deep and how wide discovery looks into plain containers of a namespace.
CONTAINER_DEPTH = 2
CONTAINER_WIDTH = 32

_TYPE_MRO = type_mro

#: ``id(cls) -> (cls.__mro__, active integrations, kind)``: the kind depends on which libraries are
#: imported, so an entry is valid for one set of active integrations.
_CLASS_CACHE: dict[int, tuple[tuple, tuple[str, ...], str | None]] = {}
_CLASS_CACHE_SIZE = 4096


def _classify(cls: type) -> tuple[tuple[str, ...], str | None]:
    try:
        mro = _TYPE_MRO(cls)
    except Exception:
        return (), None
    key = integrations.active_key()
    entry = _CLASS_CACHE.get(id(cls))
    paths = class_paths(cls)
    if entry is not None and entry[0] is mro and entry[1] == key:
        return paths, entry[2]
    kind = integrations.kind_from_paths(paths)
    if len(_CLASS_CACHE) >= _CLASS_CACHE_SIZE:
        _CLASS_CACHE.clear()
    _CLASS_CACHE[id(cls)] = (mro, key, kind)
    return paths, kind


def _value_rules(cls: type) -> tuple:
    """``(predicate, kind)`` rules for instances of exactly ``cls`` (a tensor that is an attention mask)."""
    paths = class_paths(cls)
    return integrations.value_kind_rules(paths[0]) if paths else ()


def _value_kind(obj: Any, rules: tuple) -> str | None:
    """The kind the first rule whose predicate holds gives ``obj``; a predicate that raises gives none."""
    for predicate, kind in rules:
        try:
            if predicate(obj):
                return kind
        except Exception:
            continue
    return None


def subject_kind(obj: Any) -> str | None:
    """Return the subject kind of ``obj`` or None when mpdoctor has nothing to say about it."""
    kind = _classify(type(obj))[1]
    return kind if kind is not None else _value_kind(obj, _value_rules(type(obj)))


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
    #: Other names the user holds this object, or a part of it, by (``layer = model.model.layers[28]``).
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.inner is None:
            self.inner = self.obj
        if not self.inner_path:
            self.inner_path = self.name

    @property
    def class_name(self) -> str:
        """The class name of the outer object."""
        return type_name(self.obj)


_attr = attr_of_known


def _unwrap(obj: Any, rules: list, want: str, name: str) -> tuple[Any, str]:
    """Follow wrapper rules from ``obj`` to the innermost object of kind ``want``."""
    path, current = name, obj
    for _ in range(8):
        paths = mro_paths(current)
        rule = next((r for r in rules if r.class_path in paths), None)
        if rule is None:
            break
        nxt = _attr(current, rule.attr)
        if nxt is None or subject_kind(nxt) != want:
            break
        current, path = nxt, path + rule.suffix
    return current, path


def unwrap_model(module: Any, name: str) -> tuple[Any, str]:
    """Return the innermost module behind DDP / compile / PEFT wrappers and the path users type to reach its config."""
    return _unwrap(module, list(integrations.model_unwraps()), "model", name)


def unwrap_optimizer(optimizer: Any, name: str) -> tuple[Any, str]:
    """Return the optimizer behind accelerate's / Lightning's wrappers (the one whose step hooks fire) and its path."""
    return _unwrap(optimizer, list(integrations.optimizer_unwraps()), "optimizer", name)


def _children(subject: Subject) -> Iterator[tuple[str, str, Any]]:
    """Yield ``(kind, name, obj)`` for the objects a subject brings along (as its integrations declare)."""
    for attr in integrations.brought_attrs(mro_paths(subject.obj)):
        # A dotted attribute is followed step by step (``precision_plugin.scaler``).
        value = subject.obj
        for part in attr.split("."):
            value = _attr(value, part) if value is not None else None
        if value is None:
            continue
        # An exact list or tuple holds several children (Lightning's ``trainer.optimizers``).
        items = list(enumerate(value[:CONTAINER_WIDTH])) if type(value) in (list, tuple) else [(None, value)]
        for index, item in items:
            kind = subject_kind(item)
            if kind is not None:
                yield kind, f"{subject.name}.{attr}" + ("" if index is None else f"[{index}]"), item


def _make_subject(kind: str, name: str, obj: Any, owner: str | None) -> Subject:
    if kind == "model":
        inner, path = unwrap_model(obj, name)
        return Subject(kind, name, obj, inner=inner, inner_path=path, owner=owner)
    if kind == "optimizer":
        inner, path = unwrap_optimizer(obj, name)
        if inner is not obj:
            return Subject(kind, name, obj, inner=inner, inner_path=path, owner=owner)
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
    kinds: dict[Any, Any] = {}
    seen_containers: set[int] = set()
    for name, value in items:
        if type(name) is not str or name.startswith("_") or name in hidden_names:
            continue
        cls = type(value)
        if (cls is list or cls is tuple or cls is dict) and _cached_value_kind(kinds, cls, value) is None:
            yield from _walk_container(name, value, kinds, seen_containers)
            continue
        if _cached_kind(kinds, cls) is not None or _cached_value_kind(kinds, cls, value) is not None:
            # A name shown in every rendering: one that looks like a token is redacted at the source.
            yield redact(name), value


_UNSEEN: Any = object()


def _cached_kind(kinds: dict, cls: type) -> str | None:
    """The subject kind of instances of ``cls``, classified once per class and walk."""
    kind = kinds.get(id(cls), _UNSEEN)
    if kind is _UNSEEN:
        kind = kinds[id(cls)] = _classify(cls)[1]
    return kind


def _cached_value_kind(kinds: dict, cls: type, value: Any) -> str | None:
    """The kind ``value`` has by its values (an attention mask among tensors), its class's rules read once per walk."""
    key = -1 - id(cls)  # beside the class's kind in the same per-walk dict: ids are never negative
    rules = kinds.get(key, _UNSEEN)
    if rules is _UNSEEN:
        rules = kinds[key] = _value_rules(cls)
    return _value_kind(value, rules) if rules else None


def _walk_container(
    name: str, container: Any, kinds: dict[Any, Any], seen_containers: set[int]
) -> Iterator[tuple[str, Any]]:
    stack: list[tuple[str, Any, int]] = [(name, container, 0)]
    while stack:
        name, value, depth = stack.pop()
        cls = type(value)
        # A container that is a value of some kind itself (a legacy KV cache: a tuple of (key, value) pairs) is one.
        if (cls is list or cls is tuple or cls is dict) and _cached_value_kind(kinds, cls, value) is None:
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
        if _cached_kind(kinds, cls) is not None or _cached_value_kind(kinds, cls, value) is not None:
            yield redact(name), value


def _default_name(kind: str, index: int) -> str:
    return f"{kind}" if index == 0 else f"{kind}_{index}"


def _named_objects(objects: Iterable[Any], names: dict[int, str]) -> list[tuple[str, Any]]:
    """The objects of a known kind, each under its given name or its kind's next default name."""
    top: list[tuple[str, Any]] = []
    counters: dict[str, int] = {}
    for obj in objects:
        kind = subject_kind(obj)
        if kind is None:
            continue
        name = names.get(id(obj))
        if name is None:
            name = _default_name(kind, counters.get(kind, 0))
            counters[kind] = counters.get(kind, 0) + 1
        top.append((name, obj))
    return top


def _subjects_and_children(top: list[tuple[str, Any]]) -> list[Subject]:
    """The top-level subjects, then (breadth first) what each brings along, each object once under its most
    direct name; the inside of a wrapper is never a second subject."""
    seen: set[int] = set()
    queue: list[tuple[str, str, Any, str | None]] = []
    for name, obj in top:
        kind = subject_kind(obj)
        if kind is not None and id(obj) not in seen:
            seen.add(id(obj))
            queue.append((kind, name, obj, None))
    subjects: list[Subject] = []
    # Mark the objects a wrapper holds as seen under their direct names first.
    i = 0
    while i < len(queue):
        kind, name, obj, owner = queue[i]
        subject = _make_subject(kind, name, obj, owner)
        subjects.append(subject)
        # A model's inner module (PEFT / DDP / compile), a wrapped optimizer: never a second subject.
        if subject.kind in ("model", "optimizer") and subject.inner is not subject.obj:
            seen.add(id(subject.inner))
        for child_kind, child_name, child in _children(subject):
            if id(child) not in seen:
                seen.add(id(child))
                queue.append((child_kind, child_name, child, subject.name))
        i += 1
    return subjects


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
    top = _named_objects(objects, dict(names or {}))
    if namespace is not None:
        top.extend(_walk_namespace(namespace, hidden))
    subjects = _subjects_and_children(top)
    # An inner module or optimizer listed on its own before its wrapper is dropped in favour of the wrapper.
    inner_ids = {id(s.inner) for s in subjects if s.inner is not s.obj}
    subjects = [s for s in subjects if not (id(s.obj) in inner_ids and s.inner is s.obj)]
    subjects = _one_patient_per_tree(subjects)
    order = {k: n for n, k in enumerate(KINDS)}
    subjects.sort(key=lambda s: order.get(s.kind, len(order)))
    return subjects


#: What mpdoctor inspects, for the sentence that says an object was not one of them.
INSPECTED = "models, optimizers, GradScalers, Trainers, TrainingArguments, Accelerators and KV caches"
# transformers 5 renamed PretrainedConfig to PreTrainedConfig.
_CONFIG_CLASSES = (
    "transformers.configuration_utils.PreTrainedConfig",
    "transformers.configuration_utils.PretrainedConfig",
)


def nothing_to_inspect(name: str, obj: Any) -> str:
    """Why an object given by name brought no subject, and what to give instead (read without running its code)."""
    cls_name = type_name(obj)
    article = "an" if cls_name[:1].lower() in "aeiou" else "a"
    if is_a(obj, ("torch.Tensor",)):
        dtype = obj.dtype if class_path(type(obj)) in ("torch.Tensor", "torch.nn.parameter.Parameter") else None
        shown = f" ({str(dtype).replace('torch.', '')})" if dtype is not None else ""
        return f"{name} is a tensor{shown}: nothing to inspect on its own; name the model or optimizer that holds it"
    if is_a(obj, _CONFIG_CLASSES) or cls_name.endswith("Config"):
        return f"{name} is {article} {cls_name}: a config is read through the model built from it; name the model"
    return f"{name} is {article} {cls_name}: nothing to inspect (mpdoctor inspects {INSPECTED})"


def _module_paths(module: Any) -> dict[int, str]:
    """``id(submodule) -> dotted path`` of every submodule of ``module`` (the root excluded)."""
    try:
        return {id(m): path for path, m in module.named_modules() if path}
    except Exception:  # a half-built module: it keeps its own subject
        return {}


def _one_patient_per_tree(subjects: list[Subject]) -> list[Subject]:
    """Drop a model that is a submodule of another inspected model; its name becomes an alias of the owner.

    A leftover loop variable (``layer = model.model.layers[28]``) is part of the
    model, not a second patient: diagnosing it alone would prescribe for one
    layer what the whole model needs otherwise.
    """
    models = [s for s in subjects if s.kind == "model"]
    if len(models) < 2:
        return subjects
    trees = {id(s): _module_paths(s.obj) for s in models}
    dropped: set[int] = set()
    aliases: dict[int, list[str]] = {}
    for s in models:
        for owner in models:
            if owner is s or id(owner) in dropped:
                continue
            path = trees[id(owner)].get(id(s.obj))
            if path is not None:
                dropped.add(id(s))
                aliases.setdefault(id(owner), []).append(f"{s.name} = {owner.name}.{path}")
                break
    out = []
    for s in subjects:
        if id(s) in dropped:
            continue
        if id(s) in aliases:
            s.aliases = tuple(s.aliases) + tuple(aliases[id(s)])
        out.append(s)
    return out
