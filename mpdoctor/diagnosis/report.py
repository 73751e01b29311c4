"""The Report: what ``diagnose()`` and ``%mpdoctor`` return.

Like ``%timeit -o``'s ``TimeitResult``, it is a value object: findings, the
dtype histogram and the facts behind them, with exports (pandas, dict/JSON,
markdown), ``refresh()`` to diagnose the same live objects again, and rich
display in notebooks.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from ..treatment.findings import Finding

if TYPE_CHECKING:
    import pandas

    from ..facts import Facts

HISTOGRAM_COLUMNS = ["object", "kind", "dtype", "tensors", "elements", "bytes", "trainable", "devices", "meta"]


class Report:
    """The diagnosis of a set of live objects.

    Attributes
    ----------
    findings : list of Finding
        Ordered by severity (errors first).
    facts : Facts
        The snapshot the findings rest on.
    target : str or None
        The what-if device profile, or None for the live machine.
    elapsed : float
        Seconds the diagnosis took.
    probe_table : pandas.DataFrame or None
        Per-module table of a one-batch probe (only for ``probe()`` reports).
    cause : Finding or None
        When the report explains an exception (the crash hook, ``mpdoctor run``,
        ``watch``): the finding that caused it, first in ``findings``.
    exception : str or None
        One-line summary of that exception (``"RuntimeError: mat1 and mat2 ..."``).
    scale_history : list of mpdoctor.facts.scale_history.ScaleRecord
        Per GradScaler and real step, while watched (``watch``, the callbacks, a notebook after
        ``%load_ext``): the scale, whether the step was skipped, the loss. Empty otherwise.
    """

    def __init__(
        self,
        findings: list[Finding],
        facts: Facts,
        target: str | None = None,
        scan: bool = False,
        ignore: tuple[str, ...] = (),
        elapsed: float = 0.0,
        probe_table: Any = None,
        rediagnose: Any = None,
        subjects: tuple = (),
        live: Any = None,
        plan: list | None = None,
        hidden: dict | None = None,
    ) -> None:
        self.findings = findings
        self.facts = facts
        self.target = target
        self.scan = scan
        self.ignore = tuple(ignore)
        self.elapsed = elapsed
        self.created = time.time()
        self.probe_table = probe_table
        self._rediagnose = rediagnose
        self._histogram = None
        self._skip_display_in: int | None = None
        self._subjects = tuple(subjects)
        self.live = live
        self._plan = plan
        #: The best plan of safe fixes only (set by diagnose; None: the safe fixes of the plan).
        self._safe_plan: list | None = None
        #: Findings hidden by ``ignore``, per check slug.
        self.hidden: dict[str, int] = dict(hidden or {})
        # Set by mpdoctor.crash when the report explains an exception; renderers show the cause first.
        self.cause: Finding | None = None
        self.exception: str | None = None
        # Set by the runtime observers (mpdoctor.runtime): the scale, skips and loss per watched step.
        self.scale_history: list = []
        self.watched: str | None = None  # what a runtime report watched (a notebook cell's AMP loop)
        #: The name of the inspected object whose method raised that exception (``"scaler16"``), when found.
        self.raised_by: str | None = None
        #: What the caller gave that is nothing to inspect, one sentence each (``diagnose(42)``).
        self.notes: list[str] = []

    # -- queries -----------------------------------------------------------------------
    @property
    def subjects(self) -> tuple:
        """The inspected subjects: name, kind and the live object (``.obj``), as discovered."""
        return self._subjects or self.facts.subjects

    def findings_for(self, check: str) -> list[Finding]:
        """Findings of one check slug."""
        return [f for f in self.findings if f.check == check]

    def counts(self) -> dict[str, int]:
        """Number of findings per severity."""
        out = {"error": 0, "warning": 0, "info": 0}
        for f in self.findings:
            out[f.severity] += 1
        return out

    @property
    def ok(self) -> bool:
        """True when there is no error and no warning."""
        c = self.counts()
        return c["error"] == 0 and c["warning"] == 0

    @property
    def fixes(self) -> list:
        """The treatment: the planned fixes, in the order to apply them (they never undo each other).

        Alternatives a finding also offers (``finding.fixes``, with ``fix.planned`` False and
        ``fix.note`` saying why) are in :attr:`all_fixes`.
        """
        if self._plan is not None:
            return list(self._plan)
        return self.all_fixes

    @property
    def safe_fixes(self) -> list:
        """The safe treatment: what :meth:`apply_safe_fixes` applies, in order.

        Planned with the same simulator as :attr:`fixes` on safe fixes alone, so it can hold a safe fix that
        :attr:`fixes` leaves as an alternative because it prefers an unsafe one (disabling a bf16 run's
        scaler while the plan casts to fp32 master weights).
        """
        if self._safe_plan is not None:
            return list(self._safe_plan)
        return [fx for fx in self.fixes if fx.safe]

    @property
    def all_fixes(self) -> list:
        """Every fix offered by every finding, planned or not."""
        out: list = []
        for f in self.findings:
            out.extend(fx for fx in f.fixes if all(fx is not x for x in out))
        return out

    def _current_treatment(self, fix: Any) -> Any:
        """The fix with ``fix``'s key in a plan made now from the live objects; None when not needed any more."""
        if not self._subjects:
            return fix
        now = self.refresh()
        match = next((fx for fx in now.all_fixes if fx.key == fix.key), None)
        if match is None:
            fix.note = "not applied: no longer needed (the fixes applied since resolved its finding)"
        return match

    @property
    def histogram(self) -> pandas.DataFrame:
        """Dtype tallies: one row per object x kind x dtype x trainability."""
        if self._histogram is None:
            import pandas as pd

            rows = [r._asdict() for r in self.facts.tallies]
            self._histogram = pd.DataFrame(rows, columns=HISTOGRAM_COLUMNS)
        return self._histogram

    @property
    def scan_table(self) -> pandas.DataFrame | None:
        """Per-module value scan (NaN/Inf counts, abs max, fp16/bf16 range), or None without ``scan=True``."""
        if not self.facts.scans:
            return None
        from .scan_rows import scan_table

        return scan_table(self.facts)

    def scan_rows(self) -> list[dict]:
        """The value scan as plain rows per module (what renderers show); empty without a scan."""
        if not self.facts.scans:
            return []
        from .scan_rows import scan_rows

        return scan_rows(self.facts)

    @property
    def ranks(self) -> list[dict]:
        """One row per rank after ``diagnose(..., distributed=True)``: rank, digest, whether it agrees, absent.

        Empty outside a cross-rank diagnosis. Rows of ranks that disagree carry their fingerprint.
        """
        dist = getattr(self.facts, "distributed", None)
        if dist is None or not dist.exchanged:
            return []
        counts: dict[str, int] = {}
        for r in dist.ranks:
            counts[r.digest] = counts.get(r.digest, 0) + 1
        common = max(counts, key=lambda d: (counts[d], -min(x.rank for x in dist.ranks if x.digest == d))) if counts else None
        rows = [{"rank": r.rank, "digest": r.digest, "agrees": r.digest == common, "answered": True,
                 "fingerprint": r.fingerprint} for r in dist.ranks]  # fmt: skip
        rows += [{"rank": r, "digest": None, "agrees": False, "answered": False, "fingerprint": None} for r in dist.absent]
        return sorted(rows, key=lambda row: row["rank"])

    # -- actions -----------------------------------------------------------------------
    def refresh(self) -> Report:
        """Diagnose the same live objects again (with the same target, scan and ignore list)."""
        if self._rediagnose is None:  # a report built by hand, not by diagnose(): nothing live to re-read
            return self
        return self._rediagnose()

    def apply_safe_fixes(self) -> list:
        """Apply the best plan of safe fixes (:attr:`safe_fixes`) not yet applied; return the fixes applied.

        A fix that fails is rolled back, keeps its ``error`` and is skipped;
        the others are still applied.
        """
        from ..treatment.fixes import FixFailed, FixNeedsConfirmation

        applied = []
        for fix in self.safe_fixes:
            if not fix.applied:
                try:
                    fix.apply()
                    applied.append(fix)
                except (FixFailed, FixNeedsConfirmation) as exc:
                    fix.error = fix.error or str(exc)
        return applied

    # -- exports -----------------------------------------------------------------------
    def to_frame(self) -> pandas.DataFrame:
        """Findings as a DataFrame (one row per finding)."""
        import pandas as pd

        rows = [
            {
                "severity": f.severity,
                "check": f.check,
                "subject": f.subject,
                "message": f.message,
                "fixes": "; ".join(x.title for x in f.fixes),
                "ranks": ",".join(str(r) for r in f.evidence.get("ranks", ())) if isinstance(f.evidence, dict) else "",
            }
            for f in self.findings
        ]
        columns = ["severity", "check", "subject", "message", "fixes"]
        if self.ranks:  # a cross-rank report: which ranks each finding concerns
            columns.append("ranks")
        return pd.DataFrame(rows, columns=columns)

    def to_dict(self) -> dict:
        """A JSON-serialisable dict of the whole report."""
        from ..render.data import report_dict

        return report_dict(self)

    def to_json(self, indent: int | None = 2) -> str:
        """The report as JSON."""
        return json.dumps(self.to_dict(), indent=indent)

    def to_markdown(self) -> str:
        """Markdown ready to paste into a bug report, with versions and device."""
        from ..render.markdown import render_markdown

        return render_markdown(self)

    def to_text(self, width: int = 100) -> str:
        """The compact text rendering (what ``print(report)`` shows)."""
        from ..render.text import render_text

        return render_text(self, width=width)

    def to_html(self) -> str:
        """The static HTML rendering (no buttons)."""
        from ..render.html import render_html

        return render_html(self)

    def widget(self) -> Any:
        """The interactive ipywidgets report with fix buttons."""
        from ..render.widget import ReportWidget

        return ReportWidget(self)

    # -- display -----------------------------------------------------------------------
    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        c = self.counts()
        names = ", ".join(s.name for s in self.subjects) or "nothing"
        from ..treatment.findings import count

        return f"<mpdoctor.Report: {count(c['error'], 'error')}, {count(c['warning'], 'warning')}, {c['info']} info on {names}>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self) if cycle else self.to_text())

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None, **kwargs: Any) -> dict:
        bundle = {"text/plain": self.to_text(), "text/html": self.to_html()}
        if include:
            bundle = {k: v for k, v in bundle.items() if k in include}
        if exclude:
            bundle = {k: v for k, v in bundle.items() if k not in exclude}
        return bundle

    def _ipython_display_(self) -> None:
        from ..render.frontend import show

        show(self)
