"""The Report: what ``diagnose()`` and ``%mpdoctor`` return.

Like ``%timeit -o``'s ``TimeitResult``, it is a value object: findings, the
dtype histogram and the facts behind them, with exports (pandas, dict/JSON,
markdown), ``refresh()`` to diagnose the same live objects again, and rich
display in notebooks.
"""

from __future__ import annotations

import copy
import json
from dataclasses import InitVar, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable

from ..rules.engine.findings import Finding
from .treatment import Treatment, carry_over

if TYPE_CHECKING:
    import pandas

    from ..facts import Facts
    from ..render.view import ReportView

HISTOGRAM_COLUMNS = ["object", "kind", "dtype", "tensors", "elements", "bytes", "trainable", "devices", "meta"]


@dataclass(frozen=True, eq=False, repr=False)
class Report:
    """The diagnosis of a set of live objects: a value, made once.

    Everything a report shows is given when it is made: the findings of the diagnosis, of the cell history, of a
    watcher and of a crash; the scale history; the cause. A frozen dataclass: its fields are spelled once, below,
    and nothing changes them afterwards: :meth:`evolve` makes a new report with some fields replaced (what the
    crash hook and the watchers do), and :meth:`refresh` a new report of the same live objects. Applying and
    undoing fixes is the :attr:`treatment`'s job.

    Attributes
    ----------
    findings : tuple of Finding
        Ordered by severity (errors first).
    facts : Facts
        The snapshot the findings rest on.
    target : str or None
        The what-if device profile, or None for the live machine.
    elapsed : float
        Seconds the diagnosis took.
    probe_table : pandas.DataFrame or None
        Per-module table of a one-batch probe (only for ``probe()`` reports). Made when first read from
        ``probe_source``, which may be a function returning it.
    cause : Finding or None
        When the report explains an exception (the crash hook, ``mpdoctor run``,
        ``watch``): the finding that caused it, first in ``findings``.
    exception : str or None
        One-line summary of that exception (``"RuntimeError: mat1 and mat2 ..."``).
    raised_by : str or None
        The name of the inspected object whose method raised that exception (``"scaler16"``), when found.
    scale_history : tuple of mpdoctor.facts.scale_history.ScaleRecord
        Per GradScaler and real step, while watched (``watch``, the callbacks, a notebook after
        ``%load_ext``): the scale, whether the step was skipped, the loss. Empty otherwise.
    watched : str or None
        What a runtime report watched (a notebook cell's AMP loop).
    notes : tuple of str
        What the caller gave that is nothing to inspect, one sentence each (``diagnose(42)``).
    treatment : Treatment
        Applies, undoes and re-plans this report's fixes on the live objects.
    proof : mpdoctor.diagnosis.proof.Proof or None
        The plan checked on the user's step (``diagnose(..., step=fn)``), or None when no step was held.
    departed : tuple of dict
        After :meth:`refresh`: each finding of the previous report that is not in this diagnosis (``check``,
        ``subject``, ``severity``) and ``why``: ``"fixed"``, ``"superseded"`` or ``"only fixable in code"``
        (that one is still in :attr:`findings`, with its code). Empty for a first diagnosis.
    """

    findings: tuple = ()
    facts: Facts = None  # type: ignore[assignment]
    target: str | None = None
    scan: bool = False
    ignore: tuple = ()
    elapsed: float = 0.0
    #: The probe's per-module table, or a function making it (:attr:`probe_table` calls it once, when first read).
    probe_source: Any = None
    #: Diagnoses the same live objects again (given to a new :class:`Treatment`; unused when ``treatment`` is given).
    rediagnose: InitVar[Callable[[], Report] | None] = None
    #: The subjects as discovered (:attr:`subjects` falls back to the facts' own).
    discovered: tuple = ()
    live: Any = None
    #: The planned fixes, in order (None: every fix of the findings, :attr:`fixes`).
    plan: tuple | None = None
    #: Findings hidden by ``ignore``, per check slug.
    hidden: dict = field(default_factory=dict)
    #: The best plan of safe fixes only (None: the safe fixes of the plan).
    safe_plan: tuple | None = None
    cause: Finding | None = None
    exception: str | None = None
    raised_by: str | None = None
    scale_history: tuple = ()
    watched: str | None = None
    notes: tuple = ()
    treatment: Treatment = None  # type: ignore[assignment]
    proof: Any = None
    departed: tuple = ()
    #: ``(fix, TwinTrial)``: what a code fix did when run on copies of the user's objects before it was shown.
    trials: tuple = ()
    _cache: dict = field(init=False, default_factory=dict)

    def __post_init__(self, rediagnose: Callable[[], Report] | None) -> None:
        # Each field in its one shape (tuples, a dict of its own), given as any iterable.
        normal = {
            "findings": tuple(self.findings), "ignore": tuple(self.ignore), "discovered": tuple(self.discovered),
            "plan": tuple(self.plan) if self.plan is not None else None,
            "safe_plan": tuple(self.safe_plan) if self.safe_plan is not None else None,
            "hidden": dict(self.hidden or {}), "scale_history": tuple(self.scale_history), "notes": tuple(self.notes),
            "departed": tuple(dict(d) for d in self.departed), "trials": tuple(self.trials),
            "treatment": self.treatment if self.treatment is not None else Treatment(rediagnose),
        }  # fmt: skip
        for name, value in normal.items():
            object.__setattr__(self, name, value)  # a frozen dataclass sets its own fields here, once
        if self.proof is not None:  # a fix verified with others applies them: the treatment keeps what the proof found
            self.treatment.learn(self.proof)

    def evolve(self, **changes: Any) -> Report:
        """A new report with ``changes`` (keyword: field name) and every other field as in this one.

        The new report shares this one's :attr:`treatment`: applying a fix from either re-plans against the same
        live objects. Fields: the dataclass's fields (``findings``, ``cause``, ``scale_history``, ...).
        """
        unknown = set(changes) - {f.name for f in fields(self) if f.init}
        if unknown:
            raise TypeError(f"Report has no field {sorted(unknown)}")
        evolved = replace(self, **changes)
        if evolved.proof is not None and "proof" not in changes and not _same_plans(self, evolved):
            # A proof is of one plan: a report whose plan changed after it holds no proof (its fixes unverified).
            return replace(evolved, proof=None)
        return evolved

    # -- queries -----------------------------------------------------------------------
    @property
    def probe_table(self) -> Any:
        """The probe's per-module DataFrame (None outside ``probe()`` reports), made once, when first read."""
        table = self.probe_source
        if callable(table):
            if "probe_table" not in self._cache:
                self._cache["probe_table"] = table()
            return self._cache["probe_table"]
        return table

    @property
    def subjects(self) -> tuple:
        """The inspected subjects: name, kind and the live object (``.obj``), as discovered."""
        return self.discovered or self.facts.subjects

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
        if self.plan is not None:
            return list(self.plan)
        return self.all_fixes

    @property
    def safe_fixes(self) -> list:
        """The safe treatment: what :meth:`apply_safe_fixes` applies, in order.

        Planned with the same simulator as :attr:`fixes` on safe fixes alone, so it can hold a safe fix that
        :attr:`fixes` leaves as an alternative because it prefers an unsafe one (disabling a bf16 run's
        scaler while the plan casts to fp32 master weights).
        """
        if self.safe_plan is not None:
            return list(self.safe_plan)
        return [fx for fx in self.fixes if fx.safe]

    @property
    def all_fixes(self) -> list:
        """Every fix offered by every finding, planned or not."""
        out: list = []
        for f in self.findings:
            out.extend(fx for fx in f.fixes if all(fx is not x for x in out))
        return out

    @property
    def histogram(self) -> pandas.DataFrame:
        """Dtype tallies: one row per object x kind x dtype x trainability."""
        if "histogram" not in self._cache:
            import pandas as pd

            rows = [r._asdict() for r in self.facts.tallies]
            self._cache["histogram"] = pd.DataFrame(rows, columns=HISTOGRAM_COLUMNS)
        return self._cache["histogram"]

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
        common = dist.reference
        rows = [{"rank": r.rank, "digest": r.digest, "agrees": r.digest == common, "answered": True,
                 "fingerprint": r.fingerprint} for r in dist.ranks]  # fmt: skip
        rows += [{"rank": r, "digest": None, "agrees": False, "answered": False, "fingerprint": None} for r in dist.absent]
        return sorted(rows, key=lambda row: row["rank"])

    # -- actions (doors onto the treatment) ---------------------------------------------
    def refresh(self) -> Report:
        """A new report of the same live objects, diagnosed now (with the same target, scan and ignore list).

        Each finding of this report that the new one does not find is in its :attr:`departed`, saying why it left
        (fixed, superseded by another fix); a finding only code can fix stays, with its code. A report built by
        hand, with nothing live to re-read, returns itself.
        """
        fresh = self.treatment.refresh(self)
        return self if fresh is self else carry_over(self, fresh)

    def apply_safe_fixes(self) -> list:
        """Apply the best plan of safe fixes (:attr:`safe_fixes`) not yet applied; return the fixes applied.

        A fix that fails is rolled back, keeps its ``error`` and is skipped;
        the others are still applied. Call :meth:`refresh` for the report after them.
        """
        return self.treatment.apply_safe(self.safe_fixes)

    # -- the view and the exports ------------------------------------------------------------
    @property
    def view(self) -> ReportView:
        """The plain view every renderer reads, built once per state of this report's fixes."""
        from .view_builder import build_view, fix_state

        state = fix_state(self)
        cached = self._cache.get("view")
        if cached is None or cached[0] != state:
            cached = self._cache["view"] = (state, build_view(self))
        return cached[1]

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
        """A JSON-serialisable dict of the whole report (a copy: changing it changes nothing else)."""
        return copy.deepcopy(self.view.data)

    def to_json(self, indent: int | None = 2) -> str:
        """The report as JSON."""
        return json.dumps(self.view.data, indent=indent)

    def to_markdown(self) -> str:
        """Markdown ready to paste into a bug report, with versions and device."""
        from ..render.markdown import render_markdown

        return self.view.rendered("markdown", render_markdown)

    def to_text(self, width: int = 100) -> str:
        """The compact text rendering (what ``print(report)`` shows)."""
        from ..render.text import render_text

        return self.view.rendered(("text", width), lambda view: render_text(view, width=width))

    def to_html(self) -> str:
        """The static HTML rendering (no buttons)."""
        from ..render.html import render_html

        return self.view.rendered("html", render_html)

    def controller(self) -> Any:
        """What an interactive front end acts through (:class:`~mpdoctor.diagnosis.treatment.ReportController`):
        this report as the one shown, re-diagnosis, apply, undo and the safe plan."""
        from .treatment import ReportController

        return ReportController(self)

    def widget(self) -> Any:
        """The interactive ipywidgets report with fix buttons, acting through :meth:`controller`."""
        from ..render.widget import ReportWidget

        return ReportWidget(self.controller())

    # -- display -----------------------------------------------------------------------
    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        c = self.counts()
        names = ", ".join(s.name for s in self.subjects) or "nothing"
        from ..rules.engine.findings import count

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


def _same_plans(one: Report, other: Report) -> bool:
    """The two reports plan the same fixes, in the same order (the plan and the safe plan)."""
    def same(a: list, b: list) -> bool:
        return len(a) == len(b) and all(x is y for x, y in zip(a, b))

    return same(one.fixes, other.fixes) and same(one.safe_fixes, other.safe_fixes)
