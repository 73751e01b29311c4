"""EMA and weight averaging: torch's ``AveragedModel``, diffusers' ``EMAModel``, ema-pytorch's ``EMA``, timm's ``ModelEmaV3``.

Read through the torch integration (its ``model_facts`` and ``facts``: the module wrappers are modules, and a
diffusers ``EMAModel`` the user holds is a subject of kind ``averaging``, declared by the diffusers integration).
It reads, per model, the islands kept off the compute path on purpose
(:func:`mpdoctor.objects.readers.intent.read_islands`), and per averaging object its shadow facts, measured on its own
tensors. It also builds the live steps of the one fix its check offers: keep the shadow in fp32, with the update
path made to accept an fp32 shadow of a low-precision model.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ...objects.edits.steps import CastParams, Change, SetAttr, cast_tensor
from ...objects.live.introspect import modules_of, raw_attr
from ...objects.readers.ema_code import ema_updates, user_code
from ...objects.readers.intent import (
    AVERAGING_MODULES,
    closure_decay,
    read_hand_written,
    read_islands,
    read_shadow,
    shadow_kind,
    source_candidates,
)


def model_facts(outer: Any, inner: Any, inner_path: str, live: Any) -> dict:
    """The islands of a model (:class:`~mpdoctor.facts.intent.Island`): the ``islands`` field of its facts."""
    return {"islands": read_islands(inner)} if isinstance(inner, torch.nn.Module) else {}


def shadow_facts(subjects: tuple, live: Any, hardware: Any) -> dict:
    """The ``averaging`` field of the facts: every averaging object held directly or inside a model."""
    models = [(s.name, s.inner) for s in subjects if s.kind == "model" and isinstance(s.inner, torch.nn.Module)]
    found: list[tuple[str, Any]] = [(s.name, s.obj) for s in subjects if s.kind == "averaging"]
    for name, model in list(models):
        try:
            found.extend((f"{name}.{path}" if path else name, mod) for path, mod in modules_of(model, AVERAGING_MODULES))
        except Exception:  # a model whose tree cannot be walked is reported once, by its own gathering
            models.remove((name, model))
    aliases = _aliases(subjects)
    out, seen = [], set()
    for name, obj in found:
        kind = shadow_kind(obj)
        if kind is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        try:
            shadow = read_shadow(name, obj, kind, lambda: source_candidates(models), aliases)
        except Exception:  # an averaging object half built or hostile: nothing to say about it
            continue
        if shadow is not None:
            live.add(obj)
            out.append(shadow)
    out.extend(s for s in _hand_written(models, live) if s.ref not in seen)
    return {"averaging": tuple(out)} if out else {}


def _hand_written(models: list[tuple[str, Any]], live: Any) -> list:
    """Models the user's own code averages into (``ema_p.lerp_(p, 1 - decay)`` over two models' parameters)."""
    if not models:
        return []
    code, namespace = user_code()
    if not code:
        return []
    by_name = dict(source_candidates(models))
    out = []
    for update in ema_updates(code, namespace):
        shadow, online = by_name.get(update.target), by_name.get(update.online)
        if shadow is None and type(namespace.get(update.target)) is dict:  # a dict of shadow tensors
            shadow = namespace[update.target]
        if shadow is None or online is None or shadow is online:
            continue
        try:
            facts = read_hand_written(update.target, shadow, update.online, online, update)
        except Exception:  # a model whose parameters cannot be read is reported by its own gathering
            continue
        if facts is not None:
            live.add(shadow)
            out.append(facts)
    return out


def _aliases(subjects: tuple) -> dict[str, str]:
    """``path -> the user's name`` from the subjects' aliases (``"net = ema.online_model"``: ema-pytorch's ``EMA``
    holds the online model as a submodule, so ``net`` is folded into ``ema``)."""
    out: dict[str, str] = {}
    for s in subjects:
        for alias in getattr(s, "aliases", ()) or ():
            user, sep, path = str(alias).partition(" = ")
            if sep:
                out.setdefault(path, user)
    return out


class CastContainerTensors(Change):
    """Replace each floating tensor of a list or a dict (diffusers' ``EMAModel.shadow_params``, a hand-written EMA's
    dict of shadow tensors) by a copy in ``dtype``.

    Every copy is made before the first swap; undo puts the very tensor objects back.
    """

    def __init__(self, items: list | dict, dtype: torch.dtype, label: str) -> None:
        self.items, self.dtype = items, dtype
        self.description = f"cast {label} to {str(dtype).replace('torch.', '')}"
        self._old: dict | None = None

    @property
    def in_place(self) -> bool:
        values = self.items if isinstance(self.items, list) else list(self.items.values())
        return all(t.dtype == self.dtype for t in values if torch.is_tensor(t) and t.is_floating_point())

    def apply(self) -> None:
        keys = range(len(self.items)) if isinstance(self.items, list) else list(self.items)
        staged = {k: cast_tensor(self.items[k], self.dtype) for k in keys if torch.is_tensor(self.items[k])
                  and self.items[k].is_floating_point() and self.items[k].dtype != self.dtype}  # fmt: skip
        self._old = {k: self.items[k] for k in staged}
        for k, t in staged.items():
            self.items[k] = t

    def revert(self) -> None:
        if self._old is not None:
            for k, t in self._old.items():
                self.items[k] = t
            self._old = None


def _per_tensor_avg_fn(obj: Any) -> Any:
    """The per-tensor twin of an ``AveragedModel``'s ``multi_avg_fn``: it promotes an fp32 shadow with a bf16 model
    where ``torch._foreach_lerp_`` raises."""
    from torch.optim.swa_utils import get_ema_avg_fn, get_swa_avg_fn

    decay = closure_decay(raw_attr(obj, "multi_avg_fn", None))
    return get_swa_avg_fn() if decay is None else get_ema_avg_fn(decay)


def keep_shadow_fp32_steps(obj: Any, label: str) -> list[Change]:
    """The live steps that keep an averaging object's shadow in fp32 and let its update take the online dtype."""
    kind = shadow_kind(obj)
    if kind == "ema-model":
        return [CastContainerTensors(obj.shadow_params, torch.float32, f"the shadow parameters of {label}")]
    if kind is None and isinstance(obj, dict):  # a hand-written EMA's dict of shadow tensors
        return [CastContainerTensors(obj, torch.float32, f"the tensors of {label}")]
    module = obj if kind is None else obj.ema_model if kind == "ema-pytorch" else obj.module  # None: hand-written
    params = [p for p in module.parameters() if p.is_floating_point()]
    steps: list[Change] = [CastParams(params, torch.float32, (), f"shadow parameters of {label}", state=False)]
    if kind == "averaged-model" and raw_attr(obj, "multi_avg_fn", None) is not None:
        steps += [SetAttr(obj, "avg_fn", _per_tensor_avg_fn(obj), f"{label}.avg_fn"), SetAttr(obj, "multi_avg_fn", None, f"{label}.multi_avg_fn")]
    if kind == "ema-pytorch" and not raw_attr(obj, "coerce_dtype", False):
        steps += [SetAttr(obj, "coerce_dtype", True, f"{label}.coerce_dtype")]
        for attr in ("inplace_copy", "inplace_lerp"):
            fn = raw_attr(obj, attr, None)
            if isinstance(fn, functools.partial):  # its update functions bound coerce_dtype when it was built
                steps.append(SetAttr(obj, attr, functools.partial(fn.func, *fn.args, **{**fn.keywords, "coerce_dtype": True}), f"{label}.{attr}"))
    return steps

