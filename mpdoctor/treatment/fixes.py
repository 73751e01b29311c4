"""Fixes that change live objects in place, atomically, with an exact undo.

A :class:`Fix` is data: a title, an applicability, the code that does the same,
and change specs (:mod:`mpdoctor.treatment.changes`) bound to the live objects
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
from typing import Any, Callable, Protocol

from ..edits.steps import Change
from ..redact import describe_exception
from .rules import Applicability  # defined beside Rule; this import path stays

#: Fixes whose undo backup would exceed this many bytes ask for ``apply(confirm=True)``.
UNDO_BUDGET_BYTES = 2 * 2**30


class FixFailed(RuntimeError):
    """A fix could not be applied; everything it touched is as it was before."""


class FixNeedsConfirmation(RuntimeError):
    """A fix would keep a backup larger than the undo budget; apply it with ``confirm=True``."""


class FixDoor(Protocol):
    """What a fix is bound to for applying: the diagnosis-level treatment (it re-plans against the live objects)."""

    def apply(self, fix: Fix, confirm: bool = False) -> Fix: ...

    def undo(self, fix: Fix | None = None) -> Fix | None: ...


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
        What the fix does, as plain data (:mod:`mpdoctor.treatment.changes`), resolved against the live table
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
    ) -> None:
        self.slug = slug
        self.code = code
        self.applicability = applicability or Applicability.UNSAFE
        self.changes = tuple(changes)
        # Replaceable attributes, so fault-injection tests can make any step fail.
        self._plan: Callable[[], list[Change]] = self._spec_steps
        self._verify: Callable[[], str | None] = self._spec_problem
        self.backup_bytes = backup_bytes
        self.needs_confirmation = backup_bytes > UNDO_BUDGET_BYTES
        if self.needs_confirmation:
            title = f"{title} (keeps a {backup_bytes / 2**30:.1f} GiB undo backup)"
        self.title = title
        self.cost = cost
        self.recipe = recipe
        self.applied = False
        self.error: str | None = None
        #: Set by the treatment planner: whether this fix is part of the report's plan, and why not.
        self.planned = True
        self.note = ""
        #: What the user's step did after this fix, when the plan was checked on it ("verified on your step: ...").
        self.proof = ""
        self._done: list[Change] = []
        self._live: Any = None
        self._door: FixDoor | None = None
        self.finding_subject = ""

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

    def _spec_steps(self) -> list[Change]:
        if self._live is None:
            raise FixFailed("this fix is not bound to live objects (take it from a Report)")
        return [step for spec in self.changes for step in spec.bind(self._live)]

    def _spec_problem(self) -> str | None:
        if self._live is not None:
            for spec in self.changes:
                problem = spec.verify(self._live)
                if problem:
                    return problem
        return None

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

    def apply_steps(self) -> None:
        """Run the steps of :attr:`changes` as bound now, atomically: on any failure, revert those taken."""
        if self.applied:
            return
        done: list[Change] = []
        try:
            for change in self._plan():
                change.apply()
                done.append(change)
            problem = self._verify()
            if problem:
                raise FixFailed(f"the change did not take: {problem}")
        except BaseException as exc:
            leftovers = _revert_all(done)
            cause = describe_exception(exc)
            if leftovers:
                self.error = f"failed ({cause}) and could not be fully rolled back: {leftovers}"
            else:
                self.error = f"rolled back after {cause}"
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise FixFailed(f"{self.title} {self.error}") from exc
        self._done = done
        self.applied = True
        self.error = None

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
        leftovers = _revert_all(self._done)
        self._done = []
        self.applied = False
        if leftovers:
            self.error = f"undo could not restore everything: {leftovers}"
            raise FixFailed(f"{self.title}: {self.error}")

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
            "proof": self.proof,
        }


def _revert_all(changes: list[Change]) -> str:
    """Revert ``changes`` newest first, each even when another fails; describe the failures."""
    failed = []
    for change in reversed(changes):
        try:
            change.revert()
        except BaseException as exc:  # keep restoring the others
            failed.append(f"{change.description}: {describe_exception(exc)}")
    return "; ".join(failed)
