"""The change that keeps an EMA / averaged copy's shadow in fp32 (with an update path that accepts it)."""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ...facts import Facts
from ...facts.intent import ShadowFacts
from ...objects.edits.steps import Change
from ...objects.live import Live
from ...objects.readers.intent import min_gap, shadow_kind, shadow_tensors
from .changes import ChangeSpec


@dataclass(frozen=True)
class KeepShadowFp32(ChangeSpec):
    """Cast the shadow tensors of the averaging object ``ref`` to fp32, in place, and let its update take an online
    model of another dtype (ema-pytorch's ``coerce_dtype``; ``AveragedModel``'s per-tensor ``avg_fn``)."""

    ref: int
    label: str
    #: The Python that does the same, with the user's names (shown in the fix's code).
    code: str = dataclasses.field(default="", compare=False)

    def bind(self, live: Live) -> list[Change]:
        from ...libraries.torch.averaging import keep_shadow_fp32_steps

        return keep_shadow_fp32_steps(live.get(self.ref), self.label)

    def simulate(self, facts: Facts) -> Facts:
        shadows = tuple(
            dataclasses.replace(
                s, shadow_dtypes=("float32",), low_elements=0, same_dtype_update=False,
                coerce_dtype=True if s.coerce_dtype is not None else None,
                lost_share=0.0 if s.lost_share is not None else None, min_gap=min_gap("float32", s.decay),
            ) if s.ref == self.ref else s
            for s in facts.averaging
        )  # fmt: skip
        return dataclasses.replace(facts, averaging=shadows)

    def verify(self, live: Live) -> str | None:
        obj = live.get(self.ref)
        kind = shadow_kind(obj) or ("hand-written" if isinstance(obj, (torch.nn.Module, dict)) else None)
        left = sum(1 for t in shadow_tensors(obj, kind) if t.dtype != torch.float32) if kind else 0
        return f"{left} shadow tensors of {self.label} are not float32" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, "shadow dtype"): "float32"}

    def backup_bytes(self, facts: Facts) -> int:
        return sum(2 * s.low_elements for s in facts.averaging if s.ref == self.ref)


def shadow_fix_code(s: ShadowFacts, with_update: bool = True) -> str:
    """Python that does what :class:`KeepShadowFp32` does to the averaging object ``s``, with the user's names (run
    in the tests on a twin). ``with_update=False``: the cast alone, without advice on a hand-written ``lerp_`` (the
    online model is fp32 already, so the user's line is right once the shadow is)."""
    if s.kind == "ema-model":
        return f"import torch\n\n{s.name}.to(dtype=torch.float32)  # EMAModel.to casts its shadow_params; step() promotes the bf16 parameters"
    if s.kind == "hand-written" and s.class_path == "builtins.dict":
        return (
            f"import torch\n\n"
            f"for k, t in {s.name}.items():\n"
            f"    if t.is_floating_point() and t.dtype != torch.float32:\n"
            f"        {s.name}[k] = t.float()  # the EMA's tensors in fp32"
        ) + (_lerp_advice(s) if s.update_op == "lerp_" and with_update else "")
    cast = (
        f"import torch\n\n"
        f"for p in {s.shadow_path}.parameters():\n"
        f"    if p.is_floating_point() and p.dtype != torch.float32:\n"
        f"        p.data = p.data.float()  # the {'EMA' if s.kind == 'ema-pytorch' else 'averaged'} copy in fp32; the same Parameter objects"
    )
    if s.kind == "ema-pytorch" and not s.coerce_dtype:
        return (
            f"import functools\n{cast}\n"
            f"{s.name}.coerce_dtype = True  # its update casts the online weights to the shadow's dtype\n"
            f"for attr in ('inplace_copy', 'inplace_lerp'):  # the update functions bound coerce_dtype when EMA was built\n"
            f"    fn = getattr({s.name}, attr)\n"
            f"    setattr({s.name}, attr, functools.partial(fn.func, *fn.args, **{{**fn.keywords, 'coerce_dtype': True}}))"
        )
    if s.kind == "hand-written" and s.update_op == "lerp_" and s.update_line:
        return cast + _lerp_advice(s) if with_update else cast
    if s.kind == "averaged-model" and s.same_dtype_update:
        avg = f"get_ema_avg_fn({s.decay!r})" if s.decay is not None else "get_swa_avg_fn()"
        return (
            f"from torch.optim.swa_utils import {avg.split('(')[0]}\n{cast}\n"
            f"{s.name}.avg_fn = {avg}  # average per tensor: torch._foreach_lerp_ takes one dtype\n"
            f"{s.name}.multi_avg_fn = None"
        )
    return cast


def _lerp_advice(s: ShadowFacts) -> str:
    if s.update_fixed:
        return (
            f"\n\n# and your update ({s.update_where}) lerping toward the fp32 weights (Tensor.lerp_ takes one dtype),\n"
            f"# in place of yours:\n{s.update_fixed}"
        )
    return (
        f"\n# and in your update ({s.update_where}) lerp toward the fp32 weights (Tensor.lerp_ takes one dtype):\n"
        f"#     {_online_cast(s.update_line or '')}"
    )


def lerp_update_code(s: ShadowFacts) -> str:
    """Python for an fp32 hand-written EMA whose ``lerp_`` meets a lower-precision model: the user's update lerping
    toward the fp32 weights (the shadow stays as it is)."""
    return "import torch\n" + _lerp_advice(s)


def _online_cast(line: str) -> str:
    """``ema_p.lerp_(p, 1 - decay)`` -> ``ema_p.lerp_(p.float(), 1 - decay)``."""
    call = ast.parse(line, mode="eval").body
    if isinstance(call, ast.Call) and call.args:
        call.args[0] = ast.Call(ast.Attribute(call.args[0], "float", ast.Load()), [], [])
    return ast.unparse(call)
