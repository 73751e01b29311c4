"""Diagnosing on every rank of a job: from a script (``diagnose_every_rank``) or a training callback, and the rank-zero test the callbacks share."""

from __future__ import annotations

from typing import Any


def is_rank_zero() -> bool:
    """True outside a process group and on its rank 0: where a callback renders."""
    try:
        import torch.distributed as dist

        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    except Exception:
        return True


def diagnose_every_rank(*objects: Any, timeout: float = 60.0, **kwargs: Any) -> Any:
    """What a training callback calls on every rank: the cross-rank diagnosis, the same Report on each.

    Render it where :func:`is_rank_zero` is True. Outside a process group it is
    ``diagnose(*objects, **kwargs)``.
    """
    from . import diagnose

    return diagnose(*objects, distributed=True, timeout=timeout, **kwargs)


def group_size() -> int:
    """The size of the initialised default process group, 1 without one."""
    try:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    except Exception:
        return 1


def diagnose_in_callback(*objects: Any, timeout: float = 60.0, **kwargs: Any) -> Any:
    """What a training callback's start-of-training diagnosis calls on every process.

    In a process group of more than one rank, every rank must call it (it is the cross-rank
    :func:`diagnose_every_rank`: the same findings on each rank); otherwise plain ``diagnose``.
    """
    if group_size() > 1:
        return diagnose_every_rank(*objects, timeout=timeout, **kwargs)
    from . import diagnose

    return diagnose(*objects, **kwargs)
