"""The exchange across ranks behind ``diagnose(..., distributed=True)``.

Every rank of the default process group calls it; it rides on the group's own
key-value store (no transport of its own, no collective that could hang):

1. each rank computes a compact fingerprint of its facts (parameter dtype tallies
   per model, FSDP units' dtypes and policy, precision setups, scalers, autocast,
   the precision environment, device capability, library versions) and its
   16-hex-digit digest;
2. ``compare_set`` on one key makes the first rank's ``rank:digest`` the reference
   (that rank publishes its fingerprint); a rank whose digest differs publishes
   its fingerprint too. Each rank sets its digest key (how an absent rank is named)
   and adds to the arrival counter: 1 when it agrees, ``1 + _ODD`` when it does
   not, so one counter carries both arrivals and disagreements;
3. each rank waits (polling, bounded by ``timeout``) until all ranks arrived. When
   nobody disagreed the exchange is over: per rank one ``compare_set``, one ``set``,
   one ``add`` and its polls (the reference rank one ``set`` more), whatever the
   model size or the world size. Only on disagreement do ranks read every digest
   and the fingerprints of one rank per distinct digest.

A rank that does not arrive within ``timeout`` is named in ``DistributedFacts.absent``
and the check ``rank-did-not-answer`` reports it; the call returns either way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from typing import Any

from ..facts import Facts
from ..libraries.distributed.facts import DistributedFacts, RankRow

#: Environment variables that legitimately differ between ranks.
PER_RANK_ENV = frozenset({"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "CUDA_VISIBLE_DEVICES", "LOCAL_WORLD_SIZE"})
_POLL = 0.02
_ODD = 1 << 20  # a disagreeing rank adds 1 + _ODD to the arrival counter: arrivals below, disagreements above
_rounds = 0


def fingerprint(facts: Facts) -> dict:
    """The compact, JSON-able summary of one rank's precision state (independent of model size)."""
    models = {m.name: dict(sorted(m.tensors.param_dtype_counts().items())) for m in facts.models}
    dist = facts.distributed
    fsdp: dict[str, dict[str, int]] = {}
    for u in dist.fsdp_units if dist is not None else ():
        key = f"{u.version}:{'/'.join(u.dtypes)}:param={u.param_dtype}:reduce={u.reduce_dtype}"
        fsdp.setdefault(u.model, {})[key] = fsdp.setdefault(u.model, {}).get(key, 0) + 1
    precision = {p.name: {"declared": p.declared, "computes_in": p.computes_in, "native_amp": p.native_amp,
                          "scaler": p.scaler_enabled} for p in facts.precisions}  # fmt: skip
    hw = facts.hardware
    versions = {k: str(v).split(" ")[0] for k, v in facts.runtime.versions.items() if k in ("torch", "transformers", "accelerate", "peft", "python")}
    return {
        "params": models,
        "fsdp": fsdp,
        "precision": precision,
        "scalers": {s.name: bool(s.enabled) for s in facts.scalers},
        "autocast": dict(facts.runtime.autocast),
        "env": {k: v for k, v in facts.runtime.env.items() if k not in PER_RANK_ENV},
        "device": {"name": hw.name, "capability": list(hw.capability) if hw.capability else None, "bf16": hw.bf16_native},
        "versions": versions,
    }


def digest(fp: dict) -> str:
    """A short, stable hash of a fingerprint."""
    return hashlib.sha256(json.dumps(fp, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Counters:
    """What one exchange cost this rank (store operations and bytes sent and received)."""

    def __init__(self) -> None:
        self.ops = 0
        self.bytes = 0
        self.polls = 0  # of ``ops``: reads of the arrival counter while waiting

    def count(self, payload: bytes | str | None = None) -> None:
        self.ops += 1
        self.bytes += len(payload) if payload is not None else 8


def _wait_count(store: Any, key: str, want: int, deadline: float, c: Counters) -> int:
    while True:
        have = int(store.add(key, 0))
        c.count()
        c.polls += 1
        if have % _ODD >= want or time.monotonic() >= deadline:
            return have
        time.sleep(_POLL)


def exchange(facts: Facts, timeout: float = 60.0, store: Any = None, counters: Counters | None = None) -> Facts:
    """Exchange fingerprints with every rank of the default process group; return facts with the rank table.

    Never raises and never waits longer than about ``timeout`` seconds.
    """
    global _rounds
    dist = facts.distributed or DistributedFacts()
    if not dist.initialized or dist.world_size < 2:
        return facts
    c = counters if counters is not None else Counters()
    try:
        store = store if store is not None else _default_store()
        _rounds += 1
        prefix = f"mpdoctor/{_rounds}/"
        me, world = dist.rank, dist.world_size
        fp = fingerprint(facts)
        mine = digest(fp)
        ref_rank, first = _announce(store, prefix, me, fp, mine, c)
        counter = _wait_count(store, prefix + "arrived", world, time.monotonic() + timeout, c)
        arrived, disagree = counter % _ODD, counter // _ODD > 0
        absent = _absent(store, prefix, world, c) if arrived < world else ()
        if disagree or absent:
            rows = _compared_rows(store, prefix, world, absent, (me, fp), (ref_rank, first), c)
        else:
            rows = [RankRow(r, mine, fp if r == me else None) for r in range(world)]
        new = dataclasses.replace(dist, exchanged=True, ranks=tuple(rows), absent=absent, timeout=timeout,
                                  extra={**dist.extra, "exchange_ops": c.ops, "exchange_bytes": c.bytes,
                                         "exchange_polls": c.polls})  # fmt: skip
    except Exception as exc:  # the exchange must never be what breaks a run
        new = dataclasses.replace(dist, exchanged=False, timeout=timeout, exchange_error=f"{type(exc).__name__}: {exc}"[:300])
    return dataclasses.replace(facts, distributed=new)


def _default_store() -> Any:
    """The default process group's store."""
    from ..libraries.distributed.integration import default_store

    store = default_store()
    if store is None:
        raise RuntimeError("the default process group has no store")
    return store


def _announce(store: Any, prefix: str, me: int, fp: dict, mine: str, c: Counters) -> tuple[int, str]:
    """Claim the reference (the first rank to arrive), post this rank's digest (and its fingerprint when it is
    the reference or disagrees with it) and count this rank in; return the reference's rank and digest."""
    claim = f"{me}:{mine}"
    got = store.compare_set(prefix + "first", "", claim)
    c.count(claim)
    got = got.decode() if isinstance(got, bytes) else str(got)
    ref_rank_text, _, first = got.partition(":")
    ref_rank = int(ref_rank_text)
    odd = first != mine
    if odd or ref_rank == me:
        payload = json.dumps(fp, sort_keys=True, default=str)
        store.set(prefix + f"fp/{me}", payload)
        c.count(payload)
    store.set(prefix + f"d/{me}", mine)
    c.count(mine)
    store.add(prefix + "arrived", 1 + _ODD if odd else 1)
    c.count()
    return ref_rank, first


def _absent(store: Any, prefix: str, world: int, c: Counters) -> tuple[int, ...]:
    """The ranks that posted no digest before the deadline."""
    c.ops += world
    return tuple(r for r in range(world) if not store.check([prefix + f"d/{r}"]))


def _compared_rows(store: Any, prefix: str, world: int, absent: tuple[int, ...], own: tuple[int, dict],
                   reference: tuple[int, str], c: Counters) -> list[RankRow]:  # fmt: skip
    """Every present rank's row with its digest, and the fingerprint of each distinct digest read once.

    ``own`` is this rank and its fingerprint, ``reference`` the reference rank and its digest (whose
    fingerprint the reference posted; any other digest's is posted by the rank that holds it).
    """
    me, fp = own
    ref_rank, first = reference
    present = [r for r in range(world) if r not in absent]
    values = store.multi_get([prefix + f"d/{r}" for r in present]) if present else []
    c.ops += 1
    digests = {r: (v.decode() if isinstance(v, bytes) else str(v)) for r, v in zip(present, values)}
    c.bytes += sum(len(v) for v in digests.values())
    shown: dict[str, dict | None] = {}
    rows: list[RankRow] = []
    for r in present:
        d = digests[r]
        if d not in shown:
            shown[d] = _read_fp(store, prefix, ref_rank if d == first else r, c)
        rows.append(RankRow(r, d, shown[d] if shown[d] is not None else (fp if r == me else None)))
    return rows


def _read_fp(store: Any, prefix: str, rank: int, c: Counters) -> dict | None:
    key = prefix + f"fp/{rank}"
    c.count()
    if not store.check([key]):
        return None
    raw = store.get(key)
    c.bytes += len(raw)
    try:
        return json.loads(raw)
    except Exception:
        return None


def reattach(facts: Facts, previous: DistributedFacts) -> Facts:
    """Local facts with the rank table of an earlier exchange, this rank's row recomputed (what ``refresh`` does).

    ``Report.refresh()`` and fix re-planning run on one rank only; calling the collective again would wait
    for ranks that are not calling it. The other ranks' rows are as they were exchanged.
    """
    dist = facts.distributed or DistributedFacts()
    if not previous.exchanged:
        return facts
    fp = fingerprint(facts)
    mine = digest(fp)
    rows = tuple(RankRow(r.rank, mine, fp) if r.rank == previous.rank else r for r in previous.ranks)
    new = dataclasses.replace(dist, exchanged=True, ranks=rows, absent=previous.absent, timeout=previous.timeout,
                              exchange_error=previous.exchange_error, extra=previous.extra)  # fmt: skip
    return dataclasses.replace(facts, distributed=new)
