"""What the probe's boundary trace says about the batch: the ``batch-dtype-mismatch`` finding, its fixes and the line to keep (pure functions of the probe's facts; the trace itself is :mod:`mpdoctor.attach.runtime.boundary`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ...facts.batch import BatchInput
from ...facts.location import python_path
from ..engine.changes import CastBatchItems, CastInputsHook
from ..engine.findings import Finding
from ..engine.fixes import Fix
from ..engine.rules import Applicability, Rule

#: The check slug of a batch entry whose dtype the receiving layer does not compute in.
SLUG = "batch-dtype-mismatch"


def keep_line(model: str, keys: list[str], batch_kind: str, dtype: str = "", batch: str = "batch") -> str:
    """The line of code that keeps the batch in the model's dtype (``torch.<dtype>`` when known: a plain
    ``nn.Module`` has no ``.dtype``)."""
    to = f"torch.{dtype}" if dtype else f"{model}.dtype"
    if batch_kind == "mapping":
        name = batch if batch.isidentifier() else "batch"
        return (f"{name} = {{k: v.to({to}) if v.is_floating_point() else v for k, v in {name}.items()}}"
                "  # ids and bool masks keep their dtype")  # fmt: skip
    key = keys[0] if keys else "x"
    name = key if key.isidentifier() else "x"
    return f"{name} = {name}.to({to})  # before {model}({name})"


def _hook_code(model: str, dtype: str) -> str:
    """The input-casting pre-hook as code that runs where the user's objects are (the fix applies the same)."""
    return (f"def cast_floating_inputs(module, args, kwargs):  # every call of {model}: floating inputs to {dtype}\n"
            f"    cast = lambda v: v.to(torch.{dtype}) if torch.is_tensor(v) and v.is_floating_point() else v\n"
            "    return tuple(map(cast, args)), {k: cast(v) for k, v in kwargs.items()}\n"
            f"{model}.register_forward_pre_hook(cast_floating_inputs, with_kwargs=True)")  # fmt: skip


def _entry_code(model: str, path: str, method: str) -> str:
    """The runnable line that casts at one more entry: a submodule's forward gets the pre-hook, a method a wrapper."""
    owner = python_path(".".join(x for x in (model, path) if x))
    if method in ("forward", "__call__"):
        return "" if owner == model else f"\n{owner}.register_forward_pre_hook(cast_floating_inputs, with_kwargs=True)"
    return (f"\n{owner}.{method} = (lambda call: lambda *args, **kwargs: call(*cast_floating_inputs(None, args, kwargs)[0], "
            f"**cast_floating_inputs(None, args, kwargs)[1]))({owner}.{method})  # {owner}.{method} casts its inputs too")


def _entry_names(model: str, entries: tuple[tuple[str, str], ...]) -> list[str]:
    """``vae.decode``, ``model.encoder``: how the user calls each entry other than the model's own forward."""
    names = []
    for path, method in entries:
        call = ".".join(x for x in (model, path) if x)
        name = call if method in ("forward", "__call__") else f"{call}.{method}"
        if name != model and name not in names:
            names.append(name)
    return names


def input_cast_fix(model: str, model_ref: int, dtype: str,
                   entries: tuple[tuple[str, str], ...] = ()) -> Fix:  # fmt: skip
    """The in-place input cast of ``model``: at its forward and at every entry the user calls (``entries``)."""
    names = _entry_names(model, entries)
    at = f"at {', '.join(names)} and its forward" if names else "at its forward"
    code = _hook_code(model, dtype) + "".join(_entry_code(model, path, method) for path, method in entries)
    return Fix(
        f"Cast {model}'s floating inputs to {dtype} {at} (ids and bool masks untouched)",
        code, applicability=Applicability.SAFE,
        changes=(CastInputsHook(model_ref, dtype, model, tuple(entries)),),
        recipe="cast-inputs-hook",
        cost="one cast per floating input per call",
    )


def mismatch_fixes(
    model: str, model_ref: int, batch_ref: int, keys: list[str], dtype: str, batch_kind: str, batch: str = "batch",
    entries: tuple[tuple[str, str], ...] = (),
) -> list[Fix]:
    """The fixes of a batch entry in the wrong dtype: the input cast at the model's entries, the batch cast in place."""
    line = keep_line(model, keys, batch_kind, dtype, batch)
    fixes = [input_cast_fix(model, model_ref, dtype, entries)]
    if batch_ref:
        fixes.append(
            Fix(
                f"Cast batch[{', '.join(repr(k) for k in keys)}] to {dtype} in place",
                line, applicability=Applicability.SAFE,
                changes=(CastBatchItems(batch_ref, tuple(keys), dtype),),
                recipe="cast-batch",
                cost="this batch only: the next one from the loader needs the line of code",
            )
        )
    return fixes


def mismatch_message(model: str, bad: list[BatchInput], raised: str | None, autocast: str | None) -> tuple[str, str]:
    first = bad[0]
    where = f"{model}.{first.layer}" if first.layer else model
    layer = (
        f"{where} ({first.layer_class}, weights {first.layer_dtype})"
        if first.layer
        else f"{model} ({first.model_dtype})"
    )
    names = ", ".join(f"`{b.key}` ({b.dtype})" for b in bad)
    msg = (f"The batch's {names} enter{'s' if len(bad) == 1 else ''} {layer} with nothing autocasting: the layer "
           f"computes in {first.target}, the input is {first.dtype}.")  # fmt: skip
    if raised:
        msg += f" That is what raised: {raised}"
    else:
        msg += " The forward ran only because it converts it; a GPU kernel or another layer may not."
    return where, msg


def _explaining_inputs(p: Any) -> tuple[list[BatchInput], str] | None:
    """The batch inputs in the wrong dtype and the dtype error they raised in the forward, or None."""
    inputs = tuple(getattr(p, "boundary", ()) or ())
    bad = [b for b in inputs if b.mismatched(p.autocast)]
    if not bad:
        return None
    e = p.error
    if e is None or not e.is_dtype_error or e.phase != "forward":
        return None  # the forward ran: the model converts these inputs itself (CLIP, ViT cast pixel_values)
    reached = [b for b in bad if b.layer is not None]
    return reached or bad, f"{e.exception}: {e.message}"


def batch_findings(p: Any, rule: Rule) -> Iterator[Finding]:
    """The ``batch-dtype-mismatch`` finding of one probe (:class:`~mpdoctor.attach.numerics.probe_facts.ProbeFacts`)."""
    explained = _explaining_inputs(p)
    if explained is None:
        return
    bad, raised = explained
    where, msg = mismatch_message(p.model, bad, raised, p.autocast)
    dtype = bad[0].target
    kind = "mapping" if getattr(p, "batch_kind", "") == "mapping" else "tensor"
    yield rule.finding(
        where,
        msg,
        {
            "inputs": {b.key: b.dtype for b in bad},
            "layer": bad[0].layer,
            "layer_class": bad[0].layer_class,
            "layer_dtype": bad[0].layer_dtype,
            "model_dtype": bad[0].model_dtype,
            "autocast": p.autocast,
            "exception": raised,
            "keep": keep_line(p.model, [b.key for b in bad], kind),
        },
        mismatch_fixes(
            p.model, getattr(p, "model_ref", 0), getattr(p, "batch_ref", 0), [b.key for b in bad], dtype, kind,
            entries=receiving_layers(bad, dtype),
        ),
    )


def receiving_layers(bad: list, dtype: str) -> tuple[tuple[str, str], ...]:
    """``(path, "forward")`` of each layer that met a mistyped input and computes in ``dtype``: the cast sits where
    the failure is, so it holds for every way the user reaches that layer (``model.generate``, ``vae.encode``, a
    submodule called directly), not only for the model's own forward."""
    return tuple(dict.fromkeys((b.layer, "forward") for b in bad if b.layer and b.target == dtype))


def batch_explains(p: Any) -> bool:
    """True when the probe's dtype error is explained by a batch input in the wrong dtype."""
    return _explaining_inputs(p) is not None
