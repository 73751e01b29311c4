"""Executable, reversible edits of live objects: the steps a fix is made of.

Each :class:`Change` records what it replaces before replacing it and restores exactly that on
:meth:`Change.revert`. Casting steps compute every new tensor before swapping any in, so the failure point
(allocation) comes before the first visible change. Integrations build the library-specific steps from
these; :class:`mpdoctor.rules.engine.fixes.Fix` runs them atomically.
"""

from __future__ import annotations

import contextlib
import copy
import os
import types
from collections.abc import Iterable, Sequence
from typing import Any, Callable

import torch

_UNSET = object()

def cast_tensor(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Return a copy of ``tensor`` in ``dtype`` on its own device (the one place fixes allocate)."""
    return tensor.to(dtype=dtype, copy=True)


def same_value(held: Any, value: Any) -> bool:
    """``held`` is ``value`` as a setting: the same object, or equal plain values (numbers, strings, dtypes,
    tuples of them). A tensor or any other object compares by identity only: equal-looking is not the same."""
    if held is value:
        return True
    plain = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device)
    if isinstance(held, (tuple, list)) and isinstance(value, (tuple, list)):
        return type(held) is type(value) and len(held) == len(value) and all(map(same_value, held, value))
    return isinstance(held, plain) and isinstance(value, plain) and type(held) is type(value) and held == value


class Change:
    """One reversible step of a fix."""

    description = ""

    @property
    def in_place(self) -> bool:
        """True when the live objects already hold what :meth:`apply` would make (applying changes nothing);
        False when it would change something, or cannot tell (a step made by a function)."""
        return False

    def apply(self) -> None:
        """Record the prior state, then make the change."""
        raise NotImplementedError

    def revert(self) -> None:
        """Restore exactly the state recorded by :meth:`apply`."""
        raise NotImplementedError


class SetAttr(Change):
    """Set ``obj.attr = value``; undo restores the previous value (or its absence)."""

    def __init__(self, obj: Any, attr: str, value: Any, label: str) -> None:
        self.obj, self.attr, self.value = obj, attr, value
        self.description = f"{label} = {value!r}"
        self._old: Any = _UNSET

    @property
    def in_place(self) -> bool:
        return same_value(getattr(self.obj, self.attr, _UNSET), self.value)

    def apply(self) -> None:
        d = object.__getattribute__(self.obj, "__dict__") if hasattr(self.obj, "__dict__") else {}
        self._old = d[self.attr] if self.attr in d else getattr(self.obj, self.attr, _UNSET)
        self._had_own = self.attr in d
        setattr(self.obj, self.attr, self.value)

    def revert(self) -> None:
        if self._old is _UNSET or not self._had_own:
            try:
                delattr(self.obj, self.attr)
            except AttributeError:
                pass
            if self._old is not _UNSET and getattr(self.obj, self.attr, _UNSET) is not self._old:
                setattr(self.obj, self.attr, self._old)
        else:
            setattr(self.obj, self.attr, self._old)


class SetRequiresGrad(Change):
    """``p.requires_grad_(flag)`` on each parameter; undo puts each one's flag back."""

    def __init__(self, params: Sequence[Any], flag: bool, label: str) -> None:
        self.params, self.flag = list(params), flag
        self.description = f"{label}: requires_grad={flag}"
        self._old: list[bool] = []

    @property
    def in_place(self) -> bool:
        return all(p.requires_grad == self.flag for p in self.params)

    def apply(self) -> None:
        self._old = [p.requires_grad for p in self.params]
        for p in self.params:
            p.requires_grad_(self.flag)

    def revert(self) -> None:
        for p, old in zip(self.params, self._old):
            p.requires_grad_(old)


class SetClass(Change):
    """``obj.__class__ = cls`` (a converted layer back to the torch class it was converted from); undo puts the
    converted class back. The instance, its parameters and every reference to it stay the same objects."""

    def __init__(self, obj: Any, cls: type, label: str) -> None:
        self.obj, self.cls = obj, cls
        self.description = f"{label}: back to {cls.__module__}.{cls.__qualname__}"
        self._old: Any = None

    @property
    def in_place(self) -> bool:
        return type(self.obj) is self.cls

    def apply(self) -> None:
        self._old = type(self.obj)
        self.obj.__class__ = self.cls

    def revert(self) -> None:
        if self._old is not None:
            self.obj.__class__ = self._old


class SetChild(Change):
    """``parent.<name>`` becomes the submodule ``new`` (a layer swapped for another class built over the same
    Parameters); undo puts the very module object that was there back. Written to the parent's ``_modules``, as
    ``setattr`` on a module does, without its hooks."""

    def __init__(self, parent: Any, name: str, new: Any, label: str) -> None:
        self.parent, self.name, self.new = parent, name, new
        self.description = f"{label}: a {type(new).__module__}.{type(new).__qualname__}"
        self._old: Any = _UNSET

    @property
    def in_place(self) -> bool:
        return object.__getattribute__(self.parent, "_modules").get(self.name) is self.new

    def apply(self) -> None:
        children = object.__getattribute__(self.parent, "_modules")
        self._old = children[self.name]
        children[self.name] = self.new

    def revert(self) -> None:
        if self._old is not _UNSET:
            object.__getattribute__(self.parent, "_modules")[self.name] = self._old
            self._old = _UNSET


class SwapParameter(Change):
    """``module.<name>`` becomes ``new``, and every optimizer that held the old Parameter holds ``new`` instead, its
    state moved with it; undo puts the old Parameter back everywhere. For a weight a library wrapped in a tensor
    subclass (torchao's low-precision training wrappers), ``new`` is the plain tensor it wraps."""

    def __init__(self, module: Any, name: str, new: Any, optimizers: Iterable[Any], label: str) -> None:
        self.module, self.name, self.new, self.optimizers = module, name, new, list(optimizers)
        self.description = f"{label}: a plain Parameter in place of the wrapped one"
        self._old: Any = None

    def _swap(self, old: Any, new: Any) -> None:
        object.__getattribute__(self.module, "_parameters")[self.name] = new
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["params"] = [new if p is old else p for p in group["params"]]
            if old in opt.state:
                opt.state[new] = opt.state.pop(old)

    @property
    def in_place(self) -> bool:
        return object.__getattribute__(self.module, "_parameters").get(self.name) is self.new

    def apply(self) -> None:
        self._old = object.__getattribute__(self.module, "_parameters")[self.name]
        self._swap(self._old, self.new)

    def revert(self) -> None:
        if self._old is not None:
            self._swap(self.new, self._old)


class SetEnv(Change):
    """Set (or, with None, remove) an environment variable."""

    def __init__(self, name: str, value: str | None) -> None:
        self.name, self.value = name, value
        self.description = f"os.environ[{name!r}] = {value!r}" if value is not None else f"del os.environ[{name!r}]"
        self._old: str | None = None

    @property
    def in_place(self) -> bool:
        return os.environ.get(self.name) == self.value

    def apply(self) -> None:
        self._old = os.environ.get(self.name)
        if self.value is None:
            os.environ.pop(self.name, None)
        else:
            os.environ[self.name] = self.value

    def revert(self) -> None:
        if self._old is None:
            os.environ.pop(self.name, None)
        else:
            os.environ[self.name] = self._old


class CastParams(Change):
    """Cast parameters (with their grads and optimizer state) to ``dtype``, keeping the Parameter objects.

    The optimizers keep their references because the Parameters are the same
    objects; only ``.data``, ``.grad`` and full-size floating state tensors are
    replaced. The old tensors are kept for an exact undo.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        dtype: torch.dtype,
        optimizers: Iterable[Any] = (),
        label: str = "parameters",
        state: bool = True,
    ) -> None:
        unique = {id(p): p for p in params}  # a tied weight listed twice is cast once
        self.params = [p for p in unique.values() if p.dtype != dtype]
        self.dtype = dtype
        self.optimizers = list(optimizers)
        self.cast_state = state
        self.description = f"cast {len(self.params)} {label} to {str(dtype).replace('torch.', '')}"
        self._backup: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor | None, list]] = []

    def _state_entries(self, p: torch.Tensor) -> list[tuple[dict, str, torch.Tensor]]:
        out = []
        if not self.cast_state:
            return out
        seen: set[int] = set()
        for opt in self.optimizers:
            st = opt.state.get(p) if hasattr(opt, "state") else None
            # A wrapper and the optimizer inside it share one state dict: cast it once.
            if not isinstance(st, dict) or id(st) in seen:
                continue
            seen.add(id(st))
            for key, value in st.items():
                if (
                    isinstance(value, torch.Tensor)
                    and value.dtype.is_floating_point
                    and value.shape == p.shape
                    and value.dtype == p.dtype
                ):
                    out.append((st, key, value))
        return out

    @property
    def in_place(self) -> bool:
        return all(p.dtype == self.dtype for p in self.params)

    def apply(self) -> None:
        # Phase 1: allocate every new tensor; a failure here changes nothing.
        staged = []
        for p in self.params:
            new_data = cast_tensor(p.data, self.dtype)
            new_grad = cast_tensor(p.grad, self.dtype) if p.grad is not None else None
            new_state = [(st, key, old, cast_tensor(old, self.dtype)) for st, key, old in self._state_entries(p)]
            staged.append((p, new_data, new_grad, new_state))
        # Phase 2: swap references; nothing here allocates. Should a swap still fail (a state
        # dict that refuses a key), the swaps already made are undone before the error leaves.
        self._backup = []
        try:
            for p, new_data, new_grad, new_state in staged:
                old_grad = p.grad
                self._backup.append((p, p.data, old_grad, [(st, key, old) for st, key, old, _ in new_state]))
                p.grad = None
                p.data = new_data
                p.grad = new_grad
                for st, key, _old, new in new_state:
                    st[key] = new
        except BaseException:
            self.revert()
            raise

    def revert(self) -> None:
        failures: list[BaseException] = []
        for p, old_data, old_grad, states in reversed(self._backup):
            try:
                p.grad = None
                p.data = old_data
                p.grad = old_grad
            except Exception as exc:
                failures.append(exc)
            for st, key, old in states:
                try:
                    st[key] = old
                except Exception as exc:
                    failures.append(exc)
        self._backup = []
        if failures:
            raise failures[0]

    @property
    def backup_bytes(self) -> int:
        """Bytes the undo backup keeps alive (the replaced tensors)."""
        return sum(p.numel() * p.element_size() * (2 if p.grad is not None else 1) for p in self.params)


class CastGrads(Change):
    """Cast each parameter's ``.grad`` to the parameter's dtype, keeping the grad tensor objects.

    ``grad.data`` is swapped rather than ``param.grad`` rebound: a grad whose
    dtype differs from its parameter could not be assigned back through
    ``param.grad`` on undo.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], label: str = "parameters") -> None:
        self.params = list(params)
        self.description = f"cast the grads of {len(self.params)} {label} to their parameter's dtype"
        self._backup: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def in_place(self) -> bool:
        return all(p.grad is None or p.grad.dtype == p.dtype for p in self.params)

    def apply(self) -> None:
        # Allocate every new grad first: a failure here changes nothing.
        staged = [
            (p.grad, cast_tensor(p.grad.data, p.dtype))
            for p in self.params
            if p.grad is not None and p.grad.dtype != p.dtype
        ]
        self._backup = []
        for grad, new in staged:
            self._backup.append((grad, grad.data))
            grad.data = new

    def revert(self) -> None:
        for grad, old in reversed(self._backup):
            grad.data = old
        self._backup = []


class CastStateEntries(Change):
    """Replace optimizer state tensors by copies in another dtype; undo puts the originals back."""

    def __init__(self, entries: list[tuple[dict, Any, torch.dtype]], label: str) -> None:
        self.entries = entries
        self.description = f"cast {len(entries)} {label}"
        self._backup: list[tuple[dict, Any, torch.Tensor]] = []

    @property
    def in_place(self) -> bool:
        return all(isinstance(st.get(key), torch.Tensor) and st[key].dtype == dtype for st, key, dtype in self.entries)

    def apply(self) -> None:
        staged = [(st, key, st[key], cast_tensor(st[key], dtype)) for st, key, dtype in self.entries]
        self._backup = []
        for st, key, old, new in staged:
            self._backup.append((st, key, old))
            st[key] = new

    def revert(self) -> None:
        for st, key, old in reversed(self._backup):
            st[key] = old
        self._backup = []


class ReplaceData(Change):
    """Give ``tensor`` the values of ``values`` through ``tensor.data``: the same Python object (the user's names
    still bound to it), its version counter untouched; undo gives it back its very storage. ``values`` is
    allocated before the step is made, so nothing is written before the failure point."""

    def __init__(self, tensor: torch.Tensor, values: torch.Tensor, label: str) -> None:
        self.tensor, self.values = tensor, values
        self._old: torch.Tensor | None = None
        self.description = label

    @property
    def in_place(self) -> bool:
        held = self.tensor.data
        return (held.dtype == self.values.dtype and held.shape == self.values.shape
                and bool(torch.equal(held, self.values)))  # fmt: skip

    def apply(self) -> None:
        self._old = self.tensor.data
        self.tensor.data = self.values

    def revert(self) -> None:
        if self._old is not None:
            self.tensor.data = self._old


class SetItem(Change):
    """Set a key of a plain dict; undo restores the old value or its absence."""

    def __init__(self, d: dict, key: Any, value: Any, label: str) -> None:
        self.d, self.key, self.value = d, key, value
        self.description = f"{label} = {value!r}"
        self._had = False
        self._old: Any = None

    @property
    def in_place(self) -> bool:
        return self.key in self.d and same_value(self.d[self.key], self.value)

    def apply(self) -> None:
        self._had = self.key in self.d
        self._old = self.d.get(self.key)
        self.d[self.key] = self.value

    def revert(self) -> None:
        if self._had:
            self.d[self.key] = self._old
        else:
            self.d.pop(self.key, None)


class Call(Change):
    """A change made by a function, undone by another (both given by the check)."""

    def __init__(self, do: Callable[[], Any], undo: Callable[[Any], None], description: str,
                 held: Callable[[], bool] | None = None) -> None:  # fmt: skip
        self._do, self._undo, self.description = do, undo, description
        #: Tells whether the state ``do`` makes is already there (None: it cannot be told).
        self._held = held
        self._token: Any = None

    @property
    def in_place(self) -> bool:
        return self._held is not None and bool(self._held())

    def apply(self) -> None:
        self._token = self._do()

    def revert(self) -> None:
        self._undo(self._token)


class ForwardPreHook(Change):
    """Register a forward pre-hook on a module; undo removes exactly that hook (its handle is recorded).

    ``marker`` names the hook's purpose: when a hook with the same marker is already registered on the
    module, applying does nothing (a second application never stacks a second hook).
    """

    def __init__(self, module: torch.nn.Module, hook: Callable[..., Any], marker: str, label: str) -> None:
        self.module, self.hook, self.marker = module, hook, marker
        self.description = label
        self._handle: Any = None

    @staticmethod
    def registered(module: torch.nn.Module, marker: str) -> bool:
        """True when a hook carrying ``marker`` is registered on ``module``."""
        hooks = getattr(module, "_forward_pre_hooks", {})
        return any(getattr(h, "_mpdoctor_marker", None) == marker for h in list(hooks.values()))

    @property
    def in_place(self) -> bool:
        return self.registered(self.module, self.marker)

    def apply(self) -> None:
        self._handle = None
        if self.registered(self.module, self.marker):
            return
        self.hook._mpdoctor_marker = self.marker  # type: ignore[attr-defined]
        self._handle = self.module.register_forward_pre_hook(self.hook, with_kwargs=True)

    def revert(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class MethodInputCast(Change):
    """Cast the floating arguments of ``obj.<method>(...)`` before each call; undo removes exactly that wrapper.

    A forward pre-hook runs only for ``module(x)``; the user who calls ``vae.decode(z)`` or
    ``model.generate(...)`` goes around it. The wrapper is an attribute of the instance (its class and every
    other instance are untouched) over the bound method found when the fix is applied. ``cast`` maps
    ``(args, kwargs)`` to the cast ``(args, kwargs)``. ``marker`` names the wrapper's purpose: a second
    application onto an already wrapped method does nothing.
    """

    def __init__(self, obj: Any, method: str, cast: Callable[[tuple, dict], tuple[tuple, dict]], marker: str,
                 label: str, context: Callable[[], Any] | None = None,
                 restore: Callable[[Any, tuple, dict], Any] | None = None) -> None:  # fmt: skip
        self.obj, self.method, self.cast, self.marker = obj, method, cast, marker
        #: A context each call runs in (autocast turned off inside a module kept in fp32), or None.
        self.context = context
        #: ``(result, args, kwargs) -> result`` given to the caller (outputs cast back to the inputs' dtype), or None.
        self.restore = restore
        self.description = label
        self._wrapper: Any = None
        self._had_own = False
        self._old: Any = _UNSET

    @staticmethod
    def registered(obj: Any, method: str, marker: str) -> bool:
        """True when ``obj``'s own ``method`` attribute is a wrapper carrying ``marker``."""
        try:
            own = object.__getattribute__(obj, "__dict__")
        except AttributeError:
            return False
        return getattr(own.get(method), "_mpdoctor_marker", None) == marker

    @property
    def in_place(self) -> bool:
        return self.registered(self.obj, self.method, self.marker)

    def apply(self) -> None:
        self._wrapper = None
        if self.registered(self.obj, self.method, self.marker):
            return
        own = object.__getattribute__(self.obj, "__dict__")
        bound = getattr(self.obj, self.method)  # the method as the user's call finds it now
        cast_floating_arguments = CastingCall(self.obj, bound, self.cast, self.context, self.restore, self.marker)
        self._had_own, self._old = self.method in own, own.get(self.method, _UNSET)
        own[self.method] = cast_floating_arguments  # the instance dict: no Module.__setattr__ bookkeeping
        self._wrapper = cast_floating_arguments

    def revert(self) -> None:
        if self._wrapper is None:
            return
        own = object.__getattribute__(self.obj, "__dict__")
        if own.get(self.method) is self._wrapper:
            if self._had_own:
                own[self.method] = self._old
            else:
                del own[self.method]
        self._wrapper = None


class CastingCall:
    """The wrapper :class:`MethodInputCast` puts on an instance: casts the arguments, runs the method found when
    the fix was applied (in ``context``), gives back ``restore``'s result.

    A copy of the instance (``copy.deepcopy(model)``: an EMA, a twin) gets a wrapper of its own over the copy's
    method, so the copy never calls into the original (a closure over the original's bound method would).
    """

    def __init__(self, owner: Any, inner: Callable[..., Any], cast: Callable[[tuple, dict], tuple[tuple, dict]],
                 context: Callable[[], Any] | None, restore: Callable[[Any, tuple, dict], Any] | None,
                 marker: str) -> None:  # fmt: skip
        self._owner, self._inner, self._cast, self._context, self._restore = owner, inner, cast, context, restore
        self._mpdoctor_marker = marker
        self.__wrapped__ = inner  # inspect.signature sees the method's

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # a fix's wrapper is not the user's code: IPython leaves it out of tracebacks
        with self._context() if self._context is not None else contextlib.nullcontext():
            cast_args, cast_kwargs = self._cast(args, kwargs)
            out = self._inner(*cast_args, **cast_kwargs)
        return self._restore(out, args, kwargs) if self._restore is not None else out

    def __deepcopy__(self, memo: dict) -> Any:
        owner = memo.get(id(self._owner))
        if owner is None:  # copied without its instance: it still serves that instance
            return self
        inner = self._inner
        if isinstance(inner, types.MethodType) and inner.__self__ is self._owner:
            inner = types.MethodType(inner.__func__, owner)  # the copy's own method
        else:
            inner = copy.deepcopy(inner, memo)
        twin = CastingCall(owner, inner, self._cast, self._context, self._restore, self._mpdoctor_marker)
        memo[id(self)] = twin
        return twin


class DropGrads(Change):
    """``p.grad = None`` on each parameter; undo gives each one back its very grad tensor.

    A fix that freezes parameters drops the gradients a step that raised left on them: an optimizer steps every
    parameter whose ``.grad`` is set, whatever its ``requires_grad``.
    """

    def __init__(self, params: Sequence[Any], label: str) -> None:
        self.params = list(params)
        self.description = f"{label}: .grad = None"
        self._old: list[tuple[Any, Any]] = []

    def apply(self) -> None:
        self._old = [(p, p.grad) for p in self.params if p.grad is not None]
        for p, _ in self._old:
            p.grad = None

    def revert(self) -> None:
        for p, grad in reversed(self._old):
            if grad.dtype == p.dtype:
                p.grad = grad
            else:  # torch refuses a grad of another dtype through .grad: match the data for the assignment only
                data = p.data
                p.data = torch.empty_like(grad)
                try:
                    p.grad = grad
                finally:
                    p.data = data
        self._old = []
