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
