"""What :func:`mpdoctor.compare` measures per layer and what the measurements make clear.

- :class:`LayerResult`: one Linear, or one attention matmul, under one precision: the SQNR of its output and
  of its weight gradient against the same matmul in float32 on the same inputs (the layer's *own* error),
  and the shares of its nonzero input activations that underflow or saturate and of its nonzero output
  gradients that underflow.
- :func:`layer_results`: the rows of one run, from its :class:`~mpdoctor.attach.emulation.matmuls.LayerStats`.
- :func:`findings`: a finding per precision whose loss went non-finite or whose layers lose inputs or
  gradients to zero.
- The thresholds these judgements (and ``recommend()``) use, calibrated on this CPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ...rules.engine.findings import Finding
from .matmuls import LayerStats
from .sites import QK_LABEL

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
KEEP_BELOW_DB = {"bf16": 40.0, "fp16": 58.0, "fp8": 16.0, "fp8-rowwise": 18.0, "mxfp8": 15.0, "mxfp8-rceil": 15.0, "nvfp4": 8.0}
#: Dims real kernels need: float8 GEMMs (cuBLAS / torch._scaled_mm) want multiples of 16; block formats their block.
KERNEL_MULTIPLE = {"fp8": 16, "fp8-rowwise": 16, "mxfp8": 32, "mxfp8-rceil": 32, "nvfp4": 16}
FP8_FAMILY = ("fp8", "fp8-rowwise", "mxfp8", "mxfp8-rceil", "nvfp4")


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

    @property
    def lost_pct(self) -> float:
        """The larger of the shares of nonzero inputs and of nonzero output gradients lost to zero."""
        return max(self.act_underflow_pct, self.grad_underflow_pct)


def underflow_limit(name: str) -> float:
    """The underflow share (percent) above which a layer is flagged under precision ``name``."""
    return UNDERFLOW_PCT.get(name, DEFAULT_UNDERFLOW_PCT)


def below(value: float, floor: float) -> bool:
    """``value`` is a number under ``floor`` (NaN, a missing measurement, is never below)."""
    return isinstance(value, float) and not math.isnan(value) and value < floor


def sqnr_db(pairs: list[torch.Tensor]) -> float:
    """SQNR in dB of summed ``[signal power, noise power]`` pairs (NaN when none or non-finite)."""
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


def layer_results(name: str, stats: Mapping[str, LayerStats], order: Sequence[str], attention: Mapping) -> list[LayerResult]:
    """The rows of the run of precision ``name``, in ``order`` (attention rows are the labels in ``attention``)."""
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
                out_sqnr_db=sqnr_db(s.out),
                wgrad_sqnr_db=sqnr_db(s.wgrad),
                act_underflow_pct=_pct(act[1], act[0]),
                act_saturation_pct=_pct(act[2], act[0]),
                grad_underflow_pct=_pct(grad[1], grad[0]),
                calls=s.calls,
                kind="attention" if path in attention else "linear",
            )
        )
    return rows



# -- findings -------------------------------------------------------------------------------------


def findings(model: str, reference: str, precisions: Sequence[str], losses: Mapping[str, float],
             errors: Mapping[str, str], rows: Sequence[LayerResult]) -> list[Finding]:  # fmt: skip
    """What the measurements make clear: a finding per precision, listing the layers."""
    out: list[Finding] = []
    ref_loss = losses.get(reference, math.nan)
    for p in precisions:
        loss = losses.get(p, math.nan)
        if math.isfinite(ref_loss) and not math.isfinite(loss) and p not in errors:
            out.append(_nonfinite_loss(model, reference, p, loss, ref_loss))
        if p not in FP8_FAMILY:
            continue
        lossy = [r for r in rows if r.precision == p and r.lost_pct > underflow_limit(p)]
        linear = [r for r in lossy if r.kind != "attention"]
        if linear:
            out.append(_layer_underflow(model, p, linear))
        attention = [r for r in lossy if r.kind == "attention"]
        if attention:
            out.append(_attention_underflow(model, p, attention))
    return out


def _nonfinite_loss(model: str, reference: str, p: str, loss: float, ref_loss: float) -> Finding:
    hint = " (past fp16's range: scale the loss with a GradScaler or use bf16)" if p == "fp16" else ""
    return Finding(
        "low-precision-loss-nonfinite",
        "warning",
        model,
        f"under {p} emulation the loss is {loss} where {reference} gives {ref_loss:.4g}{hint}",
        {"precision": p, "loss": loss, "reference_loss": ref_loss},
    )


def _where(model: str, path: str) -> str:
    return model if path == "(model)" else f"{model}.{path}"


def _layer_underflow(model: str, p: str, rows: list[LayerResult]) -> Finding:
    """Linear layers losing inputs or gradients under ``p``: a warning for 8-bit formats, info for NVFP4."""
    worst = max(rows, key=lambda r: r.lost_pct)
    what = "activations" if worst.act_underflow_pct >= worst.grad_underflow_pct else "output gradients"
    one = len(rows) == 1
    layers = f"{len(rows)} Linear layer{' loses' if one else 's lose'}"
    return Finding(
        f"{p}-layer-underflows",
        # fp4 loses a share of every block by design: said, not warned; an 8-bit format losing >1% is harm.
        "info" if p == "nvfp4" else "warning",
        _where(model, worst.module),
        f"under {p}, {layers} more than {underflow_limit(p):g}% "
        f"of {'its' if one else 'their'} nonzero inputs or gradients to zero (worst: {worst.module}, {worst.lost_pct:.1f}% of its {what}); "
        f"keep {'it' if one else 'them'} in higher precision: comparison.recommend({p!r}).code",
        {"precision": p, "layers": [r.module for r in rows], "worst_pct": worst.lost_pct},
    )


def _attention_underflow(model: str, p: str, rows: list[LayerResult]) -> Finding:
    """Attention matmuls losing inputs or gradients under ``p``: info, as no float8 / MX training recipe
    runs attention in ``p`` (torchao converts nn.Linear only); it is what an fp8 attention kernel would lose."""
    worst = max(rows, key=lambda r: r.lost_pct)
    operand = "queries" if worst.module.endswith(f"[{QK_LABEL}]") else "probabilities"
    what = operand if worst.act_underflow_pct >= worst.grad_underflow_pct else "output gradients"
    path = worst.module.rsplit(" [", 1)[0]
    many = len(rows) != 1
    return Finding(
        f"{p}-attention-underflows",
        "info",
        _where(model, path),
        f"under {p}, {len(rows)} attention matmul{'s lose' if many else ' loses'} more than {underflow_limit(p):g}% of "
        f"{'their' if many else 'its'} nonzero inputs or gradients to zero (worst: {worst.module}, {worst.lost_pct:.1f}% of its {what}); "
        f"it matters only where attention itself runs in {p} (an fp8 attention kernel): torchao's float8 and MX "
        f"recipes convert nn.Linear only and leave attention in high precision",
        {"precision": p, "matmuls": [r.module for r in rows], "worst_pct": worst.lost_pct},
    )
