"""Functions run on each rank of the real gloo jobs in this folder (importable by spawned children)."""

from __future__ import annotations

import functools
import time

import torch
from steps import snapshot, step_trains


def tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _summary(report) -> dict:
    return {
        "slugs": sorted({f.check for f in report.findings}),
        "severities": {f.check: f.severity for f in report.findings},
        "ranks_of": {f.check: f.evidence.get("ranks") for f in report.findings if "ranks" in f.evidence},
        "table": [{k: r[k] for k in ("rank", "agrees", "answered")} for r in report.ranks],
        "ops": report.facts.distributed.extra.get("exchange_ops"),
        "bytes": report.facts.distributed.extra.get("exchange_bytes"),
        "polls": report.facts.distributed.extra.get("exchange_polls"),
    }


def cure(report, slug: str, via: str) -> list[str]:
    """Apply this rank's planned in-place fixes of ``slug``: ``fix.apply()`` (``via="api"``) or a click on each
    fix's button in the report's widget (``via="widget"``, the confirming second click for an unsafe fix).

    Returns the titles applied; an agreeing rank's plan may hold none (the fix belongs to the odd rank).
    """
    from cure import click_fix

    from mpdoctor.rules.engine.fixes import Applicability

    fixes = [fx for fx in report.fixes if fx.slug == slug and fx.applicability is not Applicability.DISPLAY_ONLY]
    if via == "api":
        for fx in fixes:
            fx.apply()
            assert fx.applied, f"{fx.title}: {fx.error}"
    else:
        rw = report.widget()
        rw.confirm_delay = 0.0  # the second click confirms; it is not the tail of a double-click
        for fx in fixes:
            assert click_fix(rw, fx.key), f"no button for {fx.title}"
        assert "failed" not in rw.status, rw.status
    return [fx.title for fx in fixes]


def ddp_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The user's step: DDP's constructor on the (fixed) model, a forward, backward and optimizer step."""
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    before = snapshot(model.parameters())
    dtype = next(model.parameters()).dtype
    loss = ddp(torch.randn(4, 8, dtype=dtype)).float().pow(2).mean()
    loss.backward()
    opt.step()
    return step_trains(loss, before, model.parameters())


def _ddp_cured(build, via: str, optimizer=torch.optim.AdamW) -> dict:
    """A fresh twin of the setup from ``build()``: diagnosed across the ranks, cured ``via`` the API or the
    widget, then DDP's constructor and a step on it."""
    import mpdoctor

    model = build()
    opt = optimizer(model.parameters())
    names = {id(model): "model", id(opt): "opt"}
    report = mpdoctor.diagnose(model, opt, distributed=True, timeout=30, names=names)
    out = {"before": _summary(report), "frame_has_ranks": "ranks" in report.to_frame().columns,
           "applied": cure(report, "ranks-disagree", via)}  # fmt: skip
    if via == "api":  # the finding gone once is enough: the twin's proof is its step
        out["after"] = _summary(mpdoctor.diagnose(model, opt, distributed=True, timeout=30, names=names))
    out["dtype"] = str(next(model.parameters()).dtype)
    out["step"] = ddp_step(model, opt)
    return out


def odd_rank_dtype(rank: int, world: int, vias: tuple[str, ...] = ("api", "widget")) -> dict:
    """The last rank holds bf16 weights: caught before DDP, fixed in place on that rank (through the API, then on a
    twin through the widget's button), then DDP's constructor and a step train on every rank."""

    def build() -> torch.nn.Module:
        model = tiny()
        return model.to(torch.bfloat16) if rank == world - 1 else model

    return {via: _ddp_cured(build, via) for via in vias}


def identical(rank: int, world: int) -> dict:
    import mpdoctor

    model = tiny()
    report = mpdoctor.diagnose(model, distributed=True, timeout=30, names={id(model): "model"})
    return _summary(report)


def exchange_cost(rank: int, world: int) -> dict:
    """The healthy exchange alone, started together after a barrier: its counters, its seconds, the store's RTT.

    For ``bench/bench_distributed.py``: the facts are gathered first (that cost is the diagnosis's, not the
    exchange's), the round-trip time is 50 ``add`` calls on a key of this rank's own.
    """
    import torch.distributed as dist

    import mpdoctor
    from mpdoctor.diagnosis.exchange import exchange
    from mpdoctor.libraries.distributed.integration import default_store

    model = tiny()
    facts = mpdoctor.diagnose(model, names={id(model): "model"}).facts
    store = default_store()
    start = time.perf_counter()
    for _ in range(50):
        store.add(f"bench/rtt/{rank}", 0)
    rtt = (time.perf_counter() - start) / 50
    dist.barrier()
    start = time.perf_counter()
    done = exchange(facts, timeout=60)
    seconds = time.perf_counter() - start
    # Rank 0 hosts the store: no rank may leave (and take the store down) while another still reads it.
    dist.barrier()
    extra = done.distributed.extra
    if "exchange_ops" not in extra:  # the exchange failed and said why: show that, not a KeyError
        raise RuntimeError(f"rank {rank}: the exchange failed: {done.distributed.exchange_error}")
    return {"ops": extra["exchange_ops"], "bytes": extra["exchange_bytes"], "polls": extra["exchange_polls"],
            "seconds": seconds, "rtt_s": rtt, "agree": all(r.digest == done.distributed.ranks[0].digest
                                                           for r in done.distributed.ranks)}  # fmt: skip


def absent_rank(rank: int, world: int) -> dict:
    """Rank 1 never joins the diagnosis; rank 0 must come back within its timeout."""
    import mpdoctor

    if rank == 1:
        time.sleep(6)
        return {}
    model = tiny()
    start = time.monotonic()
    report = mpdoctor.diagnose(model, distributed=True, timeout=2, names={id(model): "model"})
    return {**_summary(report), "waited": time.monotonic() - start}


def ddp_fp16_vs_bf16(rank: int, world: int) -> dict:
    """The real harm: fp16 on rank 0, bf16 on rank 1; DDP's start-up broadcast overwrites rank 1 silently.
    Then, on twins of the same setup, the cure through the API and through the widget, and DDP trains."""

    def build() -> torch.nn.Module:
        return tiny().to(torch.float16 if rank == 0 else torch.bfloat16)

    model = build()
    original = [p.detach().float().clone() for p in model.parameters()]
    torch.nn.parallel.DistributedDataParallel(model)
    drift = max((p.detach().float() - o).abs().max().item() for p, o in zip(model.parameters(), original))
    out = {"drift": drift, "dtype": str(next(model.parameters()).dtype)}
    # SGD: this row is about the ranks' dtypes alone (AdamW's own fp16 fault: ddp_fp16_vs_bf16_adamw).
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    out.update({via: _ddp_cured(build, via, sgd) for via in ("api", "widget")})
    return out


def ddp_fp16_vs_bf16_adamw(rank: int, world: int) -> dict:
    """fp16 on rank 0, bf16 on rank 1, each with AdamW: no majority. Casting the bf16 rank to fp16 would put
    AdamW's eps=1e-8 on fp16 weights (``adam-eps-underflow``, an error of its own), so the plan follows the wider
    range: rank 0 to bf16. Cured on twins through the API and the widget; DDP's constructor and a step train."""

    def build() -> torch.nn.Module:
        return tiny().to(torch.float16 if rank == 0 else torch.bfloat16)

    return {via: _ddp_cured(build, via, functools.partial(torch.optim.AdamW, lr=1e-3)) for via in ("api", "widget")}


def ddp_fp32_vs_bf16(rank: int, world: int) -> None:
    """The real failure, no diagnosis: bf16 weights on the last rank, fp32 on the others, then DDP and one step.

    Run by ``run_processes``: the bf16 rank aborts inside gloo, which no Python ``except`` can catch.
    """
    model = tiny()
    if rank == world - 1:
        model.to(torch.bfloat16)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    print(f"rank {rank}: DDP constructed", flush=True)
    loss = ddp(torch.randn(4, 8, dtype=next(model.parameters()).dtype)).float().pow(2).mean()
    loss.backward()
    print(f"rank {rank}: backward done", flush=True)


def fsdp2_mixed_unit(rank: int, world: int) -> dict:
    """FSDP2 shards a unit of mixed dtypes; the diagnosis names it before the first forward raises."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import mpdoctor

    mesh = init_device_mesh("cpu", (world,))
    model = tiny()
    model[2].to(torch.bfloat16)
    fully_shard(model, mesh=mesh)
    report = mpdoctor.diagnose(model, distributed=True, timeout=30, names={id(model): "model"})
    out = {"report": _summary(report)}
    try:
        model(torch.randn(4, 8))
        out["error"] = None
    except AssertionError as exc:
        out["error"] = str(exc)
    # The fix: one dtype per unit before sharding; bf16 compute comes from the policy.
    fixed = tiny()
    fully_shard(fixed, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    healthy = mpdoctor.diagnose(fixed, distributed=True, timeout=30, names={id(fixed): "model"})
    out["healthy"] = _summary(healthy)
    opt = torch.optim.AdamW(fixed.parameters())
    loss = fixed(torch.randn(4, 8)).float().pow(2).mean()
    loss.backward()
    opt.step()
    out["loss_finite"] = bool(torch.isfinite(loss))
    half = tiny()
    fully_shard(half, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    out["half_reduce"] = _summary(mpdoctor.diagnose(half, names={id(half): "model"}))
    return out


def fsdp_step(model: torch.nn.Module, batch: dict | None = None) -> dict:
    """The user's plain wrap, ``FSDP(model, device_id=cpu, use_orig_params=True)`` (no policy), then a forward,
    backward and AdamW step on it; what the step did to the trainable parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    fm = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    params = [p for p in fm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    before = snapshot(params)
    loss = fm(**batch).loss if batch is not None else fm(torch.randn(4, 8)).float().pow(2).mean()
    loss.backward()
    opt.step()
    return step_trains(loss, before, params)


def _fsdp_cured(build, diagnose, slug: str, via: str, recheck, batch: dict | None = None) -> dict:
    """A fresh twin from ``build()``: the user's diagnosis, the plan's fixes of ``slug`` applied ``via`` the API or
    the widget, the diagnosis again (``recheck``), then the same plain FSDP wrap that raised, and a step."""
    model = build()
    report = diagnose(model)
    out = {"report": _summary(report), "applied": cure(report, slug, via)}
    if via == "api":  # the finding gone once is enough: the twin's proof is its step
        out["after"] = _summary(recheck(model))
    out["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    out["step"] = fsdp_step(model, batch)
    return out


def fsdp1_units(rank: int, world: int) -> dict:
    """FSDP1: the real wrap error on a mixed model, read by the crash explanation on every rank, cured in place
    (API, and the widget on a twin) so the same plain wrap then trains; the facts of a healthy wrap (policy read
    from _handle)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision

    import mpdoctor
    from mpdoctor.attach.crash.cause import explain

    def build() -> torch.nn.Module:
        model = tiny()
        model[2].to(torch.bfloat16)
        return model

    def explained(model: torch.nn.Module):
        # What the crash hook does with the user's failing cell: the real exception, explained.
        try:
            FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
        except ValueError as exc:
            report = explain(exc, names={id(model): "model"})
            assert report is not None, f"not explained: {exc}"
            return report
        raise AssertionError("the mixed model wrapped")

    out = {}
    bad = build()
    try:
        FSDP(bad, device_id=torch.device("cpu"), use_orig_params=True)
        out["error"] = None
    except ValueError as exc:
        out["error"] = str(exc)
    for via in ("api", "widget"):
        out[via] = _fsdp_cured(build, explained, "mixed-param-dtypes", via,
                               lambda m: mpdoctor.diagnose(m, names={id(m): "model"}))  # fmt: skip
    fm = FSDP(tiny(), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
              device_id=torch.device("cpu"), use_orig_params=True)  # fmt: skip
    report = mpdoctor.diagnose(fm, names={id(fm): "fm"})
    out["report"] = _summary(report)
    out["units"] = [[u.version, list(u.dtypes), u.param_dtype, u.reduce_dtype] for u in report.facts.distributed.fsdp_units]
    return out


def fsdp1_peft_adapters(rank: int, world: int, base_dtype: str) -> dict:
    """A half-precision base with PEFT's fp32 LoRA adapters, wrapped by FSDP1 as a Trainer with ``fsdp=...`` would.

    Field cases huggingface/peft#484 (fp16 base) and huggingface/trl#1723 (bf16 base): the real ValueError first,
    then the diagnosis of the planned wrap (TrainingArguments ``fsdp="full_shard"``), the in-place cast through the
    API and, on a twin, through the widget; after each the user's very wrap (no policy) and a training step.
    """
    import tempfile

    from peft import LoraConfig, get_peft_model
    from setups import tiny_llama
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from transformers import TrainingArguments

    import mpdoctor

    dtype = getattr(torch, base_dtype)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True, fsdp="full_shard", ddp_backend="gloo",
                             report_to=[])  # fmt: skip

    def build():
        torch.manual_seed(0)
        base = tiny_llama(use_cache=False).to(dtype)
        return get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    def planned(model):
        return mpdoctor.diagnose(model, args, names={id(model): "model", id(args): "args"})

    out = {}
    try:
        FSDP(build(), device_id=torch.device("cpu"), use_orig_params=True)
        out["error"] = None
    except ValueError as exc:
        out["error"] = str(exc)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    for via in ("api", "widget"):
        out[via] = _fsdp_cured(build, planned, "fsdp-mixed-dtype-unit", via, planned, {"input_ids": ids, "labels": ids})
    return out
