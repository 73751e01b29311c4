"""The corrected cell for a NaN born on the user's own line: the op's argument clamped into the op's domain.

:mod:`mpdoctor.attach.runtime.nan_origin` names the op that made the first NaN / inf from finite inputs and the line of the
user's code that called it (a notebook cell's, or a script's function). When that op is defined on part of the real
line only and its input left that part (a probability of exactly 0 or 1 into a focal loss's ``log``), no precision
change cures it: the code itself is wrong for that input. :func:`clamped_source` rewrites the source that holds the
line (read with :mod:`ast`, never run; every other line stays as the user wrote it), the one call the frame points at
with its argument clamped by the dtype's own smallest normal number, ``torch.finfo(x.dtype).tiny``:

- ``log`` / ``log2`` / ``log10`` (function or method): ``torch.log(p)`` -> ``torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))``
  (log of a probability of 0 becomes about -87 in fp32, and the clamp passes no gradient below the bound);
- ``log1p``: the argument kept above -1 (``-1 + eps``);
- ``sqrt`` / ``rsqrt``: the argument clamped at ``tiny`` (a negative radicand is the error itself; at exactly 0
  ``sqrt``'s gradient is inf, so 0 is not bound enough);
- ``reciprocal``, a division ``a / b`` (``torch.div``, ``true_divide``) and ``x ** -k`` whose denominator / base
  reached 0: clamped at ``tiny`` only when every value of it the replay saw was >= 0 (``den_min``). A denominator
  holding negative values would lose its sign to a ``clamp_min``, and ``sign(b) * b.abs().clamp_min(tiny)`` would
  send a value that crossed zero to the other infinity: those stay advice. ``x ** -k`` (a literal negative exponent) is
  clamped at ``tiny ** (1/k)``, so the power stays finite.

Left out: ``xlogy`` and ``log_softmax`` (their NaN is an inf input, not a domain), ``fmod`` / ``remainder`` / floor
division, a division by a Python number, and any line the frame's positions do not pin to one call.
"""

from __future__ import annotations

import ast

#: Ops rewritten, by the op name the replay reports (a function, a method, or the operator's dunder).
LOG_OPS = frozenset({"log", "log2", "log10"})
ROOT_OPS = frozenset({"sqrt", "rsqrt"})
DIVISION_OPS = frozenset({"div", "true_divide", "divide", "__truediv__", "__rtruediv__", "reciprocal"})
POWER_OPS = frozenset({"pow", "__pow__"})
CLAMPED_OPS = LOG_OPS | ROOT_OPS | DIVISION_OPS | POWER_OPS | {"log1p"}


def clamped_source(source: str, line: int, col: int | None, end_col: int | None, op: str, dtype: str,
                   nonnegative: bool) -> str | None:  # fmt: skip
    """``source`` with the call of ``op`` at ``line`` (columns ``col`` to ``end_col`` of it, as the frame's code
    positions give them; None: the only such call on the line) given an argument inside the op's domain (its bound in
    the argument's own dtype, or ``dtype`` for a long expression); None when the op is not one :data:`CLAMPED_OPS`
    clamps, the call is not found, or its clamp is not well defined (``nonnegative`` False: a denominator or base
    holding negative values)."""
    if op not in CLAMPED_OPS or (op in DIVISION_OPS | POWER_OPS and not nonnegative):
        return None
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    calls = _calls_to_clamp(tree, line, col, end_col, op)
    edits = [(n, _clamped(n, op, dtype)) for n in calls]
    if not edits or any(new is None for _, new in edits):
        return None
    lines = source.splitlines()
    text = lines[line - 1]
    for call, new in sorted(edits, key=lambda e: -e[0].col_offset):  # right to left: the columns stay true
        start = _char_offset(text, call.col_offset)
        end = _char_offset(text, call.end_col_offset or call.col_offset)
        text = f"{text[:start]}{new}{text[end:]}"
    lines[line - 1] = f"{text}  # clamped into {_domain(op)}: no NaN / inf at the bound"
    return "\n".join(lines) + "\n"


def _calls_to_clamp(tree: ast.Module, line: int, col: int | None, end_col: int | None, op: str) -> list[ast.AST]:
    """The calls of ``op`` on ``line`` to clamp: the one the frame's columns point at for a division or a power (only
    the operand the replay saw reach 0 is known to be >= 0); every outermost one of the line for log / sqrt / rsqrt /
    log1p, whose clamp is a no-op inside the domain (``y * log(p) + (1 - y) * log(1 - p)`` meets p == 1 and p == 0
    alike). Empty when a call spans several lines or the frame points at none."""
    calls = [n for n in ast.walk(tree) if _is_call_of(n, op) and n.lineno <= line <= (n.end_lineno or n.lineno)]
    if any(n.lineno != (n.end_lineno or n.lineno) for n in calls):
        return []  # a call over several lines: not rewritten in place
    pinned = _pinned(calls, col, end_col)
    if op in DIVISION_OPS | POWER_OPS:
        calls = pinned if col is not None else calls
        return calls if len(calls) == 1 else []
    if col is not None and not pinned:
        return []  # the frame points elsewhere: the line is not the one read
    return [n for n in calls if not any(o is not n and _inside(n, o) for o in calls)]


def _pinned(calls: list[ast.AST], col: int | None, end_col: int | None) -> list[ast.AST]:
    """The innermost call holding the columns ``col`` to ``end_col``; empty without columns."""
    if col is None:
        return []
    holding = [n for n in calls if n.col_offset <= col and (end_col is None or (n.end_col_offset or 0) >= end_col)]
    return sorted(holding, key=lambda n: (n.end_col_offset or 0) - n.col_offset)[:1]


def _inside(inner: ast.AST, outer: ast.AST) -> bool:
    return outer.col_offset <= inner.col_offset and (inner.end_col_offset or 0) <= (outer.end_col_offset or 0)


def _char_offset(text: str, byte_offset: int) -> int:
    """A column of :mod:`ast` (UTF-8 bytes) as an index into ``text``."""
    return len(text.encode("utf-8")[:byte_offset].decode("utf-8", errors="ignore"))


def _domain(op: str) -> str:
    if op in LOG_OPS:
        return "log's domain"
    if op == "log1p":
        return "log1p's domain"
    if op in ROOT_OPS:
        return f"{op}'s domain"
    if op in POWER_OPS:
        return "a base above zero"
    return "a denominator above zero"


def _name(func: ast.AST) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _is_call_of(node: ast.AST, op: str) -> bool:
    """``node`` is the expression the replay's op name comes from: a call ``torch.log(x)`` / ``x.log()``, or for the
    operators a ``BinOp`` (``a / b``, ``x ** -2``)."""
    if isinstance(node, ast.Call):
        name = _name(node.func)
        return name == op or (op == "__pow__" and name == "pow") or (op in ("div", "divide", "true_divide")
                                                                      and name in ("div", "divide", "true_divide"))
    if isinstance(node, ast.BinOp):
        return (isinstance(node.op, ast.Div) and op in ("__truediv__", "__rtruediv__", "div", "true_divide")) or (
            isinstance(node.op, ast.Pow) and op in ("__pow__", "pow"))  # fmt: skip
    return False


def _bound(op: str, arg: ast.expr, dtype: str, exponent: float | None = None) -> ast.expr:
    """The lower bound of ``arg``'s clamp, in the dtype of ``arg`` itself where it is short to repeat (a name, an
    attribute, ``1 - p``), else in ``dtype`` (the op's dtype in the replay)."""
    text = ast.unparse(arg)
    calls = any(isinstance(n, ast.Call) for n in ast.walk(arg))  # not run twice for its dtype
    of = f"{text}.dtype" if isinstance(arg, (ast.Name, ast.Attribute)) else (
        f"({text}).dtype" if len(text) <= 24 and not calls else f"torch.{dtype}")  # fmt: skip
    finfo = f"torch.finfo({of})"
    if op == "log1p":
        return ast.parse(f"-1 + {finfo}.eps", mode="eval").body
    if exponent is not None and exponent > 1:  # x ** -k stays finite for x >= tiny ** (1/k)
        return ast.parse(f"{finfo}.tiny ** (1 / {exponent!r})", mode="eval").body
    return ast.parse(f"{finfo}.tiny", mode="eval").body


def _clamp(arg: ast.expr, op: str, dtype: str, exponent: float | None = None) -> ast.expr:
    return ast.Call(ast.Attribute(arg, "clamp_min", ast.Load()), [_bound(op, arg, dtype, exponent)], [])


def _clamped(node: ast.AST, op: str, dtype: str) -> str | None:
    """The call / operation with its offending operand clamped, as code; None when its shape is not one handled."""
    node = ast.parse(ast.unparse(node), mode="eval").body  # a copy: the cell's tree stays as read
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.Div):
            node.right = _clamp(node.right, op, dtype)
            return ast.unparse(node)
        exponent = _negative_exponent(node.right)
        if exponent is None:
            return None
        node.left = _clamp(node.left, op, dtype, exponent)
        return ast.unparse(node)
    if not isinstance(node, ast.Call) or node.keywords:
        return None
    binary = op in DIVISION_OPS - {"reciprocal"} or op in POWER_OPS
    method = isinstance(node.func, ast.Attribute) and len(node.args) == (1 if binary else 0)
    operands = [node.func.value, *node.args] if method else list(node.args)
    if len(operands) != (2 if binary else 1):
        return None
    exponent = None
    if op in POWER_OPS:
        exponent = _negative_exponent(operands[1])
        if exponent is None:
            return None
    slot = 1 if binary and op not in POWER_OPS else 0  # the denominator, or the base / the one argument
    clamped = _clamp(operands[slot], op, dtype, exponent)
    if method and slot == 0:
        node.func.value = clamped
    else:
        node.args[slot - (1 if method else 0)] = clamped
    return ast.unparse(node)


def _negative_exponent(node: ast.AST) -> float | None:
    """The magnitude of a negative literal exponent (``-2``, ``-0.5``), else None."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        value = node.operand.value
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return value
    return None
