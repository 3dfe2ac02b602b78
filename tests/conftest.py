"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from lightning_skrull.runtime import launch

# What the tests' ranks import beyond the package's own preload (pytest and the test helpers'
# imports, DeepSpeed and the compiler modules its engine imports, transformers' lazily imported
# model and generation code): imported once in the fork server that starts every multi-process
# test's ranks, not in each rank of each spawn (about 3 s per process on an idle machine).
# Imports only, as the package's own preload: nothing runs a torch operation before the fork. A
# module that is not installed is skipped by the fork server.
launch.PRELOADED = (
    *launch.PRELOADED,
    "pytest",
    "numpy",
    "accelerate",
    "safetensors.torch",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.generation.utils",
    "transformers.integrations.deepspeed",
    "transformers.integrations.hub_kernels",
    "transformers.masking_utils",
    "torch._functorch.partitioners",
    "torch._inductor.compile_fx",
    "deepspeed",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "lightning.pytorch.strategies.deepspeed",
)


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
    """A Trainer run in this process makes a one-rank process group; remove it afterwards.

    DeepSpeed keeps a clone of the world group for the life of the process
    (``deepspeed.utils.groups._WORLD_GROUP``), which a destroyed world leaves unusable: the
    next test's ZeRO-2 engine would fail with "Group ... is not registered". It is dropped with
    the world, so DeepSpeed clones the next one.
    """
    saved = dict(os.environ)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        groups = sys.modules.get("deepspeed.utils.groups")
        if groups is not None:
            groups._WORLD_GROUP = None
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def clean_world() -> Iterator[None]:
    """Trainer runs in this process leave a process group and environment behind; undo both.

    One intra-op thread while the test runs: the model is tiny, and on a shared machine
    several spinning threads per op make each step many times slower.
    """
    saved, threads = dict(os.environ), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
