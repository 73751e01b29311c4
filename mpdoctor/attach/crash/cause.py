"""Explain one exception: diagnose the objects of its frames and mark the finding that caused it.

This module imports no torch at import time: the renderers read
:func:`cause_label` from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

from ...render.formatting import cause_label  # noqa: F401  (the renderers' view of a cause; re-exported)

#: Longest exception summary shown in a report heading.
SUMMARY_CHARS = 240


def exception_summary(exc: BaseException) -> str:
    """``"RuntimeError: first line of the message"``, shortened and redacted; never calls ``__str__``."""
    from ...redact import redact
    from .frames import _TYPE_QUALNAME
    from .patterns import exception_message

    try:
        name = _TYPE_QUALNAME(type(exc))
    except Exception:
        name = "Exception"
    message = exception_message(exc)
    if not message:
        return redact(str(name))
    first = message.strip().splitlines()[0] if message.strip() else ""
    if len(first) > SUMMARY_CHARS:
        first = first[: SUMMARY_CHARS - 3] + "..."
    return redact(f"{name}: {first}")


def explain(
    exc: BaseException,
    tb: TracebackType | None = None,
    *objects: Any,
    namespace: Mapping[str, Any] | None = None,
    names: Mapping[int, str] | None = None,
    target: str | None = None,
    scan: bool | None = None,
    ignore: Iterable[str] = (),
) -> Any:
    """Diagnose the objects around a known mixed-precision exception, the finding that explains it first.

    Parameters
    ----------
    exc : BaseException
        The exception raised.
    tb : traceback, optional
        Its traceback (default: ``exc.__traceback__``); the locals of its user
        frames are inspected, innermost :data:`~mpdoctor.attach.crash.frames.MAX_FRAMES` at most.
    *objects
        Objects to inspect as well (the watched model and optimizer).
    namespace : mapping, optional
        A namespace to inspect first (IPython's ``user_ns``): its names win
        over the frames' local names for the same object.
    names, target, ignore
        As for :func:`mpdoctor.diagnose`.
    scan : bool, optional
        Scan values; default: only for failures about values (NaN/Inf).

    Returns
    -------
    Report or None
        None when ``exc`` is not a known mixed-precision failure. Otherwise the
        report, with ``report.cause`` (the explaining finding, first in
        ``report.findings``) and ``report.exception`` (a one-line summary).
    """
    from ...diagnosis import diagnose
    from .frames import frame_namespace, traceback_frames
    from .patterns import match_exception

    matched = match_exception(exc)
    if matched is None:
        return None
    pattern, link = matched
    if tb is None:
        tb = BaseException.__dict__["__traceback__"].__get__(exc)
    frames = traceback_frames(tb)
    inner_tb = BaseException.__dict__["__traceback__"].__get__(link)
    if link is not exc and inner_tb is not None:
        frames = frames + traceback_frames(inner_tb)
    merged = frame_namespace(frames, namespace)
    report = diagnose(
        *objects,
        namespace=merged,
        names=names,
        target=target,
        scan=pattern.scan if scan is None else scan,
        ignore=ignore,
    )
    report = _with_watched_loop(report, pattern, frames)
    if objects and type(merged) is dict:  # the watched model by its name: the failing module is found inside it
        given = {s.name: s.obj for s in report.subjects if s.name.isidentifier() and any(s.obj is o for o in objects)}
        merged = {**given, **merged}
    report = mark_cause(report, pattern, link, frames, namespace=merged)
    return _batch_cause(report, pattern.slug, frames, merged, objects)


def _with_watched_loop(report: Any, pattern: Any, frames: list) -> Any:
    """A protocol error the loop watcher saw happen: its finding joins the report, so the cause is the mistake it
    named (the same finding, slug and fix the cell or script showed), not the family's generic note."""
    if getattr(pattern, "kind", "") != "protocol" or not pattern.checks:
        return report
    try:
        from ..runtime.protocol import watched_findings
        from .operands import loop_line

        line = loop_line(frames)
        seen = watched_findings(pattern.checks, line.place) if line is not None else []
    except Exception:  # the family's own note stands
        return report
    held = {id(f) for f in report.findings}
    return report.evolve(findings=(*report.findings, *(f for f in seen if id(f) not in held))) if seen else report


def _line_label(frame: Any) -> str:
    """``cell [5], line 3`` / ``train.py:42`` for a frame (never IPython's ``<ipython-input-5-...>`` filename)."""
    from ...facts.location import Location

    return Location.at(frame.filename, frame.lineno).label


def _batch_cause(report: Any, slug: str, frames: list, namespace: Mapping[str, Any], objects: tuple) -> Any:
    """A dtype error raised by a layer fed a batch entry of another dtype: name the entry and the layer first.
    Returns the report with that cause, or ``report`` as it was."""
    try:
        from ..runtime.boundary import crash_finding

        finding = crash_finding(slug, frames, namespace, objects, report.live)
        if finding is None:  # a pipeline's component raised: its module and tensors are in library frames
            from .frames import component_call

            component = component_call(frames, namespace)
            if component:
                finding = crash_finding(slug, frames, {**namespace, **component}, objects, report.live)
    except Exception:  # the pattern's cause stands without it
        return report
    if finding is None:
        return report
    finding.fixes = _at_entry_points(finding, frames, report.live)
    for fx in finding.fixes:  # built beside the finding, not through a check: they carry its slug from here
        fx.slug = fx.slug or finding.check
    # Its fixes stay bound as crash_finding bound them: the failing batch is not in a re-diagnosis at rest,
    # so re-planning through the treatment would find them "no longer needed".
    previous = report.cause
    if previous is not None and isinstance(previous.evidence, dict):
        # The failing op's two tensors and the cast (the exception family's reading) stay beside the batch entry.
        finding.evidence = {**previous.evidence, **finding.evidence}
    return report.evolve(findings=(finding, *report.findings), cause=finding, **_plans_led_by(report, finding))


def _plans_led_by(report: Any, cause: Any) -> dict:
    """The report's plans with the cause's first in-place fix at their head.

    The plan was made by a diagnosis at rest, which never saw the failing batch: without this, "Apply all safe
    fixes" would apply the rest of the plan and leave the very call that raised raising. The cause's other
    in-place fixes stay on its finding as alternatives.
    """
    from ...rules.engine.rules import Applicability

    in_place = [fx for fx in cause.fixes if fx.applicability is not Applicability.DISPLAY_ONLY]
    if not in_place:
        return {}
    lead = in_place[0]
    for other in in_place[1:]:
        other.planned = False
        other.note = other.note or f"an alternative to {lead.title!r}, which the plan applies"
    plans = {"plan": (lead, *(fx for fx in report.fixes if fx is not lead))}
    safe = [fx for fx in report.safe_fixes if fx is not lead]
    plans["safe_plan"] = (lead, *safe) if lead.safe else tuple(safe)
    return plans


def _at_entry_points(finding: Any, frames: list, live: Any) -> list:
    """The finding's fixes, its input cast widened to the call the user made (``vae.decode``, ``model.generate``).

    A forward pre-hook alone never runs for ``vae.decode(z)``: the fix would be "applied" and the user's
    very call would raise again.
    """
    from ...rules.checks.batch_inputs import input_cast_fix
    from ...rules.engine.changes import CastInputsHook
    from .frames import entry_points

    out = []
    for fx in finding.fixes:
        spec = next((c for c in fx.changes if isinstance(c, CastInputsHook)), None)
        model = live.get(spec.ref) if spec is not None and spec.ref in live else None
        entries = entry_points(frames, model) if model is not None else ()
        if not entries or spec.covers(*entries[0]):
            out.append(fx)
            continue
        out.append(input_cast_fix(spec.label, spec.ref, spec.dtype, entries).bind(live))
    return out


def _raiser(report: Any, frames: list) -> tuple[str, str, str] | None:
    """(name, kind, where) of the innermost inspected object whose method is on the failing stack, or None."""
    from .frames import raising_objects

    try:
        raisers = raising_objects(frames)
    except Exception:  # the cause is still marked, without naming the raiser
        return None
    by_id: dict[int, Any] = {}
    for s in report.subjects:
        by_id.setdefault(id(s.obj), s)
        by_id.setdefault(id(getattr(s, "inner", s.obj)), s)
    for r in raisers:
        s = by_id.get(id(r.obj))
        if s is not None:
            return s.name, s.kind, r.where
    return None


def _mentions(text: str, name: str) -> bool:
    import re

    return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", text) is not None


def _concerns(finding: Any, raiser: tuple[str, str, str] | None) -> bool:
    """True when the finding is about the object that raised (its subject, or named in its evidence)."""
    if raiser is None:
        return False
    name = raiser[0]
    if finding.subject == name:
        return True
    evidence = finding.evidence if isinstance(finding.evidence, dict) else {}
    return any(v == name or (isinstance(v, (list, tuple)) and name in v) for v in evidence.values())


def _name_the_raiser(cause: Any, raiser: tuple[str, str, str], report: Any) -> Any:
    """The cause, naming the object that raised: its evidence says so, and a message written at rest about
    another object of the same kind (``scaler`` of two enabled GradScalers) names the one that raised."""
    import re

    name, kind, where = raiser
    if isinstance(cause.evidence, dict):
        cause = dataclasses.replace(cause, evidence={"raised_by": f"{name} ({where})", **cause.evidence})
    if _mentions(cause.message, name):
        return cause
    others = [s.name for s in report.subjects if s.kind == kind and s.name != name and _mentions(cause.message, s.name)]
    if len(others) == 1:
        cause = dataclasses.replace(
            cause, message=re.sub(rf"(?<![\w.]){re.escape(others[0])}(?![\w])", name, cause.message)
        )
    return cause


def mark_cause(report: Any, pattern: Any, exc: BaseException, frames: list,
               namespace: Mapping[str, Any] | None = None) -> Any:  # fmt: skip
    """A new report: the finding that explains ``exc`` first, as ``cause``, with ``exception`` and ``raised_by``.

    When no finding of the pattern's checks is in the report (the objects are
    out of reach, or no check covers them), a cause note built from the
    pattern takes its place: what the message means and the generic fix, with
    the dtypes of the tensors in the innermost frames as evidence.
    """
    summary = exception_summary(exc)
    raiser = _raiser(report, frames)
    rank = {slug: i for i, slug in enumerate(pattern.checks)}
    candidates = [f for f in report.findings if f.check in rank]
    detail = _redacted(family_detail(pattern, exc, frames, namespace))
    if candidates:
        # The finding about the object that raised first: of two GradScalers, the one whose unscale_ failed.
        chosen = min(candidates, key=lambda f: (rank[f.check], not _concerns(f, raiser), f.rank))
        cause = _name_the_raiser(chosen, raiser, report) if raiser else chosen
        if detail is not None:  # the check's finding explains it; the failing op's tensors go beside it
            # ...without overwriting the finding's own line: it is what makes it the mistake the loop showed.
            extra = {k: v for k, v in detail.evidence.items() if k not in cause.evidence}
            cause = dataclasses.replace(cause, evidence={**cause.evidence, **extra})
        rest = [f for f in report.findings if f is not chosen]
        plans: dict = {}
    else:
        cause = _cause_note(pattern, summary, frames, detail, getattr(report, "live", None))
        rest = list(report.findings)
        plans = _plans_led_by(report, cause)  # its in-place fix, bound to what the frames held, leads the plan
    return report.evolve(findings=(cause, *rest), cause=cause, exception=summary,
                         raised_by=raiser[0] if raiser else None, **plans)  # fmt: skip


def _redacted(detail: Any) -> Any:
    """User names and source lines reach the report: redacted like every user string."""
    from ...redact import redact

    if detail is not None:
        detail.evidence = {k: redact(v) if type(v) is str else v for k, v in detail.evidence.items()}
        detail.sentence, detail.code = redact(detail.sentence), redact(detail.code)
    return detail


def _cause_note(pattern: Any, summary: str, frames: list, detail: Any, live: Any = None) -> Any:
    """The cause built from the pattern when no check's finding explains the exception: what the message means,
    the generic fix, the tensors of the failing frames (or the family's reading of the failing op)."""
    from ...redact import redact
    from ...rules.engine.findings import Finding
    from .frames import tensor_locals

    try:
        tensors = tensor_locals(frames)
    except Exception:  # evidence is a bonus; the note stands without it
        tensors = []
    where = next((f for f in reversed(frames) if f.user), frames[-1] if frames else None)
    subject = f"{where.function} ({_line_label(where)})" if where is not None else summary.split(":")[0]
    evidence: dict[str, Any] = {"exception": summary, "pattern": pattern.slug}
    if tensors:
        evidence["tensors in the failing frames"] = [redact(t) for t in tensors]
    seen = f" In the failing frames: {'; '.join(tensors[:4])}." if tensors else ""
    if detail is not None:
        if "operands" in detail.evidence or "rule" in detail.evidence:  # named tensors / the rule say it all
            evidence.pop("tensors in the failing frames", None)
        evidence.update(detail.evidence)
        seen = f" {detail.sentence}" if detail.sentence else seen
        subject = detail.subject or subject
    cause = Finding(
        check=pattern.slug,
        severity="error",
        subject=redact(subject),
        message=redact(f"{pattern.meaning}{seen} Fix: {pattern.fix}"),
        evidence=evidence,
    )
    if detail is not None:
        cause.fixes.extend(detail.fixes(live))
    for fx in cause.fixes:  # built beside the note, not through a check: filed under its slug from here
        fx.slug = fx.slug or cause.check
    return cause


class FamilyDetail:
    """What the failing frames add to a catalogue family's cause: the tensors, the cast, the rule, the line.

    Attributes
    ----------
    sentence : str
        Added to the cause's message (``In Linear.forward: x (fp32, [2, 4]) met model.0.weight (bf16, ...).``).
    code : str
        The fix as code, with the user's names.
    title : str
        The fix's title.
    subject : str
        What the cause is about (the loop line of a protocol error).
    evidence : dict
        Plain facts for the finding (``operands``, ``cast``, ``rule``, ``loop line``).
    """

    def __init__(self, sentence: str, code: str, title: str, subject: str, evidence: dict) -> None:
        self.sentence, self.code, self.title, self.subject, self.evidence = sentence, code, title, subject, evidence
        #: ``(module, name, tensor names, dtype)``: the other owner of the odd operand (see ``_held_beside``).
        self.held: tuple | None = None
        #: The operand to cast when it is a parameter whose module was found (:class:`~.operands.Operand`), and
        #: the dtype it takes: the in-place cast of exactly that tensor.
        self.parameter: tuple | None = None
        #: The same for a buffer or tensor attribute of a module that the failing line read (``self.pe[:, :n]``).
        self.held_operand: tuple | None = None
        #: ``(module, its name, twins, optimizers, device)``: the module whose forward raised, to run in fp32 with
        #: autocast off inside and its outputs cast back (see :func:`_island`), with every module of its class.
        self.island: tuple | None = None
        #: ``(object, its name, method, where)``: the object the user holds whose method the op without a half kernel
        #: ran inside, when that is no module's forward (an optimizer's ``step``): the fp32 island goes around that
        #: call (see :func:`_held_call`).
        self.call_island: tuple | None = None
        #: ``(module, its name, twins)``: the module whose attention call got an integer mask (see
        #: :func:`_failing_module`), to receive its masks as bool.
        self.mask_module: tuple | None = None
        #: ``(model, model's name, layer paths, block, optimizers)``: the converted layers a block format refuses (see
        #: :func:`~.operands.refused_layers`), to take out of the recipe in place.
        self.convert: tuple | None = None
        #: ``code`` is the crashing cell corrected (run on twins before it is shown), not the family's advice.
        self.corrected = False

    def convert_fix(self, live: Any) -> Any:
        """The in-place conversion back of the layers a block format refused, bound to ``live``; None without."""
        if self.convert is None or live is None:
            return None
        from ...facts.location import python_path
        from ...rules.engine.fixes import Applicability, Fix
        from ...rules.engine.lowbit_changes import ConvertBack

        model, name, paths, block, optimizers = self.convert
        shown = ", ".join(f"{name}.{p}" for p in paths[:4]) + (", ..." if len(paths) > 4 else "")
        code = "\n".join(f"{python_path(name + '.' + p)}.weight = torch.nn.Parameter({python_path(name + '.' + p)}.weight._data)  # a dim "
                         f"not a multiple of {block}: high precision (rebuild the optimizer over the new weights)"
                         for p in paths)  # fmt: skip
        return Fix(
            f"Take {shown} out of the low-precision recipe ({len(paths)} layer{'s' if len(paths) != 1 else ''} "
            f"whose dims are not multiples of its block of {block}): back to torch's layer, in place",
            code + f"\n# or at conversion time: a filter that skips layers whose dims are not multiples of {block}",
            applicability=Applicability.UNSAFE,
            changes=(ConvertBack(live.add(model), tuple(paths), f"layers of {name}", tuple(live.add(o) for o in optimizers)),),
            recipe="convert-back",
            cost="those layers compute in their weights' dtype (bf16/fp32) instead of the block format",
        ).bind(live)

    def parameter_fix(self, live: Any) -> Any:
        """The in-place cast of the parameter the op met in the wrong dtype and of its twins (the same attribute of
        every module of that class in the model: they run the same forward, and would raise next), bound to
        ``live``; None when the operand is not such a parameter. An upcast of a float8 store is exact (safe); any
        other cast changes what the weights hold (unsafe)."""
        if self.parameter is None or live is None:
            return None
        from ...facts.location import python_path
        from ...rules.engine.changes import CastParamsTo
        from ...rules.engine.fixes import Applicability, Fix
        from .operands import spoken

        operand, dtype = self.parameter
        attr = operand.slot or operand.name.rpartition(".")[2]
        owner = operand.root if operand.root is not None else operand.module
        exact = operand.dtype.startswith("float8") and dtype in ("bfloat16", "float16", "float32")
        if _container(operand.module):  # a ParameterDict / ParameterList entry: no forward of its own, no twins
            twins = [id(operand.tensor)]
            title = f"Cast {operand.name} (the tensor the op met) to {spoken(dtype)} in place"
            code = f"{python_path(operand.name)}.data = {python_path(operand.name)}.data.to(torch.{dtype})  # the same Parameter"
        else:
            twins = _parameter_twins(owner, operand, attr)
            cls = type(operand.module).__name__
            title = (f"Cast {attr} of every {cls} ({len(twins)} tensor{'s' if len(twins) != 1 else ''}, "
                     f"{operand.name} the op met) to {spoken(dtype)} in place")  # fmt: skip
            code = (f"for module in {_root_name(operand)}.modules():  # every {cls}: they run the same forward\n"
                    f"    if type(module).__name__ == {cls!r} and module.{attr}.dtype == torch.{operand.dtype}:\n"
                    f"        module.{attr}.data = module.{attr}.data.to(torch.{dtype})  # the same Parameter")  # fmt: skip
        return Fix(
            title,
            code,
            applicability=Applicability.SAFE if exact else Applicability.UNSAFE,
            changes=(CastParamsTo(live.add(owner), frozenset(twins), dtype, operand.name if len(twins) == 1
                                  else f"{attr} of every {type(operand.module).__name__}"),),  # fmt: skip
            recipe="cast-operand-parameter",
            cost=f"{attr} held in {spoken(dtype)}" + (" (an exact upcast)" if exact else ""),
        ).bind(live)

    def held_operand_fix(self, live: Any) -> Any:
        """The in-place cast of the buffer (or tensor attribute) the failing line read and the op met in the wrong
        dtype, and of the same tensor of every module of that class in the model (they run the same forward),
        bound to ``live``; None when the operand is not such a tensor. An upcast of a float8 store is exact
        (safe); any other cast changes what the tensor holds (unsafe)."""
        if self.held_operand is None or live is None:
            return None
        from ...rules.engine.changes import CastHeldTensors
        from ...rules.engine.fixes import Applicability, Fix
        from .operands import spoken

        operand, dtype = self.held_operand
        owner = operand.root if operand.root is not None else operand.module
        cls = type(operand.module)
        twins = [m for m in owner.modules() if type(m) is cls and _holds(m, operand.slot, operand.dtype)]
        twins = twins or [operand.module]
        exact = operand.dtype.startswith("float8") and dtype in ("bfloat16", "float16", "float32")
        code = (f"for module in {_root_name(operand)}.modules():  # every {cls.__name__}: they run the same forward\n"
                f"    if type(module).__name__ == {cls.__name__!r} and module.{operand.slot}.dtype == torch.{operand.dtype}:\n"
                f"        module.{operand.slot} = module.{operand.slot}.to(torch.{dtype})  # a buffer stays a buffer")  # fmt: skip
        n = len(twins)
        return Fix(
            f"Cast {operand.slot} of every {cls.__name__} ({n} tensor{'s' if n != 1 else ''}, {operand.name} the op "
            f"met) to {spoken(dtype)} in place",
            code,
            applicability=Applicability.SAFE if exact else Applicability.UNSAFE,
            changes=tuple(CastHeldTensors(live.add(m), (operand.slot,), dtype, f"{cls.__name__}.{operand.slot}")
                          for m in twins),  # fmt: skip
            recipe="cast-held-operand",
            cost=f"{operand.slot} held in {spoken(dtype)}" + (" (an exact upcast)" if exact else ""),
        ).bind(live)

    def held_fix(self, live: Any) -> Any:
        """The in-place cast of the tensors a module holds beside its weights, bound to ``live``; None without."""
        if self.held is None or live is None:
            return None
        from ...facts.location import python_path
        from ...rules.engine.changes import CastHeldTensors
        from ...rules.engine.fixes import Applicability, Fix
        from .operands import spoken

        module, name, names, dtype = self.held
        where = python_path(name)
        listed = ", ".join(f"{where}.{n}" for n in names)
        code = "\n".join(f"{where}.{n} = {where}.{n}.to(torch.{dtype})  # beside {where}'s {dtype} weights"
                          for n in names)  # fmt: skip
        return Fix(
            f"Cast {listed} to {spoken(dtype)}, the dtype of {where}'s weights (the op's other operand follows)",
            code, applicability=Applicability.UNSAFE,
            changes=(CastHeldTensors(live.add(module), tuple(names), dtype, where),),
            recipe="cast-held-tensors",
            cost=f"rounds {listed} to {spoken(dtype)}",
        ).bind(live)

    def island_fix(self, live: Any) -> Any:
        """The module whose forward raised, and every module of its class, run in fp32 with autocast off inside and
        their outputs cast back to their inputs' dtype, in place; None without such a module."""
        if self.island is None or live is None:
            return None
        from ...rules.engine.changes import KeepModuleFp32
        from ...rules.engine.fixes import Applicability, Fix

        module, name, twins, optimizers, device = self.island
        cls = type(module).__name__
        holders = tuple(live.add(o) for o in optimizers)
        changes = tuple(KeepModuleFp32(live.add(m), "", frozenset(id(p) for p in m.parameters()), device, holders,
                                       f"{cls} {i}" if len(twins) > 1 else name, cast_back=True)
                        for i, m in enumerate(twins))  # fmt: skip
        changes += _island_buffers(live, twins, cls if len(twins) > 1 else name)
        n = len(twins)
        every = f"every {cls} ({n}, {name} among them)" if n > 1 else name
        return Fix(
            f"Run {every} in fp32 with autocast off inside, its output cast back to its input's dtype, in place",
            f"# the op {name}'s forward runs has no kernel, or meets another dtype, in half precision: run it in fp32\n"
            f"{name}.float()  # its parameters in fp32, with the same Parameter objects\n"
            f"# in its forward: x = x.float(), the op, then out.to(input_dtype); under autocast: "
            f"with torch.autocast({device!r}, enabled=False)",
            applicability=Applicability.UNSAFE,
            changes=changes,
            recipe="fp32-island",
            cost=f"{cls}'s weights and math in fp32 (twice the memory of bf16 / fp16 there, slower)",
        ).bind(live)

    def call_island_fix(self, live: Any) -> Any:
        """The ops with no half-precision kernel run in fp32 inside the held object's method the op ran in (an
        optimizer's ``step``: library code, no module's forward), their results cast back, in place; None without
        such a call."""
        if self.call_island is None or live is None:
            return None
        from ...rules.engine.changes import KeepCallFp32
        from ...rules.engine.fixes import Applicability, Fix

        obj, name, method, where = self.call_island
        call = f"{name}.{method}"
        return Fix(
            f"Run the linalg and FFT ops inside {call} ({where}) in fp32, their results cast back to their inputs' "
            f"bf16 / fp16, in place",
            f"# {call} runs an op with no bf16 / fp16 kernel ({where}, library code: no module's forward to keep in\n"
            f"# fp32). Inside it, such an op runs on fp32 copies of its tensors, its result cast back:\n"
            f"q, r = torch.linalg.qr(x.float())\nq, r = q.to(x.dtype), r.to(x.dtype)",
            applicability=Applicability.UNSAFE,
            changes=(KeepCallFp32(live.add(obj), method, ("linalg", "fft"), call),),
            recipe="fp32-ops-island",
            cost=f"the linalg / FFT ops of {call} in fp32 (their operands copied in fp32 while they run, slower)",
        ).bind(live)

    def mask_fix(self, live: Any) -> Any:
        """Integer masks arriving at the module whose attention raised (and every module of its class) made bool at
        its forward, in place; None without such a module."""
        if self.mask_module is None or live is None:
            return None
        from ...rules.engine.changes import BoolMaskInputs
        from ...rules.engine.fixes import Applicability, Fix

        module, name, twins = self.mask_module
        cls = type(module).__name__
        every = f"every {cls} ({len(twins)}, {name} among them)" if len(twins) > 1 else name
        return Fix(
            f"Make the integer masks {every} receives bool at its forward (1 = attend becomes True), in place",
            self.code,
            applicability=Applicability.UNSAFE,  # a mask of other integers than 0 and 1 would change meaning
            changes=tuple(BoolMaskInputs(live.add(m), "forward", f"{cls} {i}" if len(twins) > 1 else name)
                          for i, m in enumerate(twins)),  # fmt: skip
            recipe="bool-mask-at-forward",
            cost="none: a bool mask is what attention reads (a mask of other integers than 0 and 1 is not a mask)",
        ).bind(live)

    def fixes(self, live: Any) -> list:
        """The cause's fixes, in place first: the tensors held beside the weights, else the parameter the op met
        (and its twins), else the module whose forward raised as an fp32 island; then the code as display-only
        advice."""
        exact = self.held_fix(live)
        if exact is None:
            exact = self.parameter_fix(live)
        if exact is None:
            exact = self.held_operand_fix(live)
        if exact is None:
            exact = self.convert_fix(live)
        if exact is None:
            exact = self.call_island_fix(live)
        if exact is None:
            exact = self.island_fix(live)
        if exact is None:
            exact = self.mask_fix(live)
        return [fx for fx in (exact, self.fix() if self.code else None) if fx is not None]

    def fix(self) -> Any:
        """A display-only fix holding the code."""
        from ...rules.engine.fixes import Applicability, Fix
        from ..runtime.op_rewrite import CORRECTED_CELL

        recipe = CORRECTED_CELL if self.corrected else "crash-cast"
        return Fix(self.title, self.code, applicability=Applicability.DISPLAY_ONLY, recipe=recipe)


def _island_buffers(live: Any, modules: list, label: str) -> tuple:
    """The half-precision floating buffers of an island's modules cast to fp32 with them (an orthogonal
    parametrization's ``base``): an fp32 forward would meet them in bf16 / fp16 and raise."""
    from ...rules.engine.island_changes import CastBuffersTo

    out = []
    for m in modules:
        held = tuple(tuple(n.rpartition(".")[::2]) for n, b in m.named_buffers()
                     if b.is_floating_point() and b.element_size() < 4)  # fmt: skip
        if held:
            out.append(CastBuffersTo(live.add(m), held, "float32", f"{label}'s buffers"))
    return tuple(out)


def _parameter_twins(owner: Any, operand: Any, attr: str) -> list[int]:
    """Ids of the parameter ``attr`` of every module of ``operand.module``'s class under ``owner``, in its dtype."""
    cls = type(operand.module)
    twins = [id(p) for m in owner.modules() if type(m) is cls
             for name, p in m.named_parameters(recurse=False) if name == attr and str(p.dtype) == f"torch.{operand.dtype}"]
    return twins or [id(operand.tensor)]


def _container(module: Any) -> bool:
    """torch's parameter containers: they hold entries for another module's forward and run none of their own."""
    import sys

    nn = sys.modules["torch"].nn
    return type(module) in (nn.ParameterDict, nn.ParameterList)


def _holds(module: Any, slot: str, dtype: str) -> bool:
    """``module`` holds a floating tensor ``slot`` (a buffer or own attribute) in ``dtype``."""
    from .operands import _held

    tensor = _held(module, slot)
    return getattr(tensor, "dtype", None) is not None and str(tensor.dtype) == f"torch.{dtype}"


def _root_name(operand: Any) -> str:
    """The user's name of the model the operand lies in (``model`` of ``model.blocks.0.table``)."""
    return operand.name.split(".", 1)[0] if operand.root is not None else "module"


def family_detail(pattern: Any, exc: BaseException, frames: list, namespace: Mapping[str, Any] | None) -> FamilyDetail | None:
    """The tensors, cast, rule and loop line of a catalogue family's exception; None for other patterns."""
    from .patterns import exception_message

    kind = getattr(pattern, "kind", "")
    if not kind:
        return None
    try:
        message = exception_message(exc) or ""
        if kind == "protocol":
            return _protocol_detail(pattern, frames, namespace)
        if kind == "refusal":
            detail = _refusal_detail(pattern, frames, namespace)
        else:
            detail = _dtype_detail(pattern, message, frames, namespace)
    except Exception:  # the detail is a bonus: the pattern's meaning and fix stand without it
        return None
    if detail is not None and pattern.slug == "crash-attention-mask-dtype":
        try:
            detail.mask_module = _failing_module(frames, namespace)
        except Exception:  # no module found: the code stays the fix
            detail.mask_module = None
    if detail is not None and pattern.slug in ISLAND_FAMILIES:
        try:
            detail.island = _island(frames, namespace)
        except Exception:  # no module found: the code stays the fix
            detail.island = None
    if detail is not None and pattern.slug in CALL_ISLAND_FAMILIES:
        try:
            detail.call_island = _held_call(frames, namespace)
        except Exception:  # no held object's call found: the module's island, or the code, stays the fix
            detail.call_island = None
        if detail.island is None and detail.call_island is None:
            _with_corrected_cell(detail, pattern.slug, frames, namespace)
    return detail


def _with_corrected_cell(detail: FamilyDetail, slug: str, frames: list, namespace: Mapping[str, Any] | None) -> None:
    """The cell (or script) whose own top-level line ran the op, corrected (:func:`~..runtime.op_rewrite.corrected_cell`),
    as ``detail``'s code: nothing in place reaches an op over tensors no module or held object's call holds."""
    import linecache

    from ...facts.location import Location
    from ..runtime.op_rewrite import corrected_cell

    view = next((f for f in reversed(frames) if f.user), None)
    if view is None or not _top_level(view.function):
        return
    try:
        source = "".join(linecache.getlines(view.filename))
        names = {**(view.frame.f_globals if type(view.frame.f_globals) is dict else {}),
                 **(dict(namespace) if type(namespace) is dict else {})}  # fmt: skip
        code = corrected_cell(source, view.lineno, names, ("fft",) if slug == "crash-fft-half" else ("linalg",))
    except Exception:  # the family's code stays the fix
        return
    if code is None or len(code.splitlines()) > _CORRECTED_CELL_LINES:
        return
    where = Location.at(view.filename, view.lineno, "").place
    detail.code = f"# {where} again, its op with no half-precision kernel on fp32 copies of its tensors\n{code}"
    detail.title = f"Run {where} again with the op in fp32, its result cast back (corrected code)"
    detail.corrected = True


def _top_level(function: str) -> bool:
    """A frame of a cell's or script's own top-level code: ``<module>``, or ``<cell line: N>`` (the code name IPython
    7.x gives a cell on Python 3.11+, as Colab runs it)."""
    return function == "<module>" or function.startswith("<cell line:")


#: Longer sources than this are not shown whole as a corrected cell (a script: its line's advice stands).
_CORRECTED_CELL_LINES = 80


#: The families a module's forward can raise whose op runs in fp32 where half precision has no kernel or meets
#: another dtype: running that module in fp32 (an fp32 island) takes the op out of half precision.
ISLAND_FAMILIES = frozenset({"crash-linalg-half", "crash-fft-half", "crash-index-put-dtype", "crash-scatter-dtype"})


#: The families whose op has no half-precision kernel at all: inside any call, that op can run on fp32 copies of its
#: tensors (:class:`~mpdoctor.rules.engine.changes.KeepCallFp32`), where no module's forward holds it.
CALL_ISLAND_FAMILIES = frozenset({"crash-linalg-half", "crash-fft-half"})


def _held_call(frames: list, namespace: Mapping[str, Any] | None) -> tuple | None:
    """``(object, its name, method, where)`` for the innermost frame whose ``self`` is an object the user holds by a
    name (in the namespace or a user frame's locals) and no module, library frames included (an optimizer's
    ``step`` in its package): ``method`` is the outermost method of that object's class on the stack, the call
    the user made (``step``, not a helper it calls). None when a user module's method is nearer the op (its fp32
    island is the fix), or no held object's method is on the stack."""
    import sys

    from .frames import _CALL_MACHINERY, _TYPE_MRO, _locals, _qualname
    from .operands import _name_of

    torch = sys.modules["torch"]
    for view in reversed(frames):
        obj = next((v for k, v in _locals(view.frame) if k == "self"), None)
        if obj is None or isinstance(obj, torch.Tensor):
            continue
        if isinstance(obj, torch.nn.Module):
            if view.user:
                return None
            continue
        name = _name_of(obj, frames, namespace)
        if name is None or not name.isidentifier():
            continue
        classes = _TYPE_MRO(type(obj))
        for outer in frames:
            own = next((v for k, v in _locals(outer.frame) if k == "self"), None)
            method = outer.function
            if own is obj and method not in _CALL_MACHINERY and any(method in c.__dict__ for c in classes):
                return obj, name, method, _qualname(outer)
        return None
    return None


def _holding(modules: list, candidates: list, torch: Any) -> list:
    """The optimizers among ``candidates`` holding a parameter of ``modules``, each once."""
    ids = {id(p) for m in modules for p in m.parameters()}
    out: list = []
    for value in candidates:
        if not isinstance(value, torch.optim.Optimizer) or any(value is o for o in out):
            continue
        if any(id(p) in ids for g in value.param_groups for p in g["params"]):
            out.append(value)
    return out


def _failing_module(frames: list, namespace: Mapping[str, Any] | None) -> tuple | None:
    """``(module, its name, twins)`` for the innermost user frame that is a module's method: the module and every
    module of its class in the model that holds it (they run the same forward); None when the failing code is no
    module's."""
    import sys

    from .operands import _module_path, _roots

    torch = sys.modules["torch"]
    view = next((v for v in reversed(frames) if v.user and isinstance(v.frame.f_locals.get("self"), torch.nn.Module)),
                None)  # fmt: skip
    if view is None:
        return None
    module = view.frame.f_locals["self"]
    roots = [(n, r) for n, r in _roots(frames, namespace, torch) if n != "self"]  # a method's own name is no name
    name = _module_path(module, roots, torch) or type(module).__name__
    root = next((r for _, r in roots if any(m is module for m in r.modules())), module)
    twins = [m for m in root.modules() if type(m) is type(module)] or [module]
    return module, name, twins


def _island(frames: list, namespace: Mapping[str, Any] | None) -> tuple | None:
    """``(module, its name, twins, optimizers, device)``: the failing module (:func:`_failing_module`) and the
    optimizers holding its twins' parameters; None when the failing code is no module's."""
    import sys

    found = _failing_module(frames, namespace)
    if found is None:
        return None
    module, name, twins = found
    torch = sys.modules["torch"]
    optimizers = _holding(twins, [*(dict.values(namespace) if type(namespace) is dict else ()),
                                  *(v for f in frames if f.user for v in f.frame.f_locals.values())], torch)
    device = next((p.device.type for p in module.parameters()), "cpu")
    return module, name, twins, optimizers, device


def _dtype_detail(pattern: Any, message: str, frames: list, namespace: Mapping[str, Any] | None) -> FamilyDetail | None:
    from .operands import failing_operands, spoken

    ops = failing_operands(frames, message, pattern.cast, pattern.code or "{src} = {src}.to({dtype})", namespace)
    if ops is None:
        return None
    evidence: dict[str, Any] = {"operands": ops.sentence(), "cast": ops.code}
    title = f"Cast {ops.cast.name} to {spoken(ops.dtype)}"
    if ops.cast.parameter:
        title = f"Cast {ops.cast.owner.split(' (')[0]} to {spoken(ops.dtype)}"
    detail = FamilyDetail(ops.sentence(), ops.code, title, "", evidence)
    if ops.cast.parameter and ops.cast.module is not None and ops.cast.tensor is not None:
        detail.parameter = (ops.cast, ops.dtype)
    elif ops.cast.slot and ops.cast.module is not None and ops.cast.tensor is not None:
        detail.held_operand = (ops.cast, ops.dtype)
    elif ops.cast.dtype.startswith("float8"):  # a local bound to a float8 buffer (``guide = self.guide``)
        held = _buffer_behind_local(frames, namespace, ops.cast)
        if held is not None:
            detail.held_operand = (held, ops.dtype)
    if ops.keep is not None and ops.keep.parameter and not ops.cast.parameter:
        detail.held = _held_beside(frames, namespace, ops.cast.dtype, ops.dtype)
        if detail.held is not None:
            evidence["held"] = f"{detail.held[1]}.{', '.join(detail.held[2])} ({ops.cast.dtype}) feeds the op"
    return detail


def _buffer_behind_local(frames: list, namespace: Mapping[str, Any] | None, operand: Any) -> Any:
    """``operand`` (a local of the innermost user frame) as the buffer of that frame's module it is bound to: the
    same tensor object, so casting the buffer in place is casting what the op met. None when it is no buffer."""
    import sys

    from .operands import _module_path, _roots

    torch = sys.modules["torch"]
    view = next((v for v in reversed(frames) if v.user), None)
    module = view.frame.f_locals.get("self") if view is not None else None
    tensor = view.frame.f_locals.get(operand.name) if view is not None else None
    if not isinstance(module, torch.nn.Module) or not isinstance(tensor, torch.Tensor):
        return None
    slot = next((name for name, b in module.named_buffers(recurse=False) if b is tensor), None)
    if slot is None:
        return None
    roots = [(n, r) for n, r in _roots(frames, namespace, torch) if n != "self"]
    root = next((r for _, r in roots if any(m is module for m in r.modules())), module)
    path = _module_path(module, roots, torch) or type(module).__name__
    return dataclasses.replace(operand, name=f"{path}.{slot}", tensor=tensor, module=module, root=root, slot=slot)


def _held_beside(frames: list, namespace: Mapping[str, Any] | None, odd: str, dtype: str) -> tuple | None:
    """``(module, its name, tensor names, dtype)``: tensors in the odd dtype a module holds beside weights all
    in ``dtype``, read on the failing line; casting them ends the mismatch at its source."""
    import sys

    from .operands import _module_path, _roots, held_tensors

    held = held_tensors(frames, odd)
    if held is None:
        return None
    module, names = held
    floating = [p.dtype for p in module.parameters() if p.is_floating_point()]
    torch = sys.modules["torch"]
    if not floating or any(d != getattr(torch, dtype) for d in floating):
        return None  # the module's own weights are mixed: the odd tensor is not the only one out of step
    name = _module_path(module, _roots(frames, namespace, torch), torch) or type(module).__name__
    return module, name, names, dtype


def _protocol_detail(pattern: Any, frames: list, namespace: Mapping[str, Any] | None) -> FamilyDetail:
    from .operands import loop_line, protocol_names

    line = loop_line(frames)
    scaler, optimizer = protocol_names(frames, namespace)
    names = {"scaler": scaler, "optimizer": optimizer}
    code = pattern.code.format(src="x", dst="destination", dtype="torch.float32", **names) if pattern.code else ""
    evidence: dict[str, Any] = {"rule": pattern.rule}
    sentence = f"The rule: {pattern.rule}."
    subject = ""
    if line is not None:
        evidence["loop line"] = f"{line.label}: {line.code}"
        evidence["code"] = line.code  # as the watcher's and the cell reader's findings of the same rule say it
        sentence += f" Broken at {line.label}: `{line.code}`."
        subject = line.label
    return FamilyDetail(sentence, code, "Follow the GradScaler protocol", subject, evidence)


def _refusal_detail(pattern: Any, frames: list, namespace: Mapping[str, Any] | None) -> FamilyDetail:
    from .operands import loop_line, refusal_subject, refused_layers

    refused = refusal_subject(frames, namespace)
    line = loop_line(frames)
    evidence: dict[str, Any] = {}
    parts = []
    if refused:
        evidence["refused"] = refused
        parts.append(f"Refused: {refused}.")
    if line is not None:
        evidence["line"] = f"{line.label}: {line.code}"
        parts.append(f"At {line.label}: `{line.code}`.")
    detail = FamilyDetail(" ".join(parts), pattern.code, "Keep these layers out of the low-precision recipe"
                          if pattern.slug.endswith("block-size") else "Use a precision this device runs", "",
                          evidence)  # fmt: skip
    if pattern.slug.endswith("block-size"):
        detail.convert = refused_layers(frames, namespace)
    return detail
