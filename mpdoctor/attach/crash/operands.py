"""The two tensors of a failing op, named as the user knows them, and the cast that fixes it.

A dtype error names dtypes, never tensors. The failing frames hold the
tensors: the locals of ``Linear.forward`` (``self``, ``input``), of
``F.layer_norm`` (``input``, ``weight``), or of the user's own line
(``x[idx] = y``). This module picks the two whose dtypes the message names,
gives each the name the user knows it by (``model.encoder.layer.0.dense.weight``
for a parameter, the local name in the innermost user frame that holds the
same tensor for an activation) and writes the cast with those names.

For protocol errors (GradScaler) it finds the user's loop line instead:
``train.py:42`` or, in a notebook, ``cell [7], line 3``.

Reading is safe: only tensors whose class is torch's own (or a torch /
torchao subclass) are read, through torch's own descriptors; modules are
walked with ``torch.nn.Module``'s own methods; no user code runs.
"""

from __future__ import annotations

import ast
import linecache
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...compat import GRAD_SCALER_MODULES, MODULE_DICTS
from ...facts.location import Location, python_path
from .catalogue import AMP_STATE, FP8_UPCAST, INDEX_LONG, MASK, TO_DESTINATION, TO_EXPECTED, TO_PARAMETER
from .frames import _TYPE_MRO, FrameView, _locals, _qualname, class_path

#: Frames read for operands, innermost first (the op's frame and its callers).
OPERAND_FRAMES = 6
#: Roots (models in the namespace and the user frames) searched for a parameter's module path.
MAX_ROOTS = 24
#: Modules walked per root when naming a parameter.
MAX_MODULES = 20_000

#: dtype spellings in torch's messages -> torch dtype names (``c10::BFloat16``, ``torch.cuda.HalfTensor``, ``long int``).
_DTYPE_WORDS = {
    "float8_e4m3fnuz": "float8_e4m3fnuz", "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2fnuz": "float8_e5m2fnuz",
    "float8_e5m2": "float8_e5m2", "bfloat16": "bfloat16", "half": "float16", "float16": "float16",
    "double": "float64", "float64": "float64", "float32": "float32", "float": "float32", "long int": "int64",
    "long": "int64", "int64": "int64", "int32": "int32", "int": "int32", "bool": "bool",
}  # fmt: skip
_DTYPE_RE = re.compile(
    r"(?<![a-z0-9_])(?:c10::|torch\.(?:cuda\.)?|CPU|CUDA)?"
    r"(Float8_e4m3fnuz|Float8_e4m3fn|Float8_e5m2fnuz|Float8_e5m2|float8_e4m3fn|float8_e5m2|BFloat16|bfloat16|Half|"
    r"float16|Double|double|float64|float32|Float|float|long int|Long|int64|int32|Int|int|Bool|bool)"
    r"(?:Tensor|Type)?(?![A-Za-z0-9_])"
)
_EXPECTED_FOUND = re.compile(r"expected[^,;]*?\b(\w+(?:::\w+)?)\s+but found\s+(\w+(?:::\w+)?)", re.IGNORECASE)
_FOUND_EXPECTED = re.compile(r"found dtype (\w+) but expected (\w+)", re.IGNORECASE)
_SPOKEN = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64", "int64": "int64"}
_FLOATING = ("float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
             "float8_e5m2fnuz")  # fmt: skip
_MASK_NAME = re.compile(r"mask", re.IGNORECASE)
_INDEX_NAME = re.compile(r"target|label|ids|index|indices|idx|class", re.IGNORECASE)


def spoken(dtype: str) -> str:
    """``bfloat16`` -> ``bf16``; float8 names stay whole."""
    return _SPOKEN.get(dtype, dtype)


def message_dtypes(message: str) -> list[str]:
    """The dtypes a torch message names, in order (``"got Float and BFloat16"`` -> ``["float32", "bfloat16"]``)."""
    text = re.sub(r"\bgot(?=[A-Z])", "got ", message)  # masked_scatter writes "gotFloat"
    text = text.replace("Float8 Types", "")  # the promotion message's preamble is not a dtype
    out = []
    for m in _DTYPE_RE.finditer(text):
        out.append(_DTYPE_WORDS[m.group(1).lower()])
    return out


def _winner_loser(message: str) -> tuple[str, str] | None:
    """(the dtype the op expects, the dtype it found) when the message says which is which."""
    m = _FOUND_EXPECTED.search(message)
    if m:
        found, expected = message_dtypes(m.group(1)), message_dtypes(m.group(2))
        if found and expected:
            return expected[0], found[0]
    m = _EXPECTED_FOUND.search(message)
    if m:
        expected, found = message_dtypes(m.group(1)), message_dtypes(m.group(2))
        if found and expected:
            return expected[0], found[0]
    return None


@dataclass(frozen=True)
class Operand:
    """One tensor of the failing op.

    Attributes
    ----------
    name : str
        The name the user knows it by (``model.0.weight``, ``hidden_states``), or the op's own local name.
    dtype : str
        torch dtype name (``bfloat16``).
    shape : tuple of int
    parameter : bool
        True for a module parameter.
    owner : str
        For a parameter: the module's path and class (``model.0 (Linear)``).
    user_named : bool
        True when the name comes from the user's namespace or code, not the library's frame.
    tensor, module, root : object or None
        For a parameter (or a buffer or tensor attribute the failing line read) whose module was found: the live
        tensor, the module that holds it and the user's model it lies in (an in-place cast of exactly that tensor,
        and of its twins, is then possible). Not compared, not shown.
    slot : str
        The name ``module`` holds the tensor under (``weight``, ``pe``, ``*`` in a ParameterDict).
    """

    name: str
    dtype: str
    shape: tuple
    parameter: bool = False
    owner: str = ""
    user_named: bool = True
    tensor: Any = field(default=None, compare=False, repr=False)
    module: Any = field(default=None, compare=False, repr=False)
    root: Any = field(default=None, compare=False, repr=False)
    slot: str = ""

    def describe(self) -> str:
        """``model.0.weight (bf16, parameter of model.0 Linear)`` / ``hidden_states (fp32, [2, 4])``."""
        shape = ", ".join(str(d) for d in self.shape)
        if self.parameter:
            return f"{self.name} ({spoken(self.dtype)}, parameter of {self.owner})"
        if not self.shape:  # an expression written on the user's line: no tensor to measure
            return f"{self.name} ({spoken(self.dtype)})"
        if self.owner:
            return f"{self.name} ({spoken(self.dtype)}, [{shape}], held by {self.owner})"
        return f"{self.name} ({spoken(self.dtype)}, [{shape}])"


@dataclass(frozen=True)
class Operands:
    """The two tensors of a failing op and the cast that fixes it.

    Attributes
    ----------
    cast : Operand
        The tensor to cast.
    keep : Operand or None
        The tensor whose dtype wins (None when the message names one tensor only, e.g. index targets).
    dtype : str
        The dtype ``cast`` must take.
    where : str
        The op's frame (``Linear.forward``).
    code : str
        The cast as code, with the user's names.
    """

    cast: Operand
    keep: Operand | None
    dtype: str
    where: str
    code: str

    def sentence(self) -> str:
        """``In Linear.forward: hidden_states (fp32, [2, 4]) met model.0.weight (bf16, parameter of ...).``"""
        if self.keep is None:
            return f"In {self.where}: {self.cast.describe()}."
        return f"In {self.where}: {self.cast.describe()} met {self.keep.describe()}."


@dataclass
class _Candidate:
    tensor: Any
    name: str
    dtype: str
    shape: tuple
    depth: int  # 0 = innermost frame
    parameter: bool
    module: Any = None
    param_name: str = ""
    user: bool = True
    in_line: bool = False
    slot: str = ""  # a buffer or tensor attribute: the name ``module`` holds it under


def _torch() -> Any:
    return sys.modules.get("torch")


def _is_tensor(torch: Any, value: Any) -> bool:
    cls = type(value)
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return True
    # torch's and torchao's tensor subclasses (float8 training tensors, MX / NVFP4 tensors) have a real dtype.
    path = class_path(cls)
    return (path.startswith(("torch.", "torchao.")) and torch.Tensor in _TYPE_MRO(cls))


def _dtype_name(torch: Any, t: Any) -> str | None:
    try:
        dtype = torch._C.TensorBase.dtype.__get__(t)
    except Exception:
        return None
    return str(dtype).replace("torch.", "")


def _shape(torch: Any, t: Any) -> tuple:
    try:
        return tuple(int(d) for d in torch._C.TensorBase.shape.__get__(t))
    except Exception:
        return ()


def _is_module(torch: Any, value: Any) -> bool:
    try:
        return torch.nn.Module in _TYPE_MRO(type(value))
    except Exception:
        return False


def _direct_parameters(value: Any) -> list[tuple[str, Any]]:
    from ...objects.live.introspect import own_dict

    params = own_dict(value).get("_parameters")
    return [(k, v) for k, v in dict.items(params) if v is not None] if type(params) in MODULE_DICTS else []


def _line_names(view: FrameView) -> set[str]:
    try:
        line = linecache.getline(view.filename, view.lineno)
    except Exception:
        return set()
    return set(re.findall(r"[A-Za-z_]\w*", line))


def _candidates(frames: list[FrameView], torch: Any) -> list[_Candidate]:
    """Every tensor the innermost frames hold, each once, innermost first."""
    out: list[_Candidate] = []
    seen: set[int] = set()
    for depth, view in enumerate(list(reversed(frames))[:OPERAND_FRAMES]):
        try:
            items = _locals(view.frame)
        except Exception:
            continue
        names_in_line = _line_names(view) if view.user else set()
        for name, value in items:
            if type(name) is str and not name.startswith("__"):
                out.extend(_local_candidates(torch, name, value, depth, view.user, name in names_in_line, seen))
        if view.user:
            out.extend(_line_reads(view, dict(items), torch, depth, seen))
    return out


#: Steps of an attribute chain read on a user's line: ``("attr", "pe")`` or ``("key", "*")``.
_Step = tuple[str, Any]


def _line_reads(view: FrameView, local: dict, torch: Any, depth: int, seen: set[int]) -> list[_Candidate]:
    """The tensors a user line reads through attribute chains from its locals (``self.pe[:, :n]``,
    ``self.table["*"]``): a module's parameter, buffer or tensor attribute, reached through the modules' own
    dicts and containers (no user code runs). An operand that is never a local is met this way."""
    try:
        tree = ast.parse(linecache.getline(view.filename, view.lineno).strip())
    except (SyntaxError, ValueError):
        return []
    out: list[_Candidate] = []
    for node in ast.walk(tree):
        chain = _chain(node) if isinstance(node, (ast.Attribute, ast.Subscript)) else None
        if chain is None or chain[0] not in local:
            continue
        found = _resolve(local[chain[0]], chain[1], torch)
        if found is None or id(found[0]) in seen:
            continue
        tensor, module, slot, parameter = found
        dtype = _dtype_name(torch, tensor)
        if dtype is None:
            continue
        seen.add(id(tensor))
        out.append(_Candidate(tensor, ast.unparse(node), dtype, _shape(torch, tensor), depth, parameter, module,
                              slot if parameter else "", user=True, in_line=True,
                              slot="" if parameter else slot))  # fmt: skip
    return out


def _chain(node: Any) -> tuple[str, list[_Step]] | None:
    """``self.a["k"].b`` -> ``("self", [("attr", "a"), ("key", "k"), ("attr", "b")])``; None for anything else
    (a call, a computed key)."""
    steps: list[_Step] = []
    while True:
        if isinstance(node, ast.Attribute):
            steps.append(("attr", node.attr))
            node = node.value
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                and type(node.slice.value) in (str, int):  # fmt: skip
            steps.append(("key", node.slice.value))
            node = node.value
        elif isinstance(node, ast.Name) and steps:
            return node.id, steps[::-1]
        else:
            return None


def _resolve(value: Any, steps: list[_Step], torch: Any) -> tuple[Any, Any, str, bool] | None:
    """``(tensor, module that holds it, its name there, is a parameter)`` at the end of ``steps`` from ``value``;
    None when a step leaves modules and plain containers, or the end is not a tensor held by a module."""
    from ...objects.live.introspect import own_dict

    holder, slot, parameter = None, "", False
    for kind, key in steps:
        holder, slot, parameter = None, "", False
        if _is_module(torch, value):
            own = own_dict(value)
            name = str(key)
            for table in ("_parameters", "_buffers", "_modules"):
                entries = own.get(table)
                if type(entries) in MODULE_DICTS and name in entries:
                    value, holder, slot, parameter = entries[name], value, name, table == "_parameters"
                    break
            else:
                if kind != "attr" or name not in own:
                    return None
                value, holder, slot = own[name], value, name
        elif kind == "key" and type(value) is dict and key in value:
            value = dict.__getitem__(value, key)
        elif kind == "key" and type(value) in (list, tuple) and type(key) is int and -len(value) <= key < len(value):
            value = value[key]
        else:
            return None
    if holder is None or value is None or not _is_tensor(torch, value):
        return None
    return value, holder, slot, parameter


def _local_candidates(torch: Any, name: str, value: Any, depth: int, user: bool, in_line: bool,
                      seen: set[int]) -> list[_Candidate]:  # fmt: skip
    """The tensors one local holds: itself, or near the failing op a module's direct parameters or a
    sequence's first items; a tensor in ``seen`` is left out and the others are added to it."""
    if _is_tensor(torch, value):
        held = [(name, value, type(value) is torch.nn.Parameter, None, "")]
    elif _is_module(torch, value) and depth < 3:
        held = [(f"{name}.{pname}", p, True, value, pname) for pname, p in _direct_parameters(value)[:8]]
    elif type(value) in (tuple, list) and depth < 3:
        held = [(f"{name}[{i}]", x, type(x) is torch.nn.Parameter, None, "") for i, x in enumerate(value[:8])]
    else:
        return []
    out: list[_Candidate] = []
    for label, tensor, parameter, module, pname in held:
        dtype = _dtype_name(torch, tensor) if id(tensor) not in seen and _is_tensor(torch, tensor) else None
        if dtype is None:
            continue
        seen.add(id(tensor))
        out.append(_Candidate(tensor, label, dtype, _shape(torch, tensor), depth, parameter, module, pname,
                              user=user, in_line=in_line))  # fmt: skip
    return out


def _roots(frames: list[FrameView], namespace: Mapping[str, Any] | None, torch: Any) -> list[tuple[str, Any]]:
    roots: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def add(name: Any, value: Any) -> None:
        if type(name) is str and not name.startswith("_") and id(value) not in seen and _is_module(torch, value):
            seen.add(id(value))
            roots.append((name, value))

    for name, value in (dict.items(namespace) if type(namespace) is dict else ()):
        add(name, value)
    for view in reversed(frames):
        if view.user:
            try:
                for name, value in _locals(view.frame):
                    if name != "self":
                        add(name, value)
            except Exception:
                continue
    return roots[:MAX_ROOTS]


def _tree(root: Any) -> Any:
    """``(path, module)`` of ``root``'s tree in ``named_modules()`` order, read from the instances' ``__dict__``."""
    from ...objects.live.introspect import own_dict

    stack: list[tuple[str, Any]] = [("", root)]
    seen: set[int] = set()
    while stack:
        path, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield path, module
        children = own_dict(module).get("_modules")
        if type(children) in MODULE_DICTS:
            items = [(k, v) for k, v in dict.items(children) if v is not None and type(k) is str]
            stack.extend((f"{path}.{k}" if path else k, v) for k, v in reversed(items))


def _walk(roots: list[tuple[str, Any]], torch: Any, what: str, target: Any) -> str | None:
    """The dotted path of ``target`` (a module or a parameter) under the root that holds it highest up."""
    from ...objects.live.introspect import own_dict

    best: tuple[int, int, int, str] | None = None
    for order, (root_name, root) in enumerate(roots):
        for i, (path, sub) in enumerate(_tree(root)):
            if i > MAX_MODULES:
                break
            found = path if sub is target else None
            if what == "parameter":
                params = own_dict(sub).get("_parameters")
                name = next((k for k, v in dict.items(params) if v is target), None) if type(params) in MODULE_DICTS else None
                found = (f"{path}.{name}" if path else name) if name is not None else None
            if found is not None:
                # The deepest path wins (the outermost model), then a plain root name, then the first root.
                candidate = (-(found.count(".") + (1 if found else 0)), root_name.count("."), order,
                             f"{root_name}.{found}" if found else root_name)  # fmt: skip
                best = candidate if best is None or candidate < best else best
                break
    return best[3] if best is not None else None


def _module_path(module: Any, roots: list[tuple[str, Any]], torch: Any) -> str | None:
    """``model.encoder.layer.0.dense`` for ``module`` inside one of ``roots`` (torch's own walk; no user code)."""
    return _walk(roots, torch, "module", module)


def _user_name(c: _Candidate, frames: list[FrameView], namespace: Mapping[str, Any] | None) -> str | None:
    """The innermost user frame's local (or the namespace's name) bound to the same tensor."""
    for view in reversed(frames):
        if not view.user:
            continue
        try:
            for name, value in _locals(view.frame):
                if value is c.tensor and type(name) is str and not name.startswith("_") and name != "self":
                    return name
        except Exception:
            continue
    for name, value in (dict.items(namespace) if type(namespace) is dict else ()):
        if value is c.tensor and type(name) is str and not name.startswith("_"):
            return name
    return _same_storage_name(c, frames)


def _same_storage_name(c: _Candidate, frames: list[FrameView]) -> str | None:
    """A user local viewing the same memory, dtype and size (a library reshaped or re-wrapped the tensor)."""
    torch = _torch()
    try:
        ptr = torch.Tensor.data_ptr(c.tensor)
    except Exception:
        return None
    for view in reversed(frames):
        if not view.user:
            continue
        try:
            items = _locals(view.frame)
        except Exception:
            continue
        for name, value in items:
            if type(value) is torch.Tensor and type(name) is str and not name.startswith("_"):
                try:
                    if (torch.Tensor.data_ptr(value) == ptr and _dtype_name(torch, value) == c.dtype
                            and torch.Tensor.numel(value) == torch.Tensor.numel(c.tensor)):  # fmt: skip
                        return name
                except Exception:
                    continue
    return None


def _operand(c: _Candidate, frames: list[FrameView], namespace: Mapping[str, Any] | None,
             roots: list[tuple[str, Any]], torch: Any) -> Operand:  # fmt: skip
    if c.parameter and c.module is not None:
        return _module_parameter(c, roots, torch)
    if c.parameter:
        path = _walk(roots, torch, "parameter", c.tensor)
        if path is not None:
            owner = path.rsplit(".", 1)[0] if "." in path else path
            return Operand(path, c.dtype, c.shape, True, owner, True)
        return Operand(_user_name(c, frames, namespace) or c.name, c.dtype, c.shape, True, "a module", c.user)
    if c.slot and c.module is not None:  # a buffer or tensor attribute the line read from a module
        path = _module_path(c.module, roots, torch)
        cls = class_path(type(c.module)).rsplit(".", 1)[-1]
        root = next((r for n, r in roots if path == n or path.startswith(n + ".")), None) if path else None
        return Operand(_held_name(path, c.slot) if path else c.name, c.dtype, c.shape, False,
                       f"{path or 'a module'} ({cls})", True, c.tensor, c.module, root, c.slot)  # fmt: skip
    name = _user_name(c, frames, namespace)
    return Operand(name or c.name, c.dtype, c.shape, False, "", name is not None or c.user)


def _module_parameter(c: _Candidate, roots: list[tuple[str, Any]], torch: Any) -> Operand:
    """A parameter the line read from a module: under its path when the module is in a root's tree."""
    path = _module_path(c.module, roots, torch)
    cls = class_path(type(c.module)).rsplit(".", 1)[-1]
    if path is None:
        return Operand(c.name, c.dtype, c.shape, True, f"a {cls}", c.user, c.tensor, c.module)
    root = next((r for n, r in roots if path == n or path.startswith(n + ".")), None)
    return Operand(_held_name(path, c.param_name), c.dtype, c.shape, True, f"{path} ({cls})", True, c.tensor,
                   c.module, root, c.param_name)  # fmt: skip


def _held_name(path: str, slot: str) -> str:
    """``model.0.weight``; a key that is not a name reads as one (``manager.table['*']`` in a ParameterDict)."""
    return f"{path}.{slot}" if slot.isidentifier() else f"{path}[{slot!r}]"


def _pick(cands: list[_Candidate], dtype: str, prefer_param: bool | None = None,
          name_re: re.Pattern | None = None) -> _Candidate | None:  # fmt: skip
    pool = [c for c in cands if c.dtype == dtype]
    if not pool:
        return None

    def key(c: _Candidate) -> tuple:
        return (
            0 if name_re is None or name_re.search(c.name) else 1,
            0 if prefer_param is None or c.parameter == prefer_param else 1,
            # The op's own frame holds its operands (``input`` and ``self.weight`` in Linear.forward): a tensor
            # of that dtype named on an outer line is only an ancestor of one of them.
            0 if c.depth == 0 else 1,
            0 if c.in_line else 1,
            c.depth,
        )

    return min(pool, key=key)


def _pair(cands: list[_Candidate], dtypes: list[str]) -> tuple[_Candidate, _Candidate] | None:
    """Two candidates of two different floating dtypes: those the message names, or the innermost such pair."""
    named = [d for i, d in enumerate(dtypes) if d in _FLOATING and d not in dtypes[:i]]
    return _named_pair(cands, named) or _innermost_pair(cands)


def _named_pair(cands: list[_Candidate], named: list[str]) -> tuple[_Candidate, _Candidate] | None:
    """The two tensors of the two dtypes the message names, or of the one it names and the nearest other."""
    if len(named) >= 2:
        a, b = _pick(cands, named[0]), _pick(cands, named[1])
        return (a, b) if a is not None and b is not None else None
    if len(named) == 1:
        a = _pick(cands, named[0], prefer_param=False)
        others = [c for c in cands if c.dtype != named[0] and c.dtype in _FLOATING]
        if a is not None and others:
            return a, min(others, key=lambda c: (0 if c.parameter else 1, 0 if c.in_line else 1, c.depth))
    return None


def _innermost_pair(cands: list[_Candidate]) -> tuple[_Candidate, _Candidate] | None:
    """The innermost floating tensor that has a partner of another floating dtype, with its nearest partner."""
    floating = [c for c in cands if c.dtype in _FLOATING]
    for c in sorted(floating, key=lambda c: (c.depth, 0 if c.in_line else 1)):
        partner = [o for o in floating if o.dtype != c.dtype]
        if partner:
            return c, min(partner, key=lambda o: (o.depth, 0 if o.in_line else 1))
    return None


def _receiver(view: FrameView | None) -> str | None:
    """``x`` in ``x.index_add_(...)`` / ``x[idx] = y`` on the user's failing line."""
    if view is None:
        return None
    line = linecache.getline(view.filename, view.lineno)
    m = re.search(r"([A-Za-z_][\w.]*)\s*\.\s*(?:index_\w+|scatter\w*|masked_scatter_?|put_?|copy_)\s*\(", line)
    if m is None:
        m = re.search(r"([A-Za-z_][\w.]*)\s*\[[^\]]*\]\s*=[^=]", line)
    return m.group(1).rsplit(".", 1)[-1] if m else None


def _cast_code(cast: Operand, dtype: str, template: str, keep: Operand | None) -> str:
    target = f"torch.{dtype}"
    if cast.parameter:
        owner = python_path(cast.owner.split(" (")[0])
        return f"{owner}.to({target})  # or cast the other operand, or use torch.autocast"
    name = cast.name if re.fullmatch(r"[A-Za-z_][\w.]*", cast.name) else "x"
    dst = keep.name if keep is not None and re.fullmatch(r"[A-Za-z_][\w.]*", keep.name) else "destination"
    code = template.format(src=name, dst=dst, dtype=target, scaler="scaler", optimizer="optimizer")
    if not cast.user_named:
        code += f"  # {cast.name}: the tensor passed to this op"
    return code


def failing_operands(frames: list[FrameView], message: str, cast_rule: str, template: str,
                     namespace: Mapping[str, Any] | None = None) -> Operands | None:  # fmt: skip
    """The two tensors a dtype error is about, and the cast that fixes it; None when they are out of reach.

    Parameters
    ----------
    frames : list of FrameView
        The traceback's frames, outermost first.
    message : str
        The exception message (its dtypes choose the pair).
    cast_rule : str
        The family's rule (:data:`~mpdoctor.attach.crash.catalogue.TO_PARAMETER`, ...).
    template : str
        The family's code template.
    namespace : mapping, optional
        The user's namespace (IPython ``user_ns``), for model roots and names.
    """
    torch = _torch()
    if torch is None or not frames or not cast_rule:
        return None
    cands = _candidates(frames, torch)
    if not cands:
        return None
    dtypes = message_dtypes(message)
    where = _qualname(frames[-1])
    if cast_rule in (INDEX_LONG, AMP_STATE, MASK):
        choice = _single_choice(cast_rule, cands, dtypes, message)
    else:
        pair = _pair(cands, dtypes)
        if pair is None:
            return _written_expression(frames, cands, dtypes, where) if cast_rule == TO_DESTINATION else None
        choice = _pair_choice(pair, cast_rule, message, frames)
    if choice is None:
        return None
    return _operands(choice, cast_rule, template, frames, namespace, where, torch)


#: What a dtype error's fix casts, what it keeps (None: nothing to match), and the dtype it casts to.
_Choice = tuple[_Candidate, "_Candidate | None", str]


def _single_choice(cast_rule: str, cands: list[_Candidate], dtypes: list[str], message: str) -> _Choice | None:
    """The one tensor an index, AMP-state or mask error is about."""
    if cast_rule == INDEX_LONG:
        return _index_choice(cands, dtypes)
    if cast_rule == AMP_STATE:
        return _amp_state_choice(cands, message)
    return _mask_choice(cands, dtypes)


def _index_choice(cands: list[_Candidate], dtypes: list[str]) -> _Choice | None:
    """The index that is not int64: named like an index first, then of a dtype the message names."""
    pool = [c for c in cands if c.dtype not in ("int64", "bool", "uint8")]
    if not pool:
        return None
    cast = min(pool, key=lambda c: (0 if _INDEX_NAME.search(c.name) else 1, 0 if c.dtype in dtypes else 1,
                                    0 if c.in_line else 1, c.depth))  # fmt: skip
    return cast, None, "int64"


def _amp_state_choice(cands: list[_Candidate], message: str) -> _Choice | None:
    """The AMP state tensor of the wrong dtype: an integer one where an int tensor is wanted, else a half one."""
    wants_int = "int tensor" in message
    pool = [c for c in cands if (c.dtype in ("int64", "int16", "int8", "uint8") if wants_int
                                 else c.dtype in _FLOATING and c.dtype != "float32")]  # fmt: skip
    if not pool:
        return None
    cast = min(pool, key=lambda c: (0 if c.in_line else 1, c.depth))
    return cast, None, "int32" if wants_int else "float32"


def _mask_choice(cands: list[_Candidate], dtypes: list[str]) -> _Choice | None:
    """The attention mask of the wrong dtype, cast to the query's dtype."""
    masks = [c for c in cands if _MASK_NAME.search(c.name)]
    if not masks:
        return None
    floating = [d for d in dtypes if d in _FLOATING]
    wrong = [m for m in masks if m.dtype in dtypes[:1]] or masks
    cast = min(wrong, key=lambda c: c.depth)
    queries = [c for c in cands if c is not cast and c.dtype in _FLOATING and not _MASK_NAME.search(c.name)]
    keep = min(queries, key=lambda c: (0 if "q" in c.name.lower() else 1, c.depth)) if queries else None
    return cast, keep, keep.dtype if keep is not None else (floating[-1] if floating else "bool")


def _pair_choice(pair: tuple[_Candidate, _Candidate], cast_rule: str, message: str,
                 frames: list[FrameView]) -> _Choice:  # fmt: skip
    """Which of two tensors of different dtypes the family's rule casts, and to which dtype."""
    keep, cast = _kept_first(pair, cast_rule, message, frames)
    dtype = keep.dtype
    if cast_rule == FP8_UPCAST and dtype.startswith("float8"):
        dtype = "bfloat16"
    return cast, keep, dtype


def _kept_first(pair: tuple[_Candidate, _Candidate], cast_rule: str, message: str,
                frames: list[FrameView]) -> tuple[_Candidate, _Candidate]:  # fmt: skip
    """``(keep, cast)``: the parameter, the destination, the wider format or the expected dtype is kept."""
    a, b = pair
    if cast_rule == TO_PARAMETER:
        return (b, a) if b.parameter and not a.parameter else (a, b)
    if cast_rule == TO_DESTINATION:
        receiver = _receiver(next((f for f in reversed(frames) if f.user), None))
        return (b, a) if receiver is not None and b.name == receiver else (a, b)
    if cast_rule == FP8_UPCAST:
        return (b, a) if a.dtype.startswith("float8") else (a, b)
    if cast_rule == TO_EXPECTED:
        wl = _winner_loser(message)
        return (b, a) if wl is not None and a.dtype == wl[1] else (a, b)
    return a, b


def _operands(choice: _Choice, cast_rule: str, template: str, frames: list[FrameView],
              namespace: Mapping[str, Any] | None, where: str, torch: Any) -> Operands:  # fmt: skip
    """The chosen tensors as the user names them, and the cast's code."""
    cast, keep, dtype = choice
    roots = _roots(frames, namespace, torch)
    cast_op = _operand(cast, frames, namespace, roots, torch)
    keep_op = _operand(keep, frames, namespace, roots, torch) if keep is not None else None
    if cast_op.parameter and keep_op is not None and not keep_op.parameter and cast_rule == TO_PARAMETER:
        cast_op, keep_op = keep_op, cast_op
        dtype = keep_op.dtype
    code = _cast_code(cast_op, dtype, template, keep_op)
    return Operands(cast_op, keep_op, dtype, where, code)


def _written_expression(frames: list[FrameView], cands: list[_Candidate], dtypes: list[str],
                        where: str) -> Operands | None:  # fmt: skip
    """``dst[idx] = <expression>`` on the user's line, when the values written are a temporary, not a local."""
    view = next((f for f in reversed(frames) if f.user), None)
    if view is None or len(dtypes) < 2:
        return None
    line = linecache.getline(view.filename, view.lineno).strip()
    m = re.fullmatch(r"([A-Za-z_][\w.]*)\s*\[(.+)\]\s*=\s*(.+?)\s*(?:#.*)?", line)
    if m is None:
        return None
    dst_name, index, expression = m.groups()
    dst = next((c for c in cands if c.name == dst_name.rsplit(".", 1)[-1] and c.dtype == dtypes[0]), None)
    shape = dst.shape if dst is not None else ()
    keep = Operand(dst_name, dtypes[0], shape)
    cast = Operand(expression, dtypes[1], ())
    code = f"{dst_name}[{index}] = ({expression}).to({dst_name}.dtype)"
    return Operands(cast, keep, dtypes[0], where, code)


# -- protocol errors: the user's loop line ------------------------------------------------------------------


def loop_line(frames: list[FrameView]) -> Location | None:
    """The innermost user frame's line (``cell [7], line 3`` or ``train.py:42``)."""
    user = next((f for f in reversed(frames) if f.user), None)
    if user is None:
        return None
    try:
        source = linecache.getline(user.filename, user.lineno)
    except Exception:
        source = ""
    return Location.at(user.filename, user.lineno, source)


def protocol_names(frames: list[FrameView], namespace: Mapping[str, Any] | None = None) -> tuple[str, str]:
    """The names the user holds the GradScaler and the optimizer of a failing protocol call by
    (``"scaler"`` / ``"optimizer"`` when unknown)."""
    scaler_obj = optimizer_obj = None
    for view in reversed(frames):
        if view.user or not view.module.startswith(GRAD_SCALER_MODULES):
            continue
        try:
            local = dict(_locals(view.frame))
        except Exception:
            continue
        scaler_obj = scaler_obj if scaler_obj is not None else local.get("self")
        optimizer_obj = optimizer_obj if optimizer_obj is not None else local.get("optimizer")
    scaler = _name_of(scaler_obj, frames, namespace) or "scaler"
    optimizer = _name_of(optimizer_obj, frames, namespace) or "optimizer"
    return scaler, optimizer


def _name_of(obj: Any, frames: list[FrameView], namespace: Mapping[str, Any] | None) -> str | None:
    if obj is None:
        return None
    for view in reversed(frames):
        if not view.user:
            continue
        try:
            for name, value in _locals(view.frame):
                if value is obj and type(name) is str and not name.startswith("_") and name != "self":
                    return name
        except Exception:
            continue
    for name, value in (dict.items(namespace) if type(namespace) is dict else ()):
        if value is obj and type(name) is str and not name.startswith("_"):
            return name
    return None


def refusal_subject(frames: list[FrameView], namespace: Mapping[str, Any] | None = None) -> str | None:
    """The module or tensor a library refused (``model.0 (Linear 40->40)``, ``x float32[4, 40]``)."""
    torch = _torch()
    if torch is None:
        return None
    roots = _roots(frames, namespace, torch)
    for view in list(reversed(frames))[:OPERAND_FRAMES]:
        try:
            local = dict(_locals(view.frame))
        except Exception:
            continue
        module = local.get("module") if view.module.startswith("torchao") else None
        if module is not None and _is_module(torch, module):
            path = _module_path(module, roots, torch)
            shapes = [f"{n} {list(_shape(torch, p))}" for n, p in _direct_parameters(module)[:1]]
            cls = class_path(type(module)).rsplit(".", 1)[-1]
            return f"{path or 'a module'} ({cls}{', ' + shapes[0] if shapes else ''})"
        for name in ("data_hp", "x", "input", "weight"):
            value = local.get(name)
            if value is not None and _is_tensor(torch, value) and not view.user:
                dtype = _dtype_name(torch, value) or "?"
                return f"{name} {spoken(dtype)}{list(_shape(torch, value))} in {_qualname(view)}"
    return None


def refused_layers(frames: list[FrameView], namespace: Mapping[str, Any] | None = None) -> tuple | None:
    """``(model, its name, paths, block, optimizers)``: the layers of a model converted to a low-precision recipe
    (a torchao layer class, or a weight wrapped in a torchao tensor subclass) with a weight dimension that is not a
    multiple of the block the failing frame checked (they are what the format refuses), and the optimizers of the
    namespace. None when the block or such a layer is out of reach."""
    torch = _torch()
    block = _block_size(frames)
    if torch is None or block is None:
        return None
    roots = _roots(frames, namespace, torch)
    optimizers = [v for v in (dict.values(namespace) if type(namespace) is dict else ())
                  if isinstance(v, torch.optim.Optimizer)]  # fmt: skip
    for name, model in roots:
        paths = [p for p, m in model.named_modules() if _converted(m) and _off_block(m, block)]
        if paths:
            return model, name, paths, block, optimizers
    return None


def _converted(module: Any) -> bool:
    """A layer a low-precision recipe converted: a torchao class, or a torchao tensor subclass as its weight."""
    weight = own_params(module).get("weight")
    return type(module).__module__.startswith("torchao") or type(weight).__module__.startswith("torchao")


def own_params(module: Any) -> dict:
    try:
        return dict(object.__getattribute__(module, "_parameters"))
    except Exception:
        return {}


def _block_size(frames: list[FrameView]) -> int | None:
    """The block size the failing frame checked against (``block_size`` among its locals)."""
    for view in reversed(frames):
        try:
            value = dict(_locals(view.frame)).get("block_size")
        except Exception:
            continue
        if type(value) is int and value > 0:
            return value
    return None


def _off_block(module: Any, block: int) -> bool:
    weight = getattr(module, "weight", None)
    shape = tuple(getattr(weight, "shape", ()))
    return bool(shape) and any(d % block for d in shape)


__all__ = [
    "Operand", "Operands", "failing_operands", "loop_line", "message_dtypes", "protocol_names", "refusal_subject",
    "refused_layers", "spoken",
]  # fmt: skip


# -- the other owner: a tensor a module holds beside its weights, read on the failing line ------------------------


def held_tensors(frames: list[FrameView], dtype: str) -> tuple[Any, tuple[str, ...]] | None:
    """The module and the names of the tensors it holds in ``dtype`` that the failing user line reads.

    A mismatched op often gets its odd operand from a tensor another owner keeps: ``self.head(self.proj(x) *
    self.scale)`` with ``scale`` a buffer left in fp32 beside bf16 weights makes the head's input fp32. The
    innermost user frame whose ``self`` is a module is read: every ``self.<name>`` on its line that is a buffer
    or a plain tensor attribute of that module, floating, in ``dtype``. None when there is none.
    """
    torch = _torch()
    if torch is None:
        return None
    for view in reversed(frames):
        if not view.user:
            continue
        try:
            module = next((v for k, v in _locals(view.frame) if k == "self"), None)
        except Exception:
            continue
        if module is None or not _is_module(torch, module):
            continue
        line = linecache.getline(view.filename, view.lineno)
        names = []
        for name in dict.fromkeys(re.findall(r"\bself\.([A-Za-z_]\w*)\b(?!\s*[.(\[])", line)):
            tensor = _held(module, name)
            if _is_tensor(torch, tensor) and _dtype_name(torch, tensor) == dtype and tensor.is_floating_point():
                names.append(name)
        return (module, tuple(names)) if names else None
    return None


def _held(module: Any, name: str) -> Any:
    """``module``'s buffer or own attribute ``name``, read from its dicts (no ``__getattr__`` runs)."""
    try:
        buffers = object.__getattribute__(module, "_buffers")
        if name in buffers:
            return buffers[name]
        return object.__getattribute__(module, "__dict__").get(name)
    except Exception:
        return None
