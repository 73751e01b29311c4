"""The loop, read: the GradScaler protocol mistakes of a hand-written AMP loop, found in its source.

An AST analysis, never an execution. Each source (a notebook cell, a script) is walked in program order as
an abstract run of the protocol ``scale(loss).backward()`` -> ``unscale_`` at most once per real step ->
clipping -> ``scaler.step(opt)`` -> ``update()``: loop bodies are walked twice (the second pass sees what one
iteration leaves for the next), an accumulation guard (``if (i + 1) % accum == 0:``) marks the calls that run
once per real step, a call to a function defined in the code read (``train_step(batch)``) walks its body at
the call. Sources are read in order with what earlier ones defined (a scaler created in one cell, the loop in
the next).

The analysis is calibrated against the correct recipes: what it cannot prove wrong it does not report. A
scaled backward is "pending" only when every path made it (an ``if use_amp:`` branch and its plain ``else``
leave nothing pending); an ``unscale_`` or ``step`` not yet followed by ``update()`` counts when any path
made it (that is the path that raises). Findings name the cell and line (``In [7], line 12``) and carry, as a
display-only fix, the user's own loop with the corrected lines.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from ..treatment.findings import Finding
from .rules import RULES

#: The methods the protocol is made of (any other attribute call is not looked at).
_PROTOCOL_ATTRS = frozenset({"backward", "unscale_", "step", "update"})
#: Call names that clip gradients in place (torch.nn.utils); accelerate's and Lightning's own clip unscale first.
CLIP_FUNCS = frozenset({"clip_grad_norm_", "clip_grad_value_", "clip_grad_norm"})
_TORCH_PARTS = frozenset({"torch", "nn", "utils", "clip_grad"})
#: Constructors whose result is a GradScaler.
SCALER_CLASSES = frozenset({"GradScaler", "ShardedGradScaler"})
#: torch.optim classes (and common third-party ones) whose instances are optimizers.
OPTIMIZER_CLASSES = frozenset(
    {
        "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "ASGD",
        "LBFGS", "SparseAdam", "Adafactor", "Lion", "AdamW8bit", "Adam8bit", "PagedAdamW", "PagedAdamW8bit",
        "AdamWBF16", "ZeroRedundancyOptimizer", "Muon",
    }
)  # fmt: skip
_SCHEDULER_CALL = re.compile(r"LR$|_schedule|[Ss]cheduler|Plateau|WarmRestarts")
_OPTIMIZER_NAME = re.compile(r"(?:^|_)(?:[oO]ptim|opt(?:$|_|[A-Z0-9]))")
_SCALER_NAME = re.compile(r"scaler$", re.IGNORECASE)
_SCHEDULER_NAME = re.compile(r"sched|lr_", re.IGNORECASE)
#: Words in an ``if`` test that make it an accumulation guard (the branch runs once per real step).
_GUARD_WORDS = re.compile(
    r"accum|sync_gradients|grad_acc|update_freq|is_last|last_micro|should_step|do_step|step_now"
)
#: Cell magics whose body is Python run as is: their body is read too.
_CODE_CELL_MAGICS = frozenset({"time", "capture", "timeit", "prun"})


@dataclass(frozen=True)
class Source:
    """One unit of code read: a notebook cell or a script.

    Attributes
    ----------
    label : str
        How findings name it: ``"In [7]"`` or ``"train.py"``.
    code : str
        The Python source (IPython syntax already transformed away).
    tree : ast.Module
        Its parse tree.
    line_offset : int
        Added to the tree's line numbers to give the line the user sees (a ``%%time`` cell's body starts on 2).
    """

    label: str
    code: str
    tree: ast.Module
    line_offset: int = 0

    @property
    def lines(self) -> list[str]:
        return self.code.splitlines()

    def where(self, lineno: int) -> str:
        """``"In [7], line 12"``."""
        return f"{self.label}, line {lineno + self.line_offset}"


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


def source_of(label: str, code: str) -> Source | None:
    """A :class:`Source` for ``code``, or None when it does not parse; a ``%%time`` cell yields its body."""
    tree = parse(code)
    if tree is None:
        return None
    body = _cell_magic_body(tree)
    if body is not None:
        inner = parse(body)
        if inner is not None:
            return Source(label, body, inner, line_offset=1)
    return Source(label, code, tree)


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


def _dotted(node: ast.AST) -> str:
    """``torch.nn.utils.clip_grad_norm_`` for an attribute chain, ``""`` for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _text(node: ast.AST) -> str:
    """A receiver's source text (``scaler``, ``self.scaler``, ``scalers[0]``)."""
    dotted = _dotted(node)
    if dotted:
        return dotted
    try:
        return ast.unparse(node)
    except Exception:  # ast.unparse on a malformed tree
        return ""


@dataclass
class Names:
    """What the code read so far has bound: scalers, optimizers, schedulers, functions."""

    #: scaler text -> False when created with a literal ``enabled=False`` (its mistakes are latent), else True.
    scalers: dict[str, bool] = field(default_factory=dict)
    optimizers: set[str] = field(default_factory=set)
    schedulers: set[str] = field(default_factory=set)
    #: function name -> (source, def node)
    functions: dict[str, tuple[Source, ast.FunctionDef]] = field(default_factory=dict)
    #: name bound to ``scaler.scale(loss)`` -> that scaler
    scaled_aliases: dict[str, str] = field(default_factory=dict)

    def _learn_binding(self, name: str, value: ast.AST) -> None:
        if not name:
            return
        if isinstance(value, ast.Attribute) and value.attr == "scaler":  # accelerator.scaler, trainer.scaler
            self.scalers[name] = True
        if not isinstance(value, ast.Call):
            return
        called = _dotted(value.func)
        last = called.rsplit(".", 1)[-1]
        if last in SCALER_CLASSES:
            self.scalers[name] = not any(
                kw.arg == "enabled" and isinstance(kw.value, ast.Constant) and kw.value.value is False
                for kw in value.keywords
            )
        elif (
            last in OPTIMIZER_CLASSES
            or (last.endswith("Optimizer") and last != "Optimizer")
            or called.endswith("optim.Optimizer")
        ):
            self.optimizers.add(name)
        elif last and _SCHEDULER_CALL.search(last):
            self.schedulers.add(name)

    def bind_in_order(self, name: str, value: ast.AST) -> None:
        """A binding met while walking: ``scaled = scaler.scale(loss)`` makes an alias, a rebinding drops it."""
        if not name:
            return
        self._learn_binding(name, value)
        if _scale_call(value) and self.is_scaler(_text(value.func.value)):
            self.scaled_aliases[name] = _text(value.func.value)
        else:
            self.scaled_aliases.pop(name, None)

    def is_scaler(self, text: str) -> bool:
        """A GradScaler: created or used as one, or named like one (``scaler``, ``self.grad_scaler``)."""
        if text in self.scalers:
            return True
        if _SCALER_NAME.search(text.rsplit(".", 1)[-1]):
            self.scalers[text] = True
            return True
        return False

    def is_optimizer(self, text: str) -> bool:
        if text in self.optimizers:
            return True
        if text in self.schedulers or text in self.scalers:
            return False
        last = text.rsplit(".", 1)[-1]
        return bool(_OPTIMIZER_NAME.search(last)) and not _SCHEDULER_NAME.search(last)

    def is_scheduler(self, text: str) -> bool:
        if text in self.schedulers:
            return True
        return bool(_SCHEDULER_NAME.search(text.rsplit(".", 1)[-1])) and text not in self.optimizers


def _scale_call(node: ast.AST) -> bool:
    """``<x>.scale(<loss>)``."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "scale"
        and len(node.args) == 1
    )


def _is_clip(call: ast.Call) -> bool:
    parts = _dotted(call.func).split(".")
    return parts[-1] in CLIP_FUNCS and (len(parts) == 1 or any(p in _TORCH_PARTS for p in parts[:-1]))


#: An ``if`` testing these already steps the scheduler only on real steps.
_SKIP_TEST = re.compile(r"get_scale|skip|_scale\b|found_inf")


def _unparse(node: ast.AST) -> str:
    try:
        return ast.unparse(node)
    except Exception:  # a malformed tree
        return ""


def _test_text(test: ast.AST) -> str:
    """An ``if`` test's source text, kept on the node."""
    text = getattr(test, "_mpdoctor_text", None)
    if text is None:
        text = test._mpdoctor_text = _unparse(test)
    return text


def _is_accumulation_guard(test: ast.AST) -> bool:
    """``(i + 1) % accum == 0``, ``step % k == 0``, ``accelerator.sync_gradients``, ``is_last_microbatch``..."""
    for node in ast.walk(test):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            return True
    return bool(_GUARD_WORDS.search(_test_text(test)))


# -- the abstract run ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Loc:
    """A line of a source."""

    source: Source
    node: ast.AST

    @property
    def line(self) -> int:
        return self.node.lineno

    @property
    def where(self) -> str:
        return self.source.where(self.node.lineno)

    @property
    def code(self) -> str:
        lines = self.source.lines
        first = lines[self.node.lineno - 1].strip() if 0 < self.node.lineno <= len(lines) else ""
        return first


#: The mode flags (``use_amp``, ``scaler is not None``) a path has assumed, with their truth.
Cond = frozenset


@dataclass(frozen=True)
class Fact:
    """A protocol call on some path: where, under which mode flags, inside an accumulation guard, in which loop."""

    loc: Loc
    cond: Cond = frozenset()
    guarded: bool = False
    loop: int = 0

    def holds_under(self, assumed: dict[str, bool]) -> bool:
        return all(assumed.get(test, truth) == truth for test, truth in self.cond)


@dataclass
class State:
    """What the protocol has done so far on the paths being walked."""

    #: scaler -> its scaled backward, with no unscale_/step since (must: every path)
    scaled: dict[str, Fact] = field(default_factory=dict)
    #: scaler -> its scaled backward, with no update() since (must)
    pending: dict[str, Fact] = field(default_factory=dict)
    #: (scaler, optimizer) -> unscale_ with no update() since (may: any path)
    unscaled: dict[tuple[str, str], Fact] = field(default_factory=dict)
    #: (scaler, optimizer) -> scaler.step with no update() since (may)
    stepped: dict[tuple[str, str], Fact] = field(default_factory=dict)
    #: scaler -> its last step (may)
    last_step: dict[str, Fact] = field(default_factory=dict)
    #: mode flag -> the truth this path assumes (inside ``if use_amp:``)
    assumed: dict[str, bool] = field(default_factory=dict)

    _TABLES = ("scaled", "pending", "unscaled", "stepped", "last_step")

    def copy(self) -> State:
        return State(*(dict(getattr(self, t)) for t in self._TABLES), dict(self.assumed))

    def fact(self, loc: Loc, **kw) -> Fact:
        return Fact(loc, frozenset(self.assumed.items()), **kw)

    def assuming(self, test: str, truth: bool) -> State:
        """This state on the branch where ``test`` is ``truth``: facts made under the opposite truth are dropped."""
        out = self.copy()
        out.assumed[test] = truth
        for t in self._TABLES:
            setattr(out, t, {k: f for k, f in getattr(out, t).items() if f.holds_under(out.assumed)})
        return out

    @staticmethod
    def merge(states: Sequence[State | None]) -> State | None:
        live = [s for s in states if s is not None]
        if not live:
            return None
        out = live[0].copy()
        for t in ("scaled", "pending"):  # must: on every path, or made under a flag the other paths exclude
            keys = {k for s in live for k in getattr(s, t)}
            kept = {}
            for k in keys:
                facts = [getattr(s, t).get(k) for s in live]
                made = next(f for f in facts if f is not None)
                if all(f is not None or not made.holds_under(s.assumed) for f, s in zip(facts, live)):
                    kept[k] = made
            setattr(out, t, kept)
        for s in live[1:]:
            out.unscaled = {**s.unscaled, **out.unscaled}
            out.stepped = {**s.stepped, **out.stepped}
            for k, rec in s.last_step.items():
                if k not in out.last_step or (rec.guarded and not out.last_step[k].guarded):
                    out.last_step[k] = rec
        return out


def _mode_flag(test: ast.AST) -> tuple[str, bool] | None:
    """``use_amp`` -> ("use_amp", True); ``not use_amp`` -> ("use_amp", False); ``scaler is not None`` ->
    ("scaler is None", False); None for a test that changes from one iteration to the next."""
    truth = True
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test, truth = test.operand, not truth
    if (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], (ast.Is, ast.IsNot, ast.Eq, ast.NotEq))
    ):
        if not (_dotted(test.left) and isinstance(test.comparators[0], ast.Constant)):
            return None
        if isinstance(test.ops[0], (ast.IsNot, ast.NotEq)):
            truth = not truth
            op = "is" if isinstance(test.ops[0], ast.IsNot) else "=="
        else:
            op = "is" if isinstance(test.ops[0], ast.Is) else "=="
        return f"{_dotted(test.left)} {op} {test.comparators[0].value!r}", truth
    if isinstance(test, ast.Call) and not test.args and _dotted(test.func):  # scaler.is_enabled()
        return f"{_dotted(test.func)}()", truth
    if _dotted(test):
        return _dotted(test), truth
    return None


@dataclass
class RawFinding:
    """A protocol mistake at a line, before it becomes a :class:`Finding`."""

    slug: str
    loc: Loc
    scaler: str
    optimizer: str = ""
    related: dict[str, Loc] = field(default_factory=dict)
    latent: bool = False  # the scaler is created with enabled=False: the mistake is harmless until enabled
    detail: str = ""
    scheduler: str = ""


class _Stop(Exception):
    """Internal: a path ended (return / break / raise)."""


class LoopReader:
    """Walks sources in order and collects protocol mistakes.

    Parameters
    ----------
    names : Names, optional
        What earlier code bound (created fresh when omitted).
    """

    MAX_INLINE_DEPTH = 4

    def __init__(self, names: Names | None = None) -> None:
        self.names = names or Names()
        self.state = State()
        self.found: dict[tuple[str, int, int], RawFinding] = {}
        self._source: Source | None = None
        self._guards = 0  # accumulation guards around the current statement, within the innermost loop
        self._loop = 0  # id of the innermost loop
        self._loops = 0
        self._in_loop = False
        self._inlining: list[str] = []
        self._continues: list[list[State]] = []
        self._returns: list[list[State]] = []
        self._inlined: set[str] = set()
        self._tests: list[str] = []  # the tests of the ifs around the current statement
        self._order: dict[int, int] = {}  # id(source) -> position in reading order

    # -- entry points ------------------------------------------------------------------------------------
    def read(self, source: Source) -> None:
        """Walk one source after the ones already read (its top level continues their run)."""
        self._order.setdefault(id(source), len(self._order))
        self._source = source
        state = self._block(source.tree.body, self.state)
        self.state = state if state is not None else State()

    def reset_walk(self) -> None:
        """Forget the walk's context after a source could not be walked (the findings so far stay)."""
        self._guards, self._in_loop, self._inlining = 0, False, []
        self._continues, self._returns, self._tests = [], [], []

    def finish(self) -> list[RawFinding]:
        """Walk the functions no code read has called (on their own), then return every mistake found."""
        for name, (source, node) in list(self.names.functions.items()):
            if name not in self._inlined:
                try:
                    self._standalone(source, node)
                except (
                    RecursionError,
                    MemoryError,
                    ValueError,
                    TypeError,
                    AttributeError,
                ):  # skipped, like a cell
                    self.reset_walk()
        return sorted(self.found.values(), key=lambda f: (self._order.get(id(f.loc.source), -1), f.loc.line))

    def _standalone(self, source: Source, node: ast.AST) -> None:
        saved = (self._source, self.state, self._guards, self._in_loop, self._loop)
        self._source, self._guards, self._in_loop = source, 0, False
        self._returns.append([])
        try:
            self._block(node.body, State())
        finally:
            self._returns.pop()
            self._source, self.state, self._guards, self._in_loop, self._loop = saved

    # -- statements --------------------------------------------------------------------------------------
    def _block(self, stmts: Iterable[ast.stmt], state: State | None) -> State | None:
        for stmt in stmts:
            if state is None:
                return None
            state = self._stmt(stmt, state)
        return state

    def _stmt(self, stmt: ast.stmt, state: State) -> State | None:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.names.functions[stmt.name] = (self._source, stmt)
            self._inlined.discard(stmt.name)  # a redefinition is read again
            return state
        if isinstance(stmt, ast.ClassDef):
            for item in stmt.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self._standalone(self._source, item)
            return state
        if isinstance(stmt, ast.If):
            return self._if(stmt, state)
        if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
            return self._loop_stmt(stmt, state)
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                self._expr(item.context_expr, state)
            return self._block(stmt.body, state)
        if isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            body = self._block(stmt.body, state.copy())
            handlers = [self._block(h.body, state.copy()) for h in stmt.handlers]
            out = State.merge([self._block(stmt.orelse, body) if body is not None else None, *handlers])
            return self._block(stmt.finalbody, out) if out is not None else None
        if type(stmt).__name__ == "Match":
            return State.merge([self._block(case.body, state.copy()) for case in stmt.cases] + [state])
        if isinstance(stmt, ast.Return):
            if stmt.value is not None:
                self._expr(stmt.value, state)
            if self._returns:
                self._returns[-1].append(state)
            return None
        if isinstance(stmt, ast.Continue):
            if self._continues:
                self._continues[-1].append(state)
            return None
        if isinstance(stmt, (ast.Break, ast.Raise)):
            return None
        if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            if stmt.value is not None:
                self._expr(stmt.value, state)
            if isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    for t in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                        self.names.bind_in_order(_text(t), stmt.value)
            return state
        if isinstance(stmt, ast.Expr):
            self._expr(stmt.value, state)
            return state
        return state

    def _if(self, stmt: ast.If, state: State) -> State | None:
        self._expr(stmt.test, state)
        guard = self._in_loop and _is_accumulation_guard(stmt.test)
        flag = None if guard else _mode_flag(stmt.test)
        if flag is not None and flag[0] in state.assumed:  # the flag is known on this path: one branch runs
            taken = stmt.body if state.assumed[flag[0]] == flag[1] else stmt.orelse
            return self._block(taken, state)
        body_in = state.assuming(*flag) if flag else state.copy()
        else_in = state.assuming(flag[0], not flag[1]) if flag else state.copy()
        self._guards += guard
        self._tests.append(_test_text(stmt.test))
        try:
            body = self._block(stmt.body, body_in)
        finally:
            self._guards -= guard
            self._tests.pop()
        other = self._block(stmt.orelse, else_in) if stmt.orelse else else_in
        out = State.merge([body, other])
        if out is not None:
            out.assumed = dict(state.assumed)  # the paths join again
        return out

    def _loop_stmt(self, stmt: ast.stmt, state: State) -> State | None:
        if isinstance(stmt, ast.While):
            self._expr(stmt.test, state)
        else:
            self._expr(stmt.iter, state)
        saved = (self._guards, self._loop, self._in_loop)
        self._loops += 1
        self._guards, self._loop, self._in_loop = 0, self._loops, True
        try:
            entry = state
            for _ in range(2):  # the second pass starts from what one iteration leaves behind
                self._continues.append([])
                end = self._block(stmt.body, entry.copy())
                entry_next = State.merge([end, *self._continues.pop()])
                if entry_next is None:
                    break
                entry = entry_next
        finally:
            self._guards, self._loop, self._in_loop = saved
        return self._block(stmt.orelse, entry) if stmt.orelse else entry

    # -- expressions: the protocol's calls, in evaluation order --------------------------------------------
    def _expr(self, node: ast.AST, state: State) -> None:
        for call in _calls_in_order(node):
            self._call(call, state)

    def _call(self, call: ast.Call, state: State) -> None:
        func = call.func
        if isinstance(func, ast.Name) and func.id in self.names.functions:
            self._inline(func.id, state)
            return
        if _is_clip(call):
            self._clip(call, state)
            return
        if not isinstance(func, ast.Attribute):
            return
        attr = func.attr
        if attr not in _PROTOCOL_ATTRS:
            return
        receiver = _text(func.value) if attr != "backward" else ""
        if attr == "backward" and _scale_call(func.value):  # x.scale(loss).backward(): x is a scaler
            self.names.scalers.setdefault(_text(func.value.func.value), True)
        if attr == "backward":
            scaler = self._scaled_by(func.value)
            if scaler:
                fact = state.fact(self._loc(call))
                state.scaled[scaler] = fact
                state.pending[scaler] = fact
            return
        if attr != "backward" and self.names.is_scaler(receiver):
            self._scaler_call(receiver, attr, call, state)
        elif attr == "step" and not call.args and self.names.is_scheduler(receiver):
            self._scheduler_step(receiver, call, state)
        elif attr == "step" and self.names.is_optimizer(receiver):
            self._optimizer_step(receiver, call, state)

    def _scaled_by(self, node: ast.AST) -> str:
        """The scaler that scaled the tensor ``node`` (``scaler.scale(loss)`` or a name bound to it), else ``""``."""
        if _scale_call(node):
            owner = _text(node.func.value)
            return owner if self.names.is_scaler(owner) else ""
        if isinstance(node, ast.BinOp):  # (scaler.scale(loss) / accum).backward()
            return self._scaled_by(node.left) or self._scaled_by(node.right)
        return self.names.scaled_aliases.get(_text(node), "")

    def _scaler_call(self, scaler: str, attr: str, call: ast.Call, state: State) -> None:
        loc = self._loc(call)
        opt = _text(call.args[0]) if call.args else ""
        if opt and attr in ("unscale_", "step"):
            self.names.optimizers.add(opt)
        if attr == "unscale_":
            key = (scaler, opt)
            if key in state.unscaled:
                self._report("amp-unscale-twice", loc, scaler, opt, first_unscale=state.unscaled[key].loc)
            state.unscaled[key] = state.fact(loc)
            state.scaled.pop(scaler, None)
        elif attr == "step":
            key = (scaler, opt)
            if key in state.stepped:
                self._report("amp-update-missing", loc, scaler, opt, previous_step=state.stepped[key].loc)
            state.stepped[key] = state.fact(loc)
            state.scaled.pop(scaler, None)
            state.last_step[scaler] = state.fact(loc, guarded=self._guards > 0, loop=self._loop)
        elif attr == "update":
            last = state.last_step.get(scaler)
            if (
                last is not None
                and last.guarded
                and self._guards == 0
                and last.loop == self._loop
                and self._in_loop
            ):
                self._report(
                    "amp-update-per-microbatch", loc, scaler, _opt_of(last.loc), guarded_step=last.loc
                )
            for table in (state.unscaled, state.stepped):
                for key in [k for k in table if k[0] == scaler]:
                    del table[key]
            state.scaled.pop(scaler, None)
            state.pending.pop(scaler, None)

    def _clip(self, call: ast.Call, state: State) -> None:
        if state.scaled:
            scaler, backward = next(iter(state.scaled.items()))
            opt = self._optimizer_for(scaler, state)
            self._report(
                "amp-clip-before-unscale", self._loc(call), scaler, opt, scaled_backward=backward.loc
            )

    def _optimizer_step(self, opt: str, call: ast.Call, state: State) -> None:
        for scaler, backward in state.pending.items():
            if any(k == (scaler, opt) for k in state.stepped):
                continue
            self._report(
                "amp-step-bypasses-scaler", self._loc(call), scaler, opt, scaled_backward=backward.loc
            )
            return

    def _scheduler_step(self, sched: str, call: ast.Call, state: State) -> None:
        # PyTorch's own recipe does this: harmless unless steps are skipped, so info at most, and only for a
        # schedule stepped in the loop that steps the scaler (an epoch-level schedule barely notices a skip).
        if not self._in_loop or any(_SKIP_TEST.search(t) for t in self._tests):
            return
        for scaler, rec in state.last_step.items():
            if rec.loop == self._loop:
                opt = _opt_of(rec.loc)
                self._report(
                    "amp-scheduler-on-skipped-steps",
                    self._loc(call),
                    scaler,
                    opt,
                    scheduler=sched,
                    scaler_step=rec.loc,
                )
                return

    def _optimizer_for(self, scaler: str, state: State) -> str:
        """The optimizer this scaler steps (seen so far, else the one optimizer known), for the corrected code."""
        for s, opt in list(state.stepped) + list(state.unscaled):
            if s == scaler and opt:
                return opt
        return ""

    def _inline(self, name: str, state: State) -> None:
        if name in self._inlining or len(self._inlining) >= self.MAX_INLINE_DEPTH:
            return
        source, node = self.names.functions[name]
        self._inlined.add(name)
        saved = self._source
        self._source = source
        self._inlining.append(name)
        self._returns.append([])
        self._continues.append([])  # a continue cannot cross a def; isolate the caller's loop
        try:
            end = self._block(node.body, state.copy())
            out = State.merge([end, *self._returns[-1]])
        finally:
            self._continues.pop()
            self._returns.pop()
            self._inlining.pop()
            self._source = saved
        if out is not None:
            state.scaled, state.pending, state.unscaled = out.scaled, out.pending, out.unscaled
            state.stepped, state.last_step, state.assumed = out.stepped, out.last_step, out.assumed

    # -- findings ------------------------------------------------------------------------------------------
    def _loc(self, node: ast.AST) -> Loc:
        return Loc(self._source, node)

    def _report(
        self, slug: str, loc: Loc, scaler: str, opt: str = "", scheduler: str = "", **related: Loc
    ) -> None:
        key = (slug, id(loc.source), loc.line)
        if key in self.found:
            return
        latent = not self.names.scalers.get(scaler, True)
        self.found[key] = RawFinding(slug, loc, scaler, opt, dict(related), latent, scheduler=scheduler)


def _opt_of(loc: Loc) -> str:
    node = loc.node
    return _text(node.args[0]) if isinstance(node, ast.Call) and node.args else ""


#: Nodes with no call inside (leaves, operators, contexts) and lambdas (their body runs later, if ever).
_NO_CALLS = (
    ast.Name,
    ast.Constant,
    ast.expr_context,
    ast.operator,
    ast.cmpop,
    ast.boolop,
    ast.unaryop,
    ast.Lambda,
)


def _calls_in_order(node: ast.AST) -> list[ast.Call]:
    """The calls in an expression in evaluation order (arguments before the call; not inside lambdas).

    Kept on the node: loop bodies are walked twice, and trees are cached across readings.
    """
    cached = getattr(node, "_mpdoctor_calls", None)
    if cached is not None:
        return cached
    out: list[ast.Call] = []

    def visit(n: ast.AST) -> None:
        if isinstance(n, _NO_CALLS):
            return
        if isinstance(n, ast.Call):
            visit(n.func)
            for a in n.args:
                visit(a)
            for kw in n.keywords:
                visit(kw.value)
            out.append(n)
            return
        for child in ast.iter_child_nodes(n):
            visit(child)

    visit(node)
    try:
        node._mpdoctor_calls = out
    except AttributeError:  # a node type without a __dict__
        pass
    return out


# -- corrected code ------------------------------------------------------------------------------------------


@dataclass
class Edit:
    """A change to one source's lines: insert before / after a statement, replace a span, delete a statement."""

    kind: str  # "before" | "after" | "replace" | "delete"
    stmt: ast.stmt
    text: str = ""
    node: ast.AST | None = None  # for "replace": the expression replaced within its line


def _parents(source: Source) -> dict[int, ast.AST]:
    """id(node) -> its parent, computed once per cached tree."""
    return _parent_map(source.code)


@lru_cache(maxsize=256)
def _parent_map(code: str) -> dict[int, ast.AST]:
    # Kept beside the parse cache, not on the tree: a tree holding its own parent map is a reference cycle,
    # and freeing thousands of cyclic trees costs the garbage collector more than the reading itself.
    tree = parse(code)
    if tree is None:
        return {}
    return {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _ancestors(source: Source, node: ast.AST) -> list[ast.AST]:
    parents, out = _parents(source), []
    while id(node) in parents:
        node = parents[id(node)]
        out.append(node)
    return out


def _statement_of(source: Source, node: ast.AST) -> ast.stmt | None:
    """The innermost statement holding ``node``."""
    if isinstance(node, ast.stmt):
        return node
    return next((a for a in _ancestors(source, node) if isinstance(a, ast.stmt)), None)


def _indent(source: Source, stmt: ast.stmt) -> str:
    line = source.lines[stmt.lineno - 1]
    return line[: len(line) - len(line.lstrip())]


def _window(source: Source, stmts: Sequence[ast.stmt]) -> tuple[int, int]:
    """Lines (1-based, inclusive) of the innermost loop (else function, else top-level run) holding ``stmts``."""
    lo = min(s.lineno for s in stmts)
    hi = max(s.end_lineno or s.lineno for s in stmts)
    around = [
        a
        for a in _ancestors(source, stmts[0])
        if isinstance(a, ast.stmt) and a.lineno <= lo and (a.end_lineno or a.lineno) >= hi
    ]
    for kinds in ((ast.For, ast.AsyncFor, ast.While), (ast.FunctionDef, ast.AsyncFunctionDef)):
        best = next((a for a in around if isinstance(a, kinds)), None)
        if best is not None:
            start = min([best.lineno] + [d.lineno for d in getattr(best, "decorator_list", [])])
            return start, best.end_lineno or best.lineno
    tops = [s for s in source.tree.body if (s.end_lineno or s.lineno) >= lo and s.lineno <= hi]
    return min(s.lineno for s in tops), max(s.end_lineno or s.lineno for s in tops)


def apply_edits(source: Source, edits: Sequence[Edit]) -> str:
    """The corrected lines: the window of ``source`` holding the edits, with the edits made, dedented."""
    lines = source.lines
    lo, hi = _window(source, [e.stmt for e in edits])
    before: dict[int, list[str]] = {}
    after: dict[int, list[str]] = {}
    deleted: set[int] = set()
    replaced: dict[int, str] = {}
    for e in edits:
        end = e.stmt.end_lineno or e.stmt.lineno
        if e.kind == "before":
            before.setdefault(e.stmt.lineno, []).extend(e.text.splitlines())
        elif e.kind == "after":
            after.setdefault(end, []).extend(e.text.splitlines())
        elif e.kind == "delete":
            deleted.update(range(e.stmt.lineno, end + 1))
        elif e.kind == "replace" and e.node is not None and e.node.lineno == e.node.end_lineno:
            line = replaced.get(e.node.lineno, lines[e.node.lineno - 1])
            replaced[e.node.lineno] = line[: e.node.col_offset] + e.text + line[e.node.end_col_offset :]
        elif e.kind == "replace":  # a whole statement replaced by new lines
            deleted.update(range(e.stmt.lineno, end + 1))
            before.setdefault(e.stmt.lineno, []).extend(e.text.splitlines())
    out: list[str] = []
    for n in range(lo, hi + 1):
        out.extend(before.get(n, []))
        if n not in deleted:
            out.append(replaced.get(n, lines[n - 1]))
        out.extend(after.get(n, []))
    indents = [len(x) - len(x.lstrip()) for x in out if x.strip()]
    cut = min(indents) if indents else 0
    return "\n".join(x[cut:] if x.strip() else "" for x in out).rstrip() + "\n"


def _template(slug: str, scaler: str, opt: str, sched: str = "") -> str:
    """The rule's corrected code with the user's names (when their own lines cannot be rewritten)."""
    code = RULES[slug].use_instead
    code = re.sub(r"\bscaler\b", scaler or "scaler", code)
    code = re.sub(r"\boptimizer\b", opt or "optimizer", code)
    code = re.sub(r"\bscheduler\b", sched or "scheduler", code)
    return code + "\n"


def corrected_code(raw: RawFinding, reader: LoopReader) -> str:
    """The user's own loop with the corrected lines (the rule's template with their names when that fails)."""
    try:
        code = _corrected(raw, reader)
    except Exception:  # a construct the rewriter does not know: the template still names their objects
        code = None
    return code or _template(raw.slug, raw.scaler, raw.optimizer, raw.scheduler)


def _find_calls(source: Source, receiver: str, attr: str) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(source.tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == attr
        and _text(n.func.value) == receiver
    ]


def _corrected(raw: RawFinding, reader: LoopReader) -> str | None:
    source, node = raw.loc.source, raw.loc.node
    stmt = _statement_of(source, node)
    if stmt is None:
        return None
    s, opt = raw.scaler, raw.optimizer
    indent = _indent(source, stmt)
    if raw.slug == "amp-clip-before-unscale":
        if not opt:
            steps = [c for c in _find_calls(source, s, "step") if c.args and c.lineno > node.lineno]
            opt = _text(steps[0].args[0]) if steps else ""
            raw.optimizer = opt
        if not opt:
            return None
        return apply_edits(
            source,
            [Edit("before", stmt, f"{indent}{s}.unscale_({opt})  # unscale first: clip the true gradients")],
        )
    if raw.slug == "amp-step-bypasses-scaler":
        edits = [Edit("replace", stmt, f"{s}.step({opt})", node=node)]
        updates = [c for c in _find_calls(source, s, "update") if c.lineno > node.lineno]
        if not updates:
            edits.append(Edit("after", stmt, f"{indent}{s}.update()"))
        return apply_edits(source, edits)
    if raw.slug == "amp-update-missing":
        return apply_edits(source, [Edit("after", stmt, f"{indent}{s}.update()  # once per real step")])
    if raw.slug == "amp-unscale-twice":
        steps = [c for c in _find_calls(source, s, "step") if _text(c.args[0]) == opt] if opt else []
        target = next((c for c in steps if c.lineno > node.lineno), steps[0] if steps else None)
        if target is None:
            return None
        target_stmt = _statement_of(source, target)
        if target_stmt is None or target_stmt.lineno <= stmt.lineno <= (target_stmt.end_lineno or 0):
            return None
        moved = [stmt]
        parent = _parent_body(source, stmt)
        if parent is not None:  # clipping right after the unscale moves with it
            k = parent.index(stmt)
            for nxt in parent[k + 1 :]:
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Call) and _is_clip(nxt.value):
                    moved.append(nxt)
                else:
                    break
        if any(m.lineno <= target_stmt.lineno <= (m.end_lineno or m.lineno) for m in moved):
            return None
        new_indent = _indent(source, target_stmt)
        lines = [line for m in moved for line in _reindent(source, m, new_indent)]
        lines[0] += "  # once per real step, after the last micro-batch"
        return apply_edits(
            source, [Edit("delete", m) for m in moved] + [Edit("before", target_stmt, "\n".join(lines))]
        )
    if raw.slug == "amp-update-per-microbatch":
        guarded = raw.related.get("guarded_step")
        if guarded is None or guarded.source is not source:
            return None
        target_stmt = _statement_of(source, guarded.node)
        if target_stmt is None:
            return None
        return apply_edits(
            source,
            [
                Edit("delete", stmt),
                Edit(
                    "after",
                    target_stmt,
                    f"{_indent(source, target_stmt)}{s}.update()  # once per real step, with the step",
                ),
            ],
        )
    if raw.slug == "amp-scheduler-on-skipped-steps":
        step = raw.related.get("scaler_step")
        if step is None or step.source is not source:
            return None
        step_stmt = _statement_of(source, step.node)
        if step_stmt is None or _parent_body(source, step_stmt) is not _parent_body(source, stmt):
            return None
        sched = raw.scheduler or _text(node.func.value)
        return apply_edits(
            source,
            [
                Edit("before", step_stmt, f"{_indent(source, step_stmt)}scale_before = {s}.get_scale()"),
                Edit(
                    "replace",
                    stmt,
                    f"{indent}if {s}.get_scale() >= scale_before:  # the step was not skipped\n{indent}    {sched}.step()",
                ),
            ],
        )
    return None


def _reindent(source: Source, stmt: ast.stmt, indent: str) -> list[str]:
    """The lines of ``stmt`` moved to ``indent`` (its continuation lines keep their relative indent)."""
    lines = source.lines[stmt.lineno - 1 : stmt.end_lineno or stmt.lineno]
    cut = len(lines[0]) - len(lines[0].lstrip())
    return [indent + line[cut:] if line[:cut].strip() == "" else indent + line.lstrip() for line in lines]


def _stmt_text(source: Source, stmt: ast.stmt) -> str:
    lines = source.lines[stmt.lineno - 1 : stmt.end_lineno or stmt.lineno]
    return "\n".join(lines)


def _parent_body(source: Source, stmt: ast.stmt) -> list | None:
    node = _parents(source).get(id(stmt))
    if node is not None:
        for name in ("body", "orelse", "finalbody", "handlers"):
            body = getattr(node, name, None)
            if isinstance(body, list) and any(x is stmt for x in body):
                return body
    return None


# -- findings ------------------------------------------------------------------------------------------------


_WHAT = {
    "amp-clip-before-unscale": "{code} clips {scaler}'s scaled gradients (scaled backward {scaled_backward}; no {scaler}.unscale_ before it)",
    "amp-step-bypasses-scaler": "{code} steps on gradients {scaler} scaled ({scaled_backward}), bypassing {scaler}.step",
    "amp-unscale-twice": "{code} runs again before {scaler}.update() (first {first_unscale})",
    "amp-update-missing": "{code} runs again with no {scaler}.update() since its step {previous_step}",
    "amp-update-per-microbatch": "{code} runs every micro-batch while {scaler}.step runs once per accumulated step "
    "({guarded_step}); on a micro-batch without a step, update() asserts 'No inf checks were recorded prior to update.'",
    "amp-scheduler-on-skipped-steps": "{code} steps the schedule after every {scaler}.step ({scaler_step}), also on "
    "the steps the scaler skips; harmless while no step is skipped (an fp16 run skips its first few while the scale falls)",
}


def to_finding(raw: RawFinding, reader: LoopReader) -> Finding:
    """The :class:`Finding` for a mistake: the rule's slug and severity, the cell and line, the corrected lines."""
    from ..treatment.fixes import Applicability, Fix

    rule = RULES[raw.slug]
    severity = "info" if raw.slug == "amp-scheduler-on-skipped-steps" or raw.latent else rule.severity
    where = raw.loc.where
    code = raw.loc.code
    related = {
        k: ("on the previous iteration" if v.node is raw.loc.node else f"at {v.where}")
        for k, v in raw.related.items()
    }
    what = _WHAT[raw.slug].format(code=f"`{code}`", scaler=raw.scaler or "the scaler", **related)
    latent = (
        f" ({raw.scaler} is created with enabled=False: harmless until it is enabled)" if raw.latent else ""
    )
    message = f"{where}: {what}{latent}; {_WHY.get(raw.slug, rule.why)}"
    fixed = corrected_code(raw, reader)
    evidence = {
        "cell": raw.loc.source.label,
        "line": raw.loc.line + raw.loc.source.line_offset,
        "code": code,
        "scaler": raw.scaler,
        **({"optimizer": raw.optimizer} if raw.optimizer else {}),
        **{k: v.where for k, v in raw.related.items()},
    }
    fix = Fix(
        _FIX_TITLE[raw.slug].format(scaler=raw.scaler, opt=raw.optimizer or "optimizer", where=where),
        fixed,
        applicability=Applicability.DISPLAY_ONLY,
        recipe=raw.slug,
        slug=raw.slug,
    )
    fix.finding_subject = where
    return Finding(
        check=raw.slug, severity=severity, subject=where, message=message, evidence=evidence, fixes=[fix]
    )


#: Measured on this CPU where it differs from the shared rule's text: a 0.1 clip on scaled gradients bites on
#: every step, then scaler.step divides the clipped gradient by the scale again (tests/test_loop_reader.py).
_WHY = {
    "amp-clip-before-unscale": "the norm it measures is the true norm x the scale (65536 to start), so it clips at "
    "max_norm x scale: almost every step is clipped to max_norm, then scaler.step divides that by the scale again, and "
    "the update is thousands of times too small (with a very small scale the clip never bites)",
}

_FIX_TITLE = {
    "amp-clip-before-unscale": "Call {scaler}.unscale_({opt}) before clipping ({where})",
    "amp-step-bypasses-scaler": "Step through {scaler}.step({opt}) ({where})",
    "amp-unscale-twice": "Unscale once per real step, after the last micro-batch ({where})",
    "amp-update-missing": "Call {scaler}.update() after every {scaler}.step ({where})",
    "amp-update-per-microbatch": "Call {scaler}.update() once per real step, beside {scaler}.step ({where})",
    "amp-scheduler-on-skipped-steps": "Step the scheduler only when {scaler} did not skip the step ({where})",
}


def read_sources(sources: Iterable[Source], names: Names | None = None) -> list[Finding]:
    """The protocol mistakes in ``sources`` read in order (names bound by earlier ones are known to later ones).

    Parameters
    ----------
    sources : iterable of Source
        Cells in execution order, or one script.
    names : Names, optional
        Bindings known beforehand.

    Returns
    -------
    list of Finding
        One per mistake, each naming its cell and line, with the corrected lines as a display-only fix.
        The same mistake in a cell run again is reported once, at its latest run.
    """
    reader = LoopReader(names)
    for source in sources:
        saved = reader.state.copy()
        try:
            reader.read(source)
        except (
            RecursionError,
            MemoryError,
            ValueError,
            TypeError,
            AttributeError,
        ):  # a pathological cell is skipped
            reader.state = saved
            reader.reset_walk()
    raws = reader.finish()
    latest: dict[tuple[str, int, str], RawFinding] = {}
    for raw in raws:  # a cell run again: report its latest run only
        key = (raw.slug, raw.loc.line, raw.loc.source.code)
        latest.pop(key, None)
        latest[key] = raw
    findings = [to_finding(raw, reader) for raw in latest.values()]
    findings.sort(key=lambda f: f.rank)  # stable: in reading order within a severity
    return findings


def read_code(code: str, label: str = "<code>") -> list[Finding]:
    """The protocol mistakes in one code string (never executed)."""
    source = source_of(label, code)
    return read_sources([source]) if source is not None else []
