"""What the one-batch probe saw: per-module records, the error it caught, and the probe's facts.

Plain data read by the probe checks and renderers; :mod:`mpdoctor.attach.numerics.probe`
produces it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from ...objects.gathering.values import FP16_MAX

#: Exception texts that mean two dtypes met where one was expected.
DTYPE_ERROR = re.compile(
    r"dtype|scalar type|BFloat16|\bHalf\b|expected .* but (got|found)|type \(.*\) .*should be the same",
    re.IGNORECASE,
)

#: Columns of ``Report.probe_table``. Input statistics are not among them: on the CPU they are measured
#: only for modules whose output went bad (see :class:`ModuleProbe`), so a column would be mostly empty;
#: the probe findings say whether the first bad module's inputs were finite.
PROBE_COLUMNS = [
    "order", "module", "class", "calls", "input_dtypes", "output_dtypes", "grad_dtypes", "param_dtypes",
    "out_absmax", "grad_absmax", "param_grad_absmax",
    "out_nonfinite", "grad_nonfinite", "param_grad_nonfinite", "fp16_headroom",
]  # fmt: skip


@dataclass(frozen=True)
class ModuleProbe:
    """What one module saw during the probe (maxima and sums over its calls).

    ``*_absmax`` are None when the module saw no floating tensor of that kind;
    they are NaN/inf when a NaN/inf was seen. Inputs are measured where it
    matters: on the CPU only for calls whose output went non-finite or past
    65504 (everything else there would double the probe's cost), on
    accelerators for every call (queued, free of syncs). ``grad`` is the gradient of the
    loss with respect to the module's output; ``param_grad`` the gradients of
    its own (direct) parameters. ``done`` and ``grad_order`` are the positions
    of its first forward completion and first output gradient, the orders that
    decide which module went wrong first.
    """

    order: int
    path: str
    class_name: str
    calls: int
    input_dtypes: tuple[str, ...]
    output_dtypes: tuple[str, ...]
    grad_dtypes: tuple[str, ...]
    param_dtypes: tuple[str, ...]
    in_absmax: float | None
    out_absmax: float | None
    grad_absmax: float | None
    param_grad_absmax: float | None
    in_nonfinite: int
    out_nonfinite: int
    grad_nonfinite: int
    param_grad_nonfinite: int
    param_nonfinite: int
    done: int | None
    grad_order: int | None

    @property
    def fp16_headroom(self) -> float:
        """How many times its largest output or gradient fits under 65504 (< 1: past the fp16 range; 0: non-finite)."""
        peaks = [v for v in (self.out_absmax, self.grad_absmax) if v is not None]
        if not peaks:
            return math.inf
        peak = max(peaks, key=lambda v: math.inf if math.isnan(v) else v)
        if not math.isfinite(peak):
            return 0.0
        return math.inf if peak == 0 else FP16_MAX / peak

    def row(self, model: str) -> dict:
        """One ``probe_table`` row; modules are named as the user reaches them (``model.layers.0.mlp``)."""
        return {
            "order": self.order,
            "module": f"{model}.{self.path}" if self.path else model,
            "class": self.class_name,
            "calls": self.calls,
            "input_dtypes": ",".join(self.input_dtypes),
            "output_dtypes": ",".join(self.output_dtypes),
            "grad_dtypes": ",".join(self.grad_dtypes),
            "param_dtypes": ",".join(self.param_dtypes),
            "out_absmax": self.out_absmax,
            "grad_absmax": self.grad_absmax,
            "param_grad_absmax": self.param_grad_absmax,
            "out_nonfinite": self.out_nonfinite,
            "grad_nonfinite": self.grad_nonfinite,
            "param_grad_nonfinite": self.param_grad_nonfinite,
            "fp16_headroom": self.fp16_headroom,
        }


@dataclass(frozen=True)
class ProbeError:
    """An exception raised during the probe, attributed to the module running at that moment."""

    phase: str  # "forward", "loss" or "backward"
    module: str | None
    class_name: str | None
    exception: str
    message: str
    input_dtypes: tuple[str, ...] = ()
    param_dtypes: tuple[str, ...] = ()

    @property
    def is_dtype_error(self) -> bool:
        """True when the message says two dtypes met where one was expected."""
        return bool(DTYPE_ERROR.search(self.message))


@dataclass(frozen=True)
class GenerationFacts:
    """What ``probe(model, batch, generate=True)`` saw of each decoding step of ``model.generate``.

    Step 0 is the prefill (the prompt's forward), step ``k`` the forward that decides new token ``k + 1``.
    ``logits_nonfinite`` / ``probs_nonfinite`` count per step the NaN/Inf values of the last position's logits
    and of their softmax in fp32 (what sampling draws from: an ``inf`` logit or a row of ``-inf`` makes them
    NaN). ``step_ends`` is the probe's module-completion counter at the end of each step, which places the
    first bad module in its step.
    """

    requested: int
    logits_nonfinite: tuple[int, ...] = ()
    probs_nonfinite: tuple[int, ...] = ()
    step_ends: tuple[int, ...] = ()
    #: Tokens generate() returned beyond the prompt (None when it raised).
    new_tokens: int | None = None

    @property
    def steps(self) -> int:
        """Decoding steps that ran to the end of the model's forward."""
        return len(self.logits_nonfinite)

    @staticmethod
    def _first(counts: tuple[int, ...]) -> int | None:
        return next((i for i, n in enumerate(counts) if n), None)

    @property
    def first_bad_logits(self) -> int | None:
        """The first step whose logits held NaN/Inf, None when every step's were finite."""
        return self._first(self.logits_nonfinite)

    @property
    def first_bad_probs(self) -> int | None:
        """The first step whose probabilities held NaN/Inf."""
        return self._first(self.probs_nonfinite)

    def step_of(self, done: int | None) -> int | None:
        """The decoding step in which the module call completing at position ``done`` ran."""
        if done is None:
            return None
        return next((i for i, end in enumerate(self.step_ends) if done < end), None)


@dataclass(frozen=True)
class ProbeFacts:
    """Everything one probe saw; checks in :mod:`mpdoctor.rules.checks.probe` turn it into findings.

    Attributes
    ----------
    model : str
        The model's name.
    modules : tuple of ModuleProbe
        One per module that ran, in the order modules were first called.
    autocast : str or None
        The autocast dtype the forward ran under (``"bfloat16"``, ``"float16"``), None for none.
    autocast_source : str
        Where it came from: ``"argument"``, ``"accelerator"``, ``"ambient"`` (the caller's), ``"none"``.
    device : str
        The device type the model ran on.
    loss_scale : float
        The GradScaler scale the loss was multiplied by before backward (1 without an enabled scaler).
    loss : float or None
        The unscaled loss.
    backward : bool
        Whether the backward ran.
    note : str
        Why the backward did not run, when it did not.
    error : ProbeError or None
        The exception the model raised, if any.
    fp16_weights : bool
        Whether some parameters are stored in fp16.
    seconds : float
        Wall time of the probe.
    grads_trained : bool
        The backward ran, every gradient it wrote is finite and at least one is non-zero: what
        :func:`mpdoctor.diagnosis.proof.run_step` calls a step with no optimizer that trained.
    """

    model: str
    modules: tuple[ModuleProbe, ...]
    autocast: str | None
    autocast_source: str
    device: str
    loss_scale: float
    loss: float | None
    backward: bool
    note: str
    error: ProbeError | None
    fp16_weights: bool
    seconds: float
    #: mpdoctor.attach.runtime.boundary.BatchInput per floating batch tensor: its key, dtype and receiving layer.
    boundary: tuple = ()
    #: mpdoctor.attach.runtime.nan_origin.NanOrigin: where the first non-finite value was produced, and why.
    origin: Any = None
    #: ``"mapping"`` for a dict / BatchFeature batch, else ``"tensor"``; refs of the batch (0 when not a
    #: dict the user holds) and the model in the report's live table.
    batch_kind: str = "tensor"
    batch_ref: int = 0
    model_ref: int = 0
    grads_trained: bool = False
    #: GenerationFacts of a ``generate=True`` probe (the decoding steps it ran), None for a training probe.
    generation: Any = None
    #: The fp32 span of an fp16 overflow (``(path, cast_to)`` per module to keep in fp32, the last one's output cast
    #: back to the compute dtype), measured and re-run finite by :func:`mpdoctor.attach.numerics.fp32_span.overflow_span`;
    #: empty when not measured (a training probe, autocast, bf16) or when no span cured it.
    fp32_span: tuple[tuple[str, str], ...] = ()

    @property
    def fp16_in_use(self) -> bool:
        """True when this forward computed in fp16 (fp16 autocast or fp16 weights)."""
        return self.autocast == "float16" or self.fp16_weights

    def _first(self, key: Callable[[ModuleProbe], bool], order: str) -> ModuleProbe | None:
        hits = [m for m in self.modules if getattr(m, order) is not None and key(m)]
        return min(hits, key=lambda m: getattr(m, order)) if hits else None

    def first_nonfinite(self) -> tuple[ModuleProbe, str] | None:
        """The first module whose output went non-finite in the forward, else whose output gradient did in backward."""
        m = self._first(lambda m: m.out_nonfinite > 0, "done")
        if m is not None:
            return m, "forward"
        m = self._first(lambda m: m.grad_nonfinite > 0, "grad_order")
        return (m, "backward") if m is not None else None

    def first_overflow(self) -> tuple[ModuleProbe, str] | None:
        """The first module whose finite output (forward) or output gradient (backward) passed 65504."""
        m = self._first(lambda m: _past(m.out_absmax), "done")
        if m is not None:
            return m, "forward"
        m = self._first(lambda m: _past(m.grad_absmax), "grad_order")
        return (m, "backward") if m is not None else None

    def module(self, path: str) -> ModuleProbe | None:
        """The record of the module at ``path``."""
        return next((m for m in self.modules if m.path == path), None)

    def rows(self) -> list[dict]:
        """The per-module table as plain rows."""
        return [m.row(self.model) for m in self.modules]

    def table(self) -> Any:
        """The per-module table as a pandas DataFrame."""
        import pandas as pd

        return pd.DataFrame(self.rows(), columns=PROBE_COLUMNS)


class ForwardCall:
    """Positional and keyword arguments of one ``forward`` call, as a batch for :func:`probe`.

    What :class:`~mpdoctor.libraries.transformers.callback.MPDoctorCallback` captures from
    a Trainer; also for models taking both (``probe(model, ForwardCall(x, mask=m))``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> ForwardCall:
        """From an ``(args, kwargs)`` pair, as a forward pre-hook sees them."""
        return cls(*args, **kwargs)

    def __repr__(self) -> str:
        return f"ForwardCall({len(self.args)} args, kwargs {sorted(self.kwargs)})"


def _past(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > FP16_MAX
