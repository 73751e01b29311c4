"""Lightning: ``Trainer`` (``lightning.pytorch`` and ``pytorch_lightning``) and ``Fabric``, and their precision plugins.

A Trainer brings its LightningModule, its optimizers and its precision plugin's
GradScaler; a Fabric brings its precision plugin's GradScaler. Precision is one
plugin object per recipe: ``trainer.precision_plugin`` (``MixedPrecision`` for
``*-mixed``: autocast over fp32 weights, a GradScaler for ``16-mixed``;
``HalfPrecision`` for ``*-true``: weights and inputs cast to half;
``Precision`` for ``32-true``), ``fabric._precision`` for Fabric.

``Trainer(precision=...)`` is not stored verbatim. The accelerator connector
keeps the unified flag in ``_precision_flag`` (Fabric: ``_precision_input``),
and overwrites it in the one case where it replaces the request: ``16-mixed``
on a CPU becomes ``bf16-mixed`` with a warning. Every read of that
semi-private state is here, guarded, and tested against the installed
Lightning (2.6).
"""

from __future__ import annotations

from typing import Any

import torch

from ...objects.edits.steps import CastParams, Change, SetAttr, SetItem, cast_tensor
from ...objects.integrations import Integration, Unwrap
from ...objects.live.introspect import is_a, raw_attr, type_name
from .facts import LightningPrecisionFacts, lightning_effective, unify

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")
TRAINERS = tuple(f"{ns}.trainer.trainer.Trainer" for ns in NAMESPACES)
FABRICS = ("lightning.fabric.fabric.Fabric", "lightning_fabric.fabric.Fabric")
LIGHTNING_OPTIMIZERS = tuple(f"{ns}.core.optimizer.LightningOptimizer" for ns in NAMESPACES)
LIGHTNING_MODULES = tuple(f"{ns}.core.module.LightningModule" for ns in NAMESPACES)
#: torch's stock optimizers a ``configure_optimizers`` may name, by the name it calls them with.
_STOCK_OPTIMIZERS = {"Adam": "torch.optim.adam.Adam", "AdamW": "torch.optim.adamw.AdamW", "SGD": "torch.optim.sgd.SGD"}


def _dtype_name(value: Any) -> str | None:
    text = str(value) if value is not None else None
    return text.replace("torch.", "") if text and text.startswith("torch.") else None


def plugin_of(obj: Any) -> Any:
    """The precision plugin of a Trainer (``strategy.precision_plugin``) or a Fabric (``_precision``)."""
    if is_a(obj, FABRICS):
        return raw_attr(obj, "_precision", None)
    strategy = raw_attr(obj, "_accelerator_connector", None)
    strategy = raw_attr(strategy, "strategy", None) if strategy is not None else None
    if strategy is None:
        return None
    return raw_attr(strategy, "_precision_plugin", None)


def _strategy_of(trainer: Any) -> Any:
    connector = raw_attr(trainer, "_accelerator_connector", None)
    return raw_attr(connector, "strategy", None) if connector is not None else None


def mixed_plugin_changes(trainer: Any, name: str, precision: str, half: torch.dtype) -> list[Change]:
    """The steps that make a built Trainer run as ``Trainer(precision=precision)`` (``"bf16-mixed"``) would have
    from the start: its ``HalfPrecision`` plugin replaced, where Lightning keeps it (the strategy's
    ``_precision_plugin``, the accelerator connector's ``precision_plugin`` and ``_precision_flag``), by the
    ``MixedPrecision(precision, device)`` its connector builds, and, after a ``fit`` converted the LightningModule to
    ``half``, its floating parameters (with their grads and optimizer state), buffers and ``dtype`` back in fp32.

    Raises ValueError for a plugin the swap would not keep whole: a strategy's own (FSDP, DeepSpeed) or a Fabric's.
    """
    import importlib

    connector = raw_attr(trainer, "_accelerator_connector", None)
    strategy = _strategy_of(trainer)
    old = raw_attr(strategy, "_precision_plugin", None)
    steps: list[Change] = []
    if not (type_name(old) == "MixedPrecision" and raw_attr(old, "precision", None) == precision):
        if type_name(old) != "HalfPrecision" or connector is None:
            raise ValueError(f"{name} runs the {type_name(old)} plugin: only a HalfPrecision plugin is swapped in place")
        namespace = "pytorch_lightning" if type(trainer).__module__.startswith("pytorch_lightning") else "lightning.pytorch"
        flag = raw_attr(connector, "_accelerator_flag", None)
        device = flag if flag in ("cpu", "mps") else "cuda"  # as the connector chooses the autocast device
        new = importlib.import_module(f"{namespace}.plugins.precision").MixedPrecision(precision, device)
        held = [(strategy, "_precision_plugin", f"{name}.strategy.precision_plugin"),
                (connector, "precision_plugin", f"{name}._accelerator_connector.precision_plugin")]  # fmt: skip
        if raw_attr(connector, "_precision_plugin_flag", None) is old:  # passed as plugins=[...]
            held.append((connector, "_precision_plugin_flag", f"{name}._accelerator_connector._precision_plugin_flag"))
        for obj, attr, label in held:
            step = SetAttr(obj, attr, new, label)
            step.description = f"{label} = MixedPrecision({precision!r}, {device!r})"
            steps.append(step)
        steps.append(SetAttr(connector, "_precision_flag", precision, f"{name}._accelerator_connector._precision_flag"))
    module = raw_attr(strategy, "_lightning_module", None)
    if isinstance(module, torch.nn.Module):
        steps += _module_back_to_fp32(module, f"{name}.lightning_module", half, raw_attr(strategy, "_optimizers", None) or ())
    return steps


def _module_back_to_fp32(module: torch.nn.Module, label: str, half: torch.dtype, optimizers: Any) -> list[Change]:
    """Undo what ``HalfPrecision.convert_module`` (``module.to(half)``) did: parameters, buffers, ``module.dtype``."""
    params = [p for p in module.parameters() if p.dtype == half]
    steps: list[Change] = [CastParams(params, torch.float32, list(optimizers), f"{label} parameters")] if params else []
    for path, sub in module.named_modules():
        buffers = object.__getattribute__(sub, "_buffers")
        for key, buf in list(buffers.items()):
            if isinstance(buf, torch.Tensor) and buf.dtype == half:
                step = SetItem(buffers, key, cast_tensor(buf, torch.float32), f"{label}.{path or ''}{key}")
                step.description = f"cast {label}{'.' + path if path else ''}.{key} to float32"
                steps.append(step)
        if raw_attr(sub, "_dtype", None) == half:  # Lightning's DeviceDtypeModuleMixin: what module.dtype says
            steps.append(SetAttr(sub, "_dtype", torch.float32, f"{label}{'.' + path if path else ''}.dtype"))
    return steps


def mixed_plugin_problem(trainer: Any, precision: str, half: torch.dtype) -> str | None:
    """After :func:`mixed_plugin_changes`: None when the Trainer runs ``precision`` with its module in fp32."""
    plugin = plugin_of(trainer)
    if type_name(plugin) != "MixedPrecision" or raw_attr(plugin, "precision", None) != precision:
        return f"the precision plugin is {type_name(plugin)}, not MixedPrecision({precision!r})"
    module = raw_attr(_strategy_of(trainer), "_lightning_module", None)
    left = [n for n, p in module.named_parameters() if p.dtype == half] if isinstance(module, torch.nn.Module) else []
    return f"{len(left)} parameters of the LightningModule are still {half}" if left else None


def requested_flag(obj: Any) -> str | None:
    """The precision flag the connector holds (the request, except when Lightning replaced it)."""
    connector = raw_attr(obj, "_connector" if is_a(obj, FABRICS) else "_accelerator_connector", None)
    if connector is None:
        return None
    given = raw_attr(connector, "_precision_instance" if is_a(obj, FABRICS) else "_precision_plugin_flag", None)
    if given is not None:  # plugins=[...]: the plugin is the request, and the flag keeps its "32-true" default
        flag = raw_attr(given, "precision", None)
        return flag if isinstance(flag, str) else None
    flag = raw_attr(connector, "_precision_input" if is_a(obj, FABRICS) else "_precision_flag", None)
    return unify(flag) if isinstance(flag, (str, int)) else None


def device_flag(obj: Any) -> str | None:
    """The accelerator the connector resolved (``"cpu"``, ``"cuda"``, ...)."""
    connector = raw_attr(obj, "_connector" if is_a(obj, FABRICS) else "_accelerator_connector", None)
    flag = raw_attr(connector, "_accelerator_flag", None) if connector is not None else None
    return flag if isinstance(flag, str) else None


def planned_optimizer(subject: Any, subjects: tuple) -> str | None:
    """The class path of the torch optimizer that ``configure_optimizers`` of the Trainer's LightningModule builds,
    read from its source (no user code runs), while the Trainer holds no optimizer yet (before ``fit``); None when
    it holds one, or the source names no stock torch optimizer. The module is the Trainer's own, else the one
    LightningModule among the subjects."""
    if any(s.owner == subject.name and s.kind == "optimizer" for s in subjects):
        return None
    modules = [s.obj for s in subjects if s.owner == subject.name and is_a(s.obj, LIGHTNING_MODULES)]
    modules = modules or [s.obj for s in subjects if s.owner is None and is_a(s.obj, LIGHTNING_MODULES)]
    if len(modules) != 1:
        return None
    return _named_optimizer(modules[0])


def _named_optimizer(module: Any) -> str | None:
    import ast
    import inspect
    import textwrap

    fn = next((k.__dict__["configure_optimizers"] for k in type.__getattribute__(type(module), "__mro__")
               if "configure_optimizers" in k.__dict__ and not k.__module__.startswith(("lightning", "pytorch_lightning"))),
              None)  # fmt: skip
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn))) if fn is not None else None
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in _STOCK_OPTIMIZERS:
                return _STOCK_OPTIMIZERS[name]
    return None


def precision_facts(subject: Any, subjects: tuple, hw: Any) -> LightningPrecisionFacts:
    """Read one Trainer's or Fabric's precision into plain facts (on ``hw``, the live device or a ``target=``)."""
    obj = subject.obj
    plugin = plugin_of(obj)
    requested = requested_flag(obj)
    effective = raw_attr(plugin, "precision", None) if plugin is not None else None
    effective = effective if isinstance(effective, str) else None
    device = device_flag(obj)
    if not hw.live and requested is not None:
        # A what-if: Lightning's connector rule applied to the target's device.
        device = hw.kind
        effective = lightning_effective(requested, device)
    scaler = raw_attr(plugin, "scaler", None) if plugin is not None else None
    return LightningPrecisionFacts(
        name=subject.name,
        kind="fabric" if is_a(obj, FABRICS) else "trainer",
        requested=requested,
        effective=effective,
        plugin=type_name(plugin) if plugin is not None else "?",
        input_dtype=_dtype_name(raw_attr(plugin, "_desired_input_dtype", None)) if plugin is not None else None,
        scaler_enabled=bool(raw_attr(scaler, "_enabled", False)) if scaler is not None else None,
        device=device,
        model_names=tuple(s.name for s in subjects if s.owner == subject.name and s.kind == "model"),
        optimizer_names=tuple(s.name for s in subjects if s.owner == subject.name and s.kind == "optimizer"),
        ref=id(obj),
        planned_optimizer=planned_optimizer(subject, subjects),
    )


def _setup_facts(subjects: tuple, hw: Any) -> dict:
    out = []
    for s in subjects:
        if s.kind == "trainer" and is_a(s.obj, TRAINERS + FABRICS):
            try:
                out.append(precision_facts(s, subjects, hw))
            except Exception:  # a half-built Trainer: the rest of the report still stands
                continue
    return {"lightning": tuple(out)} if out else {}


INTEGRATION = Integration(
    name="lightning",
    modules=(),
    any_modules=("lightning", "pytorch_lightning", "lightning_fabric"),
    kinds=tuple((t, "trainer") for t in TRAINERS + FABRICS),
    optimizer_unwraps=tuple(Unwrap(o, "_optimizer", "._optimizer") for o in LIGHTNING_OPTIMIZERS),
    brings=tuple((t, ("lightning_module", "optimizers", "precision_plugin.scaler")) for t in TRAINERS)
    + tuple((f, ("_precision.scaler",)) for f in FABRICS),
    facts=lambda subjects, live, hardware: _setup_facts(subjects, hardware),
)
