"""The code the loop reader reads: a notebook cell or a script as a parsed :class:`Source`, and the names in it.

Parsing is cached (history is read again and again); a ``%%time`` cell is read as its body. Nothing here runs
the code.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import lru_cache

from ...facts.location import Location

#: Cell magics whose body is Python run as is: their body is read too.
_CODE_CELL_MAGICS = frozenset({"time", "capture", "timeit", "prun"})


@dataclass(frozen=True)
class Source:
    """One unit of code read: a notebook cell or a script.

    Attributes
    ----------
    file : str
        Where it comes from, as :class:`~mpdoctor.facts.location.Location` reads it: ``"In[7]"`` for a cell
        of the history, the script's path.
    code : str
        The Python source (IPython syntax already transformed away).
    tree : ast.Module
        Its parse tree.
    line_offset : int
        Added to the tree's line numbers to give the line the user sees (a ``%%time`` cell's body starts on 2).
    """

    file: str
    code: str
    tree: ast.Module
    line_offset: int = 0

    @property
    def lines(self) -> list[str]:
        return self.code.splitlines()

    def location(self, lineno: int) -> Location:
        """Line ``lineno`` of the parse tree as the user sees it (``cell [7], line 12``, ``train.py:12``)."""
        lines = self.lines
        code = lines[lineno - 1] if 0 < lineno <= len(lines) else ""
        return Location.at(self.file, lineno + self.line_offset, code)


@lru_cache(maxsize=4096)
def parse(code: str) -> ast.Module | None:
    """The parse tree of ``code``, or None when it is not Python (cached: history is read again and again)."""
    try:
        return ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None


#: A cell holding none of these cannot take part in the protocol: it is not parsed (most notebook cells).
RELEVANT = (
    "scale",
    "step",
    "clip_grad",
    "backward",
    "def ",
    "class ",
    "for ",
    "while ",
    "optim",
    "Optim",
    "sched",
    "Scaler",
)


def relevant(code: str) -> bool:
    """Whether ``code`` may create, use or call into the protocol (a text test, before parsing)."""
    return any(token in code for token in RELEVANT)


def source_of(file: str, code: str) -> Source | None:
    """A :class:`Source` for ``code``, or None when it does not parse; a ``%%time`` cell yields its body."""
    tree = parse(code)
    if tree is None:
        return None
    body = _cell_magic_body(tree)
    if body is not None:
        inner = parse(body)
        if inner is not None:
            return Source(file, body, inner, line_offset=1)
    return Source(file, code, tree)


def _cell_magic_body(tree: ast.Module) -> str | None:
    # IPython turns "%%time\n<body>" into get_ipython().run_cell_magic('time', '', '<body>').
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr):
        return None
    call = tree.body[0].value
    if not (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "run_cell_magic"
    ):
        return None
    if len(call.args) != 3:
        return None
    name, _, body = call.args
    if isinstance(name, ast.Constant) and name.value in _CODE_CELL_MAGICS and isinstance(body, ast.Constant):
        return body.value if isinstance(body.value, str) else None
    return None


# -- names ---------------------------------------------------------------------------------------------------


def dotted(node: ast.AST) -> str:
    """``torch.nn.utils.clip_grad_norm_`` for an attribute chain, ``""`` for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def unparse(node: ast.AST) -> str:
    """``node``'s source text, ``""`` for a malformed tree."""
    try:
        return ast.unparse(node)
    except Exception:  # a malformed tree
        return ""


def text_of(node: ast.AST) -> str:
    """A receiver's source text (``scaler``, ``self.scaler``, ``scalers[0]``)."""
    return dotted(node) or unparse(node)
