"""A corpus of live training setups, broken and healthy, for the reliability suite.

Each :class:`Scenario` builds a fresh namespace (what a notebook's ``user_ns``
would hold) from tiny real models, and knows how to run one training step in
it. The field cases are the five the project started from (README, "Notebooks"); the healthy
controls must produce no error or warning. :func:`hostile_pool` builds, once,
the objects the hostile-namespace properties sample from.

The suite iterates over ``report.fixes`` for whatever checks exist when it
runs, so a new check's fixes are exercised without editing this file.

Tests that only read a scenario's diagnosis (findings, plan, facts, text) take it from
:func:`shared_diagnosis`: one build per scenario per session, diagnosed once under each target
the tests ask for. Tests that apply fixes, run steps or otherwise change objects call
``scenario.build()`` for objects of their own.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import socket
import sys
import tempfile
import threading
import time
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from amp_loops import checkpoint_after, resumed, scaled_step
from setups import (
    TinyDataset,
    batch,
    tiny_gemma3,
    tiny_llama,
    tiny_lora,
    tiny_trainer,
    train_step,
    training_args,
)

import mpdoctor

# --------------------------------------------------------------------------------------
# Field cases and healthy controls
# --------------------------------------------------------------------------------------


@dataclass
class Scenario:
    """A named namespace builder and the training step that belongs to it.

    Attributes
    ----------
    name : str
        Stable id (used as the pytest parameter id).
    build : callable
        Returns a fresh namespace dict; may set environment variables (the
        conftest fixture restores ``ACCELERATE_*`` after each test).
    step : callable
        ``step(ns) -> float``: one real training step in that namespace.
    healthy : bool
        A control: diagnosing it must give no error and no warning.
    """

    name: str
    build: Callable[[], dict]
    step: Callable[[dict], float]
    healthy: bool = False
    probe_args: Callable[[dict], tuple[Any, Any, Any]] | None = None

    def probe_inputs(self, ns: dict) -> tuple[Any, Any, Any]:
        """``(model, batch, setup)`` for ``mpdoctor.probe`` in this namespace."""
        if self.probe_args is not None:
            return self.probe_args(ns)
        if "trainer" in ns:
            return ns["trainer"].model, batch(), ns["trainer"]
        return ns["model"], batch(), None

    def __repr__(self) -> str:
        return f"Scenario({self.name})"


def reset_accelerate() -> None:
    """Forget accelerate's process-wide singletons (a fresh notebook kernel's view)."""
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)


def _lm_step(ns: dict, model_key: str = "model", opt_key: str = "opt", scaler_key: str | None = None) -> float:
    scaler = ns.get(scaler_key) if scaler_key else None
    return train_step(ns[model_key], ns[opt_key], batch(), scaler=scaler)


def _trainer_step(ns: dict) -> float:
    trainer = ns["trainer"]
    return float(trainer.train().training_loss)


# -- builders -----------------------------------------------------------------------------


def bf16_model_with_enabled_scaler() -> dict:
    """Field case 3: a bf16 model trained under an enabled GradScaler (one step already taken)."""
    model = tiny_llama(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    train_step(model, opt, scaler=scaler)
    return {"model": model, "opt": opt, "scaler": scaler}


def fp16_params_with_scaler() -> dict:
    """Field case 3's neighbour: fp16 *parameters* (with grads and Adam state) under an enabled scaler."""
    model = tiny_llama(torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-4)  # eps=1e-8 is 0 in fp16: NaN weights
    train_step(model, opt)  # grads and exp_avg / exp_avg_sq exist, in fp16
    scaler = torch.amp.GradScaler("cpu")
    return {"model": model, "opt": opt, "scaler": scaler}


def gemma3_train_nested_cache() -> dict:
    """Field case 4: Gemma3ForConditionalGeneration in train mode, text_config.use_cache=True."""
    model = tiny_gemma3()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt)
    return {"model": model, "opt": opt}


def adamw_bf16_over_fp32() -> dict:
    """Field case 1: AdamWBF16 holding fp32 parameters (its first step() asserts)."""
    from adamw_bf16 import AdamWBF16

    model = tiny_llama(use_cache=False)
    opt = AdamWBF16(model.parameters(), lr=1e-3)
    model.zero_grad()
    model(**batch()).loss.backward()  # grads exist: the next opt.step() is the crash
    return {"model": model, "opt": opt}


def stale_accelerate_env_fp16() -> dict:
    """Field case 2: ACCELERATE_MIXED_PRECISION=fp16 left behind; Trainer(fp16=False) still autocasts fp16."""
    reset_accelerate()
    os.environ["ACCELERATE_MIXED_PRECISION"] = "fp16"
    trainer = tiny_trainer(tiny_llama(use_cache=False), fp16=False)
    trainer.create_optimizer()
    return {"trainer": trainer}


def launcher_fp8_beaten_by_bf16() -> dict:
    """``accelerate launch --mixed_precision fp8`` (its variables, as tests/stack/test_field_lowprecision.py records
    them from the real launcher) with ``TrainingArguments(bf16=True)``: the run trains in bf16, not fp8."""
    reset_accelerate()
    os.environ["ACCELERATE_MIXED_PRECISION"] = "fp8"
    os.environ["ACCELERATE_FP8_FORMAT"] = "HYBRID"  # two of the launcher's 12 ACCELERATE_FP8_* variables
    os.environ["ACCELERATE_FP8_OPT_LEVEL"] = "O2"
    trainer = tiny_trainer(tiny_llama(use_cache=False), bf16=True)
    trainer.create_optimizer()
    return {"trainer": trainer}


def launcher_fp8_arguments_before_the_trainer() -> dict:
    """The same launcher variables (all-gather on, as the launcher sets it) with ``TrainingArguments(bf16=True)``
    and no Trainer yet: the fix lets fp8 through in place; the step builds the Trainer from them and trains."""
    reset_accelerate()
    os.environ["ACCELERATE_MIXED_PRECISION"] = "fp8"
    os.environ["ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER"] = "1"
    return {"model": tiny_llama(use_cache=False), "args": training_args(bf16=True)}


def _trainer_from_args_step(ns: dict) -> float:
    from transformers import Trainer

    return float(Trainer(model=ns["model"], args=ns["args"], train_dataset=TinyDataset()).train().training_loss)


def trainer_fp16_on_cpu() -> dict:
    """Field case 2: Trainer(fp16=True, use_cpu=True): native_amp is False, the run is silently fp32."""
    reset_accelerate()
    trainer = tiny_trainer(tiny_llama(use_cache=False), fp16=True)
    trainer.create_optimizer()
    return {"trainer": trainer}


class _MixedPath(torch.nn.Module):
    """A bf16 Linear feeding an fp32 Linear (field case 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16).to(torch.bfloat16)
        self.down = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _mixed_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def mixed_linear_path() -> dict:
    """Field case 5: a bf16 and an fp32 Linear in one forward; one autocast step gave Adam state."""
    torch.manual_seed(0)
    model = _MixedPath()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _mixed_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    opt.step()
    return {"model": model, "opt": opt}


def _mixed_step(ns: dict) -> float:
    model, opt = ns["model"], ns["opt"]
    x, y = _mixed_inputs()
    opt.zero_grad()
    first = next(model.parameters()).dtype
    loss = torch.nn.functional.mse_loss(model(x.to(first)).float(), y)  # no autocast: the dtypes must agree
    loss.backward()
    opt.step()
    return float(loss.detach())


def peft_lora_bf16() -> dict:
    """A PEFT LoRA model on a bf16 base (fp32 adapters), its optimizer over the adapters."""
    model = tiny_lora(torch.bfloat16)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    train_step(model, opt)
    return {"model": model, "opt": opt}


def averaged_model_bf16() -> dict:
    """A bf16 network and torch's EMA of it, ``AveragedModel(..., avg_fn=get_ema_avg_fn(0.999))``: the copy is
    bf16, so its updates round away (low-precision-ema); one step and one update taken."""
    from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).to(torch.bfloat16)
    ns = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=1e-2)}
    ns["ema"] = AveragedModel(model, avg_fn=get_ema_avg_fn(0.999))
    _averaged_step(ns)
    return ns


def _averaged_step(ns: dict) -> float:
    dtype = next(ns["model"].parameters()).dtype  # the batch follows the model, as a user's loader would
    loss = ns["model"](torch.randn(8, 16, dtype=dtype)).float().pow(2).mean()
    loss.backward()
    ns["opt"].step()
    ns["opt"].zero_grad()
    ns["ema"].update_parameters(ns["model"])
    return float(loss.detach())


def kv_cache_fp32_in_bf16_model() -> dict:
    """Issue #40: a KV cache filled while the model was fp32, held by the user after ``model.to(bfloat16)``."""
    model = tiny_llama(train=False)
    with torch.no_grad():
        cache = model(torch.tensor([[3, 14, 15, 9]]), use_cache=True).past_key_values
    model.to(torch.bfloat16)
    return {"model": model, "cache": cache}


def _cached_step(ns: dict) -> float:
    """A step on the cached prompt: two more tokens, the loss of the second, one SGD step (the cache's dtype decides
    whether attention runs)."""
    model = ns["model"]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.tensor([[5, 7]])
    loss = model(ids, past_key_values=ns["cache"], labels=ids).loss
    loss.backward()
    opt.step()
    return float(loss.detach())


#: Issue #40's left-padded batch: the first row's two pads allow no key at all.
_PADDED_IDS = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
_PADDING = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])


def mask_fp32_min_in_fp16() -> dict:
    """Issue #40: a 4D mask filled with float32's finfo.min, cast to the fp16 model's dtype (-inf), eager attention."""
    model = tiny_llama(torch.float16, train=False)
    model.config._attn_implementation = "eager"
    n = _PADDED_IDS.shape[1]
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None] & _PADDING[:, None, None, :].bool()
    mask = torch.zeros(2, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min).to(torch.float16)
    return {"model": model, "mask": mask}


def _masked_step(ns: dict) -> float:
    """One SGD step on the left-padded batch with the user's mask (the pads' labels ignored)."""
    model = ns["model"]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    labels = _PADDED_IDS.masked_fill(_PADDING == 0, -100)
    loss = model(_PADDED_IDS, attention_mask=ns["mask"], labels=labels).loss
    loss.backward()
    opt.step()
    return float(loss.detach())


def healthy_fp32() -> dict:
    """Control: fp32 model without cache, AdamW with state, a disabled scaler."""
    model = tiny_llama(use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt)
    return {"model": model, "opt": opt, "scaler": torch.amp.GradScaler("cpu", enabled=False)}


def healthy_eval_with_cache() -> dict:
    """Control: a model in eval mode may keep its cache."""
    model = tiny_llama(train=False, use_cache=True)
    return {"model": model}


def healthy_bf16_autocast_fp32_weights() -> dict:
    """Control: fp32 master weights, bf16 autocast, no scaler: the recommended recipe."""
    model = tiny_llama(use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt, autocast_dtype=torch.bfloat16)
    return {"model": model, "opt": opt}


def healthy_trainer_fp32() -> dict:
    """Control: a plain fp32 Trainer on the CPU, optimizer created."""
    reset_accelerate()
    trainer = tiny_trainer(tiny_llama(use_cache=False))
    trainer.create_optimizer()
    return {"trainer": trainer}


def _autocast_step(ns: dict) -> float:
    return train_step(ns["model"], ns["opt"], batch(), autocast_dtype=torch.bfloat16)


def _eval_step(ns: dict) -> float:
    model = ns["model"]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_step(model.train(), opt, batch())


def resumed_without_the_scaler_state() -> dict:
    """huggingface/transformers PR #11663: model and optimizer restored from a loaded checkpoint that holds the
    scaler's state too (``ckpt["scaler"]``), the GradScaler left fresh."""
    return resumed(checkpoint_after())


def _resumed_step(ns: dict) -> float:
    return float(scaled_step(ns["model"], ns["opt"], ns["scaler"]))


FIELD_CASES = [
    Scenario("bf16_model_with_enabled_scaler", bf16_model_with_enabled_scaler, functools.partial(_lm_step, scaler_key="scaler")),
    Scenario("fp16_params_with_scaler", fp16_params_with_scaler, functools.partial(_lm_step, scaler_key="scaler")),
    Scenario("gemma3_train_nested_cache", gemma3_train_nested_cache, _lm_step),
    Scenario("adamw_bf16_over_fp32", adamw_bf16_over_fp32, _lm_step),
    Scenario("stale_accelerate_env_fp16", stale_accelerate_env_fp16, _trainer_step),
    Scenario("trainer_fp16_on_cpu", trainer_fp16_on_cpu, _trainer_step),
    Scenario("launcher_fp8_beaten_by_bf16", launcher_fp8_beaten_by_bf16, _trainer_step),
    Scenario("launcher_fp8_arguments_before_the_trainer", launcher_fp8_arguments_before_the_trainer, _trainer_from_args_step),
    Scenario(
        "mixed_linear_path",
        mixed_linear_path,
        _mixed_step,
        probe_args=lambda ns: (ns["model"], _mixed_inputs()[0].bfloat16(), None),
    ),
    Scenario("peft_lora_bf16", peft_lora_bf16, _lm_step),
    Scenario("kv_cache_fp32_in_bf16_model", kv_cache_fp32_in_bf16_model, _cached_step,
             probe_args=lambda ns: (ns["model"], {"input_ids": torch.tensor([[5, 7]])}, None)),
    Scenario("mask_fp32_min_in_fp16", mask_fp32_min_in_fp16, _masked_step,
             probe_args=lambda ns: (ns["model"], {"input_ids": _PADDED_IDS, "attention_mask": ns["mask"]}, None)),
    Scenario("averaged_model_bf16", averaged_model_bf16, _averaged_step,
             probe_args=lambda ns: (ns["model"], torch.randn(8, 16, dtype=torch.bfloat16), None)),
    Scenario("resumed_without_the_scaler_state", resumed_without_the_scaler_state, _resumed_step,
             probe_args=lambda ns: (ns["model"], torch.ones(8, 8), None)),
]

HEALTHY = [
    Scenario("healthy_fp32", healthy_fp32, _lm_step, healthy=True),
    Scenario("healthy_eval_with_cache", healthy_eval_with_cache, _eval_step, healthy=True),
    Scenario("healthy_bf16_autocast_fp32_weights", healthy_bf16_autocast_fp32_weights, _autocast_step, healthy=True),
    Scenario("healthy_trainer_fp32", healthy_trainer_fp32, _trainer_step, healthy=True),
]

SCENARIOS = FIELD_CASES + HEALTHY
BY_NAME = {s.name: s for s in SCENARIOS}


# --------------------------------------------------------------------------------------
# Hostile objects: things a notebook namespace really holds, and things that fight back
# --------------------------------------------------------------------------------------

#: Every call into a hostile object's protocol lands here; the properties assert it stays empty.
HOSTILE_CALLS: list[str] = []
#: A "hang" sleeps at most this long, so a regression fails the test instead of freezing it.
HANG_SECONDS = 0.2


def _record(what: str) -> None:
    HOSTILE_CALLS.append(what)


def _hang(what: str) -> None:
    _record(what)
    deadline = time.monotonic() + HANG_SECONDS
    while time.monotonic() < deadline:
        time.sleep(0.01)


class RaisingGetattr:
    """``__getattr__`` raises for every missing attribute."""

    def __getattr__(self, name: str) -> Any:
        _record(f"RaisingGetattr.__getattr__({name})")
        raise RuntimeError(f"boom: {name}")


class RaisingGetattribute:
    """Every attribute read raises, even ``__dict__``."""

    def __getattribute__(self, name: str) -> Any:
        _record(f"RaisingGetattribute.__getattribute__({name})")
        raise RuntimeError(f"boom: {name}")


class HangingGetattr:
    """``__getattr__`` hangs (boundedly)."""

    def __getattr__(self, name: str) -> Any:
        _hang(f"HangingGetattr.__getattr__({name})")
        raise AttributeError(name)


class HangingGetattribute:
    """Every attribute read hangs (boundedly)."""

    def __getattribute__(self, name: str) -> Any:
        _hang(f"HangingGetattribute.__getattribute__({name})")
        return object.__getattribute__(self, name)


class LyingClass:
    """``__class__`` claims to be a torch Module (``isinstance`` would believe it)."""

    @property
    def __class__(self):
        _record("LyingClass.__class__")
        return torch.nn.Module


class RaisingClass:
    """Reading ``__class__`` raises."""

    @property
    def __class__(self):
        _record("RaisingClass.__class__")
        raise RuntimeError("no class for you")


class HangingLen:
    """``__len__`` / ``__iter__`` / ``__bool__`` / ``__repr__`` / ``__hash__`` / ``__eq__`` hang."""

    def __len__(self) -> int:
        _hang("HangingLen.__len__")
        return 0

    def __iter__(self):
        _hang("HangingLen.__iter__")
        return iter(())

    def __bool__(self) -> bool:
        _hang("HangingLen.__bool__")
        return False

    def __repr__(self) -> str:
        _hang("HangingLen.__repr__")
        return "HangingLen()"

    def __hash__(self) -> int:
        _hang("HangingLen.__hash__")
        return 0

    def __eq__(self, other: object) -> bool:
        _hang("HangingLen.__eq__")
        return False


class RaisingLen:
    """``__len__`` / ``__iter__`` / ``__getitem__`` raise."""

    def __len__(self) -> int:
        _record("RaisingLen.__len__")
        raise RuntimeError("len")

    def __iter__(self):
        _record("RaisingLen.__iter__")
        raise RuntimeError("iter")

    def __getitem__(self, i: Any) -> Any:
        _record("RaisingLen.__getitem__")
        raise RuntimeError("getitem")


class HostileMeta(type):
    """A metaclass whose class-level protocol fights back (``type(x) == list`` would run it)."""

    def __eq__(cls, other: object) -> bool:
        _hang("HostileMeta.__eq__")
        return False

    def __hash__(cls) -> int:
        _record("HostileMeta.__hash__")
        return 0

    def __getattribute__(cls, name: str) -> Any:
        if name in ("__mro__", "__dict__", "__name__", "__qualname__", "__module__"):
            _record(f"HostileMeta.__getattribute__({name})")
        return type.__getattribute__(cls, name)


class MetaHostile(metaclass=HostileMeta):
    """An instance of a class with a hostile metaclass."""


class EvilDict(dict):
    """A dict subclass whose views raise."""

    def items(self):
        _record("EvilDict.items")
        raise RuntimeError("items")

    def keys(self):
        _record("EvilDict.keys")
        raise RuntimeError("keys")

    def __iter__(self):
        _record("EvilDict.__iter__")
        raise RuntimeError("iter")


class EvilList(list):
    """A list subclass whose iteration hangs."""

    def __iter__(self):
        _hang("EvilList.__iter__")
        return iter(())

    def __getitem__(self, i: Any) -> Any:
        _hang("EvilList.__getitem__")
        return None


class EvilStr(str):
    """A str subclass (a namespace key or dict key) whose methods fight back."""

    def startswith(self, *a: Any) -> bool:  # type: ignore[override]
        _record("EvilStr.startswith")
        raise RuntimeError("startswith")

    def __hash__(self) -> int:
        return str.__hash__(self)

    def __repr__(self) -> str:
        _record("EvilStr.__repr__")
        raise RuntimeError("repr")


class BrokenNamedModules(torch.nn.Module):
    """A real Module whose ``named_modules`` raises: must become an internal-error finding."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def named_modules(self, *a: Any, **k: Any):
        raise RuntimeError("named_modules is broken")


class _UnprintableError(RuntimeError):
    def __str__(self) -> str:
        raise ValueError("this exception cannot be printed")

    def __repr__(self) -> str:
        raise ValueError("this exception cannot be repr'd")


class UnprintableFailure(torch.nn.Module):
    """A real Module failing with an exception whose ``__str__`` raises."""

    def named_modules(self, *a: Any, **k: Any):
        raise _UnprintableError()


class LazyModuleLoaded(Exception):
    """Raised by the lazy module's body: it must never run."""


def lazy_module() -> types.ModuleType:
    """A module object from ``importlib.util.LazyLoader`` whose body would raise when loaded."""
    path = os.path.join(tempfile.mkdtemp(prefix="mpdoctor-lazy-"), "mpdoctor_lazy_probe.py")
    with open(path, "w") as fh:
        fh.write("from scenarios import LazyModuleLoaded\nraise LazyModuleLoaded('loaded')\n")
    spec = importlib.util.spec_from_file_location("mpdoctor_lazy_probe", path)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lazy_module_is_unloaded(module: types.ModuleType) -> bool:
    """True while the lazy module has not been executed (its class is still the lazy one)."""
    return type(module) is not types.ModuleType


class Buffered(torch.nn.Module):
    """A module with exotic dtypes as buffers and non-trainable parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("fp8", torch.zeros(4, dtype=torch.float8_e4m3fn))
        self.register_buffer("i8", torch.arange(4, dtype=torch.int8))
        self.register_buffer("u8", torch.arange(4, dtype=torch.uint8))
        self.register_buffer("flags", torch.tensor([True, False]))
        self.register_buffer("cplx", torch.zeros(3, dtype=torch.complex64))
        self.register_buffer("scalar", torch.tensor(3.0))
        self.register_buffer("none_buffer", None)
        self.fp8_weight = torch.nn.Parameter(torch.ones(2, 2).to(torch.float8_e4m3fn), requires_grad=False)
        self.int_weight = torch.nn.Parameter(torch.ones(3, dtype=torch.int8), requires_grad=False)
        self.c_weight = torch.nn.Parameter(torch.ones(2, dtype=torch.complex64), requires_grad=False)


class TwoDevices(torch.nn.Module):
    """Parameters on the CPU and on ``meta`` in one module."""

    def __init__(self) -> None:
        super().__init__()
        self.real = torch.nn.Linear(4, 4)
        with torch.device("meta"):
            self.ghost = torch.nn.Linear(4096, 4096)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_or_dp(module: torch.nn.Module) -> torch.nn.Module:
    """A real DistributedDataParallel on a single-process gloo group, else DataParallel on the CPU.

    The group is destroyed once the wrapper exists: the wrapper is only ever inspected.
    """
    import torch.distributed as dist

    try:
        if not dist.is_initialized():
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
            )
        wrapped = torch.nn.parallel.DistributedDataParallel(module)
    except Exception:
        return torch.nn.DataParallel(module)
    # Only the wrapper is needed (it is never called): leave no process group behind for other tests.
    dist.destroy_process_group()
    return wrapped


def config_missing_attributes():
    """A real Llama whose config lost attributes (deleted from its ``__dict__``)."""
    model = tiny_llama()
    for key in ("use_cache", "dtype", "model_type", "_attn_implementation_internal", "torch_dtype"):
        model.config.__dict__.pop(key, None)
    return model


def config_with_hostile_values():
    """A real Llama whose config values (read by the facts) are objects that fight back."""
    model = tiny_llama(seed=4)
    d = model.config.__dict__
    d["use_cache"] = HangingLen()
    d["dtype"] = HangingLen()
    d["model_type"] = EvilStr("evil")
    d["_attn_implementation_internal"] = MetaHostile()
    d["quantization_config"] = {"quant_method": HangingLen(), "bnb_4bit_compute_dtype": HangingLen(), "load_in_4bit": HangingLen()}
    sub = type(model.config)()
    sub.__dict__.update(use_cache=HangingGetattribute(), quantization_config=HangingGetattribute(), dtype=LyingClass())
    sub.__dict__["_attn_implementation_internal"] = HangingLen()
    d["hostile_sub_config"] = sub
    return model


@dataclass
class Real:
    """A real object of the pool and the subjects it must produce.

    ``objects`` are the live objects that must each appear as exactly one
    subject (``subject.obj``) when ``value`` is reachable in a namespace;
    ``tensors`` is how many tensors they hold (params, grads, buffers, optimizer state).
    """

    key: str
    value: Any
    objects: tuple = ()
    tensors: int = 0


@dataclass
class Pool:
    """Objects the hostile properties sample from, built once per test module."""

    real: list[Real] = field(default_factory=list)
    hostile: dict[str, Any] = field(default_factory=dict)
    huge: dict[str, Any] = field(default_factory=dict)
    keepalive: list = field(default_factory=list)
    lazy: types.ModuleType | None = None


def _count_tensors(*objs: Any) -> int:
    n = 0
    for obj in objs:
        try:
            n += _count_tensors_of(obj)
        except Exception:  # the deliberately broken modules
            pass
    return n


def _count_tensors_of(obj: Any) -> int:
    n = 0
    if isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            n += 1 + (p.grad is not None)
        n += sum(1 for _ in obj.buffers())
    elif isinstance(obj, torch.optim.Optimizer):
        for st in obj.state.values():
            n += sum(isinstance(v, torch.Tensor) for v in st.values())
    return n


def _real(key: str, value: Any, *objects: Any) -> Real:
    objects = objects or (value,)
    return Real(key, value, tuple(objects), _count_tensors(*objects))


@functools.lru_cache(maxsize=1)
def hostile_pool() -> Pool:
    """Build the pool once: tiny real models, optimizers, scalers, Trainers, wrappers, and hostile objects."""
    from accelerate import Accelerator

    pool = Pool()
    llama = tiny_llama()
    opt = torch.optim.AdamW(llama.parameters(), lr=1e-3)
    train_step(llama, opt)
    bf16 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).to(torch.bfloat16)
    scaler = torch.amp.GradScaler("cpu")
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8))
    zero = torch.nn.Sequential(torch.nn.Linear(0, 0), torch.nn.Linear(3, 0))
    reset_accelerate()
    trainer = tiny_trainer(tiny_llama(use_cache=False, seed=1))  # optimizer is None before train()
    reset_accelerate()
    compiled_inner = torch.nn.Linear(3, 3)
    compiled = torch.compile(compiled_inner)  # never called
    ddp_inner = torch.nn.Sequential(torch.nn.Linear(3, 3))
    ddp = ddp_or_dp(ddp_inner)
    lora = tiny_lora(torch.bfloat16, seed=2)
    lora_opt = torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=0.1)
    acc = Accelerator(cpu=True)
    acc_model = torch.nn.Linear(2, 2)
    acc_opt = acc.prepare_optimizer(torch.optim.SGD(acc_model.parameters(), lr=0.1))
    reset_accelerate()
    gemma = tiny_gemma3(seed=3)

    pool.real = [
        _real("llama", llama),
        _real("adamw", opt),
        _real("bf16_seq", bf16),
        _real("scaler", scaler),
        _real("disabled_scaler", torch.amp.GradScaler("cpu", enabled=False)),
        _real("meta_model", meta),
        _real("zero_elements", zero),
        _real("exotic_dtypes", Buffered()),
        _real("two_devices", TwoDevices()),
        _real("trainer_without_optimizer", trainer, trainer, trainer.model, trainer.args, trainer.accelerator),
        _real("compiled", compiled),
        _real("ddp", ddp),
        _real("lora", lora),
        _real("lora_sgd", lora_opt),
        _real("accelerated_optimizer", acc_opt),
        _real("accelerated_model", acc_model),
        _real("gemma", gemma),
        _real("config_missing_attrs", config_missing_attributes()),
        _real("config_hostile_values", config_with_hostile_values()),
        _real("broken_named_modules", BrokenNamedModules()),
        _real("unprintable_failure", UnprintableFailure()),
        _real("training_args", training_args()),
    ]
    pool.keepalive += [compiled_inner, ddp_inner, acc, TinyDataset]

    alive_target = torch.nn.Linear(2, 2)
    pool.keepalive.append(alive_target)

    class _Dead:
        pass

    dead = _Dead()
    dead_proxy = weakref.proxy(dead)
    del dead
    recursive_list: list = []
    recursive_list.append(recursive_list)
    recursive_dict: dict = {}
    recursive_dict["self"] = recursive_dict
    recursive_dict["list"] = recursive_list
    nested: list = [[[[[]]]]]
    pool.lazy = lazy_module()
    pool.hostile = {
        "raising_getattr": RaisingGetattr(),
        "raising_getattribute": RaisingGetattribute(),
        "hanging_getattr": HangingGetattr(),
        "hanging_getattribute": HangingGetattribute(),
        "lying_class": LyingClass(),
        "raising_class": RaisingClass(),
        "hanging_len": HangingLen(),
        "raising_len": RaisingLen(),
        "meta_hostile": MetaHostile(),
        "hostile_class": MetaHostile,
        "evil_dict": EvilDict(a=1),
        "evil_list": EvilList([1, 2]),
        # Hostile user objects, not stand-ins for a library: a MagicMock claims every attribute and
        # is an instance of nothing, which is what discovery must survive in a real user_ns.
        "magic_mock": mock.MagicMock(),
        "noncallable_mock": mock.NonCallableMagicMock(),
        "mock_spec_module": mock.MagicMock(spec=torch.nn.Module),
        "lazy_module": pool.lazy,
        "alive_proxy": weakref.proxy(alive_target),
        "dead_proxy": dead_proxy,
        "recursive_list": recursive_list,
        "recursive_dict": recursive_dict,
        "nested": nested,
        "a_thread_lock": threading.Lock(),
        "a_function": lambda: _record("a_function called"),
        "a_class": torch.nn.Linear,
        "a_module_object": torch,
        "an_int": 3,
        "a_string": "hello",
        "none": None,
    }
    pool.huge = {
        "huge_list": list(range(10**6)),
        "huge_tuple": tuple(range(10**6)),
        "huge_dict": dict.fromkeys(range(10**6)),
        "huge_set": set(range(10**6)),
        "huge_range": range(10**12),
    }
    return pool



# -- low-precision numerics (issue 11 corpus) ------------------------------------------------


def fp16_weights_adamw_eps() -> dict:
    """pytorch#8860: fp16 weights under stock AdamW, whose eps=1e-8 is 0 in fp16 (NaN at the first step)."""
    model = tiny_llama(torch.float16, use_cache=False)
    return {"model": model, "opt": torch.optim.AdamW(model.parameters(), lr=1e-3)}


def bf16_rope_long_context() -> dict:
    """transformers#29496: ``model.to(bf16)`` rounded the RoPE frequencies of a 4096-position model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=64, max_position_embeddings=4096, use_cache=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt, autocast_dtype=torch.bfloat16)
    model.to(torch.bfloat16)  # casts the weights, the Adam state stays fp32 ... and inv_freq
    return {"model": model, "opt": opt}


FIELD_CASES += [
    Scenario("fp16_weights_adamw_eps", fp16_weights_adamw_eps, _lm_step),
    Scenario("bf16_rope_long_context", bf16_rope_long_context, _autocast_step),
]
SCENARIOS = FIELD_CASES + HEALTHY
BY_NAME = {s.name: s for s in SCENARIOS}


# --------------------------------------------------------------------------------------
# One read-only diagnosis per scenario, shared by the tests that only read it
# --------------------------------------------------------------------------------------

#: Every target the suite reads a shared diagnosis under: the live machine and the what-if profiles.
SHARED_TARGETS: tuple[str | None, ...] = (None, "cpu", "T4", "V100", "A100", "H100")
#: What ``tests/conftest.py`` clears before each test: a shared build starts from the same environment a test does.
_PRECISION_VARIABLES = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DOWNCAST_BF16", "ACCELERATE_USE_CPU")


@dataclass(frozen=True)
class Diagnosed:
    """One build of a scenario and its reports under some targets: to read, never to change.

    Attributes
    ----------
    scenario : Scenario
        The scenario built.
    names : frozenset of str
        The variable names its namespace held.
    reports : mapping
        ``target -> Report`` (``None`` for the live machine), each diagnosed from the same build.
    """

    scenario: Scenario
    names: frozenset[str]
    reports: types.MappingProxyType

    def report(self, target: str | None = None) -> Any:
        """The report under ``target`` (``None``: the live machine)."""
        return self.reports[target]


_SHARED: dict[str, Diagnosed] = {}


def shared_diagnosis(name: str, targets: tuple[str | None, ...] = (None,)) -> Diagnosed:
    """Scenario ``name`` built once per session and diagnosed under ``targets`` (and every target asked before).

    A later call asking for a target not diagnosed yet builds the scenario again and diagnoses it under every
    target asked so far: a Trainer's accelerate state is reset after each test, so a build is only diagnosed
    right after it is made. The build runs as a test's would (no ``ACCELERATE_*`` precision variable left over,
    accelerate's singletons reset), and the environment, accelerate's state and the RNG are put back afterwards,
    so the first test to ask sees the same process state as the others. The reports and the objects they hold
    are shared: a test that applies a fix or runs a step builds its own.
    """
    known = _SHARED.get(name)
    if known is not None and all(t in known.reports for t in targets):
        return known
    wanted = tuple(dict.fromkeys([*(known.reports if known is not None else ()), *targets]))
    scenario = BY_NAME[name]
    env, rng = dict(os.environ), torch.get_rng_state()
    try:
        for key in [*_PRECISION_VARIABLES, *(k for k in os.environ if k.startswith("ACCELERATE_FP8_"))]:
            os.environ.pop(key, None)
        reset_accelerate()
        ns = scenario.build()
        reports = {target: mpdoctor.diagnose(namespace=ns, target=target) for target in wanted}
    finally:
        os.environ.clear()
        os.environ.update(env)
        reset_accelerate()
        torch.set_rng_state(rng)
    _SHARED[name] = Diagnosed(scenario, frozenset(ns), types.MappingProxyType(reports))
    return _SHARED[name]
