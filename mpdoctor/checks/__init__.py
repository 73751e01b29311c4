"""The check registry.

A check is a function ``facts -> iterable of Finding`` registered under a
stable slug with :func:`check`. Its docstring has a one-line summary and four
sections, as ruff documents its rules::

    What it detects
        ...
    Why it matters
        ...
    Fix
        ...
    Source
        ...

The checks reference (``docs/checks.md``) is generated from these docstrings
(``python -m mpdoctor checks --update-docs``), so code and docs cannot drift.
A check that raises becomes an ``internal-error`` finding; the others still run.
"""

from __future__ import annotations

import importlib
import inspect
import re
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Callable

from ..treatment.findings import Finding

SECTIONS = ("What it detects", "Why it matters", "Severity", "Fix", "Source")

#: Modules holding checks, imported in this order when the registry is first used.
MODULES = (
    "scaler", "cache", "optimizer", "dtypes", "precision", "hardware", "numerics", "lightning", "distributed",
    "diffusion", "lowbit", "trl", "lowprecision", "deepspeed",
)


@dataclass(frozen=True)
class Check:
    """A registered check."""

    slug: str
    severity: str
    func: Callable
    summary: str
    sections: dict

    @property
    def why(self) -> str:
        """The 'Why it matters' section."""
        return self.sections.get("Why it matters", "")

    def doc_markdown(self) -> str:
        """One reference paragraph in markdown."""
        parts = [f"### `{self.slug}` ({self.severity})", "", _markdown(self.summary), ""]
        for title in SECTIONS:
            if self.sections.get(title):
                parts.append(f"- **{title}:** {_markdown(self.sections[title])}")
        return "\n".join(parts) + "\n"


def _markdown(text: str) -> str:
    """Docstring reStructuredText as markdown: ````x```` and ``:func:`x``` -> ``x`` in single backticks."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return re.sub(r"``(.+?)``", r"`\1`", text)


REGISTRY: dict[str, Check] = {}
_loaded = False


def _parse_doc(doc: str) -> tuple[str, dict]:
    doc = inspect.cleandoc(doc or "")
    lines = doc.splitlines()
    summary = lines[0].strip() if lines else ""
    sections: dict[str, list[str]] = {}
    current = None
    for line in lines[1:]:
        if line.strip() in SECTIONS and not line.startswith(" "):
            current = line.strip()
            sections[current] = []
        elif current is not None and line.strip():
            sections[current].append(line.strip())
    return summary, {k: re.sub(r"\s+", " ", " ".join(v)) for k, v in sections.items()}


def check(slug: str, severity: str) -> Callable[[Callable], Callable]:
    """Register a check under ``slug``; ``severity`` is its usual (most severe) level."""

    def register(func: Callable) -> Callable:
        summary, sections = _parse_doc(func.__doc__ or "")
        missing = [s for s in SECTIONS if not sections.get(s)]
        if missing:
            raise ValueError(f"check {slug} lacks docstring sections: {missing}")
        if slug in REGISTRY and REGISTRY[slug].func.__qualname__ != func.__qualname__:
            raise ValueError(f"duplicate check slug {slug}")
        REGISTRY[slug] = Check(slug, severity, func, summary, sections)
        return func

    return register


def load() -> dict[str, Check]:
    """Import every check module once and return the registry."""
    global _loaded
    if not _loaded:
        for name in MODULES:
            try:
                importlib.import_module(f"{__name__}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{__name__}.{name}":
                    raise
        _loaded = True
    return REGISTRY


def internal_error(where: str, exc: BaseException) -> Finding:
    """The finding that stands in for a check or a fact that raised."""
    tb = traceback.extract_tb(exc.__traceback__)
    frame = f" ({tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})" if tb else ""
    return Finding(
        check="internal-error",
        severity="error",
        subject=where,
        message=f"mpdoctor could not complete {where}: {type(exc).__name__}: {exc}{frame}. The rest of the report is unaffected.",
        evidence={"exception": type(exc).__name__, "detail": str(exc)[:300]},
    )


def run_checks(facts, ignore: Iterable[str] = (), hidden: dict[str, int] | None = None) -> list[Finding]:
    """Run every registered check; drop the findings of checks in ``ignore``; never raises.

    Ignored checks still run when ``hidden`` is given, which receives how many
    findings each of them would have shown (a report says what it hides).
    """
    skip = set(ignore)
    findings: list[Finding] = []
    for where, detail in facts.errors:
        findings.append(
            Finding(
                check="internal-error",
                severity="error",
                subject=where,
                message=f"mpdoctor could not read {where}: {detail}. The rest of the report is unaffected.",
                evidence={"detail": detail},
            )
        )
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
    """The checks reference in markdown, generated from the check docstrings."""
    registry = load()
    return "\n".join(registry[slug].doc_markdown() for slug in sorted(registry))
