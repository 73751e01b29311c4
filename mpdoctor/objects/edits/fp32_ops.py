"""An fp32 island around a call rather than a module: the ops with no half-precision kernel run in fp32 inside it.

Some ops have no bf16 / fp16 kernel at all (LAPACK / cuSOLVER factorizations and solves, pocketfft / MKL FFTs).
When such an op runs inside code that is no module's forward (an optimizer's ``step``, a library's helper the user
calls), no module can be made an fp32 island around it. :class:`Fp32Kernels` is a ``TorchFunctionMode`` that, while
it is active, runs those ops on fp32 copies of their bf16 / fp16 tensor arguments and casts their real floating
results back to the arguments' dtype: the op runs, and what follows it sees the dtype it saw before.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_HALF = (torch.float16, torch.bfloat16)

#: The ops without a bf16 / fp16 kernel, per family (names in ``torch.linalg``, ``torch.fft``, ``torch`` and methods
#: of ``torch.Tensor``). Matrix products and norms are left out: they have half kernels.
FAMILY_OPS: dict[str, dict[str, tuple[str, ...]]] = {
    "linalg": {
        "torch.linalg": ("qr", "svd", "svdvals", "cholesky", "cholesky_ex", "eigh", "eigvalsh", "eig", "eigvals",
                         "inv", "inv_ex", "solve", "solve_ex", "solve_triangular", "lstsq", "det", "slogdet", "pinv",
                         "matrix_rank", "lu", "lu_factor", "lu_factor_ex", "lu_solve", "ldl_factor", "ldl_factor_ex",
                         "ldl_solve", "householder_product", "matrix_exp", "cond"),
        "torch": ("qr", "svd", "cholesky", "cholesky_solve", "cholesky_inverse", "inverse", "det", "logdet",
                  "slogdet", "pinverse", "triangular_solve", "geqrf", "orgqr", "ormqr", "lu_solve", "lu_unpack",
                  "matrix_exp"),
        "torch.Tensor": ("qr", "svd", "cholesky", "cholesky_solve", "cholesky_inverse", "inverse", "det", "logdet",
                         "slogdet", "pinverse", "triangular_solve", "geqrf", "orgqr", "ormqr", "lu_solve",
                         "matrix_exp"),
    },
    "fft": {
        "torch.fft": ("fft", "ifft", "fft2", "ifft2", "fftn", "ifftn", "rfft", "irfft", "rfft2", "irfft2", "rfftn",
                      "irfftn", "hfft", "ihfft", "hfft2", "ihfft2", "hfftn", "ihfftn"),
        "torch": ("stft", "istft"),
        "torch.Tensor": ("stft", "istft"),
    },
}  # fmt: skip


def family_ops(families: tuple[str, ...]) -> frozenset:
    """The torch callables of ``families`` this torch has (an op a version lacks is left out)."""
    return frozenset(family_op_names(families))


def family_op_names(families: tuple[str, ...]) -> dict[Any, str]:
    """The torch callables of ``families`` this torch has, each with its name in its namespace (``svd``)."""
    owners = {"torch": torch, "torch.linalg": torch.linalg, "torch.fft": torch.fft, "torch.Tensor": torch.Tensor}
    out: dict[Any, str] = {}
    for family in families:
        for owner, names in FAMILY_OPS.get(family, {}).items():
            out.update((getattr(owners[owner], n), n) for n in names if hasattr(owners[owner], n))
    return out


def _half_dtype(value: Any, depth: int = 2) -> torch.dtype | None:
    """The dtype of the first bf16 / fp16 tensor among ``value`` (lists, tuples and dicts ``depth`` levels in)."""
    if isinstance(value, torch.Tensor):
        return value.dtype if value.dtype in _HALF else None
    if depth and isinstance(value, (list, tuple)):
        return next((d for d in map(lambda v: _half_dtype(v, depth - 1), value) if d is not None), None)
    if depth and isinstance(value, dict):
        return _half_dtype(tuple(value.values()), depth)
    return None


def _mapped(value: Any, fn: Any, depth: int = 2) -> Any:
    """``value`` with ``fn`` applied to each tensor (lists, tuples, named tuples and dicts ``depth`` levels in)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if depth and isinstance(value, tuple) and hasattr(value, "_fields"):  # torch.return_types: a named tuple
        return type(value)(tuple(_mapped(v, fn, depth - 1) for v in value))
    if depth and isinstance(value, (list, tuple)):
        return type(value)(_mapped(v, fn, depth - 1) for v in value)
    if depth and isinstance(value, dict):
        return {k: _mapped(v, fn, depth - 1) for k, v in value.items()}
    return value


class Fp32Kernels(TorchFunctionMode):
    """While active, the ops of ``families`` (:data:`FAMILY_OPS`) met with bf16 / fp16 tensors run in fp32 and give
    back their real floating results in the dtype of those tensors (complex and integer results as the op made
    them). Every other op, and every op on fp32 tensors, runs as it would. An op given ``out=`` runs as written.

    Parameters
    ----------
    families : tuple of str
        Keys of :data:`FAMILY_OPS` (``("linalg", "fft")``).
    """

    def __init__(self, families: tuple[str, ...] = ("linalg", "fft")) -> None:
        super().__init__()
        self.families = tuple(families)
        self._ops = family_ops(self.families)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        __tracebackhide__ = True  # a fix's wrapper is not the user's code: IPython leaves it out of tracebacks
        kwargs = kwargs or {}
        dtype = _half_dtype((args, kwargs)) if func in self._ops and "out" not in kwargs else None
        if dtype is None:
            return func(*args, **kwargs)
        upcast = _mapped((args, kwargs), lambda t: t.float() if t.dtype in _HALF else t, depth=3)
        out = func(*upcast[0], **upcast[1])
        return _mapped(out, lambda t: t.to(dtype) if t.dtype == torch.float32 else t)


class Fp32KernelsContext:
    """A factory of :class:`Fp32Kernels` modes for a wrapper's ``context``: a plain value, so a deep copy of the
    wrapper (a twin of the object it serves) gets the same families without sharing a mode's state."""

    def __init__(self, families: tuple[str, ...]) -> None:
        self.families = tuple(families)

    def __call__(self) -> Fp32Kernels:
        return Fp32Kernels(self.families)
