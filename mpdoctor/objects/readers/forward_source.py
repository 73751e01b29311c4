"""What a module's ``forward`` source says about its inputs: whether it casts them to its own weights' dtype.

A deliberate fp32 island (a MoE router or gate kept in fp32 under a bf16 model, an fp32 head) is written so:
``F.linear(x.to(self.weight.dtype), self.weight)``, ``x.type_as(self.weight)``, ``self.gate(h.float())`` in the
parent. mpdoctor reads that from the source file (``inspect.getsource``: the file is read, no user code runs),
once per class, and the dtype check does not call such a module an accident.
"""

from __future__ import annotations

import inspect
import re
import textwrap
import weakref

#: The module casts its own input to one of its own tensors' dtype (or type): ``x.to(self.weight.dtype)``,
#: ``x.to(dtype=self.weight.dtype)``, ``x.type_as(self.weight)``, ``x.type(self.weight.dtype)``.
_OWN_DTYPE = re.compile(
    r"\.(?:to|type)\(\s*(?:dtype\s*=\s*)?self\.[\w.]+\.dtype\s*[,)]|\.type_as\(\s*self\.[\w.]+\s*\)"
)
#: The module upcasts its input to fp32 (``x.float()``, ``x.to(torch.float32)``, ``x.type(torch.float32)``).
_TO_FP32 = re.compile(r"\.float\(\s*\)|\.(?:to|type)\(\s*(?:dtype\s*=\s*)?torch\.float(?:32)?\s*[,)]")

_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def forward_source(cls: type) -> str:
    """The source of ``cls.forward`` (its first definer in the MRO), or ``""`` when it cannot be read."""
    try:
        cached = _SOURCES.get(cls)
    except TypeError:  # a class that cannot be weakly referenced
        cached = None
    if cached is not None:
        return cached
    owner = next((c for c in cls.__mro__ if "forward" in c.__dict__), None)
    source = ""
    if owner is not None and not owner.__module__.startswith("torch."):
        try:
            source = textwrap.dedent(inspect.getsource(owner.__dict__["forward"]))
        except (OSError, TypeError):  # built in, or defined where no file holds it
            source = ""
    try:
        _SOURCES[cls] = source
    except TypeError:
        pass
    return source


def casts_own_input(cls: type) -> str | None:
    """``"own-dtype"`` when ``cls.forward`` casts a tensor to one of its own tensors' dtype, else None.

    An upcast to fp32 inside a module's own forward is no such evidence: Llama's RMSNorm upcasts its input for the
    variance, casts it back and multiplies by its fp32 weight, returning fp32 into the next bf16 matmul.
    """
    try:
        cached = _OWN_CASTS.get(cls, _UNREAD)
    except TypeError:  # a class that cannot be weakly referenced
        cached = _UNREAD
    if cached is not _UNREAD:
        return cached
    source = forward_source(cls)
    found = "own-dtype" if source and _OWN_DTYPE.search(source) else None
    try:
        _OWN_CASTS[cls] = found
    except TypeError:
        pass
    return found


#: ``class -> casts_own_input(class)``: read once per class, as its source is.
_OWN_CASTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_UNREAD = object()


_CHILDREN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def children_cast_by(cls: type) -> dict[str, str]:
    """The child attributes ``cls.forward`` calls with a cast input: ``self.gate(h.float())`` -> ``{"gate": "float32"}``,
    ``self.head(x.to(self.head.weight.dtype))`` -> ``{"head": "own-dtype"}``."""
    try:
        cached = _CHILDREN.get(cls)
    except TypeError:
        cached = None
    if cached is not None:
        return cached
    out = _children_cast_by(forward_source(cls))
    try:
        _CHILDREN[cls] = out
    except TypeError:
        pass
    return out


def _children_cast_by(source: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for m in re.finditer(r"self\.(\w+)\(", source):
        args = _call_arguments(source, m.end())
        if _OWN_DTYPE.search(args):
            out.setdefault(m.group(1), "own-dtype")
        elif _TO_FP32.search(args):
            out.setdefault(m.group(1), "float32")
    return out


def _call_arguments(source: str, start: int) -> str:
    """The text between the parenthesis opened just before ``start`` and its match."""
    depth = 1
    for i in range(start, min(len(source), start + 400)):
        ch = source[i]
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return source[start:i]
    return ""
