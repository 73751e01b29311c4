"""The emulated matmuls of :func:`mpdoctor.compare`: a Linear, ``a @ b`` between activations, and SDPA decomposed.

Each quantizes both operands of each of its matmuls as a :class:`~mpdoctor.attach.emulation.formats.Precision`
says, along that matmul's contraction dimension, and multiplies with float32 accumulation; the backward
matmuls do the same with the output gradient in the precision's gradient format (e5m2 for tensorwise
fp8, MX blocks along each backward matmul's own contraction dim). Each also records, in a
:class:`LayerStats`, its error against the same matmul in float32 on the same inputs (``stats=None``: only
run, nothing measured, as a plan's verification runs them). The float32 reference of a large matmul is
computed for every k-th row of its output only (:func:`sampled`: at least :data:`MEASURED_ROWS` rows), an
estimate of the SQNR from over a hundred thousand values at a fraction of a matmul's cost.

- :class:`EmulatedLinear`: ``F.linear`` (output, input gradient, weight gradient).
- :class:`EmulatedMatmul`: ``a @ b`` of two batched activations ``(..., M, K) @ (..., K, N)``: the
  attention matmuls. Its "weight gradient" is the gradient of ``b`` (``aᵀ @ g``, contracted over
  ``M``), the matmul in the role a Linear's weight gradient has.
- :func:`emulated_sdpa`: ``F.scaled_dot_product_attention`` as the math it stands for: scores =
  ``q @ kᵀ`` (an :class:`EmulatedMatmul`, contracted over the head dim, kept in float32 as fused
  kernels keep them) times the scale, plus the mask
  (bool, float or causal), a float32 softmax (as fp8 attention kernels keep it; a row masked
  everywhere gives zeros, as torch's SDPA does), dropout, then ``p @ v`` (an :class:`EmulatedMatmul`,
  contracted over the key length). GQA repeats key and value heads as torch's math path does.
"""

from __future__ import annotations

import math

import torch

from .formats import Precision, Quantized


class LayerStats:
    """Sums of one emulated matmul site's measurements in one run, kept as 0-d tensors until the run ends."""

    __slots__ = ("calls", "out", "wgrad", "act", "grad")

    def __init__(self) -> None:
        self.calls = 0
        self.out: list[torch.Tensor] = []  # [signal power, noise power] per call
        self.wgrad: list[torch.Tensor] = []
        self.act: list[torch.Tensor] = []  # [nonzero, underflow, saturated]
        self.grad: list[torch.Tensor] = []  # [nonzero, underflow]


#: Rows of a matmul's output (and of a weight gradient) its float32 reference is computed for, at least: a
#: larger matmul is measured on every k-th row (evenly strided), so the reference costs ~1/k of a matmul.
MEASURED_ROWS = 128


def sampled(n: int) -> slice:
    """Every k-th of ``n`` rows, k = n // MEASURED_ROWS (all rows when n < 2 * MEASURED_ROWS)."""
    return slice(None, None, max(1, n // MEASURED_ROWS))


def power(exact: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """[signal power, noise power] of ``got`` against ``exact``: two fused norms, no squared temporaries."""
    norms = torch.stack([torch.linalg.vector_norm(exact), torch.linalg.vector_norm(got - exact)]).double()
    return norms.square()


def quantize_along(prec: Precision, x: torch.Tensor, dim: int, grad: bool = False, count: bool = True) -> Quantized:
    """Quantize an N-D float32 ``x`` as an operand contracted over ``dim``.

    Scales that ignore the contraction dim (casts; tensorwise fp8: one scale for the whole tensor) take
    ``x`` as it is; per-row and block formats see it as the 2-D matrix ``(everything else, x.shape[dim])``.
    """
    if not prec.along_contraction:
        return prec.quantize(x, dim, grad, count)
    moved = x.movedim(dim, -1)
    q = prec.quantize(moved.reshape(-1, moved.shape[-1]), 1, grad, count)
    return Quantized(q.values.reshape(moved.shape).movedim(-1, dim), q.nonzero, q.underflow, q.saturated)


class EmulatedLinear(torch.autograd.Function):
    """``F.linear`` with both operands of each of its three matmuls quantized, float32 accumulation."""

    @staticmethod
    def forward(ctx, x, weight, bias, prec: Precision, stats: LayerStats | None):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.prec, ctx.stats, ctx.has_bias = prec, stats, bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        k = x.shape[-1]
        x2 = x.reshape(-1, k).to(torch.float32)
        w = weight.to(torch.float32)
        measured = stats is not None
        qx = prec.quantize(x2, 1, count=measured)
        qw = prec.quantize(w, 1, count=False)
        # Scales that ignore the contraction dim give the backward matmuls the very same operands: keep them.
        ctx.reuse = None if prec.along_contraction else (qx.values, qw.values)
        y = qx.values @ qw.values.t()
        if bias is not None:
            y.add_(bias.to(torch.float32))  # in place: y is the matmul's own fresh output
        y = prec.round_output(y)
        if measured:
            rows = sampled(x2.shape[0])
            exact = x2[rows] @ w.t()
            if bias is not None:
                exact = exact + bias.to(torch.float32)
            stats.calls += 1
            stats.out.append(power(exact, y[rows]))
            stats.act.append(torch.stack([qx.nonzero, qx.underflow, qx.saturated]))
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        prec: Precision = ctx.prec
        stats: LayerStats | None = ctx.stats
        n = grad.shape[-1]
        g2 = grad.reshape(-1, n).to(torch.float32)
        w = weight.to(torch.float32)
        qg = prec.quantize(g2, 1, grad=True, count=stats is not None)
        if stats is not None:
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
            if stats is not None:
                rows = sampled(gw32.shape[0])
                stats.wgrad.append(power(g2[:, rows].t() @ x2, gw32[rows]))
            gw = gw32.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = (qg.values if prec.rounds_output else g2).sum(0).to(ctx.bias_dtype)
        return gx, gw, gb, None, None


class EmulatedMatmul(torch.autograd.Function):
    """``a @ b`` of two activations, ``(..., M, K) @ (..., K, N)`` with equal batch dims, emulated; float32 out.

    Forward ``a @ b`` contracts over ``K``; backward ``g @ bᵀ`` over ``N`` and ``aᵀ @ g`` over ``M``, each
    with both operands quantized along that matmul's own contraction dim (the output gradient ``g`` in
    the precision's gradient format). ``stats.wgrad`` measures the gradient of ``b``. ``rounds`` False keeps
    the output in float32 where the precision would round it (a fused attention kernel's scores).
    """

    @staticmethod
    def forward(ctx, a, b, prec: Precision, stats: LayerStats | None, rounds: bool = True):  # type: ignore[override]
        ctx.save_for_backward(a, b)
        ctx.prec, ctx.stats = prec, stats
        a32, b32 = a.to(torch.float32), b.to(torch.float32)
        qa = quantize_along(prec, a32, -1, count=stats is not None)
        qb = quantize_along(prec, b32, -2, count=False)
        ctx.reuse = None if prec.along_contraction else (qa.values, qb.values)
        y = qa.values @ qb.values
        y = prec.round_output(y) if rounds else y
        if stats is not None:
            stats.calls += 1
            rows = sampled(a32.shape[-2])
            stats.out.append(power(a32[..., rows, :] @ b32, y[..., rows, :]))
            stats.act.append(torch.stack([qa.nonzero, qa.underflow, qa.saturated]))
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        a, b = ctx.saved_tensors
        prec: Precision = ctx.prec
        stats: LayerStats | None = ctx.stats
        g = grad.to(torch.float32)
        qg = quantize_along(prec, g, -1, grad=True, count=stats is not None)
        if stats is not None:
            stats.grad.append(torch.stack([qg.nonzero, qg.underflow]))
        reuse = ctx.reuse
        ctx.reuse = None
        ga = gb = None
        if ctx.needs_input_grad[0]:
            qb = reuse[1] if reuse is not None else quantize_along(prec, b.to(torch.float32), -1, count=False).values
            ga = prec.round_output(qg.values @ qb.transpose(-2, -1)).to(a.dtype)
        if ctx.needs_input_grad[1]:
            a32 = a.to(torch.float32)
            qg0 = quantize_along(prec, g, -2, grad=True, count=False) if prec.along_contraction else qg
            qa0 = reuse[0] if reuse is not None else quantize_along(prec, a32, -2, count=False).values
            gb32 = prec.round_output(qa0.transpose(-2, -1) @ qg0.values)
            if stats is not None:
                rows = sampled(gb32.shape[-2])
                stats.wgrad.append(power(a32[..., rows].transpose(-2, -1) @ g, gb32[..., rows, :]))
            gb = gb32.to(b.dtype)
        return ga, gb, None, None, None


def emulated_matmul(a: torch.Tensor, b: torch.Tensor, prec: Precision, stats: LayerStats | None, rounds: bool = True) -> torch.Tensor:
    """``a @ b`` (batch dims broadcast, as ``torch.matmul`` does) through :class:`EmulatedMatmul`; float32 out."""
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    # Expanded outside the Function: autograd sums the gradient back over the broadcast dims.
    a = a.expand(*batch, *a.shape[-2:])
    b = b.expand(*batch, *b.shape[-2:])
    return EmulatedMatmul.apply(a, b, prec, stats, rounds)


def emulated_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    prec: Precision,
    scores: LayerStats | None,
    mix: LayerStats | None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` decomposed, its two matmuls emulated (``scores``: q·kᵀ, ``mix``: p·v).

    The caller checks the arguments are ones SDPA accepts (same floating dtype, not both a mask and
    ``is_causal``). Returns the query's dtype.
    """
    dtype = query.dtype
    length, keys = query.shape[-2], key.shape[-2]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    if enable_gqa and key.dim() >= 3 and query.shape[-3] != key.shape[-3]:
        # As torch's math path: each key/value head serves a group of query heads.
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], -3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], -3)
    # Fused kernels (flash, CPU and GPU, fp8 FlashAttention-3) keep the scores in float32 up to the softmax:
    # under bf16/fp16 only the operands and p·v's output are rounded, as torch's SDPA under autocast does here.
    s = emulated_matmul(query, key.transpose(-2, -1), prec, scores, rounds=False) * scale
    masked: torch.Tensor | None = None
    if is_causal:
        # Top-left aligned, as SDPA's is_causal.
        masked = ~torch.ones(length, keys, dtype=torch.bool, device=s.device).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            masked = ~attn_mask
        else:
            s = s + attn_mask.to(torch.float32)
    if masked is not None:
        s = s.masked_fill(masked, -math.inf)
    if is_causal or attn_mask is not None:
        # A row masked everywhere gives zeros, as torch's SDPA does (not NaN), in value and gradient.
        dead = torch.isneginf(s).all(-1, keepdim=True)
        p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    else:
        p = torch.softmax(s, dim=-1)
    if dropout_p > 0.0:
        p = torch.dropout(p, dropout_p, True)
    return emulated_matmul(p, value, prec, mix).to(dtype)
