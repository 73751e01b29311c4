"""torch.distributed, FSDP1, FSDP2 and accelerate's multi-process state: every semi-private read in one place.

- FSDP1 (``FullyShardedDataParallel``): ``fm.mixed_precision``, ``fm._handle`` (its
  ``flat_param`` dtype, ``_fwd_bwd_param_dtype``, ``_reduce_dtype``).
- FSDP2 (``fully_shard``): the policy is readable only through ``module._get_fsdp_state()``,
  its ``_fsdp_param_group`` (``mp_policy``, ``fsdp_params``); a param's ``orig_dtype`` is
  set lazily at the first forward, before which the sharded parameter's dtype is the original.
- accelerate: ``AcceleratorState`` / ``PartialState`` shared state (``distributed_type``,
  ``num_processes``, ``backend``, ``fsdp_plugin``); a Trainer's ``args.fsdp`` / ``fsdp_config``.
- the default process group's store (``_get_default_store``), which the cross-rank exchange uses.

Every read is guarded: a layout these versions do not have yields nothing, never an exception.
Tested against torch 2.13 and accelerate 1.15 (``tests/distributed/test_integration_distributed.py``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ...objects.integrations import Integration
from ...objects.live.introspect import is_a, modules_of, own_dict, raw_attr
from .facts import AcceleratorProcesses, FsdpUnit, PlannedWrap

FSDP1 = "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel"
FSDP2 = ("torch.distributed.fsdp.FSDPModule", "torch.distributed.fsdp._fully_shard._fully_shard.FSDPModule")
ACCELERATOR = "accelerate.accelerator.Accelerator"
TRAINING_ARGS = "transformers.training_args.TrainingArguments"
_EXAMPLES = 4


def _dt(dtype: Any) -> str | None:
    if dtype is None:
        return None
    text = str(dtype)
    return text[6:] if text.startswith("torch.") else text


def _fsdp1_unit(model: str, path: str, mod: Any) -> FsdpUnit | None:
    handle = raw_attr(mod, "_handle", None)
    flat = raw_attr(handle, "flat_param", None) if handle is not None else None
    mp = raw_attr(mod, "mixed_precision", None)
    if handle is None:
        return None
    dtypes = (_dt(flat.dtype),) if flat is not None else ()
    param_dtype = _dt(raw_attr(handle, "_fwd_bwd_param_dtype", None))
    reduce_dtype = _dt(raw_attr(handle, "_reduce_dtype", None))
    if param_dtype is None and mp is not None:
        param_dtype = _dt(raw_attr(mp, "param_dtype", None))
    if reduce_dtype is None and mp is not None:
        reduce_dtype = _dt(raw_attr(mp, "reduce_dtype", None))
    numel = int(flat.numel()) if flat is not None else 0
    return FsdpUnit(model, path, "fsdp1", dtypes, param_dtype, reduce_dtype, numel)


def _fsdp2_unit(model: str, path: str, mod: Any) -> FsdpUnit | None:
    get_state = getattr(type(mod), "_get_fsdp_state", None)
    if get_state is None:
        return None
    state = get_state(mod)
    # torch 2.13 keeps a list of param groups; earlier releases one group.
    groups = raw_attr(state, "_fsdp_param_groups", None)
    if groups is None:
        one = raw_attr(state, "_fsdp_param_group", None)
        groups = [one] if one is not None else []
    if not groups:  # a unit that manages no parameters of its own
        return None
    policy = raw_attr(groups[0], "mp_policy", None) or raw_attr(state, "_mp_policy", None)
    by_dtype: dict[str, list[str]] = {}
    numel = 0
    for fp in (fp for g in groups for fp in (raw_attr(g, "fsdp_params", None) or ())):
        orig = own_dict(fp).get("orig_dtype")
        sharded = raw_attr(fp, "sharded_param", None)
        name = _dt(orig if orig is not None else getattr(sharded, "dtype", None)) or "?"
        info = raw_attr(fp, "_module_info", None)
        owner = raw_attr(info, "module", None)
        pname = raw_attr(info, "param_name", "?")
        sub = next((p for p, m in mod.named_modules() if m is owner), "") if owner is not None else ""
        by_dtype.setdefault(name, []).append(f"{sub}.{pname}" if sub else str(pname))
        shape = raw_attr(fp, "_orig_size", None)
        try:
            numel += int(shape.numel()) if shape is not None else 0
        except Exception:
            pass
    examples = tuple((d, n) for d, names in sorted(by_dtype.items()) for n in names[:_EXAMPLES])
    return FsdpUnit(
        model,
        path,
        "fsdp2",
        tuple(sorted(by_dtype)),
        _dt(raw_attr(policy, "param_dtype", None)),
        _dt(raw_attr(policy, "reduce_dtype", None)),
        numel,
        examples,
    )


def fsdp_units(model: str, module: Any) -> tuple[FsdpUnit, ...]:
    """The FSDP units inside ``module`` (FSDP1 wrappers and FSDP2 ``fully_shard``-ed modules), root first."""
    if "torch.distributed.fsdp" not in sys.modules:
        return ()
    out: list[FsdpUnit] = []
    try:
        for path, mod in modules_of(module, (FSDP1, *FSDP2)):
            try:
                if is_a(mod, (FSDP1,)):
                    unit = _fsdp1_unit(model, path, mod)
                elif is_a(mod, FSDP2):
                    unit = _fsdp2_unit(model, path, mod)
                else:
                    continue
            except Exception:  # a layout these versions do not have
                continue
            if unit is not None:
                out.append(unit)
    except Exception:
        return tuple(out)
    return tuple(out)


def _shared(state_cls_path: str) -> dict:
    mod_name, _, cls_name = state_cls_path.rpartition(".")
    mod = sys.modules.get(mod_name)
    cls = getattr(mod, cls_name, None) if mod is not None else None
    shared = raw_attr(cls, "_shared_state", None) if cls is not None else None
    return shared if isinstance(shared, dict) else {}


def accelerator_processes(name: str, acc: Any) -> AcceleratorProcesses | None:
    """What an Accelerator says about its processes (read from accelerate's shared state, no property runs)."""
    if not is_a(acc, (ACCELERATOR,)):
        return None
    state = raw_attr(acc, "state", None)
    d = own_dict(state) if state is not None else {}
    partial = _shared("accelerate.state.PartialState")
    merged = {**partial, **d}
    dtype = merged.get("distributed_type")
    return AcceleratorProcesses(
        name,
        str(getattr(dtype, "value", dtype)),
        int(merged.get("num_processes", 1) or 1),
        int(merged.get("process_index", 0) or 0),
        merged.get("backend"),
    )


def _policy_dtypes(policy: Any) -> tuple[str | None, str | None]:
    if policy is None:
        return None, None
    if isinstance(policy, dict):
        return _dt(policy.get("param_dtype")), _dt(policy.get("reduce_dtype"))
    return _dt(raw_attr(policy, "param_dtype", None)), _dt(raw_attr(policy, "reduce_dtype", None))


def planned_wrap(name: str, obj: Any) -> PlannedWrap | None:
    """An FSDP wrap an Accelerator or TrainingArguments will perform, or None."""
    try:
        if is_a(obj, (ACCELERATOR,)):
            state = raw_attr(obj, "state", None)
            plugin = own_dict(state).get("fsdp_plugin") if state is not None else None
            procs = accelerator_processes(name, obj)
            if plugin is None and not (procs and procs.distributed_type == "FSDP"):
                return None
            version = raw_attr(plugin, "fsdp_version", None) if plugin is not None else None
            pd, rd = _policy_dtypes(raw_attr(plugin, "mixed_precision_policy", None) if plugin is not None else None)
            return PlannedWrap(name, f"fsdp{version}" if version else None, pd, rd)
        if is_a(obj, (TRAINING_ARGS,)):
            fsdp = raw_attr(obj, "fsdp", None)
            if not fsdp:
                return None
            config = raw_attr(obj, "fsdp_config", None) or {}
            version = config.get("version", config.get("fsdp_version")) if isinstance(config, dict) else None
            return PlannedWrap(name, f"fsdp{version}" if version else None)
    except Exception:
        return None
    return None


def launcher_state() -> dict:
    """The notebook_launcher pitfalls, read in the parent process (nothing is initialised by reading)."""
    # ``import accelerate`` imports its launchers: what counts is notebook_launcher held in the user's namespace.
    launchers = sys.modules.get("accelerate.launchers")
    launcher = raw_attr(launchers, "notebook_launcher", None) if launchers is not None else None
    main = own_dict(sys.modules.get("__main__"))
    held = launcher is not None and any(v is launcher for v in list(main.values()))
    out = {"launcher_imported": held, "accelerator_state_initialized": False, "cuda_initialized": False}
    if "accelerate.state" in sys.modules:
        out["accelerator_state_initialized"] = bool(_shared("accelerate.state.AcceleratorState"))
    torch = sys.modules.get("torch")
    try:
        out["cuda_initialized"] = bool(torch.cuda.is_initialized()) if torch is not None else False
    except Exception:
        pass
    return out


def process_group() -> dict:
    """The default process group as plain values (public torch.distributed API)."""
    out: dict = {}
    for key in ("WORLD_SIZE", "RANK"):
        try:
            out[f"env_{key.lower()}"] = int(os.environ[key]) if key in os.environ else None
        except ValueError:
            out[f"env_{key.lower()}"] = None
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            out.update(initialized=True, rank=dist.get_rank(), world_size=dist.get_world_size(),
                       backend=str(dist.get_backend()))  # fmt: skip
    except Exception:
        pass
    return out


def default_store() -> Any:
    """The default process group's key-value store (semi-private in torch 2.13), or None."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:
        return None


#: Declared for the registry's shape; not listed in ``MODULES``: it adds no subject kinds, and its readers are
#: called by :func:`mpdoctor.libraries.distributed.facts.gather_distributed`.
INTEGRATION = Integration(name="torch.distributed", modules=("torch",))
