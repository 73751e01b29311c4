"""Distributed facts: the process group, FSDP units, planned FSDP wraps, launcher state, and the other ranks.

Plain data, like every fact: a check can build them by hand (an 8-rank job, a
rank that holds bf16 where the others hold fp32) and the exchange across ranks
(:mod:`mpdoctor.diagnosis.exchange`) serialises their fingerprint. The library reads
behind them sit in :mod:`mpdoctor.integrations.distributed`.
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
