"""Reading user objects without running user code: class paths through ``type``'s own descriptors, raw attributes.

Everything that classifies or reads an arbitrary object goes through here:
``type(obj).__mro__`` read with ``type``'s descriptors (never ``obj.__class__``
or ``isinstance``, which an object may fake; never a metaclass's hooks), and
attributes read from ``__dict__`` and class dicts (never ``getattr``, which
runs properties and ``__getattr__``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

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
    """``module.qualname`` of a class, read without running user code.

    A class without a readable string module (made by ``exec`` under globals without ``__name__``, or whose
    ``__module__`` was set to a non-string) is named by its qualname alone, so it can still be matched by its
    name; ``"?"`` when even the qualname cannot be read (not a class).
    """
    try:
        qualname = _TYPE_QUALNAME(cls)
    except Exception:
        return "?"
    try:
        module = _TYPE_MODULE(cls)
    except Exception:  # no __module__ in the class's dict
        module = None
    if type(qualname) is not str:
        return "?"
    return f"{module}.{qualname}" if type(module) is str and module else qualname


def type_mro(cls: type) -> tuple:
    """``cls.__mro__`` through ``type``'s descriptor; raises for a non-class."""
    return _TYPE_MRO(cls)


#: ``id(cls) -> (cls.__mro__, class paths)``. The cached MRO tuple starts with the class itself, so
#: the class stays alive and its id cannot be reused while the entry exists; a class whose
#: ``__bases__`` were reassigned has a new MRO tuple and is read again.
_PATHS: dict[int, tuple[tuple, tuple[str, ...]]] = {}
_PATHS_SIZE = 4096


def class_paths(cls: type) -> tuple[str, ...]:
    """Class paths of ``cls`` and its bases; empty when the MRO cannot be read."""
    try:
        mro = _TYPE_MRO(cls)
    except Exception:
        return ()
    entry = _PATHS.get(id(cls))
    if entry is not None and entry[0] is mro:
        return entry[1]
    paths = tuple(class_path(c) for c in mro)
    if len(_PATHS) >= _PATHS_SIZE:
        _PATHS.clear()
    _PATHS[id(cls)] = (mro, paths)
    return paths


def mro_paths(obj: Any) -> tuple[str, ...]:
    """Class paths of ``type(obj)`` and its bases."""
    return class_paths(type(obj))


def is_a(obj: Any, names: Iterable[str]) -> bool:
    """True when one of ``names`` is a class path in ``type(obj)``'s MRO."""
    paths = mro_paths(obj)
    return any(n in paths for n in names)


def raw_attr(obj: Any, key: str, default: Any = None) -> Any:
    """Read ``key`` from ``obj.__dict__`` or its class dicts without running user code."""
    try:
        d = object.__getattribute__(obj, "__dict__")
        if key in d:
            return d[key]
    except Exception:
        pass
    try:
        for cls in _TYPE_MRO(type(obj)):
            if key in cls.__dict__:
                value = cls.__dict__[key]
                return default if isinstance(value, (property, staticmethod, classmethod)) or callable(value) else value
    except Exception:
        pass
    return default


def own_dict(obj: Any) -> dict:
    """``obj.__dict__`` read without ``__getattribute__`` hooks; empty when there is none."""
    try:
        d = object.__getattribute__(obj, "__dict__")
        return d if isinstance(d, dict) else {}
    except Exception:
        return {}


def attr_of_known(obj: Any, name: str) -> Any:
    """``getattr`` on an object whose class mpdoctor recognised as a library class; None when absent or raising."""
    try:
        return getattr(obj, name, None)
    except Exception:
        return None


# One walk of a module tree per gathering: tensors, intent, the places between steps, bitsandbytes, torchao, FSDP and
# rotary-buffer facts all need ``named_modules()``; on a 70B-shaped model each walk costs about as much as the whole
# tally, so they share it, and what several readers ask of every module is read in one pass over it (ruff runs every
# AST rule in one traversal).
_WALKS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("mpdoctor_module_walks", default=None)


@contextlib.contextmanager
def shared_module_walks() -> Iterator[None]:
    """Within this block, :func:`named_modules` walks each module tree once."""
    token = _WALKS.set({})
    try:
        yield
    finally:
        _WALKS.reset(token)


class Anatomy(NamedTuple):
    """The few modules of a tree a reader must look at, found in one pass over its walk.

    Each field lists ``(path, submodule)`` in ``named_modules()`` order, and keeps every module it cannot rule
    out (an own dict that is not the usual one), so a reader that visits only these sees what it would see
    visiting them all.
    """

    #: Modules holding buffers of their own (router correction biases, rotary frequencies).
    buffered: tuple[tuple[str, Any], ...]
    #: Modules with both forward pre-hooks and forward hooks (a cast written around a module).
    hooked: tuple[tuple[str, Any], ...]
    #: Modules holding a ``parametrizations`` child (``torch.nn.utils.parametrize``).
    parametrized: tuple[tuple[str, Any], ...]
    #: Modules holding a parameter that is not exactly an ``nn.Parameter`` (a tensor subclass: quantized storage).
    subclassed: tuple[tuple[str, Any], ...]


class ModuleWalk:
    """One walk of a module tree (``named_modules()``), and what readers derived from it, each derived once.

    A tree of classes that list their submodules as ``nn.Module`` does is walked from the modules' own dicts, and
    the :class:`Anatomy` is read in the same traversal; any other tree is walked by its own ``named_modules()``.
    """

    __slots__ = ("module", "modules", "_by_class", "_anatomy")

    def __init__(self, module: Any) -> None:
        self.module = module  # held, so the module's id is not reused while the walk is cached
        self._by_class: dict[type, list[int]] | None = None
        self._anatomy: Anatomy | None = None
        once = _walk_once(module)
        if once is None:
            self.modules: tuple[tuple[str, Any], ...] = tuple(module.named_modules())
        else:
            self.modules, self._anatomy = once

    def by_class(self) -> dict[type, list[int]]:
        """``type -> positions in the walk``."""
        if self._by_class is None:
            index: dict[type, list[int]] = {}
            for i, (_path, mod) in enumerate(self.modules):
                cls = type(mod)
                at = index.get(cls)
                if at is None:
                    index[cls] = [i]
                else:
                    at.append(i)
            self._by_class = index
        return self._by_class

    def anatomy(self) -> Anatomy:
        """The modules with buffers, with hooks around them, parametrized, or holding tensor-subclass parameters."""
        if self._anatomy is None:
            self._anatomy = _anatomy(self.modules)
        return self._anatomy


_CLASS_DICT = type.__dict__["__dict__"].__get__
#: ``class -> whether it walks and hashes as nn.Module does`` (classes are few; a notebook that redefines one makes
#: a new class).
_PLAIN: dict[type, bool] = {}


def _class_attr(cls: type, name: str) -> Any:
    """``name`` as ``cls`` resolves it, read from the class dicts along its MRO (no metaclass hook runs)."""
    for c in _TYPE_MRO(cls):
        d = _CLASS_DICT(c)
        if name in d:
            return d[name]
    return None


def _walks_as_module(cls: type) -> bool:
    """``cls`` lists its submodules, reads its attributes and hashes with ``nn.Module``'s and ``object``'s own code."""
    known = _PLAIN.get(cls)
    if known is None:
        from torch.nn import Module

        try:
            known = (
                _class_attr(cls, "named_modules") is _CLASS_DICT(Module)["named_modules"]
                and all(_class_attr(cls, n) is _CLASS_DICT(object)[n] for n in ("__getattribute__", "__hash__", "__eq__"))
                and _class_attr(cls, "_modules") is None
            )
        except Exception:
            known = False
        if len(_PLAIN) >= _PATHS_SIZE:
            _PLAIN.clear()
        _PLAIN[cls] = known
    return known


def _walk_once(root: Any) -> tuple[tuple[tuple[str, Any], ...], Anatomy] | None:
    """``tuple(root.named_modules())`` and its :class:`Anatomy`, in one traversal of the modules' own dicts: the
    same pre-order, each module once. None when a module's class walks its own way (its ``named_modules()`` then)."""
    from torch.nn import Parameter

    modules: list[tuple[str, Any]] = []
    buffered, hooked, parametrized, subclassed = [], [], [], []
    seen: set[int] = set()
    pending = [("", root)]
    plain, push, keep, met = _PLAIN, pending.append, modules.append, seen.add
    while pending:
        entry = pending.pop()
        mod = entry[1]
        key = id(mod)
        if key in seen:  # the modules are held by the walk: an id is not reused during it
            continue
        cls = type(mod)
        if not (plain.get(cls) or _walks_as_module(cls)):
            return None
        try:
            d = mod.__dict__  # object.__getattribute__: the class has no other (``_walks_as_module``)
        except Exception:
            return None
        children = d.get("_modules") if type(d) is dict else None
        if type(children) is not dict:
            return None
        met(key)
        keep(entry)
        bufs = d.get("_buffers")
        if bufs or type(bufs) is not dict:
            buffered.append(entry)
        if d.get("_forward_pre_hooks") and d.get("_forward_hooks"):
            hooked.append(entry)
        params = d.get("_parameters")
        if type(params) is not dict or (params and _holds_subclass(params, Parameter)):
            subclassed.append(entry)
        if children:
            if "parametrizations" in children:
                parametrized.append(entry)
            dot = entry[0] + "." if entry[0] else ""
            for name, child in reversed(children.items()):
                if child is not None:
                    push((dot + name, child))
    return tuple(modules), Anatomy(tuple(buffered), tuple(hooked), tuple(parametrized), tuple(subclassed))


def _holds_subclass(params: dict, plain: type) -> bool:
    """A parameter in ``params`` is not exactly ``plain`` (``nn.Parameter``)."""
    for p in params.values():
        if p is not None and type(p) is not plain:
            return True
    return False


def _anatomy(walk: tuple[tuple[str, Any], ...]) -> Anatomy:
    """The :class:`Anatomy` of a walk made by a tree's own ``named_modules()``."""
    from torch.nn import Parameter

    buffered, hooked, parametrized, subclassed = [], [], [], []
    for entry in walk:
        d = own_dict(entry[1])
        if not d:  # no own dict to read: every reader looks at it as it would have
            for kept in (buffered, hooked, parametrized, subclassed):
                kept.append(entry)
            continue
        bufs = d.get("_buffers")
        if bufs or type(bufs) is not dict:
            buffered.append(entry)
        if d.get("_forward_pre_hooks") and d.get("_forward_hooks"):
            hooked.append(entry)
        children = d.get("_modules")
        if type(children) is not dict or "parametrizations" in children:
            parametrized.append(entry)
        params = d.get("_parameters")
        if type(params) is not dict or _holds_subclass(params, Parameter):
            subclassed.append(entry)
    return Anatomy(tuple(buffered), tuple(hooked), tuple(parametrized), tuple(subclassed))


def module_walk(module: Any) -> ModuleWalk:
    """The walk of ``module``'s tree: shared by every reader inside :func:`shared_module_walks`, else a fresh one."""
    cache = _WALKS.get()
    if cache is None:
        return ModuleWalk(module)
    hit = cache.get(id(module))
    if hit is None or hit.module is not module:
        hit = cache[id(module)] = ModuleWalk(module)
    return hit


def named_modules(module: Any) -> tuple[tuple[str, Any], ...]:
    """``tuple(module.named_modules())``, shared by every reader inside :func:`shared_module_walks`."""
    return module_walk(module).modules


def anatomy(module: Any) -> Anatomy:
    """The :class:`Anatomy` of ``module``'s tree, read once per walk."""
    return module_walk(module).anatomy()


def modules_where(module: Any, accept: Callable[[type], bool]) -> list[tuple[str, Any]]:
    """``(path, submodule)`` of ``module``'s tree whose class ``accept`` takes, in ``named_modules()`` order.

    ``accept`` runs once per distinct class, not per module (a 70B Llama has 1,000 modules of 6
    classes); a class it raises on is not taken.
    """
    walk = module_walk(module)
    hits: list[int] = []
    for cls, at in walk.by_class().items():
        try:
            taken = accept(cls)
        except Exception:
            taken = False
        if taken:
            hits.extend(at)
    hits.sort()
    return [walk.modules[i] for i in hits]


def modules_of(module: Any, names: Iterable[str]) -> list[tuple[str, Any]]:
    """``(path, submodule)`` of ``module``'s tree whose class (or a base) has one of the class paths ``names``."""
    names = tuple(names)
    return modules_where(module, lambda cls: any(n in class_paths(cls) for n in names))
