"""DeepSpeed: the engine, and the DeepSpeed configs that TrainingArguments and accelerate hold.

The one place mpdoctor reads DeepSpeed's (and the HF DeepSpeed integration's)
semi-private state, always through :func:`~mpdoctor.objects.live.introspect.raw_attr`, never
by calling a method:

- ``DeepSpeedEngine``: ``engine._config`` (``float16_config.enabled``,
  ``bfloat16_config.enabled``, ``zero_config.stage``, ``communication_data_type``;
  the engine's ``bfloat16_enabled()`` / ``fp16_enabled()`` / ``communication_data_type``
  read exactly these fields), ``engine.optimizer`` (the ZeRO / bf16 / fp16
  optimizer: its ``loss_scaler`` and fp32 master partitions), ``engine.module``.
- ``TrainingArguments(deepspeed=cfg)``: ``args.hf_deepspeed_config`` (an
  ``HfTrainerDeepSpeedConfig``: ``.config`` is the dict DeepSpeed will get, with
  ``"auto"`` already resolved from the arguments; ``.mismatches`` the lines
  ``trainer.train()`` raises with).
- accelerate: ``accelerator.state.deepspeed_plugins`` (one ``DeepSpeedPlugin`` or a
  dict of them, the active one ``selected``); ``plugin.hf_ds_config``. A Trainer
  built from such arguments shares the arguments' ``HfTrainerDeepSpeedConfig``.

Tested against deepspeed 0.19.8, transformers 5.23 and accelerate 1.15.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...objects.edits.steps import Change, same_value
from ...objects.integrations import Integration, Unwrap
from ...objects.live.introspect import is_a, raw_attr
from .facts import DeepSpeedFacts

ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"
TRAINER = "transformers.trainer.Trainer"
TRAINING_ARGS = "transformers.training_args.TrainingArguments"
ACCELERATOR = "accelerate.accelerator.Accelerator"

#: The HF integration's mismatch lines that concern precision (``fill_match("fp16.enabled", ...)``).
PRECISION_KEYS = ("fp16.enabled", "bf16.enabled")


def _dtype_name(value: Any) -> str | None:
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, str):
        return {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(value, value)
    return None


def _enabled(cfg: dict, key: str) -> bool | str | None:
    section = cfg.get(key)
    if isinstance(section, dict):
        value = section.get("enabled", False)
        return value if value == "auto" else bool(value)
    if key == "bf16" and isinstance(cfg.get("bfloat16"), dict):  # DeepSpeed's older spelling
        return _enabled({"bf16": cfg["bfloat16"]}, "bf16")
    return None


def _zero_stage(cfg: dict) -> int | None:
    zero = cfg.get("zero_optimization")
    if isinstance(zero, dict):
        stage = zero.get("stage", 0)
        return int(stage) if isinstance(stage, (int, float)) and not isinstance(stage, bool) else None
    return 0 if zero is None else None


def _split_mismatches(lines: Any) -> tuple[tuple[str, ...], int]:
    if not isinstance(lines, list):
        return (), 0
    texts = [x for x in lines if isinstance(x, str)]
    precision = tuple(x for x in texts if any(x.startswith(f"- ds {k}=") for k in PRECISION_KEYS))
    return precision, len(texts) - len(precision)


def _args_precision(args: Any) -> tuple[bool | None, bool | None]:
    if args is None:
        return None, None
    fp16 = bool(raw_attr(args, "fp16", False)) or bool(raw_attr(args, "fp16_full_eval", False))
    bf16 = bool(raw_attr(args, "bf16", False)) or bool(raw_attr(args, "bf16_full_eval", False))
    return fp16, bf16


def active_plugin(state: Any) -> Any:
    """The selected ``DeepSpeedPlugin`` of an ``AcceleratorState`` (read from its fields), or None."""
    plugins = raw_attr(state, "deepspeed_plugins", None)
    if isinstance(plugins, dict):
        return next((p for p in plugins.values() if raw_attr(p, "selected", False)), None)
    return plugins


def _config_facts(name: str, source: str, path: str, hf: Any, args: Any, args_name: str | None, live: Any,
                  obj: Any, mp: str | None = None, state: Any = None) -> DeepSpeedFacts | None:
    cfg = raw_attr(hf, "config", None)
    if not isinstance(cfg, dict):
        return None
    mismatches = raw_attr(hf, "mismatches", None)
    precision, others = _split_mismatches(mismatches)
    args_fp16, args_bf16 = _args_precision(args)
    if args is None and mp is not None:
        args_fp16, args_bf16 = mp == "fp16", mp == "bf16"
    live.add(obj)
    live.add(cfg)
    for part in (args, state):
        if part is not None:
            live.add(part)
    if isinstance(mismatches, list):
        live.add(mismatches)
    return DeepSpeedFacts(
        name=name,
        source=source,
        config_path=path,
        fp16=_enabled(cfg, "fp16"),
        bf16=_enabled(cfg, "bf16"),
        zero_stage=_zero_stage(cfg),
        communication_data_type=_dtype_name(cfg.get("communication_data_type")),
        args_fp16=args_fp16,
        args_bf16=args_bf16,
        args_name=args_name,
        mismatches=precision,
        ref=id(obj),
        config_ref=id(cfg),
        config_refs=(id(cfg),),
        mismatches_refs=(id(mismatches),) if isinstance(mismatches, list) else (),
        args_ref=id(args) if args is not None else 0,
        state_ref=id(state) if state is not None else 0,
    )


def loss_scaler_facts(scaler: Any) -> dict:
    """The loss scale fields of a DeepSpeed ``LossScaler`` / ``DynamicLossScaler`` (plain values)."""
    if scaler is None:
        return {}
    cur = raw_attr(scaler, "cur_scale", None)
    out: dict = {"dynamic_loss_scale": bool(raw_attr(scaler, "dynamic", False))}
    if isinstance(cur, (int, float)):
        out["loss_scale"] = float(cur)
    low = raw_attr(scaler, "min_scale", None)
    if isinstance(low, (int, float)):
        out["min_loss_scale"] = float(low)
    hyst = raw_attr(scaler, "cur_hysteresis", None)
    if isinstance(hyst, int):
        out["loss_scale_hysteresis"] = hyst
    return out


#: Attributes holding the fp32 master partitions: ZeRO 1/2, ZeRO 3, BF16_Optimizer, FP16_Optimizer.
MASTER_GROUPS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition", "fp32_groups_flat")


def _master(optimizer: Any) -> tuple[str | None, int]:
    for attr in MASTER_GROUPS:
        groups = raw_attr(optimizer, attr, None)
        if isinstance(groups, list) and groups:
            dtypes = {_dtype_name(t.dtype) for t in groups if isinstance(t, torch.Tensor)}
            if len(dtypes) == 1:
                return dtypes.pop(), len(groups)
    return None, 0


def _module_dtype(module: Any) -> str | None:
    if not isinstance(module, torch.nn.Module):
        return None
    dtypes = set()
    for p in module.parameters():
        if p.is_floating_point():
            dtypes.add(_dtype_name(p.dtype))
        if len(dtypes) > 1:
            return "mixed"
    return dtypes.pop() if dtypes else None


def engine_facts(name: str, engine: Any, live: Any) -> DeepSpeedFacts | None:
    """The precision facts of a live ``DeepSpeedEngine``, read from ``engine._config`` and its optimizer."""
    config = raw_attr(engine, "_config", None)
    if config is None:
        return None
    fp16 = raw_attr(raw_attr(config, "float16_config", None), "enabled", None)
    bf16 = raw_attr(raw_attr(config, "bfloat16_config", None), "enabled", None)
    stage = raw_attr(raw_attr(config, "zero_config", None), "stage", None)
    comm = raw_attr(config, "communication_data_type", None)
    # DeepSpeedEngine.communication_data_type: the config's, else the training dtype.
    comm_name = _dtype_name(comm) or ("float16" if fp16 else "bfloat16" if bf16 else "float32")
    optimizer = raw_attr(engine, "optimizer", None)
    master_dtype, partitions = _master(optimizer) if optimizer is not None else (None, 0)
    modules = raw_attr(engine, "_modules", None)
    module = modules.get("module") if isinstance(modules, dict) else None
    live.add(engine)
    return DeepSpeedFacts(
        name=name,
        source="engine",
        config_path=f"{name}._config",
        fp16=bool(fp16) if fp16 is not None else None,
        bf16=bool(bf16) if bf16 is not None else None,
        zero_stage=int(stage) if isinstance(stage, int) else None,
        communication_data_type=comm_name,
        master_dtype=master_dtype,
        master_partitions=partitions,
        module_dtype=_module_dtype(module),
        ref=id(engine),
        **loss_scaler_facts(raw_attr(optimizer, "loss_scaler", None) if optimizer is not None else None),
    )


def gather(subjects: tuple, live: Any, hardware: Any) -> dict:
    """Every DeepSpeed setup among ``subjects``: engines, and configs not yet turned into one."""
    engines = [s for s in subjects if s.kind == "model" and is_a(s.obj, (ENGINE,))]
    engine_ids = {id(s.obj) for s in engines}
    out: list[DeepSpeedFacts] = [f for f in (engine_facts(s.name, s.obj, live) for s in engines) if f is not None]
    seen_configs: set[int] = set()
    # A Trainer's config first: the one train() will use (its accelerator's plugin; usually the arguments' own).
    trainers = [s for s in subjects if s.kind == "trainer"]
    for s in (*trainers, *(s for s in subjects if s.kind in ("training_args", "accelerator"))):
        if s.kind == "trainer":
            facts = _trainer_config(s, engine_ids, seen_configs, live)
        else:
            facts = _held_config(s, seen_configs, live)
        if facts is not None:
            seen_configs.update(facts.config_refs)
            out.append(facts)
    if not out:
        return {}
    fp16_ok, bf16_ok = device_support(hardware)
    name = raw_attr(hardware, "name", None)
    return {"deepspeed": tuple(dataclasses.replace(f, device_fp16=fp16_ok, device_bf16=bf16_ok, device=name) for f in out)}


def _trainer_config(s: Any, engine_ids: set[int], seen_configs: set[int], live: Any) -> DeepSpeedFacts | None:
    """The config a Trainer's ``train()`` will use, with the arguments' copy; None once its engine exists (its
    configs then go into ``seen_configs``: the engine's own facts say it)."""
    args = raw_attr(s.obj, "args", None)
    if id(raw_attr(s.obj, "model_wrapped", None)) in engine_ids:
        seen_configs.add(id(raw_attr(raw_attr(args, "hf_deepspeed_config", None), "config", None)))
        return None
    acc = raw_attr(s.obj, "accelerator", None)
    plugin = active_plugin(raw_attr(acc, "state", None)) if acc is not None else None
    hf = raw_attr(plugin, "hf_ds_config", None) if plugin is not None else None
    path = f"{s.name}.accelerator.state.deepspeed_plugin.hf_ds_config"
    if hf is None:
        hf = raw_attr(args, "hf_deepspeed_config", None) if args is not None else None
        path = f"{s.name}.args.hf_deepspeed_config"
    if hf is None:
        return None
    state = raw_attr(acc, "state", None) if acc is not None else None
    facts = _config_facts(s.name, "trainer", path, hf, args, f"{s.name}.args", live, s.obj, state=state)
    if facts is None:
        return None
    extra = raw_attr(args, "hf_deepspeed_config", None) if args is not None else None
    return _with_copy(facts, extra, live)


def _held_config(s: Any, seen_configs: set[int], live: Any) -> DeepSpeedFacts | None:
    """The config a TrainingArguments or an Accelerator holds, unless a Trainer's facts already have it."""
    if s.kind == "training_args":
        hf = raw_attr(s.obj, "hf_deepspeed_config", None)
        if hf is None or id(raw_attr(hf, "config", None)) in seen_configs:
            return None
        return _config_facts(s.name, "training_args", f"{s.name}.hf_deepspeed_config", hf, s.obj, s.name, live, s.obj)
    state = raw_attr(s.obj, "state", None)
    plugin = active_plugin(state)
    hf = raw_attr(plugin, "hf_ds_config", None) if plugin is not None else None
    if hf is None or id(raw_attr(hf, "config", None)) in seen_configs:
        return None
    mp = raw_attr(state, "_mixed_precision", None)
    return _config_facts(s.name, "accelerator", f"{s.name}.state.deepspeed_plugin.hf_ds_config", hf, None,
                         None, live, s.obj, str(mp) if mp is not None else None, state=state)  # fmt: skip


def _with_copy(facts: DeepSpeedFacts, hf: Any, live: Any) -> DeepSpeedFacts:
    """Add the arguments' own config (when it is a separate object) to what a fix has to change."""
    cfg = raw_attr(hf, "config", None) if hf is not None else None
    refs, mrefs = facts.config_refs, facts.mismatches_refs
    if isinstance(cfg, dict) and id(cfg) not in refs:
        live.add(cfg)
        refs += (id(cfg),)
    mm = raw_attr(hf, "mismatches", None) if hf is not None else None
    if isinstance(mm, list) and id(mm) not in mrefs:
        live.add(mm)
        mrefs += (id(mm),)
    return dataclasses.replace(facts, config_refs=refs, mismatches_refs=mrefs)


# -- live changes: a DeepSpeed config's precision, before train() ---------------------------------------


class ConfigPrecision(Change):
    """Set ``fp16.enabled`` / ``bf16.enabled`` of DeepSpeed config dicts and drop the HF mismatch lines
    about them; undo restores each touched section and list exactly."""

    def __init__(self, configs: list[dict], mismatch_lists: list[list], values: dict[str, bool], description: str) -> None:
        self.configs, self.lists, self.values, self.description = configs, mismatch_lists, values, description
        self._sections: list[tuple[dict, str, Any, bool]] = []
        self._lists: list[tuple[list, list]] = []

    @property
    def in_place(self) -> bool:
        sections = all(isinstance(cfg.get(k), dict) and cfg[k].get("enabled") == v
                       for cfg in self.configs for k, v in self.values.items())  # fmt: skip
        stale = any(isinstance(x, str) and any(x.startswith(f"- ds {k}.enabled=") for k in self.values)
                    for lines in self.lists for x in lines)  # fmt: skip
        return sections and not stale

    def apply(self) -> None:
        self._sections, self._lists = [], []
        try:
            for cfg in self.configs:
                for key, value in self.values.items():
                    had = key in cfg
                    old = cfg.get(key)
                    self._sections.append((cfg, key, old, had))
                    section = dict(old) if isinstance(old, dict) else {}
                    section["enabled"] = value
                    cfg[key] = section
            for lines in self.lists:
                self._lists.append((lines, list(lines)))
                lines[:] = [x for x in lines if not (isinstance(x, str) and any(x.startswith(f"- ds {k}.enabled=") for k in self.values))]
        except BaseException:
            self.revert()
            raise

    def revert(self) -> None:
        for cfg, key, old, had in reversed(self._sections):
            if had:
                cfg[key] = old
            else:
                cfg.pop(key, None)
        for lines, old in self._lists:
            lines[:] = old
        self._sections, self._lists = [], []


class ConfigKey(Change):
    """Set one top-level key of DeepSpeed config dicts; undo restores the value or its absence."""

    def __init__(self, configs: list[dict], key: str, value: Any, description: str) -> None:
        self.configs, self.key, self.value, self.description = configs, key, value, description
        self._saved: list[tuple[dict, Any, bool]] = []

    @property
    def in_place(self) -> bool:
        return all(self.key in c and same_value(c[self.key], self.value) for c in self.configs)

    def apply(self) -> None:
        self._saved = [(c, c.get(self.key), self.key in c) for c in self.configs]
        for c in self.configs:
            c[self.key] = self.value

    def revert(self) -> None:
        for c, old, had in self._saved:
            if had:
                c[self.key] = old
            else:
                c.pop(self.key, None)
        self._saved = []


def device_support(hardware: Any) -> tuple[bool | None, bool | None]:
    """``(fp16, bf16)``: whether DeepSpeed accepts each on the live device or the ``target=`` profile.

    DeepSpeed's rule (``_do_sanity_check``): its accelerator's ``is_fp16_supported()`` /
    ``is_bf16_supported()``. Its CPU accelerator accepts bf16 always and fp16 only where oneDNN
    has fp16 (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``); CUDA accepts fp16 always and bf16
    from compute capability 8.0.
    """
    kind = raw_attr(hardware, "kind", None)
    if kind == "cuda":
        return True, bool(raw_attr(hardware, "bf16_native", False))
    if kind == "cpu":
        try:
            fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except Exception:
            fp16 = False
        return fp16, True
    return None, None


def holds_a_config(subjects: tuple) -> bool:
    """True when arguments, a Trainer's arguments or an accelerator among ``subjects`` hold a DeepSpeed config:
    ``TrainingArguments(deepspeed=cfg)`` builds one without importing deepspeed, and its precision can
    already contradict the arguments."""
    for s in subjects:
        if s.kind == "training_args" and raw_attr(s.obj, "hf_deepspeed_config", None) is not None:
            return True
        if s.kind == "trainer":
            args = raw_attr(s.obj, "args", None)
            if args is not None and raw_attr(args, "hf_deepspeed_config", None) is not None:
                return True
        if s.kind == "accelerator" and active_plugin(raw_attr(s.obj, "state", None)) is not None:
            return True
    return False


INTEGRATION = Integration(
    name="deepspeed",
    modules=("deepspeed",),
    kinds=((ENGINE, "model"),),
    model_unwraps=(Unwrap(ENGINE, "module", ".module"),),
    facts=gather,
    wakes_on=holds_a_config,
)
