"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True, scope="session")
def data_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Data caches built by the tests go to a temporary directory, not the user's cache."""
    saved = os.environ.get("LIGHTNING_SKRULL_CACHE")
    os.environ["LIGHTNING_SKRULL_CACHE"] = str(tmp_path_factory.mktemp("data_cache"))
    yield
    if saved is None:
        os.environ.pop("LIGHTNING_SKRULL_CACHE", None)
    else:
        os.environ["LIGHTNING_SKRULL_CACHE"] = saved


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
