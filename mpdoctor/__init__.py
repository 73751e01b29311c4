"""mpdoctor: find and fix mixed-precision faults in live PyTorch / Hugging Face objects.

>>> import mpdoctor
>>> report = mpdoctor.diagnose(model, optimizer, scaler)   # or namespace=globals()
>>> report.apply_safe_fixes()

In IPython / Jupyter: ``%load_ext mpdoctor`` then ``%mpdoctor``.

Importing mpdoctor costs about a millisecond: every name below is loaded on
first use (``%load_ext mpdoctor`` in a notebook's first cell waits for nothing
it does not run), and transformers, accelerate, peft, pandas, IPython and
ipywidgets are imported only when a feature needs them, never to read objects
of a library the user has not imported.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names below resolve to
    from .attach.emulation.compare import compare
    from .diagnosis import diagnose
    from .diagnosis.environment import env_report
    from .diagnosis.report import Report
    from .rules.engine.findings import Finding
    from .rules.engine.fixes import Fix, FixFailed, FixNeedsConfirmation

from ._version import __version__  # noqa: F401  (re-exported)

__all__ = [
    "Finding",
    "Fix",
    "FixFailed",
    "FixNeedsConfirmation",
    "MPDoctorCallback",
    "MPDoctorLightningCallback",
    "Report",
    "checks_reference",
    "compare",
    "diagnose",
    "env_report",
    "load_ipython_extension",
    "probe",
    "unload_ipython_extension",
    "watch",
]


def load_ipython_extension(ipython: Any) -> None:
    """Register ``%mpdoctor`` and the crash diagnosis (called by ``%load_ext mpdoctor``).

    A cell that raises a known mixed-precision error shows its traceback and
    then the diagnosis; ``%config MPDoctorMagics.on_error = False`` turns that off.
    """
    from .attach.crash.hook import install
    from .front.magic import MPDoctorMagics

    ipython.register_magics(MPDoctorMagics)
    magics = ipython.magics_manager.registry.get("MPDoctorMagics")
    if not install(ipython, enabled=lambda: bool(getattr(magics, "on_error", True))):
        print("mpdoctor: another custom exception handler is set; crashes will not be diagnosed automatically")
    from .attach.runtime import session

    session.install(ipython)  # the GradScaler protocol, watched cell by cell


def unload_ipython_extension(ipython: Any) -> None:
    """Remove ``%mpdoctor`` and the crash diagnosis (called by ``%unload_ext mpdoctor``)."""
    from .attach.crash.hook import uninstall
    from .attach.runtime import session

    uninstall(ipython)
    session.uninstall(ipython)
    magics = ipython.magics_manager.magics.get("line", {})
    magics.pop("mpdoctor", None)
    registry = ipython.magics_manager.registry
    registry.pop("MPDoctorMagics", None)


#: Public name -> the module defining it, imported on first access (PEP 562).
_LAZY = {
    "compare": ".attach.emulation.compare",
    "diagnose": ".diagnosis",
    "env_report": ".diagnosis.environment",
    "Finding": ".rules.engine.findings",
    "Fix": ".rules.engine.fixes",
    "FixFailed": ".rules.engine.fixes",
    "FixNeedsConfirmation": ".rules.engine.fixes",
    "Report": ".diagnosis.report",
    "checks_reference": ".rules.checks",
}


#: Public name -> (the library it needs, the extra that installs it), for names whose module imports it.
_NEEDS = {
    "MPDoctorCallback": ("transformers", "hf"),
    "MPDoctorLightningCallback": ("Lightning", "lightning"),
}


def __dir__() -> list[str]:
    # Tab completion and dir() show the public API only, not this module's imports and helpers.
    return sorted({*__all__, "__version__"})


def _missing_library(name: str, error: ImportError) -> type:
    """A stand-in for ``name`` when its library is not installed: introspection (help, dir, ``import *``)
    still works, and using it raises an ImportError that says which extra to install."""
    library, extra = _NEEDS[name]
    why = f"mpdoctor.{name} needs {library}, which is not installed ({error}): pip install \"mpdoctor[{extra}]\""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise ImportError(why)

    return type(name, (), {"__init__": __init__, "__doc__": f"Unavailable: {why}.", "__module__": __name__})


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is not None:
        value = getattr(importlib.import_module(where, __name__), name)
        globals()[name] = value  # later reads skip this hook
        return value
    if name == "probe":
        from .attach.numerics.probe import probe

        return probe
    if name == "watch":
        from .attach.training.watch import watch

        return watch
    if name in _NEEDS:
        module = ".libraries.transformers.callback" if name == "MPDoctorCallback" else ".libraries.lightning.callback"
        try:
            return getattr(importlib.import_module(module, __name__), name)
        except ImportError as exc:  # the library is absent (or broken): a stand-in that says what to install
            return _missing_library(name, exc)
    return _submodule(__name__, name)


def _submodule(package: str, name: str) -> Any:
    """``package.name`` imported when it is a submodule read as an attribute (``mpdoctor.attach.numerics`` after
    a plain ``import mpdoctor``), as if the package had imported it; AttributeError otherwise."""
    if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
        return importlib.import_module(f"{package}.{name}")
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
