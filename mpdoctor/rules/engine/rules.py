"""Rules: what a finding is an instance of, documented the way ruff documents its rules.

Three kinds of rule share one type and one registry: the checks (``Facts -> Findings``,
:mod:`mpdoctor.rules.checks`), the runtime rules of the GradScaler protocol (:mod:`mpdoctor.attach.runtime.protocol_rules`) and the
crash families (:mod:`mpdoctor.attach.crash.catalogue`). Each has a stable slug, a title, the severities its findings
take (the first is the usual one), and ruff's sections: why it is bad, an example of the mistake, the code to
use instead, and how safe its fix is. A finding is built through its rule (:meth:`Rule.finding`), so its
``check`` is the rule's slug, written once.

The rule sources sit above the treatment; :func:`load_rules` imports them by name (as ``checks.MODULES`` are
imported), so the registry is complete wherever it is read without the treatment importing upward.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .findings import Finding, Severity


class Applicability(str, Enum):
    """How a fix may be applied, as ruff classifies fixes."""

    #: Keeps the meaning of the run the user intended; "Apply all safe fixes" applies it.
    SAFE = "safe"
    #: Changes numerics or state; applied only on an explicit request.
    UNSAFE = "unsafe"
    #: Nothing mpdoctor can do in place (re-create an optimizer, reload a model): the code says what to run.
    DISPLAY_ONLY = "display-only"


class RuleKind(str, Enum):
    """Where a rule's findings come from."""

    #: A check: a pure function of the facts gathered from the objects at rest.
    CHECK = "check"
    #: A rule of the training loop, seen while it runs (or read from its cells and scripts).
    RUNTIME = "runtime"
    #: A family of exceptions the crash hook explains.
    CRASH_FAMILY = "crash-family"


#: The modules whose import registers every rule, and the function of each (if any) that loads the rest.
RULE_SOURCES: tuple[tuple[str, str], ...] = (
    ("mpdoctor.rules.checks", "load"),
    ("mpdoctor.attach.runtime.protocol_rules", ""),
    ("mpdoctor.attach.crash.catalogue", ""),
)


@dataclass(frozen=True)
class Rule:
    """One rule a finding can be an instance of.

    Attributes
    ----------
    slug : str
        Stable name, the ``check`` of its findings (``scaler-with-bf16``).
    title : str
        One line: the mistake.
    kind : RuleKind
        Check, runtime rule or crash family.
    severities : tuple of Severity
        The severities its findings take, the usual one first.
    why : str
        Why is this bad?
    example : str
        Code that shows the mistake.
    use_instead : str
        The corrected code.
    fix_safety : tuple of Applicability
        The applicabilities of the fixes its findings offer.
    fix_safety_note : str
        What that means for this rule: what the fix changes, what it cannot do in place.
    sources : str
        Where the failure is documented: issues, threads, the library's source.
    detects : str
        What it does, precisely (the conditions that raise it); may be empty for runtime rules and families.
    severity_note : str
        When each severity is given.
    """

    slug: str
    title: str
    kind: RuleKind
    severities: tuple[Severity, ...]
    why: str
    example: str
    use_instead: str
    fix_safety: tuple[Applicability, ...]
    fix_safety_note: str
    sources: str
    detects: str = ""
    severity_note: str = ""

    def __post_init__(self) -> None:
        if not self.severities:
            raise ValueError(f"rule {self.slug} has no severity")
        object.__setattr__(self, "severities", tuple(Severity(s) for s in self.severities))
        object.__setattr__(self, "kind", RuleKind(self.kind))
        object.__setattr__(self, "fix_safety", tuple(Applicability(a) for a in self.fix_safety))

    @property
    def severity(self) -> Severity:
        """The usual severity of its findings (the first of :attr:`severities`)."""
        return self.severities[0]

    @property
    def severity_label(self) -> str:
        """``"error"``, or ``"warning or info"`` / ``"error, warning or info"`` for a rule whose findings take
        several severities (the usual one first)."""
        names = [s.value for s in self.severities]
        return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"

    def sections(self) -> dict[str, str]:
        """ruff's sections, in their order, each by its heading."""
        return {
            "What it does": self.detects,
            "Why is this bad?": self.why,
            "Example": self.example,
            "Use instead": self.use_instead,
            "Fix safety": self.fix_safety_note,
            "Severity": self.severity_note,
            "Sources": self.sources,
        }

    def finding(
        self,
        subject: str,
        message: str,
        evidence: dict[str, Any] | None = None,
        fixes: Sequence[Any] = (),
        *,
        severity: Severity | str | None = None,
    ) -> Finding:
        """A finding of this rule: its ``check`` is this rule's slug, its severity one this rule declares.

        Parameters
        ----------
        subject : str
            Dotted path of the object concerned.
        message : str
            One plain sentence: what is wrong and what happens if it is ignored.
        evidence : dict, optional
            The facts the finding rests on.
        fixes : sequence of Fix
            The fixes offered; a fix without a slug takes this rule's.
        severity : Severity or str, optional
            One of :attr:`severities`; the usual one when omitted.

        Raises
        ------
        ValueError
            When ``severity`` is not one this rule declares (the rule's docs would then say something false).
        """
        level = self.severity if severity is None else Severity(severity)
        if level not in self.severities:
            raise ValueError(f"rule {self.slug} declares {self.severity_label}, not {level.value}")
        for fix in fixes:
            fix.slug = fix.slug or self.slug
        return Finding(self.slug, level.value, subject, message, dict(evidence or {}), list(fixes))

    def doc_markdown(self, level: int = 3) -> str:
        """The rule's reference entry in markdown: a heading of ``level``, its sections one level below."""
        head = [f"{'#' * level} `{self.slug}` ({self.severity_label})", "", markdown(self.title), "",
                f"Kind: {self.kind.value}."]  # fmt: skip
        return "\n".join(head + self.sections_markdown(level + 1)) + "\n"

    def sections_markdown(self, level: int, skip: tuple[str, ...] = ()) -> list[str]:
        """The lines of ruff's sections in markdown under headings of ``level``, each preceded by a blank line."""
        sub = "#" * level
        parts: list[str] = []
        for heading, text in self.sections().items():
            if not text or heading in skip:
                continue
            if heading in ("Example", "Use instead"):
                parts += ["", f"{sub} {heading}", "", "```python", text, "```"]
                continue
            if heading == "Fix safety":
                label = ", ".join(a.value for a in self.fix_safety) or "no fix offered"
                heading = f"{heading} ({label})"
            parts += ["", f"{sub} {heading}", "", markdown(text)]
        return parts


def markdown(text: str) -> str:
    """Docstring reStructuredText as markdown: ````x```` and ``:func:`x``` -> ``x`` in single backticks."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return re.sub(r"``(.+?)``", r"`\1`", text)


#: Every registered rule, by slug.
REGISTRY: dict[str, Rule] = {}


def register(rule: Rule) -> Rule:
    """Add ``rule`` to the registry and return it.

    Raises
    ------
    ValueError
        When another rule already holds its slug (a slug names one rule, whatever its kind).
    """
    held = REGISTRY.get(rule.slug)
    if held is not None and held != rule:
        raise ValueError(f"duplicate rule slug {rule.slug} ({held.kind.value} and {rule.kind.value})")
    REGISTRY[rule.slug] = rule
    return rule


def load_rules() -> dict[str, Rule]:
    """Import every rule source once and return the registry: checks, runtime rules and crash families."""
    for module_name, loader in RULE_SOURCES:
        module = importlib.import_module(module_name)
        if loader:
            getattr(module, loader)()
    return REGISTRY


def rule_for(slug: str) -> Rule | None:
    """The rule named ``slug`` (of any kind), or None."""
    return load_rules().get(slug)


def rules_of(kind: RuleKind, rules: Iterable[Rule] | None = None) -> list[Rule]:
    """The rules of ``kind``, sorted by slug."""
    return sorted((r for r in (load_rules().values() if rules is None else rules) if r.kind is kind),
                  key=lambda r: r.slug)  # fmt: skip
