"""``Comparison.plan()``: a per-layer precision plan, ranked by the per-layer figures and verified by running it.

The Linears are ranked worst first by their figures under the target (the larger of the output and
weight-gradient noise powers, ``10^(-SQNR/10)``, and the share of inputs or gradients lost to zero). Then
the mixed model is emulated end to end, forward and backward, on the comparison's batch: the ``k`` worst
layers in the kept precision (bf16 or fp32), the rest in the target, attention as the model runs it (as
torchao's recipes leave it). ``k`` is searched by bisection (as Polygraphy's ``debug precision`` bisects,
as OpenVINO's accuracy control reverts the worst layers) for the fewest layers kept that bring the loss
gap against fp32 within the budget, capped by the share of layers that may stay high. A layer whose dims
the real kernels refuse (:data:`~mpdoctor.attach.emulation.measurements.KERNEL_MULTIPLE`) is kept whatever its
figures. A layer whose own figures cross the per-layer thresholds that ``recommend()``, the heatmap's ``▼``
and the ``<target>-layer-underflows`` warning use (``keep_reasons``) ranks first and is kept whatever the
loss budget (only a ``max_kept`` cap can leave one out): the plan never converts a layer the warning beside
it says to keep; the budget decides how many more to keep.

The plan reports its own loss gap and gradient SQNR (all parameter gradients against fp32's) next to
all-target and all-kept, and the code: torchao's config with a ``module_filter_fn`` that converts exactly
the planned layers, and accelerate's ``AORecipeKwargs`` recipe for the float8 targets.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .emulated_runs import Runner
from .formats import PRECISIONS, Precision, precision
from .measurements import KERNEL_MULTIPLE, SATURATION_PCT, LayerResult
from .recommendation import conversion_code, keep_literal, keep_reasons

#: The targets a plan can convert to (torchao has a recipe, or at least a config, for each).
TARGETS = ("fp8", "fp8-rowwise", "mxfp8", "mxfp8-rceil", "nvfp4")
#: The precisions kept layers may stay in.
KEPT = ("bf16", "fp32")
#: Default loss budget when none is given: this share of the fp32 loss.
DEFAULT_BUDGET_SHARE = 0.005


@dataclass(frozen=True)
class Verified:
    """One mixed model, run end to end: which Linears stayed high, its loss and how far from fp32."""

    kept: tuple[str, ...]
    loss: float
    loss_gap: float
    grad_sqnr_db: float
    seconds: float

    def to_dict(self) -> dict:
        """Plain data."""
        return {"kept": list(self.kept), "loss": self.loss, "loss_gap": self.loss_gap,
                "grad_sqnr_db": self.grad_sqnr_db, "seconds": self.seconds}  # fmt: skip


@dataclass
class Plan:
    """A verified per-layer precision plan (the result of ``Comparison.plan()``).

    Attributes
    ----------
    target : str
        The precision of the converted Linears.
    keep_precision : str
        The precision of the kept ones (``bf16`` or ``fp32``).
    kept : tuple of str
        The Linears kept in ``keep_precision``, worst first.
    converted : tuple of str
        The Linears converted to ``target``, in call order.
    reasons : dict
        ``path -> why`` for each kept layer (its figures, or the dims real kernels refuse).
    reference_loss : float
        The loss in fp32.
    budget : float or None
        The loss-gap budget; ``max_kept`` the share of layers that may stay high (None: no cap).
    min_grad_sqnr_db : float or None
        The gradient budget: the least SQNR (dB) of all parameter gradients against fp32's (None: no bound).
    within_budget : bool
        Whether the verified plan's loss gap, and its gradient SQNR when bounded, are within the budget.
    planned, all_target, all_kept : Verified
        The plan, every Linear in ``target``, every Linear in ``keep_precision``: verified runs.
    tried : tuple of Verified
        Every mixed model the search ran, in order.
    """

    target: str
    keep_precision: str
    kept: tuple[str, ...]
    converted: tuple[str, ...]
    reasons: dict
    reference_loss: float
    budget: float | None
    max_kept: float | None
    within_budget: bool
    planned: Verified
    all_target: Verified
    all_kept: Verified
    tried: tuple[Verified, ...] = ()
    attention: bool = False
    seconds: float = 0.0
    ranking: tuple[str, ...] = field(default=())
    min_grad_sqnr_db: float | None = None
    #: The cell whose ``%mpdoctor --plan`` drew this plan's summary with the heatmap (display state).
    _summary_shown_in: int | None = field(default=None, repr=False, compare=False)

    @property
    def loss_gap(self) -> float:
        """The verified plan's loss gap against fp32."""
        return self.planned.loss_gap

    def module_filter_fn(self) -> Callable[[torch.nn.Module, str], bool]:
        """torchao's ``(module, fqn) -> bool``: True for exactly the Linears the plan converts."""
        converted = frozenset(self.converted)

        def module_filter_fn(module: torch.nn.Module, fqn: str) -> bool:
            return isinstance(module, torch.nn.Linear) and fqn in converted

        return module_filter_fn

    def torchao_config(self) -> Any:
        """torchao's config object for the target (imports torchao): ``Float8LinearConfig`` for fp8 recipes,
        ``MXFP8TrainingOpConfig`` for MXFP8, ``NVFP4DynamicActivationNVFP4WeightConfig`` for NVFP4."""
        if self.target in ("fp8", "fp8-rowwise"):
            from torchao.float8 import Float8LinearConfig

            return Float8LinearConfig.from_recipe_name("tensorwise" if self.target == "fp8" else "rowwise")
        if self.target in ("mxfp8", "mxfp8-rceil"):
            from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe

            return MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_RCEIL)
        from torchao.prototype.mx_formats import NVFP4DynamicActivationNVFP4WeightConfig

        return NVFP4DynamicActivationNVFP4WeightConfig()

    @property
    def code(self) -> str:
        """torchao code converting exactly the planned Linears (the kept ones named in ``keep``)."""
        head = f"# mpdoctor plan: {self.target}, {len(self.kept)} of {len(self.kept) + len(self.converted)} Linears kept in {self.keep_precision}; "
        head += f"emulated loss gap {self.planned.loss_gap:.4g} vs fp32 (all-{self.target}: {self.all_target.loss_gap:.4g}); not run on {self.target} kernels\n"
        return head + conversion_code(self.target, self.kept, self.attention)

    @property
    def accelerate_code(self) -> str | None:
        """accelerate's recipe for the float8 targets (``AORecipeKwargs`` with the plan's filter), else None.

        TransformerEngine's recipes (accelerate's ``TERecipeKwargs``) convert every Linear: no per-layer
        plan can be expressed there.
        """
        if self.target not in ("fp8", "fp8-rowwise"):
            return None
        recipe = "tensorwise" if self.target == "fp8" else "rowwise"
        keep_line = keep_literal(self.kept)
        return (
            "import torch\n"
            "from accelerate import Accelerator\n"
            "from accelerate.utils import AORecipeKwargs\n"
            "from torchao.float8 import Float8LinearConfig\n\n"
            f"{keep_line}  # kept in high precision by mpdoctor's plan (checked in emulation, not on fp8 kernels)\n\n"
            "def module_filter_fn(module, fqn):\n"
            "    return isinstance(module, torch.nn.Linear) and fqn not in keep\n\n"
            f'config = Float8LinearConfig.from_recipe_name("{recipe}")\n'
            'accelerator = Accelerator(mixed_precision="fp8", '
            "kwargs_handlers=[AORecipeKwargs(config=config, module_filter_func=module_filter_fn)])\n"
        )

    def to_dict(self) -> dict:
        """Plain data (what the renderers read)."""
        return {
            "target": self.target,
            "target_label": precision(self.target).label,
            "keep_precision": self.keep_precision,
            "kept": list(self.kept),
            "converted": list(self.converted),
            "reasons": dict(self.reasons),
            "reference_loss": self.reference_loss,
            "budget": self.budget,
            "max_kept": self.max_kept,
            "min_grad_sqnr_db": self.min_grad_sqnr_db,
            "within_budget": self.within_budget,
            "planned": self.planned.to_dict(),
            "all_target": self.all_target.to_dict(),
            "all_kept": self.all_kept.to_dict(),
            "runs": len(self.tried),
            "seconds": self.seconds,
        }

    def to_text(self) -> str:
        """The plan in a few lines: what is kept, the verified figures, the code."""
        from ...render.comparison import plan_text

        return plan_text(self.to_dict()) + "\n\n" + self.code

    def __repr__(self) -> str:
        return self.to_text()

    def _ipython_display_(self) -> None:
        """The plan as text; only its code when ``%mpdoctor --plan`` already drew its summary in this cell."""
        from IPython import get_ipython
        from IPython.display import display

        count = getattr(get_ipython(), "execution_count", None)
        shown, self._summary_shown_in = self._summary_shown_in, None
        text = self.code if shown is not None and shown == count else self.to_text()
        display({"text/plain": text}, raw=True)


def risk(row: LayerResult | None) -> float:
    """How much a layer loses under the target: the larger of its output and weight-gradient noise-to-signal
    power ratios and its share of inputs or gradients lost to zero (0 when unmeasured)."""
    if row is None:
        return 0.0
    values = [row.lost_pct / 100.0]
    for db in (row.out_sqnr_db, row.wgrad_sqnr_db):
        if isinstance(db, float) and not math.isnan(db):
            values.append(10.0 ** (-db / 10.0) if math.isfinite(db) or db < 0 else 0.0)
    return max(values)


def _ranking(layers: Sequence[tuple[str, int, int]], rows: Mapping[str, LayerResult], target: str
             ) -> tuple[list[str], dict[str, str], dict[str, str]]:  # fmt: skip
    """Linears worst first (ties in call order), those whose figures cross the per-layer thresholds (the same as
    ``recommend()``'s and the underflow warning's) ahead of the rest; then the ones the kernels refuse, and the
    threshold-crossers, each with why."""
    reasons = keep_reasons(target, layers, rows, max_saturation_pct=SATURATION_PCT)
    multiple = KERNEL_MULTIPLE.get(target)
    forced = {p: f"dims {fin}x{fout} not multiples of {multiple}" for p, fin, fout in layers if multiple and (fin % multiple or fout % multiple)}
    flagged = {p: why for p, why in reasons.items() if p not in forced}
    free = [p for p, _, _ in layers if p not in forced]
    ranked = sorted(free, key=lambda p: (p not in flagged, -risk(rows.get(p))))
    return ranked, forced, flagged


def _why(row: LayerResult | None) -> str:
    if row is None:
        return "not measured"
    return (f"output {row.out_sqnr_db:.1f} dB, weight gradient {row.wgrad_sqnr_db:.1f} dB, "
            f"{row.lost_pct:.1f}% of inputs or gradients lost to zero")  # fmt: skip


def grad_sqnr_db(reference: Sequence[torch.Tensor | None], got: Sequence[torch.Tensor | None]) -> float:
    """SQNR (dB) of all parameter gradients together against the reference's (a missing gradient counts as zero).

    Two fused norms per parameter (no squared or float64 temporaries), summed in float64.
    """
    signal = noise = 0.0
    for r, g in zip(reference, got):
        if r is None:
            continue
        norm_r = float(torch.linalg.vector_norm(r))
        signal += norm_r * norm_r
        norm_e = float(torch.linalg.vector_norm(g - r)) if g is not None else norm_r
        noise += norm_e * norm_e
    if not (math.isfinite(signal) and math.isfinite(noise)):
        return math.nan
    if noise == 0:
        return math.inf
    return 10.0 * math.log10(signal / noise) if signal > 0 else -math.inf


class _Search:
    """The verified runs of one plan search (each a mixed model, run end to end)."""

    def __init__(self, runner: Runner, target: Precision, keep: Precision, layers: Sequence[str]) -> None:
        self.runner, self.target, self.keep, self.layers = runner, target, keep, list(layers)
        reference = None if runner.dtype == torch.float32 else PRECISIONS["fp32"]
        self.reference_loss, self.reference_grads = runner.loss_and_grads(reference, {})
        self.tried: list[Verified] = []

    def verify(self, kept: Sequence[str]) -> Verified:
        """The mixed model with ``kept`` in the kept precision and the rest in the target, run (once per set)."""
        kept_set = frozenset(kept)
        done = next((v for v in self.tried if frozenset(v.kept) == kept_set), None)
        if done is not None:
            return done if done.kept == tuple(kept) else Verified(tuple(kept), done.loss, done.loss_gap, done.grad_sqnr_db, done.seconds)
        start = time.perf_counter()
        assignment = {p: (self.keep if p in kept_set else self.target) for p in self.layers}
        try:
            loss, grads = self.runner.loss_and_grads(self.target, assignment)
        except Exception:  # a mixed model that raises is as far from the reference as can be
            loss, grads = math.nan, []
        gap = abs(loss - self.reference_loss) if math.isfinite(loss) else math.inf
        out = Verified(tuple(kept), loss, gap, grad_sqnr_db(self.reference_grads, grads) if grads else math.nan,
                       time.perf_counter() - start)  # fmt: skip
        self.tried.append(out)
        return out


def make_plan(layers: Sequence[tuple[str, int, int]], rows: Sequence[LayerResult], attention: bool,
              model: torch.nn.Module, batch: Any, loss: Callable | None, training: bool, target: str,
              *, budget: float | None, max_kept: float | None, keep: str,
              min_grad_sqnr_db: float | None = None) -> Plan:  # fmt: skip
    """The plan of ``Comparison.plan()`` (see this module's docstring): ``layers`` are the comparison's
    ``(path, in, out)`` Linears in call order, ``rows`` its measurements, ``attention`` whether it reached any."""
    start = time.perf_counter()
    tgt, high = precision(target), precision(keep)
    if tgt.name not in TARGETS:
        raise ValueError(f"plan() converts to {', '.join(TARGETS)}, not {tgt.name}")
    if high.name not in KEPT:
        raise ValueError(f"plan() keeps layers in {' or '.join(KEPT)}, not {high.name}")
    if max_kept is not None and not 0.0 <= max_kept <= 1.0:
        raise ValueError(f"max_kept is a share of the Linears, between 0 and 1, not {max_kept}")
    by_path = {r.module: r for r in rows if r.precision == tgt.name}
    ranked, forced, flagged = _ranking(layers, by_path, tgt.name)
    paths = [p for p, _, _ in layers]
    with Runner(model, batch, loss, training) as runner:
        search = _Search(runner, tgt, high, paths)
        if budget is None and max_kept is None and min_grad_sqnr_db is None:
            budget = DEFAULT_BUDGET_SHARE * abs(search.reference_loss)
        fits = _fits(budget, min_grad_sqnr_db)
        cap = len(ranked) if max_kept is None else max(0, min(len(ranked), math.floor(max_kept * len(paths)) - len(forced)))
        all_target = search.verify(())
        all_kept = search.verify(paths)
        k, planned = _bisect(search, list(forced), ranked, cap, fits, all_target if not forced else None, len(flagged))
    kept = (*forced, *ranked[:k])
    reasons = {**forced, **{p: flagged.get(p) or _why(by_path.get(p)) for p in ranked[:k]}}
    return Plan(
        target=tgt.name,
        keep_precision=high.name,
        kept=tuple(kept),
        converted=tuple(p for p in paths if p not in set(kept)),
        reasons=reasons,
        reference_loss=search.reference_loss,
        budget=budget,
        max_kept=max_kept,
        within_budget=fits is None or fits(planned),
        planned=planned,
        all_target=all_target,
        all_kept=all_kept,
        tried=tuple(search.tried),
        attention=attention,
        seconds=time.perf_counter() - start,
        ranking=tuple(ranked),
        min_grad_sqnr_db=min_grad_sqnr_db,
    )


def _fits(budget: float | None, min_grad_sqnr_db: float | None) -> Callable[[Verified], bool] | None:
    """Whether a verified run is within the budget: its loss gap at most ``budget`` and its gradient SQNR at
    least ``min_grad_sqnr_db`` (a NaN SQNR, a run that raised, never fits); None when nothing is bounded."""
    if budget is None and min_grad_sqnr_db is None:
        return None

    def fits(v: Verified) -> bool:
        if budget is not None and not v.loss_gap <= budget:
            return False
        return min_grad_sqnr_db is None or v.grad_sqnr_db >= min_grad_sqnr_db

    return fits


def _bisect(search: _Search, forced: list[str], ranked: list[str], cap: int, fits: Callable[[Verified], bool] | None,
            none_kept: Verified | None, least: int = 0) -> tuple[int, Verified]:  # fmt: skip
    """The fewest of the worst-ranked layers to keep (at least ``least``, at most ``cap``) whose mixed model
    ``fits`` the budget.

    Without a budget the cap itself is the plan (more layers kept never loses accuracy in the model's
    figures). Assumes the gap shrinks (and the gradient SQNR grows) as layers are kept; every answer is a
    run, not an inference.
    """

    def run(k: int) -> Verified:
        if k == 0 and none_kept is not None:
            return none_kept
        return search.verify([*forced, *ranked[:k]])

    if fits is None:
        return cap, run(cap)
    least = min(least, cap)  # the layers the thresholds flag, unless the cap is smaller
    low = run(least)
    if fits(low) or cap == least:
        return least, low
    high = run(cap)
    if not fits(high):
        return cap, high  # over budget even at the cap: the best the cap allows, said so
    lo, hi, best = least, cap, high
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = run(mid)
        if fits(got):
            hi, best = mid, got
        else:
            lo = mid
    return hi, best
