"""The spawn helper itself: results in rank order, errors surface, hangs end."""

from __future__ import annotations

import os

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


def _environment(rank: int, world_size: int, name: str) -> tuple[str | None, int]:
    return os.environ.get(name), os.getppid()


@pytest.mark.multiprocess
def test_ranks_see_the_callers_environment_and_start_from_the_fork_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # set after the fork server may have started (earlier tests): its children would inherit
    # the server's environment, not the caller's, without the hand-over
    for value in ("first", "second"):
        monkeypatch.setenv("SKRULL_LAUNCH_PROBE", value)
        ranks = spawn(_environment, 2, "SKRULL_LAUNCH_PROBE")
        assert [env for env, _ in ranks] == [value, value]
        # forked by the fork server (which imported the heavy modules once), not by this process
        assert all(parent != os.getpid() for _, parent in ranks)
    ranks = spawn(_environment, 2, "SKRULL_LAUNCH_PROBE", start_method="spawn")
    assert ranks == [("second", os.getpid())] * 2


def test_other_start_methods_are_refused() -> None:
    with pytest.raises(
        ValueError, match="start_method must be 'forkserver' or 'spawn', got 'fork'"
    ):
        spawn(_sum_ranks, 2, start_method="fork")
