"""accelerate: the Accelerator (what it will autocast to, its shared GradScaler) and its wrappers.

``AcceleratedOptimizer`` wraps the user's optimizer and shares the
accelerator's scaler; ``prepare()`` replaces a model's ``forward`` with autocast
plus fp32 output conversion and keeps the original as ``_original_forward``.
The accelerator's mode lives in the process-wide ``AcceleratorState``
singleton; ``native_amp`` says whether it really autocasts (False for fp16 on a
CPU: the run is fp32 whatever the mode says).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MethodType
from typing import Any, NamedTuple

import torch

from ...compat import ACCELERATE_FP8_RECIPE_ATTRS, grad_scaler
from ...facts.fp8_training import AORecipeFacts, FP8RecipeFacts
from ...objects.edits.steps import Change, SetAttr, SetEnv
from ...objects.integrations import Integration, Unwrap
from ...objects.live.introspect import class_path, modules_where, own_dict, raw_attr

ACCELERATOR = "accelerate.accelerator.Accelerator"
ACCELERATED_OPTIMIZER = "accelerate.optimizer.AcceleratedOptimizer"


class AcceleratorView(NamedTuple):
    """What an accelerator will run: its mode, whether it autocasts, its scaler, its device type."""

    mixed_precision: str | None
    native_amp: bool | None
    scaler_enabled: bool | None
    device: str | None


def effective(acc: Any) -> AcceleratorView:
    """Read an Accelerator's precision state from its fields (no method is called)."""
    state = raw_attr(acc, "state", None)
    mp = raw_attr(state, "_mixed_precision", None) if state is not None else None
    if mp is None and state is not None:
        shared = raw_attr(state, "_shared_state", None)
        if isinstance(shared, dict):
            mp = shared.get("_mixed_precision")
    native = raw_attr(acc, "native_amp", None)
    scaler = raw_attr(acc, "scaler", None)
    scaler_enabled = bool(raw_attr(scaler, "_enabled", False)) if scaler is not None else False
    device = raw_attr(acc, "device", None)
    if device is None and state is not None:
        device = raw_attr(state, "device", None)
    dev_type = device.type if isinstance(device, torch.device) else None
    return AcceleratorView(
        str(mp) if mp is not None else None, bool(native) if native is not None else None, scaler_enabled, dev_type
    )


def fp8_requested_in_process() -> bool:
    """Whether this process asks accelerate for fp8: ``ACCELERATE_MIXED_PRECISION=fp8``, or an Accelerator made here
    whose shared state says fp8 (read from the state's fields; accelerate is never imported here)."""
    if os.environ.get("ACCELERATE_MIXED_PRECISION", "").lower() == "fp8":
        return True
    state_module = sys.modules.get("accelerate.state")
    shared = raw_attr(raw_attr(state_module, "AcceleratorState", None), "_shared_state", None)
    return isinstance(shared, dict) and str(shared.get("_mixed_precision", "")) == "fp8"


def _model_facts(outer: Any, inner: Any, inner_path: str, live: Any) -> dict:
    wrapped = any(own_dict(m).get("_original_forward") is not None for m in (outer, inner))
    prepared = wrapped or any(own_dict(m).get("_is_accelerate_prepared") is True for m in (outer, inner))
    out: dict = {"forward_wrapped": wrapped, "accelerate_prepared": prepared}
    # The Linears accelerate's fp8 (AO) could still convert matter only to a prepared model of a process that asks
    # for fp8 (fp8-requested-not-on); no other diagnosis walks them.
    candidates = _linear_candidates(outer) if prepared and fp8_requested_in_process() else ()
    if candidates:
        out["float8_candidates"] = candidates
    return out


def _linear_candidates(model: Any) -> tuple[tuple[str, int, int], ...]:
    """torch's own ``nn.Linear`` layers below the root, with their dims. Subclasses are left out: they carry a
    behaviour of their own (quantized storage, MultiheadAttention's ``out_proj`` read by its parent) that a float8
    training layer would drop."""
    try:
        found = modules_where(model, lambda cls: cls is torch.nn.Linear)
        return tuple((path, int(raw_attr(m, "in_features", 0)), int(raw_attr(m, "out_features", 0)))
                     for path, m in found if path)  # fmt: skip
    except Exception:  # a tree of another shape must not stop the report
        return ()



# -- live changes: what fixes do to an accelerator, in place --------------------------------------------

HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
ENV_VAR = "ACCELERATE_MIXED_PRECISION"


@dataclass
class LiveSetup:
    """The live arguments, accelerator and models of one precision setup."""

    args: Any
    args_name: str | None
    acc: Any
    acc_name: str | None
    models: list[tuple[str, Any]] = field(default_factory=list)

    def device(self) -> str:
        """The accelerator's device type (``cpu`` for arguments alone with ``use_cpu``)."""
        state = raw_attr(self.acc, "state", None) if self.acc is not None else None
        dev = raw_attr(state, "device", None) if state is not None else None
        if isinstance(dev, torch.device):
            return dev.type
        if self.args is not None and raw_attr(self.args, "use_cpu", False):
            return "cpu"
        return "cuda" if torch.cuda.is_available() else "cpu"


class DictPatch(Change):
    """Edit some keys of an object's ``__dict__``; undo restores exactly those keys (value or absence)."""

    def __init__(self, obj: Any, keys: tuple[str, ...], edit: Callable[[dict], None], description: str) -> None:
        self.obj, self.keys, self.edit, self.description = obj, keys, edit, description
        self._saved: dict[str, Any] = {}
        self._absent: set[str] = set()

    def apply(self) -> None:
        d = object.__getattribute__(self.obj, "__dict__")
        self._saved = {k: d[k] for k in self.keys if k in d}
        self._absent = {k for k in self.keys if k not in d}
        try:
            self.edit(d)
        except BaseException:
            self.revert()
            raise

    def revert(self) -> None:
        d = object.__getattribute__(self.obj, "__dict__")
        for k in self._absent:
            d.pop(k, None)
        d.update(self._saved)


def _unwrap(model: Any, d: dict) -> None:
    """Undo accelerate's autocast wrapper of ``forward`` (what ``extract_model_from_parallel`` does)."""
    original = d.pop("_original_forward")
    if isinstance(original, MethodType) and original.__self__ is model and original.__func__ is getattr(type(model), "forward", None):
        d.pop("forward", None)  # the class's forward again, as before prepare()
    else:
        d["forward"] = original


def _wrap(model: Any, d: dict, autocast: Callable[[], Any]) -> None:
    """Wrap ``forward`` in autocast and fp32 output conversion, as ``Accelerator.prepare_model`` does."""
    from accelerate.utils import convert_outputs_to_fp32

    forward = model.forward
    d["_original_forward"] = forward
    if hasattr(forward, "__func__"):
        inner = MethodType(autocast()(forward.__func__), model)
        d["forward"] = MethodType(convert_outputs_to_fp32(inner.__func__), model)
    else:
        d["forward"] = convert_outputs_to_fp32(autocast()(forward))


def _autocast_factory(acc: Any, precision: str, device: str) -> Callable[[], Any]:
    handler = raw_attr(acc, "autocast_handler", None)
    kwargs = handler.to_kwargs() if handler is not None and hasattr(handler, "to_kwargs") else {}
    return lambda: torch.autocast(device_type=device, dtype=HALF[precision], **kwargs)


def _give_scaler(opt: Any, scaler: Any) -> Callable[[dict], None]:
    def edit(d: dict) -> None:
        from accelerate.optimizer import patch_optimizer_step

        inner = d["optimizer"]
        d["scaler"] = scaler
        d["_accelerate_step_called"] = False
        d["_optimizer_original_step_method"] = inner.step
        d["_optimizer_patched_step_method"] = patch_optimizer_step(opt, inner.step)

    return edit


_OPT_SCALER_KEYS = ("scaler", "_accelerate_step_called", "_optimizer_original_step_method", "_optimizer_patched_step_method")


def precision_changes(
    live: LiveSetup, precision: str, native: bool, flags: dict | None = None, env: bool = True
) -> list[Change]:
    """The changes that make ``live`` run in ``precision`` (autocasting iff ``native``), from its state now.

    Parameters
    ----------
    live
        The setup's live objects.
    precision
        ``"no"``, ``"fp16"`` or ``"bf16"``: the accelerator mode and ``args.mixed_precision`` to set.
    native
        Whether the accelerator really autocasts (``native_amp``).
    flags
        ``TrainingArguments`` fields to set as well (``{"fp16": False, "bf16": True}``).
    env
        Remove an ``ACCELERATE_MIXED_PRECISION`` that says something else.
    """
    changes = _args_changes(live, precision, flags or {})
    if env and os.environ.get(ENV_VAR) not in (None, precision):
        changes.append(SetEnv(ENV_VAR, None))
    acc = live.acc
    if acc is None:
        return changes
    before = raw_attr(raw_attr(acc, "state", None), "_mixed_precision", None)
    changes += _mode_changes(live, acc, precision, native)
    changes += _scaler_changes(live, acc, native and precision == "fp16")
    changes += _forward_changes(live, acc, precision, native, before)
    return changes


def _args_changes(live: LiveSetup, precision: str, flags: dict) -> list[Change]:
    """``TrainingArguments``' flags and ``mixed_precision`` set to what the precision asks."""
    args = live.args
    if args is None:
        return []
    changes: list[Change] = [
        SetAttr(args, key, value, f"{live.args_name}.{key}")
        for key, value in flags.items()
        if raw_attr(args, key, None) != value
    ]
    if raw_attr(args, "mixed_precision", None) != precision:
        changes.append(SetAttr(args, "mixed_precision", precision, f"{live.args_name}.mixed_precision"))
    return changes


def _mode_changes(live: LiveSetup, acc: Any, precision: str, native: bool) -> list[Change]:
    """The accelerator state's mode and the accelerator's ``native_amp``."""
    changes: list[Change] = []
    state = raw_attr(acc, "state", None)
    if state is not None and raw_attr(state, "_mixed_precision", None) != precision:
        changes.append(SetAttr(state, "_mixed_precision", precision, f"{live.acc_name}.state._mixed_precision"))
    if bool(raw_attr(acc, "native_amp", False)) != native:
        changes.append(SetAttr(acc, "native_amp", native, f"{live.acc_name}.native_amp"))
    return changes


def _scaler_changes(live: LiveSetup, acc: Any, want_scaler: bool) -> list[Change]:
    """The accelerator's GradScaler enabled iff wanted; a new one, given to its optimizers, when it has none."""
    scaler = raw_attr(acc, "scaler", None)
    if scaler is not None:
        if bool(raw_attr(scaler, "_enabled", False)) == want_scaler:
            return []
        # Shared with every AcceleratedOptimizer: mutate, never rebind.
        return [SetAttr(scaler, "_enabled", want_scaler, f"{live.acc_name}.scaler._enabled")]
    if not want_scaler:
        return []
    handler = raw_attr(acc, "scaler_handler", None)
    kwargs = handler.to_kwargs() if handler is not None and hasattr(handler, "to_kwargs") else {}
    new = grad_scaler(live.device(), **kwargs)
    changes: list[Change] = [SetAttr(acc, "scaler", new, f"{live.acc_name}.scaler")]
    for opt in raw_attr(acc, "_optimizers", None) or ():
        if "optimizer" in _own(opt) and _own(opt).get("scaler") is None:
            changes.append(DictPatch(opt, _OPT_SCALER_KEYS, _give_scaler(opt, new), "give the optimizer the scaler"))
    return changes


def _forward_changes(live: LiveSetup, acc: Any, precision: str, native: bool, before: Any) -> list[Change]:
    """Each prepared model's forward wrapped in the autocast of ``precision`` iff ``native``; a wrapper made for
    another precision (``before``) is replaced."""
    changes: list[Change] = []
    device = live.device()
    for m in _accelerated_models(live, acc):
        d = _own(m)
        wrapped = d.get("_original_forward") is not None
        prepared = bool(d.get("_is_accelerate_prepared", False)) or wrapped
        stale = wrapped and (not native or before != precision)
        need = native and (stale or not wrapped) and prepared
        if not stale and not need:
            continue
        factory = _autocast_factory(acc, precision, device) if need else None

        def edit(d: dict, m: Any = m, stale: bool = stale, factory: Callable | None = factory) -> None:
            if stale:
                _unwrap(m, d)
            if factory is not None:
                _wrap(m, d, factory)

        what = ("re-wrap" if stale else "wrap") if need else "unwrap"
        changes.append(DictPatch(m, ("forward", "_original_forward"), edit, f"{what} {type(m).__name__}.forward"))
    return changes


def _accelerated_models(live: LiveSetup, acc: Any) -> list[Any]:
    """The accelerator's prepared models and the setup's models, each once."""
    models: list[Any] = []
    for m in list(raw_attr(acc, "_models", None) or ()) + [m for _n, m in live.models]:
        if isinstance(m, torch.nn.Module) and all(m is not x for x in models):
            models.append(m)
    return models


_own = own_dict



# -- TransformerEngine fp8 recipes held by accelerators ---------------------------------------------------

#: ``TERecipeKwargs.fp8_format`` when neither the argument nor ``ACCELERATE_FP8_FORMAT`` sets it (accelerate 1.15).
HANDLER_DEFAULT_FORMAT = "HYBRID"
#: What TE's recipes hold when they get no ``fp8_format`` (TE 2.x ``common/recipe``): ``MXFP8BlockScaling``
#: defaults to E4M3 for every tensor, ``DelayedScaling`` to HYBRID.
TE_DEFAULT_FORMAT = {True: "E4M3", False: "HYBRID"}
_RECIPE_ATTRS = ACCELERATE_FP8_RECIPE_ATTRS


def recipe_facts(acc: Any, name: str) -> list[FP8RecipeFacts]:
    """The TE recipes an accelerator holds, with the format TE will really run.

    accelerate builds TE's recipe at ``prepare()`` from ``handler.to_kwargs()``, which keeps only the fields
    that differ from a default handler built in a cleared environment (``KwargsHandler.to_kwargs``): an
    ``fp8_format`` of ``HYBRID`` is dropped, and TE's recipe keeps its own default. ``to_kwargs`` itself is
    not called here (it clears ``os.environ`` while it builds the default); the rule is applied to the fields.
    """
    out = []
    for attr in _RECIPE_ATTRS:
        handler = raw_attr(acc, attr, None)
        if handler is None:
            continue
        backend = raw_attr(handler, "backend", "TE")
        if not isinstance(backend, str) or backend.upper() != "TE":
            continue  # MS-AMP's recipe has no format to judge
        written = raw_attr(handler, "fp8_format", None)
        written = str(written).upper() if isinstance(written, str) else None
        block = raw_attr(handler, "use_mxfp8_block_scaling", False) is True
        passed = written if written not in (None, HANDLER_DEFAULT_FORMAT) else None
        out.append(
            FP8RecipeFacts(
                owner=f"{name}.{attr}",
                class_path=class_path(type(handler)),
                block_scaling=block,
                written_format=written,
                passed_format=passed,
                runs_format=passed or TE_DEFAULT_FORMAT[block],
            )
        )
    return out


# -- torchao fp8 recipes held by accelerators ---------------------------------------------------------------

#: Distributed types whose wrappers own the parameters (flat, sharded or partitioned): a layer swapped after
#: ``prepare()`` would not reach them.
_SHARDING = ("FSDP", "DEEPSPEED", "MEGATRON")


def ao_recipe_facts(acc: Any, name: str, live: Any) -> AORecipeFacts | None:
    """The torchao recipe ``acc`` holds (``ao_recipe_handler``), or None. Its fields are read; nothing is called."""
    handler = raw_attr(acc, "ao_recipe_handler", None)
    if handler is None:
        return None
    from ..torchao.integration import recipe_of

    config = raw_attr(handler, "config", None)
    kind = str(raw_attr(raw_attr(acc, "state", None), "distributed_type", "")).upper()
    return AORecipeFacts(
        owner=name,
        accelerator_ref=live.add(acc),
        user_filter=raw_attr(handler, "module_filter_func", None) is not None,
        recipe=recipe_of(config) if config is not None else "tensorwise",
        pad_inner_dim=bool(raw_attr(config, "pad_inner_dim", False)),
        sharded=any(k in kind for k in _SHARDING),
    )


def live_ao_config(acc: Any) -> Any:
    """The accelerator's own torchao ``Float8LinearConfig``, as ``prepare()`` would pass it to
    ``convert_to_float8_training``, with FSDP float8 all-gather off: on, ``Float8Linear.from_float`` wraps each
    weight in a new Parameter the optimizer does not hold; without FSDP it does nothing else."""
    import dataclasses

    config = raw_attr(raw_attr(acc, "ao_recipe_handler", None), "config", None)
    if config is None:
        from torchao.float8 import Float8LinearConfig

        config = Float8LinearConfig()
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=False)


def _facts(subjects: tuple, live: Any, hardware: Any) -> dict:
    recipes: list[FP8RecipeFacts] = []
    ao: list[AORecipeFacts] = []
    for s in subjects:
        if s.kind == "accelerator":
            try:
                recipes += recipe_facts(s.obj, s.name)
                held = ao_recipe_facts(s.obj, s.name, live)
            except Exception:  # a half-built accelerator: the rest of the report still stands
                continue
            if held is not None:
                ao.append(held)
    out: dict = {"fp8_recipes": tuple(recipes)} if recipes else {}
    if ao:
        out["ao_recipes"] = tuple(ao)
    return out


INTEGRATION = Integration(
    name="accelerate",
    modules=("accelerate",),
    kinds=((ACCELERATOR, "accelerator"),),
    optimizer_unwraps=(Unwrap(ACCELERATED_OPTIMIZER, "optimizer", ".optimizer"),),
    brings=((ACCELERATOR, ("scaler",)), (ACCELERATED_OPTIMIZER, ("scaler",))),
    model_facts=_model_facts,
    effective=effective,
    facts=_facts,
)
