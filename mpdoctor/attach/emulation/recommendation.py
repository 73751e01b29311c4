"""Which Linears to keep in higher precision, judged layer by layer, and the code that converts the rest.

:func:`keep_reasons` reads one precision's rows of a comparison against the thresholds of
:mod:`mpdoctor.attach.emulation.measurements`; :func:`conversion_code` writes the torchao (or autocast) code with a
``module_filter_fn`` that leaves the kept layers alone. :class:`Recommendation` is the result of
``Comparison.recommend()``; ``Comparison.plan()`` (:mod:`mpdoctor.attach.emulation.precision_plan`) verifies such a choice by
running the mixed model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from .measurements import (
    KEEP_BELOW_DB,
    KERNEL_MULTIPLE,
    SATURATION_JUDGED,
    LayerResult,
    below,
    underflow_limit,
)


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



def keep_reasons(
    name: str,
    layers: Sequence[tuple[str, int, int]],
    rows: Mapping[str, LayerResult],
    *,
    min_sqnr_db: float | None = None,
    max_underflow_pct: float | None = None,
    max_saturation_pct: float,
) -> dict[str, str]:
    """``path -> why`` for each Linear of ``layers`` to keep in higher precision under ``name`` (``rows``: its rows by path)."""
    floor = KEEP_BELOW_DB.get(name, 0.0) if min_sqnr_db is None else min_sqnr_db
    under = underflow_limit(name) if max_underflow_pct is None else max_underflow_pct
    multiple = KERNEL_MULTIPLE.get(name)
    reasons: dict[str, str] = {}
    for path, fin, fout in layers:
        why = []
        if multiple and (fin % multiple or fout % multiple):
            why.append(f"dims {fin}x{fout} not multiples of {multiple}")
        r = rows.get(path)
        if r is not None:
            why.extend(_measured_reasons(name, r, floor, under, max_saturation_pct))
        if why:
            reasons[path] = "; ".join(why)
    return reasons


def _measured_reasons(name: str, r: LayerResult, floor: float, under: float, max_saturation_pct: float) -> list[str]:
    why = []
    if r.act_underflow_pct > under:
        why.append(f"{r.act_underflow_pct:.1f}% of activations underflow")
    if r.grad_underflow_pct > under:
        why.append(f"{r.grad_underflow_pct:.1f}% of output gradients underflow")
    if name in SATURATION_JUDGED and r.act_saturation_pct > max_saturation_pct:
        why.append(f"{r.act_saturation_pct:.2f}% of activations saturate")
    if below(r.out_sqnr_db, floor):
        why.append(f"output SQNR {r.out_sqnr_db:.1f} dB < {floor:g}")
    if below(r.wgrad_sqnr_db, floor):
        why.append(f"weight-gradient SQNR {r.wgrad_sqnr_db:.1f} dB < {floor:g}")
    return why


def keep_literal(keep: Sequence[str]) -> str:
    """``keep = {'a', 'b'}`` in sorted order (``keep = set()`` when empty): the same code for the same plan."""
    return "keep = {" + ", ".join(repr(k) for k in sorted(keep)) + "}" if keep else "keep = set()"


def conversion_code(name: str, keep: tuple[str, ...], attention: bool = False) -> str:
    """torchao 0.18 code converting every Linear except ``keep`` (names as torchao passes them: fqn)."""
    keep_line = keep_literal(keep)
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
    if name in ("mxfp8", "mxfp8-rceil"):
        return (
            "import torch\n"
            "from torchao.quantization import quantize_\n"
            "from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe\n\n"
            + filt
            + ("# mpdoctor's mxfp8 figures assume FLOOR scales (OCP MX); this recipe uses RCEIL: mxfp8-rceil's figures are its own\n"
               if name == "mxfp8" else "# mpdoctor's mxfp8-rceil figures assume this recipe's RCEIL scales\n")
            + "config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_RCEIL)\n"
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
