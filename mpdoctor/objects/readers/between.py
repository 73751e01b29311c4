"""Reading the places between steps: accumulation settings, half-precision grads, metric states, router
correction biases and merged LoRA layers, each with its harm measured on the live tensors.

Every read goes through ``__dict__`` / ``_buffers`` / ``_parameters`` (never a property of the user's
objects); the measurements copy small slices of tensors and never write to them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ...facts.between import (
    Accumulation,
    BetweenFacts,
    HalfGradReplay,
    MergedAdapter,
    MetricStates,
    OrthogonalWeight,
    RouterBias,
)
from ..live import Live
from ..live.introspect import anatomy, class_paths, modules_where, own_dict, raw_attr

_HALF = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_METRIC = "torchmetrics.metric.Metric"
#: Buffers that routers keep in fp32 on purpose (transformers' ``_keep_in_fp32_modules_strict``, Megatron's
#: ``expert_bias``): the bias added to the expert scores before top-k.
_ROUTER_BIASES = ("e_score_correction_bias", "expert_bias")
#: DeepSeek-V3's bias update speed (gamma = 0.001, arXiv:2412.19437 section 4.2).
BIAS_UPDATE = 1e-3
#: Elements of a gradient replayed per model: enough for a stable figure, bounded cost on a 70B model.
_REPLAY_ELEMENTS = 1 << 16


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_accumulations(objects: Iterable[tuple[str, Any]]) -> tuple[Accumulation, ...]:
    """Accumulation asked for by ``TrainingArguments``, an ``Accelerator`` or a Lightning ``Trainer``."""
    out: list[Accumulation] = []
    for name, obj in objects:
        paths = class_paths(type(obj))
        steps = _int(raw_attr(obj, "gradient_accumulation_steps"))
        if steps is not None and any(p.endswith("TrainingArguments") for p in paths):
            out.append(Accumulation(name, "TrainingArguments.gradient_accumulation_steps", steps))
        elif "accelerate.accelerator.Accelerator" in paths:
            kwargs = raw_attr(raw_attr(obj, "gradient_state"), "plugin_kwargs") or {}
            steps = _int(kwargs.get("num_steps")) if isinstance(kwargs, dict) else None
            if steps is not None:
                out.append(Accumulation(name, "Accelerator(gradient_accumulation_steps=...)", steps))
        elif "lightning.pytorch.trainer.trainer.Trainer" in paths:
            steps = _int(raw_attr(obj, "accumulate_grad_batches"))
            if steps is not None:
                out.append(Accumulation(name, "Trainer(accumulate_grad_batches=...)", steps))
    return tuple(a for a in out if a.steps > 1)


def accumulation_error(grad: torch.Tensor, steps: int, dtype: torch.dtype) -> float:
    """Relative error of ``steps`` micro-batch gradients summed in ``dtype`` against the same sum in fp32.

    The micro-batches are ``grad`` scaled by seeded weights around ``1 / steps`` (what a loss divided by the
    accumulation steps gives), each rounded to ``dtype`` as autograd writes it, then added as ``.grad +=``
    does: in ``dtype``, one rounding per addition.
    """
    flat = grad.detach().reshape(-1)[:_REPLAY_ELEMENTS].float().cpu()
    gen = torch.Generator().manual_seed(0)
    weights = (1.0 + 0.5 * torch.randn(steps, generator=gen)) / steps
    acc_half = torch.zeros_like(flat, dtype=dtype)
    acc_fp32 = torch.zeros_like(flat)
    for w in weights.tolist():
        micro = (flat * w).to(dtype)
        acc_half += micro
        acc_fp32 += micro.float()
    norm = acc_fp32.norm()
    return float((acc_half.float() - acc_fp32).norm() / norm) if norm > 0 else 0.0


def read_grad_replay(name: str, model: Any, steps: int) -> HalfGradReplay | None:
    """The accumulation error of ``model``'s trainable half-precision parameters, or None when it has none."""
    params = [p for p in _params(model) if p.requires_grad and p.dtype in _HALF]
    if not params:
        return None
    dtype = params[0].dtype
    grads = [p.grad for p in params if p.grad is not None and p.grad.dtype in _HALF]
    if grads:
        pieces, left = [], _REPLAY_ELEMENTS
        for g in grads:  # the first elements of each grad in turn, until the replay has enough
            if left <= 0:
                break
            pieces.append(g.detach().reshape(-1)[:left].float().cpu())
            left -= pieces[-1].numel()
        sample = torch.cat(pieces)
        measured_on = "the model's own gradients"
    else:
        sample = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 1e-3
        measured_on = "a representative gradient"
    return HalfGradReplay(
        model=name,
        model_ref=id(model),
        param_ids=frozenset(id(p) for p in params if p.dtype == dtype),
        dtype=_HALF[dtype],
        steps=steps,
        relative_error=accumulation_error(sample, steps, dtype),
        measured_on=measured_on,
    )


def _params(model: Any) -> list[torch.nn.Parameter]:
    try:
        return list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    except Exception:
        return []


def stall_count(dtype: torch.dtype) -> int:
    """Additions of 1.0 after which a running sum in ``dtype`` stops moving (256 in bf16, 2048 in fp16)."""
    if dtype not in _HALF:
        return 0
    return int(round(2 / torch.finfo(dtype).eps))


def read_metrics(name: str, root: Any, live: Live) -> list[MetricStates]:
    """The torchmetrics ``Metric`` modules of ``root`` (``root`` itself included) and their state dtypes."""
    out = []
    for path, metric in modules_where(root, lambda cls: _METRIC in class_paths(cls)):
        defaults = raw_attr(metric, "_defaults") or {}
        states = []
        for key in defaults if isinstance(defaults, dict) else ():
            value = own_dict(metric).get(key)
            tensors = value if isinstance(value, (list, tuple)) else [value]
            for t in tensors[:1]:
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    states.append((str(key), str(t.dtype).replace("torch.", "")))
        live.add(metric)
        half = [torch.bfloat16 if d == "bfloat16" else torch.float16 for _, d in states if d in ("bfloat16", "float16")]
        stall = min((stall_count(d) for d in half), default=0)
        out.append(MetricStates(name, path, type(metric).__name__, id(metric), tuple(states), stall))
    return out


def read_router_biases(name: str, model: Any) -> list[RouterBias]:
    """Router correction biases of ``model`` held in half precision, with the share of updates they lose."""
    out = []
    for path, module in anatomy(model).buffered:  # the modules holding buffers, found in the shared walk
        buffers = raw_attr(module, "_buffers") or {}
        for attr in _ROUTER_BIASES:
            bias = buffers.get(attr) if isinstance(buffers, dict) else None
            if not isinstance(bias, torch.Tensor) or bias.dtype not in _HALF or bias.device.type == "meta":
                continue
            values = bias.detach().float().cpu().reshape(-1)
            lost = ((values + BIAS_UPDATE).to(bias.dtype).float() == values).float().mean().item() if values.numel() else 0.0
            out.append(
                RouterBias(
                    model=name, model_ref=id(model), path=path, class_name=type(module).__name__, attr=attr,
                    dtype=_HALF[bias.dtype], experts=values.numel(),
                    max_abs=float(values.abs().max()) if values.numel() else 0.0, lost_updates=float(lost),
                    update=BIAS_UPDATE,
                )
            )
    return out


def merge_loss(merged: torch.Tensor, delta: torch.Tensor) -> float:
    """The share of ``delta`` a merge into ``merged``'s dtype lost: ``|merged - base - delta| / |delta|``.

    The base before the merge was representable in ``merged``'s dtype, so it is recovered as
    ``round(merged - delta)``.
    """
    merged32 = merged.detach().float()
    base = (merged32 - delta).to(merged.dtype).float()
    norm = delta.norm()
    return float(((merged32 - base) - delta).norm() / norm) if norm > 0 else 0.0


def _lora_delta(layer: Any, adapter: str) -> torch.Tensor | None:
    """``B @ A * scaling`` of one adapter in fp32 (transposed for ``fan_in_fan_out`` layers), or None."""
    a = raw_attr(layer, "_modules", {}).get("lora_A")
    b = raw_attr(layer, "_modules", {}).get("lora_B")
    scaling = raw_attr(layer, "scaling") or {}
    if a is None or b is None or adapter not in own_dict(a).get("_modules", {}):
        return None
    wa = own_dict(a)["_modules"][adapter]._parameters.get("weight")
    wb = own_dict(b)["_modules"][adapter]._parameters.get("weight")
    if wa is None or wb is None or wa.dim() != 2 or wb.dim() != 2:
        return None  # a convolution's adapter: its delta is not a matmul of the two weights
    delta = (wb.detach().float() @ wa.detach().float()) * float(scaling.get(adapter, 1.0))
    return delta.T if raw_attr(layer, "fan_in_fan_out", False) else delta


def read_merged_adapters(name: str, model: Any) -> list[MergedAdapter]:
    """LoRA layers whose adapters were merged into a half-precision base weight, with the share of delta lost."""
    out = []
    for path, layer in modules_where(model, lambda cls: "BaseTunerLayer" in " ".join(class_paths(cls))):
        merged = raw_attr(layer, "merged_adapters") or []
        base = raw_attr(layer, "_modules", {}).get("base_layer")
        weight = raw_attr(base, "_parameters", {}).get("weight") if base is not None else None
        if not merged or not isinstance(weight, torch.Tensor) or weight.dtype not in _HALF:
            continue
        for adapter in merged:
            delta = _lora_delta(layer, adapter)
            if delta is None or delta.shape != weight.shape:
                continue
            a_dtype = own_dict(raw_attr(layer, "_modules")["lora_A"])["_modules"][adapter]._parameters["weight"].dtype
            out.append(
                MergedAdapter(name, path, str(adapter), _HALF[weight.dtype], str(a_dtype).replace("torch.", ""),
                              merge_loss(weight, delta))
            )
    return out


def orthogonality_error(weight: torch.Tensor) -> float:
    """``max |Q Q^T - I|`` over the smaller side of a (batch of) matrix, computed in fp32."""
    q = weight.detach().float()
    if q.shape[-2] > q.shape[-1]:
        q = q.transpose(-2, -1)
    eye = torch.eye(q.shape[-2], dtype=q.dtype, device=q.device)
    return float((q @ q.transpose(-2, -1) - eye).abs().max())


def read_orthogonal(name: str, model: Any) -> list[OrthogonalWeight]:
    """Weights under torch's ``orthogonal`` parametrization stored in half precision, with their orthogonality error.

    The weight is computed by the parametrization list only when every parametrization in it is torch's own
    (never a user's module).
    """
    out = []
    for path, module in anatomy(model).parametrized:  # the modules holding parametrizations, found in the shared walk
        lists = raw_attr(raw_attr(module, "_modules", {}).get("parametrizations"), "_modules", {}) or {}
        for tensor, plist in lists.items():
            steps = list(raw_attr(plist, "_modules", {}).values())
            original = raw_attr(plist, "_parameters", {}).get("original")
            if not isinstance(original, torch.Tensor) or original.dtype not in _HALF or original.device.type == "meta":
                continue
            if not any(type(p).__name__ == "_Orthogonal" for p in steps):
                continue
            if not all(type(p).__module__.startswith("torch.nn.utils.") for p in steps):
                continue
            orth = next(p for p in steps if type(p).__name__ == "_Orthogonal")
            omap = getattr(own_dict(orth).get("orthogonal_map"), "name", str(own_dict(orth).get("orthogonal_map")))
            error, refused = None, ""
            try:
                with torch.no_grad():
                    error = orthogonality_error(plist())
            except Exception as exc:  # torch refuses cayley / householder in half precision
                refused = str(exc).strip().splitlines()[0][:200]
            out.append(OrthogonalWeight(name, path, str(tensor), _HALF[original.dtype], omap, error, refused))
    return out


def read_between(
    subjects: Iterable[tuple[str, str, Any]], live: Live, errors: list[tuple[str, str]] | None = None
) -> BetweenFacts:
    """The between-steps facts of ``(name, kind, object)`` subjects.

    A subject that cannot be read is appended to ``errors`` as ``(name, what failed)``; the others are read.
    """
    subjects = tuple(subjects)
    try:
        accumulations = read_accumulations((n, o) for n, _, o in subjects)
    except Exception as exc:  # a hostile object among the subjects must not stop the report
        accumulations = ()
        if errors is not None:
            errors.append(("accumulation", f"between steps: {type(exc).__name__}: {exc}"[:500]))
    steps = max((a.steps for a in accumulations), default=1)
    replays: list[HalfGradReplay] = []
    metrics: list[MetricStates] = []
    routers: list[RouterBias] = []
    merges: list[MergedAdapter] = []
    orthogonal: list[OrthogonalWeight] = []
    seen: set[int] = set()
    for name, kind, obj in subjects:
        if kind != "model" or not isinstance(obj, torch.nn.Module):
            continue
        try:
            _read_model(name, obj, steps, live, seen, (replays, metrics, routers, merges))
            orthogonal.extend(read_orthogonal(name, obj))
        except Exception as exc:  # a half-built metric or adapter must not stop the report
            if errors is not None:
                errors.append((name, f"between steps: {type(exc).__name__}: {exc}"[:500]))
    return BetweenFacts(
        tuple(accumulations), tuple(replays), tuple(metrics), tuple(routers), tuple(merges), tuple(orthogonal)
    )


def _read_model(name: str, obj: torch.nn.Module, steps: int, live: Live, seen: set[int], out: tuple) -> None:
    """Append ``obj``'s grad replay, metrics, router biases and merged adapters to the four lists ``out``."""
    replays, metrics, routers, merges = out
    for m in read_metrics(name, obj, live):
        if m.ref not in seen:
            seen.add(m.ref)
            metrics.append(m)
    routers.extend(read_router_biases(name, obj))
    merges.extend(read_merged_adapters(name, obj))
    if steps > 1:
        replay = read_grad_replay(name, obj, steps)
        if replay is not None:
            replays.append(replay)
