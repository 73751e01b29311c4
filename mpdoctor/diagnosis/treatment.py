"""The verb beside the Report: applying, undoing and re-planning fixes on the live objects.

A :class:`~mpdoctor.diagnosis.report.Report` is a value: what was found, when it was made. Acting on the live
objects behind it is the job of one :class:`Treatment` per diagnosed set of objects, shared by every report
re-diagnosed from them (``report.refresh()`` returns a new Report with the same Treatment). The old doors stay:
``fix.apply()``, ``fix.undo()``, ``report.apply_safe_fixes()`` and ``report.refresh()`` all end here.

Before a fix is applied it is re-planned against the objects as they are now (another fix applied since may have
resolved its finding, or changed which tensors its cast must cover), so a fix taken from an older report still does
the right thing.
"""

from __future__ import annotations

from typing import Any, Callable

from ..rules.engine.fixes import Fix, FixFailed, FixNeedsConfirmation, FixRecord

#: Why a finding of the last report is not in a re-diagnosis, as ``report.departed`` and ``to_dict()`` say it.
FIXED, SUPERSEDED, CODE_ONLY, CHANGED = "fixed", "superseded", "only fixable in code", "changed outside"

#: A Report (``mpdoctor.diagnosis.report``, which holds a Treatment: not imported here, not even for annotations).
Report = Any


class Treatment:
    """Applies, undoes and re-plans the fixes of the reports diagnosed from one set of live objects.

    Parameters
    ----------
    source : callable, optional
        Diagnoses the same live objects again and returns a new Report (sharing this treatment). None for a
        report built by hand (nothing live to re-read: fixes apply as planned).
    """

    def __init__(self, source: Callable[[], Report] | None = None) -> None:
        self.source = source
        #: Fixes applied through this treatment, oldest first (what :meth:`undo` walks back).
        self.applied: list[Fix] = []
        #: What the last proof said each fix needs first: ``id(fix) -> (fix, prerequisites)``
        #: (:meth:`mpdoctor.diagnosis.proof.Proof.prerequisites`).
        self.needs: dict[int, tuple[Fix, tuple]] = {}
        #: The fixes applied with each fix applied as a group: ``id(fix) -> (fix, group)``.
        self.groups: dict[int, tuple[Fix, tuple]] = {}
        #: What happened to each fix bound to this treatment: ``id(fix) -> (fix, record)``.
        self.records: dict[int, tuple[Fix, FixRecord]] = {}

    def record_of(self, fix: Fix) -> FixRecord:
        """What happened to ``fix``: the record this treatment keeps for it (it adopts the one the fix kept before
        it was bound, so nothing that happened is lost)."""
        entry = self.records.get(id(fix))
        if entry is None or entry[0] is not fix:
            entry = self.records[id(fix)] = (fix, fix._own)
        return entry[1]

    def learn(self, proof: Any) -> None:
        """Keep the prerequisites ``proof`` found (it replaces what an earlier proof said of the same fixes)."""
        for fix, needed in getattr(proof, "needs", ()):
            self.needs[id(fix)] = (fix, tuple(needed))

    def prerequisites(self, fix: Fix) -> tuple:
        """``fix`` and the fixes it was verified with, in the order they ran (its proof names them): what applying
        ``fix`` applies; () for a fix verified alone."""
        entry = self.needs.get(id(fix))
        return entry[1] if entry is not None and entry[0] is fix else ()

    @property
    def live(self) -> bool:
        """True when the treatment can re-read live objects (the report came from ``diagnose`` or ``probe``)."""
        return self.source is not None

    def refresh(self, report: Report) -> Report:
        """A new Report of the same live objects, diagnosed now (``report`` itself when nothing is live)."""
        if self.source is None:
            return report
        return self.source()

    def current(self, fix: Fix) -> Fix | None:
        """The fix with ``fix``'s key in a plan made now from the live objects; None when no longer needed."""
        if self.source is None:
            return fix
        now = self.source()
        match = next((fx for fx in now.all_fixes if fx.key == fix.key), None)
        if match is None:
            fix.note = "not applied: no longer needed (the fixes applied since resolved its finding)"
        return match

    def apply(self, fix: Fix, confirm: bool = False) -> Fix:
        """Re-plan ``fix`` against the live objects, then apply it in place (atomically); return it.

        Raises
        ------
        FixNeedsConfirmation
            When the undo backup exceeds the budget and ``confirm`` is False.
        FixFailed
            When a step fails (every step already taken is reverted), or for a display-only fix.
        """
        if fix.applied:
            return fix
        fix.check_applicable(confirm)
        group = [fx for fx in self.prerequisites(fix) if not fx.applied]
        if group and any(fx is not fix for fx in group):
            return self._with_prerequisites(fix, group, confirm)
        return self._apply_one(fix)

    def _apply_one(self, fix: Fix) -> Fix:
        """Re-plan ``fix`` against the live objects, then apply it in place (atomically)."""
        changes = None
        if fix.changes and not fix.bound_where_seen:
            current = self.current(fix)
            if current is None:
                return fix  # no longer needed: current() set fix.note
            if current.changes != fix.changes:  # the same treatment, re-planned against the objects as they are now
                changes = current.changes
        fix.apply_steps(changes)
        self.applied.append(fix)
        return fix

    def _with_prerequisites(self, fix: Fix, group: list[Fix], confirm: bool) -> Fix:
        """Apply ``group`` (``fix`` and the fixes it was verified with, in the order that ran) as one action: when
        one fails, those applied here are undone, newest first, and the failure raised."""
        done: list[Fix] = []
        try:
            for member in group:
                member.check_applicable(confirm)
                self._apply_one(member)
                if member.applied:
                    done.append(member)
        except BaseException:
            for member in reversed(done):
                self.undo(member)
            raise
        self.groups[id(fix)] = (fix, tuple(done))  # undoing fix undoes what applying it applied
        return fix

    def undo(self, fix: Fix | None = None) -> Fix | None:
        """Undo ``fix`` (default: the last fix applied through this treatment); return it, or None."""
        if fix is None:
            fix = next((fx for fx in reversed(self.applied) if fx.applied), None)
            if fix is None:
                return None
        group = self.groups.pop(id(fix), None)
        members = group[1] if group is not None and group[0] is fix else (fix,)
        for member in reversed(members):
            member.undo_steps()
            if member in self.applied:
                self.applied.remove(member)
        return fix

    def apply_safe(self, fixes: list[Fix]) -> list[Fix]:
        """Apply ``fixes`` (a report's safe plan) not yet applied, in order; return those applied.

        A fix that fails is rolled back, keeps its ``error`` and is skipped; the others are still applied.
        """
        applied = []
        for fix in fixes:
            if fix.applied:
                continue
            try:
                self.apply(fix)
            except (FixFailed, FixNeedsConfirmation) as exc:
                fix.record.error = fix.error or str(exc)
                continue
            if fix.applied:
                applied.append(fix)
        return applied


class ReportController:
    """What an interactive front end (the widget) acts through: the current report of one set of live objects, and
    the actions on them. A renderer draws :attr:`report`; it never calls the report's doors itself.

    Parameters
    ----------
    report : Report
        The report first shown; :meth:`adopt` replaces it.
    """

    def __init__(self, report: Report) -> None:
        self.report = report

    def diagnose_now(self) -> Report:
        """The live objects diagnosed again, not yet shown: compare it with :attr:`report` before acting."""
        return self.report.refresh()

    def adopt(self, fresh: Report) -> Report:
        """Show ``fresh`` from now on; returns it."""
        self.report = fresh
        return fresh

    def refresh(self) -> Report:
        """Diagnose again and show the result (a report with nothing live to re-read stays as it is)."""
        return self.adopt(self.diagnose_now())

    def offers(self, fix: Fix) -> bool:
        """``fix`` is one the current report offers, and not applied: a button of an older report is stale."""
        offered = getattr(self.report, "all_fixes", None) or self.report.fixes
        return not fix.applied and any(fix is x for x in offered)

    def apply(self, fix: Fix, confirm: bool = False) -> None:
        """Apply ``fix`` to the live objects (re-planned on them first); raises what :meth:`Fix.apply` raises."""
        fix.apply(confirm=confirm)

    def undo(self, fix: Fix) -> None:
        """Undo ``fix`` exactly."""
        fix.undo()

    def apply_safe(self) -> list[Fix]:
        """Apply the current report's best plan of safe fixes; the fixes applied."""
        return self.report.apply_safe_fixes()


def bind_fixes(report: Any, live: Any, treatment: Treatment) -> None:
    """Bind every fix of ``report`` (its findings', its plans') to the live table and the treatment."""
    for f in report.findings:
        for fx in f.fixes:
            fx.bind(live, treatment)
    for fx in (*report.fixes, *report.safe_fixes):
        fx.bind(live, treatment)


def _finding_key(finding: Any) -> tuple[str, str]:
    return (finding.check, finding.subject)


def _code_only(finding: Any) -> bool:
    """A finding whose every fix is code to write (a loop mistake): re-diagnosing the objects cannot see it go."""
    return bool(finding.fixes) and all(fx.applicability.value == "display-only" for fx in finding.fixes)


def _pending_where_seen(finding: Any) -> bool:
    """A crash's finding whose fix, bound to the batch the crash saw, is not applied yet: a re-diagnosis of the
    objects at rest cannot see that batch, so the finding has not left, it is still to treat."""
    fixes = finding.fixes
    return any(fx.bound_where_seen for fx in fixes) and not any(fx.applied for fx in fixes)


def why_departed(finding: Any, any_applied: bool) -> str:
    """Why ``finding``, absent from a re-diagnosis, left.

    :data:`CODE_ONLY` (it stays), :data:`FIXED` (one of its fixes was applied), :data:`SUPERSEDED` (another fix
    of its report was), or :data:`CHANGED` (no fix was applied: the user's own code changed the objects).
    """
    if _code_only(finding):
        return CODE_ONLY
    if any(fx.applied for fx in finding.fixes):
        return FIXED
    return SUPERSEDED if any_applied else CHANGED


def carry_over(before: Report, fresh: Report) -> Report:
    """``fresh`` (a re-diagnosis of ``before``'s objects) saying why each finding of ``before`` left.

    The one decision behind both ``report.refresh()`` and the widget's buttons. A finding only code can fix (the
    watcher's, the cell reader's and the crash's loop findings, absent from a diagnosis of the objects at rest)
    stays, with its code; so does a crash's finding whose fix, bound to the batch it saw, is not applied yet (it
    has not left); every other finding gone is marked fixed (one of its own fixes was applied) or
    superseded (another fix resolved it), or changed outside (no fix was applied: the user's code changed the
    objects). The marks are ``fresh.departed``: one dict per finding, with ``check``, ``subject``, ``severity``
    and ``why``.
    """
    now = {_finding_key(f) for f in fresh.findings}
    unseen = [f for f in before.findings if _finding_key(f) not in now]
    pending = [f for f in unseen if not _code_only(f) and _pending_where_seen(f)]  # it never left
    gone = [f for f in unseen if all(f is not p for p in pending)]
    kept = [*(f for f in gone if _code_only(f)), *pending]
    any_applied = any(fx.applied for fx in (*before.all_fixes, *before.safe_fixes))
    departed = tuple(
        {"check": f.check, "subject": f.subject, "severity": f.severity, "why": why_departed(f, any_applied)}
        for f in gone
    )
    findings = sorted([*fresh.findings, *kept], key=lambda f: f.rank) if kept else fresh.findings
    return fresh.evolve(findings=findings, departed=departed, **_plans_keeping(fresh, pending))


def _plans_keeping(fresh: Report, pending: list) -> dict:
    """The pending crash fixes stay in the plans, as bound: "Apply all safe fixes" still applies them."""
    bound = [fx for f in pending for fx in f.fixes if fx.bound_where_seen and fx.planned]
    if not bound:
        return {}
    return {"plan": [*fresh.fixes, *bound], "safe_plan": [*fresh.safe_fixes, *(fx for fx in bound if fx.safe)]}
