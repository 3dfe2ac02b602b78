"""CP blocks (issue 45, the planning side): plans whose sequences are sharded over aligned
blocks of the CP group, the planner's block step, the topology-aware cost model, and the
simulate / lower-bound pair on block plans."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_skrull.scheduling import (
    DISTRIBUTED,
    CostModel,
    CpBlock,
    GlobalBatchPlan,
    MicroBatchPlan,
    PlannerOptions,
    degree_shares,
    lower_bound,
    plan_global_batch,
    simulate,
    spans_nodes,
)
from lightning_skrull.scheduling.bound_blocks import best_dual
from lightning_skrull.scheduling.sequence_costs import SequenceCosts
from lightning_skrull.scheduling.shapes import QWEN2_5_7B
from lightning_skrull.scheduling.simulate import micro_batch_terms
from lightning_skrull.scheduling.topology import check_topology

BLOCKS = PlannerOptions(dacp_blocks=True)
# Slow links make blocks pay often: the properties then see many of them.
SLOW = CostModel(comm_bandwidth=5e9, ranks_per_node=None)


def _model(cp_size: int, dp_size: int, rpn_choice: int) -> CostModel:
    """A cost model with a ranks_per_node that fits the layout (or None)."""
    fits = [None] + [
        r
        for r in (1, 2, 4, 8, 16)
        if (dp_size * cp_size) % r == 0 and (r % cp_size == 0 or cp_size % r == 0)
    ]
    return CostModel(
        comm_bandwidth=10e9, inter_node_bandwidth=2e9, ranks_per_node=fits[rpn_choice % len(fits)]
    )


# ------------------------------------------------------------------------------ the plan
def test_a_block_is_aligned_and_its_ranks_are_consecutive() -> None:
    assert CpBlock(start=4, size=2).ranks == range(4, 6)
    for start, size in ((1, 2), (2, 4), (-2, 2), (0, 1), (0, 0)):
        with pytest.raises(ValueError, match="not an aligned block"):
            CpBlock(start=start, size=size)
    with pytest.raises(TypeError, match="must be an int"):
        CpBlock(start=0, size=2.0)  # type: ignore[arg-type]


def test_a_micro_batch_refuses_blocks_that_do_not_fit_its_group() -> None:
    for block in (CpBlock(start=0, size=8), CpBlock(start=0, size=3), CpBlock(start=8, size=4)):
        with pytest.raises(ValueError, match="does not fit a CP group of 8"):
            MicroBatchPlan((0,), (block,), cp_size=8)
    with pytest.raises(ValueError, match="does not fit a CP group of 6"):
        MicroBatchPlan((0,), (CpBlock(start=0, size=4),), cp_size=6)
    MicroBatchPlan((0,), (CpBlock(start=0, size=4),))  # cp_size unknown: only alignment


def test_cp_ranks_reads_every_placement() -> None:
    mb = MicroBatchPlan(
        (5, 6, 7, 8, 9),
        (
            3,
            CpBlock(start=4, size=4),
            DISTRIBUTED,
            CpBlock(start=2, size=2),
            CpBlock(start=0, size=4),
        ),
        cp_size=8,
    )
    assert [mb.cp_ranks(i) for i in range(5)] == [
        range(3, 4), range(4, 8), range(0, 8), range(2, 4), range(0, 4)
    ]  # fmt: skip
    assert mb.block_sizes() == (2, 4)
    assert mb.block_ids(4) == (6, 9) and mb.block_ids(2) == (8,) and mb.block_ids(8) == ()
    assert mb.distributed_ids == (7,)
    lengths = [0] * 5 + [10, 9, 16, 5, 4]
    # rank j: local 10 on 3; ceil(9/4)=3 on 4..7; ceil(16/8)=2 everywhere; ceil(5/2)=3 on 2..3;
    # ceil(4/4)=1 on 0..3.
    assert mb.tokens_per_cp_rank(lengths, 8) == [3, 3, 6, 16, 5, 5, 5, 5]
    with pytest.raises(RuntimeError, match="needs the plan's cp_size"):
        MicroBatchPlan((7,), (DISTRIBUTED,)).cp_ranks(0)


def test_cp_size_takes_no_part_in_equality_and_a_block_enters_the_digest() -> None:
    a = MicroBatchPlan((0, 1), (0, DISTRIBUTED))
    assert a == MicroBatchPlan((0, 1), (0, DISTRIBUTED), cp_size=4)

    def digest(mb: MicroBatchPlan) -> str:
        return GlobalBatchPlan(((mb,),), dp_size=1, cp_size=4, bucket_size=8, policy="x").digest()

    assert digest(a) == digest(MicroBatchPlan((0, 1), (0, DISTRIBUTED), cp_size=4))
    assert digest(a) != digest(MicroBatchPlan((0, 1), (0, CpBlock(start=0, size=2)), cp_size=4))
    assert digest(MicroBatchPlan((0, 1), (0, CpBlock(start=0, size=2)), cp_size=4)) != digest(
        MicroBatchPlan((0, 1), (0, CpBlock(start=2, size=2)), cp_size=4)
    )


def test_degree_shares_sum_the_tokens_at_each_degree() -> None:
    mb = MicroBatchPlan((0, 1, 2, 3), (1, CpBlock(start=0, size=2), DISTRIBUTED, 0), cp_size=4)
    plan = GlobalBatchPlan(((mb,),), dp_size=1, cp_size=4, bucket_size=100, policy="x")
    assert degree_shares(plan, [10, 20, 30, 40]) == {1: 0.5, 2: 0.2, 4: 0.3}
    empty = GlobalBatchPlan(((),), dp_size=1, cp_size=4, bucket_size=100, policy="x")
    assert degree_shares(empty, []) == {}


# ------------------------------------------------------------------------------ the planner
@st.composite
def _batches(draw):
    dp = draw(st.integers(1, 3))
    cp = draw(st.sampled_from([1, 2, 4, 6, 8]))
    bucket = draw(st.sampled_from([16, 64, 300, 2048]))
    n = draw(st.integers(0, 40))
    long_share = draw(st.sampled_from([0.0, 0.3, 0.8]))
    rng = random.Random(draw(st.integers(0, 2**31)))
    lengths = [
        rng.randint(1, cp * bucket) if rng.random() < long_share else rng.randint(1, bucket)
        for _ in range(n)
    ]
    return dp, cp, bucket, lengths, draw(st.integers(0, 7))


def _check_contract(plan: GlobalBatchPlan, lengths: list[int]) -> None:
    assert sorted(plan.all_sequence_ids()) == list(range(len(lengths)))
    cp = plan.cp_size
    for mbs in plan.micro_batches:
        for mb in mbs:
            assert mb.cp_size == cp
            assert max(mb.tokens_per_cp_rank(lengths, cp), default=0) <= plan.bucket_size
            for i, where in enumerate(mb.placement):
                ranks = mb.cp_ranks(i)
                if isinstance(where, CpBlock):
                    assert cp % where.size == 0 and where.start % where.size == 0
                    assert 1 < where.size < cp and ranks.stop <= cp
                else:
                    assert len(ranks) == (cp if where == DISTRIBUTED else 1)


@settings(max_examples=1500, deadline=None)
@given(_batches())
def test_block_plans_keep_the_plan_contract(batch) -> None:
    dp, cp, bucket, lengths, rpn = batch
    model = _model(cp, dp, rpn)
    kw = dict(dp_size=dp, cp_size=cp, bucket_size=bucket, cost_model=model, options=BLOCKS)
    plan = plan_global_batch(lengths, **kw)
    _check_contract(plan, lengths)
    assert plan_global_batch(lengths, **kw).digest() == plan.digest()  # the same on every rank
    bound = lower_bound(
        lengths, dp_size=dp, cp_size=cp, bucket_size=bucket, cost_model=model, blocks=True
    )
    assert bound <= simulate(plan, lengths, model) * (1 + 1e-9)
    assert bound <= lower_bound(
        lengths, dp_size=dp, cp_size=cp, bucket_size=bucket, cost_model=model
    ) * (1 + 1e-9)


@settings(max_examples=300, deadline=None)
@given(_batches())
def test_with_the_step_off_no_plan_holds_a_block(batch) -> None:
    dp, cp, bucket, lengths, rpn = batch
    model = _model(cp, dp, rpn)
    kw = dict(dp_size=dp, cp_size=cp, bucket_size=bucket, cost_model=model)
    for options in (None, PlannerOptions.paper(), PlannerOptions(dacp_blocks=False)):
        plan = plan_global_batch(lengths, **kw, options=options)
        assert not any(mb.block_sizes() for mbs in plan.micro_batches for mb in mbs)
    assert not PlannerOptions().dacp_blocks and not PlannerOptions.paper().dacp_blocks


def test_blocks_occur_and_pay_where_whole_group_exchanges_cross_nodes() -> None:
    rng = random.Random(3)
    lengths = [rng.randint(13_000, 52_000) for _ in range(24)]
    model = CostModel(shape=QWEN2_5_7B, ranks_per_node=8, inter_node_bandwidth=25e9)
    kw = dict(dp_size=2, cp_size=16, bucket_size=13_000, cost_model=model)
    today = plan_global_batch(lengths, **kw)
    blocks = plan_global_batch(lengths, **kw, options=BLOCKS)
    _check_contract(blocks, lengths)
    shares = degree_shares(blocks, lengths)
    assert any(1 < d < 16 for d in shares), shares
    # Measured 0.926x of today's time (5.16 s against 5.57 s).
    assert simulate(blocks, lengths, model) < 0.95 * simulate(today, lengths, model)


def test_a_prime_group_has_no_blocks_and_plans_as_without_the_step() -> None:
    lengths = [random.Random(1).randint(1, 600) for _ in range(30)]
    kw = dict(dp_size=2, cp_size=5, bucket_size=200, cost_model=SLOW)
    assert plan_global_batch(lengths, **kw, options=BLOCKS) == plan_global_batch(lengths, **kw)


# ------------------------------------------------------------------------------ topology
def test_spans_nodes_is_a_question_of_rank_numbers() -> None:
    # CP16 over nodes of 8: the halves sit in one node each, the whole group spans two.
    assert not spans_nodes(range(0, 8), cp_size=16, ranks_per_node=8)
    assert not spans_nodes(range(8, 16), cp_size=16, ranks_per_node=8, dp_rank=3)
    assert spans_nodes(range(0, 16), cp_size=16, ranks_per_node=8)
    assert spans_nodes(range(4, 8), cp_size=8, ranks_per_node=2)
    # CP4 inside nodes of 8: never, whichever DP rank.
    assert not any(spans_nodes(range(4), cp_size=4, ranks_per_node=8, dp_rank=r) for r in range(4))
    # CP12 over nodes of 4: an aligned block of 3 can straddle a node boundary.
    assert spans_nodes(range(3, 6), cp_size=12, ranks_per_node=4)
    assert not spans_nodes(range(0, 16), cp_size=16, ranks_per_node=None)
    assert not spans_nodes(range(5, 6), cp_size=16, ranks_per_node=1)


def test_an_exchange_across_nodes_pays_the_inter_node_link() -> None:
    model = CostModel(
        shape=QWEN2_5_7B, ranks_per_node=8, inter_node_bandwidth=25e9, inter_node_latency_s=30e-6
    )
    inside, across = range(8, 16), range(0, 16)
    assert model.link(inside, 16) == (model.comm_latency_s, model.comm_bandwidth)
    assert model.link(across, 16) == (30e-6, 25e9)
    tokens = 50_000
    layers = 2 * QWEN2_5_7B.num_layers
    expect_inside = (
        layers * model.comm_latency_s + model.comm_bytes(tokens, 8) / model.comm_bandwidth
    )
    expect_across = layers * 30e-6 + model.comm_bytes(tokens, 16) / 25e9
    assert model.exchange_seconds(tokens, inside, 16) == pytest.approx(expect_inside, rel=1e-12)
    assert model.exchange_seconds(tokens, across, 16) == pytest.approx(expect_across, rel=1e-12)
    assert model.comm_seconds(tokens, 16) == model.exchange_seconds(tokens, across, 16)
    # Without a topology the whole group prices as before, to the last bit.
    plain = CostModel(shape=QWEN2_5_7B)
    old = (
        2 * QWEN2_5_7B.num_layers * plain.comm_latency_s
        + plain.comm_bytes(tokens, 16) / plain.comm_bandwidth
    )
    assert plain.comm_seconds(tokens, 16) == old


@pytest.mark.parametrize(
    ("rpn", "dp", "cp", "match"),
    [
        (3, 2, 4, "does not divide the world size"),
        (8, 2, 12, "does not fit CP groups of 12"),
        (4, 3, 6, "does not divide the world size"),
        (4, 4, 6, "does not fit CP groups of 6"),
    ],
)
def test_a_ranks_per_node_that_does_not_fit_the_layout_is_refused(rpn, dp, cp, match) -> None:
    model = CostModel(ranks_per_node=rpn)
    with pytest.raises(ValueError, match=match):
        check_topology(rpn, dp_size=dp, cp_size=cp)
    with pytest.raises(ValueError, match=match):
        plan_global_batch([5, 6], dp_size=dp, cp_size=cp, bucket_size=64, cost_model=model)
    with pytest.raises(ValueError, match=match):
        lower_bound([5, 6], dp_size=dp, cp_size=cp, bucket_size=64, cost_model=model)


@pytest.mark.parametrize("bad", [0, -8, True, 2.0, "8"])
def test_a_ranks_per_node_that_is_not_a_count_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="ranks_per_node="):
        CostModel(ranks_per_node=bad)


def test_the_inter_node_constants_are_checked() -> None:
    with pytest.raises(ValueError, match="inter_node_bandwidth"):
        CostModel(inter_node_bandwidth=0.0)
    with pytest.raises(ValueError, match="inter_node_latency_s"):
        CostModel(inter_node_latency_s=-1.0)


# ------------------------------------------------------------------------------ timing
def test_block_micro_batch_seconds_agree_between_the_two_timers() -> None:
    lengths = [3000, 900, 5000, 700, 1200, 8000, 400]
    model = CostModel(shape=QWEN2_5_7B, ranks_per_node=4, inter_node_bandwidth=20e9)
    costs = SequenceCosts(lengths, 8, model)
    placements = (
        (0, CpBlock(start=2, size=2), CpBlock(start=4, size=4), 1, DISTRIBUTED, DISTRIBUTED, 0),
        (
            CpBlock(start=0, size=4),
            5,
            CpBlock(start=4, size=4),
            6,
            CpBlock(start=4, size=2),
            DISTRIBUTED,
            7,
        ),
    )
    for placement in placements:
        for groups in ((), (1,) * len([p for p in placement if p == DISTRIBUTED])):
            mb = MicroBatchPlan(tuple(range(7)), placement, groups, cp_size=8)
            expect = model.micro_batch_seconds(mb, lengths, 8)
            assert micro_batch_terms(mb, costs, model).seconds == pytest.approx(expect, rel=1e-9)


def test_one_block_exchange_is_exposed_without_local_attention_to_hide_it() -> None:
    model = CostModel(shape=QWEN2_5_7B)
    mb = MicroBatchPlan((0,), (CpBlock(start=0, size=4),), cp_size=8)
    times = model.rank_seconds(mb, [40_000], 8)
    d = 4
    alone = (
        model.micro_batch_overhead_s
        + model.linear_seconds(40_000 / d)
        + model.exchange_seconds(40_000, range(4), 8)
        + model.distributed_attention_seconds(40_000, d)
    )
    assert times[:4] == pytest.approx([alone] * 4, rel=1e-12)
    assert times[4:] == pytest.approx([model.micro_batch_overhead_s] * 4, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.floats(-5, 5), st.floats(-5, 5)), min_size=1, max_size=5), max_size=8
    ),
    st.floats(0, 5),
)
def test_the_dual_is_maximised_exactly(choices, latency) -> None:
    value = best_dual(latency, choices)
    grid = [k / 400 for k in range(401)]
    best_on_grid = max(
        lam * latency + sum(min(a + lam * b for a, b in lines) for lines in choices) for lam in grid
    )
    assert value >= best_on_grid - 1e-9
    assert value <= best_on_grid + 0.1  # the maximum lies within 1/800 of a grid point
    assert math.isfinite(value)
