"""Number formats as quantizers: what bf16, fp16, fp8, MXFP8 and NVFP4 do to a tensor, on any device.

Each quantizer takes a float32 tensor and the dimension a matmul contracts over
and returns a :class:`Quantized`: the dequantized values (float32, what the
matmul really multiplies) and three counts, as 0-d tensors so that nothing
synchronises an accelerator: the nonzero elements, those of them that quantize
to zero (underflow) and those whose scaled magnitude passes the format's largest
finite value (saturation: clamped for e4m3 and e2m1, inf for fp16 and e5m2).

The semantics follow the reference implementations, bit for bit where torchao
has one (``tests/stack/test_compare_oracles.py`` checks them on the CPU):

- ``bf16`` / ``fp16``: round to nearest even, as autocast's casts do; fp16
  overflows to inf past 65504.
- ``fp8`` tensorwise (torchao's default float8 training recipe):
  ``scale = 448 / amax`` (float64 division, then float32; amax clamped at
  1e-12), ``x * scale`` saturated to +-448 and cast to e4m3; gradients in e5m2
  with ``57344 / amax``. Dequantized as ``fp8 / scale``.
- ``fp8-rowwise`` (torchao's ``rowwise`` recipe): one scale per row along the
  contraction dimension, rounded down to a power of two; e4m3 everywhere.
- ``mxfp8`` (OCP MX v1.0, torchao's ``to_mx`` with ``FLOOR`` scales): blocks of
  32 along the contraction dimension, a shared e8m0 scale
  ``2^(floor(log2(block amax)) - 8)``, e4m3 elements, saturated; gradients too.
- ``mxfp8-rceil``: MXFP8 with RCEIL scales (torchao's MX training recipes, NVIDIA's cuBLAS):
  ``2^ceil(log2(block amax / 448))``, so no element saturates; as torchao's
  ``to_mx(..., scaling_mode=ScaleCalculationMode.RCEIL)``, bit for bit.
- ``mxfp8-hybrid``: MXFP8 with e5m2 gradients (TransformerEngine's ``Format.HYBRID``): the gradient
  blocks' scale is ``2^(floor(log2(block amax)) - 15)``, as torchao's ``to_mx(x, torch.float8_e5m2, 32)``.
- ``nvfp4``: blocks of 16, an e4m3 block scale ``block amax / 6`` divided by a
  per-tensor float32 scale ``amax / (448 * 6)``, e2m1 elements (0, 0.5, 1,
  1.5, 2, 3, 4, 6) rounded to nearest even and saturated at 6. Gradients are
  rounded to nearest too (NVIDIA's recipe rounds them stochastically and
  applies a Hadamard transform first: neither is emulated).

A contraction dimension that is not a multiple of the block size is padded with
zeros for the emulation (zeros change no block maximum); real kernels refuse
such shapes, which ``recommend`` reports separately.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
E2M1_MAX = 6.0
#: The largest power of two e4m3 holds (2^8 = 256): MX scales put a block's amax at 2^8.
E4M3_MAX_POW2 = 8
#: The largest power of two e5m2 holds (2^15 = 32768): MX e5m2 elements put a block's amax at 2^15.
E5M2_MAX_POW2 = 15
#: torchao's floor on amax before ``448 / amax`` (float8_utils.EPS).
AMAX_EPS = 1e-12
_F32_MIN_NORMAL = torch.finfo(torch.float32).tiny
_E4M3_TINY = torch.finfo(E4M3).tiny
#: Relative margin past a format's max that float32 rounding of a scaled value alone can make (a few ulps).
_PAST_ROUNDING = 1.0 + 2.0**-20
#: A float32's exponent field and sign bit, as int32 masks.
_EXPONENT_BITS = 0x7F800000
_SIGN_BIT = -(2**31)


@dataclass(frozen=True)
class Quantized:
    """A quantized tensor, dequantized to float32, and what the quantization lost (0-d int64 counts)."""

    values: torch.Tensor
    nonzero: torch.Tensor
    underflow: torch.Tensor
    saturated: torch.Tensor


def _counts(x: torch.Tensor, q: torch.Tensor, over: torch.Tensor | None) -> Quantized:
    """``q`` with the counts of ``x``'s nonzeros and underflow; ``over`` is the saturated count (None: no counts)."""
    if over is None:  # counts not wanted (weights): skip four passes over the tensor
        zero = torch.zeros((), dtype=torch.int64, device=x.device)
        return Quantized(q, zero, zero, zero)
    # A zero quantizes to zero: the elements lost are the nonzeros of x less those of q (no mask allocated).
    nonzero = torch.count_nonzero(x)
    return Quantized(values=q, nonzero=nonzero, underflow=nonzero - torch.count_nonzero(q), saturated=over)


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` (0-d, NaN when ``x`` holds one) from one ``aminmax`` pass: on the CPU some thirty times
    faster than ``vector_norm(x, inf)`` and ``abs().max()``, and exactly their value."""
    if x.numel() == 0:  # aminmax refuses an empty tensor; vector_norm's max of nothing is 0
        return torch.zeros((), dtype=x.dtype, device=x.device)
    lo, hi = torch.aminmax(x)
    return torch.maximum(hi, lo.neg())


def _count_past(x: torch.Tensor, limit: float, top: torch.Tensor | None = None) -> torch.Tensor:
    """How many elements have ``|x| > limit`` (0-d int64); on the CPU one max first, as most tensors have none.

    ``top``: ``max |x|`` (per block or row) when the caller knows it: a scaled tensor's is its unscaled
    max times the positive scale (rounding is monotonic), so no pass over ``x`` reads it. Two comparisons
    counted: no ``|x|`` temporary, and ``count_nonzero`` is some four times faster than summing a bool
    mask (which converts it to int64 first).
    """
    if x.device.type == "cpu" and float(abs_max(x) if top is None else top.max()) <= limit:
        return torch.zeros((), dtype=torch.int64)  # reading a scalar costs no sync on the CPU
    return torch.count_nonzero(x > limit) + torch.count_nonzero(x < -limit)


# -- elementwise formats ---------------------------------------------------------------


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` (nearest even) and read back as float32."""
    return x.to(dtype).to(torch.float32)


def quantize_cast(x: torch.Tensor, dtype: torch.dtype, count: bool = True) -> Quantized:
    """Round to bf16 or fp16 as autocast does (no scale); past the format's max counts as saturated."""
    q = round_to(x, dtype)
    return _counts(x, q, _count_past(x, torch.finfo(dtype).max) if count else None)


#: Elements rounded per pass of :func:`round_mantissa_`: a chunk and its two int buffers (768 KiB) stay in
#: a core's L2 cache through the eight passes, where a whole activation would go to memory and back each time.
ROUND_CHUNK = 1 << 16


def round_mantissa_(v: torch.Tensor, mantissa: int, min_exp: int) -> torch.Tensor:
    """Round a float32 ``v`` in place to a float format of ``mantissa`` bits and smallest normal ``2^min_exp``.

    Nearest even, subnormals included, the sign of zero kept: the values the cast to such a format (e4m3:
    3 and -6; e5m2: 2 and -14; e2m1: 1 and 0) reads back as float32, bit for bit, for any ``v`` within the
    format's range (the caller saturates first). One magic-number add per element on ``|v|``: ``C =
    2^(e + 23 - mantissa)``, ``e`` the element's exponent (at least ``min_exp``), and ``(|v| + C) - C``
    leaves ``|v|`` rounded to the format's step at that exponent (float32 addition rounds to nearest even);
    the sign bit goes back on last, so a negative value that rounds to zero gives ``-0``. Six int and two
    float passes, no float8 conversion (torch's CPU cast to e4m3 is scalar and costs about three times as
    much), run chunk by chunk (:data:`ROUND_CHUNK`) with two reused int buffers.
    """
    if not v.is_contiguous():  # a strided view: one chunk, the passes on the view itself
        _round_chunk_(v.view(torch.int32), torch.empty_like(v, dtype=torch.int32),
                      torch.empty_like(v, dtype=torch.int32), mantissa, min_exp)  # fmt: skip
        return v
    # Flat: on a 3-D view (blocks) the same int passes run some eight times slower on the CPU.
    bits = v.view(-1).view(torch.int32)
    n = bits.numel()
    sign = torch.empty(min(n, ROUND_CHUNK), dtype=torch.int32, device=v.device)
    magic = torch.empty_like(sign)
    for start in range(0, n, ROUND_CHUNK):
        part = bits[start : start + ROUND_CHUNK]
        k = part.numel()
        _round_chunk_(part, sign[:k], magic[:k], mantissa, min_exp)
    return v


def _round_chunk_(bits: torch.Tensor, sign: torch.Tensor, magic: torch.Tensor, mantissa: int, min_exp: int) -> None:
    """:func:`round_mantissa_` on one chunk of float32 bits, in place; ``sign`` and ``magic`` are scratch."""
    torch.bitwise_and(bits, _SIGN_BIT, out=sign)
    bits.bitwise_xor_(sign)  # |v|, in place
    torch.bitwise_and(bits, _EXPONENT_BITS, out=magic)
    magic.clamp_(min=(min_exp + 127) << 23).add_((23 - mantissa) << 23)
    c = magic.view(torch.float32)
    bits.view(torch.float32).add_(c).sub_(c)
    bits.bitwise_or_(sign)  # the sign back, -0 included (a bitwise or: copysign is some three times slower)


def _round_fp8_(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A saturated float32 ``v`` rounded in place to e4m3 or e5m2 and read back as float32 (as ``.to(dtype)``)."""
    if dtype == E4M3:
        return round_mantissa_(v, 3, -6)
    return v.copy_(v.to(dtype))  # torch's e5m2 cast is vectorised: as fast as the magic add


# -- scaled fp8 -------------------------------------------------------------------------


def _fp8_max(dtype: torch.dtype) -> float:
    return E4M3_MAX if dtype == E4M3 else E5M2_MAX


def tensorwise_scale(x: torch.Tensor, dtype: torch.dtype = E4M3, amax: torch.Tensor | None = None) -> torch.Tensor:
    """torchao's tensorwise scale: ``fmax / max(amax, 1e-12)`` in float64, then float32 (0-d).

    ``amax``: ``max |x|`` when the caller has it (else one pass over ``x`` reads it).
    """
    top = (abs_max(x) if amax is None else amax).to(torch.float64)  # one pass, no |x| temporary
    return (_fp8_max(dtype) / torch.clamp(top, min=AMAX_EPS)).to(torch.float32)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = E4M3, count: bool = True,
                 amax: torch.Tensor | None = None) -> Quantized:  # fmt: skip
    """``x * scale`` saturated to the format's max, cast to ``dtype``, divided by ``scale`` again.

    ``amax``: ``max |x|`` (shaped as ``scale``) when the caller has it: the saturation count then reads
    ``max |x * scale|`` from it, not from a pass over the scaled tensor.
    """
    fmax = _fp8_max(dtype)
    scaled = x * scale
    # ``amax * (fmax / amax)`` lands an ulp past fmax in about one tensor of eight (the scale is rounded to
    # float32): the amax element is not saturated for that, so only a magnitude past rounding counts.
    top = None if amax is None else amax * scale
    over = _count_past(scaled, fmax * _PAST_ROUNDING, top) if count else None
    return _counts(x, _round_fp8_(scaled.clamp_(-fmax, fmax), dtype).div_(scale), over)


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype = E4M3, count: bool = True) -> Quantized:
    """Tensorwise dynamic float8 (scale = fmax / amax): torchao's ``hp_tensor_to_float8_dynamic``."""
    amax = abs_max(x)
    return quantize_fp8(x, tensorwise_scale(x, dtype, amax), dtype, count, amax)


def quantize_rowwise(x: torch.Tensor, dim: int, dtype: torch.dtype = E4M3, count: bool = True) -> Quantized:
    """One float8 scale per slice along ``dim`` (the contraction dim), rounded down to a power of two."""
    amax = block_amax(x, dim)
    scale = (_fp8_max(dtype) / torch.clamp(amax.to(torch.float64), min=AMAX_EPS)).to(torch.float32)
    scale = torch.exp2(torch.floor(torch.log2(scale)))
    return quantize_fp8(x, scale, dtype, count, amax)


# -- block formats ----------------------------------------------------------------------


def _blocks(x: torch.Tensor, dim: int, block: int) -> tuple[torch.Tensor, int, int]:
    """A 2-D ``x`` as blocks of ``block`` along ``dim`` (zero-padded to whole blocks), without a transpose.

    ``dim=1``: shape ``(rows, nblocks, block)``, reduce over axis 2; ``dim=0``: ``(nblocks, block, cols)``,
    reduce over axis 1. Returns the view, the axis to reduce over and the padding added.
    """
    if x.dim() != 2:
        raise ValueError(f"block formats quantize 2-D operands, not shape {tuple(x.shape)}")
    dim = dim % 2
    pad = (-x.shape[dim]) % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad) if dim == 1 else (0, 0, 0, pad))
    if dim == 1:
        return x.reshape(x.shape[0], -1, block), 2, pad
    return x.reshape(-1, block, x.shape[1]), 1, pad


def _unblock(q: torch.Tensor, dim: int, pad: int, shape: torch.Size) -> torch.Tensor:
    q = q.reshape(q.shape[0], -1) if dim % 2 == 1 else q.reshape(-1, q.shape[-1])
    return q[:, : shape[1]] if dim % 2 == 1 else q[: shape[0]]


def block_amax(b: torch.Tensor, axis: int) -> torch.Tensor:
    """``max |b|`` over ``axis`` (kept): the larger of the max and minus the min, no ``|b|`` temporary (a full
    pass and a fresh buffer saved); ``b.abs().amax(axis)``'s value, a zero's sign aside, which no scale reads."""
    return torch.maximum(b.amax(dim=axis, keepdim=True), b.amin(dim=axis, keepdim=True).neg_())


def mx_scale_bits(amax: torch.Tensor, max_pow2: int = E4M3_MAX_POW2) -> torch.Tensor:
    """The biased e8m0 exponent of each block: ``floor(log2(amax)) - max_pow2 + 127``, clamped, as int32.

    ``max_pow2`` is the element format's largest power of two (8 for e4m3, 15 for e5m2). Read from amax's
    float32 exponent bits, as torchao's ``to_mx`` does (``FLOOR`` mode).
    """
    exponent = ((amax.contiguous().view(torch.int32) >> 23) & 0xFF) - 127
    return torch.clamp(exponent - max_pow2, min=-127, max=128) + 127


def mx_rceil_scale_bits(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """The biased e8m0 exponent of each block under RCEIL: ``ceil(log2(amax / fmax)) + 127``, as int32.

    NVIDIA's cuBLAS rule and torchao's ``ScaleCalculationMode.RCEIL`` (``_to_mx_rceil``): the scale is the
    power of two at or above ``amax / fmax`` (float32 division), clamped to [-127, 127]; a NaN amax gives
    255, an infinite one 254.
    """
    descale = amax / fmax
    normal = torch.clamp(torch.ceil(torch.log2(descale)), min=-127, max=127) + 127
    return torch.where(torch.isnan(descale), 255, torch.where(torch.isinf(descale), 254, normal)).to(torch.int32)


#: MX block-scale rules: ``floor`` (OCP MX v1.0, torchao ``to_mx``'s default) and ``rceil`` (torchao's MX
#: training recipes, NVIDIA's cuBLAS).
MX_SCALE_MODES = ("floor", "rceil")


def quantize_mx(x: torch.Tensor, dim: int, dtype: torch.dtype = E4M3, block: int = 32, count: bool = True,
                scale_mode: str = "floor") -> Quantized:  # fmt: skip
    """MX block float8: blocks of ``block`` along ``dim``, e8m0 power-of-two scales, saturated elements.

    ``dtype`` is the element format: e4m3 (MXFP8 as NVIDIA's recipe runs it) or e5m2 (the gradients of an
    MXFP8 recipe in ``HYBRID`` format), each with its own largest power of two for the block scale.
    ``scale_mode``: ``"floor"`` puts a block's amax at the format's largest power of two (elements past
    the format's max saturate); ``"rceil"`` rounds ``amax / fmax`` up to a power of two (nothing saturates,
    a block's small elements lose up to one more bit), as torchao's ``to_mx(..., ScaleCalculationMode.RCEIL)``.
    """
    if scale_mode not in MX_SCALE_MODES:
        raise ValueError(f"unknown MX scale mode {scale_mode!r}: choose from {', '.join(MX_SCALE_MODES)}")
    x = x.to(torch.float32)
    b, axis, pad = _blocks(x, dim, block)
    amax = block_amax(b, axis)
    fmax = _fp8_max(dtype)
    if scale_mode == "rceil":
        biased = mx_rceil_scale_bits(amax, fmax)
        # torchao's reciprocal: 2^(127 - e); 1 for e = 0 (a zero block), 2^-127 for an inf amax, NaN for NaN.
        rcp = torch.where(biased == 0, 1.0, torch.exp2(127 - biased.to(torch.float32)))
        rcp = torch.where(biased == 254, 2.0**-127, rcp)
        rcp = torch.where(biased == 255, float("nan"), rcp)
        scaled = b * rcp
    else:
        biased = mx_scale_bits(amax, E5M2_MAX_POW2 if dtype == E5M2 else E4M3_MAX_POW2)
        scale = torch.clamp((biased << 23).view(torch.float32), min=_F32_MIN_NORMAL)
        # A power of two's reciprocal is exact (2^-127 to 2^126, 0 for an inf scale): the product is the
        # quotient bit for bit, and a multiply is several times cheaper than a divide.
        rcp = scale.reciprocal()
        scaled = b * rcp
    # Padding is zeros, never past the limit: the mask needs no unblocking to be counted. A block's
    # largest scaled magnitude is its amax scaled (rounding is monotonic): no pass over ``scaled``.
    over = _count_past(scaled, fmax, amax * rcp) if count else None
    # torchao's get_fp_scale: 2^(biased - 127), NaN for the e8m0 NaN encoding (a block holding NaN or inf).
    dequant_scale = torch.where(biased == 255, float("nan"), torch.exp2((biased - 127).to(torch.float32)))
    q = _round_fp8_(scaled.clamp_(-fmax, fmax), dtype).mul_(dequant_scale)
    return _counts(x, _unblock(q, dim, pad, x.shape), over)


def nvfp4_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """The per-tensor float32 scale of two-level NVFP4: ``amax / (448 * 6)`` (torchao ``per_tensor_amax_to_scale``)."""
    return abs_max(x).to(torch.float32) / (E4M3_MAX * E2M1_MAX)


def quantize_nvfp4(
    x: torch.Tensor, dim: int, block: int = 16, tensor_scale: torch.Tensor | None = None, count: bool = True
) -> Quantized:
    """NVFP4: blocks of 16 along ``dim``, e4m3 block scales under a per-tensor float32 scale, e2m1 elements."""
    x = x.to(torch.float32)
    if tensor_scale is None:
        tensor_scale = nvfp4_tensor_scale(x)
    # An all-zero tensor would divide by zero; its blocks quantize to zero whatever the scale.
    tensor_scale = torch.where(tensor_scale > 0, tensor_scale, torch.ones_like(tensor_scale))
    b, axis, pad = _blocks(x, dim, block)
    amax = block_amax(b, axis)
    block_scale = (amax / E2M1_MAX) / tensor_scale
    block_scale_fp8 = block_scale.clamp(min=_E4M3_TINY, max=E4M3_MAX).to(E4M3).to(torch.float32)
    reciprocal = (1.0 / tensor_scale) / block_scale_fp8
    scaled = b * reciprocal
    # Counted before the in-place saturation; a block's largest scaled magnitude is its amax scaled.
    over = _count_past(scaled, E2M1_MAX, amax * reciprocal) if count else None
    q = round_mantissa_(scaled.clamp_(-E2M1_MAX, E2M1_MAX), 1, 0).mul_(tensor_scale * block_scale_fp8)
    return _counts(x, _unblock(q, dim, pad, x.shape), over)


# -- precisions -------------------------------------------------------------------------


@dataclass(frozen=True)
class Precision:
    """How one precision quantizes the three operands of a Linear's three matmuls.

    Attributes
    ----------
    name : str
        The name ``compare`` takes (``"bf16"``, ``"fp8"``, ...).
    kind : str
        ``"cast"`` (bf16/fp16, no scale), ``"tensorwise"``, ``"rowwise"``, ``"mx"`` or ``"nvfp4"``.
    element : torch.dtype or None
        Element dtype of activations and weights (``None``: no quantization, the reference).
    grad_element : torch.dtype or None
        Element dtype of output gradients.
    block : int
        Block size along the contraction dimension (0: none).
    rounds_output : bool
        Whether each matmul's output is rounded to the format (autocast's bf16/fp16 matmuls return
        bf16/fp16; float8 and block-format matmuls return the high-precision dtype).
    summary : str
        One line for reports.
    scale_mode : str
        How an MX block scale is chosen (``"floor"`` or ``"rceil"``: :data:`MX_SCALE_MODES`); empty for the
        other kinds.
    """

    name: str
    kind: str
    element: torch.dtype | None
    grad_element: torch.dtype | None
    block: int
    rounds_output: bool
    summary: str
    scale_mode: str = ""

    def quantize(self, x: torch.Tensor, dim: int, grad: bool = False, count: bool = True) -> Quantized:
        """Quantize ``x`` (float32) as an operand contracted over ``dim``; ``grad`` for output gradients.

        ``count=False`` skips the underflow and saturation counts (they come back as zeros).
        """
        dtype = self.grad_element if grad else self.element
        if self.kind == "reference" or dtype is None:
            zero = torch.zeros((), dtype=torch.int64, device=x.device)
            return Quantized(x, zero, zero, zero)
        if self.kind == "cast":
            return quantize_cast(x, dtype, count)
        if self.kind == "tensorwise":
            return quantize_tensorwise(x, dtype, count)
        if self.kind == "rowwise":
            return quantize_rowwise(x, dim, dtype, count)
        if self.kind == "mx":
            return quantize_mx(x, dim, dtype, self.block, count, self.scale_mode or "floor")
        if self.kind == "nvfp4":
            return quantize_nvfp4(x, dim, self.block, count=count)
        raise ValueError(f"unknown precision kind {self.kind!r}")

    def round_output(self, y: torch.Tensor) -> torch.Tensor:
        """A matmul's fresh float32 output as the precision returns it, rounded in place (no second buffer)."""
        return y.copy_(y.to(self.element)) if self.rounds_output and self.element is not None else y

    @property
    def label(self) -> str:
        """The name with the scale mode a figure assumes, for MX: ``mxfp8 [FLOOR]``; the name otherwise."""
        return f"{self.name} [{self.scale_mode.upper()}]" if self.scale_mode else self.name

    @property
    def along_contraction(self) -> bool:
        """True when the scales depend on the contraction dim (each matmul quantizes its operands anew)."""
        return self.kind in ("rowwise", "mx", "nvfp4")


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", "reference", None, None, 0, False, "float32 matmuls (the reference)"),
        Precision("bf16", "cast", torch.bfloat16, torch.bfloat16, 0, True, "autocast bf16: operands and outputs rounded to bfloat16"),
        Precision("fp16", "cast", torch.float16, torch.float16, 0, True, "autocast fp16: operands and outputs rounded to float16, no loss scaling"),
        Precision("fp8", "tensorwise", E4M3, E5M2, 0, False, "float8 tensorwise (torchao default): e4m3 scale 448/amax, e5m2 gradients"),
        Precision("fp8-rowwise", "rowwise", E4M3, E4M3, 0, False, "float8 rowwise (torchao rowwise): e4m3 power-of-two scale per row"),
        Precision("mxfp8", "mx", E4M3, E4M3, 32, False,
                  "MXFP8: 32-element blocks, e8m0 FLOOR scales (OCP MX v1.0), e4m3 elements and gradients", "floor"),
        Precision("mxfp8-rceil", "mx", E4M3, E4M3, 32, False,
                  "MXFP8 with RCEIL scales (torchao's MX training recipes): 32-element blocks, e8m0 scale rounded up, "
                  "e4m3 elements and gradients", "rceil"),
        Precision("mxfp8-hybrid", "mx", E4M3, E5M2, 32, False,
                  "MXFP8 in HYBRID format: e4m3 forward, e5m2 gradients, FLOOR scales (not NVIDIA's recipe)", "floor"),
        Precision("nvfp4", "nvfp4", E4M3, E4M3, 16, False, "NVFP4: 16-element blocks, e4m3 block scales, per-tensor fp32 scale, e2m1"),
    )
}
#: Spellings accepted for the precisions' names.
ALIASES = {
    "float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
    "fp8-tensorwise": "fp8", "float8": "fp8", "rowwise": "fp8-rowwise", "mx": "mxfp8", "fp4": "nvfp4",
}  # fmt: skip


def precision(name: str) -> Precision:
    """The :class:`Precision` called ``name`` (aliases accepted); ValueError naming the known ones otherwise."""
    key = ALIASES.get(str(name).lower(), str(name).lower())
    if key not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}: choose from {', '.join(PRECISIONS)}")
    return PRECISIONS[key]
