"""Process groups of a DP x CP world (CP innermost).

A world of ``W = dp_size * cp_size`` ranks is cut so that the CP group of DP rank ``d`` is the
consecutive ranks ``[d * cp_size, (d + 1) * cp_size)``; a CP group then stays inside one node
whenever ``cp_size`` divides the devices per node. ``cp_rank = rank % cp_size`` and
``dp_rank = rank // cp_size``.

The groups are made with plain :func:`torch.distributed.new_group` (every rank creates every
group, in the same order, as ``new_group`` requires). A ``DeviceMesh`` would give the same groups
but ties the layout to a device type; nothing here needs one.

Groups are made once per default process group (:func:`once_per_world`): every ``trainer.fit``,
``validate`` and ``test`` sets the strategy up anew, and under NCCL every new group a rank joins
is a communicator holding device memory until the process ends. A script that fits and then
tests, or a sweep of Trainers in one job, reuses the groups of the first instead. A new default
group (after :func:`torch.distributed.destroy_process_group` and a new
:func:`~torch.distributed.init_process_group`) gets new ones.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed import ProcessGroup

T = TypeVar("T")

_PER_WORLD: dict[Hashable, tuple[Any, Any]] = {}
"""``key -> (default process group, what was built for it)`` (:func:`once_per_world`)."""


def once_per_world(key: Hashable, build: Callable[[], T]) -> T:
    """``build()``, run once per default process group and ``key``, then reused.

    ``build`` makes process groups (a collective: every rank calls this with the same keys in
    the same order, as every rank sets the same strategy up). The result is reused while the
    default group is the one it was built under; after the default group is destroyed and a
    new one initialised, ``build`` runs again.

    Args:
        key: what was built (the kind and its sizes), e.g. ``("layout", cp_size)``.
        build: makes it; called on a miss only.
    """
    world = dist.group.WORLD
    hit = _PER_WORLD.get(key)
    if hit is not None and hit[0] is world:
        return hit[1]  # type: ignore[no-any-return]
    value = build()
    _PER_WORLD[key] = (world, value)
    return value


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """This process's place in the DP x CP world and the groups it talks over.

    Attributes:
        rank: global rank.
        world_size: ranks in the world (``dp_size * cp_size``).
        dp_size: number of DP ranks (CP groups).
        cp_size: ranks in one CP group.
        dp_rank: this process's DP rank (``rank // cp_size``).
        cp_rank: this process's rank inside its CP group (``rank % cp_size``).
        cp_group: the CP group of this process (the consecutive ranks of its DP rank).
        dp_group: the ranks with the same ``cp_rank`` in every CP group.
        world_group: the whole world, over which gradients are averaged.
    """

    rank: int
    world_size: int
    dp_size: int
    cp_size: int
    dp_rank: int
    cp_rank: int
    cp_group: ProcessGroup | None = field(default=None, compare=False)
    dp_group: ProcessGroup | None = field(default=None, compare=False)
    world_group: ProcessGroup | None = field(default=None, compare=False)

    @property
    def cp_ranks(self) -> tuple[int, ...]:
        """Global ranks of this process's CP group, in CP-rank order."""
        first = self.dp_rank * self.cp_size
        return tuple(range(first, first + self.cp_size))


def rank_coordinates(rank: int, world_size: int, cp_size: int) -> tuple[int, int]:
    """``(dp_rank, cp_rank)`` of ``rank`` in a world of ``world_size`` ranks, CP innermost.

    Raises:
        ValueError: ``cp_size < 1``, ``world_size`` not a multiple of ``cp_size``, or ``rank``
            outside the world.
    """
    check_world(world_size, cp_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size} ranks.")
    return rank // cp_size, rank % cp_size


def check_world(world_size: int, cp_size: int) -> None:
    """Check that a world of ``world_size`` ranks splits into CP groups of ``cp_size``.

    Raises:
        ValueError: ``cp_size < 1``, ``cp_size > world_size`` or ``world_size % cp_size != 0``,
            with the sizes that would work.
    """
    if not isinstance(cp_size, int) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(f"cp_size must be an integer >= 1, got {cp_size!r}.")
    if cp_size > world_size:
        raise ValueError(
            f"the world has {world_size} rank(s), which is not a multiple of cp_size {cp_size}: "
            f"cp_size is larger than the world, and one CP group needs cp_size processes. Start "
            f"at least {cp_size} processes (Trainer devices * num_nodes) or pick cp_size from "
            f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}."
        )
    if world_size % cp_size != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"the world has {world_size} ranks, which is not a multiple of cp_size {cp_size}; "
            f"world_size = dp_size * cp_size, so pick cp_size from {divisors} or change the "
            "number of processes."
        )


def build_process_groups(cp_size: int) -> ParallelLayout:
    """Create the CP and DP groups of the current world and return this process's layout.

    Call it on every rank, after :func:`torch.distributed.init_process_group`, with the same
    ``cp_size``: group creation is collective. The groups are made once per default process
    group and ``cp_size`` and reused by later calls (:func:`once_per_world`).

    Args:
        cp_size: ranks per CP group; must divide the world size.

    Returns:
        This process's :class:`ParallelLayout`.

    Raises:
        RuntimeError: the default process group is not initialised.
        ValueError: ``cp_size`` does not divide the world size.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "build_process_groups needs an initialised default process group; call "
            "torch.distributed.init_process_group(...) first."
        )
    check_world(dist.get_world_size(), cp_size)
    return once_per_world(("layout", cp_size), lambda: _new_layout(cp_size))


def as_member(group: object) -> ProcessGroup:
    """A group ``dist.new_group`` returned to a rank inside it. torch 2.14 types the result
    ``ProcessGroup | Literal[-100]`` (-100: what ranks outside the group get); callers keep only
    the groups of their own rank.

    Raises:
        RuntimeError: ``group`` is not a ``ProcessGroup``.
    """
    if not isinstance(group, ProcessGroup):
        raise RuntimeError(f"dist.new_group gave {group!r} to a rank inside the group")
    return group


def _new_layout(cp_size: int) -> ParallelLayout:
    """New CP and DP groups of the current world (:func:`build_process_groups`)."""
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    dp_rank, cp_rank = rank_coordinates(rank, world_size, cp_size)
    dp_size = world_size // cp_size

    cp_group: ProcessGroup | None = None
    for d in range(dp_size):
        ranks = list(range(d * cp_size, (d + 1) * cp_size))
        group = dist.new_group(ranks)
        if d == dp_rank:
            cp_group = as_member(group)
    dp_group: ProcessGroup | None = None
    for c in range(cp_size):
        ranks = list(range(c, world_size, cp_size))
        group = dist.new_group(ranks)
        if c == cp_rank:
            dp_group = as_member(group)
    return ParallelLayout(
        rank=rank,
        world_size=world_size,
        dp_size=dp_size,
        cp_size=cp_size,
        dp_rank=dp_rank,
        cp_rank=cp_rank,
        cp_group=cp_group,
        dp_group=dp_group,
        world_group=dist.group.WORLD,
    )
