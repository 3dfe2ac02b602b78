"""Collation of one rank's micro-batches, checked for every rank of a world in one process.

The reference is the global batch itself: reassembling every CP rank's packed tensors with
``unpack`` must give back each sequence's tokens, its positions 0..L-1 and its labels shifted by
one inside the sequence, exactly (integers, no tolerance).
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_samples, supervised_tokens
from lightning.fabric.utilities.apply_func import move_data_to_device

from lightning_skrull.attention import unpack
from lightning_skrull.data.collate import (
    IGNORE_INDEX,
    MODEL_INPUT_KEYS,
    MicroBatch,
    RankBatch,
    collate_rank,
    count_supervised_tokens,
    shift_sequence_labels,
    tokens_per_cp_rank,
)
from lightning_skrull.scheduling import DISTRIBUTED, GlobalBatchPlan, MicroBatchPlan

D = DISTRIBUTED


def _plan(micro_batches, dp_size: int, cp_size: int, bucket_size: int) -> GlobalBatchPlan:
    return GlobalBatchPlan(
        micro_batches=tuple(tuple(MicroBatchPlan(*mb) for mb in rank) for rank in micro_batches),
        dp_size=dp_size,
        cp_size=cp_size,
        bucket_size=bucket_size,
        policy="hand",
    )


# DP=3 x CP=3, bucket 8: distributed sequences of 20, 2 and 4 tokens (some CP ranks hold none of
# the short ones), local sequences of 1 and 2 tokens, CP ranks left empty, unequal micro-batch
# counts per DP rank.
LENGTHS = [20, 1, 2, 5, 4, 3, 2, 8, 1]
PLAN = _plan(
    [
        [((0, 1, 2), (D, 2, D)), ((3, 4, 5), (0, D, 1))],
        [((6,), (1,)), ((7, 8), (0, 1))],
        [],  # DP rank 2 gets no sequence
    ],
    dp_size=3,
    cp_size=3,
    bucket_size=8,
)
SAMPLES = make_samples(LENGTHS, seed=0, prompt={0: 5, 3: 2}, fully_masked=(5,))


def _collate_all(min_micro_batches: int | None = None) -> dict[tuple[int, int], RankBatch]:
    return {
        (d, c): collate_rank(
            SAMPLES,
            PLAN,
            dp_rank=d,
            cp_rank=c,
            world_size=9,
            sample_indices=[100 + i for i in range(len(SAMPLES))],
            min_micro_batches=min_micro_batches,
        )
        for d in range(3)
        for c in range(3)
    }


def _expected_shifted(sample: dict[str, list[int]]) -> list[int]:
    labels = sample.get("labels", sample["input_ids"])
    return [*labels[1:], IGNORE_INDEX]


def test_every_sequence_reassembles_with_labels_shifted_inside_it() -> None:
    batches = _collate_all()
    seen: list[int] = []
    for d in range(3):
        for i in range(len(batches[(d, 0)])):
            mbs = [batches[(d, c)].micro_batches[i] for c in range(3)]
            layouts = [mb.layout for mb in mbs]
            for key in ("input_ids", "shift_labels", "position_ids"):
                whole = unpack(layouts, [mb.inputs[key][0] for mb in mbs])
                for sid, tensor in whole.items():
                    if sid >= len(SAMPLES):  # placeholder of an empty CP rank
                        assert tensor.tolist() == [
                            {"input_ids": 0, "shift_labels": -100, "position_ids": 0}[key]
                        ]
                        continue
                    want = {
                        "input_ids": SAMPLES[sid]["input_ids"],
                        "shift_labels": _expected_shifted(SAMPLES[sid]),
                        "position_ids": list(range(LENGTHS[sid])),
                    }[key]
                    assert tensor.tolist() == want, (sid, key)
            seen += [s for s in whole if s < len(SAMPLES)]
            for mb in mbs:
                assert set(mb.inputs) == set(MODEL_INPUT_KEYS)
                assert mb.inputs["labels"] is mb.inputs["shift_labels"]
                assert mb.sample_indices == tuple(
                    100 + s for s in PLAN.micro_batches[d][i].sequence_ids
                )
    assert sorted(seen) == list(range(len(SAMPLES)))


def test_num_items_is_global_supervised_tokens_over_world_size() -> None:
    total = supervised_tokens(SAMPLES)
    assert total == count_supervised_tokens(SAMPLES) > 0
    for batch in _collate_all().values():
        assert batch.num_supervised_tokens == total
        assert batch.sample_indices == tuple(range(100, 109))
        for mb in batch.micro_batches:
            assert mb.inputs["num_items_in_batch"].dim() == 0
            assert float(mb.inputs["num_items_in_batch"]) == pytest.approx(total / 9, rel=1e-7)
    # the rank shares add up to the global count: no supervised token lost or counted twice
    assert (
        sum(mb.num_supervised_tokens for b in _collate_all().values() for mb in b.micro_batches)
        == total
    )


def test_empty_cp_ranks_get_one_placeholder_token_and_no_more() -> None:
    for (d, c), batch in _collate_all().items():
        for i, mb in enumerate(batch.micro_batches):
            held = tokens_per_cp_rank(PLAN.micro_batches[d][i], LENGTHS, 3)[c]
            assert mb.num_placeholder_tokens == (1 if held == 0 else 0)
            assert mb.num_tokens == max(held, 1)
            assert mb.num_tokens <= PLAN.bucket_size
    # micro-batch 0 of DP rank 1 holds one 2-token sequence on CP rank 1 only
    batches = _collate_all()
    assert [batches[(1, c)].micro_batches[0].num_placeholder_tokens for c in range(3)] == [1, 0, 1]


def test_min_micro_batches_pads_with_empty_micro_batches() -> None:
    batches = _collate_all(min_micro_batches=2)
    for (d, _c), batch in batches.items():
        assert len(batch) == 2
        assert batch.num_planned_micro_batches == (0 if d == 2 else 2)
    for mb in batches[(2, 1)].micro_batches:
        assert mb.sample_indices == ()
        assert mb.inputs["input_ids"].tolist() == [[0]]
        assert mb.inputs["shift_labels"].tolist() == [[IGNORE_INDEX]]


def test_fully_masked_global_batch_divides_by_one_over_world() -> None:
    samples = make_samples([4, 1], seed=1, fully_masked=(0, 1))
    plan = _plan([[((0, 1), (D, 0))]], dp_size=1, cp_size=2, bucket_size=4)
    batch = collate_rank(samples, plan, dp_rank=0, cp_rank=1, world_size=2)
    assert batch.num_supervised_tokens == 0
    assert float(batch.micro_batches[0].inputs["num_items_in_batch"]) == 0.5


def test_samples_without_labels_supervise_every_token_but_the_first() -> None:
    samples = make_samples([5, 3], seed=2, without_labels=(0, 1))
    plan = _plan([[((0, 1), (0, 0))]], dp_size=1, cp_size=1, bucket_size=8)
    batch = collate_rank(samples, plan, dp_rank=0, cp_rank=0, world_size=1)
    assert batch.num_supervised_tokens == 4 + 2
    got = batch.micro_batches[0].inputs["shift_labels"][0].tolist()
    assert got == [*samples[0]["input_ids"][1:], -100, *samples[1]["input_ids"][1:], -100]


def test_shift_sequence_labels() -> None:
    assert shift_sequence_labels(torch.tensor([7])).tolist() == [-100]
    assert shift_sequence_labels(torch.tensor([-100, 3, 4])).tolist() == [3, 4, -100]


def test_to_moves_tensors_and_lightning_uses_it() -> None:
    batch = _collate_all()[(0, 0)]
    moved = move_data_to_device(batch, torch.device("cpu"))
    assert isinstance(moved, RankBatch)
    assert isinstance(moved.micro_batches[0], MicroBatch)
    assert moved.micro_batches[0].device == torch.device("cpu")
    assert moved.micro_batches[0].layout is batch.micro_batches[0].layout
    assert torch.equal(
        moved.micro_batches[0].inputs["input_ids"], batch.micro_batches[0].inputs["input_ids"]
    )


def test_plan_over_the_bucket_is_a_runtime_error() -> None:
    plan = _plan([[((0, 1), (0, 0))]], dp_size=1, cp_size=2, bucket_size=20)
    samples = make_samples([15, 9], seed=3)
    with pytest.raises(RuntimeError, match="puts 24 tokens on CP rank 0, over the bucket of 20"):
        collate_rank(samples, plan, dp_rank=0, cp_rank=1, world_size=2)


@pytest.mark.parametrize(
    ("kwargs", "samples", "error", "match"),
    [
        ({"world_size": 4}, None, ValueError, "world_size 4 does not match"),
        ({"dp_rank": 1}, None, ValueError, r"dp_rank 1 is outside \[0, 1\)"),
        ({"sample_indices": [1]}, None, ValueError, "2 samples but 1 sample indices"),
        (
            {},
            [{"input_ids": [1, 2, 3], "labels": [1, 2]}, {"input_ids": [1]}],
            ValueError,
            "3 input_ids but 2 labels",
        ),
        (
            {},
            [{"input_ids": [], "labels": []}, {"input_ids": [1]}],
            ValueError,
            "sample 0 has no token",
        ),
        ({}, [{"input_ids": [1.5, 2.0]}, {"input_ids": [1]}], TypeError, "must hold integers"),
        ({}, [[1, 2], {"input_ids": [1]}], TypeError, "sample 0 must be a mapping"),
        ({}, [{"input_ids": [1, 2]}], ValueError, r"duplicated or out of range \[1\]"),
    ],
)
def test_bad_inputs_are_refused(kwargs, samples, error, match) -> None:
    plan = _plan([[((0, 1), (D, 0))]], dp_size=1, cp_size=2, bucket_size=8)
    samples = samples if samples is not None else make_samples([2, 1], seed=0)
    args = {"dp_rank": 0, "cp_rank": 0, "world_size": 2, **kwargs}
    with pytest.raises(error, match=match):
        collate_rank(samples, plan, **args)
