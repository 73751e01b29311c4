"""Changes of low-precision weights, as data: float8 training layers converted back to torch's Linear or in from it
(:class:`ConvertBack`, :class:`ConvertToFloat8`), float8-stored weights upcast where they are used
(:class:`UpcastStoredWeights`, :class:`UnstoreFloat8Layers`), and torchao quantized weights repaired or run
dequantized (:class:`ZeroQuantizedZeroBlocks`, :class:`FloorActivationScales`, :class:`DequantizeBlockMatmuls`).

Each is a :class:`~mpdoctor.rules.engine.changes.ChangeSpec` like those of :mod:`.changes`, kept here because they
read and write the storage of quantized tensors, not the dtypes of plain ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...objects.edits.steps import (
    CastParams,
    Change,
    SetClass,
    SwapParameter,
)
from .changes import ChangeSpec, _replace_params, torch_dtype

if TYPE_CHECKING:
    from ...facts import Facts
    from ...objects.live import Live


@dataclass(frozen=True)
class ConvertBack(ChangeSpec):
    """Take the layers ``paths`` of the model ``ref`` out of a low-precision recipe: each converted layer (torchao's
    ``MXLinear``, ``Float8Linear``, subclasses of ``nn.Linear`` that keep its parameters) goes back to the torch
    class it was converted from, in place; undo converts it again."""

    ref: int
    paths: tuple[str, ...]
    label: str = "layers"
    holders: tuple[int, ...] = ()

    def bind(self, live: Live) -> list[Change]:
        model = live.get(self.ref)
        holders = [live.get(r) for r in self.holders if r in live]
        steps: list[Change] = []
        for path in self.paths:
            module = model.get_submodule(path) if path else model
            base = torch_base_class(type(module))
            if base is not None and base is not type(module):
                steps.append(SetClass(module, base, f"{self.label}: {path}"))
            for name, p in list(object.__getattribute__(module, "_parameters").items()):
                inner = wrapped_tensor(p)
                if inner is not None:
                    plain = torch.nn.Parameter(inner.detach(), requires_grad=p.requires_grad)
                    steps.append(SwapParameter(module, name, plain, holders, f"{self.label}: {path}.{name}"))
        return steps

    def simulate(self, facts: Facts) -> Facts:
        """The model with those layers no longer float8 training layers (they compute in their weights' dtype)."""
        gone = set(self.paths)
        models = tuple(dataclasses.replace(m, float8_layers=tuple(x for x in m.float8_layers if x.path not in gone))
                       if m.ref == self.ref and m.float8_layers else m for m in facts.models)  # fmt: skip
        return dataclasses.replace(facts, models=models)

    def verify(self, live: Live) -> str | None:
        model = live.get(self.ref)
        left = [p for p in self.paths if _still_converted(model.get_submodule(p))]
        return f"{', '.join(left)} still converted" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, path, "class"): "torch" for path in self.paths}


def wrapped_tensor(p: Any) -> Any:
    """The plain tensor a library's low-precision wrapper subclass holds (torchao's training weight wrappers keep it
    as ``_data``), or None for a plain tensor."""
    if p is None or type(p).__module__.startswith("torch") and not type(p).__module__.startswith("torchao"):
        return None
    inner = getattr(p, "_data", None)
    return inner if isinstance(inner, torch.Tensor) and type(inner) in (torch.Tensor, torch.nn.Parameter) else None


def _still_converted(module: Any) -> bool:
    base = torch_base_class(type(module))
    wrapped = any(wrapped_tensor(p) is not None for p in object.__getattribute__(module, "_parameters").values())
    return wrapped or (base is not None and base is not type(module))


def torch_base_class(cls: type) -> type | None:
    """The first class of ``cls``'s MRO that is torch's own layer (``torch.nn.Linear`` for torchao's ``MXLinear``)."""
    for base in cls.__mro__:
        if base.__module__.startswith("torch.nn.modules") and base is not torch.nn.Module:
            return base
    return None


@dataclass(frozen=True)
class ConvertToFloat8(ChangeSpec):
    """The inverse of :class:`ConvertBack`: the torch ``nn.Linear`` layers ``paths`` of the model ``ref`` become
    torchao's ``Float8Linear``, built as ``convert_to_float8_training`` builds them with the accelerator
    ``accelerator``'s own torchao recipe config (read when applied), over the very same weight and bias Parameters,
    so every optimizer holding them trains them on. Undo puts the original module objects back in their parents.
    A layer already converted (this fix applied before, or the user's own conversion) is a step already in place."""

    ref: int
    paths: tuple[str, ...]
    accelerator: int
    label: str = "layers"

    def bind(self, live: Live) -> list[Change]:
        from ...libraries.accelerate.integration import live_ao_config
        from ...libraries.torchao.integration import float8_training_layer
        from ...objects.edits.steps import SetChild

        model = live.get(self.ref)
        config = live_ao_config(live.get(self.accelerator))
        staged = []  # every new layer built before any is swapped in
        for path in self.paths:
            parent_path, _, name = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            module = object.__getattribute__(parent, "_modules")[name]
            if type(module) is torch.nn.Linear:
                module = float8_training_layer(module, config)
            elif not _still_converted(module):
                raise ValueError(f"{path} is a {type(module).__qualname__}, not torch's Linear")
            staged.append(SetChild(parent, name, module, f"{self.label}: {path}"))
        return staged

    def simulate(self, facts: Facts) -> Facts:
        """The model with those layers float8 training layers of the accelerator's recipe."""
        from ...facts.fp8_training import Float8Layer

        recipe = next((r for r in facts.ao_recipes if r.accelerator_ref == self.accelerator), None)
        chosen = set(self.paths)

        def converted(m: Any) -> Any:
            layers = tuple(Float8Layer(path, i, o, recipe.recipe if recipe else "tensorwise",
                                       pad_inner_dim=bool(recipe and recipe.pad_inner_dim))
                           for path, i, o in m.float8_candidates if path in chosen)  # fmt: skip
            rest = tuple(c for c in m.float8_candidates if c[0] not in chosen)
            return dataclasses.replace(m, float8_layers=m.float8_layers + layers, float8_candidates=rest)

        models = tuple(converted(m) if m.ref == self.ref else m for m in facts.models)
        return dataclasses.replace(facts, models=models)

    def verify(self, live: Live) -> str | None:
        model = live.get(self.ref)
        left = [p for p in self.paths if not _still_converted(model.get_submodule(p))]
        return f"{', '.join(left)} not converted" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, path, "class"): "float8" for path in self.paths}


UPCAST_STORAGE_MARKER = "mpdoctor-upcast-float8-storage"
#: What the float8 storage reader says upcasts a layer once this fix is on it (``StoredLayer.upcast``).
UPCAST_STORAGE_WHAT = "mpdoctor's upcast in its forward"
_ABSENT = object()


def _float8_dtypes() -> frozenset[torch.dtype]:
    from ...facts.quantized import STORAGE_DTYPES

    # e4m3 / e5m2 upcast exactly to bf16, fp16 and fp32; e8m0 scales and packed float4 are no weight to upcast.
    names = (n for n in STORAGE_DTYPES if n.startswith(("float8_e4m3", "float8_e5m2")))
    return frozenset(getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), torch.dtype))


class _UpcastForForward:
    """A context for one call of a module's forward: each float8-stored parameter named is read as an upcast copy.

    The copy sits in the instance dict under the parameter's name, where attribute lookup finds it before
    ``nn.Module.__getattr__`` reaches ``_parameters``: the stored Parameter (its bytes, its identity, every
    optimizer's reference) is untouched, and gradients, where it requires them, flow to it through the cast.
    """

    def __init__(self, module: torch.nn.Module, names: tuple[str, ...], dtype: torch.dtype) -> None:
        self.module, self.names, self.dtype = module, names, dtype
        self._saved: list[tuple[str, Any]] = []

    def __enter__(self) -> None:
        own = object.__getattribute__(self.module, "__dict__")
        params, storage = own["_parameters"], _float8_dtypes()
        self._saved = []
        for name in self.names:
            p = params.get(name)
            if p is not None and p.dtype in storage:  # storage cast up by the user since: nothing to do
                self._saved.append((name, own.get(name, _ABSENT)))
                own[name] = p.to(self.dtype)

    def __exit__(self, *exc: Any) -> None:
        own = object.__getattribute__(self.module, "__dict__")
        for name, old in reversed(self._saved):
            if old is _ABSENT:
                own.pop(name, None)
            else:
                own[name] = old
        self._saved = []


def _same_arguments(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return args, kwargs


def _stored_layers(live: Live, ref: int, layers: tuple[tuple[str, str], ...]) -> list[tuple[str, Any, str]]:
    """``(path, module, storage dtype)`` of each float8-storing layer ``layers`` of the model ``ref``."""
    model = live.get(ref)
    return [(path, model.get_submodule(path) if path else model, dtype) for path, dtype in layers]


@dataclass(frozen=True)
class UpcastStoredWeights(ChangeSpec):
    """Compute each layer ``path`` of the model ``ref`` with its float8-stored parameters cast to ``dtype``, in place.

    ``layers`` are ``(path, compute dtype)`` pairs. Each layer's ``forward`` is wrapped on the instance (its class and
    every other instance untouched): for each call, its float8 parameters are read as upcast copies (what diffusers'
    layerwise casting and ComfyUI's ``manual_cast`` layers do), so every entry point that reaches the layer (the
    model's forward, ``generate``, the layer called directly) computes in ``dtype``; the stored float8 Parameters
    stay as they are (bytes, identity, optimizers' references). An upcast of float8 is exact. Undo removes exactly
    that wrapper.
    """

    ref: int
    layers: tuple[tuple[str, str], ...]
    label: str = "model"

    def _modules(self, live: Live) -> list[tuple[str, Any, str]]:
        return _stored_layers(live, self.ref, self.layers)

    def bind(self, live: Live) -> list[Change]:
        from ...objects.edits.steps import MethodInputCast

        storage, steps = _float8_dtypes(), []
        for path, module, dtype in self._modules(live):
            params = object.__getattribute__(module, "__dict__").get("_parameters", {})
            names = tuple(n for n, p in params.items() if p is not None and p.dtype in storage)
            if not names or MethodInputCast.registered(module, "forward", UPCAST_STORAGE_MARKER):
                continue
            upcast = _UpcastForForward(module, names, torch_dtype(dtype))
            where = f"{self.label}.{path}" if path else self.label
            steps.append(MethodInputCast(module, "forward", _same_arguments, UPCAST_STORAGE_MARKER,
                                         f"{where}: compute with its float8 {', '.join(names)} cast to {dtype}",
                                         context=lambda upcast=upcast: upcast))  # fmt: skip
        return steps

    def simulate(self, facts: Facts) -> Facts:
        dtypes = dict(self.layers)
        models = []
        for m in facts.models:
            if m.ref == self.ref and any(x.path in dtypes for x in m.stored_layers):
                layers = tuple(
                    dataclasses.replace(x, upcast=UPCAST_STORAGE_WHAT, compute_dtype=dtypes[x.path], emits_storage=False)
                    if x.path in dtypes else x
                    for x in m.stored_layers
                )  # fmt: skip
                m = dataclasses.replace(m, stored_layers=layers)
            models.append(m)
        return dataclasses.replace(facts, models=tuple(models))

    def verify(self, live: Live) -> str | None:
        from ...objects.edits.steps import MethodInputCast

        storage = _float8_dtypes()
        left = [
            path or self.label
            for path, module, _ in self._modules(live)
            if any(p is not None and p.dtype in storage for p in object.__getattribute__(module, "__dict__").get("_parameters", {}).values())
            and not MethodInputCast.registered(module, "forward", UPCAST_STORAGE_MARKER)
        ]
        return f"nothing upcasts the float8 weights of {', '.join(left)}" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, path, "float8-compute-dtype"): dtype for path, dtype in self.layers}


@dataclass(frozen=True)
class UnstoreFloat8Layers(ChangeSpec):
    """Take the layers ``layers`` (``(path, compute dtype)`` pairs) of the model ``ref`` out of float8 storage, in place.

    Each layer's float8 parameters are cast to its compute dtype (the same Parameter objects: optimizers and hooks
    keep their references; an upcast of e4m3 / e5m2 is exact) and diffusers' layerwise-casting hook is taken off it
    (:func:`~mpdoctor.libraries.diffusers.integration.layerwise_casting_removed`), so the layer is left as
    ``skip_modules_pattern`` would have left it: stored and computed in the compute dtype. Code that reads the weight
    outside the forward (DoRA's weight norm) then meets it in that dtype. Every other layer keeps its float8 storage.
    An ``add_adapter`` that raised on these layers left diffusers' ``_hf_peft_config_loaded`` set with no adapter:
    that flag is reset too, so the same call can run again. Undo puts back the very float8 tensors (bytes and
    objects), hooks, registry containers, forwards and flag.
    """

    ref: int
    layers: tuple[tuple[str, str], ...]
    label: str = "model"

    def _modules(self, live: Live) -> list[tuple[str, Any, str]]:
        return _stored_layers(live, self.ref, self.layers)

    def bind(self, live: Live) -> list[Change]:
        from ...libraries.diffusers.integration import failed_adapter_flag_reset, layerwise_casting_removed

        storage, stored, unhook = _float8_dtypes(), {}, []
        for path, module, dtype in self._modules(live):
            params = object.__getattribute__(module, "__dict__").get("_parameters", {})
            stored.setdefault(dtype, []).extend(p for p in params.values() if p is not None and p.dtype in storage)
            unhook += layerwise_casting_removed(module, f"{self.label}.{path}" if path else self.label)
        casts: list[Change] = [CastParams(params, torch_dtype(dtype), label=f"float8-stored parameters of {self.label}")
                               for dtype, params in stored.items() if params]  # fmt: skip
        return casts + unhook + failed_adapter_flag_reset(live.get(self.ref), self.label)

    def simulate(self, facts: Facts) -> Facts:
        from ...facts.tensors import STORAGE_ONLY

        dtypes, ids, models = dict(self.layers), {}, []
        for m in facts.models:
            if m.ref == self.ref:
                for p in m.tensors.params:
                    if p.module in dtypes and p.dtype in STORAGE_ONLY:
                        ids.setdefault(dtypes[p.module], set()).add(p.id)
                m = dataclasses.replace(m, stored_layers=tuple(x for x in m.stored_layers if x.path not in dtypes))
            models.append(m)
        facts = dataclasses.replace(facts, models=tuple(models))
        for dtype, cast in ids.items():
            facts = _replace_params(facts, frozenset(cast), dtype, dtype, grads_only=False)
        return facts

    def verify(self, live: Live) -> str | None:
        from ...libraries.diffusers.integration import layerwise_casting_hook

        storage = _float8_dtypes()
        left = [
            path or self.label
            for path, module, _ in self._modules(live)
            if layerwise_casting_hook(module) is not None
            or any(p is not None and p.dtype in storage for p in object.__getattribute__(module, "__dict__").get("_parameters", {}).values())
        ]
        return f"still stored in float8: {', '.join(left)}" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, path, "float8-storage"): dtype for path, dtype in self.layers}

    def backup_bytes(self, facts: Facts) -> int:
        # the float8 tensors kept for undo: one byte an element
        paths = dict(self.layers)
        return sum(x.elements for m in facts.models if m.ref == self.ref for x in m.stored_layers if x.path in paths)


def _with_quantized_weights(facts: Facts, ref: int, change: Callable[[Any], Any]) -> Facts:
    """``facts`` with each quantized weight of the model ``ref`` passed through ``change``."""
    models = tuple(dataclasses.replace(m, quantized_weights=tuple(change(q) for q in m.quantized_weights))
                   if m.ref == ref and m.quantized_weights else m for m in facts.models)  # fmt: skip
    return dataclasses.replace(facts, models=models)


def _layer_weights(model: Any, paths: Iterable[str]) -> list[tuple[str, Any]]:
    """``(path, weight)`` of each layer ``path`` of ``model``: the ``weight`` in its own parameters (None when it has
    none), read from the module's ``__dict__`` (a torchao tensor subclass is returned as it is)."""
    out = []
    for path in paths:
        module = model.get_submodule(path) if path else model
        out.append((path, object.__getattribute__(module, "__dict__").get("_parameters", {}).get("weight")))
    return out


@dataclass(frozen=True)
class ZeroQuantizedZeroBlocks(ChangeSpec):
    """In the torchao float8 weights of the layers ``paths`` of the model ``ref``, write 0 into each NaN / inf element
    of a block whose scale is 0, in place.

    A block's scale is its amax / 448: a scale of 0 says every element of the block was 0 before quantization, and
    ``0 / 0`` made it NaN. Writing 0 back (scale 0 times 0) restores exactly the weights the model had. The
    quantized tensor, its ``qdata`` object and the scales stay; undo gives ``qdata`` back its very storage.
    """

    ref: int
    paths: tuple[str, ...]
    label: str = "model"

    def _weights(self, live: Live) -> list[tuple[str, Any]]:
        return _layer_weights(live.get(self.ref), self.paths)

    def bind(self, live: Live) -> list[Change]:
        from ...libraries.torchao.integration import zero_scale_nonfinite
        from ...objects.edits.steps import ReplaceData

        steps: list[Change] = []
        for path, w in self._weights(live):
            mask = zero_scale_nonfinite(w) if w is not None else None
            if mask is None or not bool(mask.any()):
                continue
            qdata = w.qdata
            values = qdata.detach().clone()
            values.view(torch.uint8)[mask] = 0  # +0.0 in every float8 format
            where = f"{self.label}.{path}" if path else self.label
            steps.append(ReplaceData(qdata, values, f"{where}.weight: {int(mask.sum())} NaN elements of zero-scale blocks -> 0"))
        return steps

    def simulate(self, facts: Facts) -> Facts:
        return _with_quantized_weights(facts, self.ref, lambda q: dataclasses.replace(
            q, nonfinite=q.nonfinite - q.zero_scale_nonfinite, zero_scale_nonfinite=0) if q.path in self.paths else q)

    def verify(self, live: Live) -> str | None:
        from ...libraries.torchao.integration import zero_scale_nonfinite

        masks = [(path, zero_scale_nonfinite(w) if w is not None else None) for path, w in self._weights(live)]
        left = [path or self.label for path, mask in masks if mask is not None and bool(mask.any())]
        return f"zero-scale blocks of {', '.join(left)} still hold NaN" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, path, "zero-scale-blocks"): 0 for path in self.paths}


@dataclass(frozen=True)
class FloorActivationScales(ChangeSpec):
    """Give the dynamic activation quantization of the torchao weights of the layers ``paths`` of the model ``ref``
    a lower bound on its scale's amax (``hp_value_lb = floor``), in place.

    Each such weight carries the recipe of its input's quantization (``act_quant_kwargs``), read at every forward.
    Without a bound, an all-zero row of the input (padding, a masked token) gets scale ``amax / 448 = 0`` and
    quantizes to ``0 / 0 = NaN``. With it, the row's scale is ``floor / 448`` and the row stays 0; rows whose amax is
    above the floor quantize exactly as before. Undo gives each weight its previous recipe object back.
    """

    ref: int
    paths: tuple[str, ...]
    floor: float = 1e-12
    label: str = "model"

    def _weights(self, live: Live) -> list[tuple[str, Any]]:
        return [(path, w) for path, w in _layer_weights(live.get(self.ref), self.paths)
                if w is not None and getattr(w, "act_quant_kwargs", None) is not None]  # fmt: skip

    def bind(self, live: Live) -> list[Change]:
        from ...objects.edits.steps import SetAttr

        steps: list[Change] = []
        for path, w in self._weights(live):
            kwargs = w.act_quant_kwargs
            if getattr(kwargs, "hp_value_lb", None) is not None:
                continue  # a bound of the user's own stays
            where = f"{self.label}.{path}" if path else self.label
            steps.append(SetAttr(w, "act_quant_kwargs", dataclasses.replace(kwargs, hp_value_lb=self.floor),
                                 f"{where}.weight.act_quant_kwargs"))  # fmt: skip
        return steps

    def simulate(self, facts: Facts) -> Facts:
        bounded = _with_quantized_weights(facts, self.ref, lambda q: dataclasses.replace(q, activation_floor=self.floor)
                                          if q.path in self.paths and q.dynamic_activation and q.activation_floor is None
                                          else q)  # fmt: skip
        return _probes_healed_at(bounded, self.ref, self.paths)

    def verify(self, live: Live) -> str | None:
        left = [path or self.label for path, w in self._weights(live) if getattr(w.act_quant_kwargs, "hp_value_lb", None) is None]
        return f"the activation scales of {', '.join(left)} still have no lower bound" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, path, "activation-scale-floor"): self.floor for path in self.paths}


@dataclass(frozen=True)
class DequantizeBlockMatmuls(ChangeSpec):
    """Make the matmuls of the torchao block-format weights (MX, NVFP4) of the layers ``paths`` of the model ``ref``
    that quantize their activations run dequantized, in place, on any device.

    Their matmul is a block-scaled GEMM only sm_100 kernels run. A weight with a kernel choice of its own (MX) is
    switched to torchao's emulation (activations still quantized, both operands dequantized to a bf16 matmul); one
    without (NVFP4) drops its activation recipe and dequantizes the weight, as ``NVFP4WeightOnlyConfig`` builds it.
    The stored data and scales are not touched; undo gives each weight its previous recipe and kernel choice.
    """

    ref: int
    paths: tuple[str, ...]
    label: str = "model"

    def bind(self, live: Live) -> list[Change]:
        from ...libraries.torchao.integration import dequantized_matmul_changes

        steps: list[Change] = []
        for path, w in _layer_weights(live.get(self.ref), self.paths):
            if w is not None:
                steps += dequantized_matmul_changes(w, f"{self.label}.{path}.weight" if path else f"{self.label}.weight")
        return steps

    def simulate(self, facts: Facts) -> Facts:
        def dequantized(q: Any) -> Any:
            if q.path not in self.paths or not q.dynamic_activation:
                return q
            if q.gemm:
                return dataclasses.replace(q, gemm="emulated")
            return dataclasses.replace(q, dynamic_activation=False, activation_granularity="", activation_floor=None)

        return _with_quantized_weights(facts, self.ref, dequantized)

    def verify(self, live: Live) -> str | None:
        from ...libraries.torchao.integration import dequantized_matmul_changes

        left = [path or self.label for path, w in _layer_weights(live.get(self.ref), self.paths)
                if w is not None and dequantized_matmul_changes(w, path)]  # fmt: skip
        return f"the matmuls of {', '.join(left)} still call a block-scaled GEMM" if left else None

    def targets(self) -> dict[tuple, Any]:
        return {(self.ref, path, "block-matmul"): "dequantized" for path in self.paths}


def _probes_healed_at(facts: Facts, ref: int, paths: tuple[str, ...]) -> Facts:
    """The probes of the model ``ref`` once the layers ``paths`` no longer make NaN from finite inputs and weights:
    a forward NaN first made in one of them is predicted gone, with what it carried downstream and back through
    the backward (a prediction the planner plans on; the proof checks it)."""
    out = []
    for p in facts.probes:
        hit = p.first_nonfinite() if getattr(p, "model_ref", 0) == ref and hasattr(p, "first_nonfinite") else None
        first = hit[0] if hit is not None and hit[1] == "forward" else None
        if first is None or first.path not in paths or first.in_nonfinite or first.param_nonfinite:
            out.append(p)
            continue
        modules = tuple(dataclasses.replace(m, out_nonfinite=0, in_nonfinite=0, grad_nonfinite=0, param_grad_nonfinite=0)
                        if not m.param_nonfinite else m for m in p.modules)  # fmt: skip
        out.append(dataclasses.replace(p, modules=modules))
    return dataclasses.replace(facts, probes=tuple(out)) if out != list(facts.probes) else facts
