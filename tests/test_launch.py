"""The spawn helper itself: results in rank order, errors surface, hangs end."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_skrull.runtime.launch import DistributedRunError, spawn


def _sum_ranks(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return float(t.item())


def _fail_on_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()


@pytest.mark.multiprocess
def test_spawn_returns_in_rank_order_and_collectives_work() -> None:
    assert spawn(_sum_ranks, 3) == [3.0, 3.0, 3.0]


@pytest.mark.multiprocess
def test_spawn_reraises_rank_error_without_hanging() -> None:
    with pytest.raises(DistributedRunError, match="boom on rank one"):
        spawn(_fail_on_one, 2, timeout=60)
