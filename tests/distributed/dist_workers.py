"""Functions run on each rank of the real gloo jobs in this folder (importable by spawned children)."""

from __future__ import annotations

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


def odd_rank_dtype(rank: int, world: int) -> dict:
    """The last rank holds bf16 weights: caught before DDP, fixed in place on that rank, then DDP trains."""
    import mpdoctor

    model = tiny()
    if rank == world - 1:
        model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())
    before = mpdoctor.diagnose(model, opt, distributed=True, timeout=30, names={id(model): "model", id(opt): "opt"})
    out = {"before": _summary(before), "frame_has_ranks": "ranks" in before.to_frame().columns}
    applied = before.apply_safe_fixes()
    out["applied"] = [fx.title for fx in applied]
    after = mpdoctor.diagnose(model, opt, distributed=True, timeout=30, names={id(model): "model", id(opt): "opt"})
    out["after"] = _summary(after)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    before = snapshot(model.parameters())
    loss = ddp(torch.randn(4, 8)).float().pow(2).mean()
    loss.backward()
    opt.step()
    out["step"] = step_trains(loss, before, model.parameters())
    return out


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
    from mpdoctor.integrations.distributed import default_store

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
    """The real harm: fp16 on rank 0, bf16 on rank 1; DDP's start-up broadcast overwrites rank 1 silently."""
    model = tiny().to(torch.float16 if rank == 0 else torch.bfloat16)
    original = [p.detach().float().clone() for p in model.parameters()]
    torch.nn.parallel.DistributedDataParallel(model)
    drift = max((p.detach().float() - o).abs().max().item() for p, o in zip(model.parameters(), original))
    return {"drift": drift, "dtype": str(next(model.parameters()).dtype)}


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


def fsdp1_units(rank: int, world: int) -> dict:
    """FSDP1: the real wrap error on a mixed model; the facts of a healthy wrap (policy read from _handle)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision

    import mpdoctor

    out = {}
    bad = tiny()
    bad[2].to(torch.bfloat16)
    try:
        FSDP(bad, device_id=torch.device("cpu"), use_orig_params=True)
        out["error"] = None
    except ValueError as exc:
        out["error"] = str(exc)
    fm = FSDP(tiny(), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
              device_id=torch.device("cpu"), use_orig_params=True)  # fmt: skip
    report = mpdoctor.diagnose(fm, names={id(fm): "fm"})
    out["report"] = _summary(report)
    out["units"] = [[u.version, list(u.dtypes), u.param_dtype, u.reduce_dtype] for u in report.facts.distributed.fsdp_units]
    return out


def fsdp1_peft_adapters(rank: int, world: int, base_dtype: str) -> dict:
    """A half-precision base with PEFT's fp32 LoRA adapters, wrapped by FSDP1 as a Trainer with ``fsdp=...`` would.

    Field cases huggingface/peft#484 (fp16 base) and huggingface/trl#1723 (bf16 base): the real ValueError first,
    then the diagnosis of the planned wrap (TrainingArguments ``fsdp="full_shard"``), the in-place cast, a wrap and a
    training step that work.
    """
    import tempfile

    from peft import LoraConfig, get_peft_model
    from setups import tiny_llama
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from transformers import TrainingArguments

    import mpdoctor

    dtype = getattr(torch, base_dtype)

    def build():
        torch.manual_seed(0)
        base = tiny_llama(use_cache=False).to(dtype)
        return get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    out = {}
    try:
        FSDP(build(), device_id=torch.device("cpu"), use_orig_params=True)
        out["error"] = None
    except ValueError as exc:
        out["error"] = str(exc)
    model = build()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True, fsdp="full_shard", ddp_backend="gloo",
                             report_to=[])  # fmt: skip
    names = {id(model): "model", id(args): "args"}
    report = mpdoctor.diagnose(model, args, names=names)
    out["report"] = _summary(report)
    finding = report.findings_for("fsdp-mixed-dtype-unit")[0]
    out["fix"] = [finding.fixes[0].title, finding.fixes[0].safe] if finding.fixes else None
    finding.fixes[0].apply()
    out["after"] = _summary(mpdoctor.diagnose(model, args, names=names))
    fm = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True,
              mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32))  # fmt: skip
    opt = torch.optim.AdamW([p for p in fm.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    loss = fm(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    out["loss_finite"] = bool(torch.isfinite(loss))
    return out
