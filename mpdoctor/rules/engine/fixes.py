"""Fixes that change live objects in place, atomically, with an exact undo.

A :class:`Fix` is data: a title, an applicability, the code that does the same,
and change specs (:mod:`mpdoctor.rules.engine.changes`) bound to the live objects
when it is applied. Each change records what it replaces before replacing it;
when a step fails, the steps already taken are reverted in reverse order and
:class:`FixFailed` says why, so a fix is never half-applied. Casting fixes
compute every new tensor before swapping any in, so the failure point
(allocation) comes before the first visible change.

``safe`` follows ruff's fix applicability: a safe fix keeps the meaning of
the run the user intended; an unsafe one changes numerics or state and is
applied only on an explicit request.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ...objects.edits.steps import Change
from ...redact import describe_exception
from .rules import Applicability  # defined beside Rule; this import path stays

#: Fixes whose undo backup would exceed this many bytes ask for ``apply(confirm=True)``.
UNDO_BUDGET_BYTES = 2 * 2**30


#: What a fix is: fixed when it is made (:meth:`Fix.replace` makes another).
_VALUE = frozenset({"title", "code", "changes", "applicability", "cost", "recipe", "backup_bytes", "needs_confirmation"})
#: Where a fix is filed: its check and its finding's subject, written once when it is filed, never moved.
_ADDRESS = frozenset({"slug", "finding_subject"})


class FixFailed(RuntimeError):
    """A fix could not be applied; everything it touched is as it was before."""


class FixNeedsConfirmation(RuntimeError):
    """A fix would keep a backup larger than the undo budget; apply it with ``confirm=True``."""


@dataclass
class FixRecord:
    """What happened to a fix: whether it is applied, how applying or undoing it failed, and the steps it took (what
    undo reverts). Kept by the treatment the fix is bound to, keyed by the fix (:meth:`FixDoor.record_of`); a fix
    bound to none keeps its own."""

    applied: bool = False
    error: str | None = None
    steps: list = field(default_factory=list)


class FixDoor(Protocol):
    """What a fix is bound to for applying: the diagnosis-level treatment (it re-plans against the live objects and
    keeps what happened to each fix)."""

    def apply(self, fix: Fix, confirm: bool = False) -> Fix: ...

    def undo(self, fix: Fix | None = None) -> Fix | None: ...

    def record_of(self, fix: Fix) -> FixRecord: ...


class Fix:
    """A way to fix a finding in place.

    Parameters
    ----------
    title : str
        Imperative title (``"Set use_cache=False on text_config"``).
    code : str
        The Python that makes the same change, to paste where the object is created.
    backup_bytes : int
        Estimated undo backup; above :data:`UNDO_BUDGET_BYTES` the title says
        so and ``apply`` needs ``confirm=True``.
    changes : tuple of ChangeSpec
        What the fix does, as plain data (:mod:`mpdoctor.rules.engine.changes`), resolved against the live table
        when applied.
    applicability : Applicability
        Safe, unsafe (the default: applied only on an explicit request) or display-only.
    cost : str
        What the fix costs (memory, speed), for choosing between alternatives.
    recipe : str
        A stable name of the treatment within its check (``"fp32-master-weights"``).
    """

    def __init__(
        self,
        title: str,
        code: str,
        *,
        changes: Sequence[Any] = (),
        applicability: Applicability | None = None,
        cost: str = "",
        recipe: str = "",
        backup_bytes: int = 0,
        slug: str = "",
        finding_subject: str = "",
    ) -> None:
        set_value = super().__setattr__
        set_value("_given_title", title)
        set_value("slug", slug)
        set_value("finding_subject", finding_subject)
        set_value("code", code)
        set_value("applicability", applicability or Applicability.UNSAFE)
        set_value("changes", tuple(changes))
        set_value("backup_bytes", backup_bytes)
        set_value("needs_confirmation", backup_bytes > UNDO_BUDGET_BYTES)
        if self.needs_confirmation:
            title = f"{title} (keeps a {backup_bytes / 2**30:.1f} GiB undo backup)"
        set_value("title", title)
        set_value("cost", cost)
        set_value("recipe", recipe)
        # Replaceable attributes, so fault-injection tests can make any step fail.
        self._plan: Callable[[], list[Change]] = self._spec_steps
        self._verify: Callable[[], str | None] = self._spec_problem
        # What happens to it, until a treatment keeps that (bind): :attr:`record`.
        self._own = FixRecord()
        #: Set by the treatment planner: whether this fix is part of the report's plan, and why not.
        self.planned = True
        self.note = ""
        self._live: Any = None
        self._door: FixDoor | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _ADDRESS and getattr(self, name) in ("", value):
            super().__setattr__(name, value)  # filed under its check and finding once, never moved
            return
        if name in _VALUE or name in _ADDRESS:
            raise AttributeError(f"a Fix is a value: make another with fix.replace({name}=...)")
        super().__setattr__(name, value)

    def replace(self, **values: Any) -> Fix:
        """Another fix with ``values`` (the constructor's keywords) and this one's other values; its record is
        new (not applied, no note), bound as this one is."""
        given = {"title": self._given_title, "code": self.code, "changes": self.changes,
                 "applicability": self.applicability, "cost": self.cost, "recipe": self.recipe,
                 "backup_bytes": self.backup_bytes, "slug": self.slug, "finding_subject": self.finding_subject}  # fmt: skip
        unknown = set(values) - set(given)
        if unknown:
            raise TypeError(f"Fix has no value {sorted(unknown)}")
        given.update(values)
        title, code = given.pop("title"), given.pop("code")
        return Fix(title, code, **given).bind(self._live, self._door)

    @property
    def record(self) -> FixRecord:
        """What happened to this fix (applied, the error, the steps to undo): the record its treatment keeps."""
        door = self._door
        return door.record_of(self) if door is not None else self._own

    @property
    def applied(self) -> bool:
        """Applied now (through its treatment, or directly)."""
        return self.record.applied

    @property
    def error(self) -> str | None:
        """Why applying or undoing it last failed (None after a success)."""
        return self.record.error

    @property
    def _done(self) -> list:
        return self.record.steps

    @property
    def safe(self) -> bool:
        """True for a safe fix."""
        return self.applicability is Applicability.SAFE

    @property
    def key(self) -> tuple[str, str, str]:
        """What identifies this treatment across re-diagnoses: check, subject, recipe."""
        return (self.slug, self.finding_subject, self.recipe or re.sub(r"\d[\d,.]*", "#", self.title))

    def bind(self, live: Any, door: FixDoor | None = None) -> Fix:
        """Attach the live table, and the treatment that re-plans this fix before applying it."""
        self._live = live
        self._door = door
        return self

    @property
    def bound_where_seen(self) -> bool:
        """True for a fix bound to the live objects with no treatment (a crash's batch, which a diagnosis at rest
        does not hold): it is applied as bound, never re-planned."""
        return self._live is not None and self._door is None

    def __repr__(self) -> str:
        state = "applied" if self.applied else ("failed" if self.error else "pending")
        return f"<Fix {self.title!r} {self.applicability.value} {state}>"

    def _spec_steps(self, changes: Sequence[Any] | None = None) -> list[Change]:
        if self._live is None:
            raise FixFailed("this fix is not bound to live objects (take it from a Report)")
        return [step for spec in (self.changes if changes is None else changes) for step in spec.bind(self._live)]

    def _spec_problem(self, changes: Sequence[Any] | None = None) -> str | None:
        if self._live is not None:
            for spec in self.changes if changes is None else changes:
                problem = spec.verify(self._live)
                if problem:
                    return problem
        return None

    @property
    def in_place(self) -> bool:
        """True when the live objects already hold this fix's change, made some other way (the user's own code,
        another fix): applying it would change nothing, so it is not offered. False when it is applied (it is then
        shown as applied, with Undo), display-only, unbound, or when any step would change something or cannot
        tell."""
        if (not self.changes or self._live is None or self.applied
                or self.applicability is Applicability.DISPLAY_ONLY):  # fmt: skip
            return False
        try:
            steps = self._plan()
        except Exception:  # it cannot be bound to the objects as they are now: not in place
            return False
        try:
            return all(step.in_place for step in steps)
        except Exception:  # a step that cannot read the live state cannot tell
            return False

    def preview(self) -> list[str]:
        """Describe the changes :meth:`apply` would make now."""
        return [c.description for c in self._plan()]

    def apply(self, confirm: bool = False) -> Fix:
        """Apply the fix in place; a second call does nothing.

        A fix taken from a Report goes through that report's treatment
        (:class:`mpdoctor.diagnosis.treatment.Treatment`): it is re-planned first
        against the live objects as they are now, and when another fix applied
        since made it unnecessary, it does nothing and ``note`` says why.

        Raises
        ------
        FixNeedsConfirmation
            When the undo backup exceeds the budget and ``confirm`` is False.
        FixFailed
            When a step fails; every step already taken has been reverted.
            Also for a display-only fix (its ``code`` is what to run).
        """
        if self._door is not None:
            return self._door.apply(self, confirm=confirm)
        if not self.applied:
            self.check_applicable(confirm)
            self.apply_steps()
        return self

    def check_applicable(self, confirm: bool = False) -> None:
        """Raise when this fix cannot be applied in place now (display-only, or a backup needing confirmation)."""
        if self.applicability is Applicability.DISPLAY_ONLY:
            raise FixFailed(f"{self.title}: nothing can be changed in place; run fix.code where the objects are built")
        if self.needs_confirmation and not confirm:
            raise FixNeedsConfirmation(self.title)

    def apply_steps(self, changes: Sequence[Any] | None = None) -> None:
        """Run the steps of :attr:`changes` (or ``changes``: the same treatment re-planned against the objects as
        they are now) as bound now, atomically: on any failure, revert those taken."""
        if self.applied:
            return
        record = self.record
        try:
            done = self.tried_steps(changes)
        except FixFailed as exc:
            record.error = str(exc)[len(self.title) + 1 :]
            raise
        record.steps, record.applied, record.error = done, True, None

    def tried_steps(self, changes: Sequence[Any] | None = None) -> list[Change]:
        """Apply the steps of :attr:`changes` as bound now, atomically, and return them for
        :func:`revert_steps`, recording nothing on this fix: how the proof tries a fix (the trial is the proof's
        record, not the fix's). On any failure the steps taken are reverted and :class:`FixFailed` says why."""
        done: list[Change] = []
        try:
            for change in self._plan() if changes is None else self._spec_steps(changes):
                change.apply()
                done.append(change)
            problem = self._verify() if changes is None else self._spec_problem(changes)
            if problem:
                raise FixFailed(f"the change did not take: {problem}")
        except BaseException as exc:
            leftovers = _revert_all(done)
            cause = describe_exception(exc)
            error = (f"failed ({cause}) and could not be fully rolled back: {leftovers}" if leftovers
                     else f"rolled back after {cause}")  # fmt: skip
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise FixFailed(f"{self.title} {error}") from exc
        return done

    def undo(self) -> Fix:
        """Restore exactly what :meth:`apply` changed; does nothing when not applied.

        Raises
        ------
        FixFailed
            When a step could not be restored (every other step still is).
        """
        if self._door is not None:
            self._door.undo(self)
        else:
            self.undo_steps()
        return self

    def undo_steps(self) -> None:
        """Revert the steps :meth:`apply_steps` took, newest first."""
        if not self.applied:
            return
        record = self.record
        leftovers = _revert_all(record.steps)
        record.steps, record.applied = [], False
        if leftovers:
            record.error = f"undo could not restore everything: {leftovers}"
            raise FixFailed(f"{self.title}: {record.error}")

    def to_dict(self) -> dict:
        """A JSON-serialisable description."""
        return {
            "title": self.title,
            "code": self.code,
            "safe": self.safe,
            "applicability": self.applicability.value,
            "planned": self.planned,
            "note": self.note,
            "cost": self.cost,
            "applied": self.applied,
            "error": self.error,
        }


def revert_steps(changes: list[Change]) -> str:
    """Revert steps :meth:`Fix.tried_steps` took, newest first; describe what could not be reverted."""
    return _revert_all(changes)


def _revert_all(changes: list[Change]) -> str:
    """Revert ``changes`` newest first, each even when another fails; describe the failures."""
    failed = []
    for change in reversed(changes):
        try:
            change.revert()
        except BaseException as exc:  # keep restoring the others
            failed.append(f"{change.description}: {describe_exception(exc)}")
    return "; ".join(failed)
