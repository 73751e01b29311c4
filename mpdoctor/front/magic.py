"""The ``%mpdoctor`` line magic: parse the line, resolve names, diagnose, return the Report."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any

import torch
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, List, Unicode

from ..knowledge import GPU_PROFILES

try:
    from IPython.core.magic import no_var_expand
except ImportError:  # IPython < 7.3

    def no_var_expand(func):
        """Mark a magic whose line IPython must not expand (``{expr}`` / ``$name``)."""
        func._ipython_no_var_expand = True
        return func


_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


_BATCH_HINT = "a dict of keyword arguments for forward, a tensor, or a tuple/list of positional arguments"


def _print_line(text: str) -> None:
    print(f"mpdoctor: {text}")


def _type_name(obj: Any) -> str:
    from ..objects.live.introspect import type_name

    return type_name(obj)  # never runs user code: not obj.__class__, nor a metaclass's __getattribute__


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _nothing_to_inspect(name: str, obj: Any) -> str:
    """Why a named object brought no subject: the user named the wrong thing, so say what to name."""
    from ..objects.discovery.subjects import nothing_to_inspect

    return nothing_to_inspect(name, obj)


def _close_matches(slug: str, known: list[str]) -> str:
    close = difflib.get_close_matches(slug, known, n=3, cutoff=0.5)
    return f"; did you mean {' or '.join(close)}?" if close else ""


@magics_class
class MPDoctorMagics(Magics):
    """Magics of mpdoctor; ``%config MPDoctorMagics.target = 'T4'`` sets defaults."""

    target = Unicode(None, allow_none=True, help="Default device profile for %mpdoctor (what-if).").tag(config=True)
    ignore = List(Unicode(), default_value=[], help="Check slugs %mpdoctor skips by default.").tag(config=True)
    on_error = Bool(
        True, help="After a cell raises a known mixed-precision error, show the diagnosis below the traceback."
    ).tag(config=True)

    @magic_arguments()
    @argument("names", nargs="*", help="Variables to inspect (default: everything in the namespace).")
    @argument("--text", action="store_true", help="Print the text rendering instead of the widget.")
    @argument("--json", action="store_true", help="Print the report as JSON.")
    @argument("--markdown", action="store_true", help="Print the report as markdown (for bug reports).")
    @argument("--target", metavar="GPU", default=None, help=f"Evaluate on a device profile (what-if): {', '.join(['cpu', *GPU_PROFILES])}.")
    @argument("--scan", action="store_true", help="Also scan tensor values for NaN/Inf and fp16 range.")
    @argument("--ignore", metavar="CHECK[,CHECK]", default="", help="Check slugs to skip, comma-separated.")
    @argument("--probe", metavar="BATCH_NAME", default=None, help=f"Run one forward+backward on this batch variable: {_BATCH_HINT}.")
    @argument("--generate", metavar="N", type=int, default=None,
              help="With --probe: run N decoding steps of the model's generate() on the batch's prompt instead of a "
                   "forward+backward, and name the step at which the logits went NaN/Inf.")  # fmt: skip
    @argument("--no-history", action="store_true",
              help="Leave out what the cells this kernel ran did: their AMP loop mistakes, read or watched, and "
                   "the exceptions the crash hook explained.")  # fmt: skip
    @argument("--step", metavar="FUNCTION", default=None,
              help="A training step of yours (a function of no arguments): each fix is checked on it, before and after, "
                   "and everything it changes is restored.")  # fmt: skip
    @argument(
        "--compare",
        metavar="BATCH_NAME",
        default=None,
        help="What bf16, fp16, fp8, MXFP8 and NVFP4 would do to each Linear of the named model on this batch (mpdoctor.compare).",
    )
    @argument(
        "--plan",
        nargs=2,
        metavar=("TARGET", "BATCH_NAME"),
        default=None,
        help="%%mpdoctor model --plan fp8 batch: which Linears to keep in bf16 under TARGET, verified by running the mixed model (Comparison.plan).",
    )
    @line_magic
    @no_var_expand  # IPython would evaluate {expr} and $name in the line before the magic sees it
    def mpdoctor(self, line: str = ""):
        """Diagnose mixed-precision faults in the live model, optimizer, scaler, Trainer and Accelerator.

        ``%mpdoctor`` inspects everything in the namespace; ``%mpdoctor model opt``
        inspects named variables. Returns the Report (``r = %mpdoctor`` works).
        """
        if _asks_for_help(line):  # magic_arguments' parser has no -h/--help of its own
            print(self.mpdoctor.parser.format_help().removeprefix("::\n\n").replace("  %mpdoctor", "usage: %mpdoctor", 1))
            return None
        words = line.split()
        if words[:1] == ["insert"]:
            return self._insert(words[1:])
        try:
            args = parse_argstring(self.mpdoctor, line)
        except Exception as exc:  # UsageError and argparse's SystemExit-free errors
            _print_line(f"{exc} (see %mpdoctor?)")
            return None
        return self._run(args)

    def _insert(self, words: list[str]) -> None:
        """``%mpdoctor insert N``: fix N's code (numbered on the last report's cards) in a new cell below, unrun.
        IPython's ``set_next_input`` payload: JupyterLab and Notebook 7 honour it; Colab and VS Code drop it, so
        the code is printed too (docs/notebooks.md)."""
        from ..attach.runtime.session import last_shown
        from ..diagnosis.view_builder import code_fixes

        report = last_shown(self.shell)
        fixes = code_fixes(report) if report is not None else []
        if len(words) != 1 or not words[0].isdigit() or not 1 <= int(words[0]) <= len(fixes):
            known = f"1 to {len(fixes)}" if fixes else "none: the last report has no code to insert"
            _print_line(f"%mpdoctor insert N: N is the number a fix's card names ({known})")
            return None
        fix = fixes[int(words[0]) - 1]
        self.shell.set_next_input(fix.code, replace=False)
        _print_line(f"the code of '{fix.title}' is in a new cell below, unrun (JupyterLab, Notebook 7). "
                    "Where no cell appears (Colab, VS Code), here it is to copy:\n" + fix.code)  # fmt: skip
        return None

    def _resolve(self, names: list[str]):
        ns = self.shell.user_ns
        objects, labels, missing = [], {}, []
        for raw in names:
            for name in (n for n in raw.split(",") if n):
                value, ok = self._lookup(ns, name)
                if not ok:
                    missing.append(name)
                    continue
                objects.append(value)
                labels[id(value)] = name
        return objects, labels, missing

    @staticmethod
    def _lookup(ns: dict, name: str):
        # Names are looked up, never evaluated: only plain dotted identifiers are accepted.
        if not _NAME.match(name):
            return None, False
        head, *rest = name.split(".")
        if head not in ns:
            return None, False
        value = ns[head]
        for attr in rest:
            try:
                value = getattr(value, attr)
            except Exception:
                return None, False
        return value, True

    def _run(self, args):
        from ..facts.hardware import UnknownTarget
        from ..redact import describe_exception

        if args.compare or args.plan:
            return self._compare(args)
        ignore = self._ignore_list(args.ignore)
        if ignore is None:
            return None
        step, ok = self._step(args.step)
        if not ok:
            return None
        try:
            report = self._diagnosed(args, ignore)
            if report is None:
                return None
            report = _assembled(self.shell, report, args, ignore, step)
            hidden = {} if args.probe else _hidden_counts(report, ignore)
        except UnknownTarget as exc:
            _print_line(str(exc))
            return None
        except Exception as exc:  # never a traceback in the user's notebook
            _print_line(f"internal error: {describe_exception(exc)}")
            return None
        try:
            self._show(report, args)
        except Exception as exc:  # a rendering failure still returns the report, shown nowhere else
            from ..render.frontend import skip_next_display

            skip_next_display(report, self.shell.execution_count)
            _print_line(f"could not display the report ({describe_exception(exc)}); it is returned: r = %mpdoctor")
        if not (args.json or args.markdown):  # the exports stay parseable: no line after them
            _print_footer(report, args, hidden)
        from ..attach.runtime.session import remember_shown

        remember_shown(self.shell, report)  # what %mpdoctor insert N numbers
        return report

    def _step(self, name: str | None) -> tuple[Any, bool]:
        """The ``--step`` function, and False after a line saying what is wrong. Without the option: the cell that
        raised since the last report, when the crash hook explained it (its fixes are checked by running it again)."""
        if not name:
            from ..attach.runtime.session import crash_step

            return crash_step(self.shell), True
        step, ok = self._lookup(self.shell.user_ns, name)
        if not ok or not callable(step):
            _print_line(f"--step {name}: give the name of a function of no arguments that runs one training step")
            return None, False
        return step, True

    def _diagnosed(self, args: Any, ignore: list[str]) -> Any:
        """The report of the named objects (or the namespace), probed when asked; None after a line saying why not.
        No step is proven here: the proof runs on the assembled report (:func:`_assembled`)."""
        from ..attach.runtime.cell_accumulation import record_cells
        from ..diagnosis import diagnose

        record_cells(self.shell)  # a hand-written loop's accumulation, read from the cells, is a setting the checks see
        target = args.target if args.target is not None else self.target
        if args.names:
            objects, labels, missing = self._resolve(args.names)
            if missing:
                _print_line(_missing_line(missing))
                return None
            report = diagnose(*objects, names=labels, target=target, scan=args.scan, ignore=ignore)
            empty = [(labels[id(o)], o) for o in objects if not _brought_a_subject(report, labels[id(o)], o)]
            for name, obj in dict(empty).items():
                _print_line(_nothing_to_inspect(name, obj))
            if empty and not report.subjects:
                return None
        else:
            report = diagnose(namespace=self.shell.user_ns, hidden=self.shell.user_ns_hidden, target=target,
                              scan=args.scan, ignore=ignore)
        if args.probe:
            return self._probe(args.probe, report, target, args.generate)
        return report

    def _ignore_list(self, option: str) -> list[str] | None:
        """The configured and typed check slugs to skip; None (after one line per unknown slug) on a typo."""
        from ..attach.runtime.history import known_slugs
        from ..rules.checks import load

        known = sorted(set(load()) | known_slugs())
        wanted = [("MPDoctorMagics.ignore", s) for s in self.ignore]
        wanted += [("--ignore", s.strip()) for s in option.split(",") if s.strip()]
        unknown = [(where, slug) for where, slug in wanted if slug not in known]
        for where, slug in unknown:
            _print_line(f"{where}: unknown check {slug!r}{_close_matches(slug, known)} (python -m mpdoctor checks lists them)")
        return None if unknown else list(dict.fromkeys(slug for _, slug in wanted))

    def _probe(self, batch_name: str, report, target, generate: int | None = None):
        value, ok = self._lookup(self.shell.user_ns, batch_name)
        if not ok:
            _print_line(f"no such variable: {batch_name}")
            return None
        if not issubclass(type(value), _batch_types()):
            _print_line(f"--probe {batch_name}: {batch_name} is {_a(_type_name(value))}, not a batch; give {_BATCH_HINT}")
            return None
        models = [s for s in report.subjects if s.kind == "model"]
        if len(models) != 1:
            names = " or ".join(f"%mpdoctor {s.name} --probe {batch_name}" for s in models[:3])
            _print_line(f"--probe needs exactly one model; found {len(models)}" + (f" (name it: {names})" if names else ""))
            return None
        try:
            from ..attach.numerics.probe import probe
        except ModuleNotFoundError:
            _print_line("--probe is not available in this installation")
            return None
        others = [s.obj for s in report.subjects if s.kind in ("trainer", "accelerator")]
        if generate is not None:  # decoding steps of generate(): no setup's autocast or scaler applies
            return probe(models[0].obj, value, name=models[0].name, generate=True, max_new_tokens=max(1, generate),
                         target=target)  # fmt: skip
        return probe(models[0].obj, value, setup=others[0] if others else None, name=models[0].name, target=target)

    def _compare(self, args):
        """``%mpdoctor model --compare batch``: run mpdoctor.compare, show its heatmap, return the Comparison."""
        from ..redact import describe_exception

        names = [n for raw in args.names for n in raw.split(",") if n]
        target, batch_name = args.plan if args.plan else (None, args.compare)  # %mpdoctor model --plan fp8 batch
        if len(names) != 1:
            _print_line(_one_model_line(names, self.shell.user_ns, target, batch_name))
            return None
        batch, ok = self._lookup(self.shell.user_ns, batch_name)
        model, model_ok = self._lookup(self.shell.user_ns, names[0])
        if not ok or not model_ok:
            _print_line(f"no such variable: {batch_name if not ok else names[0]}")
            return None
        if not isinstance(model, torch.nn.Module):
            _print_line(f"--compare: {names[0]} is {_a(_type_name(model))}, not a torch.nn.Module")
            return None
        if not issubclass(type(batch), _batch_types()):
            _print_line(f"--compare {batch_name}: {batch_name} is {_a(_type_name(batch))}, not a batch; give {_BATCH_HINT}")
            return None
        try:
            from ..attach.emulation.compare import compare

            extra = {"precisions": ("bf16", target)} if target else {}
            comparison = compare(model, batch, name=names[0], **extra)
            plan = comparison.plan(target) if target and not comparison.error else None
        except ValueError as exc:  # a target plan() does not convert to
            _print_line(f"--plan {target}: {exc}")
            return None
        except Exception as exc:  # never a traceback in the user's notebook
            _print_line(f"internal error: {describe_exception(exc)}")
            return None
        if comparison.error:
            _print_line(f"--compare {batch_name}: {comparison.error}")
            return None
        self._show_comparison(comparison, plan, args.text)
        return plan if plan is not None else comparison

    def _show_comparison(self, comparison: Any, plan: Any, text: bool) -> None:
        """Draw the heatmap (with the plan's summary); the display hook adds only the returned plan's code."""
        from ..redact import describe_exception

        try:
            if text:
                print(comparison.to_text())
            else:
                comparison._ipython_display_()
        except Exception as exc:
            _print_line(f"could not display the comparison ({describe_exception(exc)}); it is returned: c = %mpdoctor ...")
        comparison._skip_display_in = self.shell.execution_count
        if plan is not None:  # its summary is in the heatmap just drawn: the returned plan adds only its code
            plan._summary_shown_in = self.shell.execution_count

    def _show(self, report: Any, args: Any) -> None:
        from ..render.frontend import show, skip_next_display

        if args.json:
            print(report.to_json())
        elif args.markdown:
            print(report.to_markdown())
        elif args.text:
            print(report.to_text())
        else:
            # What display(report) runs, called directly: IPython's formatter would print the
            # traceback of a rendering failure into the cell; here it becomes one line.
            show(report)
        # The returned report would be displayed again by the display hook in this same cell.
        skip_next_display(report, self.shell.execution_count)


def _one_model_line(names: list[str], ns: Mapping, target: str | None, batch_name: str) -> str:
    """``--compare needs exactly one model: %mpdoctor net --compare xb``, naming the user's own models, or none."""
    models = names or [n for n, v in ns.items() if not n.startswith("_") and isinstance(v, torch.nn.Module)]
    option = f"--plan {target} {batch_name}" if target else f"--compare {batch_name}"
    named = " or ".join(f"%mpdoctor {n} {option}" for n in models[:3])
    return f"{option.split()[0]} needs exactly one model" + (f": {named}" if named else "")


def _asks_for_help(line: str) -> bool:
    """Whether the line holds ``-h`` or ``--help`` as a word (argparse's own spelling of a request for help)."""
    return any(word in ("-h", "--help") for word in line.split())


def _missing_line(missing: list[str]) -> str:
    """``no such variable: x, 'y + 1'`` (plain names as typed; anything else quoted: it was not run)."""
    odd = any(not _NAME.match(m) for m in missing)
    shown = ", ".join(m if _NAME.match(m) else repr(m) for m in missing)
    note = " (give variable names: mpdoctor looks them up and evaluates nothing)" if odd else ""
    return f"no such variable: {shown}{note}"


def _print_footer(report: Any, args: Any, hidden: dict[str, int]) -> None:
    """The lines after a report: the probe's summary, what the ignore list hid."""
    if args.probe:
        _print_line(_probe_summary(report, args.probe))
    if hidden:
        total = sum(hidden.values())
        each = ", ".join(f"{slug} {n}" for slug, n in sorted(hidden.items()))
        _print_line(f"{total} finding{'s' if total != 1 else ''} hidden by the ignore list ({each})")


def _assembled(shell: Any, report: Any, args: Any, ignore: list[str], step: Any) -> Any:
    """The report whole (:func:`mpdoctor.attach.runtime.assembly.assemble`): what the cells did, read from their source
    (unless ``--no-history``), watched as they ran and raised; the scale history; then the plan proven on ``step``
    (the ``--step`` function, or the cell that raised; not with ``--probe``, whose report holds its own check)."""
    from ..attach.crash.patterns import checks_explaining
    from ..attach.runtime.assembly import assemble
    from ..attach.runtime.session import observed

    code = None if args.no_history else _read_code(shell, ignore)
    return assemble(report, observed(shell, ignore, code, checks_explaining), None if args.probe else step)


def _read_code(shell: Any, ignore: list[str]) -> list:
    """What the cells this kernel ran say about the AMP loop (read, never run); [] after a line saying why not."""
    from ..attach.runtime.history import read_history
    from ..redact import describe_exception

    try:
        return read_history(shell)
    except Exception as exc:  # the report of the objects stands without it
        _print_line(f"could not read the cell history ({describe_exception(exc)})")
        return []


def _batch_types() -> tuple:
    """What ``--probe`` accepts: what a DataLoader yields (imported late: the probe's module is not cheap)."""
    from ..attach.numerics.probe_facts import ForwardCall

    return (Mapping, torch.Tensor, tuple, list, ForwardCall)


def _brought_a_subject(report: Any, name: str, obj: Any) -> bool:
    """Whether the object named ``name`` was inspected, itself or through what it holds."""
    for s in report.subjects:
        if s.obj is obj or s.name == name or s.name.startswith((f"{name}.", f"{name}[")):
            return True
    return False


def _hidden_counts(report: Any, ignore: list[str]) -> dict[str, int]:
    """How many findings each ignored check would have reported (the core counts them: ``Report.hidden``)."""
    return dict(getattr(report, "hidden", {}) or {}) if ignore else {}


def _probe_summary(report: Any, batch_name: str) -> str:
    """One line saying that the probe ran, how, and what it found, healthy runs included."""
    probes = getattr(report.facts, "probes", ())
    if not probes:
        return f"--probe {batch_name}: the probe did not run"
    pf = probes[0]
    generation = getattr(pf, "generation", None)
    how = ("forward and backward" if pf.backward else "forward only") if generation is None else (
        f"generate() of {generation.steps} decoding steps")  # fmt: skip
    precision = f"{pf.autocast} autocast" if pf.autocast else "no autocast"
    loss = f", loss {pf.loss:.4g}" if pf.loss is not None else ""
    found = [f for f in report.findings if f.check.startswith("probe-")]
    if found:
        what = "found " + "; ".join(f"{f.check} at {f.subject}" for f in found)
    else:
        what = "no module raised, went NaN/Inf or passed fp16's 65504"
    note = f" ({pf.note})" if pf.note else ""
    return f"probed {pf.model} on {batch_name}: one {how}, {precision}, {len(pf.modules)} modules{loss}{note}; {what}"
