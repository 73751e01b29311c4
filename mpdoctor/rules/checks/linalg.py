"""Checks on linear algebra held in half precision: torch's orthogonal parametrization on a bf16 / fp16 weight.

They read :class:`~mpdoctor.facts.between.OrthogonalWeight` (``facts.between.orthogonal``). The ops torch
refuses outright in half precision (QR, SVD, Cholesky, FFT, samplers) are exception families
(``crash-linalg-half``, ``crash-fft-half``, ``crash-sampler-half`` in :mod:`mpdoctor.attach.crash.catalogue`).
"""

from __future__ import annotations

from collections.abc import Iterator

from ...facts import Facts
from ..engine.findings import Finding, Severity
from ..engine.fixes import Fix
from ..engine.rules import Applicability, Rule
from . import check

_SHORT = {"bfloat16": "bf16", "float16": "fp16"}
#: An orthogonality error below this is what fp32 rounding leaves on small matrices too.
_FP32_FLOOR = 1e-4


@check("orthogonal-parametrization-half", Severity.ERROR, Severity.WARNING, Severity.INFO,
       fix_safety=(Applicability.DISPLAY_ONLY,))  # fmt: skip
def orthogonal_parametrization_half(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A weight under ``torch.nn.utils.parametrizations.orthogonal`` stored in bf16 / fp16.

    What it does
        Finds parametrized weights whose ``orthogonal`` parametrization keeps its ``original`` in bf16 / fp16
        (``model.to(torch.bfloat16)`` casts it) and computes the weight the parametrization produces: its
        orthogonality error ``max |Q Q^T - I|``, or the refusal torch raises for it.
    Why is this bad?
        The orthogonal maps need linear algebra in the stored dtype: ``cayley`` solves a linear system and
        ``householder`` builds Q from reflectors, and torch has no bf16 / fp16 kernel for either
        (``"lu_cpu" not implemented for 'BFloat16'``, ``"orgqr_cpu" ...``), so the forward crashes. The default
        ``matrix_exp`` runs, but its Q is orthogonal only to bf16's 8 bits (measured: an error of about 5e-3 on
        an 8x8 weight against 1e-6 in fp32), which is what the parametrization exists to prevent.
    Example
        layer = orthogonal(nn.Linear(64, 64))
        model.to(torch.bfloat16)  # the parametrization's original goes to bf16 too
    Use instead
        model.to(torch.bfloat16)
        layer.parametrizations.weight.float()  # the orthogonal map computes from an fp32 original
        parametrize.register_parametrization(layer, "weight", CastTo(torch.bfloat16), unsafe=True)  # cast once
    Fix safety
        Display-only: the parametrization's original becomes an fp32 Parameter and a last parametrization casts
        the computed weight to the model's dtype, so every reader of ``layer.weight`` (its forward, or a parent
        that reads the weight itself, as ReFT does) gets a half-precision weight that is orthogonal to fp32's
        precision. Run it before creating the optimizer, which must hold the new fp32 original.
    Severity
        Error when torch refuses the map in this dtype (the forward raises); warning when the weight is off
        orthogonal beyond fp32's rounding; info otherwise.
    Sources
        torch ``nn/utils/parametrizations.py`` (``_Orthogonal``); HomebrewML/HeavyBall#57 (QR refused in bf16);
        pytorch/pytorch#98308 (no half-precision SVD by design: cuSOLVER has none).
    """
    between = facts.between
    for o in between.orthogonal if between is not None else ():
        where = f"{o.model}.{o.path}" if o.path else o.model
        short = _SHORT.get(o.dtype, o.dtype)
        if o.error is None:
            severity, harm = Severity.ERROR, f"torch refuses its {o.orthogonal_map} map in {short} ({o.refused}), so the forward raises"
        elif o.error > _FP32_FLOOR:
            severity, harm = Severity.WARNING, f"the weight it computes is off orthogonal by {o.error:.1e} (fp32: about 1e-6)"
        else:
            severity, harm = Severity.INFO, f"the weight is still orthogonal to {o.error:.1e}"
        yield rule.finding(
            where,
            f"{where}.{o.tensor} is parametrized as orthogonal ({o.orthogonal_map}) from a {short} original: {harm}.",
            {"dtype": o.dtype, "orthogonal_map": o.orthogonal_map, "orthogonality_error": o.error, "refused": o.refused},
            [
                Fix(
                    f"Compute {where}.{o.tensor}'s orthogonal map in fp32, then cast the weight once",
                    "import torch\nfrom torch.nn.utils import parametrize\n\n\n"
                    "class CastTo(torch.nn.Module):\n"
                    "    def __init__(self, dtype):\n        super().__init__()\n        self.dtype = dtype\n\n"
                    "    def forward(self, x):\n        return x.to(self.dtype)\n\n\n"
                    f"{where}.parametrizations.{o.tensor}.float()  # the orthogonal map computes in fp32\n"
                    f"parametrize.register_parametrization({where}, \"{o.tensor}\", CastTo(torch.{o.dtype}), "
                    "unsafe=True)  # cast once",
                    applicability=Applicability.DISPLAY_ONLY,
                    recipe="orthogonal-fp32-island",
                    cost="the layer's weights in fp32",
                )
            ],
            severity=severity,
        )
