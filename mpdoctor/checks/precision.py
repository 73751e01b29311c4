"""Checks on the precision a run computes in: what the arguments ask versus what accelerate will do; TF32.

The fixes here edit accelerate's live objects. Every attribute involved, read from accelerate 1.x
(``Accelerator.__init__``, ``prepare_model``, ``backward``, ``unscale_gradients``,
``AcceleratedOptimizer``):

- ``AcceleratorState._mixed_precision``: a process-wide singleton (``state.__dict__`` is the class's shared
  dict), so every Accelerator in the kernel sees the change;
- ``accelerator.native_amp``: whether ``prepare_model`` wraps ``forward`` in autocast, and whether
  ``unscale_gradients`` unscales;
- ``accelerator.scaler`` and each ``AcceleratedOptimizer.scaler`` (the same object, so it is mutated, not
  rebound; when none exists a new one is given to both, with the step-patching attributes
  ``AcceleratedOptimizer.__init__`` sets);
- ``model.forward`` / ``model._original_forward`` of models already prepared (``prepare_model`` returns
  early for ``_is_accelerate_prepared`` models, so a later ``train()`` never rewraps them);
- ``accelerator.autocast_handler`` (its kwargs are passed to the autocast a rewrap builds);
- ``TrainingArguments.mixed_precision`` / ``fp16`` / ``bf16`` and ``ACCELERATE_MIXED_PRECISION``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch

from ..facts import Facts, PrecisionFacts
from ..facts.configs import raw_attr
from ..facts.hardware import DeviceProfile
from ..findings import Finding
from ..fixes import Call, Change, Fix, SetAttr, SetEnv
from . import check

ENV_VAR = "ACCELERATE_MIXED_PRECISION"
HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
_MODES = ("no", "fp16", "bf16", "fp8")


# -- what a setup will compute in ---------------------------------------------------------------------------


def declared_precision(p: PrecisionFacts) -> str | None:
    """The mode the setup says it runs in: the accelerator's, else ``args.mixed_precision``."""
    if p.accelerator_mixed_precision in _MODES:
        return p.accelerator_mixed_precision
    mp = p.args.get("mixed_precision")
    return mp if mp in _MODES else None


def setup_device(p: PrecisionFacts, hw: DeviceProfile) -> str:
    """The device type the setup trains on: the what-if target's, else the accelerator's (``use_cpu`` wins)."""
    if not hw.live:
        return hw.kind
    if p.args.get("use_cpu"):
        return "cpu"
    return p.device or hw.kind


def native_amp_for(precision: str, device: str) -> bool:
    """accelerate's rule (``Accelerator.__init__``): fp16 autocasts everywhere but on the CPU; bf16 everywhere."""
    if precision == "fp16":
        return device != "cpu"
    return precision in ("bf16", "fp8")


def computes_in(p: PrecisionFacts, hw: DeviceProfile) -> str:
    """The precision the next training step of setup ``p`` computes in on ``hw``."""
    declared = declared_precision(p)
    if declared in (None, "no"):
        return "no"
    if hw.live and p.accelerator_name is not None and p.native_amp is not None:
        return declared if p.native_amp else "no"
    return declared if native_amp_for(declared, setup_device(p, hw)) else "no"


# -- the live objects behind a setup, and the changes that realign them --------------------------------------


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


def live_setup(facts: Facts, p: PrecisionFacts) -> LiveSetup:
    """Find the live objects of setup ``p``."""
    args_s = facts.subject(p.args_name) if p.args_name else None
    acc_s = facts.subject(p.accelerator_name) if p.accelerator_name else None
    models = [(n, facts.subject(n).obj) for n in p.model_names if facts.subject(n) is not None]
    return LiveSetup(
        args_s.obj if args_s else None, p.args_name, acc_s.obj if acc_s else None, p.accelerator_name, models
    )


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
    changes: list[Change] = []
    args, acc = live.args, live.acc
    if args is not None:
        for key, value in (flags or {}).items():
            if raw_attr(args, key, None) != value:
                changes.append(SetAttr(args, key, value, f"{live.args_name}.{key}"))
        if raw_attr(args, "mixed_precision", None) != precision:
            changes.append(SetAttr(args, "mixed_precision", precision, f"{live.args_name}.mixed_precision"))
    if env and os.environ.get(ENV_VAR) not in (None, precision):
        changes.append(SetEnv(ENV_VAR, None))
    if acc is None:
        return changes
    state = raw_attr(acc, "state", None)
    before = raw_attr(state, "_mixed_precision", None)
    if state is not None and before != precision:
        changes.append(SetAttr(state, "_mixed_precision", precision, f"{live.acc_name}.state._mixed_precision"))
    was_native = bool(raw_attr(acc, "native_amp", False))
    if was_native != native:
        changes.append(SetAttr(acc, "native_amp", native, f"{live.acc_name}.native_amp"))
    device = live.device()
    want_scaler = native and precision == "fp16"
    scaler = raw_attr(acc, "scaler", None)
    if scaler is not None:
        enabled = bool(raw_attr(scaler, "_enabled", False))
        if enabled != want_scaler:
            # Shared with every AcceleratedOptimizer: mutate, never rebind.
            changes.append(SetAttr(scaler, "_enabled", want_scaler, f"{live.acc_name}.scaler._enabled"))
    elif want_scaler:
        handler = raw_attr(acc, "scaler_handler", None)
        kwargs = handler.to_kwargs() if handler is not None and hasattr(handler, "to_kwargs") else {}
        new = torch.amp.GradScaler(device, **kwargs)
        changes.append(SetAttr(acc, "scaler", new, f"{live.acc_name}.scaler"))
        for opt in raw_attr(acc, "_optimizers", None) or ():
            if "optimizer" in _own(opt) and _own(opt).get("scaler") is None:
                changes.append(DictPatch(opt, _OPT_SCALER_KEYS, _give_scaler(opt, new), "give the optimizer the scaler"))
    models: list[Any] = []
    for m in list(raw_attr(acc, "_models", None) or ()) + [m for _n, m in live.models]:
        if isinstance(m, torch.nn.Module) and all(m is not x for x in models):
            models.append(m)
    for m in models:
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


def _own(obj: Any) -> dict:
    try:
        d = object.__getattribute__(obj, "__dict__")
        return d if isinstance(d, dict) else {}
    except Exception:
        return {}


def alignment_fix(
    title: str, code: str, live: LiveSetup, precision: str, native: bool, flags: dict | None = None, safe: bool = False
) -> Fix:
    """A fix bringing ``live`` to ``precision`` (``native`` autocast); the plan is computed when applied."""

    def plan() -> list[Change]:
        return precision_changes(live, precision, native, flags)

    def verify() -> str | None:
        bad = []
        if live.args is not None and raw_attr(live.args, "mixed_precision", None) != precision:
            bad.append("args.mixed_precision")
        if live.acc is not None:
            if raw_attr(raw_attr(live.acc, "state", None), "_mixed_precision", None) != precision:
                bad.append("accelerator.mixed_precision")
            if bool(raw_attr(live.acc, "native_amp", False)) != native:
                bad.append("accelerator.native_amp")
        return f"{', '.join(bad)} still differ" if bad else None

    return Fix(title, code, safe, plan, verify)


def alignment_code(live: LiveSetup, precision: str, native: bool, flags: dict | None = None, why: str = "") -> str:
    """Pasteable Python making the same changes :func:`precision_changes` would make now."""
    lines = ["import os", "import torch"] + ([f"# {why}"] if why else [])
    if os.environ.get(ENV_VAR) not in (None, precision):
        lines.append(f"os.environ.pop({ENV_VAR!r}, None)  # stale: left by an earlier TrainingArguments or a launcher")
    if live.args is not None:
        for key, value in (flags or {}).items():
            if raw_attr(live.args, key, None) != value:
                lines.append(f"{live.args_name}.{key} = {value!r}")
        if raw_attr(live.args, "mixed_precision", None) != precision:
            lines.append(f"{live.args_name}.mixed_precision = {precision!r}")
    acc, name = live.acc, live.acc_name
    if acc is not None:
        state = raw_attr(acc, "state", None)
        before = raw_attr(state, "_mixed_precision", None)
        if before != precision:
            lines.append(f"{name}.state._mixed_precision = {precision!r}  # AcceleratorState is one per process")
        if bool(raw_attr(acc, "native_amp", False)) != native:
            lines.append(f"{name}.native_amp = {native!r}")
        want = native and precision == "fp16"
        scaler = raw_attr(acc, "scaler", None)
        if scaler is not None and bool(raw_attr(scaler, "_enabled", False)) != want:
            lines.append(f"{name}.scaler._enabled = {want!r}  # the optimizer shares this scaler")
        elif scaler is None and want:
            lines.append(f"{name}.scaler = torch.amp.GradScaler({live.device()!r})")
            lines.append(f"for opt in {name}._optimizers:  # already prepared: give them the scaler too")
            lines.append(f"    opt.__setstate__({{'scaler': {name}.scaler}})  # sets the step-patching attributes")
        for mname, m in live.models:
            d = _own(m)
            wrapped = d.get("_original_forward") is not None
            if wrapped and (not native or before != precision):
                lines.append(f"{mname}.forward = {mname}._original_forward; del {mname}._original_forward")
                wrapped = False
            if native and not wrapped and (d.get("_is_accelerate_prepared") or d.get("_original_forward") is not None):
                dtype = f"torch.{str(HALF[precision]).replace('torch.', '')}"
                lines += [
                    "from types import MethodType",
                    "from accelerate.utils import convert_outputs_to_fp32",
                    f"{mname}._original_forward = {mname}.forward  # prepared already: accelerate will not wrap it again",
                    f"{mname}.forward = MethodType(convert_outputs_to_fp32(torch.autocast({live.device()!r}, "
                    f"dtype={dtype})({mname}.forward.__func__)), {mname})",
                ]
    return "\n".join(lines)


# -- checks -------------------------------------------------------------------------------------------------


@check("precision-override", "error")
def precision_override(facts: Facts) -> Iterator[Finding]:
    """The precision a run computes in is not the precision its arguments ask for.

    What it detects
        A Trainer (or ``TrainingArguments``) whose explicit ``fp16`` / ``bf16`` flags disagree with what
        accelerate will run: (a) a stale ``ACCELERATE_MIXED_PRECISION`` (left by an earlier
        ``TrainingArguments`` in the kernel, or a launcher) that turned ``fp16=False`` into
        ``accelerator.mixed_precision == "fp16"`` (or ``"bf16"``); (b) ``fp16=True`` on a CPU, where
        accelerate keeps ``native_amp=False`` and never autocasts, so the run is silently fp32. Error
        when the computed precision differs from the request; warning when only the labels differ
        (fp16 declared on a CPU computes fp32 as asked, but the stale variable will switch every later
        Trainer in the kernel to fp16 on a GPU). Setups with a DeepSpeed config are skipped.
    Why it matters
        ms-swift users passing ``--fp16 false`` still trained under fp16 autocast on V100s and got NaN;
        a CPU run asked for fp16 silently trains and measures fp32.
    Fix
        Bring the accelerator (``AcceleratorState._mixed_precision``, ``native_amp``, the shared scaler, the
        autocast wrapper of already prepared models), ``args.mixed_precision`` and the environment
        variable in line with the arguments, in place, so the next ``trainer.train()`` step computes in
        the requested precision; the stale variable is removed rather than rewritten (absent means "no" to
        both transformers and accelerate). For (b) two fixes, since torch 2.13 can autocast fp16 on a CPU
        (accelerate chooses not to): enable it as asked, with a CPU GradScaler shared by the accelerator and
        its optimizer; or make the arguments say what runs (``fp16=False``). CPUs without fp16 matmul units
        pay for the first (measured here, one thread, a 256x1024 by 1024x1024 Linear: fp32 6.6 ms, fp16
        autocast 50 ms, bf16 autocast 1.8 ms), so the message points to bf16 as the CPU's half precision.
        All unsafe: each changes the numerics of the next step or a choice the user wrote, and the
        accelerator state is process-wide.
    Source
        ms-swift issue #3896 / PR #3909; transformers ``TrainingArguments.__post_init__`` (reads
        ``ACCELERATE_MIXED_PRECISION``); accelerate ``Accelerator.__init__`` (fp16 on CPU: no native AMP).
    """
    hw = facts.hardware
    for p in facts.precisions:
        if p.requested is None or p.args.get("deepspeed"):
            continue
        declared = declared_precision(p)
        if declared is None:
            continue
        computes = computes_in(p, hw)
        if declared == p.requested and computes == p.requested:
            continue
        severity = "error" if computes != p.requested else "warning"
        live = live_setup(facts, p)
        device = live.device()
        evidence = {
            "requested": p.requested,
            "args.mixed_precision": p.args.get("mixed_precision"),
            ENV_VAR: p.env_mixed_precision,
            "accelerator.mixed_precision": p.accelerator_mixed_precision,
            "native_amp": p.native_amp,
            "computes_in": computes,
            "device": setup_device(p, hw),
        }
        fixes = []
        if declared != p.requested:
            cause = (
                f"{ENV_VAR}={p.env_mixed_precision} in the environment"
                if p.env_mixed_precision == declared
                else f"{'the accelerator' if p.accelerator_name else 'args.mixed_precision'} says {declared}"
            )
            msg = (
                f"{p.name} asks for {_label(p.requested)} but {cause}"
                + (
                    f", so the next step computes in {_label(computes)}."
                    if severity == "error"
                    else f"; on this {setup_device(p, hw)} that still computes in {_label(computes)}, but the stale "
                    "setting will run any later Trainer in this kernel in "
                    f"{declared} on a GPU."
                )
            )
            native = native_amp_for(p.requested, device)
            fixes.append(
                alignment_fix(
                    f"Make {p.name} run in {_label(p.requested)} as its arguments ask",
                    alignment_code(live, p.requested, native, why=f"{p.name}: run in {_label(p.requested)} as asked"),
                    live,
                    p.requested,
                    native,
                )
            )
        else:
            msg = (
                f"{p.name} asks for {p.requested} but accelerate does not autocast {p.requested} on the "
                f"{setup_device(p, hw)} (native_amp=False): the run is silently {_label(computes)}."
                + (" On a CPU, bf16=True is the fast half precision." if setup_device(p, hw) == "cpu" else "")
            )
            flags = {"fp16": p.requested == "fp16", "bf16": p.requested == "bf16"}
            if live.acc is not None and p.requested in HALF:
                fixes.append(
                    alignment_fix(
                        f"Enable {p.requested} autocast on the {device} as {p.name} asks"
                        + (" (with a GradScaler; fp16 matmuls are slow on most CPUs)" if p.requested == "fp16" else ""),
                        alignment_code(
                            live, p.requested, True, flags, why=f"torch can autocast {p.requested} on the {device}"
                        ),
                        live,
                        p.requested,
                        True,
                        flags,
                    )
                )
            honest = {"fp16": False, "bf16": False}
            fixes.append(
                alignment_fix(
                    f"Make {p.name} say what runs: fp32 (use bf16=True for half precision on the CPU)",
                    alignment_code(live, "no", False, honest, why="accelerate runs fp16 on the CPU as fp32"),
                    live,
                    "no",
                    False,
                    honest,
                )
            )
        yield Finding("precision-override", severity, p.name, msg, evidence, fixes)


def _label(precision: str) -> str:
    return "fp32" if precision == "no" else precision


def _half_setup_models(facts: Facts) -> set[str]:
    """Models a setup will run under fp16/bf16 autocast."""
    out: set[str] = set()
    for p in facts.precisions:
        if computes_in(p, facts.hardware) in ("fp16", "bf16", "fp8"):
            out.update(p.model_names)
    return out


#: torch >= 2.9 keeps a per-backend ``fp32_precision`` beside the legacy flags; both are part of an exact undo.
_FP32_PRECISION_PATHS = (
    "backends",
    "backends.cuda.matmul",
    "backends.cudnn",
    "backends.cudnn.conv",
    "backends.cudnn.rnn",
    "backends.mkldnn",
    "backends.mkldnn.matmul",
    "backends.mkldnn.conv",
    "backends.mkldnn.rnn",
)


def _backend(path: str) -> Any:
    obj: Any = torch
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def fp32_precisions() -> dict:
    """``fp32_precision`` of every torch backend that has one (empty before torch 2.9)."""
    out = {}
    for path in _FP32_PRECISION_PATHS:
        try:
            out[path] = _backend(path).fp32_precision
        except (AttributeError, RuntimeError):
            pass
    return out


def restore_fp32_precisions(saved: dict) -> None:
    """Put back what :func:`fp32_precisions` read, parents first."""
    for path, value in saved.items():
        if fp32_precisions().get(path) != value:
            _backend(path).fp32_precision = value


@check("tf32-off", "info")
def tf32_off(facts: Facts) -> Iterator[Finding]:
    """fp32 matmuls on a GPU with TF32 tensor cores, with TF32 switched off.

    What it detects
        On the live device or the ``target=`` profile with TF32 (Ampere and later): a model whose weights
        are mostly fp32 and that no setup runs under fp16/bf16 autocast, while
        ``torch.backends.cuda.matmul.allow_tf32`` is False and ``torch.get_float32_matmul_precision()`` is
        ``"highest"`` (PyTorch's default).
    Why it matters
        fp32 matmuls then run on CUDA cores at a fraction of the tensor-core throughput (A100: 19.5 vs 156
        TFLOPS). TF32 keeps fp32's range with a 10-bit mantissa, which is ample for training.
    Fix
        ``torch.set_float32_matmul_precision("high")`` (also sets ``allow_tf32``), process-wide and
        reversible. Unsafe: it changes matmul numerics slightly (outputs differ in the fourth significant
        digit), so it is applied only on request.
    Source
        PyTorch docs "TensorFloat-32 (TF32) on Ampere (and later) devices"; ``torch.set_float32_matmul_precision``.
    """
    hw, rt = facts.hardware, facts.runtime
    if not hw.tf32 or rt.matmul_tf32 or rt.float32_matmul_precision != "highest" or rt.autocast.get("cuda"):
        return
    covered = _half_setup_models(facts)
    fp32 = [m.name for m in facts.models if m.tensors.main_dtype == "float32" and m.name not in covered]
    if not fp32:
        return

    def do() -> tuple[str, dict]:
        old = (torch.get_float32_matmul_precision(), fp32_precisions())
        torch.set_float32_matmul_precision("high")
        return old

    def undo(old: tuple[str, dict]) -> None:
        torch.set_float32_matmul_precision(old[0])
        restore_fp32_precisions(old[1])  # the legacy setter leaves "ieee" where "none" was

    def verify() -> str | None:
        return None if torch.get_float32_matmul_precision() == "high" else "float32_matmul_precision is not 'high'"

    fix = Fix(
        "Allow TF32 matmuls: torch.set_float32_matmul_precision('high')",
        "import torch\ntorch.set_float32_matmul_precision('high')  # TF32 tensor cores for fp32 matmuls",
        False,
        lambda: [Call(do, undo, "torch.set_float32_matmul_precision('high')")],
        verify,
    )
    yield Finding(
        "tf32-off",
        "info",
        "torch.backends.cuda.matmul.allow_tf32",
        f"{', '.join(fp32)} {'runs' if len(fp32) == 1 else 'run'} fp32 matmuls on {hw.label} with TF32 off: "
        "tensor cores sit idle; TF32 is several times faster with fp32's range.",
        {
            "allow_tf32": rt.matmul_tf32,
            "float32_matmul_precision": rt.float32_matmul_precision,
            "fp32_models": fp32,
            "device": hw.label,
        },
        [fix],
    )
