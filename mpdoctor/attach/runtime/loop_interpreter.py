"""The abstract interpreter of a hand-written AMP loop: what each statement does with the scalers and optimizers.

Each source (a notebook cell, a script) is walked in program order as an abstract run of the protocol
``scale(loss).backward()`` -> ``unscale_`` at most once per real step -> clipping -> ``scaler.step(opt)`` ->
``update()``: loop bodies are walked twice (the second pass sees what one iteration leaves for the next), an
accumulation guard (``if (i + 1) % accum == 0:``) marks the calls that run once per real step, a call to a
function defined in the code read (``train_step(batch)``) walks its body at the call. Sources are read in
order with what earlier ones defined (a scaler created in one cell, the loop in the next).

The analysis is calibrated against the correct recipes: what it cannot prove wrong it does not report. A
scaled backward is "pending" only when every path made it (an ``if use_amp:`` branch and its plain ``else``
leave nothing pending); an ``unscale_`` or ``step`` not yet followed by ``update()`` counts when any path
made it (that is the path that raises). The mistakes found are :class:`LoopMistake` s;
:mod:`mpdoctor.attach.runtime.loop_findings` turns them into findings.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ...facts.location import Location
from ...objects.readers.loop_source import Source, dotted, text_of, unparse

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

    def copy(self) -> Names:
        """An independent copy for another reading: new containers; the functions' sources and trees, which no
        reading changes, are shared (a deep copy of them cost 4 s for a notebook of 200 cells)."""
        return Names(dict(self.scalers), set(self.optimizers), set(self.schedulers), dict(self.functions),
                     dict(self.scaled_aliases))  # fmt: skip

    def _learn_binding(self, name: str, value: ast.AST) -> None:
        if not name:
            return
        if isinstance(value, ast.Attribute) and value.attr == "scaler":  # accelerator.scaler, trainer.scaler
            self.scalers[name] = True
        if not isinstance(value, ast.Call):
            return
        called = dotted(value.func)
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
        if _scale_call(value) and self.is_scaler(text_of(value.func.value)):
            self.scaled_aliases[name] = text_of(value.func.value)
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


def is_clip(call: ast.Call) -> bool:
    """A call of torch's gradient clipping (``torch.nn.utils.clip_grad_norm_``, ``clip_grad_norm_``)."""
    parts = dotted(call.func).split(".")
    return parts[-1] in CLIP_FUNCS and (len(parts) == 1 or any(p in _TORCH_PARTS for p in parts[:-1]))


#: An ``if`` testing these already steps the scheduler only on real steps.
_SKIP_TEST = re.compile(r"get_scale|skip|_scale\b|found_inf")

def _test_text(test: ast.AST) -> str:
    """An ``if`` test's source text, kept on the node."""
    text = getattr(test, "_mpdoctor_text", None)
    if text is None:
        text = test._mpdoctor_text = unparse(test)
    return text


def _is_accumulation_guard(test: ast.AST) -> bool:
    """``(i + 1) % accum == 0``, ``step % k == 0``, ``accelerator.sync_gradients``, ``is_last_microbatch``..."""
    for node in ast.walk(test):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            return True
    return bool(_GUARD_WORDS.search(_test_text(test)))


# -- the abstract run ----------------------------------------------------------------------------------------


#: The mode flags (``use_amp``, ``scaler is not None``) a path has assumed, with their truth.
Cond = frozenset


@dataclass(frozen=True)
class ProtocolCall:
    """A call of the protocol on some path: where, under which mode flags, inside an accumulation guard, in
    which loop.

    Attributes
    ----------
    source : Source
        The cell or script holding the call.
    node : ast.AST
        The call in ``source``'s parse tree: the rewriter edits around it.
    cond : frozenset of (str, bool)
        The mode flags the path assumed when it made the call.
    guarded : bool
        Whether an accumulation guard was around it (it runs once per real step).
    loop : int
        The id of the innermost loop holding it.
    """

    source: Source
    node: ast.AST
    cond: Cond = frozenset()
    guarded: bool = False
    loop: int = 0

    @property
    def line(self) -> int:
        """The line in the parse tree (the line the user sees is :attr:`location`'s)."""
        return self.node.lineno

    @property
    def location(self) -> Location:
        return self.source.location(self.node.lineno)

    def holds_under(self, assumed: dict[str, bool]) -> bool:
        return all(assumed.get(test, truth) == truth for test, truth in self.cond)


@dataclass
class State:
    """What the protocol has done so far on the paths being walked."""

    #: scaler -> its scaled backward, with no unscale_/step since (must: every path)
    scaled: dict[str, ProtocolCall] = field(default_factory=dict)
    #: scaler -> its scaled backward, with no update() since (must)
    pending: dict[str, ProtocolCall] = field(default_factory=dict)
    #: (scaler, optimizer) -> unscale_ with no update() since (may: any path)
    unscaled: dict[tuple[str, str], ProtocolCall] = field(default_factory=dict)
    #: (scaler, optimizer) -> scaler.step with no update() since (may)
    stepped: dict[tuple[str, str], ProtocolCall] = field(default_factory=dict)
    #: scaler -> its last step (may)
    last_step: dict[str, ProtocolCall] = field(default_factory=dict)
    #: mode flag -> the truth this path assumes (inside ``if use_amp:``)
    assumed: dict[str, bool] = field(default_factory=dict)

    _TABLES = ("scaled", "pending", "unscaled", "stepped", "last_step")

    def copy(self) -> State:
        return State(*(dict(getattr(self, t)) for t in self._TABLES), dict(self.assumed))

    def call(self, at: ProtocolCall, **kw) -> ProtocolCall:
        """The call ``at``, as made on this path (under its mode flags)."""
        return ProtocolCall(at.source, at.node, frozenset(self.assumed.items()), **kw)

    def assuming(self, test: str, truth: bool) -> State:
        """This state on the branch where ``test`` is ``truth``: calls made under the opposite truth are dropped."""
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
        if not (dotted(test.left) and isinstance(test.comparators[0], ast.Constant)):
            return None
        if isinstance(test.ops[0], (ast.IsNot, ast.NotEq)):
            truth = not truth
            op = "is" if isinstance(test.ops[0], ast.IsNot) else "=="
        else:
            op = "is" if isinstance(test.ops[0], ast.Is) else "=="
        return f"{dotted(test.left)} {op} {test.comparators[0].value!r}", truth
    if isinstance(test, ast.Call) and not test.args and dotted(test.func):  # scaler.is_enabled()
        return f"{dotted(test.func)}()", truth
    if dotted(test):
        return dotted(test), truth
    return None


@dataclass
class LoopMistake:
    """A protocol mistake at a call, before it becomes a :class:`~mpdoctor.rules.engine.findings.Finding`.

    Attributes
    ----------
    slug : str
        The rule broken (:data:`mpdoctor.attach.runtime.protocol_rules.RULES`).
    at : ProtocolCall
        The call that breaks it.
    scaler, optimizer, scheduler : str
        The names the code holds them by (``""`` when unknown).
    related : dict of str to ProtocolCall
        The earlier calls the message cites (``first_unscale``, ``scaled_backward``, ...).
    latent : bool
        The scaler is created with ``enabled=False``: the mistake is harmless until it is enabled.
    """

    slug: str
    at: ProtocolCall
    scaler: str
    optimizer: str = ""
    related: dict[str, ProtocolCall] = field(default_factory=dict)
    latent: bool = False
    scheduler: str = ""


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
        self.found: dict[tuple[str, int, int], LoopMistake] = {}
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

    def finish(self, standalone: bool = True) -> list[LoopMistake]:
        """Walk the functions no code read has called (on their own, unless ``standalone`` is False: a corrected
        loop read again is checked by itself), then return every mistake found."""
        for name, (source, node) in list(self.names.functions.items()) if standalone else ():
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
        return sorted(self.found.values(), key=lambda f: (self._order.get(id(f.at.source), -1), f.at.line))

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
        """The state after ``stmt`` (None when no path goes on past it: return, break, raise)."""
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return self._definition(stmt, state)
        if isinstance(stmt, ast.If):
            return self._if(stmt, state)
        if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
            return self._loop_stmt(stmt, state)
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                self._expr(item.context_expr, state)
            return self._block(stmt.body, state)
        if isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            return self._try(stmt, state)
        if type(stmt).__name__ == "Match":
            return State.merge([self._block(case.body, state.copy()) for case in stmt.cases] + [state])
        if isinstance(stmt, (ast.Return, ast.Continue, ast.Break, ast.Raise)):
            return self._jump(stmt, state)
        if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            return self._assign(stmt, state)
        if isinstance(stmt, ast.Expr):
            self._expr(stmt.value, state)
        return state

    def _definition(self, stmt: ast.stmt, state: State) -> State:
        # A function is walked where it is called (else on its own at the end); a class's methods on their own.
        if isinstance(stmt, ast.ClassDef):
            for item in stmt.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self._standalone(self._source, item)
            return state
        self.names.functions[stmt.name] = (self._source, stmt)
        self._inlined.discard(stmt.name)  # a redefinition is read again
        return state

    def _try(self, stmt: ast.stmt, state: State) -> State | None:
        body = self._block(stmt.body, state.copy())
        handlers = [self._block(h.body, state.copy()) for h in stmt.handlers]
        out = State.merge([self._block(stmt.orelse, body) if body is not None else None, *handlers])
        return self._block(stmt.finalbody, out) if out is not None else None

    def _jump(self, stmt: ast.stmt, state: State) -> None:
        # The path ends here; a return or continue hands its state to where the path resumes.
        if isinstance(stmt, ast.Return):
            if stmt.value is not None:
                self._expr(stmt.value, state)
            if self._returns:
                self._returns[-1].append(state)
        elif isinstance(stmt, ast.Continue) and self._continues:
            self._continues[-1].append(state)
        return None

    def _assign(self, stmt: ast.Assign | ast.AnnAssign | ast.AugAssign, state: State) -> State:
        if stmt.value is not None:
            self._expr(stmt.value, state)
        if isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                for t in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                    self.names.bind_in_order(text_of(t), stmt.value)
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
        if is_clip(call):
            self._clip(call, state)
            return
        if not isinstance(func, ast.Attribute):
            return
        attr = func.attr
        if attr not in _PROTOCOL_ATTRS:
            return
        receiver = text_of(func.value) if attr != "backward" else ""
        if attr == "backward" and _scale_call(func.value):  # x.scale(loss).backward(): x is a scaler
            self.names.scalers.setdefault(text_of(func.value.func.value), True)
        if attr == "backward":
            scaler = self._scaled_by(func.value)
            if scaler:
                made = state.call(self._at(call))
                state.scaled[scaler] = made
                state.pending[scaler] = made
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
            owner = text_of(node.func.value)
            return owner if self.names.is_scaler(owner) else ""
        if isinstance(node, ast.BinOp):  # (scaler.scale(loss) / accum).backward()
            return self._scaled_by(node.left) or self._scaled_by(node.right)
        return self.names.scaled_aliases.get(text_of(node), "")

    def _scaler_call(self, scaler: str, attr: str, call: ast.Call, state: State) -> None:
        at = self._at(call)
        opt = text_of(call.args[0]) if call.args else ""
        if opt and attr in ("unscale_", "step"):
            self.names.optimizers.add(opt)
        if attr == "unscale_":
            key = (scaler, opt)
            if key in state.unscaled:
                self._report("amp-unscale-twice", at, scaler, opt, first_unscale=state.unscaled[key])
            state.unscaled[key] = state.call(at)
            state.scaled.pop(scaler, None)
        elif attr == "step":
            key = (scaler, opt)
            if key in state.stepped:
                self._report("amp-update-missing", at, scaler, opt, previous_step=state.stepped[key])
            state.stepped[key] = state.call(at)
            state.scaled.pop(scaler, None)
            state.last_step[scaler] = state.call(at, guarded=self._guards > 0, loop=self._loop)
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
                    "amp-update-per-microbatch", at, scaler, _opt_of(last), guarded_step=last
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
                "amp-clip-before-unscale", self._at(call), scaler, opt, scaled_backward=backward
            )

    def _optimizer_step(self, opt: str, call: ast.Call, state: State) -> None:
        for scaler, backward in state.pending.items():
            if any(k == (scaler, opt) for k in state.stepped):
                continue
            self._report(
                "amp-step-bypasses-scaler", self._at(call), scaler, opt, scaled_backward=backward
            )
            return

    def _scheduler_step(self, sched: str, call: ast.Call, state: State) -> None:
        # PyTorch's own recipe does this: harmless unless steps are skipped, so info at most, and only for a
        # schedule stepped in the loop that steps the scaler (an epoch-level schedule barely notices a skip).
        if not self._in_loop or any(_SKIP_TEST.search(t) for t in self._tests):
            return
        for scaler, rec in state.last_step.items():
            if rec.loop == self._loop:
                opt = _opt_of(rec)
                self._report(
                    "amp-scheduler-on-skipped-steps",
                    self._at(call),
                    scaler,
                    opt,
                    scheduler=sched,
                    scaler_step=rec,
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
    def _at(self, node: ast.AST) -> ProtocolCall:
        return ProtocolCall(self._source, node)

    def _report(
        self, slug: str, at: ProtocolCall, scaler: str, opt: str = "", scheduler: str = "", **related: ProtocolCall
    ) -> None:
        key = (slug, id(at.source), at.line)
        if key in self.found:
            return
        latent = not self.names.scalers.get(scaler, True)
        self.found[key] = LoopMistake(slug, at, scaler, opt, dict(related), latent, scheduler=scheduler)


def _opt_of(call: ProtocolCall) -> str:
    node = call.node
    return text_of(node.args[0]) if isinstance(node, ast.Call) and node.args else ""


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

