"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from lightning_skrull.runtime import launch

# Test modules sit in folders that mirror the package; a few import names from a module in
# another folder (the 16-bit rule of strategies/test_precision_matrix.py, say).
_HERE = os.path.dirname(os.path.abspath(__file__))
for _folder in sorted(os.listdir(_HERE)):
    _path = os.path.join(_HERE, _folder)
    if os.path.isdir(_path) and not _folder.startswith(("_", ".")) and _path not in sys.path:
        sys.path.append(_path)

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
