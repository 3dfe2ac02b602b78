"""GlobalBatchSampler: exact coverage per epoch, rank independence, and exact mid-epoch resume.

All comparisons are exact (lists of ints).
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_skrull.data import GlobalBatchSampler, load_sft_data


def _epoch(sampler: GlobalBatchSampler) -> list[list[int]]:
    return list(sampler)


def test_unshuffled_batches_follow_dataset_order() -> None:
    sampler = GlobalBatchSampler(10, 4, shuffle=False)
    assert _epoch(sampler) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert len(sampler) == 3
    dropped = GlobalBatchSampler(10, 4, shuffle=False, drop_last=True)
    assert _epoch(dropped) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(dropped) == 2
    dropped.set_epoch(3)
    assert _epoch(dropped) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # epochs do not matter unshuffled


@settings(max_examples=60, deadline=None)
@given(
    num_samples=st.integers(1, 200),
    batch=st.integers(1, 64),
    shuffle=st.booleans(),
    epoch=st.integers(0, 5),
)
def test_every_index_exactly_once_per_epoch(
    num_samples: int, batch: int, shuffle: bool, epoch: int
) -> None:
    sampler = GlobalBatchSampler(num_samples, batch, shuffle=shuffle, seed=7)
    sampler.set_epoch(epoch)
    batches = _epoch(sampler)
    assert len(batches) == len(sampler) == -(-num_samples // batch)
    assert sorted(i for b in batches for i in b) == list(range(num_samples))
    assert all(len(b) == batch for b in batches[:-1])
    assert len(batches[-1]) == num_samples - batch * (len(batches) - 1)  # the partial batch
    if num_samples >= batch:
        dropped = GlobalBatchSampler(num_samples, batch, shuffle=shuffle, seed=7, drop_last=True)
        dropped.set_epoch(epoch)
        kept = _epoch(dropped)
        assert len(kept) == len(dropped) == num_samples // batch
        # drop_last removes exactly the partial batch and nothing else.
        assert kept == [b for b in batches if len(b) == batch]


def test_same_batches_on_every_rank_whatever_the_global_random_state() -> None:
    # Simulated ranks: each perturbs the global RNGs differently before building its sampler.
    per_rank = []
    for rank in range(4):
        random.seed(rank)
        np.random.seed(rank)
        torch.manual_seed(rank)
        sampler = GlobalBatchSampler(50, 8, seed=3)
        epochs = [_epoch(sampler)]
        sampler.set_epoch(2)
        epochs.append(_epoch(sampler))
        per_rank.append(epochs)
    assert all(r == per_rank[0] for r in per_rank)


def test_shuffle_depends_on_seed_and_epoch_only() -> None:
    a, b = GlobalBatchSampler(100, 10, seed=1), GlobalBatchSampler(100, 10, seed=1)
    first = _epoch(a)
    assert first == _epoch(a) == _epoch(b)  # repeated iteration of one epoch is stable
    order = [i for batch in first for i in batch]
    assert order != sorted(order)  # shuffled (fails with probability 1/100!)
    a.set_epoch(1)
    assert _epoch(a) != first
    assert _epoch(GlobalBatchSampler(100, 10, seed=2)) != first
    assert a.epoch_order(0) == order


@settings(max_examples=60, deadline=None)
@given(
    num_samples=st.integers(1, 120),
    batch=st.integers(1, 40),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    epoch=st.integers(0, 3),
    stop_fraction=st.floats(0, 1),
)
def test_resume_mid_epoch_equals_uninterrupted(
    num_samples: int,
    batch: int,
    shuffle: bool,
    drop_last: bool,
    epoch: int,
    stop_fraction: float,
) -> None:
    if drop_last and batch > num_samples:
        return
    kwargs = {"shuffle": shuffle, "seed": 11, "drop_last": drop_last}
    reference = GlobalBatchSampler(num_samples, batch, **kwargs)
    reference.set_epoch(epoch)
    uninterrupted = _epoch(reference)

    run = GlobalBatchSampler(num_samples, batch, **kwargs)
    run.set_epoch(epoch)
    stop = int(stop_fraction * len(run))
    iterator = iter(run)
    trained = [next(iterator) for _ in range(stop)]
    state = json.loads(json.dumps(run.state_dict()))  # plain data, survives a checkpoint

    resumed = GlobalBatchSampler(num_samples, batch, shuffle=shuffle, seed=999, drop_last=drop_last)
    resumed.load_state_dict(state)
    resumed.set_epoch(epoch)  # what Lightning does at the start of the resumed epoch
    assert trained + _epoch(resumed) == uninterrupted
    # The restored position applies once: the next pass of that epoch is whole again.
    assert _epoch(resumed) == uninterrupted
    resumed.set_epoch(epoch + 1)
    reference.set_epoch(epoch + 1)
    assert _epoch(resumed) == _epoch(reference)


def test_consumer_that_prefetches_saves_its_own_count() -> None:
    sampler = GlobalBatchSampler(20, 3, seed=5)
    full = _epoch(sampler)
    iterator = iter(sampler)
    for _ in range(4):  # fetched 4, trained 3 (one prefetched)
        next(iterator)
    assert sampler.batches_yielded == 4
    state = sampler.state_dict(batches_consumed=3)
    resumed = GlobalBatchSampler(20, 3, seed=5)
    resumed.load_state_dict(state)
    assert full[:3] + _epoch(resumed) == full
    with pytest.raises(ValueError, match="batches_consumed = 8 exceeds the 7 batches"):
        sampler.state_dict(batches_consumed=8)


def test_state_after_a_whole_epoch_resumes_into_the_next() -> None:
    sampler = GlobalBatchSampler(10, 4, seed=1)
    _epoch(sampler)
    state = sampler.state_dict()
    assert (state["epoch"], state["batches_consumed"]) == (0, 3)
    resumed = GlobalBatchSampler(10, 4, seed=1)
    resumed.load_state_dict(state)
    assert _epoch(resumed) == []  # nothing left of epoch 0
    resumed.set_epoch(1)
    sampler.set_epoch(1)
    assert _epoch(resumed) == _epoch(sampler)


def test_load_state_dict_refuses_a_different_run() -> None:
    state = GlobalBatchSampler(10, 4).state_dict()
    with pytest.raises(ValueError, match="saved run had num_samples = 10, this one has 11"):
        GlobalBatchSampler(11, 4).load_state_dict(state)
    with pytest.raises(ValueError, match="saved run had global_batch_size = 4, this one has 5"):
        GlobalBatchSampler(10, 5).load_state_dict(state)
    with pytest.raises(ValueError, match="saved run had shuffle = True"):
        GlobalBatchSampler(10, 4, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match=r"state lacks \['epoch'\]"):
        GlobalBatchSampler(10, 4).load_state_dict({k: v for k, v in state.items() if k != "epoch"})
    with pytest.raises(ValueError, match="batches_consumed = 9 exceeds the 3 batches"):
        GlobalBatchSampler(10, 4).load_state_dict({**state, "batches_consumed": 9})


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        ((0, 4), {}, ValueError, "num_samples must be >= 1, got 0"),
        ((10, 0), {}, ValueError, "global_batch_size must be >= 1, got 0"),
        ((10, 2.0), {}, TypeError, r"global_batch_size must be an int, got 2\.0"),
        ((10, True), {}, TypeError, "global_batch_size must be an int, got True"),
        ((10, 4), {"seed": -1}, ValueError, "seed must be >= 0"),
        ((3, 4), {"drop_last": True}, ValueError, "drop_last=True with global_batch_size = 4 > 3"),
    ],
)
def test_bad_arguments(args: tuple, kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        GlobalBatchSampler(*args, **kwargs)


def test_set_epoch_rejects_negative() -> None:
    with pytest.raises(ValueError, match="epoch must be >= 0, got -1"):
        GlobalBatchSampler(10, 4).set_epoch(-1)


def test_drives_a_dataloader_over_an_sft_dataset() -> None:
    dataset = load_sft_data([{"input_ids": [i, i + 1]} for i in range(7)])
    sampler = GlobalBatchSampler(len(dataset), 3, shuffle=False)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=list)
    batches = [[s["input_ids"][0] for s in batch] for batch in loader]
    assert batches == [[0, 1, 2], [3, 4, 5], [6]]
