"""Gathering the distributed facts of a job: processes, FSDP units and planned wraps, asked of the integrations."""

from __future__ import annotations

from .facts import DistributedFacts, FsdpUnit


def gather_distributed(subjects: tuple, models: list) -> DistributedFacts:
    """The distributed facts of this process: its process group, the FSDP units of ``models``, planned wraps."""
    from . import integration as reader

    group = reader.process_group()
    units: list[FsdpUnit] = []
    for s in subjects:
        if s.kind == "model":
            units.extend(reader.fsdp_units(s.name, s.obj))
    accs, planned = [], []
    for s in subjects:
        if s.kind == "accelerator":
            procs = reader.accelerator_processes(s.name, s.obj)
            if procs is not None:
                accs.append(procs)
        if s.kind in ("accelerator", "training_args"):
            plan = reader.planned_wrap(s.name, s.obj)
            if plan is not None:
                planned.append(plan)
    return DistributedFacts(
        initialized=bool(group.get("initialized", False)),
        backend=group.get("backend"),
        rank=int(group.get("rank", 0)),
        world_size=int(group.get("world_size", 1)),
        env_world_size=group.get("env_world_size"),
        env_rank=group.get("env_rank"),
        accelerators=tuple(accs),
        fsdp_units=tuple(units),
        planned_wraps=tuple(planned),
        **reader.launcher_state(),
    )
