"""The objects of a traceback's frames, read without running user code.

Frame locals are plain mappings handed to :func:`mpdoctor.diagnose` as a
namespace, so the existing discovery classifies them (by MRO read through
``type``'s descriptors, never ``isinstance`` or ``getattr`` on user objects).
Only user frames are read: the frames of torch, transformers, accelerate and
the other libraries below hold the user's objects under other names
(``self``, ``module``) and would list every submodule as a subject.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

from ...compat import MODULE_DICTS, code_qualname
from ...objects.live.introspect import class_path

#: At most this many frames are read, innermost first.
MAX_FRAMES = 50

#: Top-level packages whose frames are library code, not the user's.
LIBRARY_PACKAGES = frozenset(
    {
        "torch", "transformers", "accelerate", "peft", "trl", "diffusers", "lightning", "pytorch_lightning",
        "deepspeed", "bitsandbytes", "torchao", "adamw_bf16", "IPython", "ipykernel", "traitlets", "tornado", "asyncio",
        "runpy", "importlib", "contextlib", "functools", "threading", "concurrent", "mpdoctor", "pytest",
        "_pytest", "pluggy", "unittest",
    }
)  # fmt: skip

# ``type``'s own descriptors: reading them never runs a metaclass's attribute hooks.
_TYPE_MRO = type.__dict__["__mro__"].__get__
_TYPE_QUALNAME = type.__dict__["__qualname__"].__get__


@dataclass(frozen=True)
class FrameView:
    """One frame of a traceback.

    Attributes
    ----------
    function : str
        The code object's name (``forward``, ``<module>``).
    module : str
        ``__name__`` of the frame's globals (``"?"`` when unreadable).
    filename : str
    lineno : int
    user : bool
        False for frames of :data:`LIBRARY_PACKAGES`.
    frame : FrameType
    """

    function: str
    module: str
    filename: str
    lineno: int
    user: bool
    frame: FrameType


def traceback_frames(tb: TracebackType | None, limit: int = MAX_FRAMES) -> list[FrameView]:
    """The frames of ``tb``, outermost first, at most the innermost ``limit``."""
    views: list[FrameView] = []
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        module = _module_name(frame)
        top = module.split(".", 1)[0]
        views.append(FrameView(code.co_name, module, code.co_filename, tb.tb_lineno, top not in LIBRARY_PACKAGES, frame))
        tb = tb.tb_next
    return views[-limit:]


def _module_name(frame: FrameType) -> str:
    name = dict.get(frame.f_globals, "__name__") if type(frame.f_globals) is dict else None
    return name if type(name) is str else "?"


#: IPython's own bindings in a notebook namespace besides the ``_``-prefixed ones (``_``, ``__``, ``_5``, ``_i``):
#: output and input histories and the shell's helpers. They never name a user's object.
_SHELL_BINDINGS = frozenset({"In", "Out", "exit", "quit", "get_ipython"})


def is_shell_name(name: str) -> bool:
    """Whether ``name`` is one IPython binds (``_``, ``__``, ``___``, ``_5``, ``Out``, ...) or a private one: a
    patient is never called by it (an output variable that happens to hold a submodule is not the user's name)."""
    return name.startswith("_") or name in _SHELL_BINDINGS


def frame_namespace(frames: list[FrameView], namespace: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One namespace of the user's objects: ``namespace`` first, then user frames, innermost first.

    An object already named keeps its first name (discovery reports each
    object once); a local whose name another object took is qualified with
    its function (``train.model``). Names starting with ``_`` and IPython's own
    (``Out``, ``In``) are skipped, as discovery does.
    """
    merged = _user_bindings(namespace)
    kept = _module_frame_locals(frames)
    for index in reversed(range(len(frames))):
        view = frames[index]
        if not view.user or kept[index] == "none":
            continue
        try:
            if namespace is not None and view.frame.f_locals is namespace:
                continue  # an IPython cell's frame: its locals are the namespace already read
            local_items = _locals(view.frame)
        except Exception:
            continue
        if kept[index] == "arguments":
            code = view.frame.f_code
            arguments = set(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount])
            local_items = [(k, v) for k, v in local_items if k in arguments]
        for name, value in local_items:
            if type(name) is not str or is_shell_name(name):
                continue
            if name not in merged:
                merged[name] = value
            elif merged[name] is not value:
                merged.setdefault(f"{view.function}.{name}", value)
    return merged


def _user_bindings(namespace: Mapping[str, Any] | None) -> dict[str, Any]:
    """The namespace's names of the user's own (IPython's bindings left out), read without running its code."""
    if namespace is None:
        return {}
    try:
        items = list(dict.items(namespace)) if dict in _TYPE_MRO(type(namespace)) else list(namespace.items())
    except Exception:
        return {}
    return {name: value for name, value in items if type(name) is str and not is_shell_name(name)}


def _module_frame_locals(frames: list[FrameView]) -> list[str]:
    """Per frame, which locals are the user's objects: ``"all"``, ``"arguments"`` or ``"none"``.

    Inside a torch module's ``forward`` the locals are activations, not the user's batch: the outermost module
    frame keeps only its arguments (the batch the user passed, ``model(x)``), the module frames inside it keep
    nothing (an fp32 activation fed to a bf16 layer is ``mixed-param-dtypes``, not a batch entry).
    """
    kept: list[str] = []
    inside = False
    for view in frames:  # outermost first
        try:
            module = next((v for k, v in _locals(view.frame) if k == "self"), None)
        except Exception:
            module = None
        if module is None or view.function in _CALL_MACHINERY or not _holds_torch_module_class(type(module)):
            kept.append("all")
            continue
        kept.append("none" if inside else "arguments")
        inside = True
    return kept


def _locals(frame: FrameType) -> list[tuple[Any, Any]]:
    # f_locals is a dict (a snapshot) before Python 3.13 and a FrameLocalsProxy after: neither runs user code.
    local_map = frame.f_locals
    if type(local_map) is dict:
        return list(dict.items(local_map))
    return list(local_map.items())


def tensor_locals(frames: list[FrameView], frames_read: int = 3, limit: int = 8) -> list[str]:
    """``"Linear.forward: input float32[2, 4]"`` lines for the plain tensors and parameters of the innermost frames.

    Only exact ``torch.Tensor`` / ``torch.nn.Parameter`` instances are read
    (their dtype and shape are torch's own descriptors), and the direct
    parameters of modules whose class is one of torch's own (``torch.nn.*``).
    """
    import torch

    out: list[str] = []
    for view in reversed(frames[-frames_read:]):
        try:
            items = _locals(view.frame)
        except Exception:
            continue
        where = _qualname(view)
        for name, value in items:
            if type(name) is not str or name.startswith("__"):
                continue
            cls = type(value)
            if cls is torch.Tensor or cls is torch.nn.Parameter:
                out.append(f"{where}: {name} {_tensor_text(value)}")
            elif _is_torch_module(cls):
                params = object.__getattribute__(value, "_parameters")
                if type(params) in MODULE_DICTS:
                    for pname, p in list(dict.items(params))[:4]:
                        if type(p) is torch.nn.Parameter:
                            out.append(f"{where}: {name}.{pname} {_tensor_text(p)}")
            if len(out) >= limit:
                return out
    return out


def _qualname(view: FrameView) -> str:
    return code_qualname(view.frame)


def _is_torch_module(cls: type) -> bool:
    # torch's own module classes only: a user subclass may override attribute access.
    return class_path(cls).startswith("torch.nn.modules.") and any(
        class_path(c) == "torch.nn.modules.module.Module" for c in _TYPE_MRO(cls)
    )


def _tensor_text(t: Any) -> str:
    dtype = str(t.dtype).replace("torch.", "")
    shape = ", ".join(str(d) for d in t.shape)
    return f"{dtype}[{shape}]"


@dataclass(frozen=True)
class Raiser:
    """An object whose method is on the failing stack: ``self`` of a frame (``scaler16`` in ``GradScaler.unscale_``).

    Attributes
    ----------
    obj : Any
        The object (``self`` of the frame).
    where : str
        The frame's qualified function name (``GradScaler.unscale_``).
    """

    obj: Any
    where: str


def raising_objects(frames: list[FrameView]) -> list[Raiser]:
    """The ``self`` of every frame, innermost first, each object once: the objects that raised.

    Library frames count too: the frame that raised is usually the library method called on the user's
    object (``scaler16.unscale_(opt)`` raises inside ``GradScaler.unscale_``, whose ``self`` is ``scaler16``).
    ``self`` is read from the frame's locals, never through the object.
    """
    out: list[Raiser] = []
    seen: set[int] = set()
    for view in reversed(frames):
        try:
            items = _locals(view.frame)
        except Exception:
            continue
        value = next((v for k, v in items if k == "self"), None)
        if value is None or id(value) in seen:
            continue
        seen.add(id(value))
        out.append(Raiser(value, _qualname(view)))
    return out


#: Frames of torch's call machinery: ``module(x)`` passes through them on its way to ``forward``.
_CALL_MACHINERY = frozenset({"__call__", "_call_impl", "_wrapped_call_impl"})


def entry_points(frames: list[FrameView], model: Any) -> tuple[tuple[str, str], ...]:
    """The call the user made into ``model``: ``((submodule path, method),)``, or ``()`` when none is on the stack.

    It is the outermost frame whose ``self`` is ``model`` or one of its submodules and whose function is a
    method of that object's class: ``vae.decode(z)`` gives ``("", "decode")`` (diffusers' ``apply_forward_hook``
    wrapper and torch's ``no_grad`` decorator are passed over, they are not methods of the class),
    ``model.encoder(inputs_embeds=...)`` gives ``("encoder", "forward")``, ``model(x)`` gives ``("", "forward")``.
    ``self`` is read from the frames' locals; the module tree is walked once, through torch's own
    ``named_modules``.
    """
    try:
        paths = {id(m): path for path, m in model.named_modules()}
    except Exception:  # a model whose tree cannot be walked names no entry
        return ()
    for view in frames:
        try:
            obj = next((v for k, v in _locals(view.frame) if k == "self"), None)
        except Exception:
            continue
        if obj is None or id(obj) not in paths:
            continue
        name = view.function
        if name in _CALL_MACHINERY:
            continue
        if not any(name in c.__dict__ for c in _TYPE_MRO(type(obj))):
            continue  # a decorator's wrapper frame, not the method the user called
        return ((paths[id(obj)], name),)
    return ()


def component_call(frames: list[FrameView], namespace: Mapping[str, Any]) -> dict[str, Any]:
    """The module a user's object called on the user's behalf, with the tensors it was called with; ``{}``.

    ``pipe(...)`` raises inside ``pipe.vae.decode(latents)``: the user's namespace holds ``pipe``, not the VAE, and
    the latents live in the pipeline's frame. This returns ``{"vae": pipe.vae, "z": latents, ...}``: the
    outermost frame whose ``self`` is a torch module held as an attribute (or component) of a non-module object of
    the namespace, named by that attribute, and that frame's tensor locals. Names the namespace already binds to
    other objects are left out.
    """
    values = list(dict.values(dict(namespace)))
    holders = [v for v in values if not _holds_torch_module_class(type(v))]
    own = {id(v) for v in values}
    for view in frames:
        items, module = _module_frame(view)
        if module is not None and id(module) in own:
            continue  # the user called this module directly: its frame's tensors are the library's, not a component's
        name = _attribute_name(holders, module) if module is not None else None
        if name is None:
            continue
        found = {name: module}
        found.update({k: v for k, v in items if type(k) is str and k.isidentifier() and k != "self"
                      and class_path(type(v)) in ("torch.Tensor", "torch.nn.parameter.Parameter")})  # fmt: skip
        return {k: v for k, v in found.items() if k not in namespace or namespace[k] is v}
    return {}


def _module_frame(view: FrameView) -> tuple[list[tuple[Any, Any]], Any]:
    """The frame's locals and its ``self`` when that is a torch module entered past torch's call machinery."""
    try:
        items = _locals(view.frame)
    except Exception:
        return [], None
    module = next((v for k, v in items if k == "self"), None)
    if module is None or view.function in _CALL_MACHINERY or not _holds_torch_module_class(type(module)):
        return items, None
    return items, module


def _attribute_name(holders: list[Any], module: Any) -> str | None:
    """The attribute name under which one of ``holders`` keeps ``module`` (``vae`` of a pipeline), or None."""
    return next((attr for h in holders for attr, v in _attributes(h) if v is module), None)


def _holds_torch_module_class(cls: type) -> bool:
    return any(class_path(c) == "torch.nn.modules.module.Module" for c in _TYPE_MRO(cls))


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    """``obj``'s own attributes, read from its ``__dict__`` (no ``__getattr__`` runs); none for a mapping-less object."""
    try:
        own = object.__getattribute__(obj, "__dict__")
    except Exception:
        return []
    return [(k, v) for k, v in list(dict.items(own)) if type(k) is str and k.isidentifier()] if type(own) is dict else []
