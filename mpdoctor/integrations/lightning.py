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

from ..facts.lightning import LightningPrecisionFacts, lightning_effective, unify
from ..live.introspect import is_a, raw_attr, type_name
from . import Integration, Unwrap

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


def requested_flag(obj: Any) -> str | None:
    """The precision flag the connector holds (the request, except when Lightning replaced it)."""
    connector = raw_attr(obj, "_connector" if is_a(obj, FABRICS) else "_accelerator_connector", None)
    if connector is None:
        return None
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
