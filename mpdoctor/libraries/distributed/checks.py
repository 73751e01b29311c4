"""Checks on distributed training: FSDP units, reduce dtypes, launches, and what the ranks disagree on."""

from __future__ import annotations

from collections.abc import Iterator

from ...facts import Facts, ModelFacts
from ...facts.tensors import FLOATING
from ...rules.checks import check
from ...rules.engine.changes import CastParamsTo, ResetAccelerateState, torch_dtype
from ...rules.engine.findings import Finding, Severity
from ...rules.engine.fixes import Fix
from ...rules.engine.rules import Applicability, Rule
from .facts import DistributedFacts

HALF = ("float16", "bfloat16")


def _widens(src: str, dst: str) -> bool:
    return torch_dtype(dst).itemsize >= torch_dtype(src).itemsize and not {src, dst} == set(HALF)


def _cast_fix(facts: Facts, m: ModelFacts, dtype: str, recipe: str, why: str) -> Fix | None:
    params = [p for p in m.tensors.params if p.dtype in FLOATING and p.dtype != dtype]
    if not params:
        return None
    safe = all(_widens(p.dtype, dtype) for p in params)
    code = (
        f"for p in {m.name}.parameters():  # {why}\n"
        f"    if p.is_floating_point() and p.dtype != torch.{dtype}:\n"
        f"        p.data = p.data.to(torch.{dtype})"
    )
    spec = CastParamsTo(m.ref, frozenset(p.id for p in params), dtype, facts.optimizer_refs(m.tensors.param_ids), f"parameters of {m.name}")
    return Fix(f"Cast {len(params)} parameters of {m.name} to {dtype}", code, applicability=Applicability.SAFE if safe else Applicability.UNSAFE, changes=(spec,),
               backup_bytes=spec.backup_bytes(facts), recipe=recipe)  # fmt: skip


def _float_dtypes(m: ModelFacts) -> dict[str, int]:
    return {d: n for d, n in m.tensors.param_dtype_counts().items() if d in FLOATING}


@check("fsdp-mixed-dtype-unit", Severity.ERROR, fix_safety=(Applicability.UNSAFE, Applicability.DISPLAY_ONLY))
def fsdp_mixed_dtype_unit(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """An FSDP unit, or a model an FSDP wrap is planned for, holds parameters of more than one dtype.

    What it does
        An FSDP2 ``fully_shard``-ed module whose parameters have different original
        dtypes (the wrap succeeded; the first forward has not run), or a plain model with
        mixed floating parameter dtypes while a Trainer's ``fsdp`` arguments or an
        Accelerator's FSDP plugin are set to wrap it.
    Why is this bad?
        FSDP flattens (FSDP1) or all-gathers (FSDP2) a unit's parameters as one buffer of
        one dtype. FSDP1 raises ``ValueError: Must flatten tensors with uniform dtype but
        got ...`` when it wraps; FSDP2 raises ``AssertionError: FSDP expects uniform
        original parameter dtype but got {...}`` at the first forward, on every rank.
    Example
        model.lm_head.float()  # the rest of the model is bf16
        model = FSDP(model, use_orig_params=True)
    Use instead
        model.float()  # one dtype for every parameter of a unit
        model = FSDP(model, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    Severity
        error: the run cannot start.
    Fix safety
        Cast the model's parameters to one dtype (fp32 master weights; the FSDP mixed
        precision policy gives the 16-bit compute) before wrapping. An FSDP2 unit already
        sharded cannot be cast in place: rebuild it from a uniformly-typed model.
    Sources
        torch ``distributed/fsdp/_flat_param.py`` (``_validate_tensors_to_flatten``) and
        ``_fully_shard/_fsdp_param.py`` (``init_dtype_attrs``), reproduced on torch 2.13.
    """
    dist = facts.distributed
    if dist is None:
        return
    for u in dist.fsdp_units:
        if len(u.dtypes) < 2:
            continue
        listed = ", ".join(f"{n} ({d})" for d, n in u.examples[:6])
        code = (
            f"# a sharded unit's dtypes are fixed when it is wrapped; mpdoctor does not re-shard a model\n"
            f"# before fully_shard / FSDP(...): one dtype per unit (fp32 master weights)\n"
            f"model = model.float()  # or cast the odd layers: {listed}\n"
            f"fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))"
        )
        yield rule.finding(
            f"{u.model}{'.' + u.path if u.path else ''}",
            f"FSDP unit {u.path or '<root>'} of {u.model} holds parameters of {' and '.join(u.dtypes)} ({listed}): "
            f"its first forward will raise 'FSDP expects uniform original parameter dtype' on every rank.",
            {"unit": u.path, "version": u.version, "dtypes": list(u.dtypes), "examples": [list(e) for e in u.examples]},
            [Fix("Cast the model to one dtype before sharding it", code, applicability=Applicability.DISPLAY_ONLY,
                 recipe="fsdp-uniform-dtype")],  # fmt: skip
        )
    if not dist.planned_wraps:
        return
    wrapped = {u.model for u in dist.fsdp_units}
    owners = ", ".join(p.owner for p in dist.planned_wraps)
    for m in facts.models:
        counts = _float_dtypes(m)
        if m.name in wrapped or len(counts) < 2:
            continue
        widest = max(counts, key=lambda d: (torch_dtype(d).itemsize, counts[d]))
        fix = _cast_fix(facts, m, widest, "fsdp-uniform-dtype", "FSDP needs one dtype per unit")
        yield rule.finding(
            m.name,
            f"{owners} will wrap {m.name} with FSDP, but its parameters are {' and '.join(sorted(counts))}: the wrap "
            f"(FSDP1: 'Must flatten tensors with uniform dtype') or the first forward (FSDP2) will fail on every rank.",
            {"dtypes": sorted(counts), "planned_by": [p.owner for p in dist.planned_wraps],
             "elements": counts},  # fmt: skip
            [fix] if fix is not None else [],
        )


@check("fsdp-reduce-in-half", Severity.INFO, fix_safety=(Applicability.DISPLAY_ONLY,))
def fsdp_reduce_in_half(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """FSDP reduces gradients across ranks in a 16-bit format.

    What it does
        FSDP units whose reduce dtype is fp16 or bf16 (FSDP1 ``MixedPrecision.reduce_dtype``;
        FSDP2 ``MixedPrecisionPolicy.reduce_dtype``, which defaults to ``param_dtype``).
    Why is this bad?
        The gradient sum over N ranks is rounded to 8 (bf16) or 11 (fp16) mantissa bits; with
        many ranks small contributions are lost. fp32 reduction doubles the gradient traffic
        of a step. Many recipes accept this trade, so it is reported, not blamed.
    Example
        policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    Use instead
        policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    Severity
        info: a deliberate speed / precision trade, harmless at small world sizes.
    Fix safety
        ``reduce_dtype=torch.float32`` in the policy when accuracy matters more than bandwidth.
    Sources
        torch FSDP docs (``MixedPrecision``, ``MixedPrecisionPolicy``).
    """
    dist = facts.distributed
    if dist is None:
        return
    per_model: dict[str, list] = {}
    for u in dist.fsdp_units:
        reduce = u.reduce_dtype or (u.param_dtype if u.version == "fsdp2" else None)
        if reduce in HALF:
            per_model.setdefault(u.model, []).append((u, reduce))
    for model, units in per_model.items():
        elements = sum(u.params for u, _ in units)
        reduce = units[0][1]
        extra = elements * 2
        code = "# the policy is fixed when the units are wrapped; mpdoctor does not re-shard a model\n" \
               "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # FSDP2\n" \
               "MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # FSDP1"  # fmt: skip
        yield rule.finding(
            model,
            f"{len(units)} FSDP unit(s) of {model} reduce gradients in {reduce} across {dist.world_size} ranks; fp32 "
            f"reduction costs {extra / 2**20:.2f} MiB more traffic per rank and step (2x).",
            {"units": [u.path for u, _ in units], "reduce_dtype": reduce, "world_size": dist.world_size,
             "fp32_extra_bytes": extra},  # fmt: skip
            [Fix("Reduce gradients in fp32", code, applicability=Applicability.DISPLAY_ONLY, recipe="fsdp-fp32-reduce",
                 cost="2x gradient communication")],  # fmt: skip
        )


@check("launch-world-of-one", Severity.ERROR, fix_safety=(Applicability.DISPLAY_ONLY,))
def launch_world_of_one(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """A process launched as one of several holds an Accelerator that trains alone.

    What it does
        The launcher started several processes (``WORLD_SIZE`` > 1 in the environment, or a
        process group of more than one rank), but an Accelerator in this process says one
        process (``num_processes == 1``, ``DistributedType.NO``).
    Why is this bad?
        ``prepare`` then wraps nothing in DDP: each process trains its own copy of the model
        on its own data, no gradient is averaged, N times the work, silently. Reproduced with
        accelerate 1.15: ``notebook_launcher(fn, num_processes=2)`` on a CPU without
        ``Accelerator(cpu=True)`` prints "Launching training on 2 CUDAs.", each child even
        holds a 2-rank process group (backend ``undefined``) yet its Accelerator is
        ``DistributedType.NO``, and after one step the ranks' weights differ.
    Example
        def train():
            accelerator = Accelerator()  # on a CPU: a world of one per process
            ...
        notebook_launcher(train, num_processes=2)
    Use instead
        def train():
            accelerator = Accelerator(cpu=True)
            ...
        notebook_launcher(train, num_processes=2)
    Severity
        error: the run silently is not the distributed training that was launched.
    Fix safety
        Create the Accelerator with ``cpu=True`` inside the launched function on a CPU (display
        only: accelerate's shared state cannot be re-initialised inside a running worker).
    Sources
        accelerate ``launchers.py`` (``notebook_launcher``) and ``state.py``
        (``PartialState.__init__``: no backend means ``DistributedType.NO``); tests/distributed/test_launcher.py.
    """
    dist = facts.distributed
    if dist is None:
        return
    launched = max(dist.env_world_size or 1, dist.world_size)
    accs = [a for a in dist.accelerators if a.num_processes == 1]
    if launched < 2 or not accs:
        return
    who = ", ".join(f"{a.name} ({a.distributed_type}, num_processes={a.num_processes})" for a in accs)
    rank = dist.env_rank if dist.env_rank is not None else dist.rank
    code = (
        "# each worker builds its own Accelerator in a process of its own, which mpdoctor does not reach\n"
        "def train():\n"
        "    accelerator = Accelerator(cpu=True, mixed_precision=\"bf16\")  # inside the launched function\n"
        "    ...\n"
        f"notebook_launcher(train, num_processes={launched})"
    )
    yield rule.finding(
        accs[0].name,
        f"This process was launched as rank {rank} of {launched}, but {who} sees a world of one: prepare() wraps "
        f"nothing in DDP and the {launched} processes train {launched} independent copies.",
        {"env_world_size": dist.env_world_size, "env_rank": dist.env_rank, "world_size": dist.world_size,
         "accelerators": [a.name for a in accs]},  # fmt: skip
        [Fix("Create the Accelerator with cpu=True inside the launched function", code,
             applicability=Applicability.DISPLAY_ONLY, recipe="accelerator-cpu")],  # fmt: skip
    )


@check("launcher-initialized-early", Severity.ERROR, fix_safety=(Applicability.UNSAFE, Applicability.DISPLAY_ONLY))
def launcher_initialized_early(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """An Accelerator or a CUDA device was initialised in the notebook before ``notebook_launcher``.

    What it does
        In a process that imported ``accelerate``'s launchers and is not itself a launched
        worker: accelerate's shared ``AcceleratorState`` is already filled, or CUDA is
        initialised.
    Why is this bad?
        ``notebook_launcher`` refuses to start: "To launch a multi-device training from your
        notebook, the `Accelerator` should only be initialized inside your training function.
        Restart your notebook and make sure no cells initializes an `Accelerator`." (reproduced,
        accelerate 1.15). On a GPU, forked workers cannot re-initialise CUDA ("Cannot re-initialize
        CUDA in forked subprocess"; not reproducible on this CPU); the kernel must be restarted.
    Example
        accelerator = Accelerator()  # in the notebook, before launching
        notebook_launcher(train, num_processes=2)
    Use instead
        def train():
            accelerator = Accelerator()  # created inside the launched function
            ...
        notebook_launcher(train, num_processes=2)
    Severity
        error: the launch will fail.
    Fix safety
        An Accelerator made in the kernel: reset accelerate's shared state in place (what
        ``AcceleratorState._reset_state(True)`` does; undo puts every entry back into the same
        dicts), then ``notebook_launcher`` starts. Unsafe: the Accelerator the kernel holds, and
        what it prepared, lose their state until undone; create the Accelerator inside the launched
        function from then on. CUDA initialised in the kernel: display-only, it cannot be
        un-initialised (restart the kernel).
    Sources
        accelerate ``launchers.py`` (``notebook_launcher``); tests/distributed/test_launcher.py.
    """
    dist = facts.distributed
    if dist is None or not dist.launcher_imported or dist.distributed or dist.env_world_size:
        return
    if dist.accelerator_state_initialized:
        code = (
            "from accelerate.state import AcceleratorState\n"
            "AcceleratorState._reset_state(True)  # or restart the kernel\n"
            "# and create the Accelerator only inside the function given to notebook_launcher"
        )
        yield rule.finding(
            "AcceleratorState",
            "An Accelerator was created in this kernel: notebook_launcher will refuse to start ('the `Accelerator` "
            "should only be initialized inside your training function').",
            {"accelerator_state_initialized": True},
            [Fix("Reset accelerate's state and create the Accelerator inside the function", code,
                 applicability=Applicability.UNSAFE, recipe="launcher-reset-state", changes=(ResetAccelerateState(),),
                 cost="the Accelerator already made in this kernel (and what it prepared) loses its state")],  # fmt: skip
        )
    if dist.cuda_initialized:
        yield rule.finding(
            "torch.cuda",
            "CUDA is initialised in this kernel: notebook_launcher's forked workers will fail with 'Cannot re-initialize "
            "CUDA in forked subprocess'.",
            {"cuda_initialized": True},
            [Fix("Restart the kernel and touch CUDA only inside the launched function", "# a CUDA context cannot be undone inside the process that made it: restart the kernel",
                 applicability=Applicability.DISPLAY_ONLY, recipe="launcher-restart")],  # fmt: skip
        )


#: Fingerprint keys, the severity of a disagreement on them, and why it matters.
_KEYS = {
    "params": ("error", "DDP's start-up broadcast overwrites the other ranks' weights with these bytes and its "
                        "gradient all-reduce then aborts or sums garbage"),
    "fsdp": ("error", "FSDP all-gathers and reduces the units as if every rank held the same layout"),
    "precision": ("error", "the ranks compute in different precisions while their gradients are averaged"),
    "scalers": ("error", "only some ranks scale the loss: the averaged gradients mix scaled and unscaled values"),
    "autocast": ("error", "the ranks compute in different precisions while their gradients are averaged"),
    "env": ("warning", "the precision environment differs, so later objects will differ too"),
    "device": ("warning", "the ranks run on different devices; the slowest sets the pace and dtypes may not match"),
    "versions": ("warning", "different library versions may take different precision paths"),
}


@check("ranks-disagree", Severity.ERROR, Severity.WARNING, fix_safety=(Applicability.UNSAFE,))
def ranks_disagree(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """The ranks of one job disagree on dtypes, precision, scaler, autocast, environment or versions.

    What it does
        After ``diagnose(..., distributed=True)``: ranks whose fingerprint differs from the
        majority's, per topic (parameter dtypes, FSDP units, precision setups, scalers,
        autocast, precision environment, device, versions), naming the odd ranks.
    Why is this bad?
        Under DDP, ranks holding different dtypes do not fail at construction: the start-up
        broadcast silently overwrites one rank's weights with the other's bytes, the first
        gradient all-reduce aborts gloo ("Received data size doesn't match expected size"),
        and fp16 against bf16 (same width) averages to garbage without any error.
    Example
        if rank == 0:
            model.to(torch.bfloat16)
        model = DDP(model)
    Use instead
        model.to(torch.bfloat16)  # the same code on every rank
        model = DDP(model)
    Severity
        error for dtypes, precision, scaler and autocast (the run is ruined); warning for the
        environment, device and versions.
    Fix safety
        On the odd ranks, cast the parameters to the majority's dtype (offered in place on
        those ranks); with no majority (one fp16 rank, one bf16 rank), to the dtype with the
        widest range among the ranks (fp32, then bf16, then fp16), which every rank can take
        without overflow and AdamW's eps survives. Make every rank build its objects from the
        same code and arguments.
    Sources
        torch ``nn/parallel/distributed.py`` (``_sync_module_states``); reproduced on 2 gloo
        processes (tests/distributed).
    """
    dist = facts.distributed
    if dist is None or not dist.exchanged or len({r.digest for r in dist.ranks}) < 2:
        return
    ref = dist.reference
    ref_fp = next((r.fingerprint for r in dist.ranks if r.digest == ref and r.fingerprint is not None), None)
    if ref_fp is None:
        return
    groups = _odd_groups(dist.ranks, ref)
    for key, (severity, why) in _KEYS.items():
        odd, values = _disagreement(groups, ref_fp, key)
        if not odd:
            continue
        fixes = _match_majority_fixes(facts, ref_fp) if key == "params" and dist.rank in odd else []
        names = ", ".join(str(r) for r in odd)
        yield rule.finding(
            f"ranks {names}" if len(odd) > 1 else f"rank {names}",
            f"Rank{'s' if len(odd) > 1 else ''} {names} of {dist.world_size} disagree{'' if len(odd) > 1 else 's'} with "
            f"the others on {key}: {why}.{_tie_note(dist, ref) if key == 'params' else ''}",
            {"ranks": odd, "topic": key, "values": values, "world_size": dist.world_size, "tie": dist.tied},
            fixes,
            severity=severity,
        )


def _tie_note(dist: DistributedFacts, ref: str) -> str:
    """With no majority, which rank's dtypes the plan follows and why; empty otherwise."""
    if not dist.tied:
        return ""
    follow = min(r.rank for r in dist.ranks if r.digest == ref)
    return (f" No majority: the plan casts them to the dtypes of rank {follow}, the widest range among the ranks "
            "(fp32, then bf16, then fp16).")  # fmt: skip


def _odd_groups(ranks: tuple, ref: str) -> dict[str, tuple[list[int], dict | None]]:
    """The ranks that differ from the reference digest, grouped by digest, with one fingerprint per group."""
    groups: dict[str, tuple[list[int], dict | None]] = {}
    for r in ranks:
        if r.digest != ref:
            groups.setdefault(r.digest, ([], r.fingerprint))[0].append(r.rank)
    return groups


def _disagreement(groups: dict[str, tuple[list[int], dict | None]], ref_fp: dict, key: str) -> tuple[list[int], dict]:
    """The ranks whose fingerprint differs from the majority's on ``key``, and the values each group holds."""
    differing = [(ranks, (fp or {}).get(key)) for ranks, fp in groups.values() if (fp or {}).get(key) != ref_fp.get(key)]
    values = {"majority": ref_fp.get(key)}
    values.update({f"rank {ranks[0]}": value for ranks, value in differing})
    return sorted(r for ranks, _value in differing for r in ranks), values


def _match_majority_fixes(facts: Facts, ref_fp: dict) -> list[Fix]:
    """On an odd rank: cast each model whose majority holds one dtype to that dtype."""
    fixes = []
    for m in facts.models:
        want = ref_fp["params"].get(m.name) or {}
        if len(want) == 1:
            fix = _cast_fix(facts, m, next(iter(want)), "match-other-ranks", "as on the other ranks")
            if fix is not None:
                fixes.append(fix)
    return fixes


@check("rank-did-not-answer", Severity.ERROR, Severity.WARNING)
def rank_did_not_answer(facts: Facts, rule: Rule) -> Iterator[Finding]:
    """Ranks of the process group did not join the cross-rank diagnosis within its timeout.

    What it does
        ``diagnose(..., distributed=True, timeout=...)`` on some ranks while other ranks
        never called it in time (crashed, hung, or running different code), or an exchange
        that could not run at all.
    Why is this bad?
        A rank that is not where the others are will hang the next collective of the
        training (30 minutes by default, then an abort without a cause).
    Example
        if accelerator.is_main_process:
            mpdoctor.diagnose(model, distributed=True)  # the other ranks never join the exchange
    Use instead
        mpdoctor.diagnose(model, distributed=True)  # on every rank
    Severity
        error: the job is already diverged or dead on those ranks.
    Fix safety
        Look at the named ranks' logs; make sure every rank runs the same code path and
        calls ``diagnose(..., distributed=True)``.
    Sources
        torch.distributed store semantics; mpdoctor's cross-rank exchange.
    """
    dist = facts.distributed
    if dist is None:
        return
    if dist.absent:
        names = ", ".join(str(r) for r in dist.absent)
        yield rule.finding(
            "process group",
            f"Rank{'s' if len(dist.absent) > 1 else ''} {names} of {dist.world_size} did not answer within "
            f"{dist.timeout:g} s: the report compares only the ranks that did.",
            {"ranks": list(dist.absent), "timeout": dist.timeout, "world_size": dist.world_size},
        )
    elif dist.exchange_error:
        yield rule.finding(
            "process group",
            f"The cross-rank exchange could not run ({dist.exchange_error}); this report covers this rank only.",
            {"ranks": [], "detail": dist.exchange_error},
            severity=Severity.WARNING,
        )
