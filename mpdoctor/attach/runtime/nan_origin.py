"""Where a NaN is born: the op and module that produced the first non-finite value, and why.

The probe's hooks see modules; a NaN often shows first in a module that only received it (the code between
modules produced it, or a parent's own arithmetic). When the probe's forward saw a non-finite value,
:func:`locate` runs the same forward once more (no grad, the probe's autocast and RNG state, every state the
forward touches restored) under a :class:`torch.overrides.TorchFunctionMode` that looks at each op's output and
stops at the first op whose output holds a NaN its inputs did not (or an inf from finite inputs). The mode and
the module hooks that say which module was running are active only during that replay, and only when a
non-finite value was already seen: a healthy probe pays nothing.

Causes, each with the fix that matches it:

- ``overflow``: finite inputs, an output past the dtype's largest value -> bf16 / an fp32 module, or rescale;
- ``eps-underflow``: a division by zero in a module whose eps is 0 in the compute dtype (1e-12 in fp16)
  -> a representable eps, or the norm in fp32;
- ``zero-division``: x/0 or 0/0 with no eps to blame -> add an eps or clamp the denominator;
- ``log-nonpositive`` / ``sqrt-negative``: log or sqrt of values <= 0 / < 0 -> clamp first;
- ``inf-minus-inf``: inf - inf, 0 * inf on inputs holding inf (a -inf mask row) -> finite masks;
- ``nan-in-batch`` / ``nan-in-weights``: the NaN was already there -> check the data / reload the weights.
"""

from __future__ import annotations

import math
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ...facts.tensors import dtype_name

#: Why a non-finite value was produced, by cause.
CAUSES = {
    "overflow": "finite inputs produced a value past the largest number of {dtype} ({max:.4g})",
    "eps-underflow": (
        "a division by zero: its eps {eps:g} is 0 in {dtype}, so a row of zero variance (padding, a constant "
        "row) gives 0/0 or x/0"
    ),
    "zero-division": "a division by zero (x/0 or 0/0) from finite inputs",
    "log-nonpositive": "log of a value <= 0 (smallest input {min:.4g}): -inf at 0, NaN below",
    "sqrt-negative": "square root of a negative value (smallest input {min:.4g})",
    "inf-minus-inf": "inf - inf (or 0 * inf) on inputs that already held inf, e.g. a fully masked row",
    "nan-in-batch": "the batch itself holds NaN/Inf ({key})",
    "nan-in-weights": "its own weights already hold NaN/Inf: an earlier optimizer step wrote them",
    "nonfinite-op": "the op produced NaN/Inf from finite inputs",
}

_LOG = frozenset({"log", "log2", "log10", "log_", "xlogy", "log_softmax", "log1p"})
_SQRT = frozenset({"sqrt", "sqrt_", "rsqrt", "rsqrt_"})
_DIV = frozenset({"div", "div_", "__truediv__", "__rtruediv__", "__itruediv__", "true_divide", "reciprocal",
                  "rsqrt", "rsqrt_", "__floordiv__", "floor_divide", "remainder", "fmod"})  # fmt: skip
_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")
#: Ops summing products: NaN from finite inputs there is an overflow to inf met by an opposite inf.
_ACCUMULATING = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "conv1d", "conv2d",
                           "conv3d", "conv_transpose1d", "conv_transpose2d", "sum", "mean", "mul", "exp", "pow",
                           "scaled_dot_product_attention", "__matmul__", "softmax", "var"})  # fmt: skip
#: Where torch functions take their eps positionally, and their defaults when not given.
_EPS_POSITION = {"normalize": 3, "layer_norm": 4, "group_norm": 4, "rms_norm": 3}
_EPS_DEFAULT = {"normalize": 1e-12}


@dataclass(frozen=True)
class NanOrigin:
    """Where and why the first non-finite value was produced (plain data, in ``ProbeFacts.origin``).

    Attributes
    ----------
    module : str
        Path of the innermost module running when the op ran ("" for the model itself).
    class_name : str
    op : str
        The torch function or tensor method (``log``, ``__truediv__``, ``linear``); "" when found without replay.
    cause : str
        A key of :data:`CAUSES`.
    dtype : str
        The op's output dtype.
    detail : dict
        Numbers behind the cause: ``max`` (the dtype's largest value), ``min`` (smallest input), ``eps``,
        ``key`` (a batch entry), ``den_min`` (the smallest value of a denominator or base that reached 0).
    site : tuple
        ``(filename, line, function, col, end_col)`` of the Python code that called the op (torch's and mpdoctor's frames left
        out); ``()`` when unknown or when that code is a library's (:func:`users_frame`).
    corrected : str
        The source that holds that line (a notebook cell whole; a script's function) with the op's argument clamped
        into its domain (:func:`mpdoctor.attach.runtime.domain_rewrite.clamped_source`); "" when the op or its operand has
        no well-defined clamp.
    """

    module: str
    class_name: str
    op: str
    cause: str
    dtype: str
    detail: dict = field(default_factory=dict)
    site: tuple = ()
    corrected: str = ""

    @property
    def why(self) -> str:
        """The cause in words."""
        values = {
            "dtype": self.dtype,
            "max": math.inf,
            "min": math.nan,
            "eps": 0.0,
            "key": "?",
            **self.detail,
        }
        try:
            return CAUSES[self.cause].format(**values)
        except (KeyError, ValueError):
            return CAUSES.get(self.cause, self.cause)


class _Found(Exception):
    """Raised inside the replay at the first producing op, to stop the forward there."""


def _floats(value: Any, depth: int = 0) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() and value.numel() and value.device.type != "meta" else []
    if depth < 2 and isinstance(value, (tuple, list)):
        return [t for v in value for t in _floats(v, depth + 1)]
    if depth < 2 and isinstance(value, dict):
        return [t for v in value.values() for t in _floats(v, depth + 1)]
    return []


def eps_of(module: torch.nn.Module | None) -> float | None:
    """A module's own float epsilon attribute, read without running its code."""
    if module is None:
        return None
    d = getattr(module, "__dict__", {})
    for attr in _EPS_ATTRS:
        value = d.get(attr)
        if type(value) is float:
            return value
    return None


def rounds_to_zero(value: float, dtype: torch.dtype) -> bool:
    """True when ``value`` (> 0) becomes 0 in ``dtype``."""
    return value > 0 and float(torch.tensor(value, dtype=dtype)) == 0.0


def _input_range(ins: list[torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
    """The output dtype's largest value, and the inputs' minimum and largest magnitude."""
    detail: dict[str, Any] = {"max": float(torch.finfo(dtype).max)}
    finite_ins = [t for t in ins if t.numel()]
    if finite_ins:
        detail["min"] = min(float(t.detach().min()) for t in finite_ins)
        detail["input_absmax"] = max(float(t.detach().abs().max()) for t in finite_ins)
    return detail


class OpWatch(TorchFunctionMode):
    """Stop at the first op whose output holds NaN its inputs did not, or inf from inputs without inf/NaN."""

    def __init__(
        self,
        stack: list[int],
        modules: list[tuple[str, torch.nn.Module]],
        within: frozenset[int] | None = None,
    ) -> None:
        super().__init__()
        self.stack, self.modules, self.within = stack, modules, within
        self.found: NanOrigin | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.found is None:
            outs = _floats(out)
            if outs and not all(bool(torch.isfinite(t).all()) for t in outs):
                self._judge(func, args, kwargs or {}, outs)
        return out

    def _judge(self, func: Any, args: tuple, kwargs: dict, outs: list[torch.Tensor]) -> None:
        ins = _floats((args, kwargs))
        in_nan = any(bool(torch.isnan(t).any()) for t in ins)
        in_inf = any(bool(torch.isinf(t).any()) for t in ins)
        out_nan = any(bool(torch.isnan(t).any()) for t in outs)
        if in_nan or (in_inf and not out_nan):
            return  # carried, not born here
        i = self.stack[-1] if self.stack else 0
        if self.within is not None and i not in self.within:
            return  # born in a module whose output stayed finite: discarded there (T5's log of bucket 0)
        name = getattr(func, "__name__", "") or str(func)
        dtype = outs[0].dtype
        detail = _input_range(ins, dtype)
        if in_inf:
            cause, blamed = "inf-minus-inf", None
        else:
            cause, blamed = self._cause(name, args, kwargs, dtype, detail, out_nan)
        path, module = self.modules[blamed if blamed is not None else i]
        site = users_frame(sys._getframe(1)) if blamed is None else None
        self.found = NanOrigin(path, type(module).__name__, name, cause, dtype_name(dtype), detail, site or ())
        raise _Found

    def _cause(self, name: str, args: tuple, kwargs: dict, dtype: torch.dtype, detail: dict,
               out_nan: bool) -> tuple[str, int | None]:  # fmt: skip
        """Why an op made NaN / inf from finite inputs, and the module to blame when it is not the innermost
        one (the norm whose eps vanished)."""
        if name in _LOG and detail.get("min", 0.0) <= (-1 if name == "log1p" else 0):
            return "log-nonpositive", None
        if name in _SQRT and detail.get("min", 0.0) < 0:
            return "sqrt-negative", None
        den = self._zero_denominator(name, args)
        if den is not None:
            detail["den_min"] = den
            return self._division_cause(dtype, detail)
        if self._eps_vanishes(name, args, kwargs, dtype, detail):
            return "eps-underflow", None  # an op taking eps (F.normalize, layer_norm) whose eps is 0 in this dtype
        if not out_nan or name in _ACCUMULATING:
            return "overflow", None  # a NaN from finite inputs in a sum of products is inf - inf inside it
        return "nonfinite-op", None

    def _division_cause(self, dtype: torch.dtype, detail: dict) -> tuple[str, int | None]:
        """A zero denominator: the eps of the innermost module holding one, when it is 0 in ``dtype``."""
        for j in reversed(self.stack):  # the norm whose eps vanished, innermost first
            eps = eps_of(self.modules[j][1])
            if eps is not None:
                if rounds_to_zero(eps, dtype):
                    detail["eps"] = eps
                    return "eps-underflow", j
                break
        return "zero-division", None

    @staticmethod
    def _eps_vanishes(name: str, args: tuple, kwargs: dict, dtype: torch.dtype, detail: dict) -> bool:
        position = _EPS_POSITION.get(name)
        eps = kwargs.get("eps", args[position] if position is not None and len(args) > position else None)
        if eps is None and name in _EPS_DEFAULT:
            eps = _EPS_DEFAULT[name]
        if type(eps) is float and rounds_to_zero(eps, dtype):
            detail["eps"] = eps
            return True
        return False

    @staticmethod
    def _zero_denominator(name: str, args: tuple) -> float | None:
        """The smallest value of the denominator (or the base of a negative power) when it holds a 0, else None."""
        if name in _DIV:
            den = args[0] if name in ("reciprocal", "rsqrt", "rsqrt_", "__rtruediv__") else (
                args[1] if len(args) > 1 else None)  # fmt: skip
        elif name in ("pow", "__pow__") and len(args) > 1 and type(args[1]) in (int, float) and args[1] < 0:
            den = args[0]
        else:
            return None
        if isinstance(den, torch.Tensor):
            return float(den.detach().min()) if bool((den == 0).any()) else None
        return 0.0 if den == 0 else None


#: mpdoctor's own tree: its frames (the op watch) are left out when the op's caller is looked for.
_OWN_TREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: torch's files that only pass an op on (a tensor's operators, ``__torch_function__`` handling): the op's caller is
#: the frame beyond them. Any other torch file calling the op is torch's own code (``F.normalize``): a library line.
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_DISPATCH = frozenset(_TORCH_DIR + name for name in ("_tensor.py", "overrides.py", os.path.join("utils", "_device.py")))


def users_frame(frame: Any) -> tuple | None:
    """``(filename, line, function, col, end_col)`` of the frame that called the op (mpdoctor's frames and torch's
    dispatch left out), when that frame is the user's own code (a notebook cell, a file outside the installed
    packages and the standard library); None when it is a library's (torch's own functions included) or none is
    found. ``col`` / ``end_col``: the columns of the instruction running in it (the call), None where the interpreter
    does not give them."""
    while frame is not None and (frame.f_code.co_filename.startswith(_OWN_TREE)
                                 or os.path.abspath(frame.f_code.co_filename) in _DISPATCH):  # fmt: skip
        frame = frame.f_back
    if frame is None or not _users_file(frame.f_code.co_filename):
        return None
    col = end_col = None
    positions = list(frame.f_code.co_positions()) if hasattr(frame.f_code, "co_positions") else []
    at = positions[frame.f_lasti // 2] if 0 <= frame.f_lasti // 2 < len(positions) else None
    if at is not None and at[0] == frame.f_lineno:
        col, end_col = at[2], at[3]
    return (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name, col, end_col)


def _users_file(filename: str) -> bool:
    from ...facts.location import is_cell

    if is_cell(filename):
        return True
    if filename.startswith("<"):
        return False
    libraries = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    path = os.path.abspath(filename)
    if path.startswith(_TORCH_DIR):
        return False
    return not any(path.startswith(os.path.abspath(lib) + os.sep) for lib in libraries) and os.path.exists(path)


def locate(
    model: torch.nn.Module,
    call: Any,
    modules: list[tuple[str, torch.nn.Module]],
    ctx: Any,
    first_bad: str | None = None,
) -> NanOrigin | None:
    """Replay ``call()`` (the probe's forward) under :class:`OpWatch`; the first producing op, or None.

    The caller restores modes, RNG and running statistics afterwards (the probe takes a snapshot).
    ``first_bad`` is the path of the first module whose output the probe saw non-finite: only ops running in
    it or in its ancestors count (a -inf made and discarded inside a module with a finite output is no origin).
    Module hooks keep the running stack for attribution and are removed even when the forward raises.
    """
    stack: list[int] = []
    index = {id(m): i for i, (_, m) in enumerate(modules)}
    handles = []

    def enter(module: torch.nn.Module, args: tuple) -> None:
        stack.append(index.get(id(module), 0))

    def leave(module: torch.nn.Module, args: tuple, output: Any) -> None:
        if stack:
            stack.pop()

    try:
        for _, m in modules:
            handles.append(m.register_forward_pre_hook(enter))
            handles.append(m.register_forward_hook(leave, always_call=True))
        within = None
        if first_bad is not None:
            within = frozenset(
                i for i, (path, _) in enumerate(modules)
                if path == "" or first_bad == path or first_bad.startswith(path + ".")
            )  # fmt: skip
        watch = OpWatch(stack, modules, within)
        try:
            with torch.no_grad(), ctx, watch:
                call()
        except _Found:
            pass
        except Exception:  # the replay is a bonus: the probe already reported what raised
            return watch.found
        return with_corrected_code(watch.found)
    finally:
        for h in handles:
            h.remove()


#: The causes a clamp of the op's argument cures, where the op runs on the user's own line.
_DOMAIN_CAUSES = frozenset({"log-nonpositive", "sqrt-negative", "zero-division"})
#: Longer sources than this are not shown whole (a long cell, a long function: the advice stands).
CORRECTED_LINES = 80


def with_corrected_code(found: NanOrigin | None) -> NanOrigin | None:
    """``found`` with the code that holds its op's line corrected (:attr:`NanOrigin.corrected`) when the op ran on
    the user's own line and its argument has a well-defined clamp; a notebook cell whole, a script's outermost
    function or class around the line; else ``found`` as it is."""
    if found is None or not found.site or found.cause not in _DOMAIN_CAUSES:
        return found
    import dataclasses
    import linecache

    from ...facts.location import is_cell
    from .domain_rewrite import clamped_source

    filename, line, _function, col, end_col = found.site
    source = "".join(linecache.getlines(filename))
    if not source:
        return found
    lines = source.splitlines()
    span = (1, len(lines)) if is_cell(filename) else _enclosing_block(source, line)
    if span is None:
        return found
    start, end = span
    block = lines[start - 1 : end]
    nonnegative = found.detail.get("den_min", 0.0) >= 0
    try:
        code = clamped_source("\n".join(block) + "\n", line - start + 1, col, end_col, found.op, found.dtype or "float32",
                              nonnegative)  # fmt: skip
    except Exception:  # the advice stands
        return found
    if code is None or len(code.splitlines()) > CORRECTED_LINES:
        return found
    return dataclasses.replace(found, corrected=code)


def _enclosing_block(source: str, line: int) -> tuple[int, int] | None:
    """The first and last lines of the outermost function or class of a script around ``line``, or None."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if first <= line <= (node.end_lineno or node.lineno):
                return first, node.end_lineno or node.lineno
    return None


def from_facts(batch_nonfinite: dict[str, int], weights_module: tuple[str, str] | None) -> NanOrigin | None:
    """The origin when the NaN was already there: in the batch (by key) or in a module's weights."""
    bad = [k for k, n in batch_nonfinite.items() if n]
    if bad:
        return NanOrigin("", "", "", "nan-in-batch", "", {"key": ", ".join(bad)})
    if weights_module is not None:
        return NanOrigin(weights_module[0], weights_module[1], "", "nan-in-weights", "")
    return None
