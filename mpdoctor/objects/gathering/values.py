"""Value scan: NaN/Inf counts, abs max and fp16/bf16 range of every parameter, grad and optimizer-state tensor.

The work is done in bulk, not per tensor in Python. :func:`scan_tensors` (the
core, a function of live tensors) groups tensors by dtype, device and shape:

- small tensors (at most :data:`SMALL_ELEMENTS`, the many norms, biases and
  small layers whose cost is per-call overhead, not memory) are stacked a
  budgeted chunk at a time into one reused buffer; with their sign bits
  cleared, the bit patterns order like magnitudes (every NaN above inf, inf
  above every finite value), so one integer ``amax`` per row gives each
  tensor's exact abs max or says it holds a NaN or an inf;
- large tensors go through one ``torch.aminmax`` per piece (a view, no copy).

All extremes are read back at once per device. NaN propagates to the
extremes and an inf shows up as one of them, so the extremes alone say
whether a tensor holds anything worth counting; only such tensors get a
second look: an aminmax of each small sub-chunk narrows them to the
sub-chunks holding the culprits, which are then counted exactly in reused
buffers of at most :data:`TEMP_BUDGET` bytes. Counting values that would
flush to zero in fp16 needs every value (the extremes say nothing about the
smallest magnitudes), so it runs only when fp16 is in play
(``underflow="auto"``) or on request, at a fraction of the speed.

Never a full-size temporary, never a cross-device copy (results come back as
scalars), meta tensors skipped, autocast off, nothing mutated.
:func:`mpdoctor.objects.gathering.scan.scan_facts` is the thin adapter from a diagnosis'
Facts to the live tensors it names; :mod:`mpdoctor.diagnosis.scan_rows` formats the result as rows.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ...facts.tensors import dtype_name

#: Largest finite fp16 value; anything past it is out of fp16 range.
FP16_MAX = 65504.0
#: Smallest positive fp16 value (subnormal); nonzero magnitudes below it flush to zero.
FP16_TINY = 2.0**-24
#: Largest finite bf16 value.
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
#: Smallest positive bf16 value (subnormal).
BF16_TINY = 2.0**-133
#: Bytes of scan buffers alive at once (chunk copies, abs values, masks): a quarter of the 64 MiB promise.
TEMP_BUDGET = 16 * 2**20
#: Elements per ``aminmax`` on the first pass over dense tensors: views, so no memory, only fewer calls.
READ_ELEMENTS = 2**22
#: A flagged piece is narrowed down to sub-chunks of this many elements (one more ``aminmax`` each)
#: before the exact counts, which cost several passes, run on the few sub-chunks holding the culprits.
NARROW_ELEMENTS = 2**16
#: Show a progress bar when a scan reads more than this many bytes.
PROGRESS_BYTES = 10**9

_NATIVE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class TensorScan(NamedTuple):
    """Value statistics of one tensor.

    ``absmax`` is over finite values. ``fp16_overflow`` counts finite values
    with ``|x| > 65504``; ``fp16_underflow`` nonzero values with ``|x| < 2**-24``
    (None when not computed); ``bf16_*`` likewise for bf16's range, and are 0
    for tensors already in a 16-bit format.
    """

    object: str
    name: str
    module: str
    kind: str
    dtype: str
    device: str
    numel: int
    nan: int
    inf: int
    absmax: float
    fp16_overflow: int
    fp16_underflow: int | None
    bf16_overflow: int
    bf16_underflow: int | None

    @property
    def nonfinite(self) -> int:
        """NaN plus Inf count."""
        return self.nan + self.inf

    @property
    def bytes(self) -> int:
        """Bytes read."""
        return self.numel * _itemsize(self.dtype)


@dataclass(frozen=True)
class ScanFacts:
    """The value scan of one model or optimizer.

    Attributes
    ----------
    object : str
        The subject's name (``model``, ``trainer.optimizer``).
    kind : str
        ``"model"`` or ``"optimizer"``.
    tensors : tuple of TensorScan
        One row per scanned tensor, in module order.
    skipped : tuple of (str, str)
        Tensors not scanned and why (``meta``, not floating, unsupported).
    underflow : bool
        Whether flush-to-zero counts were computed.
    seconds : float
        Wall time of this object's scan.
    chunk_elements : int
        Elements per chunk (bounds the scan's temporary memory).
    peak_temp_bytes : int
        Largest total of scan buffers alive at once.
    """

    object: str
    kind: str
    tensors: tuple[TensorScan, ...]
    skipped: tuple[tuple[str, str], ...] = ()
    underflow: bool = False
    seconds: float = 0.0
    chunk_elements: int = 0
    peak_temp_bytes: int = 0

    @property
    def bytes(self) -> int:
        """Bytes read by the scan."""
        return sum(t.bytes for t in self.tensors)


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize if hasattr(torch, dtype) else 1


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype chunks are read in: the tensor's own, or fp32 for formats ``aminmax`` cannot read (float8)."""
    return dtype if dtype in _NATIVE else torch.float32


def chunk_elements_for(dtype: torch.dtype, budget: int = TEMP_BUDGET) -> int:
    """Elements per chunk so that one chunk's buffers fit ``budget`` bytes.

    A chunk may need a copy (non-contiguous tensors and float8, in the work
    dtype), its absolute values (work dtype) and one boolean mask (1 byte).
    """
    per_element = 2 * _work_dtype(dtype).itemsize + 1
    return max(1024, budget // per_element)


class _Buffers:
    """Scratch buffers (copy, abs, mask) of one chunk size, reused across chunks and tensors.

    One set is alive at a time (a new device or dtype releases the old set),
    so the scan's temporary memory is one chunk's worth whatever the model size.
    """

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.key: tuple | None = None
        self.bufs: dict[str, torch.Tensor] = {}
        self.alive = 0
        self.peak = 0

    def begin(self, t: torch.Tensor) -> None:
        """Start a tensor: keep the buffers when its device and dtype match the last one's."""
        key = (t.device, t.dtype)
        if key != self.key:
            self.release()
            self.key = key

    def get(self, name: str, dtype: torch.dtype, device: torch.device, n: int) -> torch.Tensor:
        """A buffer of at least ``n`` elements (``n <= chunk``), grown only when a larger piece needs it."""
        buf = self.bufs.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            if buf is not None:
                self.alive -= buf.numel() * buf.element_size()
                del self.bufs[name], buf
            buf = self.bufs[name] = torch.empty(n, dtype=dtype, device=device)
            self.alive += buf.numel() * buf.element_size()
            self.peak = max(self.peak, self.alive)
        return buf[:n]

    def release(self) -> None:
        """Drop every buffer."""
        self.bufs.clear()
        self.key = None
        self.alive = 0


def _dense_flat(t: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view over all of ``t``'s elements without a copy, or None when its memory has gaps or overlaps."""
    if t.is_contiguous():
        return t.view(-1)
    # A transposed or permuted tensor is dense in another dimension order.
    order = sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d)), reverse=True)
    permuted = t.permute(order)
    return permuted.reshape(-1) if permuted.is_contiguous() else None


def _pieces(t: torch.Tensor, chunk: int, bufs: _Buffers, readable: bool, read: int) -> Iterator[torch.Tensor]:
    """Yield 1-D pieces covering every element of ``t`` once.

    Dense tensors are sliced as views of ``read`` elements (no copy); tensors
    with gaps (slices of a bigger tensor) and dtypes ``aminmax`` cannot read
    (float8) are copied ``chunk`` elements at a time into a reused buffer.
    """
    flat = _dense_flat(t)
    if flat is not None:
        step = read if readable else chunk
        for i in range(0, flat.numel(), step):
            piece = flat[i : i + step]
            if readable:
                yield piece
            else:
                yield bufs.get("copy", torch.float32, t.device, piece.numel()).copy_(piece)
        return
    if t.dim() <= 1 or t.numel() <= chunk:
        if t.dim() == 0:
            t = t.reshape(1)
        if t.dim() == 1 and t.numel() > chunk:
            for i in range(0, t.numel(), chunk):
                yield from _pieces(t[i : i + chunk], chunk, bufs, readable, read)
            return
        n = t.numel()
        buf = bufs.get("copy", _work_dtype(t.dtype), t.device, n)
        buf.view(t.shape).copy_(t)
        yield buf
        return
    for sub in t.unbind(0):
        yield from _pieces(sub, chunk, bufs, readable, read)


_THRESHOLDS: dict[tuple, tuple[torch.Tensor, bool]] = {}


def _threshold(limit: float, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, bool]:
    """``(value, strict)`` such that ``x > limit`` is exactly ``x > value`` (strict) or ``x >= value`` in ``dtype``.

    A Python scalar would be rounded to ``dtype`` first: 65504 becomes 65536
    in bf16, so a plain ``x > 65504`` would miss bf16's 65536.
    """
    key = (limit, dtype, str(device))
    if key not in _THRESHOLDS:
        value = torch.tensor(limit, dtype=dtype, device=device)
        rounded = float(value)
        if rounded < limit:  # the first representable value past the limit
            value = torch.nextafter(value, torch.tensor(math.inf, dtype=dtype, device=device))
        _THRESHOLDS[key] = (value, rounded == limit)
    return _THRESHOLDS[key]


class _Counter:
    """Exact counts of one tensor's flagged chunks, accumulated as device tensors and read out once."""

    def __init__(self, dtype: torch.dtype, device: torch.device, underflow: bool) -> None:
        self.wide16 = dtype.itemsize > 2 or dtype == torch.bfloat16  # can hold values past fp16 range
        wide_bf16 = dtype.itemsize > 2  # can hold values past bf16 range
        self.underflow = underflow
        self.work = _work_dtype(dtype)
        self.fp16_over = _threshold(FP16_MAX, self.work, device) if self.wide16 else None
        self.bf16_over = _threshold(BF16_MAX, self.work, device) if wide_bf16 else None
        self.fp16_tiny = _threshold(FP16_TINY, self.work, device)[0] if self.wide16 and underflow else None
        self.bf16_tiny = _threshold(BF16_TINY, self.work, device)[0] if wide_bf16 and underflow else None
        self.counts: dict[str, list[torch.Tensor]] = {}
        self.finite_max: list[torch.Tensor] = []

    def add(self, key: str, value: torch.Tensor) -> None:
        self.counts.setdefault(key, []).append(value)

    def totals(self) -> tuple[dict[str, int], float | None]:
        """Sums per key and the finite abs max of the looked-at chunks, in one read-out."""
        keys = list(self.counts)
        flat = [v for k in keys for v in self.counts[k]]
        values = torch.stack(flat).tolist() if flat else []
        out: dict[str, int] = {}
        i = 0
        for k in keys:
            n = len(self.counts[k])
            out[k] = int(sum(values[i : i + n]))
            i += n
        fmax = max(torch.stack(self.finite_max).double().tolist()) if self.finite_max else None
        return out, fmax


def _count_above(a: torch.Tensor, threshold: tuple[torch.Tensor, bool], mask: torch.Tensor) -> torch.Tensor:
    value, strict = threshold
    (torch.gt if strict else torch.ge)(a, value, out=mask)
    return torch.count_nonzero(mask)


def _second_look(c: torch.Tensor, cnt: _Counter, bufs: _Buffers, nonfinite: bool, wide: bool) -> None:
    """Exact counts over one chunk: NaN/Inf, past fp16/bf16 range, and flush-to-zero when asked."""
    n = c.numel()
    a = torch.abs(c, out=bufs.get("abs", c.dtype, c.device, n))
    mask = bufs.get("mask", torch.bool, c.device, n)
    inf = None
    if nonfinite:
        cnt.add("nan", torch.count_nonzero(torch.ne(a, a, out=mask)))
        inf = torch.count_nonzero(torch.eq(a, math.inf, out=mask))
        cnt.add("inf", inf)
    if wide and cnt.fp16_over is not None:
        # inf is past every limit; the counts are of finite values.
        over = _count_above(a, cnt.fp16_over, mask)
        cnt.add("fp16_overflow", over if inf is None else over - inf)
        if cnt.bf16_over is not None:
            over = _count_above(a, cnt.bf16_over, mask)
            cnt.add("bf16_overflow", over if inf is None else over - inf)
    if cnt.fp16_tiny is not None or cnt.bf16_tiny is not None:
        zeros = n - torch.count_nonzero(c)  # |x| < tiny counts zeros too; NaN compares false
        if cnt.fp16_tiny is not None:
            cnt.add("fp16_underflow", torch.count_nonzero(torch.lt(a, cnt.fp16_tiny, out=mask)) - zeros)
        if cnt.bf16_tiny is not None:
            cnt.add("bf16_underflow", torch.count_nonzero(torch.lt(a, cnt.bf16_tiny, out=mask)) - zeros)
    if nonfinite:
        # Zero the non-finite magnitudes in our own buffer to get the finite abs max.
        cnt.finite_max.append(torch.nan_to_num_(a, nan=0.0, posinf=0.0).amax())


def _flags(values: list[float], wide16: bool, underflow: bool) -> dict[int, tuple[bool, bool]]:
    """Which pieces need a second look, from their ``[min, max, min, max, ...]``: ``{index: (nonfinite, wide)}``."""
    looks: dict[int, tuple[bool, bool]] = {}
    for i in range(0, len(values), 2):
        mn, mx = values[i], values[i + 1]
        finite = math.isfinite(mn) and math.isfinite(mx)
        # NaN/Inf hide whether finite values also pass the limit, so those pieces get every count.
        wide = wide16 and (not finite or max(-mn, mx) > FP16_MAX)
        if not finite or wide or underflow:
            looks[i // 2] = (not finite, wide)
    return looks


def _finite_absmax(values: list[float]) -> float:
    out = 0.0
    for i in range(0, len(values), 2):
        mn, mx = values[i], values[i + 1]
        if math.isfinite(mn) and math.isfinite(mx):
            out = max(out, -mn, mx)
    return out


class _Job:
    """One tensor through the two passes."""

    __slots__ = ("t", "chunk", "read", "readable", "wide16", "extremes", "values")

    def __init__(self, t: torch.Tensor, chunk: int, read: int) -> None:
        self.t = t.detach()
        self.chunk = chunk
        self.read = max(read, chunk)
        self.readable = t.dtype in _NATIVE
        self.wide16 = t.dtype.itemsize > 2 or t.dtype == torch.bfloat16  # can hold values past fp16 range
        self.extremes: list[torch.Tensor] = []
        self.values: list[float] = []


def _first_pass(job: _Job, bufs: _Buffers, progress: Any) -> None:
    """One aminmax per piece (views of dense tensors: no memory); results stay on the device."""
    bufs.begin(job.t)
    size = job.t.element_size()
    for piece in _pieces(job.t, job.chunk, bufs, job.readable, job.read):
        job.extremes.extend(torch.aminmax(piece))
        if progress is not None:
            progress.update(piece.numel() * size)


def _read_out(jobs: list[_Job]) -> None:
    """All extremes of many tensors read with one stack and transfer per device and dtype."""
    groups: dict[tuple, list[_Job]] = {}
    for job in jobs:
        if job.extremes:
            groups.setdefault((job.t.device, job.t.dtype), []).append(job)
    for group in groups.values():
        values = torch.stack([x for job in group for x in job.extremes]).tolist()
        i = 0
        for job in group:
            n = len(job.extremes)
            job.values, job.extremes = values[i : i + n], []
            i += n


def _second_pass(job: _Job, underflow: bool, bufs: _Buffers) -> dict:
    """Exact counts, only on the pieces whose extremes call for them.

    A flagged piece is first narrowed, by an aminmax of each small sub-chunk,
    to the sub-chunks that hold the culprits. Flush-to-zero counts need every
    value, so that mode counts whole chunks.
    """
    t = job.t
    result: dict[str, Any] = {"numel": t.numel(), "nan": 0, "inf": 0, "absmax": 0.0, "fp16_overflow": 0,
                              "bf16_overflow": 0, "fp16_underflow": 0 if underflow else None,
                              "bf16_underflow": 0 if underflow else None}  # fmt: skip
    if not job.values:
        return result
    absmax = _finite_absmax(job.values)
    looks = _flags(job.values, job.wide16, underflow)
    if looks:
        bufs.begin(t)
        cnt = _Counter(t.dtype, t.device, underflow)
        for i, piece in enumerate(_pieces(t, job.chunk, bufs, job.readable, job.read)):
            if i not in looks:
                continue
            subs = list(piece.split(job.chunk if underflow else min(job.chunk, NARROW_ELEMENTS)))
            if len(subs) == 1 or underflow:
                sub_looks = dict.fromkeys(range(len(subs)), looks[i])
            else:
                sub_values = torch.stack([x for s in subs for x in torch.aminmax(s)]).tolist()
                absmax = max(absmax, _finite_absmax(sub_values))
                sub_looks = _flags(sub_values, job.wide16, False)
            for j, (nonfinite, wide) in sub_looks.items():
                _second_look(subs[j], cnt, bufs, nonfinite, wide)
        totals, fmax = cnt.totals()
        result.update(totals)
        if fmax is not None:
            absmax = max(absmax, fmax)
    result["absmax"] = absmax
    return result


def scan_tensor(
    t: torch.Tensor,
    underflow: bool = False,
    chunk_elements: int | None = None,
    read_elements: int = READ_ELEMENTS,
) -> dict:
    """Scan one floating tensor's values; see :class:`TensorScan` for the fields.

    Parameters
    ----------
    t : torch.Tensor
        Any strided floating tensor, on any device (read where it lives).
    underflow : bool
        Also count values that would flush to zero in fp16 (and bf16 for
        wider tensors): a second look at every chunk.
    chunk_elements : int, optional
        Elements per chunk of the second look and of copies (default:
        :func:`chunk_elements_for` the dtype); bounds the scan's buffers.
    read_elements : int
        Elements per ``aminmax`` view on the first pass over dense tensors.

    Returns
    -------
    dict
        ``numel, nan, inf, absmax, fp16_overflow, fp16_underflow, bf16_overflow, bf16_underflow``.
    """
    chunk = chunk_elements or chunk_elements_for(t.dtype)
    job = _Job(t, chunk, read_elements)
    bufs = _Buffers(chunk)
    with no_autocast():
        _first_pass(job, bufs, None)
        _read_out([job])
        result = _second_pass(job, underflow, bufs)
    bufs.release()
    return result



# -- many small tensors at once -----------------------------------------------------------

#: Tensors of at most this many elements are scanned in bulk (see :func:`_bulk_group`): one
#: ``aminmax`` each would cost more in per-call overhead than reading their values.
SMALL_ELEMENTS = 2**15
#: Bytes of small tensors stacked at once: the copy is read back twice (sign clear, max), so a chunk that
#: stays in cache makes those passes nearly free (a 16 MiB chunk is 12% slower on 10,000 64x64 tensors).
BULK_BYTES = 4 * 2**20

#: The integer view of each float format read in bulk and the mask clearing its sign bit. With the
#: sign cleared, bit patterns order like magnitudes, and every NaN orders above inf, inf above every
#: finite value: one integer max per tensor says "holds a NaN", "holds an inf" or gives its abs max.
_BITS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float16: (torch.int16, 0x7FFF),
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float32: (torch.int32, 0x7FFF_FFFF),
    torch.float64: (torch.int64, 0x7FFF_FFFF_FFFF_FFFF),
}

_DTYPE_NAMES: dict[torch.dtype, str] = {}

#: One tensor's statistics: dtype, device type, then the counts of :class:`TensorScan` from ``numel`` on.
Stats = tuple


def _dtype_label(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype_name(dtype)
    return name


@functools.cache
def _tiny_bits(limit: float, dtype: torch.dtype) -> int:
    """The bit pattern below which a magnitude in ``dtype`` is smaller than ``limit`` (``limit`` rounded up)."""
    value = torch.tensor(limit, dtype=dtype)
    if float(value) < limit:
        value = torch.nextafter(value, torch.tensor(math.inf, dtype=dtype))
    return int(value.view(_BITS[dtype][0]))


def _empty_stats(label: str, device: str, underflow: bool) -> Stats:
    zero = 0 if underflow else None
    return (label, device, 0, 0, 0, 0.0, 0, zero, 0, zero)


def _row_counts(mask: torch.Tensor) -> torch.Tensor:
    """True values per row of a 2-D mask (summed as int8 into int32: ten times faster than a bool sum on CPU)."""
    return mask.view(torch.int8).sum(dim=1, dtype=torch.int32)


def _bulk_group(
    dtype: torch.dtype,
    device: torch.device,
    shape: torch.Size,
    tensors: list[torch.Tensor],
    underflow: bool,
    chunk: int,
    bufs: _Buffers,
    bar: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Abs max (or NaN/inf) and flush-to-zero counts of same-shaped tensors, left on the device.

    The tensors are stacked ``chunk // numel`` at a time into one reused
    buffer (a copy: reductions never write into user tensors), the sign bits
    cleared in place, then one integer ``amax`` per row gives each tensor's
    abs max, or a NaN/inf marker. Returns the maxima as float64 and, when
    ``underflow``, an int64 ``(len(tensors), 2)`` tensor of fp16 and bf16
    flush-to-zero counts.
    """
    numel = math.prod(shape)
    ints, sign_off = _BITS[dtype]
    per = max(1, chunk // numel)
    wide16 = dtype.itemsize > 2 or dtype == torch.bfloat16
    wide_bf16 = dtype.itemsize > 2
    tiny16 = _tiny_bits(FP16_TINY, dtype) if underflow and wide16 else None
    tiny_bf16 = _tiny_bits(BF16_TINY, dtype) if underflow and wide_bf16 else None
    maxima: list[torch.Tensor] = []
    counts: list[torch.Tensor] = []
    for start in range(0, len(tensors), per):
        part = tensors[start : start + per]
        rows = len(part)
        buf = bufs.get("bulk", dtype, device, rows * numel)
        if shape:  # cat along the first dimension: no per-tensor unsqueezed view, as stack makes
            torch.cat(part, out=buf.view(rows * shape[0], *shape[1:]))
        else:
            torch.stack(part, out=buf.view(rows))
        bits = buf.view(ints).view(rows, numel)
        bits.bitwise_and_(sign_off)
        maxima.append(bits.amax(dim=1).view(dtype).double())
        if underflow:
            found = torch.zeros(rows, 2, dtype=torch.int64, device=device)
            if tiny16 is not None:
                # |x| < tiny and x != 0; NaN and inf have larger bit patterns, so they never count.
                mask = bufs.get("mask", torch.bool, device, rows * numel).view(rows, numel)
                zeros = _row_counts(torch.eq(bits, 0, out=mask))
                found[:, 0] = _row_counts(torch.lt(bits, tiny16, out=mask)) - zeros
                if tiny_bf16 is not None:
                    found[:, 1] = _row_counts(torch.lt(bits, tiny_bf16, out=mask)) - zeros
            counts.append(found)
        if bar is not None:
            bar.update(rows * numel * dtype.itemsize)
    return torch.cat(maxima), torch.cat(counts) if counts else None


def _single_stats(
    tensors: list[torch.Tensor], underflow: bool, chunk_elements: int | None, bar: Any
) -> tuple[list[Stats | str], int, int]:
    """One tensor at a time (large ones, float8, and small ones whose extremes call for exact counts).

    Returns the stats (or why a tensor could not be read), the largest
    chunk used and the peak bytes of the scan's buffers.
    """
    out: list[Stats | str] = [""] * len(tensors)
    jobs: list[tuple[int, _Job]] = []
    bufs = _Buffers(0)
    budget = 0
    for i, t in enumerate(tensors):
        job = _Job(t, chunk_elements or chunk_elements_for(t.dtype), READ_ELEMENTS)
        bufs.chunk = job.chunk
        budget = max(budget, job.chunk)
        try:
            _first_pass(job, bufs, bar)
        except Exception as exc:  # one odd tensor (a subclass, an exotic dtype) must not stop the scan
            out[i] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        jobs.append((i, job))
    _read_out([job for _, job in jobs])
    for i, job in jobs:
        bufs.chunk = job.chunk
        t = job.t
        try:
            r = _second_pass(job, underflow, bufs)
        except Exception as exc:
            out[i] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        out[i] = (
            _dtype_label(t.dtype), t.device.type, r["numel"], r["nan"], r["inf"], r["absmax"],
            r["fp16_overflow"], r["fp16_underflow"], r["bf16_overflow"], r["bf16_underflow"],
        )  # fmt: skip
    bufs.release()
    return out, budget, bufs.peak


def _sort_out(tensors: Sequence[torch.Tensor], idx: list[int], out: list[Stats | str]) -> list[int]:
    """Write the skip reason of each tensor that has one into ``out``; the others, for the one-tensor path."""
    readable = []
    for i in idx:
        reason = _skip_reason(tensors[i])
        if reason is None:
            readable.append(i)
        else:
            out[i] = reason
    return readable


def _groups(tensors: Sequence[torch.Tensor], out: list[Stats | str]) -> dict[tuple, list[int]]:
    """Indices of ``tensors`` by (dtype, device, shape); a tensor without a shape gets its reason in ``out``.

    Three attribute reads per tensor and a dict append: the only per-tensor Python work before the rows. The
    layout is checked per group; a sparse tensor among dense ones of its shape makes the group's cat fail, and
    the group is then sorted out one tensor at a time.
    """
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        try:
            key = (t.dtype, t.device, t.shape)
        except Exception as exc:  # a lazy module's uninitialized parameter has no shape yet
            out[i] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        group = groups.get(key)
        if group is None:
            groups[key] = [i]
        else:
            group.append(i)
    return groups


def tensor_stats(
    tensors: Sequence[torch.Tensor],
    underflow: bool = False,
    chunk_elements: int | None = None,
    progress: bool | None = None,
) -> tuple[list[Stats | str], int, int]:
    """Statistics of many tensors, the small ones in bulk.

    Tensors are grouped by dtype, device and shape with a few attribute reads
    each; every group of small tensors is reduced by a handful of ops whatever
    its size (:func:`_bulk_group`), and all groups' results come back in one
    transfer per device. A tensor whose abs max is NaN, inf or past 65504 then
    gets the exact counts of the one-tensor path, like every large tensor.

    Parameters
    ----------
    tensors : sequence of torch.Tensor
        Any tensors; those that cannot be scanned get a reason instead of stats.
    underflow : bool
        Also count values that would flush to zero in fp16 / bf16.
    chunk_elements : int, optional
        Elements per chunk (bulk buffers and the one-tensor path's copies).
    progress : bool, optional
        Show a tqdm bar; default: when more than :data:`PROGRESS_BYTES` are read.

    Returns
    -------
    (stats, chunk, peak) : tuple
        ``stats[i]`` is ``(dtype, device type, numel, nan, inf, absmax,
        fp16_overflow, fp16_underflow, bf16_overflow, bf16_underflow)`` or the
        reason ``tensors[i]`` was skipped; the largest chunk in elements; the
        peak bytes of the scan's own buffers.
    """
    out: list[Stats | str] = [""] * len(tensors)
    groups = _groups(tensors, out)
    single: list[int] = []
    bulk: list[tuple[tuple, list[int], list[torch.Tensor]]] = []
    total = 0
    for key, idx in groups.items():
        dtype, device, shape = key
        numel = math.prod(shape)
        if dtype not in _BITS or tensors[idx[0]].layout is not torch.strided:
            single += _sort_out(tensors, idx, out)
            total += sum(tensors[i].numel() * tensors[i].element_size() for i in idx if not out[i])
            continue
        if device.type == "meta":
            for i in idx:
                out[i] = "meta"
            continue
        if numel == 0:
            empty = _empty_stats(_dtype_label(dtype), device.type, underflow)
            for i in _sort_out(tensors, idx, out):
                out[i] = empty
        elif numel > SMALL_ELEMENTS:
            single += _sort_out(tensors, idx, out)  # a few large tensors: a closer look costs nothing
        else:
            bulk.append((key, idx, [tensors[i] for i in idx]))
        total += numel * len(idx) * dtype.itemsize
    bar = _progress_bar(total, progress)
    try:
        with torch.no_grad():  # stacking parameters into our own buffer is no step of anyone's graph
            flagged, failed, chunk, peak = _bulk_stats(bulk, out, underflow, chunk_elements, bar)
        if failed:
            flagged += _sort_out(tensors, failed, out)
        if single or flagged:
            rest = sorted(single + flagged)
            stats, chunk2, peak2 = _single_stats([tensors[i] for i in rest], underflow, chunk_elements, bar)
            for i, s in zip(rest, stats):
                out[i] = s
            chunk, peak = max(chunk, chunk2), max(peak, peak2)
    finally:
        if bar is not None:
            bar.close()
    return out, chunk, peak


def _bulk_stats(
    bulk: list[tuple[tuple, list[int], list[torch.Tensor]]],
    out: list[Stats | str],
    underflow: bool,
    chunk_elements: int | None,
    bar: Any,
) -> tuple[list[int], list[int], int, int]:
    """Fill ``out`` for the small tensors.

    Returns the indices whose values call for exact counts, those of groups
    that could not be read in bulk, the largest chunk and the peak bytes.
    """
    flagged: list[int] = []
    failed: list[int] = []
    pending: dict[torch.device, list[tuple[tuple, list[int], tuple]]] = {}
    bufs = _Buffers(0)
    largest = 0
    for key, idx, ts in bulk:
        dtype, device, shape = key
        # Budget: the stacked copy plus, when counting flush-to-zero, one boolean mask.
        chunk = chunk_elements or BULK_BYTES // (dtype.itemsize + (1 if underflow else 0))
        largest = max(largest, chunk)
        if bufs.key != (device, dtype):
            bufs.release()
            bufs.key = (device, dtype)
        try:
            result = _bulk_group(dtype, device, shape, ts, underflow, chunk, bufs, bar)
        except Exception:  # mixed layouts, an exotic subclass: sorted out and read one tensor at a time
            failed.extend(idx)
            continue
        pending.setdefault(device, []).append((key, idx, result))
    bufs.release()
    for items in pending.values():
        # One transfer per device for every small tensor's statistics.
        maxima = torch.cat([m for *_, (m, _) in items]).tolist()
        counts = torch.cat([c for *_, (_, c) in items]).t().tolist() if underflow else None
        row = 0
        for (dtype, device, shape), idx, _ in items:
            label, dev, numel = _dtype_label(dtype), device.type, math.prod(shape)
            # Past this, a tensor holds a NaN (no comparison holds), an inf, or values past fp16's
            # range: its exact counts come from the one-tensor path.
            limit = FP16_MAX if dtype.itemsize > 2 or dtype == torch.bfloat16 else sys.float_info.max
            if counts is None:
                for i, absmax in zip(idx, maxima[row : row + len(idx)]):
                    if absmax <= limit:
                        out[i] = (label, dev, numel, 0, 0, absmax, 0, None, 0, None)
                    else:
                        flagged.append(i)
            else:
                for k, i in enumerate(idx, row):
                    absmax = maxima[k]
                    if absmax <= limit:
                        out[i] = (label, dev, numel, 0, 0, absmax, 0, counts[0][k], 0, counts[1][k])
                    else:
                        flagged.append(i)
            row += len(idx)
    return flagged, failed, largest, bufs.peak


def no_autocast() -> contextlib.ExitStack:
    """A context with autocast off on every device: the caller's autocast must not reach mpdoctor's own
    reductions (CPU autocast to fp16 even breaks ``torch.stack`` of bf16 scalars)."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast("cpu", enabled=False))
    if torch.cuda.is_available():
        stack.enter_context(torch.autocast("cuda", enabled=False))
    return stack


def _progress_bar(total: int, progress: bool | None) -> Any:
    if progress is False or (progress is None and total <= PROGRESS_BYTES):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: no bar, same scan
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="mpdoctor scan", leave=False)


def _skip_reason(t: torch.Tensor) -> str | None:
    if t.device.type == "meta":
        return "meta"
    if t.layout != torch.strided:
        return f"layout {t.layout}"
    if not t.dtype.is_floating_point:
        return f"not floating ({dtype_name(t.dtype)})"
    return None


def scan_tensors(
    entries: Iterable[tuple[str, str, str, torch.Tensor]],
    object: str = "",
    kind: str = "",
    underflow: bool = False,
    chunk_elements: int | None = None,
    progress: bool | None = None,
) -> ScanFacts:
    """Scan live tensors: the scan's core, independent of how the tensors were found.

    Parameters
    ----------
    entries : iterable of (module, kind, name, tensor)
        ``module`` is the owner's path (rows aggregate per module), ``kind``
        ``"param"``, ``"grad"`` or ``"optimizer_state"``, ``name`` the
        tensor's full name as the user reaches it.
    object, kind : str
        The owner's name and kind (``"model"``, ``"optimizer"``) in the result.
    underflow, chunk_elements, progress
        See :func:`tensor_stats`.

    Returns
    -------
    ScanFacts
        One :class:`TensorScan` per scanned tensor, in ``entries`` order; the
        others in ``skipped`` with the reason.
    """
    start = time.perf_counter()
    entries = entries if isinstance(entries, list) else list(entries)
    entries, skipped = _stored_views(entries)
    with no_autocast():
        stats, chunk, peak = tensor_stats([e[3] for e in entries], underflow, chunk_elements, progress)
    rows: list[TensorScan] = []
    new = tuple.__new__  # a row built as a tuple: TensorScan(...) parsing 14 arguments is 1.5x slower
    head = (object,)
    for (module, tkind, name, _), s in zip(entries, stats):
        if s.__class__ is str:
            skipped.append((name, s))
        else:
            rows.append(new(TensorScan, head + (name, module, tkind) + s))
    return ScanFacts(object, kind, tuple(rows), tuple(skipped), underflow, time.perf_counter() - start, chunk, peak)


#: Packed sub-byte formats torch can hold but has no kernel to read (not even a copy to another dtype).
_UNREADABLE = frozenset(getattr(torch, n) for n in ("float4_e2m1fn_x2",) if hasattr(torch, n))


def _stored_views(entries: list) -> tuple[list, list[tuple[str, str]]]:
    """Entries whose values can be read, and ``(name, why not)`` for the others.

    A tensor subclass that stores another format than its ``dtype`` (torchao's ``Float8Tensor``, ``MXTensor``)
    has no reductions of its own: its largest inner tensor (the stored elements, through ``__tensor_flatten__``,
    no copy) is read instead, so NaN / inf in the stored data are counted (absmax is of the stored, scaled
    elements). Packed float4 cannot be read at all and is said so.
    """
    out: list = []
    skipped: list[tuple[str, str]] = []
    for entry in entries:
        t = entry[3]
        if type(t).__module__.startswith("torchao.") and hasattr(type(t), "__tensor_flatten__"):
            try:
                names, _ = type(t).__tensor_flatten__(t)
                inner = [getattr(t, n) for n in names if isinstance(getattr(t, n, None), torch.Tensor)]
                t = max(inner, key=lambda x: x.numel() * x.element_size())
            except Exception:  # another torchao version's layout: scanned as it is (and skipped with the reason)
                pass
        if t.dtype in _UNREADABLE:
            skipped.append((entry[2], f"packed {str(t.dtype)[6:]}: torch has no kernel to read its values"))
            continue
        out.append(entry if t is entry[3] else (entry[0], entry[1], entry[2], t))
    return out, skipped


def scan_objects(
    plans: Iterable[tuple[str, str, list]],
    underflow: bool = False,
    chunk_elements: int | None = None,
    progress: bool | None = None,
) -> tuple[ScanFacts, ...]:
    """Scan ``(object, kind, [(module, tensor kind, name, tensor), ...])`` plans, one :class:`ScanFacts` each."""
    return tuple(
        scan_tensors(entries, obj, kind, underflow=underflow, chunk_elements=chunk_elements, progress=progress)
        for obj, kind, entries in plans
    )
