"""Checks on parameter dtypes: two dtypes in one compute path, grads that disagree with
their parameter, and a model held in another dtype than its checkpoint."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import NamedTuple

import torch

from ...facts import Facts, ModelFacts
from ...facts.intent import Island
from ...facts.tensors import FLOATING, ModuleDtypes
from ..engine.changes import CastGradsToParams, CastParamsTo, torch_dtype
from ..engine.findings import Finding, Severity, count, size_delta
from ..engine.fixes import Fix
from ..engine.rules import Applicability, Rule
from . import check


def widens(src: str, dst: str) -> bool:
    """True when every ``src`` value is exactly a ``dst`` value (bf16 -> fp32, fp16 -> fp32)."""
    a, b = torch_dtype(src), torch_dtype(dst)
    if a == b or not (a.is_floating_point and b.is_floating_point):
        return False
    # Compare formats directly: promote_types has no rule for float8 types.
    fa, fb = torch.finfo(a), torch.finfo(b)
    return fb.max >= fa.max and fb.eps <= fa.eps and fb.smallest_normal <= fa.smallest_normal


def _under(path: str, prefix: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _name(class_path: str) -> str:
    return class_path.rsplit(".", 1)[-1]


# ---------------------------------------------------------------------------------------------
# mixed-param-dtypes
# ---------------------------------------------------------------------------------------------

_NORM_NAME = re.compile(r"Norm(\d+d)?$")
#: Norm classes verified to return their input's dtype whatever their weight's dtype.
_NORMS_KEEPING_INPUT_DTYPE = ("torch.nn.modules.normalization.", "torch.nn.modules.batchnorm.", "torch.nn.modules.instancenorm.")
_GEMMA_NORM = re.compile(r"^transformers\.models\.\w+\.modeling_\w+\.Gemma\w*RMSNorm$")
#: Of those, the ones whose kernel takes a weight as wide as its input or wider (the mixed path: bf16 input, fp32
#: weight) and raises for a narrower one: 'mixed dtype (CPU): expect parameter to have scalar type of Float' for
#: an fp32 input and a bf16 weight (measured on torch 2.13's CPU; nn.RMSNorm promotes instead).
_NORMS_REFUSING_NARROWER = ("torch.nn.modules.normalization.LayerNorm", "torch.nn.modules.normalization.GroupNorm",
                            "torch.nn.modules.batchnorm.", "torch.nn.modules.instancenorm.")  # fmt: skip


class Unit(NamedTuple):
    """A module with direct floating parameters, as the mixed-dtype rule sees it."""

    module: ModuleDtypes
    #: "compute", "adapter" (behind a patched forward), "norm" (one that may promote) or "native-norm" (torch's
    #: LayerNorm / GroupNorm / BatchNorm / InstanceNorm: a weight narrower than the input raises)
    role: str
    patched: str | None  # origin of a patched forward on the module, its parent or its tuner layer


def _is_norm(class_path: str) -> bool:
    return bool(_NORM_NAME.search(_name(class_path)))


def _norm_keeps_input_dtype(class_path: str) -> bool:
    return class_path.startswith(_NORMS_KEEPING_INPUT_DTYPE) or bool(_GEMMA_NORM.match(class_path))


def _kept_in_fp32(path: str, keep: tuple[str, ...]) -> bool:
    dotted = f".{path}."
    return any(f".{name}." in dotted for name in keep)


def compute_units(m: ModelFacts, islands: tuple[Island, ...] = ()) -> list[Unit]:
    """The modules whose parameters meet the activations uncast (see ``mixed_param_dtypes``); modules under an
    ``islands`` path are off the compute path on purpose."""
    patched = dict(m.tensors.patched_forwards)
    tuners = sorted(m.tensors.tuner_layers, key=len, reverse=True)
    casts = dict(m.tensors.input_casts)
    units: list[Unit] = []
    for md in m.tensors.modules:
        if md.class_path.startswith("bitsandbytes.") or _kept_in_fp32(md.path, m.keep_in_fp32):
            continue
        if any(_under(md.path, i.path) for i in islands):
            continue  # an averaged copy, a metric or a frozen shadow: never fed the activations
        if not _is_norm(md.class_path) and _casts_its_input(casts.get(md.path), md):
            continue  # a deliberate island: its forward (or its parent's) casts its input to its weights' dtype
        tuner = next((t for t in tuners if md.path != t and _under(md.path, t)), None)
        if tuner is not None and not _under(md.path, f"{tuner}.base_layer"):
            # A PEFT adapter: PEFT casts the input to its dtype and the sum back, unless a patched
            # forward on the tuner layer or its parent reads the adapter weights itself.
            origin = patched.get(tuner) or patched.get(_parent(tuner))
            if origin is not None:
                units.append(Unit(md, "adapter", origin))
            continue
        origin = patched.get(md.path) or patched.get(_parent(md.path))
        if _is_norm(md.class_path):
            if not _norm_keeps_input_dtype(md.class_path):
                units.append(Unit(md, "norm", origin))
            elif md.class_path.startswith(_NORMS_REFUSING_NARROWER):
                units.append(Unit(md, "native-norm", origin))
            continue
        units.append(Unit(md, "compute", origin))
    return units


def _casts_its_input(kind: str | None, md: ModuleDtypes) -> bool:
    """The source casts this module's input to its weights: to their own dtype, or to fp32 for fp32 weights."""
    return kind == "own-dtype" or (kind == "float32" and md.dtypes == frozenset({"float32"}))


def _elements(m: ModelFacts) -> dict[str, int]:
    return {p.name: p.numel for p in m.tensors.params}


def compute_dtype(m: ModelFacts, units: list[Unit]) -> str | None:
    """The dtype holding most elements among the non-norm units (ties: the first unit's)."""
    numel = _elements(m)
    totals: dict[str, int] = {}
    for u in units:
        if u.role in ("norm", "native-norm"):
            continue
        for pname, dtype, _ in u.module.params:
            full = f"{u.module.path}.{pname}" if u.module.path else pname
            totals[dtype] = totals.get(dtype, 0) + numel.get(full, 0)
    if not totals:
        return None
    order = list(totals)
    return max(order, key=lambda d: (totals[d], -order.index(d)))


def _offenders(units: list[Unit], dtype: str) -> list[Unit]:
    out = []
    for u in units:
        others = u.module.dtypes - {dtype}
        if not others:
            continue
        target = torch_dtype(dtype)
        if u.role == "norm":
            # A norm only harms when its weight promotes the activations past the compute dtype.
            if all(torch.promote_types(torch_dtype(d), target) == target for d in others):
                continue
        elif u.role == "native-norm":
            # torch's own norm takes a wider weight (its mixed path) and raises for a narrower one.
            if all(torch.promote_types(torch_dtype(d), target) != target for d in others):
                continue
        out.append(u)
    return out


def autocast_cover(facts: Facts, m: ModelFacts) -> str | None:
    """What autocasts ``m``'s forward, if anything: torch.autocast now, accelerate's wrapper, a Trainer."""
    on = {dev: dt for dev, dt in facts.runtime.autocast.items() if dev in m.tensors.devices}
    if on:
        return ", ".join(f"torch.autocast({dev!r}, {dt})" for dev, dt in on.items())
    if m.forward_wrapped:
        return f"accelerate's autocast wrapper on {m.name}.forward"
    for setup in facts.precisions:
        if m.name in setup.model_names and setup.effective in ("fp16", "bf16"):
            return f"{setup.name} ({setup.effective} autocast)"
    return None


def _describe(units: list[Unit], limit: int = 3, owner: str = "") -> str:
    # Module paths under the model's own name (``net.1``, not a bare ``1`` of a Sequential).
    def named(path: str) -> str:
        return f"{owner}.{path}" if owner and path else path or owner or "<root>"

    parts = [f"{named(u.module.path)} ({_name(u.module.class_path)}: {'/'.join(sorted(u.module.dtypes))})" for u in units[:limit]]
    more = f" and {len(units) - limit} more" if len(units) > limit else ""
    return ", ".join(parts) + more


def _hold(units: list) -> str:
    """The verb after :func:`_describe`: one module holds, several hold."""
    return "holds" if len(units) == 1 else "hold"


def _cast_minority_fix(facts: Facts, m: ModelFacts, units: list[Unit], dtype: str) -> Fix:
    ids_by_name = {p.name: p for p in m.tensors.params}
    params, paths, narrowing = [], [], False
    for u in units:
        for pname, pdtype, _ in u.module.params:
            full = f"{u.module.path}.{pname}" if u.module.path else pname
            info = ids_by_name.get(full)
            if info is not None and pdtype != dtype:
                params.append(info)
                narrowing = narrowing or not widens(pdtype, dtype)
        paths.append(u.module.path)
    listed = "".join(f"\n    {p!r}," for p in paths)
    code = (
        f"for path in ({listed}\n):\n"
        f"    for p in {m.name}.get_submodule(path).parameters(recurse=False):\n"
        f"        if p.is_floating_point() and p.dtype != torch.{dtype}:\n"
        f"            p.data = p.data.to(torch.{dtype})  # same Parameter: optimizers keep their references"
    )
    spec = CastParamsTo(
        m.ref, frozenset(p.id for p in params), dtype, facts.optimizer_refs(m.tensors.param_ids), f"minority parameters of {m.name}"
    )
    delta = sum(p.numel * (torch_dtype(dtype).itemsize - torch_dtype(p.dtype).itemsize) for p in params)
    return Fix(
        f"Cast {count(len(params), 'parameter')} of {count(len(paths), 'module')} of {m.name} to {dtype}",
        code, applicability=Applicability.SAFE if not narrowing else Applicability.UNSAFE,
        changes=(spec,),
        backup_bytes=spec.backup_bytes(facts),
        recipe="cast-minority",
        cost=f"{size_delta(delta)} of weights",
    )


@check("mixed-param-dtypes", Severity.ERROR, Severity.WARNING, Severity.INFO,
       fix_safety=(Applicability.SAFE, Applicability.UNSAFE))  # fmt: skip
def mixed_param_dtypes(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """Parameters of two floating dtypes in one compute path that nothing casts between.

    What it does
        A model whose compute modules hold parameters of a dtype other than
        the model's compute dtype (the dtype of most elements), where no cast
        brings the activations to them. Compute modules are the modules with
        direct floating parameters, except: adapters inside PEFT tuner layers
        (PEFT casts the input to the adapter dtype and the sum back), unless a
        patched forward on the tuner layer or its parent (a function assigned
        from another package, as Unsloth's fused LoRA kernels are) reads the
        adapter weights itself; modules named in transformers'
        ``_keep_in_fp32_modules`` (its code casts around them); bitsandbytes
        layers (they cast to their compute dtype); modules whose own forward,
        or their parent's, casts their input to their weights' dtype (read from
        the source: ``x.to(self.weight.dtype)``, ``x.type_as(self.weight)``,
        ``self.gate(h.float())`` for an fp32 router or gate: a deliberate
        island); modules of one dtype whose forward pre-hook casts their input
        to that dtype and whose forward hook casts their output back (read from
        the hooks' source: a ReFT intervention kept fp32); averaged copies,
        metrics and frozen copies no optimizer holds; norms that return their
        input's dtype (torch's LayerNorm / RMSNorm / GroupNorm / BatchNorm,
        Gemma's RMSNorm), except torch's LayerNorm / GroupNorm / BatchNorm /
        InstanceNorm with a weight narrower than the compute dtype, which
        raise. Other norms count only when their weight is wider
        than the compute dtype, because ``weight * x`` then promotes the
        activations. Error for a compute module without autocast; warning
        when only such norms differ; under autocast (``torch.autocast`` now,
        accelerate's wrapped forward, a Trainer autocasting the model) only
        modules behind a patched forward are reported, as a warning, except
        for a model that generates when the only autocast is a training
        setup's: its steps are covered, ``generate()`` is not (warning).
    Why is this bad?
        Without autocast a matmul takes one dtype: an fp32 adapter or layer
        fed bf16 activations raises ``mat1 and mat2 must have the same dtype``
        (``expected m1 and m2 to have the same dtype``), and a norm that
        returns fp32 (Llama's RMSNorm) makes the next bf16 Linear raise it.
        Autocast casts the inputs of out-of-place matmuls but not of in-place
        ones (``addmm_``) inside custom autograd Functions, which is how
        Unsloth's fused LoRA backward met fp32 adapters under gradient
        checkpointing.
    Example
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)
        model.lm_head.float()
        model(input_ids)  # mat1 and mat2 must have the same dtype
    Use instead
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)
        model(input_ids)  # or run the forward under torch.autocast("cuda", dtype=torch.bfloat16)
    Severity
        Error for a compute module without autocast (the first matmul raises); warning for wider norms
        without autocast, patched forwards under autocast, or a generative model autocast only by a
        training setup's steps (``generate()`` outside them raises: TRL's fp32 norms, peft #1515); info when a probe ran the model's forward and
        backward on the user's batch without a dtype error (the mixture is cast around: deliberate);
        nothing for PEFT adapters, modules whose input their forward casts, autocast-covered models and
        norms that keep their input dtype.
    Fix safety
        Cast the minority parameters of the affected modules (with their
        grads and optimizer state) to the compute dtype in place, keeping the
        Parameter objects. Safe when every cast widens exactly (bf16 -> fp32);
        unsafe when it narrows (fp32 adapters -> bf16).
    Sources
        Unsloth issues #1260 and #212 ("expected mat1 and mat2 to have the
        same dtype, but got: c10::BFloat16 != float"); PEFT's LoRA
        ``_cast_input_dtype``; transformers ``_keep_in_fp32_modules``.
    """
    for m in facts.models:
        found = _mixed_offenders(facts, m)
        if found is None:
            continue
        offenders, dtype, islands, cover, scoped = found
        severity, msg = _scoped_message(m.name, offenders, dtype, cover) if scoped else _mixed_message(m.name, offenders, dtype, cover)
        clean = _probe_ran_clean(facts, m.name)
        if clean:
            severity, msg = Severity.INFO, (
                f"{msg} But the probe ran {m.name}'s forward and backward on your batch without a dtype error: "
                "something casts around these modules, so the mixture is deliberate here."
            )
        yield rule.finding(
            m.name,
            msg,
            {
                "compute_dtype": dtype,
                "modules": {u.module.path: sorted(u.module.dtypes) for u in offenders},
                "roles": {u.module.path: u.role for u in offenders},
                "autocast": cover,
                "patched_forwards": sorted({u.patched for u in offenders if u.patched}),
                "islands": {i.path: i.evidence for i in islands},
            },
            [_cast_minority_fix(facts, m, offenders, dtype)],
            severity=severity,
        )


def _mixed_offenders(facts: Facts, m: ModelFacts) -> tuple | None:
    """``(offenders, compute dtype, islands, autocast cover, scoped)`` of ``m``'s mixed compute modules, or None when
    nothing is mixed (one dtype, every other one on an island, or all covered by an autocast that covers every
    call)."""
    if len(m.tensors.module_dtypes) < 2:
        return None  # one floating dtype in the whole model: nothing can meet another
    islands = deliberate_islands(facts, m)
    units = compute_units(m, islands)
    dtype = compute_dtype(m, units)
    if dtype is None:
        return None
    offenders = [u for u in _offenders(units, dtype) if not _islanded(u, dtype, islands)]
    if not offenders:
        return None
    cover = autocast_cover(facts, m)
    scoped = cover is not None and _steps_only(facts, m)
    if cover is not None and not scoped:
        offenders = [u for u in offenders if u.patched and u.role not in ("norm", "native-norm")]
        if not offenders:
            return None
    return offenders, dtype, islands, cover, scoped


def _islanded(u: Unit, dtype: str, islands: tuple[Island, ...]) -> bool:
    """Every parameter of ``u`` in another dtype than ``dtype`` lies on an island (``_keep_in_fp32_modules``)."""
    others = [f"{u.module.path}.{n}" if u.module.path else n for n, d, _ in u.module.params if d != dtype]
    return bool(others) and all(any(_under(o, i.path) for i in islands) for o in others)


def deliberate_islands(facts: Facts, m: ModelFacts) -> tuple[Island, ...]:
    """The islands of ``m`` the evidence holds: averaged copies and metrics always; a frozen copy of a sibling only
    while no optimizer holds its parameters (an optimizer that does makes it a trained layer)."""
    held = frozenset().union(*(o.param_ids for o in facts.optimizers)) if facts.optimizers else frozenset()
    return tuple(i for i in getattr(m, "islands", ()) if i.kind != "shadow-copy" or not (i.param_ids & held))


def _probe_ran_clean(facts: Facts, model: str) -> bool:
    """A probe of ``model`` ran its forward and backward without an error (evidence the mixture is cast around)."""
    return any(getattr(p, "model", None) == model and getattr(p, "error", None) is None and getattr(p, "backward", False)
               for p in getattr(facts, "probes", ()) or ())  # fmt: skip


def _steps_only(facts: Facts, m: ModelFacts) -> bool:
    """The only autocast over ``m`` is a training setup's, around its own steps (no ``torch.autocast`` now, no
    wrapper on ``m.forward``), and ``m`` generates: ``generate()`` is called outside those steps."""
    on = any(dev in m.tensors.devices for dev in facts.runtime.autocast)
    return not on and not m.forward_wrapped and any(c.is_generation_config for c in m.configs)


def _scoped_message(model: str, offenders: list, dtype: str, cover: str | None) -> tuple[Severity, str]:
    """Severity and message of mixed-param-dtypes when only a training setup's steps autocast a generative model."""
    return Severity.WARNING, (
        f"{model} computes in {dtype} but {_describe(offenders, owner=model)} {_hold(offenders)} other dtypes; only "
        f"{cover} casts around them, and it autocasts its own training and evaluation steps: {model}.generate(...) or "
        f"any call outside them (a callback, inference after training) raises {_MISMATCH}. Cast them to {dtype}, or "
        "run the call under torch.autocast."
    )


def _mixed_message(model: str, offenders: list, dtype: str, cover: str | None) -> tuple[Severity, str]:
    """Severity and message of mixed-param-dtypes: patched forwards under autocast, compute modules, or norms."""
    if cover is not None:
        origins = sorted({u.patched for u in offenders if u.patched})
        return Severity.WARNING, (
            f"{_describe(offenders)} of {model} {_hold(offenders)} weights other than its {dtype} compute dtype and are read "
            f"by patched forwards ({', '.join(origins)}); {cover} does not reach in-place matmuls inside custom "
            "autograd Functions, so backward can raise 'expected mat1 and mat2 to have the same dtype'."
        )
    compute = [u for u in offenders if u.role != "norm"]
    if compute:
        native = [u for u in compute if u.role == "native-norm"]
        norms = (
            f"; torch's {'norm' if len(native) == 1 else 'norms'} {_describe(native, owner=model)}, narrower than "
            f"their {dtype} input, raise 'mixed dtype (CPU): expect parameter to have scalar type of Float'"
        ) if native else ""  # fmt: skip
        return Severity.ERROR, (
            f"{model} computes in {dtype} but {_describe(compute, owner=model)} {_hold(compute)} other "
            f"dtypes and nothing autocasts: the first matmul that meets both raises {_MISMATCH}{norms}; "
            "if your loop runs the forward under torch.autocast, diagnose inside it."
        )
    return Severity.WARNING, (
        f"{model} computes in {dtype} but the {'norm' if len(offenders) == 1 else 'norms'} {_describe(offenders, owner=model)} {_hold(offenders)} wider weights and nothing "
        f"autocasts: a norm that multiplies by its weight last (Llama's RMSNorm) returns the wider dtype, "
        f"and the next {dtype} matmul raises {_MISMATCH}."
    )


#: torch's two wordings of one dtype clash in a Linear (measured on torch 2.13): addmm's when it has a bias, mm's not.
_MISMATCH = ("'mat1 and mat2 must have the same dtype' (a Linear with a bias; without one, 'expected m1 and m2 to "
             "have the same dtype')")


# ---------------------------------------------------------------------------------------------
# grad-dtype-mismatch
# ---------------------------------------------------------------------------------------------

#: Optimizers whose step raises when a grad's dtype differs from its parameter's: their
#: ``lerp`` / ``addcmul`` updates take one dtype ("expected dtype c10::BFloat16 for `end`").
LERP_OPTIMIZERS = frozenset(
    {
        "torch.optim.adam.Adam",
        "torch.optim.adamw.AdamW",
        "torch.optim.adamax.Adamax",
        "torch.optim.nadam.NAdam",
        "torch.optim.radam.RAdam",
    }
)


def cast_grads_fix(title: str, code: str, owner: int, ids: frozenset[int], safe: bool) -> Fix:
    """A fix casting each parameter's grad to the parameter's dtype in place."""
    return Fix(title, code, applicability=Applicability.SAFE if safe else Applicability.UNSAFE, changes=(CastGradsToParams(owner, ids),), recipe="cast-grads")


_GradRows = list[tuple[int, str, "str | None"]]


def _grad_holders(facts: Facts) -> list[tuple[str, int, bool, _GradRows]]:
    """Each model whose grads differ from its parameters, and each optimizer's parameters no model holds:
    (name, ref, is_model, (id, dtype, grad dtype) rows)."""
    seen: set[int] = set()
    holders: list[tuple[str, int, bool, _GradRows]] = []
    for m in facts.models:
        seen |= m.tensors.param_ids
        if m.tensors.grads_differ:  # the aggregate spares a healthy model's per-parameter rows
            holders.append((m.name, m.ref, True, [(p.id, p.dtype, p.grad_dtype) for p in m.tensors.params]))
    for o in facts.optimizers:
        rows = [(p.id, p.dtype, p.grad_dtype) for p in o.params if p.id not in seen]
        holders.append((o.name, facts.subject(o.name).inner_ref, False, rows))
    return holders


def _grad_consequence(optimizers: list, crashing: list[str]) -> str:
    """What the mismatched grads will do at the next step."""
    if crashing:
        return f"{', '.join(crashing)}.step() will raise 'expected dtype ... but got dtype ...'"
    if optimizers:
        return f"{', '.join(o.name for o in optimizers)} will build optimizer state in the grads' dtype"
    return "an optimizer step will raise (Adam family) or build state in the grads' dtype"


@check("grad-dtype-mismatch", Severity.ERROR, Severity.WARNING, fix_safety=(Applicability.SAFE, Applicability.UNSAFE))
def grad_dtype_mismatch(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """Parameters whose ``.grad`` has another dtype than the parameter.

    What it does
        A parameter (of a model, or held only by an optimizer) whose ``.grad``
        dtype differs from its own: left behind by ``p.data = p.data.bfloat16()``
        after a backward, or made on purpose by casting ``p.grad.data`` (a
        ``--gradient_precision=fp32`` option). Error when an optimizer holding
        it is one of torch's Adam family, whose step then raises; warning
        otherwise.
    Why is this bad?
        torch refuses ``p.grad = g`` of another dtype, but ``.data`` writes slip
        past it. Adam, AdamW, Adamax, NAdam and RAdam then raise at ``step()``
        (``expected dtype c10::BFloat16 for `end` but got dtype float``); SGD
        with momentum silently builds fp32 state for bf16 parameters (twice
        the memory, and state that no longer matches its parameter).
    Example
        loss.backward()
        for p in model.parameters():
            p.grad = p.grad.float()  # the parameter is bf16
    Use instead
        loss.backward()  # each grad stays in its parameter's dtype
    Severity
        Error when an Adam-family optimizer holds the parameter (its step raises); warning otherwise.
    Fix safety
        Cast each grad to its parameter's dtype in place (``p.grad.data =
        p.grad.data.to(p.dtype)``, the same grad tensor). Safe when that widens
        the grad (bf16 grad of an fp32 parameter); unsafe when it narrows.
    Sources
        SimpleTuner issue #755 (``--gradient_precision=fp32``); torch.optim
        Adam's ``lerp`` update.
    """
    for name, owner, is_model, rows in _grad_holders(facts):
        bad = {pid: (dt, gdt) for pid, dt, gdt in rows if gdt is not None and gdt != dt}
        if not bad:
            continue
        optimizers = [o for o in facts.optimizers if o.param_ids & bad.keys()]
        crashing = [o.name for o in optimizers if o.class_path in LERP_OPTIMIZERS]
        pairs = sorted({f"{gdt} grads on {dt} parameters" for dt, gdt in bad.values()})
        safe = all(widens(gdt, dt) for dt, gdt in bad.values())
        consequence = _grad_consequence(optimizers, crashing)
        source = (
            f"{name}.parameters()"
            if is_model
            else f"(p for group in {name}.param_groups for p in group['params'])"
        )
        code = (
            f"for p in {source}:\n"
            "    if p.grad is not None and p.grad.dtype != p.dtype:\n"
            "        p.grad.data = p.grad.data.to(p.dtype)  # the same grad tensor, in the parameter's dtype"
        )
        yield rule.finding(
            name,
            f"{count(len(bad), 'parameter')} of {name} carry {'; '.join(pairs)}: {consequence}.",
            {"parameters": len(bad), "pairs": pairs, "optimizers": [o.name for o in optimizers], "raises_in": crashing},
            [cast_grads_fix(f"Cast {count(len(bad), 'grad')} of {name} to their parameter's dtype", code, owner, frozenset(bad), safe)],
            severity=Severity.ERROR if crashing else Severity.WARNING,
        )


# ---------------------------------------------------------------------------------------------
# load-dtype-mismatch
# ---------------------------------------------------------------------------------------------


def _load_harm(m: ModelFacts, saved: str, held: str, training: bool, frozen: list) -> tuple[Severity, str]:
    """The severity and the why of a model held in ``held`` whose checkpoint is ``saved``."""
    ratio = torch_dtype(held).itemsize // torch_dtype(saved).itemsize
    if frozen:
        size = sum(p.numel for p in frozen) * torch_dtype(held).itemsize
        return Severity.WARNING, (
            f"{count(len(frozen), 'frozen parameter')} ({size / 2**20:.2f} MiB) take no updates, so {held} master "
            f"weights do nothing for them: the frozen base holds {ratio}x the memory of its {saved} checkpoint "
            "(prepare_model_for_kbit_training upcasts a model that is not quantized)")  # fmt: skip
    if held == "float16":
        return Severity.WARNING, "fp16's range ends at 65504, so values trained in a wider range can overflow to inf"
    if widens(saved, held):
        return Severity.INFO, ("fp32 master weights are right under autocast" if training
                               else f"{ratio}x the memory for no extra information")  # fmt: skip
    return Severity.INFO, "precision is lost but the range is kept, which is usually intended"


def _cast_to_checkpoint(facts: Facts, m: ModelFacts, saved: str, held: str, frozen: list) -> Fix:
    """Cast ``m``'s ``held`` parameters (only the frozen ones, when given) back to the checkpoint's ``saved``."""
    params = frozen or [p for p in m.tensors.params if p.dtype == held]
    code = (
        f"# better: from_pretrained(..., dtype=torch.{saved})\n"
        f"for p in {m.name}.parameters():\n"
        f"    if p.dtype == torch.{held}:\n"
        f"        p.data = p.data.to(torch.{saved})"
    )
    spec = CastParamsTo(m.ref, frozenset(p.id for p in params), saved, facts.optimizer_refs(m.tensors.param_ids),
                        f"{held} parameters of {m.name}")  # fmt: skip
    if frozen:
        code = code.replace("if p.dtype ==", "if not p.requires_grad and p.dtype ==")
    return Fix(
        f"Cast {count(len(params), ('frozen ' if frozen else '') + held + ' parameter')} of {m.name} to the checkpoint's {saved}",
        code,
        changes=(spec,),
        backup_bytes=spec.backup_bytes(facts),
        recipe="cast-to-checkpoint",
    )


def _frozen_base(m: ModelFacts, held: str) -> list:
    """The frozen parameters of ``m`` in ``held`` when they are most of its elements and nothing in it is
    quantized (a quantized model keeps its norms in fp32 on purpose); empty otherwise."""
    if m.low_bit_layers or m.quantized_weights or m.stored_layers or m.float8_layers:
        return []
    params = m.tensors.params
    if any(p.quantized is not None or not p.dtype.startswith(("float", "bfloat")) for p in params):
        return []
    frozen = [p for p in params if p.dtype == held and not p.requires_grad]
    total = sum(p.numel for p in params)
    return frozen if total and 2 * sum(p.numel for p in frozen) > total else []


@check("load-dtype-mismatch", Severity.INFO, Severity.WARNING, fix_safety=(Applicability.UNSAFE,))
def load_dtype_mismatch(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A model held in another dtype than its checkpoint (``model.dtype != config.dtype``).

    What it does
        A model whose main parameter dtype (the dtype of most elements)
        differs from ``config.dtype`` / ``config.torch_dtype``, the dtype its
        checkpoint was saved in: a bf16 checkpoint loaded in fp32 (the default
        of transformers 4.x, or ``.float()`` after loading), or cast to fp16.
        Warning when the model is fp16 and the checkpoint is not (fp16's range
        ends at 65504; weights and activations trained in bf16 or fp32 can
        overflow to inf), and when an optimizer trains the model but most of its
        widened parameters are frozen (a frozen base upcast, as
        ``prepare_model_for_kbit_training`` does to a model that is not
        quantized); info otherwise.
    Why is this bad?
        fp32 weights from a bf16 checkpoint take twice the memory and add no
        information: right as fp32 master weights under autocast, waste for
        inference and for frozen weights, which take no updates. bf16 from an fp32 checkpoint drops mantissa bits but keeps
        the range, which is usually intended.
    Example
        model = AutoModelForCausalLM.from_pretrained(name)  # checkpoint saved in bf16
        model.half()
    Use instead
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)
    Severity
        Warning for fp16 from a wider checkpoint (overflow risk) and for a frozen base widened under
        training (measured: twice the base's bytes, no update reaches them); info otherwise (fp32 master
        weights of trained parameters are right under autocast; a quantized model's fp32 norms are
        intended).
    Fix safety
        Cast the parameters in the model's dtype to the checkpoint dtype in
        place, keeping the Parameter objects; under training only the frozen
        ones (the trained parameters keep their fp32 master weights); not
        offered for bf16 from fp32. Always unsafe: it changes
        the dtype layers compute in, and narrowing loses bits. Better: load
        with ``from_pretrained(..., dtype=...)``.
    Sources
        transformers ``from_pretrained`` ``dtype`` / ``torch_dtype`` argument
        (default fp32 before 5.0, "auto" since); mpdoctor field notes.
    """
    for m in facts.models:
        saved, held = m.config_dtype, m.tensors.main_dtype
        if saved not in FLOATING or held not in FLOATING or saved == held:
            continue
        training = bool(facts.optimizers_of(m))
        where = next((c.path for c in m.configs if c.dtype and not c.is_generation_config), m.config_path)
        frozen = _frozen_base(m, held) if training and widens(saved, held) else []
        severity, why = _load_harm(m, saved, held, training, frozen)
        offer = (not (training and widens(saved, held)) or bool(frozen)) and not (saved == "float32" and held == "bfloat16")
        fixes = [_cast_to_checkpoint(facts, m, saved, held, frozen)] if offer else []
        yield rule.finding(
            m.name,
            f"{m.name} holds {held} parameters but its checkpoint is {saved} ({where}.dtype): {why}.",
            {"model_dtype": held, "config_dtype": saved, "held_by_optimizer": training},
            fixes,
            severity=severity,
        )
