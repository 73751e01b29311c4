"""Facts of the places between steps: gradient accumulation, metric states, merged adapters, router biases.

Plain data read by :mod:`mpdoctor.objects.readers.between`: what a loop accumulates over, which metric states and
router correction biases a cast reached, which LoRA layers were merged into a half-precision base, and the
harm each does, measured when the facts were read.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accumulation:
    """A gradient accumulation asked for by a training object.

    Attributes
    ----------
    name : str
        The subject that asks for it (``args``, ``accelerator``, ``trainer``).
    setting : str
        Where it is set (``TrainingArguments.gradient_accumulation_steps``).
    steps : int
        Micro-batches accumulated per optimizer step.
    """

    name: str
    setting: str
    steps: int


@dataclass(frozen=True)
class HalfGradReplay:
    """Gradients that a model's trainable half-precision parameters accumulate in their own dtype.

    Attributes
    ----------
    model : str
        The model subject.
    model_ref : int
        Its ref in the live table.
    param_ids : frozenset of int
        The trainable parameters whose ``.grad`` is (or will be) half precision.
    dtype : str
        Their dtype (``bfloat16`` / ``float16``).
    steps : int
        Micro-batches accumulated per optimizer step.
    relative_error : float
        ``|acc_half - acc_fp32| / |acc_fp32|`` of the accumulated gradient over ``steps`` micro-batches.
    measured_on : str
        ``"the model's own gradients"`` or ``"a representative gradient"`` (no ``.grad`` yet).
    """

    model: str
    model_ref: int
    param_ids: frozenset[int]
    dtype: str
    steps: int
    relative_error: float
    measured_on: str


@dataclass(frozen=True)
class MetricStates:
    """A torchmetrics ``Metric`` and the dtypes of its states.

    Attributes
    ----------
    model : str
        The subject that holds it (the metric itself, or a model it is a submodule of).
    path : str
        Its module path in that subject (empty for the subject itself).
    class_name : str
        ``MeanMetric``, ``MulticlassAccuracy`` ...
    ref : int
        The metric's ref in the live table.
    states : tuple of (str, str)
        ``(state name, dtype)`` of its floating tensor states.
    stall : int
        Additions of 1.0 after which a running sum held in the lowest state dtype stops moving (0 for fp32).
    """

    model: str
    path: str
    class_name: str
    ref: int
    states: tuple[tuple[str, str], ...]
    stall: int = 0

    @property
    def half_states(self) -> tuple[str, ...]:
        """The states held in bf16 / fp16."""
        return tuple(n for n, d in self.states if d in ("bfloat16", "float16"))


@dataclass(frozen=True)
class RouterBias:
    """A mixture-of-experts routing correction bias (DeepSeek-V3's ``e_score_correction_bias``).

    Attributes
    ----------
    model : str
        The model subject.
    model_ref : int
        Its ref in the live table.
    path : str
        The router module's path (``model.layers.1.mlp.gate``).
    class_name : str
        The router's class.
    attr : str
        The buffer's name.
    dtype : str
        Its dtype.
    experts : int
        Its length (one bias per expert).
    max_abs : float
        The largest magnitude held.
    lost_updates : float
        The share of its entries on which a bias update of ``update`` (DeepSeek-V3's bias update speed)
        rounds away in its dtype.
    update : float
        The update size measured.
    """

    model: str
    model_ref: int
    path: str
    class_name: str
    attr: str
    dtype: str
    experts: int
    max_abs: float
    lost_updates: float
    update: float = 1e-3


@dataclass(frozen=True)
class MergedAdapter:
    """A LoRA adapter merged into a half-precision base layer (PEFT ``merge_adapter()``).

    Attributes
    ----------
    model : str
        The model subject.
    path : str
        The LoRA layer's path.
    adapter : str
        The adapter's name.
    base_dtype : str
        The base weight's dtype (the merge rounded into it).
    adapter_dtype : str
        The adapter weights' dtype.
    lost_share : float
        ``|merged - base - delta| / |delta|``: the share of the adapter's fp32 delta the merge lost in
        rounding (the base before the merge recovered as ``round(merged - delta)``).
    """

    model: str
    path: str
    adapter: str
    base_dtype: str
    adapter_dtype: str
    lost_share: float


@dataclass(frozen=True)
class OrthogonalWeight:
    """A weight under torch's ``orthogonal`` parametrization whose ``original`` is held in bf16 / fp16.

    Attributes
    ----------
    model : str
        The model subject.
    path : str
        The parametrized module's path.
    tensor : str
        The parametrized tensor's name (``weight``).
    dtype : str
        The dtype of its ``original``.
    orthogonal_map : str
        ``matrix_exp``, ``cayley`` or ``householder``.
    error : float or None
        ``max |Q Q^T - I|`` of the weight the parametrization computes now (fp32 gives about 1e-6); None when
        torch refused to compute it.
    refused : str
        The refusal's message when ``error`` is None.
    """

    model: str
    path: str
    tensor: str
    dtype: str
    orthogonal_map: str
    error: float | None
    refused: str = ""


@dataclass(frozen=True)
class BetweenFacts:
    """Everything read about the places between steps."""

    accumulations: tuple[Accumulation, ...] = ()
    grad_replays: tuple[HalfGradReplay, ...] = ()
    metrics: tuple[MetricStates, ...] = ()
    router_biases: tuple[RouterBias, ...] = ()
    merged_adapters: tuple[MergedAdapter, ...] = ()
    orthogonal: tuple[OrthogonalWeight, ...] = ()
