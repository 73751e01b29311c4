"""``compare(model, batch)``: what bf16, fp16, fp8, MXFP8 and NVFP4 would do to this model, layer by layer.

One forward and one backward of the live model per precision, on its own device
(the CPU included), each next to a reference run (:mod:`mpdoctor.attach.emulation.emulated_runs`).
Low precision is emulated through a :class:`torch.overrides.TorchFunctionMode`
(:mod:`mpdoctor.attach.emulation.sites`; the matmuls themselves: :mod:`mpdoctor.attach.emulation.matmuls`):

- at every ``nn.Linear``: ``F.linear`` calls whose weight is one of the model's
  Linear weights;
- at attention's two matmuls, q·kᵀ and p·v, where they can be reached:
  ``F.scaled_dot_product_attention`` (transformers' default ``sdpa`` attention,
  ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``, whose composite
  ``F.multi_head_attention_forward`` the mode re-enters) is decomposed into its
  math with a float32 softmax; an eager attention's own ``torch.matmul`` /
  ``bmm`` / ``baddbmm`` / ``@`` between two activations of 3+ dims (no
  Parameter) inside the forward of a module that reads as attention
  (:func:`is_attention_module`) is emulated too, the first of each pair taken
  for q·kᵀ and the second for p·v. Rows are labelled ``path [q·kᵀ]`` and
  ``path [p·v]`` (:func:`attention_label`).

In each matmul, forward and backward, both operands are quantized as the
precision says (:mod:`mpdoctor.attach.emulation.formats`), along that matmul's
contraction dim, and multiplied with float32 accumulation; everything else
(norms, activations, the loss) runs in the model's own dtype.
``Comparison.reached`` says exactly what a run reached and what it could not.

The module tree is never touched: no module gets a hook and none is swapped.

Per layer and precision it measures, on the inputs the layer really sees in that
run: the SQNR of its output and of its weight gradient against the same matmul in
float32 (the layer's *own* error, so a bad layer is not hidden by the errors of
the layers before it), and the shares of the nonzero input activations that
underflow to zero or saturate, and of the nonzero output gradients that
underflow. The loss of each run, next to the reference loss, is the end-to-end
effect (:mod:`mpdoctor.attach.emulation.measurements`). ``Comparison.plan()`` turns the
per-layer figures into a verified per-layer precision plan (:mod:`mpdoctor.attach.emulation.precision_plan`);
``compare(..., steps=N)`` adds N optimizer steps per precision, as loss curves.

The model is left exactly as it was: weights, buffers, ``.grad``, RNG state,
train/eval flags and hooks, module and global (each run starts from the same RNG
state, so dropout masks are identical across precisions; the decomposed SDPA
draws its dropout mask as torch's own does on this CPU). Batches and losses are
handled as in :func:`mpdoctor.probe` (:mod:`mpdoctor.attach.numerics.harness`).
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..numerics.harness import BATCH_MESSAGE, BATCH_TYPES
from .emulated_runs import Runner
from .formats import PRECISIONS, Precision, precision
from .measurements import (  # noqa: F401  (re-exported: compare's public figures and thresholds)
    COLUMNS,
    KEEP_BELOW_DB,
    KERNEL_MULTIPLE,
    SATURATION_JUDGED,
    SATURATION_PCT,
    LayerResult,
    findings,
    layer_results,
    underflow_limit,
)
from .recommendation import Recommendation, conversion_code, keep_reasons
from .sites import PV_LABEL, QK_LABEL

if TYPE_CHECKING:
    from .precision_plan import Plan

DEFAULT_PRECISIONS = ("bf16", "fp16", "fp8", "mxfp8", "nvfp4")

@dataclass
class Comparison:
    """What each precision does to one model on one batch (the result of :func:`compare`).

    Attributes
    ----------
    model : str
        The model's name.
    reference : str
        The reference precision.
    precisions : tuple of str
        The precisions compared, in order.
    rows : tuple of LayerResult
        One per Linear and precision, and one per attention matmul (q·kᵀ, p·v) and precision.
    losses : dict
        ``precision -> loss`` (the reference included; NaN when the run failed).
    errors : dict
        ``precision -> message`` for runs that raised.
    error : str or None
        Why nothing could be compared (bad batch, no Linear, ...).
    layers : tuple
        ``(path, in_features, out_features)`` of each Linear, in call order.
    attention : tuple
        ``(label, module path, matmul)`` of each attention matmul reached, in call order (``matmul`` is
        :data:`QK_LABEL` or :data:`PV_LABEL`).
    reached : str
        Where low precision was emulated in this run, and what was not reached.
    findings : list of Finding
        What is clear from the measurements.
    plans : dict
        ``target -> Plan`` of each :meth:`plan` made.
    curves : dict
        ``precision -> loss per step`` with ``compare(..., steps=N)``.
    """

    model: str = "model"
    reference: str = "fp32"
    precisions: tuple[str, ...] = ()
    rows: tuple[LayerResult, ...] = ()
    losses: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    error: str | None = None
    layers: tuple = ()
    attention: tuple = ()
    findings: list = field(default_factory=list)
    device: str = "cpu"
    dtype: str = "float32"
    backward: bool = True
    seconds: float = 0.0
    reached: str = (
        "nn.Linear (F.linear calls on the model's Linear weights) and attention matmuls "
        "(F.scaled_dot_product_attention decomposed; eager matmuls inside attention modules)"
    )
    #: ``target -> Plan`` of each :meth:`plan` made (drawn on the heatmap).
    plans: dict = field(default_factory=dict)
    #: ``precision -> loss per step`` of ``compare(..., steps=N)`` (empty without steps).
    curves: dict = field(default_factory=dict)
    _skip_display_in: int | None = field(default=None, repr=False, compare=False)
    _subject: _Subject | None = field(default=None, repr=False, compare=False)

    # -- views ---------------------------------------------------------------------------
    def to_frame(self):
        """One row per module x precision: ``module, precision, out_sqnr_db, wgrad_sqnr_db,
        act_underflow_pct, act_saturation_pct, grad_underflow_pct`` (a pandas DataFrame).

        A Linear's row is named by its path. An attention module gives two rows, named by its path and
        the matmul: ``model.layers.0.self_attn [q·kᵀ]`` (the scores, contracted over the head dim) and
        ``model.layers.0.self_attn [p·v]`` (probabilities times values, contracted over the key length).
        For them ``out_sqnr_db`` is the matmul's output against float32 on the same inputs;
        ``wgrad_sqnr_db``, there being no weight, is the SQNR of the gradient of the matmul's second operand
        (K for q·kᵀ, V for p·v: ``aᵀ @ g``, the matmul in a weight gradient's role); the activation shares
        are of the first operand (Q, P) and the gradient share of the output gradient, as for a Linear.
        """
        import pandas as pd

        return pd.DataFrame([{c: getattr(r, c) for c in COLUMNS} for r in self.rows], columns=list(COLUMNS))

    def row(self, module: str, prec: str) -> LayerResult | None:
        """The result of one layer under one precision."""
        name = precision(prec).name
        return next((r for r in self.rows if r.module == module and r.precision == name), None)

    def to_dict(self) -> dict:
        """Plain data (what the renderers read)."""
        return {
            "model": self.model,
            "reference": self.reference,
            "precisions": list(self.precisions),
            "layers": [list(x) for x in self.layers],
            "attention": [list(x) for x in self.attention],
            # Every row's module, Linears and attention matmuls, in call order (the renderers' rows).
            "modules": list(dict.fromkeys(r.module for r in self.rows)),
            "rows": [{**{c: getattr(r, c) for c in COLUMNS}, "calls": r.calls, "kind": r.kind} for r in self.rows],
            "losses": dict(self.losses),
            "errors": dict(self.errors),
            "error": self.error,
            "findings": [f.to_dict() for f in self.findings],
            "device": self.device,
            "dtype": self.dtype,
            "backward": self.backward,
            "seconds": self.seconds,
            "reached": self.reached,
            "summaries": {p: PRECISIONS[p].summary for p in self.precisions if p in PRECISIONS},
            # Column labels: an MX precision names the scale mode its figures assume (``mxfp8 [FLOOR]``).
            "labels": {p: PRECISIONS[p].label for p in self.precisions if p in PRECISIONS},
            "thresholds": {
                "keep_below_db": dict(KEEP_BELOW_DB),
                "underflow_pct": {p: underflow_limit(p) for p in self.precisions},
                "saturation_pct": SATURATION_PCT,
            },
            "plans": {k: v.to_dict() for k, v in self.plans.items()},
            "curves": {k: list(v) for k, v in self.curves.items()},
        }

    def to_text(self) -> str:
        """The comparison as a text table."""
        from ...render.comparison import comparison_text

        return comparison_text(self.to_dict())

    def to_html(self) -> str:
        """The comparison as a static HTML heatmap (layer x precision, coloured by SQNR, underflow marked)."""
        from ...render.comparison import comparison_html

        return comparison_html(self.to_dict())

    def to_widget(self):
        """The comparison as an ipywidgets widget (metric selector and heatmap)."""
        from ...render.comparison import comparison_widget

        return comparison_widget(self.to_dict())

    def __repr__(self) -> str:
        return self.to_text()

    def _repr_html_(self) -> str:
        return self.to_html()

    def _ipython_display_(self) -> None:
        from ...render.comparison import show_comparison

        show_comparison(self)


    # -- advice --------------------------------------------------------------------------
    def recommend(
        self,
        precision_name: str = "fp8",
        *,
        min_sqnr_db: float | None = None,
        max_underflow_pct: float | None = None,
        max_saturation_pct: float = SATURATION_PCT,
    ) -> Recommendation:
        """The layers to keep in higher precision under ``precision_name``, and the code to convert the rest.

        A Linear is kept when, under that precision, its output or weight-gradient SQNR is below
        ``min_sqnr_db`` (default :data:`KEEP_BELOW_DB` for the precision), more than ``max_underflow_pct``
        percent (default :func:`underflow_limit`: 1%, 15% for NVFP4) of its nonzero input activations or
        output gradients underflow to zero, more than ``max_saturation_pct`` percent of its activations
        saturate (fp8 with amax scales and bf16/fp16 only: :data:`SATURATION_JUDGED`), or (fp8 and block formats) one of its
        dims is not a multiple of what the real kernels need (16 for float8 GEMMs, the block size for MX
        and NVFP4: :data:`KERNEL_MULTIPLE`).

        Judged layer by layer, never run: :meth:`plan` verifies a choice by running the mixed model.

        Attention rows (q·kᵀ, p·v) are never kept nor converted: they are no module a torchao
        ``module_filter_fn`` can name, and torchao's float8 and MX training recipes convert ``nn.Linear``
        only, so attention stays in high precision under them anyway. The code says so when the
        comparison has attention rows; the rows tell what an fp8 attention kernel would do.
        """
        name = self._compared(precision_name)
        rows = {r.module: r for r in self.rows if r.precision == name}
        reasons = keep_reasons(name, self.layers, rows, min_sqnr_db=min_sqnr_db, max_underflow_pct=max_underflow_pct,
                               max_saturation_pct=max_saturation_pct)  # fmt: skip
        keep = tuple(reasons)
        converted = tuple(p for p, _, _ in self.layers if p not in reasons)
        return Recommendation(name, keep, reasons, conversion_code(name, keep, bool(self.attention)), converted)

    def plan(
        self,
        target: str = "fp8",
        budget: float | None = None,
        *,
        max_kept: float | None = None,
        keep: str = "bf16",
        min_grad_sqnr_db: float | None = None,
    ) -> Plan:
        """A per-layer precision plan under ``target``, verified by running the mixed model end to end.

        The Linears are ranked by their figures under ``target`` (worst first), then the mixed model is
        emulated, forward and backward on this comparison's batch, keeping the worst layers in ``keep``
        (bf16 or fp32) until the loss gap against fp32 is within ``budget`` or the share of kept layers
        reaches ``max_kept``. See :func:`mpdoctor.attach.emulation.precision_plan.make_plan`.

        Parameters
        ----------
        target : str
            The low precision (``fp8``, ``fp8-rowwise``, ``mxfp8``, ``nvfp4``); it must have been compared.
        budget : float, optional
            The largest loss gap ``|loss(plan) - loss(fp32)|`` accepted. Default: 0.5% of the fp32 loss
            when ``max_kept`` is not given either.
        max_kept : float, optional
            The largest share (0..1) of Linears kept in ``keep``.
        keep : str
            The precision of the kept layers (``bf16`` or ``fp32``).
        min_grad_sqnr_db : float, optional
            A gradient budget besides the loss gap: the least SQNR (dB) of all parameter gradients of the
            planned model against fp32's. Layers are kept until both bounds hold (or ``max_kept`` is
            reached); ``plan.planned.grad_sqnr_db`` is the verified figure. Given alone, no loss budget
            is set by default.

        Returns
        -------
        Plan
            The kept layers, the verified loss gaps and gradient SQNRs of the plan, all-``target`` and
            all-``keep``, and the code (torchao config and ``module_filter_fn``; accelerate's recipe).
        """
        from .precision_plan import make_plan

        name = self._compared(target)
        subject = self._subject
        model = subject.model() if subject is not None else None
        if model is None:
            raise ValueError("the model of this comparison is gone (or it was not measured): run compare() again")
        result = make_plan(self.layers, self.rows, bool(self.attention), model, subject.batch, subject.loss,
                           subject.training, name, budget=budget, max_kept=max_kept, keep=keep,
                           min_grad_sqnr_db=min_grad_sqnr_db)  # fmt: skip
        self.plans[name] = result
        return result

    def _compared(self, precision_name: str) -> str:
        name = precision(precision_name).name
        if name not in self.precisions:
            raise ValueError(f"{name} was not compared; compare(..., precisions=(..., {name!r}))")
        return name


@dataclass(frozen=True)
class _Subject:
    """What a comparison ran on, for ``plan()`` to run the mixed model (the model held weakly)."""

    model: weakref.ReferenceType
    batch: Any
    loss: Callable | None
    training: bool


#: What no run reaches, whatever the model (said in every ``Comparison.reached``).
NOT_REACHED = (
    "not reached: attention inside custom kernels and other libraries' ops (flash-attn, xformers, "
    "flex_attention, torch.compile'd graphs), attention written with einsum, matmuls outside modules that "
    "read as attention, nn.MultiheadAttention's packed in-projection (not an nn.Linear); norms, activations "
    "and the loss run in the model's dtype"
)


def _reached(linears: int, attention: tuple) -> str:
    """Where this comparison emulated low precision, exactly, and what it could not reach."""
    linear = f"{linears} nn.Linear (F.linear calls on the model's Linear weights)"
    modules = len({path for _, path, _ in attention})
    if modules:
        att = (
            f"the {QK_LABEL} and {PV_LABEL} matmuls of {modules} attention module{'s' if modules != 1 else ''} "
            "(F.scaled_dot_product_attention decomposed, softmax in float32; torch.matmul / bmm / @ between "
            "two activations inside an attention module's own forward)"
        )
    else:
        att = (
            "no attention matmul (no F.scaled_dot_product_attention call, no matmul between two activations "
            "inside a module that reads as attention)"
        )
    return f"{linear}; {att}; {NOT_REACHED}"


def _refusal(model: Any, batch: Any, precisions: Any, reference: str, name: str) -> Comparison | None:
    """A Comparison naming why nothing can run (not a module, a bad batch or precision, no Linear), else None."""
    if not isinstance(model, torch.nn.Module):
        return Comparison(model=name, error=f"compare needs a torch.nn.Module, not {type(model).__name__}")
    try:
        [precision(p) for p in (*precisions, reference)]
    except ValueError as exc:
        return Comparison(model=name, error=str(exc))
    if not isinstance(batch, BATCH_TYPES):
        return Comparison(model=name, error=BATCH_MESSAGE.format(type(batch).__name__))
    return None


def compare(
    model: torch.nn.Module,
    batch: Any,
    precisions: tuple[str, ...] | list[str] = DEFAULT_PRECISIONS,
    reference: str = "fp32",
    loss: Callable | None = None,
    *,
    name: str = "model",
    training: bool = True,
    steps: int = 0,
    batches: Iterable[Any] | None = None,
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
) -> Comparison:
    """Emulate each precision at every Linear and attention matmul for one forward and backward, and measure.

    Parameters
    ----------
    model : torch.nn.Module
        The live model, on its own device; it is left exactly as it was.
    batch : dict, tensor, tuple or list
        As for :func:`mpdoctor.probe`: keyword arguments for ``forward``, one tensor, or positional arguments.
    precisions : sequence of str
        Among ``bf16``, ``fp16``, ``fp8`` (tensorwise), ``fp8-rowwise``, ``mxfp8``, ``nvfp4``.
    reference : str
        The reference precision (``fp32``: Linear and attention matmuls in float32 from the model's own
        weights; a float32 model's reference run is the model itself, unemulated).
    loss : callable, optional
        ``output -> scalar loss``; default ``output.loss``, else the mean of the first floating output.
    name : str
        The model's name in reports.
    training : bool
        Run in train mode (dropout on; the same masks in every run); the modes are restored after.
    steps : int
        Also train ``steps`` optimizer steps per precision (the reference included) from the model's
        weights, on ``batches`` (cycled; ``batch`` when None): ``Comparison.curves``, drawn beside the
        heatmap. A copy of the model trains (``copy.deepcopy``: the memory of one more model); the RNG
        is put back after.
    batches : iterable, optional
        The batches of those steps.
    optimizer : callable, optional
        ``params -> torch.optim.Optimizer`` for the steps (a fresh one per precision; default AdamW, lr 1e-3).

    Returns
    -------
    Comparison
        ``.to_frame()``, ``.losses``, ``.recommend(precision)``, ``.plan(target)``, ``.findings``,
        ``.curves``; renders as a heatmap. Never raises on a bad batch or model: ``.error`` says what went wrong.
    """
    start = time.perf_counter()
    refused = _refusal(model, batch, precisions, reference, name)
    if refused is not None:
        return refused
    precs, ref = [precision(p) for p in precisions], precision(reference)
    runner = Runner(model, batch, loss, training)
    if not runner.weights:
        return Comparison(
            model=name,
            error=f"{name} has no nn.Linear: compare emulates low precision at Linear layers, and found none to emulate",
        )
    comparison = Comparison(model=name, reference=ref.name, precisions=tuple(p.name for p in precs),
                            device=runner.device.type, dtype=str(runner.dtype).replace("torch.", ""))  # fmt: skip
    with runner:
        runs = runner.measure(ref, precs)
        if runs.error is None and steps > 0:
            comparison.curves = _curves(runner, [ref, *precs], steps, batches, optimizer)
    if runs.error is not None:
        comparison.error = runs.error
        return comparison
    called = runs.called(runner.weights)
    rows: list[LayerResult] = []
    with torch.no_grad():
        for p in precs:
            rows.extend(layer_results(p.name, runs.stats.get(p.name, {}), called, runs.attention))
    linear_of = {path: w for path, w in runner.weights.values()}
    comparison.layers = tuple((p, int(linear_of[p].shape[1]), int(linear_of[p].shape[0])) for p in called if p in linear_of)
    comparison.attention = tuple((label, *runs.attention[label]) for label in called if label in runs.attention)
    comparison.reached = _reached(len(comparison.layers), comparison.attention)
    comparison.rows = tuple(rows)
    comparison.losses = runs.losses
    comparison.errors = runs.errors
    comparison.backward = runs.backward
    comparison.findings = findings(name, ref.name, comparison.precisions, runs.losses, runs.errors, comparison.rows)
    comparison._subject = _Subject(weakref.ref(model), batch, loss, training)
    comparison.seconds = time.perf_counter() - start
    return comparison


def _curves(runner: Runner, precs: list[Precision], steps: int, batches: Iterable[Any] | None,
            optimizer: Callable | None) -> dict[str, list[float]]:  # fmt: skip
    """``precision -> loss per step`` of ``steps`` optimizer steps under each precision, from the same start."""
    make = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-3))
    batches = list(batches) if batches is not None else None  # an iterator would be spent after the first run
    curves: dict[str, list[float]] = {}
    for prec in precs:
        plain = prec.kind == "reference" and runner.dtype == torch.float32
        try:
            curves[prec.name] = runner.train(None if plain else prec, steps, batches, make)
        except Exception:  # a model that cannot be copied or trained has no curve; the single-step runs stand
            curves[prec.name] = [math.nan]
    return curves
