"""Read intent from the live objects: the parts of a model kept off its compute path on purpose, and what an EMA /
averaged copy loses in its storage dtype.

An island is evidence, never a guess from names: a submodule whose class is an averaging wrapper (torch's
``AveragedModel``, ema-pytorch's ``EMA``, timm's ``ModelEmaV2`` / ``ModelEmaV3``) or a torchmetrics ``Metric``, a frozen copy of a sibling (the same
parameter names and shapes in another dtype, ``requires_grad`` False: a hand-written EMA or teacher), or a
submodule whose forward hooks cast its input to its own dtype and its output back (a ReFT / pyvene intervention
kept in fp32 under a bf16 model: the hooks' source is read, never run). The harm of
a low-precision shadow is measured on its own tensors: one update toward the online model, exactly rounded to the
shadow's dtype, against the same update in fp32, on a copy (the live tensors are never written).
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ...facts.intent import Island, ShadowFacts
from ..live.introspect import anatomy, class_path, modules_of, named_modules, raw_attr

#: Averaging wrappers that are modules: ``class path -> shadow kind``.
AVERAGING_MODULES = {
    "torch.optim.swa_utils.AveragedModel": "averaged-model",
    "ema_pytorch.ema_pytorch.EMA": "ema-pytorch",
    "timm.utils.model_ema.ModelEmaV2": "timm",
    "timm.utils.model_ema.ModelEmaV3": "timm",
}
#: diffusers' EMA: not a module, its shadow is a list of tensors (``shadow_params``).
DIFFUSERS_EMA = "diffusers.training_utils.EMAModel"
METRIC = "torchmetrics.metric.Metric"
LOW = frozenset({"bfloat16", "float16"})
#: Elements measured per tensor: enough for a share, cheap on a 7B model.
_SAMPLE = 1 << 16


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


# ---------------------------------------------------------------------------------------------
# islands
# ---------------------------------------------------------------------------------------------


def read_islands(model: torch.nn.Module) -> tuple[Island, ...]:
    """The submodules of ``model`` kept off its compute path on purpose, each with its evidence."""
    islands: list[Island] = []
    for path, mod in modules_of(model, AVERAGING_MODULES):
        islands.append(Island(path, "averaged-copy", f"{class_path(type(mod))}: an averaged copy, updated from the weights between steps", _ids(mod)))
    for path, mod in modules_of(model, (METRIC,)):
        islands.append(Island(path, "metric", f"{class_path(type(mod))}: a torchmetrics metric, run by update() outside the forward", _ids(mod)))
    covered = [i.path for i in islands]
    for island in _frozen_copies(model):
        if not any(_under(island.path, c) for c in covered):
            islands.append(island)
    islands.extend(_kept_in_fp32(model))
    covered = [i.path for i in islands]
    islands.extend(i for i in _hook_islands(model) if not any(_under(i.path, c) for c in covered))
    return tuple(islands)


#: A cast in source: ``.float()`` / ``.half()`` / ``.bfloat16()`` / ``.double()``, ``.to(torch.X)``,
#: ``.to(dtype=torch.X)``, ``.type(torch.X)``, ``.to(<expr>.dtype)`` and ``.type_as(<expr>)`` (the last two: to a
#: dtype read at run time, named ``"dynamic"``).
_CAST = re.compile(
    r"\.(float|half|bfloat16|double)\(\s*\)"
    r"|\.(?:to|type)\(\s*(?:dtype\s*=\s*)?torch\.(float32|float|bfloat16|float16|half|float64|double)\s*[,)]"
    r"|\.(?:to\(\s*(?:dtype\s*=\s*)?[\w.\[\]]+\.dtype\s*[,)]|type_as\()"
)
_CAST_NAMES = {"float": "float32", "half": "float16", "double": "float64"}


def _hook_source(fn: Any) -> str:
    """The source of a hook (a function, a lambda's line, a partial's function, a callable object's ``__call__``);
    ``""`` when no file holds it. Read from the file: the hook is never called."""
    if isinstance(fn, functools.partial):
        fn = fn.func
    if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        fn = type(fn).__dict__.get("__call__")  # a callable object: its class's method holds the source
    try:
        return inspect.getsource(fn) if fn is not None else ""
    except (OSError, TypeError):
        return ""


def cast_targets(source: str) -> frozenset[str]:
    """The dtypes a piece of source casts tensors to (``"dynamic"`` for a dtype read at run time)."""
    out = set()
    for m in _CAST.finditer(source):
        name = m.group(1) or m.group(2)
        out.add(_CAST_NAMES.get(name, name).replace("torch.", "") if name else "dynamic")
    return frozenset(out)


def _hook_islands(model: torch.nn.Module) -> list[Island]:
    """Submodules of one floating dtype whose forward pre-hook casts the input to that dtype and whose forward hook
    casts the output to another (or back to the input's): the cast around them is written out, so they are islands."""
    out: list[Island] = []
    for path, mod in anatomy(model).hooked:  # the modules with hooks on both sides, found in the shared walk
        hooks = mod.__dict__
        pre, post = hooks.get("_forward_pre_hooks"), hooks.get("_forward_hooks")
        if not pre or not post:
            continue
        dtypes = _floating_dtypes(mod)
        if len(dtypes) != 1:
            continue
        (own,) = dtypes
        into = frozenset().union(*(cast_targets(_hook_source(h)) for h in pre.values()))
        back = frozenset().union(*(cast_targets(_hook_source(h)) for h in post.values()))
        if (own in into or "dynamic" in into) and (back - {own}):
            evidence = (
                f"its forward pre-hook casts its input to {own if own in into else 'its dtype'} and its forward hook "
                f"casts its output to {'/'.join(sorted(back - {own}))}: a {own} island cast around on purpose"
            )
            out.append(Island(path, "cast-island", evidence, _ids(mod)))
    return out


def _kept_in_fp32(model: torch.nn.Module) -> list[Island]:
    """fp32 parameters the class's ``_keep_in_fp32_modules`` names (a module or a parameter such as Wan's
    ``scale_shift_table``): the library loads them in fp32 under a bf16 ``from_pretrained`` and casts around them."""
    keep: list[str] = []
    for key in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        value = raw_attr(model, key, None)
        if isinstance(value, (list, tuple, set)):
            keep.extend(str(k) for k in value)
    if not keep:
        return []
    owner = class_path(type(model))
    out = []
    for name, p in model.named_parameters():
        parts = name.split(".")
        hit = next((k for k in keep if k in parts), None)
        if hit is not None and p.dtype == torch.float32:
            out.append(Island(name, "kept-in-fp32", f"{owner}._keep_in_fp32_modules names {hit!r}", frozenset({id(p)})))
    return out


def _ids(mod: torch.nn.Module) -> frozenset[int]:
    return frozenset(id(p) for p in mod.parameters())


def _under(path: str, prefix: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def _signature(mod: torch.nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((n, tuple(p.shape)) for n, p in mod.named_parameters())


def _floating_dtypes(mod: torch.nn.Module) -> frozenset[str]:
    return frozenset(_dtype_name(p) for p in mod.parameters() if p.is_floating_point())


def _frozen_copies(model: torch.nn.Module) -> list[Island]:
    """Children (of the root and of its children) that are frozen copies of a sibling in another dtype."""
    out: list[Island] = []
    for ppath, parent in [("", model), *model.named_children()]:
        children = [(f"{ppath}.{n}" if ppath else n, c) for n, c in parent.named_children()]
        frozen = [(path, c) for path, c in children if _frozen(c) and not _called_by(parent, path.rsplit(".", 1)[-1])]
        if not frozen:  # the usual case: no sibling signature is computed at all
            continue
        signatures = {path: _signature(c) for path, c in children}
        out.extend(island for island in (_copy_of_a_sibling(path, child, children, signatures) for path, child in frozen) if island)
    return out


def _called_by(parent: torch.nn.Module, name: str) -> bool:
    """Whether ``parent``'s forward runs its child ``name``: a container's children are its forward path, and a
    forward that reads ``self.<name>`` (or walks its children) calls it. A frozen copy on that path is not an
    island: the forward meets its dtype (it raises, or casts). Read from the source, never run; a source that
    cannot be read says no."""
    if isinstance(parent, (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)):
        return True
    names = _forward_names(type(parent))
    return name in names or bool(names & _ALL_CHILDREN)


#: What a forward reads on ``self`` to run every child.
_ALL_CHILDREN = frozenset({"children", "named_children", "modules", "named_modules", "_modules"})


@functools.lru_cache(maxsize=256)
def _forward_names(cls: type) -> frozenset[str]:
    """The attribute names a class's forward reads on its first argument (``self.head``, ``getattr(self, "head")``),
    following the class's own methods it calls (``self._run(x)``), a few deep."""
    names: set[str] = set()
    pending, seen = ["forward"], set()
    while pending and len(seen) < 16:
        method = pending.pop()
        seen.add(method)
        read = _method_names(cls, method)
        names |= read
        pending.extend(n for n in read if n not in seen and callable(getattr(cls, n, None)))
    return frozenset(names)


def _method_names(cls: type, method: str) -> set[str]:
    """The attribute names one method of ``cls`` reads on its first argument, from its source (empty when the
    source cannot be read, or the method is torch's own)."""
    fn = getattr(cls, method, None)
    if fn is None or getattr(fn, "__module__", "").startswith("torch.nn"):
        return set()
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return set()
    node = tree.body[0] if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    if node is None or not node.args.args:
        return set()
    me = node.args.args[0].arg
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == me} | {n.args[1].value for n in ast.walk(node) if _getattr_of(n, me)}  # fmt: skip


def _getattr_of(node: ast.AST, me: str) -> bool:
    """``getattr(<me>, "<name>")``."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id == me
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str))  # fmt: skip


def _frozen(mod: torch.nn.Module) -> bool:
    """Whether ``mod`` holds parameters and none of them trains (``mod.parameters()`` read as torch reads it).

    The tree is read through each module's own ``_parameters`` and ``_modules`` and stops at the first trainable
    parameter: a trainable child (the usual answer) costs a few reads, not a walk of its tree. A module whose class
    changes how torch lists parameters is asked ``parameters()`` itself, as before.
    """
    found = False
    pending, seen = [mod], set()
    while pending:
        m = pending.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if not _lists_parameters_as_torch(type(m)):
            params = list(mod.parameters())
            return bool(params) and not any(p.requires_grad for p in params)
        for p in m._parameters.values():
            if p is not None:
                if p.requires_grad:
                    return False
                found = True
        pending.extend(c for c in reversed(m._modules.values()) if c is not None)
    return found


_MODULE = torch.nn.Module


@functools.lru_cache(maxsize=256)
def _lists_parameters_as_torch(cls: type) -> bool:
    """``cls`` lists its parameters and submodules with ``nn.Module``'s own methods, from its own dicts."""
    names = ("parameters", "named_parameters", "_named_members", "named_modules", "__getattribute__")
    return all(getattr(cls, n, None) is getattr(_MODULE, n) for n in names)


def _copy_of_a_sibling(path: str, child: torch.nn.Module, siblings: list[tuple[str, torch.nn.Module]], signatures: dict) -> Island | None:
    """``child`` (frozen) as a shadow copy: a sibling has the same parameter names and shapes in another dtype."""
    dtypes = _floating_dtypes(child)
    for other_path, other in siblings:
        if other_path != path and signatures[other_path] == signatures[path] and _floating_dtypes(other) != dtypes:
            n = sum(1 for _ in child.parameters())
            evidence = (
                f"a frozen copy of {other_path} (the same {n} parameters, {'/'.join(sorted(dtypes))} beside "
                f"{'/'.join(sorted(_floating_dtypes(other)))}, requires_grad False)"
            )
            return Island(path, "shadow-copy", evidence, frozenset(id(p) for p in child.parameters()))
    return None


# ---------------------------------------------------------------------------------------------
# shadows
# ---------------------------------------------------------------------------------------------


def shadow_kind(obj: Any) -> str | None:
    """The shadow kind of an averaging object (``averaged-model``, ``ema-pytorch``, ``timm``, ``ema-model``), or None."""
    path = class_path(type(obj))
    if path == DIFFUSERS_EMA:
        return "ema-model"
    return AVERAGING_MODULES.get(path)


def shadow_tensors(obj: Any, kind: str) -> list[torch.Tensor]:
    """The floating tensors an averaging object averages into (its shadow), in parameter order."""
    if kind == "hand-written":  # a model the user's code averages into (its parameters), or a dict of tensors
        if isinstance(obj, dict):
            return [t for t in obj.values() if torch.is_tensor(t) and t.is_floating_point()]
        return [p for p in obj.parameters() if p.is_floating_point()] if isinstance(obj, torch.nn.Module) else []
    if kind == "ema-model":
        return [t for t in (raw_attr(obj, "shadow_params", None) or ()) if torch.is_tensor(t) and t.is_floating_point()]
    copy = _copy_module(obj, kind)
    return [p for p in copy.parameters() if p.is_floating_point()] if copy is not None else []


def _copy_module(obj: Any, kind: str) -> torch.nn.Module | None:
    """The averaged module inside a wrapper: ``AveragedModel.module``, timm's ``ModelEmaV3.module``, ``EMA.ema_model``."""
    modules = raw_attr(obj, "_modules", None) or {}
    return modules.get("ema_model" if kind == "ema-pytorch" else "module")


def shadow_path(name: str, kind: str) -> str:
    """What the user types to reach the shadow tensors."""
    if kind == "hand-written":
        return name
    return f"{name}.{ {'averaged-model': 'module', 'timm': 'module', 'ema-pytorch': 'ema_model', 'ema-model': 'shadow_params'}[kind]}"


def closure_decay(fn: Any, depth: int = 0) -> float | None:
    """The ``decay`` a closure (``get_ema_multi_avg_fn(decay)``) captured, through decorators."""
    if fn is None or depth > 4:
        return None
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    if code is not None:
        for var, cell in zip(code.co_freevars, cells):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if var == "decay" and isinstance(value, (int, float)):
                return float(value)
            if callable(value):
                found = closure_decay(value, depth + 1)
                if found is not None:
                    return found
    return closure_decay(getattr(fn, "__wrapped__", None), depth + 1)


def shadow_decay(obj: Any, kind: str) -> float | None:
    """The decay of the next update: the warm-up schedule's value where the library has one (diffusers'
    ``get_decay``, ema-pytorch's ``get_current_decay``), the steady decay while warm-up still copies (decay 0)."""
    if kind == "timm":  # the steady decay (its warm-up schedule needs the step the user passes to update())
        value = raw_attr(obj, "decay", None)
        return float(value) if isinstance(value, (int, float)) else None
    if kind in ("ema-model", "ema-pytorch"):
        steady = raw_attr(obj, "decay" if kind == "ema-model" else "beta", None)
        current = _current_decay(obj, kind)
        value = current if current else steady
        return float(value) if isinstance(value, (int, float)) else None
    fn = raw_attr(obj, "multi_avg_fn", None) or raw_attr(obj, "avg_fn", None)
    if fn is not None:
        return closure_decay(fn)
    n = (raw_attr(obj, "_buffers", None) or {}).get("n_averaged")
    return float(n.item()) / (float(n.item()) + 1.0) if torch.is_tensor(n) else None  # SWA: an equal average


def _current_decay(obj: Any, kind: str) -> float | None:
    """The library's own schedule (pure arithmetic on its step counter), or None when it cannot be read."""
    try:
        if kind == "ema-model":
            return float(obj.get_decay(int(raw_attr(obj, "optimization_step", 0)) + 1))
        return float(obj.get_current_decay())
    except Exception:
        return None


def stochastic_rounding(obj: Any, kind: str) -> bool:
    """The library rounds each update of a bf16 shadow stochastically (timm's ``ModelEmaV3``, on by default from
    timm 1.0.26): an update below bf16's resolution still registers, in expectation."""
    return kind == "timm" and raw_attr(obj, "stochastic_rounding", False) is True


def same_dtype_update(obj: Any, kind: str) -> bool:
    """The library's update takes one dtype on both sides (it raises for an fp32 shadow of a bf16 model)."""
    if kind == "averaged-model":
        return raw_attr(obj, "multi_avg_fn", None) is not None  # torch._foreach_lerp_ on grouped tensors
    if kind == "ema-pytorch":
        return not bool(raw_attr(obj, "coerce_dtype", False))  # Tensor.lerp_ without coerce_dtype
    return False


def online_tensors(obj: Any, kind: str, candidates: Iterable[tuple[str, torch.nn.Module]], shadow: Sequence[torch.Tensor]) -> tuple[str | None, list[torch.Tensor]]:
    """The online model an averaging object follows, by the name the user types: ema-pytorch's own reference
    (``online_model``, a submodule or a one-item list), found among the candidates by identity; else the candidate
    whose floating parameters match the shadow's shapes in order."""
    candidates = list(candidates)
    if kind == "ema-pytorch":
        found = _ema_pytorch_online(obj, candidates)
        if found is not None:
            return found
    shapes = [tuple(t.shape) for t in shadow]
    own = {id(t) for t in shadow}
    for name, module in candidates:
        params = [p for p in module.parameters() if p.is_floating_point()]
        if [tuple(p.shape) for p in params] == shapes and not own & {id(p) for p in params}:
            return name, params
    return None, []


def _ema_pytorch_online(obj: Any, candidates: list[tuple[str, torch.nn.Module]]) -> tuple[str, list[torch.Tensor]] | None:
    """ema-pytorch's ``online_model`` (a submodule, or a one-item list with ``include_online_model=False``)."""
    online = raw_attr(obj, "online_model", None) or (raw_attr(obj, "_modules", None) or {}).get("online_model")
    online = online[0] if isinstance(online, list) and online else online
    if not isinstance(online, torch.nn.Module):
        return None
    name = next((n for n, m in candidates if m is online), None)  # the user's own name for it
    return name or "online_model", [p for p in online.parameters() if p.is_floating_point()]


def source_candidates(models: Iterable[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Module]]:
    """Models and their direct children, by the names the user types (a holder's ``net`` beside its ``ema``)."""
    out: list[tuple[str, torch.nn.Module]] = []
    for name, model in models:
        out.append((name, model))
        out.extend((f"{name}.{child}", mod) for child, mod in named_modules(model)[1:] if "." not in child)
    return out


def measure_update(shadow: Sequence[torch.Tensor], online: Sequence[torch.Tensor], decay: float) -> tuple[float | None, int]:
    """``(lost share, elements fp32 changes)`` of one update ``s + (1 - decay) * (p - s)`` on copies.

    The update is computed in fp32 and rounded once to each shadow tensor's dtype (the best any library's update
    can do in that dtype); an element is lost when fp32 changes it and the rounded result equals the old value.
    """
    changed = lost = 0
    with torch.no_grad():
        for s, p in zip(shadow, online):
            s32 = s.detach().reshape(-1)[:_SAMPLE].to(torch.float32)
            p32 = p.detach().reshape(-1)[:_SAMPLE].to(device=s32.device, dtype=torch.float32)
            new32 = s32 + (1.0 - decay) * (p32 - s32)
            moved = new32 != s32
            kept = new32.to(s.dtype).to(torch.float32) != s32
            changed += int(moved.sum())
            lost += int((moved & ~kept).sum())
    return (lost / changed if changed else None), changed


def min_gap(dtype: str, decay: float | None) -> float | None:
    """The least relative distance ``|p - s| / |s|`` at which an update of a ``dtype`` shadow can register:
    half an ulp (at least ``eps / 4`` of the weight) divided by ``1 - decay``."""
    if decay is None or decay >= 1.0 or dtype not in LOW | {"float32"}:
        return None
    eps = torch.finfo(getattr(torch, dtype)).eps
    return eps / 4 / (1.0 - decay)


def read_shadow(
    name: str, obj: Any, kind: str, candidates: Callable[[], list[tuple[str, torch.nn.Module]]], aliases: dict[str, str] | None = None
) -> ShadowFacts | None:
    """The facts of one averaging object; ``candidates`` yields the models it may follow (read only when needed),
    ``aliases`` the user's own names of paths inside them (``{"ema.online_model": "net"}``)."""
    shadow = shadow_tensors(obj, kind)
    if not shadow:
        return None
    dtypes = tuple(sorted({_dtype_name(t) for t in shadow}))
    low = sum(t.numel() for t in shadow if _dtype_name(t) in LOW)
    decay = shadow_decay(obj, kind)
    share, changed = None, 0
    source, online = online_tensors(obj, kind, candidates(), shadow)
    if low and decay is not None and online:
        share, changed = measure_update(shadow, online, decay)
    narrow = max(dtypes, key=lambda d: torch.finfo(getattr(torch, d)).eps)  # the coarsest shadow dtype
    return ShadowFacts(
        name=name,
        ref=id(obj),
        kind=kind,
        class_path=class_path(type(obj)),
        shadow_path=shadow_path(name, kind),
        shadow_dtypes=dtypes,
        shadow_elements=sum(t.numel() for t in shadow),
        low_elements=low,
        decay=decay,
        same_dtype_update=same_dtype_update(obj, kind),
        coerce_dtype=bool(raw_attr(obj, "coerce_dtype", False)) if kind == "ema-pytorch" else None,
        stochastic_rounding=stochastic_rounding(obj, kind),
        source=source,
        source_name=(aliases or {}).get(source, source) if source else None,
        source_dtypes=tuple(sorted({_dtype_name(p) for p in online})),
        lost_share=share,
        changed_in_fp32=changed,
        min_gap=min_gap(narrow, decay),
    )


def _paired(obj: Any, online: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The shadow tensors and the online parameters they follow, in one order (a dict is paired by name)."""
    if isinstance(obj, dict):  # the dict's own order is the user's
        pairs = [(obj[n], p) for n, p in online.named_parameters() if torch.is_tensor(obj.get(n)) and p.is_floating_point()]
        if len(pairs) != len(shadow_tensors(obj, "hand-written")):
            return [], []
        return [s for s, _ in pairs], [p for _, p in pairs]
    return shadow_tensors(obj, "hand-written"), [p for p in online.parameters() if p.is_floating_point()]


def read_hand_written(name: str, obj: Any, online_name: str, online: torch.nn.Module, update: Any) -> ShadowFacts | None:
    """The facts of a model (or a dict of tensors keyed by parameter name) the user's code averages into
    (``update``: an :class:`~mpdoctor.objects.readers.ema_code.EmaUpdate`), when it is a copy of ``online``."""
    shadow, params = _paired(obj, online)
    if not shadow or [tuple(t.shape) for t in shadow] != [tuple(p.shape) for p in params]:
        return None
    dtypes = tuple(sorted({_dtype_name(t) for t in shadow}))
    low = sum(t.numel() for t in shadow if _dtype_name(t) in LOW)
    decay = update.decay if update.decay is not None and 0.0 < update.decay < 1.0 else None
    share, changed = measure_update(shadow, params, decay) if low and decay is not None else (None, 0)
    narrow = max(dtypes, key=lambda d: torch.finfo(getattr(torch, d)).eps)
    return ShadowFacts(
        name=name, ref=id(obj), kind="hand-written", class_path=class_path(type(obj)), shadow_path=name,
        shadow_dtypes=dtypes, shadow_elements=sum(t.numel() for t in shadow), low_elements=low, decay=decay,
        source=online_name, source_name=online_name, source_dtypes=tuple(sorted({_dtype_name(p) for p in params})),
        lost_share=share, changed_in_fp32=changed, min_gap=min_gap(narrow, decay),
        update_line=update.line, update_where=update.where, update_op=update.op, update_fixed=update.fixed,
        same_dtype_update=update.op == "lerp_",  # Tensor.lerp_ takes one dtype: an fp32 shadow of a bf16 model raises
    )  # fmt: skip
