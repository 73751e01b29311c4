"""Checks on optimizers: dtype requirements, state that disagrees with its parameters, orphaned parameters, pure-bf16 Adam."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator

import torch

from ...facts import Facts, OptimizerFacts
from ...facts.optimizer import OptParam
from ...knowledge import REQUIREMENTS, DtypeRequirement
from ..engine.changes import CastGradsToParams, CastParamsTo, CastStateToParams
from ..engine.findings import Finding, Severity, count, size_delta
from ..engine.fixes import Fix
from ..engine.rules import Applicability, Rule
from . import check

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
#: How many bits of range and precision a floating dtype keeps; fp16 and bf16 are incomparable (equal here).
_WIDTH = {"float64": 3, "float32": 2, "bfloat16": 1, "float16": 1}


def requirement_for(class_path: str) -> DtypeRequirement | None:
    """The registry entry whose pattern matches ``class_path``, if any."""
    for req in REQUIREMENTS:
        if any(fnmatch.fnmatchcase(class_path, pat) for pat in req.patterns):
            return req
    return None


# -- fixes as data -----------------------------------------------------------------------------------------


def _memory_delta(params: Iterable[OptParam], dtype: str) -> str:
    delta = sum(p.numel * (_BYTES[dtype] - _BYTES.get(p.dtype, 4)) for p in params)
    return f"{size_delta(delta)} of weights"


_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def _cast_fix(facts: Facts, o: OptimizerFacts, title: str, code: str, params: list[OptParam], dtype: str, label: str,
              recipe: str, cost: str = "") -> Fix:
    """Cast ``params`` of optimizer ``o`` with their grads and their state in every optimizer holding them."""
    ids = frozenset(p.id for p in params)
    spec = CastParamsTo(facts.subject(o.name).inner_ref, ids, dtype, facts.optimizer_refs(ids), label)
    return Fix(
        title, code, changes=(spec,), backup_bytes=spec.backup_bytes(facts), recipe=recipe,
        cost=cost or _memory_delta(params, dtype),
    )


def _cast_code(optimizer_name: str, cond: str, dtype: str, why: str) -> str:
    """Pasteable Python doing what :class:`~mpdoctor.objects.edits.steps.CastParams` does for one optimizer's parameters."""
    return (
        "import torch\n"
        f"for group in {optimizer_name}.param_groups:\n"
        '    for p in group["params"]:\n'
        f"        if {cond}:  # {why}\n"
        f"            for key, value in {optimizer_name}.state.get(p, {{}}).items():\n"
        "                if torch.is_tensor(value) and value.dtype == p.dtype and value.shape == p.shape:\n"
        f"                    {optimizer_name}.state[p][key] = value.to(torch.{dtype})\n"
        f"            p.data = p.data.to(torch.{dtype})  # same Parameter object: the optimizer keeps it\n"
        "            if p.grad is not None:\n"
        f"                p.grad.data = p.grad.data.to(torch.{dtype})"
    )


def _grad_cast_fix(facts: Facts, o: OptimizerFacts, params: list[OptParam]) -> Fix:
    """Cast the gradients of ``params`` to their parameter's dtype, in place."""
    name = o.name
    code = (
        f"for group in {name}.param_groups:\n"
        '    for p in group["params"]:\n'
        "        if p.grad is not None and p.grad.dtype != p.dtype:\n"
        "            p.grad.data = p.grad.data.to(p.dtype)  # the kernel reads p in the grad's dtype"
    )
    spec = CastGradsToParams(facts.subject(name).inner_ref, frozenset(p.id for p in params), "gradients")
    return Fix(f"Cast {count(len(params), 'gradient')} of {name} to their parameter's dtype", code, changes=(spec,), recipe="cast-grads")


def _on_cuda(facts: Facts, o: OptimizerFacts) -> bool:
    """The optimizer's parameters live on a CUDA device, or ``target=`` asks about a GPU."""
    if not facts.hardware.live and facts.hardware.kind == "cuda":
        return True
    return any("cuda" in t.devices for t in o.tallies)


# -- checks -----------------------------------------------------------------------------------------------


@check("optimizer-dtype-requirement", Severity.ERROR, Severity.WARNING, Severity.INFO, fix_safety=(Applicability.UNSAFE,))
def optimizer_dtype_requirement(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """An optimizer with dtype requirements holding parameters, gradients or state that break them.

    What it does
        Optimizers from a small registry (``REQUIREMENTS``, keyed by class-path patterns) whose trainable
        parameters, gradients or state have dtypes the optimizer cannot use: ``adamw_bf16.AdamWBF16`` (and
        SimpleTuner's vendored ``adam_bfloat16`` copy) with non-bf16 parameters; optimi optimizers created
        with ``kahan_sum=True`` over fp32 parameters; bitsandbytes 8-bit optimizers with parameters outside
        fp32/fp16/bf16 on a CUDA device or a GPU ``target=`` (its CPU backend steps float64), gradients whose dtype differs from their parameter, floating state other than fp32,
        or 32-bit state on parameters large enough for 8-bit state (info).
    Why is this bad?
        ``AdamWBF16`` asserts ``p.dtype == torch.bfloat16`` when it initialises the state of a parameter
        with a gradient: ``AssertionError: only bfloat 16 is supported.`` at the first ``step()``. optimi
        silently skips Kahan summation for fp32 parameters, so the low-precision recipe the user chose is
        not running. bitsandbytes picks its kernel by the gradient's dtype and reads the parameter in that
        dtype, so a mismatched pair is rejected or misread.
    Example
        model = get_peft_model(model.to(torch.bfloat16), lora_config)  # LoRA adapters stay fp32
        optimizer = AdamWBF16(model.parameters())  # only bfloat16 is supported
    Use instead
        model = get_peft_model(model.to(torch.bfloat16), lora_config)
        model.to(torch.bfloat16)  # adapters too
        optimizer = AdamWBF16(model.parameters())
    Severity
        Error where the optimizer raises or misreads (AdamWBF16, bitsandbytes); warning where the recipe
        silently does not run (optimi's Kahan summation); info for 32-bit state where 8-bit was
        expected.
    Fix safety
        Cast the offending parameters (with their grads and every optimizer's state for them) to the
        dtype the optimizer needs, in place: the Parameter objects stay the same, so the optimizer, the
        model and any scheduler keep their references. For bitsandbytes, gradients in another dtype than
        their parameter are cast to the parameter's dtype; its state findings have no automatic fix.
        Unsafe: it narrows fp32 weights to bf16.
    Sources
        SimpleTuner issue #755 (``--gradient_precision=fp32`` with ``adam_bfloat16``); adamw-bf16 0.0.3;
        optimi ``Adam._init_state``; bitsandbytes ``functional.optimizer_update_32bit``.
    """
    for o in facts.optimizers:
        req = requirement_for(o.class_path)
        if req is None or not req.applies(o):
            continue
        mismatched_grads = [p for p in o.params if p.grad_dtype is not None and p.grad_dtype != p.dtype]
        yield from _unaccepted_params(facts, rule, o, req, mismatched_grads)
        if req.grads_match_params and mismatched_grads:
            yield _grads_unlike_params(facts, rule, o, req, mismatched_grads)
        yield from _unaccepted_state(rule, o, req)


def _unaccepted_params(
    facts: Facts, rule: Rule, o: OptimizerFacts, req: DtypeRequirement, mismatched_grads: list[OptParam]
) -> Iterator[Finding]:
    """The finding of trainable parameters in a dtype the optimizer does not accept, with the cast that fixes it."""
    bad = [p for p in o.params if p.requires_grad and p.dtype not in req.param_dtypes]
    if bad and req.params_rule_cuda_only and not _on_cuda(facts, o):
        return  # the CPU backend steps these dtypes (bitsandbytes 0.50.2, measured)
    if not bad:
        return
    dtypes = sorted({p.dtype for p in bad})
    elements = sum(p.numel for p in bad)
    fixes = []
    if req.cast_to is not None:
        accepted = " and ".join(f"p.dtype != torch.{d}" for d in sorted(req.param_dtypes))
        fixes.append(
            _cast_fix(
                facts,
                o,
                f"Cast {count(len(bad), 'trainable ' + '/'.join(dtypes) + ' parameter')} of {o.name} to {req.cast_to} in place",
                _cast_code(
                    o.name,
                    f"p.requires_grad and {accepted}",
                    req.cast_to,
                    f"{req.name} needs {'/'.join(sorted(req.param_dtypes))}",
                ),
                bad,
                req.cast_to,
                f"parameters held by {o.name}",
                "meet-optimizer-requirement",
            )
        )
    yield rule.finding(
        o.name,
        f"{o.name} ({req.name}) holds {count(len(bad), 'trainable ' + '/'.join(dtypes) + ' parameter')} "
        f"({elements:,} elements): {req.consequence}.",
        {
            "optimizer": o.class_path,
            "requirement": req.name,
            "accepted_param_dtypes": sorted(req.param_dtypes),
            "offending_param_dtypes": dtypes,
            "offending_params": len(bad),
            "grads_in_another_dtype": len(mismatched_grads),
        },
        fixes,
        severity=req.severity,
    )


def _grads_unlike_params(
    facts: Facts, rule: Rule, o: OptimizerFacts, req: DtypeRequirement, mismatched_grads: list[OptParam]
) -> Finding:
    """The finding of gradients in another dtype than their parameter, for a kernel chosen by the gradient."""
    pairs = sorted({f"{p.dtype} param / {p.grad_dtype} grad" for p in mismatched_grads})
    return rule.finding(
        o.name,
        f"{o.name} ({req.name}) has {len(mismatched_grads)} parameters whose gradients are in another dtype "
        f"({', '.join(pairs)}): the kernel is chosen by the gradient's dtype and reads the parameter in it.",
        {"optimizer": o.class_path, "requirement": req.name, "pairs": pairs},
        [_grad_cast_fix(facts, o, mismatched_grads)],
    )


def _unaccepted_state(rule: Rule, o: OptimizerFacts, req: DtypeRequirement) -> Iterator[Finding]:
    """The findings of state in a dtype the kernels do not expect, and of 32-bit state where 8-bit saves memory."""
    if req.state_dtypes is not None:
        wrong = sorted({sd for p in o.params for _k, sd in p.state_dtypes if sd not in req.state_dtypes})
        if wrong:
            yield rule.finding(
                o.name,
                f"{o.name} ({req.name}) has {'/'.join(wrong)} state tensors; its 32-bit kernels expect "
                f"{'/'.join(sorted(req.state_dtypes))} state ({req.consequence}).",
                {"optimizer": o.class_path, "state_dtypes": wrong},
            )
    if req.low_bit_from is not None:
        big = [p for p in o.params if p.numel >= req.low_bit_from and p.state_dtypes]
        if big:
            yield rule.finding(
                o.name,
                f"{o.name} ({req.name}) keeps 32-bit floating state for {len(big)} parameters of at least "
                f"{req.low_bit_from} elements (optim_bits=32 or a per-parameter override): no memory is saved there.",
                {"optimizer": o.class_path, "params_with_32bit_state": len(big), "min_8bit_size": req.low_bit_from},
                severity=Severity.INFO,
            )


#: torch optimizers whose update mixes state and gradient with ``lerp`` / ``addcmul`` in one dtype: any
#: state/param dtype mismatch raises there (measured on torch 2.13, for-loop and foreach paths alike).
_SAME_DTYPE_ONLY = frozenset(
    {
        "torch.optim.adam.Adam",
        "torch.optim.adamw.AdamW",
        "torch.optim.adamax.Adamax",
        "torch.optim.nadam.NAdam",
        "torch.optim.radam.RAdam",
        "torch.optim._adafactor.Adafactor",
    }
)


def _narrower(state: str, param: str) -> bool:
    """True when a state in ``state`` dtype loses range or precision against ``param`` (fp16 vs bf16: both ways)."""
    if state == param:
        return False
    return _WIDTH.get(state, 0) <= _WIDTH.get(param, 0)


def _state_cast_fix(
    facts: Facts, o: OptimizerFacts, flagged: list[tuple[int, str, str, str]], pairs: list[tuple[str, str]], widening: bool
) -> Fix:
    """Cast the flagged state tensors of optimizer ``o`` to their parameter's dtype, in place."""
    name = o.name
    pair_code = ", ".join(f"(torch.{pd}, torch.{sd})" for pd, sd in pairs)
    code = (
        "import torch\n"
        f"mismatched = {{{pair_code}}}  # (param dtype, state dtype) pairs found\n"
        f"for group in {name}.param_groups:\n"
        '    for p in group["params"]:\n'
        f"        for key, value in {name}.state.get(p, {{}}).items():\n"
        "            if torch.is_tensor(value) and value.shape == p.shape and (p.dtype, value.dtype) in mismatched:\n"
        f"                {name}.state[p][key] = value.to(p.dtype)  # as load_state_dict does"
    )
    spec = CastStateToParams(
        facts.subject(name).inner_ref, frozenset((i, k) for i, k, *_ in flagged), f"state tensors of {name} to their parameter's dtype"
    )
    return Fix(
        f"Cast {count(len(flagged), 'state tensor')} of {name} to their parameter's dtype", code, applicability=Applicability.SAFE if widening else Applicability.UNSAFE,
        changes=(spec,), recipe="cast-state",
    )


@check("optimizer-state-dtype-mismatch", Severity.ERROR, Severity.WARNING, fix_safety=(Applicability.SAFE, Applicability.UNSAFE))
def optimizer_state_dtype_mismatch(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """Optimizer state tensors in another dtype than their parameter, where that breaks or degrades the update.

    What it does
        A full-size floating state tensor (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ...: same shape
        as its parameter) whose dtype differs from its parameter's, counted as a problem when (a) the
        optimizer is a ``torch.optim`` class and the state is narrower than the parameter (fp16/bf16 state
        for fp32 weights, or fp16 against bf16), or the class is one of Adam, AdamW, Adamax, NAdam, RAdam,
        Adafactor, which need the two to match exactly; or (b) a third-party optimizer keeps state
        narrower than its parameter. Wider state in third-party optimizers (fp32 moments for bf16 weights)
        is a legitimate design and is not reported.
    Why is this bad?
        Usually the result of casting a model (``model.float()`` / ``.half()`` / ``.to(dtype)``) after the
        optimizer has stepped: the parameters change dtype, the state does not. torch's Adam family then
        raises at the next ``step()`` (``expected dtype ... for `end` but got ...``), foreach kernels (the
        CUDA default) reject any narrower state, and where a step still runs, fp16 second moments underflow
        for gradients below ~2.4e-4 and blow the update up.
    Example
        optimizer.load_state_dict(torch.load("opt.pt"))
        model.float()  # the Adam moments stay bf16
    Use instead
        model.float()
        optimizer.load_state_dict(torch.load("opt.pt"))  # casts the state to the parameters' dtype
    Severity
        Error for torch optimizers whose next step raises; warning for narrower state elsewhere.
    Fix safety
        Cast the mismatched state tensors to their parameter's dtype in place, as
        ``Optimizer.load_state_dict`` does. Safe when every cast widens (fp16/bf16 state to fp32: values are
        kept exactly); unsafe when one narrows.
    Sources
        torch.optim ``_single_tensor_adamw`` / ``_multi_tensor_adamw`` (lerp requires one dtype);
        ``Optimizer._process_value_according_to_param_policy``.
    """
    for o in facts.optimizers:
        torch_class = o.class_path.startswith("torch.optim.")
        same_only = o.class_path in _SAME_DTYPE_ONLY
        flagged: list[tuple[int, str, str, str]] = []  # (param id, key, param dtype, state dtype)
        crashes = False
        for p in o.params:
            for key, sd in p.state_dtypes:
                if sd == p.dtype or sd not in _WIDTH or p.dtype not in _WIDTH:
                    continue
                narrower = _narrower(sd, p.dtype)
                if torch_class and (narrower or same_only):
                    crashes = True
                    flagged.append((p.id, key, p.dtype, sd))
                elif narrower:
                    flagged.append((p.id, key, p.dtype, sd))
        if not flagged:
            continue
        pairs = sorted({(pd, sd) for _i, _k, pd, sd in flagged})
        widening = all(_WIDTH[pd] > _WIDTH[sd] for pd, sd in pairs)
        fixes = [_state_cast_fix(facts, o, flagged, pairs, widening)]
        desc = ", ".join(f"{sd} state for {pd} params" for pd, sd in pairs)
        yield rule.finding(
            o.name,
            f"{o.name} ({o.class_name}) holds {count(len(flagged), 'state tensor')} in another dtype than their parameter ({desc}): "
            + (
                "its next step() will raise (or, where it runs, update with the wrong precision)."
                if crashes
                else "the moments lose range or precision the parameters have."
            ),
            {"optimizer": o.class_path, "pairs": [list(x) for x in pairs], "state_tensors": len(flagged)},
            fixes,
            severity=Severity.ERROR if crashes else Severity.WARNING,
        )


def _numel_multiset(values: Iterable[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _contained(small: dict[int, int], big: dict[int, int]) -> bool:
    return bool(small) and all(big.get(k, 0) >= n for k, n in small.items())


@check("optimizer-params-not-in-model", Severity.ERROR, Severity.WARNING, Severity.INFO, fix_safety=(Applicability.DISPLAY_ONLY,))
def optimizer_params_not_in_model(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """An optimizer holding parameters that no inspected model has.

    What it does
        With at least one model inspected: an optimizer that shares no parameter with any of them, or
        one that shares some with a model but also holds parameters no inspected model has. It is an
        error when the evidence says the model was replaced: the orphaned parameters have the shapes of
        a model's parameters (the model was re-created, copied, or ``.to(dtype)`` was called on a
        ``copy.deepcopy``), or of the trainable parameters a model has that the optimizer lacks (a module
        was swapped after the optimizer was built); a warning (no shared parameter, no twin) or info
        (a few extra parameters, such as a learnable loss temperature) otherwise.
    Why is this bad?
        ``optimizer.step()`` updates the tensors the optimizer holds. When they are not the model's, the
        model never changes: the loss stays flat while everything runs without an error.
    Example
        optimizer = torch.optim.AdamW(model.parameters())
        model = model.to(torch.bfloat16).to("cuda")  # .to() can replace Parameters
    Use instead
        model = model.to(torch.bfloat16).to("cuda")
        optimizer = torch.optim.AdamW(model.parameters())  # built from the live parameters
    Severity
        Error when the orphaned parameters are twins of a model's (the model was replaced); warning when
        nothing is shared; info for a few extra tensors.
    Fix safety
        None automatic. Re-create the optimizer (and its LR scheduler, and the Trainer or ``accelerate``
        wrapper that holds it) from the live model's ``parameters()``. mpdoctor does not rebind: the
        scheduler, ``AcceleratedOptimizer`` and Trainer keep references to the old optimizer object, and
        moving Adam moments from the old parameters to new ones would apply another run's history to
        weights it never saw.
    Sources
        torch.optim docs ("construct optimizers after moving the model": an optimizer holds parameter
        references, not names); ``copy.deepcopy`` and ``from_pretrained`` create new Parameters.
    """
    if not facts.models:
        return
    all_ids: set[int] = set()
    for m in facts.models:
        all_ids |= m.tensors.param_ids
    for o in facts.optimizers:
        orphans = [p for p in o.params if p.id not in all_ids]
        if not orphans:
            continue
        models = facts.models_of(o)
        orphan_numels = _numel_multiset(p.numel for p in orphans)
        twins = [m.name for m in facts.models if _contained(orphan_numels, _numel_multiset(p.numel for p in m.tensors.params))]
        owner = (models[0].name if models else twins[0] if twins else facts.models[0].name)
        cls = o.class_path.rsplit(".", 1)[0] + "." + o.class_name if not o.class_path.startswith("torch.optim.") else f"torch.optim.{o.class_name}"
        hint = f"{o.name} = {cls}({owner}.parameters(), ...)  # from the live model, with your hyper-parameters"
        if not models:
            severity, msg = _orphaned_optimizer(facts, o, twins)
        else:
            severity, msg = _orphans_beside_model(o, models, orphans, orphan_numels)
        yield rule.finding(
            o.name,
            msg + f" Re-create the optimizer from the live model: {hint}",
            {
                "orphan_params": len(orphans),
                "orphan_elements": sum(p.numel for p in orphans),
                "shared_with": [m.name for m in models],
                "suggested_code": hint,
            },
            [
                Fix(
                    f"Re-create {o.name} from {owner}'s live parameters",
                    hint,
                    applicability=Applicability.DISPLAY_ONLY,
                    recipe="recreate-optimizer",
                    cost="the optimizer's state restarts (as at step 0)",
                )
            ],
            severity=severity,
        )


def _orphaned_optimizer(facts: Facts, o: OptimizerFacts, twins: list[str]) -> tuple[Severity, str]:
    """Severity and message for an optimizer that shares no parameter with any inspected model."""
    where = (
        f"its parameters have the shapes of {', '.join(twins)}'s but are other tensors: the model was "
        "re-created or copied after the optimizer was built, so step() updates a model nobody uses"
        if twins
        else "it updates tensors of a model mpdoctor was not shown (or of one that no longer exists)"
    )
    msg = f"{o.name} shares no parameter with any inspected model ({', '.join(m.name for m in facts.models)}); {where}."
    return (Severity.ERROR if twins else Severity.WARNING), msg


def _orphans_beside_model(
    o: OptimizerFacts, models: list, orphans: list[OptParam], orphan_numels: dict[int, int]
) -> tuple[Severity, str]:
    """Severity and message for an optimizer holding parameters its model no longer has."""
    held = o.param_ids
    missing = [p for m in models for p in m.tensors.params if p.requires_grad and p.id not in held]
    swapped = _contained(orphan_numels, _numel_multiset(p.numel for p in missing))
    msg = (
        f"{o.name} holds {len(orphans)} parameters that {', '.join(m.name for m in models)} no longer has"
        + (
            f", and {len(missing)} trainable parameters of the model with the same shapes are in no optimizer: "
            "a module was replaced after the optimizer was built, so the new one never trains."
            if swapped
            else " (extra tensors such as a learnable loss temperature, or leftovers of a replaced module)."
        )
    )
    return (Severity.ERROR if swapped else Severity.INFO), msg


#: Stock torch optimizers whose moments follow the parameter dtype (``zeros_like(p)``).
_STOCK_ADAM = frozenset({"torch.optim.adam.Adam", "torch.optim.adamw.AdamW"})
#: bf16 keeps 8 significant bits: an addition smaller than half a unit in the last place is lost.
BF16_HALF_ULP = 2.0**-8
#: Share of sampled bf16 weights whose step of size lr rounds away, below which pure-bf16-adamw is info.
BF16_LOST_SHARE_WARNING = 0.01


@check("pure-bf16-adamw", Severity.WARNING, Severity.INFO, fix_safety=(Applicability.UNSAFE, Applicability.DISPLAY_ONLY))
def pure_bf16_adamw(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """bf16 weights updated by stock torch Adam/AdamW, whose moments and update are then bf16 too.

    What it does
        ``torch.optim.Adam`` / ``AdamW`` holding trainable bf16 parameters whose ``exp_avg`` /
        ``exp_avg_sq`` are bf16 (or not created yet: torch creates them in the parameter's dtype).
    Why is this bad?
        An Adam step moves each weight by about ``lr``; bf16 keeps 8 significant bits, so the step is lost
        whenever it is smaller than half a unit in the last place, i.e. for every weight larger than about
        ``256 * lr`` in magnitude (0.0026 at ``lr=1e-5``). Most updates round to zero and training stalls
        without any error.
    Example
        model.to(torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)  # small updates round away
    Use instead
        model.float()  # fp32 master weights
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
    Severity
        Calibrated on the weights at hand: the share of trainable bf16 weights whose step of size ``lr``
        rounds away (``|w| >= 2 ** (floor(log2(lr)) + 9)``, read from a strided sample of each tensor). Warning
        from 1% (a stalled loss, no crash); info below, where the loss is negligible (LoRA adapters start at
        zero or small, so their steps land until the weights grow: the fp32-master fix is then advice only).
        Nothing for the optimizer of a Lightning ``bf16-true`` run: ``lightning-true-half-adam`` names the
        cause there, since Lightning casts the module back to bf16 at every ``fit`` and an in-place cast
        would not last.
    Fix safety
        Keep fp32 master weights: cast the trainable bf16 parameters (with their grads and Adam state) to
        fp32 in place, keeping the Parameter objects, and compute in bf16 with autocast
        (``TrainingArguments(bf16=True)`` / ``torch.autocast(..., dtype=torch.bfloat16)``). Unsafe: it
        doubles their memory and changes the dtype they compute in without autocast. Alternatives that
        stay in bf16: ``adamw_bf16.AdamWBF16`` (stochastic rounding) or optimi with ``kahan_sum=True``.
    Sources
        "Revisiting BFloat16 Training" (Zamirai et al., 2020); optimi's low-precision training notes;
        adamw-bf16 README.
    """
    # A Lightning true-half run converts the module back to its precision at every fit, so an in-place
    # fp32 cast would not last: lightning-true-half-adam names the same cause with a fix that does.
    lightning_owned = {n for p in facts.lightning if p.true_half for n in p.optimizer_names}
    for o in facts.optimizers:
        if o.class_path not in _STOCK_ADAM or o.name in lightning_owned:
            continue
        pure = [
            p
            for p in o.params
            if p.requires_grad
            and p.dtype == "bfloat16"
            and all(sd == "bfloat16" for k, sd in p.state_dtypes if k in ("exp_avg", "exp_avg_sq"))
        ]
        if not pure:
            continue
        lr = o.defaults.get("lr")
        measured = o.bf16_update_loss
        share = measured[1] / measured[0] if measured else None
        severity = Severity.INFO if share is not None and share < BF16_LOST_SHARE_WARNING else Severity.WARNING
        fixes = _bf16_adamw_fixes(facts, o, pure, lr, severity)
        lost, tail = _bf16_loss_words(lr, share, severity)
        yield rule.finding(
            o.name,
            f"{o.name} ({o.class_name}) updates {count(len(pure), 'trainable bf16 parameter')} with bf16 moments: bf16 keeps "
            f"8 significant bits, so{lost}{tail}",
            {
                "optimizer": o.class_path,
                "bf16_params": len(pure),
                "bf16_elements": sum(p.numel for p in pure),
                "lr": lr,
                "lost_share": share,
                "sampled_elements": measured[0] if measured else None,
            },
            fixes,
            severity=severity,
        )


def _bf16_adamw_fixes(facts: Facts, o: OptimizerFacts, pure: list[OptParam], lr: object, severity: Severity) -> list[Fix]:
    """fp32 master weights (for the warning) and a bf16-safe optimizer (display-only)."""
    fixes = []
    if severity == Severity.WARNING:
        code = _cast_code(
            o.name, "p.requires_grad and p.dtype == torch.bfloat16", "float32", "fp32 master weights"
        ) + (
            "\n# then compute in bf16 with autocast: TrainingArguments(bf16=True) or\n"
            "# with torch.autocast(device_type, dtype=torch.bfloat16): loss = model(**batch).loss\n"
            "# (or keep bf16 weights with adamw_bf16.AdamWBF16 / optimi kahan_sum=True)"
        )
        fixes.append(
            _cast_fix(
                facts,
                o,
                f"Keep fp32 master weights: cast {count(len(pure), 'trainable bf16 parameter')} of {o.name} to fp32",
                code,
                pure,
                "float32",
                f"trainable bf16 parameters held by {o.name}",
                "fp32-master-weights",
                cost=_memory_delta(pure, "float32") + " (fp32 master copies); bf16 compute comes from autocast",
            )
        )
    fixes.append(
        Fix(
            f"Keep bf16 weights and use a bf16-safe optimizer instead of {o.class_name}",
            f"from adamw_bf16 import AdamWBF16  # pip install adamw-bf16: stochastic rounding\n"
            f"{o.name} = AdamWBF16(model.parameters(), lr={lr!r})  # or optimi.AdamW(..., kahan_sum=True)",
            applicability=Applicability.DISPLAY_ONLY,
            recipe="bf16-safe-optimizer",
            cost="no extra weight memory; the optimizer is re-created, so its state restarts",
        )
    )
    return fixes


def _bf16_loss_words(lr: object, share: float | None, severity: Severity) -> tuple[str, str]:
    """How large a weight must be for its step to round away at ``lr``, and what share of weights is."""
    lost = (
        f" at lr={lr:g} a step is lost for every weight larger than {lr / BF16_HALF_ULP:.2g} in magnitude"
        if isinstance(lr, (int, float)) and lr > 0
        else " a step is lost for every weight larger than about 256 * lr in magnitude"
    )
    if share is None:
        tail = "; training stalls silently."
    elif severity == Severity.WARNING:
        tail = f": {share:.0%} of these weights are that large now, so their updates round away; training stalls silently."
    else:
        tail = (
            f": {share:.2%} of these weights are that large now (small or zero weights such as fresh LoRA adapters "
            "keep their steps), so little is lost yet; it grows as the weights do."
        )
    return lost, tail
