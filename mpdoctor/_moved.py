"""Import paths of 0.2 that moved in 0.3, kept working for one release with a ``DeprecationWarning``.

0.3 grouped the top-level modules into packages named for the pipeline's stages (``ARCHITECTURE.md``).
``import mpdoctor.report`` (or ``from mpdoctor.fixes import Fix``) still works: a finder answers for the old
names only, with a module that reads its names from where they live now. The public API
(``mpdoctor.diagnose``, ``probe``, ``watch``, the callbacks, ``Report``, ``Fix``) never moved.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

#: Old module -> the modules its names live in now (first match wins).
MOVED: dict[str, tuple[str, ...]] = {
    "mpdoctor.changes": ("mpdoctor.treatment.changes",),
    "mpdoctor.fixes": ("mpdoctor.treatment.fixes", "mpdoctor.edits.steps"),
    "mpdoctor.findings": ("mpdoctor.treatment.findings",),
    "mpdoctor.runtime_state": ("mpdoctor.edits.torch_state",),
    "mpdoctor.discover": ("mpdoctor.discovery.subjects", "mpdoctor.live.introspect"),
    "mpdoctor.introspect": ("mpdoctor.live.introspect",),
    "mpdoctor.report": ("mpdoctor.diagnosis.report",),
    "mpdoctor.distributed": ("mpdoctor.diagnosis.ranks", "mpdoctor.diagnosis.exchange"),
    "mpdoctor.envinfo": ("mpdoctor.diagnosis.environment",),
    "mpdoctor.magic": ("mpdoctor.notebook.magic",),
    "mpdoctor.demo": ("mpdoctor.cli.demo",),
    "mpdoctor.docs": ("mpdoctor.cli.docs",),
    # 0.3.x: what attaches to a training run moved into one package, next to nothing but itself.
    "mpdoctor.crash.watch": ("mpdoctor.training.watch",),
    "mpdoctor.crash.runner": ("mpdoctor.training.runner",),
    "mpdoctor.numerics.callback": ("mpdoctor.training.trainer_callback", "mpdoctor.training.callback_state"),
    "mpdoctor.numerics.lightning_callback": ("mpdoctor.training.lightning_callback",),
    "mpdoctor.numerics.callback_state": ("mpdoctor.training.callback_state",),
    "mpdoctor.facts.lowbit": (
        "mpdoctor.facts.quantized", "mpdoctor.facts.fp8_training", "mpdoctor.facts.diffusers", "mpdoctor.facts.optimizer",
    ),
    "mpdoctor.integrations.lowprecision": ("mpdoctor.integrations.float8_storage",),
    "mpdoctor.numerics.scan": ("mpdoctor.gathering.values", "mpdoctor.gathering.scan", "mpdoctor.diagnosis.scan_rows"),
}


class MovedModule(types.ModuleType):
    """Stands at an old import path; every name is read from the modules that define it now."""

    def __init__(self, name: str, homes: tuple[str, ...]) -> None:
        super().__init__(name, f"Moved: {name} is now {', '.join(homes)} (deprecated path, removed in 0.4).")
        self.__homes = homes

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        for home in self.__homes:
            module = importlib.import_module(home)
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")

    def __dir__(self) -> list[str]:
        names: set[str] = set()
        for home in self.__homes:
            names.update(n for n in dir(importlib.import_module(home)) if not n.startswith("_"))
        return sorted(names)


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths in :data:`MOVED` (and nothing else)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        homes = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {homes[0]} in mpdoctor 0.3; the old path goes away in 0.4",
            DeprecationWarning,
            stacklevel=2,
        )
        return MovedModule(spec.name, homes)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``import mpdoctor`` calls it)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
