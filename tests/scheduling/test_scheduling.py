"""Contract of ``plan_global_batch`` for every policy: coverage, budgets, determinism, errors.

The references are computed here from the lengths alone (token counts with ``math.ceil``), not
with the plan types' own helpers.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_contract import SMALL_TILES, batches, check_contract

from lightning_skrull.scheduling import (
    DISTRIBUTED,
    POLICIES,
    CostModel,
    plan_global_batch,
)
from lightning_skrull.scheduling.shapes import QWEN2_5_7B


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=60, deadline=None)
@given(batch=batches())
def test_every_policy_keeps_the_contract(policy: str, batch) -> None:
    lengths, dp, cp, c = batch
    for model in (None, SMALL_TILES):
        plan = plan_global_batch(
            lengths, dp_size=dp, cp_size=cp, bucket_size=c, cost_model=model, policy=policy
        )
        check_contract(plan, lengths, dp, cp, c)
        assert plan.policy == policy
        again = plan_global_batch(
            tuple(lengths), dp_size=dp, cp_size=cp, bucket_size=c, cost_model=model, policy=policy
        )
        assert again == plan and again.digest() == plan.digest()


@st.composite
def long_tailed(draw: st.DrawFn) -> tuple[list[int], int, int, int]:
    """A few long sequences and many short ones on a wide CP group (where DACP's split
    placement wins under slow communication)."""
    cp = draw(st.sampled_from([4, 8, 16]))
    c = draw(st.sampled_from([3_000, 13_000]))
    long = draw(st.lists(st.integers(1_500, 3_000), max_size=4))
    short = draw(st.lists(st.integers(32, 800), min_size=5, max_size=60))
    return long + short, draw(st.integers(1, 2)), cp, c


@settings(max_examples=40, deadline=None)
@given(batch=long_tailed())
def test_skrull_keeps_the_contract_over_a_slow_network(batch) -> None:
    # Qwen2.5-7B's shape at 25 GB/s: DACP also tries (and in about a fifth of these
    # micro-batches keeps) the split placement; its plans must keep the same contract.
    lengths, dp, cp, c = batch
    model = CostModel(shape=QWEN2_5_7B, comm_bandwidth=25e9)
    plan = plan_global_batch(lengths, dp_size=dp, cp_size=cp, bucket_size=c, cost_model=model)
    check_contract(plan, lengths, dp, cp, c)


@pytest.mark.parametrize("policy", ["static", "sorted"])
@settings(max_examples=30, deadline=None)
@given(batch=batches())
def test_static_policies_distribute_everything(policy: str, batch) -> None:
    lengths, dp, cp, c = batch
    plan = plan_global_batch(lengths, dp_size=dp, cp_size=cp, bucket_size=c, policy=policy)
    assert all(p == DISTRIBUTED for mbs in plan.micro_batches for mb in mbs for p in mb.placement)


@settings(max_examples=30, deadline=None)
@given(batch=batches())
def test_static_keeps_data_order_on_each_dp_rank(batch) -> None:
    lengths, dp, cp, c = batch
    plan = plan_global_batch(lengths, dp_size=dp, cp_size=cp, bucket_size=c, policy="static")
    for d, mbs in enumerate(plan.micro_batches):
        ids = [sid for mb in mbs for sid in mb.sequence_ids]
        assert ids == list(range(d, len(lengths), dp))


@pytest.mark.parametrize("policy", POLICIES)
def test_empty_batch_gives_no_micro_batches(policy: str) -> None:
    plan = plan_global_batch([], dp_size=3, cp_size=4, bucket_size=10, policy=policy)
    assert plan.micro_batches == ((), (), ())


@pytest.mark.parametrize("policy", POLICIES)
def test_fewer_sequences_than_dp_ranks_leaves_ranks_empty(policy: str) -> None:
    lengths = [5, 9]
    plan = plan_global_batch(lengths, dp_size=4, cp_size=2, bucket_size=10, policy=policy)
    check_contract(plan, lengths, 4, 2, 10)
    assert sum(1 for mbs in plan.micro_batches if not mbs) >= 2  # sorted packs both in one


@pytest.mark.parametrize("policy", POLICIES)
def test_cp_size_one_and_dp_size_one(policy: str) -> None:
    lengths = [3, 10, 1, 7, 7, 2]
    plan = plan_global_batch(lengths, dp_size=1, cp_size=1, bucket_size=10, policy=policy)
    check_contract(plan, lengths, 1, 1, 10)
    # Nothing to shard with one CP rank: the cost-aware policies keep everything local.
    if policy in ("skrull", "dacp", "round_robin"):
        assert all(p == 0 for mb in plan.micro_batches[0] for p in mb.placement)


@pytest.mark.parametrize("policy", POLICIES)
def test_all_equal_lengths(policy: str) -> None:
    lengths = [100] * 32
    plan = plan_global_batch(lengths, dp_size=2, cp_size=4, bucket_size=300, policy=policy)
    check_contract(plan, lengths, 2, 4, 300)
    if policy == "skrull":
        # 16 sequences of 100 tokens per DP rank fit 2 x 4 x 300 tokens in two micro-batches;
        # the estimate prefers them whole (no communication), 2 per rank per micro-batch.
        for mbs in plan.micro_batches:
            assert [sorted(mb.placement) for mb in mbs] == [[0, 0, 1, 1, 2, 2, 3, 3]] * 2


@pytest.mark.parametrize("policy", POLICIES)
def test_one_sequence_exactly_at_capacity(policy: str) -> None:
    cp, c = 4, 250
    lengths = [cp * c, 3, 17]
    plan = plan_global_batch(lengths, dp_size=1, cp_size=cp, bucket_size=c, policy=policy)
    check_contract(plan, lengths, 1, cp, c)
    (where,) = [
        p for mb in plan.micro_batches[0] for s, p in zip(mb.sequence_ids, mb.placement) if s == 0
    ]
    assert where == DISTRIBUTED  # longer than one bucket: sharding is the only way


def test_numpy_integers_are_accepted() -> None:
    lengths = np.array([5, 9, 3], dtype=np.int64)
    plan = plan_global_batch(list(lengths), dp_size=1, cp_size=2, bucket_size=10)
    check_contract(plan, [5, 9, 3], 1, 2, 10)


@pytest.mark.parametrize("policy", POLICIES)
def test_too_long_sequence_names_index_length_and_capacity(policy: str) -> None:
    with pytest.raises(ValueError, match=r"sequence 2 has 81 tokens.*capacity.*4 \* 20 = 80"):
        plan_global_batch([5, 80, 81], dp_size=1, cp_size=4, bucket_size=20, policy=policy)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"cp_size": 0}, ValueError, "cp_size=0"),
        ({"dp_size": 0}, ValueError, "dp_size=0"),
        ({"bucket_size": 0}, ValueError, "bucket_size=0"),
        ({"bucket_size": -5}, ValueError, "bucket_size=-5"),
        ({"cp_size": 2.0}, TypeError, "cp_size must be an int"),
        ({"dp_size": True}, TypeError, "dp_size must be an int"),
        ({"policy": "fastest"}, ValueError, "policy='fastest' is unknown; choose one of skrull"),
        ({"cost_model": "qwen"}, TypeError, "cost_model must be a CostModel"),
        ({"lengths": [4, -1]}, ValueError, r"lengths\[1\]=-1"),
        ({"lengths": [4, 0]}, ValueError, r"lengths\[1\]=0 is invalid: every sample has at least"),
        ({"lengths": [4, 2.5]}, TypeError, r"lengths\[1\]=2.5"),
        ({"lengths": [True]}, TypeError, r"lengths\[0\]=True"),
        ({"lengths": "abc"}, TypeError, "lengths must be a sequence of ints"),
    ],
)
def test_bad_arguments_raise_with_the_fix(kwargs: dict, error: type, match: str) -> None:
    args = {"lengths": [4, 5], "dp_size": 1, "cp_size": 2, "bucket_size": 10, **kwargs}
    lengths = args.pop("lengths")
    with pytest.raises(error, match=match):
        plan_global_batch(lengths, **args)


@settings(max_examples=30, deadline=None)
@given(batch=batches())
def test_sorted_gives_each_dp_rank_a_run_of_neighbours(batch) -> None:
    lengths, dp, cp, c = batch
    plan = plan_global_batch(lengths, dp_size=dp, cp_size=cp, bucket_size=c, policy="sorted")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    runs = [[sid for mb in mbs for sid in mb.sequence_ids] for mbs in plan.micro_batches]
    assert [sid for run in runs for sid in run] == order
    assert max(map(len, runs)) - min(map(len, runs)) <= 1
