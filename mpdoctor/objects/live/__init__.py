"""The live table: ``ref -> object``, held apart from Facts.

Facts are plain data (names, ids, dtypes, flags); a fact that points at a live
object carries its ``ref`` (the object's ``id`` when it was gathered). Fix
planning resolves refs here, at the moment a fix is applied. Objects that
support weak references are held weakly, so a report never keeps a model the
user deleted alive; the others (plain dicts) are held strongly.
"""

from __future__ import annotations

import weakref
from typing import Any


class Gone(LookupError):
    """The object a ref points at no longer exists (the user deleted or replaced it)."""


class Live:
    """Map refs (``id(obj)`` at gathering time) to the live objects."""

    def __init__(self) -> None:
        self._refs: dict[int, Any] = {}
        self._weak: set[int] = set()

    def add(self, obj: Any) -> int:
        """Register ``obj``; returns its ref."""
        ref = id(obj)
        if ref in self._refs:
            return ref
        try:
            self._refs[ref] = weakref.ref(obj)
            self._weak.add(ref)
        except TypeError:  # dicts, ints, slotted classes without __weakref__
            self._refs[ref] = obj
        return ref

    def get(self, ref: int) -> Any:
        """The live object behind ``ref``.

        Raises
        ------
        Gone
            When it was never registered or has been garbage-collected.
        """
        try:
            held = self._refs[ref]
        except KeyError:
            raise Gone(f"object {ref:#x} is not in this report") from None
        if ref in self._weak:
            obj = held()
            if obj is None:
                raise Gone("the object was deleted since the diagnosis")
            return obj
        return held

    def __contains__(self, ref: object) -> bool:
        return ref in self._refs

    def merge(self, other: Live) -> Live:
        """Take every ref of ``other`` (the live table of a later gathering)."""
        for ref, held in other._refs.items():
            if ref not in self._refs:
                self._refs[ref] = held
                if ref in other._weak:
                    self._weak.add(ref)
        return self
