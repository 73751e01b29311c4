"""Distributed facts: the process group, FSDP units, planned FSDP wraps, launcher state, and the other ranks.

Plain data, like every fact: a check can build them by hand (an 8-rank job, a
rank that holds bf16 where the others hold fp32) and the exchange across ranks
(:mod:`mpdoctor.diagnosis.exchange`) serialises their fingerprint. The library reads
behind them sit in :mod:`mpdoctor.libraries.distributed.integration`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FsdpUnit:
    """One FSDP unit (an FSDP1 ``FullyShardedDataParallel`` or an FSDP2 ``fully_shard``-ed module).

    ``dtypes`` are the original dtypes of the parameters the unit flattens / shards
    (FSDP requires exactly one); ``param_dtype`` / ``reduce_dtype`` are its mixed
    precision policy (None: the original dtype).
    """

    model: str
    path: str
    version: str  # "fsdp1" | "fsdp2"
    dtypes: tuple[str, ...]
    param_dtype: str | None
    reduce_dtype: str | None
    params: int = 0
    #: Parameter names per dtype, the first few, for messages.
    examples: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class PlannedWrap:
    """A Trainer's arguments or an Accelerator configured to wrap models with FSDP (the wrap is to come)."""

    owner: str
    version: str | None  # "fsdp1" | "fsdp2" | None when not stated
    param_dtype: str | None = None
    reduce_dtype: str | None = None


@dataclass(frozen=True)
class AcceleratorProcesses:
    """What an Accelerator says about the processes it runs in."""

    name: str
    distributed_type: str
    num_processes: int
    process_index: int
    backend: str | None


@dataclass(frozen=True)
class RankRow:
    """One rank in the cross-rank table: its fingerprint digest and, where it was sent, its fingerprint."""

    rank: int
    digest: str
    fingerprint: dict | None = None


@dataclass(frozen=True)
class DistributedFacts:
    """The distributed side of one process.

    ``ranks`` and ``absent`` are filled only by ``diagnose(..., distributed=True)``.
    """

    initialized: bool = False
    backend: str | None = None
    rank: int = 0
    world_size: int = 1
    #: ``WORLD_SIZE`` / ``RANK`` from the environment (what a launcher promised), None when unset.
    env_world_size: int | None = None
    env_rank: int | None = None
    accelerators: tuple[AcceleratorProcesses, ...] = ()
    fsdp_units: tuple[FsdpUnit, ...] = ()
    planned_wraps: tuple[PlannedWrap, ...] = ()
    #: Launcher pitfalls read in the parent (notebook) process.
    launcher_imported: bool = False
    accelerator_state_initialized: bool = False
    cuda_initialized: bool = False
    #: Cross-rank exchange results.
    exchanged: bool = False
    ranks: tuple[RankRow, ...] = ()
    absent: tuple[int, ...] = ()
    timeout: float | None = None
    exchange_error: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def distributed(self) -> bool:
        """True when this process is one of several."""
        return self.world_size > 1

    @property
    def reference(self) -> str | None:
        """The digest the ranks are compared with: the majority's; with no majority, the one whose parameter dtypes
        have the widest range (fp32, then bf16, then fp16: a cast every rank can take), then the lowest rank's.
        Every rank computes the same answer from the same exchanged rows. None before an exchange."""
        counts: dict[str, int] = {}
        cost: dict[str, int] = {}
        for r in self.ranks:
            counts[r.digest] = counts.get(r.digest, 0) + 1
            cost.setdefault(r.digest, _tie_cost(r.fingerprint))
        if not counts:
            return None
        return max(counts, key=lambda d: (counts[d], -cost[d], -min(r.rank for r in self.ranks if r.digest == d)))

    @property
    def tied(self) -> bool:
        """No majority: another digest holds as many ranks as the reference (the tie-break chose it)."""
        counts: dict[str, int] = {}
        for r in self.ranks:
            counts[r.digest] = counts.get(r.digest, 0) + 1
        ref = self.reference
        return ref is not None and sum(1 for n in counts.values() if n == counts[ref]) > 1


#: Parameter dtypes by how safely every rank can be cast to them: fp32 widens exactly; bf16 keeps fp32's range,
#: so fp16 -> bf16 overflows nowhere and AdamW's eps stays representable; fp16 last.
_TIE_ORDER = {"float32": 0, "bfloat16": 1, "float16": 2}


def _tie_cost(fingerprint: dict | None) -> int:
    """How far a rank's parameter dtypes are from the widest range (its worst model's)."""
    params = (fingerprint or {}).get("params") or {}
    return max((_TIE_ORDER.get(d, len(_TIE_ORDER)) for dtypes in params.values() for d in dtypes), default=0)
