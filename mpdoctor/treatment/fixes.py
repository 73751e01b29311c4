"""Fixes that change live objects in place, atomically, with an exact undo.

A :class:`Fix` is a plan of :class:`Change` steps, computed from the live
objects when it is applied (so a fix taken from an older report still does
the right thing). Each change records what it replaces before replacing it;
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
from collections.abc import Iterable, Sequence
from typing import Any, Callable

import torch

from ..edits.steps import CastParams, Change, SetAttr
from ..redact import describe_exception
from .rules import Applicability  # defined beside Rule; this import path stays

#: Fixes whose undo backup would exceed this many bytes ask for ``apply(confirm=True)``.
UNDO_BUDGET_BYTES = 2 * 2**30


class FixFailed(RuntimeError):
    """A fix could not be applied; everything it touched is as it was before."""


class FixNeedsConfirmation(RuntimeError):
    """A fix would keep a backup larger than the undo budget; apply it with ``confirm=True``."""


class Fix:
    """A way to fix a finding in place.

    Parameters
    ----------
    title : str
        Imperative title (``"Set use_cache=False on text_config"``).
    code : str
        The Python that makes the same change, to paste where the object is created.
    safe : bool
        True when the fix keeps the meaning of the intended run; False when it
        narrows a dtype, drops state or replaces a reference. Ignored when
        ``applicability`` is given.
    plan : callable, optional
        Returns the list of :class:`Change` steps. Fixes built by checks give
        ``changes`` instead and are resolved against the live table.
    verify : callable, optional
        Called after the changes; returning a string means the fix did not
        take (the changes are reverted and :class:`FixFailed` raised).
    backup_bytes : int
        Estimated undo backup; above :data:`UNDO_BUDGET_BYTES` the title says
        so and ``apply`` needs ``confirm=True``.
    changes : tuple of ChangeSpec
        What the fix does, as plain data (:mod:`mpdoctor.treatment.changes`).
    applicability : Applicability, optional
        Safe, unsafe or display-only.
    cost : str
        What the fix costs (memory, speed), for choosing between alternatives.
    recipe : str
        A stable name of the treatment within its check (``"fp32-master-weights"``).
    """

    def __init__(
        self,
        title: str,
        code: str,
        safe: bool = False,
        plan: Callable[[], list[Change]] | None = None,
        verify: Callable[[], str | None] | None = None,
        backup_bytes: int = 0,
        slug: str = "",
        *,
        changes: Sequence[Any] = (),
        applicability: Applicability | None = None,
        cost: str = "",
        recipe: str = "",
    ) -> None:
        self.slug = slug
        self.code = code
        self.applicability = applicability or (Applicability.SAFE if safe else Applicability.UNSAFE)
        self.changes = tuple(changes)
        # Fixes built by checks resolve their change specs against the live table; both hooks stay
        # replaceable attributes so fault-injection tests can make any step fail.
        self._plan = plan if plan is not None else self._spec_steps
        self._verify = verify if verify is not None else self._spec_problem
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
        self._done: list[Change] = []
        self._live: Any = None
        self._report: Any = None
        self.finding_subject = ""

    @property
    def safe(self) -> bool:
        """True for a safe fix."""
        return self.applicability is Applicability.SAFE

    @property
    def key(self) -> tuple[str, str, str]:
        """What identifies this treatment across re-diagnoses: check, subject, recipe."""
        return (self.slug, self.finding_subject, self.recipe or re.sub(r"\d[\d,.]*", "#", self.title))

    def bind(self, live: Any, report: Any = None) -> Fix:
        """Attach the live table (and the report that re-plans on apply)."""
        self._live = live
        self._report = report
        return self

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

    def _steps(self) -> list[Change]:
        return self._plan()

    def _problem(self) -> str | None:
        return self._verify()

    def preview(self) -> list[str]:
        """Describe the changes :meth:`apply` would make now."""
        return [c.description for c in self._steps()]

    def apply(self, confirm: bool = False) -> Fix:
        """Apply the fix in place; a second call does nothing.

        A fix taken from a Report is re-planned first against the live objects
        as they are now: when another fix applied since made it unnecessary,
        it does nothing and ``note`` says why.

        Raises
        ------
        FixNeedsConfirmation
            When the undo backup exceeds the budget and ``confirm`` is False.
        FixFailed
            When a step fails; every step already taken has been reverted.
            Also for a display-only fix (its ``code`` is what to run).
        """
        if self.applied:
            return self
        if self.applicability is Applicability.DISPLAY_ONLY:
            raise FixFailed(f"{self.title}: nothing can be changed in place; run fix.code where the objects are built")
        if self.needs_confirmation and not confirm:
            raise FixNeedsConfirmation(self.title)
        if self._report is not None and self.changes:
            current = self._report._current_treatment(self)
            if current is None:
                return self  # no longer needed: the report set self.note
            self.changes = current.changes
        done: list[Change] = []
        try:
            for change in self._steps():
                change.apply()
                done.append(change)
            problem = self._problem()
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
        return self

    def undo(self) -> Fix:
        """Restore exactly what :meth:`apply` changed; does nothing when not applied.

        Raises
        ------
        FixFailed
            When a step could not be restored (every other step still is).
        """
        if not self.applied:
            return self
        leftovers = _revert_all(self._done)
        self._done = []
        self.applied = False
        if leftovers:
            self.error = f"undo could not restore everything: {leftovers}"
            raise FixFailed(f"{self.title}: {self.error}")
        return self

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


def _revert_all(changes: list[Change]) -> str:
    """Revert ``changes`` newest first, each even when another fails; describe the failures."""
    failed = []
    for change in reversed(changes):
        try:
            change.revert()
        except BaseException as exc:  # keep restoring the others
            failed.append(f"{change.description}: {describe_exception(exc)}")
    return "; ".join(failed)


def set_attrs(title: str, code: str, targets: list[tuple[Any, str, Any, str]], safe: bool = True, slug: str = "") -> Fix:
    """A fix setting attributes: ``targets`` is a list of ``(obj, attr, value, label)``."""

    def plan() -> list[Change]:
        return [SetAttr(o, a, v, lbl) for o, a, v, lbl in targets if _differs(o, a, v)]

    def verify() -> str | None:
        bad = [lbl for o, a, v, lbl in targets if _differs(o, a, v)]
        return f"{', '.join(bad)} still differ" if bad else None

    return Fix(title, code, safe, plan, verify, slug=slug)


def _differs(obj: Any, attr: str, value: Any) -> bool:
    try:
        return getattr(obj, attr) != value
    except Exception:
        return True


def cast_params_fix(
    title: str,
    code: str,
    params: Sequence[torch.nn.Parameter],
    dtype: torch.dtype,
    optimizers: Iterable[Any] = (),
    label: str = "parameters",
    slug: str = "",
    safe: bool = False,
) -> Fix:
    """A fix casting ``params`` (and their grads and optimizer state) to ``dtype`` in place."""
    params = list(params)
    optimizers = list(optimizers)
    backup = sum(p.numel() * p.element_size() * (2 if p.grad is not None else 1) for p in params if p.dtype != dtype)

    def plan() -> list[Change]:
        return [CastParams(params, dtype, optimizers, label)]

    def verify() -> str | None:
        left = sum(1 for p in params if p.dtype != dtype)
        return f"{left} parameters are not {dtype}" if left else None

    return Fix(title, code, safe, plan, verify, backup_bytes=backup, slug=slug)
