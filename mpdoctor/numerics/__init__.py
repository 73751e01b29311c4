"""Numerics: what the values say, not just the dtypes.

- :mod:`.scan`: one read of every parameter, grad and optimizer-state tensor
  for NaN/Inf counts, abs max and fp16/bf16 range (``diagnose(..., scan=True)``).
- :mod:`.probe`: one forward + backward on a real batch with cheap hooks on
  every module, naming the first module that overflows or raises
  (``mpdoctor.probe``, ``%mpdoctor --probe batch``).
- :mod:`.callback`: a transformers ``TrainerCallback`` that diagnoses at the
  start of training and probes the batch where the loss first goes non-finite
  (``mpdoctor.MPDoctorCallback``); the only module here importing transformers.

Nothing is imported here, so ``import mpdoctor`` stays cheap.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    # ``mpdoctor.numerics.callback.MPDoctorAbort`` after a plain ``import mpdoctor``: load the submodule.
    from .. import _submodule

    return _submodule(__name__, name)
