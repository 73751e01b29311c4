"""Numerics: what the values say, not just the dtypes.

- :mod:`.probe`: one forward + backward on a real batch with cheap hooks on
  every module, naming the first module that overflows or raises
  (``mpdoctor.probe``, ``%mpdoctor --probe batch``).

The training callbacks that call the probe live in :mod:`mpdoctor.attach.training`.

Nothing is imported here, so ``import mpdoctor`` stays cheap.
"""

import importlib
import importlib.util
from typing import Any


def __getattr__(name: str) -> Any:
    # ``mpdoctor.attach.numerics.probe`` read as an attribute after a plain ``import mpdoctor``: load the submodule.
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
