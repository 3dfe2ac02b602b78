"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A Trainer run in this process makes a one-rank process group; remove it afterwards."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def without_gds_step_6(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn GDS step 6 off (it moves a sequence between DP ranks after the others have run), for
    tests that judge an earlier step on the DP split and micro-batches that step made."""
    from lightning_skrull.scheduling import gds

    monkeypatch.setattr(gds, "rebalance_dp", lambda ranks, *args: [list(r) for r in ranks])
