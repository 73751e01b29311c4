"""A diagnosis' value scan (``diagnose(scan=True)``): which live tensors of the Facts' models and optimizers are
read, handed to the scan engine (:mod:`mpdoctor.objects.gathering.values`), and the Facts with their ``scans`` filled.

The Facts say what to scan (the models and optimizers gathered); the discovered subjects hold the live
tensors. Parameters shared between models, and optimizer state, are read once.
"""

from __future__ import annotations

from typing import Any

import torch

from .values import scan_objects


def _model_entries(model: torch.nn.Module, name: str, seen: set[int]) -> list[tuple[str, str, str, torch.Tensor]]:
    """``(module path, kind, full name, tensor)`` of each parameter not in ``seen`` and its grad, in
    ``named_modules()`` order.

    One loop over the ``_modules`` and ``_parameters`` dicts with a stack:
    ``named_modules``' recursive generators cost more than the scan itself on
    a model of many small modules.
    """
    entries: list[tuple[str, str, str, torch.Tensor]] = []
    append = entries.append
    parameter = torch.nn.Parameter
    visited: set[int] = set()
    stack: list[tuple[str, torch.nn.Module]] = [("", model)]
    while stack:
        mpath, mod = stack.pop()
        if id(mod) in visited:
            continue
        visited.add(id(mod))
        attrs = mod.__dict__
        params = attrs.get("_parameters")
        if params:
            base = f"{name}.{mpath}." if mpath else f"{name}."
            for pname, p in params.items():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                full = base + pname
                append((mpath, "param", full, p))
                # A Parameter is a leaf by construction; reading .grad of a non-leaf would warn.
                grad = p.grad if type(p) is parameter or p.is_leaf else None
                if grad is not None:
                    append((mpath, "grad", full + ".grad", grad))
        children = attrs.get("_modules")
        if children:
            prefix = mpath + "." if mpath else ""
            stack.extend((prefix + n, c) for n, c in reversed(children.items()) if c is not None)
    return entries


def _plans(facts: Any, subjects: Any = ()) -> list[tuple[str, str, list]]:
    """What to scan: ``(object, kind, [(module, tensor kind, name, tensor), ...])`` per model and optimizer.

    ``facts`` say what to scan; the live objects come from the discovered ``subjects``.
    """
    live = {s.name: s for s in subjects}
    plans: list[tuple[str, str, list]] = []
    seen: set[int] = set()
    for m in facts.models:
        if m.name in live:
            plans.append((m.name, "model", _model_entries(live[m.name].obj, m.name, seen)))
    if not facts.optimizers:
        return plans
    # param id -> (module path, full name): how optimizer state is labelled.
    owners = {id(e[3]): (e[0], e[2]) for _, _, entries in plans for e in entries if e[1] == "param"}
    for o in facts.optimizers:
        subject = live.get(o.name)
        inner = subject.inner if subject is not None else None
        state = inner.__dict__.get("state", {}) if inner is not None else {}
        groups = inner.__dict__.get("param_groups", []) if inner is not None else []
        entries = []
        index = 0
        for group in groups:
            for p in group.get("params", ()):
                st = state.get(p) if isinstance(state, dict) else None
                module, label = owners.get(id(p), ("", f"param {index}"))
                index += 1
                if not isinstance(st, dict):
                    continue
                for key, value in st.items():
                    if isinstance(value, torch.Tensor) and value.numel() > 1 and id(value) not in seen:
                        seen.add(id(value))
                        entries.append((module, "optimizer_state", f"{o.name}.state[{label}][{key!r}]", value))
        plans.append((o.name, "optimizer", entries))
    return plans


def fp16_in_play(facts: Any) -> bool:
    """True when something in the setup computes or stores in fp16 (so flush-to-zero counts matter)."""
    for p in facts.precisions:
        if "fp16" in (p.effective, p.requested, p.accelerator_mixed_precision, p.args.get("mixed_precision")):
            return True
    if "float16" in facts.runtime.autocast.values():
        return True
    if any(s.enabled for s in facts.scalers):
        return True
    if not facts.hardware.bf16_native:
        return True
    return any(m.tensors.param_dtype_counts().get("float16") for m in facts.models)


def scan_facts(
    facts: Any,
    subjects: Any = (),
    underflow: bool | str = "auto",
    chunk_elements: int | None = None,
    progress: bool | None = None,
) -> Any:
    """Return ``facts`` with ``scans`` filled: one :class:`ScanFacts` per model and optimizer.

    Parameters
    ----------
    facts : Facts
        Gathered facts (plain data).
    subjects : sequence of Subject
        The discovered subjects: the live objects scanned.
    underflow : bool or "auto"
        Count values that would flush to zero in fp16 / bf16. ``"auto"``: only
        when fp16 is in play (an fp16 setup, autocast, scaler, fp16 weights or
        a device without bf16), since it costs a second read of every tensor.
    chunk_elements : int, optional
        Elements per chunk; the default keeps scan buffers under :data:`mpdoctor.objects.gathering.values.TEMP_BUDGET`.
    progress : bool, optional
        Show a tqdm progress bar; default: when the scan reads more than 1 GB.
    """
    from ...facts import Facts

    if not subjects and (facts.models or facts.optimizers):
        raise ValueError("scan_facts needs the discovered subjects: facts hold no live tensors")
    if underflow == "auto":
        underflow = fp16_in_play(facts)
    scans = scan_objects(_plans(facts, subjects), underflow=bool(underflow), chunk_elements=chunk_elements, progress=progress)
    return Facts(**{**facts.__dict__, "scans": tuple(facts.scans) + scans})
