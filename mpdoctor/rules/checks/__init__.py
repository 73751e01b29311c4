"""The check registry.

A check is a function ``(facts, rule) -> iterable of Finding`` registered under a stable slug with
:func:`check`, which makes it a :class:`~mpdoctor.rules.engine.rules.Rule` of kind ``check``. The rule is
handed to the function, which builds its findings through it (``rule.finding(subject, message, ...)``), so
the slug is written once, in the decorator; callers call the registered function with the facts alone.

Its docstring has a one-line summary (the rule's title) and ruff's sections::

    What it does
        ...
    Why is this bad?
        ...
    Example
        code that shows the mistake
    Use instead
        the corrected code
    Fix safety
        what the offered fixes change, and what they cannot do in place
    Severity
        when each severity is given
    Sources
        ...

The rules reference (``docs/checks.md``) is generated from these docstrings
(``python -m mpdoctor checks --update-docs``), so code and docs cannot drift.
A check that raises becomes an ``internal-error`` finding; the others still run.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import textwrap
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Callable

from ...redact import describe_exception
from ..engine.findings import Finding, Severity
from ..engine.rules import Applicability, Rule, RuleKind, register

#: A check's docstring sections, in order; the code sections keep their lines.
SECTIONS = ("What it does", "Why is this bad?", "Example", "Use instead", "Fix safety", "Severity", "Sources")
CODE_SECTIONS = ("Example", "Use instead")

#: Modules holding checks, imported in this order when the registry is first used: a concern of this package by
#: its name, a library's own checks (``mpdoctor/libraries/<name>/checks.py``) by the library's name after ``libraries.``.
MODULES = (
    "scaler", "cache", "optimizer", "dtypes", "precision", "hardware", "values", "probe", "libraries.lightning",
    "libraries.distributed", "libraries.diffusers", "fp8_training", "quantized", "libraries.trl",
    "half_precision_arithmetic", "libraries.deepspeed", "accumulation", "metrics", "merges", "routing", "linalg",
    "averaging", "inference",
)


def _module_path(name: str) -> str:
    """The import path of a check module named in :data:`MODULES`."""
    return f"mpdoctor.{name}.checks" if name.startswith("libraries.") else f"{__name__}.{name}"


@dataclass(frozen=True)
class Check:
    """A registered check: its rule and the function that finds its findings."""

    rule: Rule
    func: Callable[..., Iterable[Finding]]

    @property
    def slug(self) -> str:
        """The rule's slug."""
        return self.rule.slug

    @property
    def severity(self) -> str:
        """The usual severity of its findings."""
        return self.rule.severity.value

    @property
    def summary(self) -> str:
        """The one-line summary (the rule's title)."""
        return self.rule.title

    @property
    def sections(self) -> dict[str, str]:
        """The documentation sections by heading."""
        return self.rule.sections()

    @property
    def why(self) -> str:
        """The 'Why is this bad?' section."""
        return self.rule.why

    def doc_markdown(self) -> str:
        """One reference entry in markdown."""
        return self.rule.doc_markdown()


REGISTRY: dict[str, Check] = {}
_loaded = False


def _parse_doc(doc: str) -> tuple[str, dict[str, str]]:
    """The summary line and the sections of a check's docstring (prose joined, code kept line by line)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    summary = lines[0].strip() if lines else ""
    sections: dict[str, list[str]] = {}
    current = None
    for line in lines[1:]:
        if line.strip() in SECTIONS and not line.startswith(" "):
            current = line.strip()
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    parsed = {}
    for title, body in sections.items():
        if title in CODE_SECTIONS:
            parsed[title] = textwrap.dedent("\n".join(body)).strip("\n")
        else:
            parsed[title] = re.sub(r"\s+", " ", " ".join(x.strip() for x in body)).strip()
    return summary, parsed


def rule_from_doc(slug: str, severities: tuple[Severity, ...], fix_safety: tuple[Applicability, ...],
                  doc: str) -> Rule:  # fmt: skip
    """The :class:`Rule` of a check, its prose read from the check's docstring.

    Raises
    ------
    ValueError
        When a section is missing or empty.
    """
    summary, sections = _parse_doc(doc)
    missing = [s for s in SECTIONS if not sections.get(s)]
    if missing:
        raise ValueError(f"check {slug} lacks docstring sections: {missing}")
    return Rule(
        slug=slug,
        title=summary,
        kind=RuleKind.CHECK,
        severities=severities,
        why=sections["Why is this bad?"],
        example=sections["Example"],
        use_instead=sections["Use instead"],
        fix_safety=fix_safety,
        fix_safety_note=sections["Fix safety"],
        sources=sections["Sources"],
        detects=sections["What it does"],
        severity_note=sections["Severity"],
    )


def check(slug: str, *severities: Severity, fix_safety: tuple[Applicability, ...] = ()) -> Callable[[Callable], Callable]:
    """Register a check under ``slug`` as a rule of kind ``check``.

    Parameters
    ----------
    slug : str
        The stable slug, the ``check`` of every finding it makes.
    *severities : Severity
        The severities its findings take, the usual one first.
    fix_safety : tuple of Applicability
        The applicabilities of the fixes its findings offer (empty: it offers none).

    The decorated function takes ``(facts, rule)``; the registered function takes the facts alone.
    """

    def register_check(func: Callable[..., Iterable[Finding]]) -> Callable[..., Iterable[Finding]]:
        rule = rule_from_doc(slug, severities, fix_safety, func.__doc__ or "")
        if slug in REGISTRY and REGISTRY[slug].func.__qualname__ != func.__qualname__:
            raise ValueError(f"duplicate check slug {slug}")
        register(rule)

        @functools.wraps(func)
        def with_rule(facts) -> Iterable[Finding]:
            return func(facts, rule)

        with_rule.rule = rule  # type: ignore[attr-defined]
        REGISTRY[slug] = Check(rule, with_rule)
        return with_rule

    return register_check


def load() -> dict[str, Check]:
    """Import every check module once and return the registry."""
    global _loaded
    if not _loaded:
        for name in MODULES:
            try:
                importlib.import_module(_module_path(name))
            except ModuleNotFoundError as exc:
                if exc.name != _module_path(name):
                    raise
        _loaded = True
    return REGISTRY


INTERNAL_ERROR = register(Rule(
    slug="internal-error",
    title="mpdoctor could not read an object or complete a check.",
    kind=RuleKind.CHECK,
    severities=(Severity.ERROR,),
    detects="An object whose facts could not be read (its accessors raised), or a check, a scan or a probe "
    "that raised. The finding names what failed and the exception; the rest of the report is complete.",
    why="The report is silent about what could not be read: a fault in that object or that check would go "
    "unseen, so a clean report is not proof of a clean setup while this finding stands.",
    example="class Broken(torch.nn.Module):\n    def named_modules(self, *args, **kwargs):\n"
    "        raise RuntimeError('boom')\n\nmpdoctor.diagnose(namespace={'broken': Broken(), 'model': model})",
    use_instead="# diagnose the objects that can be read, and report the exception to mpdoctor\n"
    "mpdoctor.diagnose(model, optimizer)",
    fix_safety=(),
    fix_safety_note="No fix: the object or the check that failed is named, with the exception; nothing is "
    "changed.",
    severity_note="Error: part of the diagnosis is missing.",
    sources="mpdoctor's reliability rule: diagnose() never raises on user objects (ARCHITECTURE.md).",
))  # fmt: skip


def internal_error(where: str, exc: BaseException | None = None, *, detail: str | None = None) -> Finding:
    """The finding that stands in for a fact that could not be read or a check, scan or probe that raised.

    Parameters
    ----------
    where : str
        What could not be completed (``check scaler-with-bf16``, a subject's name).
    exc : BaseException, optional
        The exception raised, described even when its message cannot be printed.
    detail : str, optional
        What could not be read, when no exception is at hand (``Facts.errors``).
    """
    if exc is None:
        text = detail or "unknown failure"
        return INTERNAL_ERROR.finding(where, f"mpdoctor could not read {where}: {text}. The rest of the report is "
                                      "unaffected.", {"detail": text})  # fmt: skip
    described = describe_exception(exc)
    try:
        tb = traceback.extract_tb(exc.__traceback__)
        frame = f" ({tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})" if tb else ""
    except Exception:  # a traceback that cannot be read still leaves the exception's description
        frame = ""
    return INTERNAL_ERROR.finding(
        where,
        f"mpdoctor could not complete {where}: {described}{frame}. The rest of the report is unaffected.",
        {"exception": described.split(":", 1)[0], "detail": described.split(": ", 1)[-1][:300]},
    )


def run_checks(facts, ignore: Iterable[str] = (), hidden: dict[str, int] | None = None) -> list[Finding]:
    """Run every registered check; drop the findings of checks in ``ignore``; never raises.

    Ignored checks still run when ``hidden`` is given, which receives how many
    findings each of them would have shown (a report says what it hides).
    """
    skip = set(ignore)
    findings: list[Finding] = [internal_error(where, detail=detail) for where, detail in facts.errors]
    for slug, chk in load().items():
        if slug in skip and hidden is None:
            continue
        try:
            produced = list(chk.func(facts) or ())
            if slug in skip:
                if produced and hidden is not None:
                    hidden[slug] = hidden.get(slug, 0) + len(produced)
                continue
            for finding in produced:
                for fix in finding.fixes:
                    fix.slug = fix.slug or slug
                findings.append(finding)
        except Exception as exc:  # one broken check must not hide the others
            findings.append(internal_error(f"check {slug}", exc))
    findings.sort(key=lambda f: (f.rank, f.check, f.subject))
    return findings


def checks_reference() -> str:
    """The checks' reference entries in markdown, generated from the check docstrings, sorted by slug."""
    rules = [chk.rule for chk in load().values()] + [INTERNAL_ERROR]
    return "\n".join(r.doc_markdown() for r in sorted(rules, key=lambda r: r.slug))
