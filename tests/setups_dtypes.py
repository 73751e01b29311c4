"""Helpers for the dtype, scaler and cache specs: exact-state snapshots and the no-alarm assertion."""

from __future__ import annotations

from typing import Any

import torch


def tensor_state(model: torch.nn.Module | None = None, *optimizers: Any) -> dict:
    """Every tensor a fix may touch, by name: parameter data, grads and optimizer state, plus identities.

    Values are ``(object id, dtype, clone)``; comparing two snapshots with
    :func:`assert_same_state` checks the bytes, the dtypes and that the
    Parameter / grad objects are the very same Python objects.
    """
    out: dict[str, tuple] = {}
    names: dict[int, str] = {}
    if model is not None:
        for name, p in model.named_parameters():
            names[id(p)] = name
            out[f"param:{name}"] = (id(p), p.dtype, p.detach().clone())
            if p.grad is not None:
                out[f"grad:{name}"] = (id(p.grad), p.grad.dtype, p.grad.detach().clone())
    for i, opt in enumerate(optimizers):
        for p, st in opt.state.items():
            for key, value in st.items():
                if isinstance(value, torch.Tensor):
                    out[f"opt{i}:{names.get(id(p), id(p))}:{key}"] = (id(value), value.dtype, value.clone())
    return out


def assert_same_state(before: dict, after: dict, same_objects: bool = False) -> None:
    """Both snapshots hold the same names, dtypes and bytes (and object ids when ``same_objects``)."""
    assert before.keys() == after.keys()
    for key, (oid, dtype, value) in before.items():
        oid2, dtype2, value2 = after[key]
        assert dtype2 == dtype, key
        assert torch.equal(value2, value), key
        if same_objects:
            assert oid2 == oid, key


def alarms(report) -> list[str]:
    """Every error and warning of a report, as ``"slug: message"`` lines (empty when healthy)."""
    return [f"{f.check}: {f.message}" for f in report.findings if f.severity in ("error", "warning")]


def finite(x: float) -> bool:
    """True for a finite float."""
    return bool(torch.isfinite(torch.tensor(x)))
