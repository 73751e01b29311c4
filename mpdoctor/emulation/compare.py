"""``compare(model, batch)``: what bf16, fp16, fp8, MXFP8 and NVFP4 would do to this model, layer by layer.

One forward and one backward of the live model per precision, on its own device
(the CPU included), each next to a reference run. Low precision is emulated
through a :class:`torch.overrides.TorchFunctionMode` (the matmuls themselves:
:mod:`mpdoctor.emulation.matmuls`):

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
precision says (:mod:`mpdoctor.emulation.formats`), along that matmul's
contraction dim, and multiplied with float32 accumulation; everything else
(norms, activations, the loss) runs in the model's own dtype.
``Comparison.reached`` says exactly what a run reached and what it could not.

The module tree is never touched: no module gets a hook and none is swapped. To
name the attention module whose matmuls run, one process-wide module forward
pre-hook and one forward hook (``torch.nn.modules.module.register_module_forward_pre_hook``,
``register_module_forward_hook(always_call=True)``) are registered for the
length of each emulated forward and removed in a ``finally``, also when the run
raises.

Per layer and precision it measures, on the inputs the layer really sees in that
run: the SQNR of its output and of its weight gradient against the same matmul in
float32 (the layer's *own* error, so a bad layer is not hidden by the errors of
the layers before it), and the shares of the nonzero input activations that
underflow to zero or saturate, and of the nonzero output gradients that
underflow. The loss of each run, next to the reference loss, is the end-to-end
effect.

The model is left exactly as it was: weights, buffers, ``.grad``, RNG state,
train/eval flags and hooks, module and global (each run starts from the same RNG
state, so dropout masks are identical across precisions; the decomposed SDPA
draws its dropout mask as torch's own does on this CPU). Batches and losses are
handled as in :func:`mpdoctor.probe`.
"""

from __future__ import annotations

import math
import re
import threading
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from ..numerics.probe import _call, _first_line, _loss_of, _Snapshot, _to_device
from ..numerics.probe_facts import ForwardCall
from ..treatment.findings import Finding
from .formats import PRECISIONS, Precision, precision
from .matmuls import EmulatedLinear, LayerStats, emulated_matmul, emulated_sdpa

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
#: fp8 ~ 29 out / 25 wgrad with e5m2, rowwise ~ 29, MXFP8 ~ 25, NVFP4 ~ 17 dB; tests/test_compare.py). Attention's
#: matmuls on Gaussian q, k, v land in the same ranges (tests/test_compare_attention.py); recommend() keeps Linears only.
KEEP_BELOW_DB = {"bf16": 40.0, "fp16": 58.0, "fp8": 16.0, "fp8-rowwise": 18.0, "mxfp8": 15.0, "nvfp4": 8.0}
#: Dims real kernels need: float8 GEMMs (cuBLAS / torch._scaled_mm) want multiples of 16; block formats their block.
KERNEL_MULTIPLE = {"fp8": 16, "fp8-rowwise": 16, "mxfp8": 32, "nvfp4": 16}
_FP8_FAMILY = ("fp8", "fp8-rowwise", "mxfp8", "nvfp4")


# -- where the emulation happens ----------------------------------------------------------------

#: The labels of the two attention matmuls, appended to the attention module's path in the rows.
QK_LABEL = "q·kᵀ"
PV_LABEL = "p·v"
#: Matmuls an eager attention writes by hand (``torch.matmul(q, k.transpose(2, 3))``, ``q @ k.mT``, ``bmm``).
_MATMULS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm})
_BADDBMM = frozenset({torch.baddbmm, torch.Tensor.baddbmm})
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_ATTENTION_NAME = re.compile("attn|attention", re.IGNORECASE)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def attention_label(path: str, which: str) -> str:
    """The row label of one attention matmul: ``model.layers.0.self_attn [q·kᵀ]`` (``which``: QK_LABEL or PV_LABEL)."""
    return f"{path} [{which}]"


def is_attention_module(module: torch.nn.Module, path: str) -> bool:
    """Whether a module reads as attention: its class name or its own name holds "attn" or "attention".

    ``LlamaAttention``, ``MultiheadAttention``, ``GPT2Attention``, ``BertSelfAttention``, ``self_attn``, ``attn``.
    Only matmuls inside such a module's own forward are taken for eager attention's.
    """
    return bool(_ATTENTION_NAME.search(type(module).__name__) or _ATTENTION_NAME.search(path.rsplit(".", 1)[-1]))


class _RunningModules:
    """Which module's forward is running, for the length of one emulated run.

    One process-wide module forward pre-hook and one forward hook (``always_call=True``, so a forward
    that raises pops too), registered on entry and removed on exit, also when the run raises; no module
    of the model gets a hook. Only the thread that entered is tracked.
    """

    def __init__(self, modules: dict[int, tuple[str, torch.nn.Module]]) -> None:
        self.modules = modules
        self.stack: list[list] = []  # [module, attention matmuls seen in this call]
        self._handles: list = []
        self._thread = 0

    def __enter__(self) -> _RunningModules:
        from torch.nn.modules import module as nn_module

        self._thread = threading.get_ident()
        self.stack.clear()
        try:
            self._handles.append(nn_module.register_module_forward_pre_hook(self._enter))
            self._handles.append(nn_module.register_module_forward_hook(self._exit, always_call=True))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        while self._handles:
            self._handles.pop().remove()
        self.stack.clear()

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() == self._thread:
            self.stack.append([module, 0])

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] is module:
                del self.stack[i:]
                return

    def path(self) -> str:
        """The path of the innermost running module of the model (``(model)`` when none runs)."""
        for module, _ in reversed(self.stack):
            hit = self.modules.get(id(module))
            if hit is not None and hit[1] is module:
                return hit[0]
        return "(model)"

    def attention_call(self) -> list | None:
        """The innermost running module's entry when it is an attention module of the model, else None."""
        if not self.stack:
            return None
        entry = self.stack[-1]
        hit = self.modules.get(id(entry[0]))
        if hit is None or hit[1] is not entry[0] or not is_attention_module(entry[0], hit[0]):
            return None
        return entry


def _sdpa_arguments(args: tuple, kwargs: dict) -> dict | None:
    """SDPA's arguments by name when they are ones the emulation decomposes exactly, else None."""
    if len(args) > len(_SDPA_ARGS) or any(k not in _SDPA_ARGS for k in kwargs):
        return None
    bound = {**dict(zip(_SDPA_ARGS, args)), **kwargs}
    q, k, v = bound.get("query"), bound.get("key"), bound.get("value")
    mask = bound.get("attn_mask")
    if not all(type(t) in _PLAIN and not t.is_nested and t.is_floating_point() and t.dim() >= 2 for t in (q, k, v)):
        return None
    if not (q.dtype == k.dtype == v.dtype) or q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        return None
    if mask is not None and (type(mask) not in _PLAIN or not (mask.dtype == torch.bool or mask.is_floating_point())):
        return None
    if mask is not None and bound.get("is_causal"):
        return None  # SDPA refuses both: let it say so
    if not isinstance(bound.get("dropout_p", 0.0), (int, float)):
        return None
    return bound


def _activation(t: Any) -> bool:
    """A batched activation: a plain floating tensor of 3+ dims (a Parameter is a weight, not attention)."""
    return type(t) is torch.Tensor and t.is_floating_point() and t.dim() >= 3


def _unchecked_mha() -> Callable:
    """``F.multi_head_attention_forward`` without its own ``__torch_function__`` check at its entrance.

    A mode sees only the outermost function of a Python-level composite; re-entered around this copy,
    the mode also sees the in-projection, SDPA (or bmm) and out-projection calls inside it.
    """
    func = torch.nn.functional.multi_head_attention_forward
    scope = dict(func.__globals__)
    scope["has_torch_function"] = lambda *args: False
    clone = types.FunctionType(func.__code__, scope, func.__name__, func.__defaults__, func.__closure__)
    clone.__kwdefaults__ = func.__kwdefaults__
    return clone


class _Emulation(TorchFunctionMode):
    """Routes the model's matmuls through the emulated ones (:mod:`mpdoctor.emulation.matmuls`).

    ``F.linear`` on the model's Linear weights, ``F.scaled_dot_product_attention`` (decomposed), and
    ``torch.matmul`` / ``bmm`` / ``baddbmm`` / ``@`` between two activations inside an attention module's
    own forward (eager attention: the first of each pair is q·kᵀ, the second p·v).
    """

    def __init__(
        self,
        weights: dict[int, tuple[str, torch.Tensor]],
        prec: Precision,
        modules: dict[int, tuple[str, torch.nn.Module]] | None = None,
    ) -> None:
        super().__init__()
        self.weights = weights
        self.prec = prec
        self.stats: dict[str, LayerStats] = {}
        #: attention row label -> (module path, QK_LABEL or PV_LABEL), in call order.
        self.attention: dict[str, tuple[str, str]] = {}
        self.running = _RunningModules(modules or {})
        self._mha: Callable | None = None

    def _stats(self, key: str) -> LayerStats:
        stats = self.stats.get(key)
        if stats is None:
            stats = self.stats[key] = LayerStats()
        return stats

    def _attention_stats(self, path: str, which: str) -> LayerStats:
        label = attention_label(path, which)
        self.attention.setdefault(label, (path, which))
        return self._stats(label)

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
                and (bias is None or type(bias) in _PLAIN)
            ):
                return EmulatedLinear.apply(x, weight, bias, self.prec, self._stats(hit[0]))
        elif func is torch.nn.functional.scaled_dot_product_attention:
            bound = _sdpa_arguments(args, kwargs)
            if bound is not None:
                path = self.running.path()
                scores, mix = self._attention_stats(path, QK_LABEL), self._attention_stats(path, PV_LABEL)
                return emulated_sdpa(**bound, prec=self.prec, scores=scores, mix=mix)
        elif func in _MATMULS or func in _BADDBMM:
            emulated = self._eager_matmul(func, args, kwargs)
            if emulated is not None:
                return emulated
        elif func is torch.nn.functional.multi_head_attention_forward:
            if self._mha is None:
                self._mha = _unchecked_mha()
            with self:  # re-entered: its inner linear, SDPA and bmm calls reach this mode
                return self._mha(*args, **kwargs)
        return func(*args, **kwargs)

    def _eager_matmul(self, func, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """An attention matmul written by hand, emulated; None when the call is not one."""
        if kwargs.get("out") is not None:
            return None
        if func in _BADDBMM:
            if len(args) != 3 or set(kwargs) - {"beta", "alpha"}:
                return None
            base, a, b = args
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            if type(base) is not torch.Tensor or not isinstance(beta, (int, float)) or not isinstance(alpha, (int, float)):
                return None
        else:
            if len(args) != 2 or kwargs:
                return None
            (a, b), base, beta, alpha = args, None, 0, 1
        if not (_activation(a) and _activation(b) and a.dtype == b.dtype and a.shape[-1] == b.shape[-2]):
            return None
        entry = self.running.attention_call()
        if entry is None:
            return None
        which = QK_LABEL if entry[1] % 2 == 0 else PV_LABEL
        entry[1] += 1
        y = emulated_matmul(a, b, self.prec, self._attention_stats(self.running.path(), which))
        if alpha != 1:
            y = y * alpha
        if base is not None and beta != 0:
            y = y + (base.to(torch.float32) if beta == 1 else beta * base.to(torch.float32))
        return y.to(a.dtype)


# -- results ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerResult:
    """One Linear, or one attention matmul, under one precision (a row of :meth:`Comparison.to_frame`)."""

    module: str
    precision: str
    out_sqnr_db: float
    wgrad_sqnr_db: float
    act_underflow_pct: float
    act_saturation_pct: float
    grad_underflow_pct: float
    calls: int = 1
    #: ``"linear"`` or ``"attention"`` (one of an attention module's two matmuls, labelled by :func:`attention_label`).
    kind: str = "linear"


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
    _skip_display_in: int | None = field(default=None, repr=False, compare=False)

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

        Attention rows (q·kᵀ, p·v) are never kept nor converted: they are no module a torchao
        ``module_filter_fn`` can name, and torchao's float8 and MX training recipes convert ``nn.Linear``
        only, so attention stays in high precision under them anyway. The code says so when the
        comparison has attention rows; the rows tell what an fp8 attention kernel would do.
        """
        prec = precision(precision_name)
        name = prec.name
        if name not in self.precisions:
            raise ValueError(f"{name} was not compared; compare(..., precisions=(..., {name!r}))")
        floor = KEEP_BELOW_DB.get(name, 0.0) if min_sqnr_db is None else min_sqnr_db
        under = underflow_limit(name) if max_underflow_pct is None else max_underflow_pct
        reasons: dict[str, str] = {}
        for path, fin, fout in self.layers:  # Linears only: attention rows cannot go into a module filter
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
        return Recommendation(name, keep, reasons, _code_for(name, keep, bool(self.attention)), converted)


def underflow_limit(name: str) -> float:
    """The underflow share (percent) above which a layer is flagged under precision ``name``."""
    return UNDERFLOW_PCT.get(name, DEFAULT_UNDERFLOW_PCT)


def _below(value: float, floor: float) -> bool:
    return isinstance(value, float) and not math.isnan(value) and value < floor


def _code_for(name: str, keep: tuple[str, ...], attention: bool = False) -> str:
    """torchao 0.18 code converting every Linear except ``keep`` (names as torchao passes them: fqn)."""
    keep_line = f"keep = {set(keep)!r}" if keep else "keep = set()"
    note = (
        "# attention's q·kᵀ and p·v are not converted: the recipe converts nn.Linear only, so attention\n"
        "# stays in high precision (compare's attention rows show what an fp8 attention kernel would do)\n"
        if attention
        else ""
    )
    filt = (
        note + f"{keep_line}  # measured by mpdoctor.compare: stay in high precision\n\n"
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
    if attention:
        body += f"# autocast runs attention (SDPA, its matmuls) in {dtype} too: compare's attention rows measured that\n"
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
            # The module tracker's global hooks come off when the forward ends, also when it raises.
            with mode.running, mode:
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


def _results(name: str, stats: dict[str, LayerStats], order: list[str], attention: Mapping) -> list[LayerResult]:
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
                kind="attention" if path in attention else "linear",
            )
        )
    return rows


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
    per_run: dict[str, dict[str, LayerStats]] = {}
    attention: dict[str, tuple[str, str]] = {}
    modules = {id(m): (path or "(model)", m) for path, m in model.named_modules()}
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
            mode = None if plain else _Emulation(weights, prec, modules)
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
                if mode is not None:
                    order = list(mode.stats)
                    attention.update(mode.attention)
                continue
            losses[prec.name] = value
            per_run[prec.name] = mode.stats
            attention.update(mode.attention)
    finally:
        snapshot.restore()
    # Call order: Linears and attention matmuls interleaved as the forward met them, in any run.
    seen = list(dict.fromkeys([*order, *(k for s in per_run.values() for k in s)]))
    called = [p for p in seen if any(p in s for s in per_run.values())] or order or [p for p, _ in weights.values()]
    rows: list[LayerResult] = []
    with torch.no_grad():
        for p in precs:
            rows.extend(_results(p.name, per_run.get(p.name, {}), called, attention))
    linear_of = {path: w for path, w in weights.values()}
    comparison.layers = tuple((p, int(linear_of[p].shape[1]), int(linear_of[p].shape[0])) for p in called if p in linear_of)
    comparison.attention = tuple((label, *attention[label]) for label in called if label in attention)
    comparison.reached = _reached(len(comparison.layers), comparison.attention)
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
        lossy = [r for r in c.rows if r.precision == p and max(r.act_underflow_pct, r.grad_underflow_pct) > underflow_limit(p)]
        bad = [r for r in lossy if r.kind != "attention"]
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
        attn = [r for r in lossy if r.kind == "attention"]
        if attn:
            out.append(_attention_underflow(c, p, attn))
    return out


def _attention_underflow(c: Comparison, p: str, rows: list[LayerResult]) -> Finding:
    """Attention matmuls losing inputs or gradients under ``p``: info, as no float8 / MX training recipe
    runs attention in ``p`` (torchao converts nn.Linear only); it is what an fp8 attention kernel would lose."""
    worst = max(rows, key=lambda r: max(r.act_underflow_pct, r.grad_underflow_pct))
    share = max(worst.act_underflow_pct, worst.grad_underflow_pct)
    operand = "queries" if worst.module.endswith(f"[{QK_LABEL}]") else "probabilities"
    what = operand if worst.act_underflow_pct >= worst.grad_underflow_pct else "output gradients"
    path = worst.module.rsplit(" [", 1)[0]
    many = len(rows) != 1
    return Finding(
        f"{p}-attention-underflows",
        "info",
        c.model if path == "(model)" else f"{c.model}.{path}",
        f"under {p}, {len(rows)} attention matmul{'s lose' if many else ' loses'} more than {underflow_limit(p):g}% of "
        f"{'their' if many else 'its'} nonzero inputs or gradients to zero (worst: {worst.module}, {share:.1f}% of its {what}); "
        f"it matters only where attention itself runs in {p} (an fp8 attention kernel): torchao's float8 and MX "
        f"recipes convert nn.Linear only and leave attention in high precision",
        {"precision": p, "matmuls": [r.module for r in rows], "worst_pct": share},
    )
