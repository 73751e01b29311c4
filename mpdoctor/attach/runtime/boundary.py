"""The batch at the model's boundary: a floating input in another dtype than the layer that receives it.

A bf16 ViT fed the fp32 ``pixel_values`` an image processor returns, a Whisper in fp16 fed fp32
``input_features``, ``inputs_embeds`` computed in fp32 and written into a bf16 model: with nothing
autocasting, the first layer with weights raises ``Input type (float) and bias type (c10::BFloat16) should
be the same`` or ``mat1 and mat2 must have the same dtype``. Here:

- :class:`BoundaryTrace` follows each floating batch tensor, by identity, to the first module whose forward
  receives it and that holds floating weights of its own (it rides on the probe's forward pre-hooks, which
  are removed when the probe ends, even when the forward raises);
- :class:`BatchInput` is what the probe keeps of it (plain data, in ``ProbeFacts.boundary``);
- :func:`batch_findings` turns them into the ``batch-dtype-mismatch`` finding with its fixes: a forward
  pre-hook casting floating inputs (never integer ids, never bool masks) to the compute dtype, exactly
  undoable, or a cast of a dict batch in place, and the line of code to keep;
- :func:`crash_finding` does the same from a traceback's frames, for the crash hook and ``watch()``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ...facts.batch import BatchInput
from ...facts.tensors import dtype_name
from ...rules.checks.batch_inputs import SLUG, keep_line, mismatch_fixes, mismatch_message
from ...rules.engine.findings import Finding

#: Crash patterns (``mpdoctor.attach.crash.patterns``) whose error a batch in the wrong dtype raises.
DTYPE_PATTERNS = frozenset(
    {"crash-matmul-dtype", "crash-conv-dtype", "crash-norm-dtype", "crash-attention-dtype", "crash-rnn-dtype",
     "crash-scalar-type-dtype"}
)


def named_inputs(batch: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` for the floating tensors of a batch: dict / BatchFeature entries, tuple items, a tensor."""
    if isinstance(batch, torch.Tensor):
        if batch.is_floating_point():
            yield "input", batch
        return
    args, kwargs = (getattr(batch, "args", None), getattr(batch, "kwargs", None))
    if isinstance(args, tuple) and isinstance(kwargs, dict):  # a ForwardCall
        items: list[tuple[str, Any]] = [(f"args[{i}]", v) for i, v in enumerate(args)] + list(kwargs.items())
    elif isinstance(batch, Mapping):
        items = list(batch.items())
    elif isinstance(batch, (tuple, list)):
        items = [(f"batch[{i}]", v) for i, v in enumerate(batch)]
    else:
        return
    for key, value in items:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            yield str(key), value


def main_dtype(model: torch.nn.Module) -> str | None:
    """The dtype holding most of the model's floating parameters."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return dtype_name(max(counts, key=counts.__getitem__)) if counts else None


def own_float_dtype(module: torch.nn.Module) -> str | None:
    """The dtype of a module's own (direct) floating weights, None when it has none."""
    for p in module._parameters.values():
        if p is not None and p.is_floating_point():
            return dtype_name(p.dtype)
    return None


class BoundaryTrace:
    """Follow each floating batch tensor to the first module with own weights whose forward receives it.

    :meth:`receive` is called from the probe's forward pre-hook for each floating tensor a module gets;
    once every tensor is placed, ``pending`` is empty and the hook skips the lookup altogether.
    """

    def __init__(self, batch: Any, modules: list[tuple[str, torch.nn.Module]]) -> None:
        self.inputs = list(named_inputs(batch))
        self.pending: dict[int, str] = {id(t): k for k, t in self.inputs}
        self.modules = modules
        self.placed: dict[str, int] = {}
        self._own: dict[int, str | None] = {}

    def receive(self, i: int, t: torch.Tensor) -> None:
        own = self._own.get(i, False)
        if own is False:
            own = self._own[i] = own_float_dtype(self.modules[i][1])
        if own is not None:
            self.placed[self.pending.pop(id(t))] = i

    def facts(self, model: torch.nn.Module) -> tuple[BatchInput, ...]:
        """What the trace saw, as plain data."""
        model_dtype = main_dtype(model)
        out = []
        for key, t in self.inputs:
            i = self.placed.get(key)
            path, mod = self.modules[i] if i is not None else (None, None)
            out.append(
                BatchInput(
                    key=key,
                    dtype=dtype_name(t.dtype),
                    layer=path,
                    layer_class=type(mod).__name__ if mod is not None else None,
                    layer_dtype=own_float_dtype(mod) if mod is not None else None,
                    model_dtype=model_dtype,
                )
            )
        return tuple(out)

    def count_nonfinite(self, found: tuple[BatchInput, ...]) -> tuple[BatchInput, ...]:
        """The same records with the NaN/Inf count of each input (read when the probe saw a non-finite value)."""
        import dataclasses

        counts = {k: int(torch.isnan(t.detach()).sum()) for k, t in self.inputs}  # -inf masks are legitimate
        return tuple(dataclasses.replace(b, nonfinite=counts.get(b.key, 0)) for b in found)


# -- findings ---------------------------------------------------------------------------------------------


# -- from a traceback ---------------------------------------------------------------------------------------


def _failing_layer(frames: list) -> tuple[torch.nn.Module | None, list[torch.Tensor]]:
    """The innermost frame's module (``self`` of a forward) and the tensors in its locals."""
    for view in reversed(frames):
        try:
            local_map = view.frame.f_locals
            items = list(dict.items(local_map)) if type(local_map) is dict else list(local_map.items())
        except Exception:
            continue
        module = next((v for k, v in items if k == "self" and isinstance(v, torch.nn.Module)), None)
        if module is not None:
            return module, [v for _, v in items if type(v) in (torch.Tensor, torch.nn.Parameter)]
    return None, []


def _batches(namespace: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    for name, value in namespace.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and type(value) is torch.Tensor:
            yield name, value
        elif isinstance(value, Mapping) and not isinstance(value, torch.nn.Module):
            try:
                if any(isinstance(v, torch.Tensor) for v in list(value.values())[:64]):
                    yield name, value
            except Exception:
                continue


def _model_holding(layer: Any, candidates: tuple) -> tuple[Any, str | None]:
    """The first module among ``candidates`` whose tree holds ``layer``, and the layer's path in it."""
    if layer is None:
        return None, None
    for m in candidates:
        if isinstance(m, torch.nn.Module):
            for p, sub in m.named_modules():
                if sub is layer:
                    return m, p
    return None, None


def _suspect_batches(namespace: Mapping[str, Any], held_ids: set[int],
                     other_than: str | None) -> list[tuple[str, str, Any, list[str]]]:  # fmt: skip
    """``(kind, name, batch, keys)`` of the batches holding a tensor the failing layer held (or, given
    ``other_than``, entries of a dtype other than the layer's); mappings and the batch holding the very tensor
    first."""
    found: list[tuple[str, str, Any, list[str]]] = []
    for name, batch in _batches(namespace):
        entries = list(named_inputs(batch))
        keys = [k for k, t in entries if id(t) in held_ids]
        if not keys and other_than is not None:
            keys = [k for k, t in entries if dtype_name(t.dtype) != other_than]
        if keys:
            kind = "mapping" if isinstance(batch, Mapping) else "tensor"
            found.append((kind, name, batch, [name] if kind == "tensor" else keys))
    found.sort(key=lambda f: (f[0] != "mapping", not any(id(t) in held_ids for _, t in named_inputs(f[2]))))
    return found


def crash_finding(
    pattern: str, frames: list, namespace: Mapping[str, Any], objects: tuple, live: Any
) -> Finding | None:
    """The ``batch-dtype-mismatch`` finding for a dtype error raised by a layer fed a batch entry of another dtype.

    ``frames`` are the traceback's frames (library frames included: the innermost ``self`` is the layer
    that raised); ``namespace`` the user's objects (the cell's or the frames' locals). The finding names the
    batch entry (identical to a tensor the layer held, else the entries in the wrong dtype), the layer by
    its path in the model, and offers the pre-hook and the dict cast, bound to ``live``.
    """
    if pattern not in DTYPE_PATTERNS:
        return None
    layer, held = _failing_layer(frames)
    layer_dtype = own_float_dtype(layer) if layer is not None else None
    model, path = _model_holding(layer, (*objects, *namespace.values()))
    if model is None or layer_dtype is None:
        return None
    model_name = next((k for k, v in namespace.items() if v is model and k.isidentifier()), "model")
    held_ids = {id(t) for t in held}
    # Without the very tensor in the failing frame, blame the batch only when the whole model is in one dtype:
    # a model mixing dtypes (an fp32 layer feeding a bf16 one) is mixed-param-dtypes, not the batch.
    uniform = len({p.dtype for p in model.parameters() if p.is_floating_point()}) == 1
    found = _suspect_batches(namespace, held_ids, layer_dtype if uniform else None)
    if not found:
        return None
    kind, name, batch, keys = found[0]
    dtype_of = dict((k, dtype_name(t.dtype)) for k, t in named_inputs(batch))
    bad = [BatchInput(k, dtype_of.get(k, dtype_of.get("input", "?")), path, type(layer).__name__, layer_dtype,
                      main_dtype(model)) for k in keys]  # fmt: skip
    model_ref = live.add(model)
    batch_ref = live.add(batch) if kind == "mapping" else 0
    where, msg = mismatch_message(model_name, bad, None, None)
    msg = msg.replace(
        " The forward ran only because it converts it; a GPU kernel or another layer may not.", ""
    )
    fixes = mismatch_fixes(model_name, model_ref, batch_ref, keys, layer_dtype, kind, name,
                           entries=((path, "forward"),) if path else ())  # the layer that raised: every entry reaches it
    for fx in fixes:
        fx.bind(live)
    return Finding(
        SLUG,
        "error",
        where,
        msg + " That is what raised this error.",
        {
            "inputs": {b.key: b.dtype for b in bad},  # a tensor batch's one entry is named by its variable
            "batch": name,
            "layer": path,
            "layer_class": type(layer).__name__,
            "layer_dtype": layer_dtype,
            "keep": keep_line(model_name, keys, kind, layer_dtype, name),
        },
        fixes,
    )
