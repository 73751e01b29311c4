"""``compare(model, batch)``: what bf16, fp16, fp8, MXFP8 and NVFP4 would do to this model, layer by layer.

One forward and one backward of the live model per precision, on its own device
(the CPU included), each next to a reference run. Low precision is emulated at
every ``nn.Linear`` through a :class:`torch.overrides.TorchFunctionMode` that
catches ``F.linear`` calls whose weight is one of the model's Linear weights:
the module tree is never touched (no hook, no swapped module). In each of the
three matmuls of a Linear (output, input gradient, weight gradient) both operands
are quantized as the precision says (:mod:`mpdoctor.emulation.formats`) and
multiplied with float32 accumulation; everything else (norms, softmax,
attention's own matmuls, the loss) runs in the model's own dtype.

Per layer and precision it measures, on the inputs the layer really sees in that
run: the SQNR of its output and of its weight gradient against the same matmul in
float32 (the layer's *own* error, so a bad layer is not hidden by the errors of
the layers before it), and the shares of the nonzero input activations that
underflow to zero or saturate, and of the nonzero output gradients that
underflow. The loss of each run, next to the reference loss, is the end-to-end
effect.

The model is left exactly as it was: weights, buffers, ``.grad``, RNG state,
train/eval flags and hooks (each run starts from the same RNG state, so dropout
masks are identical across precisions). Batches and losses are handled as in
:func:`mpdoctor.probe`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from ..numerics.probe import _call, _first_line, _loss_of, _Snapshot, _to_device
from ..numerics.probe_facts import ForwardCall
from ..treatment.findings import Finding
from .formats import PRECISIONS, Precision, precision

DEFAULT_PRECISIONS = ("bf16", "fp16", "fp8", "mxfp8", "nvfp4")
COLUMNS = ("module", "precision", "out_sqnr_db", "wgrad_sqnr_db", "act_underflow_pct", "act_saturation_pct", "grad_underflow_pct")
#: Share (percent) of nonzero activations or gradients lost to underflow above which a layer is flagged.
#: NVFP4 loses what lies under 1/24 of its block's max by design (about 8% of a Gaussian block).
UNDERFLOW_PCT = {"nvfp4": 15.0}
DEFAULT_UNDERFLOW_PCT = 1.0
#: Share (percent) of nonzero activations clamped at the format's max above which a layer is flagged. Only
#: fp8 with a per-tensor or per-row amax scale and bf16/fp16 are judged: MX's FLOOR scales put a block's max
#: in [256, 512), past e4m3's 448, and NVFP4's rounded e4m3 block scales clip some block maxima, by design.
SATURATION_PCT = 0.1
SATURATION_JUDGED = ("bf16", "fp16", "fp8", "fp8-rowwise")
#: Output or weight-gradient SQNR (dB) under which a layer is kept in higher precision, per precision:
#: about 10 dB below what the format gives a plain Gaussian layer on this CPU (bf16 ~ 51, fp16 ~ 69,
#: fp8 ~ 29 out / 25 wgrad with e5m2, rowwise ~ 29, MXFP8 ~ 25, NVFP4 ~ 17 dB; tests/test_compare.py).
KEEP_BELOW_DB = {"bf16": 40.0, "fp16": 58.0, "fp8": 16.0, "fp8-rowwise": 18.0, "mxfp8": 15.0, "nvfp4": 8.0}
#: Dims real kernels need: float8 GEMMs (cuBLAS / torch._scaled_mm) want multiples of 16; block formats their block.
KERNEL_MULTIPLE = {"fp8": 16, "fp8-rowwise": 16, "mxfp8": 32, "nvfp4": 16}
_FP8_FAMILY = ("fp8", "fp8-rowwise", "mxfp8", "nvfp4")


# -- per-layer statistics ---------------------------------------------------------------------


class _LayerStats:
    """Sums of one Linear's measurements in one run, kept as 0-d tensors until the run ends."""

    __slots__ = ("calls", "out", "wgrad", "act", "grad")

    def __init__(self) -> None:
        self.calls = 0
        self.out: list[torch.Tensor] = []  # [signal power, noise power] per call
        self.wgrad: list[torch.Tensor] = []
        self.act: list[torch.Tensor] = []  # [nonzero, underflow, saturated]
        self.grad: list[torch.Tensor] = []  # [nonzero, underflow]


def _power(exact: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """[signal power, noise power] of ``got`` against ``exact``: two fused norms, no squared temporaries."""
    norms = torch.stack([torch.linalg.vector_norm(exact), torch.linalg.vector_norm(got - exact)]).double()
    return norms.square()


class _EmulatedLinear(torch.autograd.Function):
    """``F.linear`` with both operands of each of its three matmuls quantized, float32 accumulation."""

    @staticmethod
    def forward(ctx, x, weight, bias, prec: Precision, stats: _LayerStats):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.prec, ctx.stats, ctx.has_bias = prec, stats, bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        k = x.shape[-1]
        x2 = x.reshape(-1, k).to(torch.float32)
        w = weight.to(torch.float32)
        qx = prec.quantize(x2, 1)
        qw = prec.quantize(w, 1, count=False)
        # Scales that ignore the contraction dim give the backward matmuls the very same operands: keep them.
        ctx.reuse = None if prec.along_contraction else (qx.values, qw.values)
        y = qx.values @ qw.values.t()
        exact = x2 @ w.t()
        if bias is not None:
            y = y + bias.to(torch.float32)
            exact = exact + bias.to(torch.float32)
        y = prec.round_output(y)
        stats.calls += 1
        stats.out.append(_power(exact, y))
        stats.act.append(torch.stack([qx.nonzero, qx.underflow, qx.saturated]))
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        prec: Precision = ctx.prec
        stats: _LayerStats = ctx.stats
        n = grad.shape[-1]
        g2 = grad.reshape(-1, n).to(torch.float32)
        w = weight.to(torch.float32)
        qg = prec.quantize(g2, 1, grad=True)
        stats.grad.append(torch.stack([qg.nonzero, qg.underflow]))
        gx = gw = gb = None
        reuse = ctx.reuse
        ctx.reuse = None
        if ctx.needs_input_grad[0]:
            qw = prec.quantize(w, 0, count=False).values if reuse is None else reuse[1]  # contracted over the output features
            gx = prec.round_output(qg.values @ qw).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
            qg0 = prec.quantize(g2, 0, grad=True, count=False) if prec.along_contraction else qg  # contracted over tokens
            qx0 = prec.quantize(x2, 0, count=False).values if reuse is None else reuse[0]
            gw32 = prec.round_output(qg0.values.t() @ qx0)
            stats.wgrad.append(_power(g2.t() @ x2, gw32))
            gw = gw32.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = (qg.values if prec.rounds_output else g2).sum(0).to(ctx.bias_dtype)
        return gx, gw, gb, None, None


class _Emulation(TorchFunctionMode):
    """Routes ``F.linear`` calls on the model's Linear weights through :class:`_EmulatedLinear`."""

    def __init__(self, weights: dict[int, tuple[str, torch.Tensor]], prec: Precision) -> None:
        super().__init__()
        self.weights = weights
        self.prec = prec
        self.stats: dict[str, _LayerStats] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x = args[0] if args else kwargs.get("input")
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            hit = self.weights.get(id(weight))
            if (
                hit is not None
                and hit[1] is weight
                and type(x) is torch.Tensor
                and x.dtype == weight.dtype
                and x.is_floating_point()
                and (bias is None or type(bias) in (torch.Tensor, torch.nn.Parameter))
            ):
                stats = self.stats.get(hit[0])
                if stats is None:
                    stats = self.stats[hit[0]] = _LayerStats()
                return _EmulatedLinear.apply(x, weight, bias, self.prec, stats)
        return func(*args, **kwargs)


# -- results ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerResult:
    """One Linear under one precision (a row of :meth:`Comparison.to_frame`)."""

    module: str
    precision: str
    out_sqnr_db: float
    wgrad_sqnr_db: float
    act_underflow_pct: float
    act_saturation_pct: float
    grad_underflow_pct: float
    calls: int = 1


@dataclass(frozen=True)
class Recommendation:
    """Which layers to keep in higher precision under one precision, and the code that does it.

    Attributes
    ----------
    precision : str
        The precision recommended for the other Linear layers.
    keep : tuple of str
        Module paths to keep in the model's own dtype.
    reasons : dict
        ``module -> why`` (the measurement and the threshold it crossed).
    code : str
        Python that converts the model with the keep list excluded (torchao 0.18 API names).
    converted : tuple of str
        The Linear layers the code converts.
    """

    precision: str
    keep: tuple[str, ...]
    reasons: dict
    code: str
    converted: tuple[str, ...] = ()

    def module_filter_fn(self) -> Callable[[torch.nn.Module, str], bool]:
        """A ``(module, fqn) -> bool`` filter for torchao that converts every Linear but the kept ones."""
        keep = frozenset(self.keep)

        def module_filter_fn(module: torch.nn.Module, fqn: str) -> bool:
            return isinstance(module, torch.nn.Linear) and fqn not in keep

        return module_filter_fn

    def __repr__(self) -> str:
        kept = ", ".join(self.keep) if self.keep else "none"
        return f"<Recommendation {self.precision}: keep {kept}>\n{self.code}"


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
        One per Linear and precision.
    losses : dict
        ``precision -> loss`` (the reference included; NaN when the run failed).
    errors : dict
        ``precision -> message`` for runs that raised.
    error : str or None
        Why nothing could be compared (bad batch, no Linear, ...).
    layers : tuple
        ``(path, in_features, out_features)`` of each Linear, in call order.
    findings : list of Finding
        What is clear from the measurements.
    """

    model: str = "model"
    reference: str = "fp32"
    precisions: tuple[str, ...] = ()
    rows: tuple[LayerResult, ...] = ()
    losses: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    error: str | None = None
    layers: tuple = ()
    findings: list = field(default_factory=list)
    device: str = "cpu"
    dtype: str = "float32"
    backward: bool = True
    seconds: float = 0.0
    reached: str = "nn.Linear (F.linear calls on the model's Linear weights); attention matmuls run in the model's dtype"
    _skip_display_in: int | None = field(default=None, repr=False, compare=False)

    # -- views ---------------------------------------------------------------------------
    def to_frame(self):
        """One row per module x precision: ``module, precision, out_sqnr_db, wgrad_sqnr_db,
        act_underflow_pct, act_saturation_pct, grad_underflow_pct`` (a pandas DataFrame)."""
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
            "rows": [{**{c: getattr(r, c) for c in COLUMNS}, "calls": r.calls} for r in self.rows],
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
            "thresholds": {
                "keep_below_db": dict(KEEP_BELOW_DB),
                "underflow_pct": {p: underflow_limit(p) for p in self.precisions},
                "saturation_pct": SATURATION_PCT,
            },
        }

    def to_text(self) -> str:
        """The comparison as a text table."""
        from ..render.comparison import comparison_text

        return comparison_text(self.to_dict())

    def to_html(self) -> str:
        """The comparison as a static HTML heatmap (layer x precision, coloured by SQNR, underflow marked)."""
        from ..render.comparison import comparison_html

        return comparison_html(self.to_dict())

    def to_widget(self):
        """The comparison as an ipywidgets widget (metric selector and heatmap)."""
        from ..render.comparison import comparison_widget

        return comparison_widget(self.to_dict())

    def __repr__(self) -> str:
        return self.to_text()

    def _repr_html_(self) -> str:
        return self.to_html()

    def _ipython_display_(self) -> None:
        from ..render.comparison import show_comparison

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
        """
        prec = precision(precision_name)
        name = prec.name
        if name not in self.precisions:
            raise ValueError(f"{name} was not compared; compare(..., precisions=(..., {name!r}))")
        floor = KEEP_BELOW_DB.get(name, 0.0) if min_sqnr_db is None else min_sqnr_db
        under = underflow_limit(name) if max_underflow_pct is None else max_underflow_pct
        reasons: dict[str, str] = {}
        for path, fin, fout in self.layers:
            r = self.row(path, name)
            why = []
            multiple = KERNEL_MULTIPLE.get(name)
            if multiple and (fin % multiple or fout % multiple):
                why.append(f"dims {fin}x{fout} not multiples of {multiple}")
            if r is not None:
                if r.act_underflow_pct > under:
                    why.append(f"{r.act_underflow_pct:.1f}% of activations underflow")
                if r.grad_underflow_pct > under:
                    why.append(f"{r.grad_underflow_pct:.1f}% of output gradients underflow")
                if name in SATURATION_JUDGED and r.act_saturation_pct > max_saturation_pct:
                    why.append(f"{r.act_saturation_pct:.2f}% of activations saturate")
                if _below(r.out_sqnr_db, floor):
                    why.append(f"output SQNR {r.out_sqnr_db:.1f} dB < {floor:g}")
                if _below(r.wgrad_sqnr_db, floor):
                    why.append(f"weight-gradient SQNR {r.wgrad_sqnr_db:.1f} dB < {floor:g}")
            if why:
                reasons[path] = "; ".join(why)
        keep = tuple(reasons)
        converted = tuple(p for p, _, _ in self.layers if p not in reasons)
        return Recommendation(name, keep, reasons, _code_for(name, keep), converted)


def underflow_limit(name: str) -> float:
    """The underflow share (percent) above which a layer is flagged under precision ``name``."""
    return UNDERFLOW_PCT.get(name, DEFAULT_UNDERFLOW_PCT)


def _below(value: float, floor: float) -> bool:
    return isinstance(value, float) and not math.isnan(value) and value < floor


def _code_for(name: str, keep: tuple[str, ...]) -> str:
    """torchao 0.18 code converting every Linear except ``keep`` (names as torchao passes them: fqn)."""
    keep_line = f"keep = {set(keep)!r}" if keep else "keep = set()"
    filt = (
        f"{keep_line}  # measured by mpdoctor.compare: stay in high precision\n\n"
        "def module_filter_fn(module, fqn):\n"
        "    return isinstance(module, torch.nn.Linear) and fqn not in keep\n\n"
    )
    if name in ("fp8", "fp8-rowwise"):
        recipe = "tensorwise" if name == "fp8" else "rowwise"
        return (
            "import torch\n"
            "from torchao.float8 import Float8LinearConfig, convert_to_float8_training\n\n"
            + filt
            + f'config = Float8LinearConfig.from_recipe_name("{recipe}")\n'
            "convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)\n"
        )
    if name == "mxfp8":
        return (
            "import torch\n"
            "from torchao.quantization import quantize_\n"
            "from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe\n\n"
            + filt
            + "# mpdoctor emulates FLOOR scales (OCP MX); torchao's training recipes use RCEIL\n"
            "config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_RCEIL)\n"
            "quantize_(model, config, filter_fn=module_filter_fn)\n"
        )
    if name == "nvfp4":
        return (
            "import torch\n"
            "from torchao.quantization import quantize_\n"
            "from torchao.prototype.mx_formats import NVFP4DynamicActivationNVFP4WeightConfig\n\n"
            + filt
            + "# torchao 0.18 ships NVFP4 for inference (no NVFP4 training recipe)\n"
            "quantize_(model, NVFP4DynamicActivationNVFP4WeightConfig(), filter_fn=module_filter_fn)\n"
        )
    dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}.get(name, "torch.float32")
    body = f"{keep_line}  # measured by mpdoctor.compare\n"
    body += "# autocast has no per-module switch: run the kept layers with autocast disabled inside their forward\n"
    body += "def _full_precision(module, args):\n    return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)\n\n"
    body += "for fqn, module in model.named_modules():\n    if fqn in keep:\n        module.forward = torch.autocast(device_type=\"cuda\", enabled=False)(module.forward)\n        module.register_forward_pre_hook(_full_precision)\n"
    return f"import torch\n\n{body}\nwith torch.autocast(device_type=\"cuda\", dtype={dtype}):\n    loss = model(**batch).loss\n"


# -- the runs -----------------------------------------------------------------------------------


def _linears(model: torch.nn.Module) -> dict[int, tuple[str, torch.Tensor]]:
    out: dict[int, tuple[str, torch.Tensor]] = {}
    for path, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and isinstance(getattr(m, "weight", None), torch.Tensor):
            w = m.weight
            if type(w) in (torch.Tensor, torch.nn.Parameter) and w.is_floating_point() and w.device.type != "meta":
                out.setdefault(id(w), (path or "(model)", w))
    return out


def _run(model, batch, loss_fn, mode: _Emulation | None, backward: bool) -> float:
    """One forward (and backward) under ``mode``; returns the loss (grads are cleared by the caller)."""
    with torch.enable_grad():
        if mode is not None:
            with mode:
                output = _call(model, batch)
                loss = _loss_of(output, loss_fn)
        else:
            output = _call(model, batch)
            loss = _loss_of(output, loss_fn)
        del output
        value = float(loss.detach().float())
        if backward and loss.requires_grad:
            loss.backward()
    return value


def _db(pairs: list[torch.Tensor]) -> float:
    if not pairs:
        return math.nan
    sig, noise = (float(v) for v in torch.stack(pairs).sum(0).tolist())
    if not (math.isfinite(sig) and math.isfinite(noise)):
        return math.nan
    if noise == 0:
        return math.inf
    if sig == 0:
        return -math.inf
    return 10.0 * math.log10(sig / noise)


def _pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole else 0.0


def _results(name: str, stats: dict[str, _LayerStats], order: list[str]) -> list[LayerResult]:
    rows = []
    for path in order:
        s = stats.get(path)
        if s is None:
            continue
        act = torch.stack(s.act).sum(0).tolist() if s.act else [0, 0, 0]
        grad = torch.stack(s.grad).sum(0).tolist() if s.grad else [0, 0]
        rows.append(
            LayerResult(
                module=path,
                precision=name,
                out_sqnr_db=_db(s.out),
                wgrad_sqnr_db=_db(s.wgrad),
                act_underflow_pct=_pct(act[1], act[0]),
                act_saturation_pct=_pct(act[2], act[0]),
                grad_underflow_pct=_pct(grad[1], grad[0]),
                calls=s.calls,
            )
        )
    return rows


def compare(
    model: torch.nn.Module,
    batch: Any,
    precisions: tuple[str, ...] | list[str] = DEFAULT_PRECISIONS,
    reference: str = "fp32",
    loss: Callable | None = None,
    *,
    name: str = "model",
    training: bool = True,
) -> Comparison:
    """Emulate each precision at every Linear for one forward and backward, and measure what it does.

    Parameters
    ----------
    model : torch.nn.Module
        The live model, on its own device; it is left exactly as it was.
    batch : dict, tensor, tuple or list
        As for :func:`mpdoctor.probe`: keyword arguments for ``forward``, one tensor, or positional arguments.
    precisions : sequence of str
        Among ``bf16``, ``fp16``, ``fp8`` (tensorwise), ``fp8-rowwise``, ``mxfp8``, ``nvfp4``.
    reference : str
        The reference precision (``fp32``: Linear matmuls in float32 from the model's own weights).
    loss : callable, optional
        ``output -> scalar loss``; default ``output.loss``, else the mean of the first floating output.
    name : str
        The model's name in reports.
    training : bool
        Run in train mode (dropout on; the same masks in every run); the modes are restored after.

    Returns
    -------
    Comparison
        ``.to_frame()``, ``.losses``, ``.recommend(precision)``, ``.findings``; renders as a heatmap.
        Never raises on a bad batch or model: ``.error`` says what went wrong.
    """
    start = time.perf_counter()
    if not isinstance(model, torch.nn.Module):
        return Comparison(model=name, error=f"compare needs a torch.nn.Module, not {type(model).__name__}")
    try:
        precs = [precision(p) for p in precisions]
        ref = precision(reference)
    except ValueError as exc:
        return Comparison(model=name, error=str(exc))
    if not isinstance(batch, (Mapping, torch.Tensor, tuple, list, ForwardCall)):
        return Comparison(
            model=name,
            error=f"batch must be a dict of keyword arguments, a tensor or a tuple/list, not {type(batch).__name__}",
        )
    weights = _linears(model)
    if not weights:
        return Comparison(
            model=name,
            error=f"{name} has no nn.Linear: compare emulates low precision at Linear layers, and found none to emulate",
        )
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    dtype = str(first.dtype).replace("torch.", "") if first is not None else "float32"
    snapshot = _Snapshot(model, batch)
    batch = _to_device(batch, device)
    rng = snapshot.cpu_rng
    losses: dict[str, float] = {}
    errors: dict[str, str] = {}
    per_run: dict[str, dict[str, _LayerStats]] = {}
    order: list[str] = []
    backward = True
    comparison = Comparison(model=name, reference=ref.name, precisions=tuple(p.name for p in precs), device=device.type, dtype=dtype)
    try:
        model.train(training)
        runs = [ref, *precs]
        for i, prec in enumerate(runs):
            snapshot.clear_grads()
            # Every run from the same RNG state and running statistics: the same dropout masks, the same batch norm.
            torch.set_rng_state(rng)
            if snapshot.cuda_rng is not None:
                torch.cuda.set_rng_state_all(snapshot.cuda_rng)
            if i > 0:
                with torch.no_grad():
                    for b, saved in snapshot.running:
                        b.copy_(saved)
            # The reference in the model's own dtype needs no emulation: the unmodified model.
            plain = i == 0 and prec.kind == "reference" and dtype == "float32"
            mode = None if plain else _Emulation(weights, prec)
            try:
                value = _run(model, batch, loss, mode, backward=True)
            except Exception as exc:  # the model's error becomes the comparison's message, never a traceback
                message = f"{type(exc).__name__}: {_first_line(exc)}"
                if i == 0:
                    comparison.error = f"the model rejected the batch in the {prec.name} reference run: {message}"
                    return comparison
                errors[prec.name] = message
                losses[prec.name] = math.nan
                continue
            finally:
                snapshot.clear_grads()
            if i == 0:
                losses[ref.name] = value
                backward = any(p.requires_grad for p in snapshot.params) or bool(snapshot.leaves)
                if mode is None:
                    order = [p for p, _ in weights.values()]
                else:
                    order = list(mode.stats)
                continue
            losses[prec.name] = value
            per_run[prec.name] = mode.stats if mode is not None else {}
            if not order or len(order) < len(mode.stats):
                order = list(dict.fromkeys([*order, *mode.stats]))
    finally:
        snapshot.restore()
    called = [p for p in order if any(p in s for s in per_run.values())] or order
    rows: list[LayerResult] = []
    with torch.no_grad():
        for p in precs:
            rows.extend(_results(p.name, per_run.get(p.name, {}), called))
    linear_of = {path: w for path, w in weights.values()}
    comparison.layers = tuple((p, int(linear_of[p].shape[1]), int(linear_of[p].shape[0])) for p in called if p in linear_of)
    comparison.rows = tuple(rows)
    comparison.losses = losses
    comparison.errors = errors
    comparison.backward = backward
    comparison.findings = _findings(comparison)
    comparison.seconds = time.perf_counter() - start
    return comparison


# -- findings -------------------------------------------------------------------------------------


def _findings(c: Comparison) -> list[Finding]:
    """What the measurements make clear (a finding per precision, listing the layers)."""
    out: list[Finding] = []
    ref_loss = c.losses.get(c.reference, math.nan)
    for p in c.precisions:
        loss = c.losses.get(p, math.nan)
        if math.isfinite(ref_loss) and not math.isfinite(loss) and p not in c.errors:
            hint = " (past fp16's range: scale the loss with a GradScaler or use bf16)" if p == "fp16" else ""
            out.append(
                Finding(
                    "low-precision-loss-nonfinite",
                    "warning",
                    c.model,
                    f"under {p} emulation the loss is {loss} where {c.reference} gives {ref_loss:.4g}{hint}",
                    {"precision": p, "loss": loss, "reference_loss": ref_loss},
                )
            )
        if p not in _FP8_FAMILY:
            continue
        bad = [
            r
            for r in c.rows
            if r.precision == p and max(r.act_underflow_pct, r.grad_underflow_pct) > underflow_limit(p)
        ]
        if bad:
            worst = max(bad, key=lambda r: max(r.act_underflow_pct, r.grad_underflow_pct))
            share = max(worst.act_underflow_pct, worst.grad_underflow_pct)
            what = "activations" if worst.act_underflow_pct >= worst.grad_underflow_pct else "output gradients"
            layers = f"{len(bad)} Linear layer{'s lose' if len(bad) != 1 else ' loses'}"
            out.append(
                Finding(
                    f"{p}-layer-underflows",
                    # fp4 loses a share of every block by design: said, not warned; an 8-bit format losing >1% is harm.
                    "info" if p == "nvfp4" else "warning",
                    c.model if worst.module == "(model)" else f"{c.model}.{worst.module}",
                    f"under {p}, {layers} more than {underflow_limit(p):g}% "
                    f"of {'its' if len(bad) == 1 else 'their'} nonzero inputs or gradients to zero (worst: {worst.module}, {share:.1f}% of its {what}); "
                    f"keep {'it' if len(bad) == 1 else 'them'} in higher precision: comparison.recommend({p!r}).code",
                    {"precision": p, "layers": [r.module for r in bad], "worst_pct": share},
                )
            )
    return out
