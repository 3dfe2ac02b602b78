"""How good the plans are: DACP against exhaustive search, the lower bound against every plan,
the simulator against a hand computation, the corrected roll-back, and GDS's loop."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_skrull.scheduling import (
    DISTRIBUTED,
    POLICIES,
    CostModel,
    GlobalBatchPlan,
    MicroBatchPlan,
    ModelShape,
    dacp,
    dacp_greedy,
    dacp_refinements,
    dp_rank_seconds,
    lower_bound,
    plan_global_batch,
    simulate,
)
from lightning_skrull.scheduling.dacp import place_micro_batch
from lightning_skrull.scheduling.dacp_greedy import CpGroupState
from lightning_skrull.scheduling.gds import balance_dp, deal_by_tokens, split_micro_batches
from lightning_skrull.scheduling.options import PlannerOptions
from lightning_skrull.scheduling.sequence_costs import SequenceCosts
from lightning_skrull.scheduling.shapes import QWEN2_5_7B
from lightning_skrull.scheduling.simulate import _relaxation

NO_OVERHEAD = CostModel(micro_batch_overhead_s=0.0)


def best_placement(lengths: list[int], cp: int, c: int, model: CostModel) -> float:
    """Exhaustive search over every placement of one micro-batch (the reference optimum)."""
    ids = tuple(range(len(lengths)))
    best = math.inf
    for placement in itertools.product(range(-1, cp), repeat=len(ids)):
        tokens = [0] * cp
        for s, p in zip(lengths, placement, strict=True):
            for j in range(cp) if p == DISTRIBUTED else (p,):
                tokens[j] += math.ceil(s / cp) if p == DISTRIBUTED else s
        if max(tokens) <= c:
            best = min(best, model.micro_batch_seconds(MicroBatchPlan(ids, placement), lengths, cp))
    return best


def test_dacp_is_close_to_the_exhaustive_optimum() -> None:
    rng = random.Random(0)
    ratios = []
    while len(ratios) < 40:
        cp = rng.choice([2, 3, 4])
        c = rng.choice([2_000, 8_000, 30_000])
        model = CostModel(
            micro_batch_overhead_s=0.0,
            comm_bandwidth=rng.choice([10e9, 100e9]),
            tile_size=rng.choice([1, 128]),
        )
        lengths = [1 + int(min(cp * c - 1, rng.lognormvariate(8, 1.2))) for _ in range(5)]
        optimum = best_placement(lengths, cp, c, model)
        if optimum == math.inf:
            continue
        placement = place_micro_batch(range(5), SequenceCosts(lengths, cp, model), c)
        assert placement is not None, "DACP must place whatever exhaustive search can"
        got = model.micro_batch_seconds(MicroBatchPlan(tuple(range(5)), placement), lengths, cp)
        ratios.append(got / optimum)
    # A heuristic, so not always optimal: measured mean 1.0007 and worst 1.018 on these cases
    # (2 of 40 above the optimum). The bounds catch a regression: without the split and the
    # paper-rule candidate DACP measured mean 1.020 and worst 1.214 here, and the paper's
    # memory-only rule alone is 2% off on average and 43% at worst on similar cases.
    assert min(ratios) >= 1.0 - 1e-12
    assert sum(ratios) / len(ratios) <= 1.01
    assert max(ratios) <= 1.15


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[int], int, int, int]:
    cp = draw(st.integers(1, 8))
    dp = draw(st.integers(1, 4))
    c = draw(st.sampled_from([64, 1_000, 8_000]))
    lengths = draw(st.lists(st.integers(1, cp * c), min_size=1, max_size=30))
    return lengths, dp, cp, c


@settings(max_examples=40, deadline=None)
@given(batch=batches())
def test_lower_bound_is_below_every_policy(batch) -> None:
    lengths, dp, cp, c = batch
    models = (
        CostModel(),
        CostModel(comm_bandwidth=5e9, tile_size=16),
        CostModel(micro_batch_overhead_s=0.05),  # the overhead measured on an H200, rounded
    )
    for model in models:
        bound = lower_bound(lengths, dp_size=dp, cp_size=cp, bucket_size=c, cost_model=model)
        assert bound > 0
        for policy in POLICIES:
            plan = plan_global_batch(
                lengths, dp_size=dp, cp_size=cp, bucket_size=c, cost_model=model, policy=policy
            )
            # Exact inequality up to float summation order.
            assert simulate(plan, lengths, model) >= bound * (1 - 1e-9)


def test_lower_bound_charges_one_micro_batch_per_dp_rank() -> None:
    # Four short sequences, four DP ranks: the token budget allows one micro-batch for all, but
    # every DP rank that gets a sequence runs one. The best plan (one sequence per DP rank)
    # meets the bound exactly; a bound that spread one overhead over four ranks would not.
    model = CostModel(micro_batch_overhead_s=0.05)
    lengths = [100] * 4
    bound = lower_bound(lengths, dp_size=4, cp_size=1, bucket_size=1_000, cost_model=model)
    plan = plan_global_batch(lengths, dp_size=4, cp_size=1, bucket_size=1_000, cost_model=model)
    assert bound == pytest.approx(0.05 + model.local_seconds(100), rel=1e-12)
    assert simulate(plan, lengths, model) == pytest.approx(bound, rel=1e-12)
    # Fewer sequences than DP ranks: only two ranks can hold one.
    two = lower_bound(lengths[:2], dp_size=4, cp_size=1, bucket_size=1_000, cost_model=model)
    assert two == pytest.approx(bound, rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(batch=batches())
def test_lower_bound_is_at_least_its_relaxation_without_forced_sequences(batch) -> None:
    # Forcing slow sequences onto the distributed path can only raise the bound; sequences
    # over the bucket are always forced (a regression once left them out).
    lengths, dp, cp, c = batch
    model = CostModel(micro_batch_overhead_s=0.01)
    costs = SequenceCosts(lengths, cp, model)
    plain = _relaxation(
        lengths, costs, [s > c for s in lengths], dp, c, model.micro_batch_overhead_s
    )
    bound = lower_bound(lengths, dp_size=dp, cp_size=cp, bucket_size=c, cost_model=model)
    assert bound >= plain * (1 - 1e-12)


def test_lower_bound_forces_sequences_longer_than_a_rank_can_hold_in_time() -> None:
    # Two sequences on four CP ranks: spread evenly while local they would take half a local
    # time each, but a plan that keeps one local lasts a whole local time. Distributing both
    # is best. At 20 GB/s each sequence's exchange outlasts its distributed attention, so the
    # plan pipelines them in two K/V groups and lasts 2 * comm + one attention; the bound,
    # which lets all distributed attention hide communication, is exactly one attention less.
    model = CostModel(comm_latency_s=0.0, comm_bandwidth=20e9)
    lengths = [4_000, 4_000]
    plan = plan_global_batch(lengths, dp_size=1, cp_size=4, bucket_size=8_000, cost_model=model)
    mb = plan.micro_batches[0][0]
    assert all(p == DISTRIBUTED for p in mb.placement)
    assert mb.kv_groups == (1, 1)
    bound = lower_bound(lengths, dp_size=1, cp_size=4, bucket_size=8_000, cost_model=model)
    costs = SequenceCosts(lengths, 4, model)
    assert costs.comm(4_000) > costs.distributed_attention(0)
    gap = simulate(plan, lengths, model) - bound
    assert gap == pytest.approx(costs.distributed_attention(0), rel=1e-9)
    spread_local = _relaxation(
        lengths, costs, [False, False], 1, 8_000, model.micro_batch_overhead_s
    )
    assert spread_local < 0.85 * bound  # what the bound was without the forcing


def test_lower_bound_charges_the_latency_of_the_micro_batches_forced_sequences_need() -> None:
    # The batch above with the default latency (20 us per collective, 56 collectives): the plan
    # pays it once per K/V group, twice; the bound once, for the one micro-batch both sequences
    # fit in (2 x 1000 tokens per CP rank of 8000).
    model = CostModel(comm_bandwidth=20e9)
    lengths = [4_000, 4_000]
    kw = dict(dp_size=1, cp_size=4, bucket_size=8_000, cost_model=model)
    plan = plan_global_batch(lengths, **kw)
    assert plan.micro_batches[0][0].kv_groups == (1, 1)
    costs = SequenceCosts(lengths, 4, model)
    assert costs.comm_fixed == pytest.approx(2 * 24 * 20e-6, rel=1e-12)  # Qwen2.5-0.5B layers
    bound = lower_bound(lengths, **kw)
    gap = simulate(plan, lengths, model) - bound
    # rel 1e-9: differences of sums in another order lose a few ulps; the latency is 40% of it.
    assert gap == pytest.approx(costs.distributed_attention(0) + costs.comm_fixed, rel=1e-9)
    without = lower_bound(lengths, **{**kw, "cost_model": model.with_constants(comm_latency_s=0)})
    assert bound - without == pytest.approx(costs.comm_fixed, rel=1e-9)
    # With a bucket of 1500 tokens both are forced (longer than the bucket) and need two
    # micro-batches (1000 tokens per CP rank each): the latency is charged twice.
    small = dict(dp_size=1, cp_size=4, bucket_size=1_500)
    bound = lower_bound(lengths, **small, cost_model=model)
    without = lower_bound(lengths, **small, cost_model=model.with_constants(comm_latency_s=0))
    assert bound - without == pytest.approx(2 * costs.comm_fixed, rel=1e-9)
    plan = plan_global_batch(lengths, **small, cost_model=model)
    assert simulate(plan, lengths, model) >= bound


def test_lower_bound_is_below_the_exhaustive_optimum_of_one_micro_batch() -> None:
    rng = random.Random(1)
    for _ in range(30):
        cp, c = rng.choice([2, 3]), rng.choice([500, 4_000])
        lengths = [rng.randint(1, cp * c) for _ in range(5)]
        model = CostModel(comm_bandwidth=rng.choice([2e9, 100e9]), tile_size=rng.choice([1, 64]))
        optimum = best_placement(lengths, cp, c, model)
        if optimum == math.inf:
            continue
        bound = lower_bound(lengths, dp_size=1, cp_size=cp, bucket_size=c, cost_model=model)
        assert bound <= optimum * (1 + 1e-9)


def test_simulate_matches_a_hand_computation() -> None:
    # Shape with round numbers; tile 1 = exact pairs; FLOP/s chosen so seconds = FLOPs * 1e-12.
    shape = ModelShape(
        hidden_size=8,
        num_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        intermediate_size=16,
        vocab_size=10,
    )
    model = CostModel(
        shape=shape,
        achieved_flops=3e12,  # with the 3x training factor: seconds = forward FLOPs / 1e12
        micro_batch_overhead_s=1.0,
        comm_latency_s=0.5,
        comm_bandwidth=1e12,
        bytes_per_element=2,
        tile_size=1,
    )
    lengths = [4, 6, 8]
    # One micro-batch on 2 CP ranks: 4 local on rank 0, 6 local on rank 1, 8 distributed.
    plan = GlobalBatchPlan(
        micro_batches=((MicroBatchPlan((0, 1, 2), (0, 1, DISTRIBUTED)),),),
        dp_size=1,
        cp_size=2,
        bucket_size=100,
        policy="hand",
    )
    lin, pair = 2464, 64  # forward FLOPs per token and per causal pair (see test_cost_model)
    rank0 = 4 * lin * 1e-12, 10 * pair * 1e-12  # linear, attention (4*5/2 = 10 pairs)
    rank1 = 6 * lin * 1e-12, 21 * pair * 1e-12  # 6*7/2 = 21 pairs
    # Distributed 8 tokens: zigzag chunks of 2 tokens, [0,2) [2,4) [4,6) [6,8); causal pairs of
    # each chunk against its prefix: 3, 7, 11, 15 -> 36 pairs = 8*9/2; per rank 18.
    dist = (8 / 2 * lin + 18 * pair) * 1e-12
    # Comm: 2 layers x 2 directions x (K and V: 2 x kv_dim 4 x 2 bytes) x 8 tokens x 1/2.
    comm = 2 * 2 * 0.5 + (2 * 2) * (2 * 4 * 2) * 8 * 0.5 / 1e12
    expected = 1.0 + max(r[0] + max(comm, r[1]) for r in (rank0, rank1)) + dist
    assert simulate(plan, lengths, model) == pytest.approx(expected, rel=1e-12)
    assert dp_rank_seconds(plan, lengths, model) == [pytest.approx(expected, rel=1e-12)]


def test_roll_back_frees_most_and_charges_the_other_ranks() -> None:
    lengths = [10, 30, 40, 20]
    costs = SequenceCosts(lengths, 2, NO_OVERHEAD)
    state = CpGroupState(costs, bucket_size=60)
    state.put_local(0, 0)
    state.put_local(1, 0)
    state.put_local(2, 1)
    state.put_local(3, 1)
    assert state.tokens == [40, 60]
    assert state.roll_back()
    # Rolling back 40 frees 40 - 20 = 20 on rank 1 (the most); rank 0 pays its 20-token shard.
    assert state.where[2] == DISTRIBUTED
    assert [t + state.reserved for t in state.tokens] == [60, 40]
    # Next: 30 on rank 0 frees 15 and rank 1 can pay 15; 20 on rank 1 would push rank 0 to 70.
    assert state.roll_back()
    assert state.where[1] == DISTRIBUTED
    assert [t + state.reserved for t in state.tokens] == [45, 55]


def test_roll_back_refuses_when_another_rank_would_overflow() -> None:
    costs = SequenceCosts([50, 40], 2, NO_OVERHEAD)
    state = CpGroupState(costs, bucket_size=50)
    state.put_local(0, 0)
    state.put_local(1, 1)
    # Sharding 50 costs rank 1 25 tokens (40 + 25 > 50); sharding 40 costs rank 0 20 (70 > 50).
    assert not state.roll_back()
    assert state.where == {0: 0, 1: 1}


def test_dacp_rolls_back_when_memory_demands_it() -> None:
    # Two ranks of 10 tokens, longest first: 8 and 6 go whole on ranks 0 and 1; the second 6
    # then fits nowhere whole, and its shard (3) not next to the 8 either. Rolling the 8 back
    # (4 per rank) makes room. The only fitting placements shard the 8.
    lengths = [6, 6, 8]
    costs = SequenceCosts(lengths, 2, NO_OVERHEAD)
    placement = place_micro_batch([0, 1, 2], costs, 10)
    assert placement is not None
    assert placement[2] == DISTRIBUTED and sorted(placement[:2]) == [0, 1]


def test_gds_adds_micro_batches_until_placement_succeeds() -> None:
    lengths = [5] * 6
    costs = SequenceCosts(lengths, 2, NO_OVERHEAD)
    tried = []

    def only_singletons(ids, costs, bucket_size):
        tried.append(len(ids))
        return (DISTRIBUTED,) if len(ids) == 1 else None

    plans = split_micro_batches(range(6), costs, 100, only_singletons)
    assert [mb.sequence_ids for mb in plans] == [(i,) for i in range(6)]
    assert tried[0] == 6 and tried[-6:] == [1] * 6  # started at m = 1, stopped at the first fit


def strided_only_counts(
    lengths: list[int], dp: int, cp: int, c: int, model: CostModel
) -> list[int]:
    """Micro-batches per DP rank of the paper's GDS loop (strided deals only), as a reference."""
    costs = SequenceCosts(lengths, cp, model)
    counts = []
    for ids in balance_dp(range(len(lengths)), dp, costs):
        mine = sorted(ids, key=lambda i: (lengths[i], i))
        m = max(1, math.ceil(sum(lengths[i] for i in mine) / (cp * c))) if mine else 0
        while mine:
            groups = [mine[i::m] for i in range(m)]
            if all(sum(lengths[i] for i in g) <= cp * c for g in groups) and all(
                place_micro_batch(g, costs, c) is not None for g in groups
            ):
                break
            m += 1
        counts.append(m)
    return counts


def test_gds_deals_by_tokens_where_the_strided_deal_overflows() -> None:
    # Ascending [1, 2, 8, 9] in 2 strided micro-batches is [1, 8] and [2, 9]: 11 tokens, over
    # the 10 of the group; the strided loop needs 3. Dealt by tokens: [1, 9] and [2, 8].
    lengths = [1, 2, 8, 9]
    assert strided_only_counts(lengths, 1, 1, 10, NO_OVERHEAD) == [3]
    plan = plan_global_batch(lengths, dp_size=1, cp_size=1, bucket_size=10)
    assert [mb.sequence_ids for mb in plan.micro_batches[0]] == [(0, 3), (1, 2)]
    assert deal_by_tokens([0, 1, 2, 3], 2, lengths) == [[0, 3], [1, 2]]


def test_gds_tries_the_token_deal_only_when_it_differs() -> None:
    # Equal lengths: at every m the token deal makes the strided micro-batches (in another
    # order), so only the strided ones are offered to the placer.
    lengths = [5] * 6
    costs = SequenceCosts(lengths, 2, NO_OVERHEAD)
    tried = []

    def refuse(ids, costs, bucket_size):
        tried.append(tuple(ids))
        return None if len(ids) > 1 else (DISTRIBUTED,)

    split_micro_batches(range(6), costs, 100, refuse)
    assert tried == [tuple(range(6)), (0, 2, 4), (0, 3), (0, 4), (0, 5)] + [(i,) for i in range(6)]


def test_gds_needs_fewer_micro_batches_than_the_strided_loop_near_capacity() -> None:
    # Log-uniform lengths up to a little over the group's capacity (cut to it), so a few
    # sequences sit at or near capacity: the strided loop then needs up to one micro-batch per
    # sequence. Measured: fewer on 170 of these 200 batches (2483 micro-batches saved), more on
    # none; the 150 leaves room for planner changes that move a few.
    rng = random.Random(1)
    fewer = 0
    for _ in range(200):
        cp, dp, c = rng.choice([1, 2, 4, 8]), rng.choice([1, 2]), rng.choice([512, 2048])
        cap = cp * c
        top = math.log2(cap) + 0.5
        lengths = [min(cap, int(2 ** rng.uniform(4, top))) for _ in range(rng.randint(4, 40))]
        plan = plan_global_batch(lengths, dp_size=dp, cp_size=cp, bucket_size=c)
        counts = [len(mbs) for mbs in plan.micro_batches]
        reference = strided_only_counts(lengths, dp, cp, c, CostModel())
        assert all(a <= b for a, b in zip(counts, reference, strict=True)), (lengths, counts)
        fewer += sum(counts) < sum(reference)
    assert fewer >= 150


def test_skrull_beats_static_on_short_heavy_data() -> None:
    # Regression guard on a fixed workload (Qwen2.5-0.5B shape, DP=2, CP=8): 120 short chat
    # samples and 4 long ones. Measured 1.49x over packed static, which pays communication and
    # tile waste for every short sequence; skrull was the fastest policy.
    rng = random.Random(0)
    lengths = [int(math.exp(rng.uniform(math.log(64), math.log(1024)))) for _ in range(120)]
    lengths += [rng.randint(4_000, 30_000) for _ in range(4)]
    model = CostModel()
    times = {
        p: simulate(
            plan_global_batch(lengths, dp_size=2, cp_size=8, bucket_size=26_000, policy=p),
            lengths,
            model,
        )
        for p in POLICIES
    }
    assert times["skrull"] * 1.3 <= times["static"]
    # Heuristics can tie or lose by a hair to another policy on some batch; 2% is the margin.
    assert times["skrull"] <= min(times.values()) * 1.02


def test_split_runs_where_sharding_short_sequences_wastes_time() -> None:
    # Qwen2.5-7B's shape, CP=16, the default 100 GB/s: the greedy (refined) shards 19 of these
    # sequences, 14 of them 200-token ones whose tiles are mostly empty on 16 ranks. Their
    # communication is only 11% of its estimate, under the communication gate, but with the
    # tile waste they cost 14% beyond an even spread, over the waste gate. The split shards the
    # 5 longest and keeps the short ones whole: 1.3% faster.
    model = CostModel(shape=QWEN2_5_7B)
    lengths = [9000] + [1500] * 4 + [200] * 30
    costs = SequenceCosts(lengths, 16, model)
    base, rest = dacp._forced(range(len(lengths)), costs, 13_000)
    greedy = base.copy()
    assert dacp_greedy.greedy(greedy, rest, look_ahead=True)
    dacp_refinements.improve(greedy, max_moves=2 * len(lengths) + 16)
    estimate = greedy.estimate()
    assert len(greedy.distributed) == 19
    assert costs.comm(greedy.dist_tokens) < PlannerOptions().split_comm_share * estimate
    assert dacp_refinements.shard_waste(greedy) >= PlannerOptions().split_waste_share * estimate
    plan = plan_global_batch(lengths, dp_size=1, cp_size=16, bucket_size=13_000, cost_model=model)
    (mb,) = plan.micro_batches[0]
    shards = [lengths[sid] for sid, p in zip(mb.sequence_ids, mb.placement) if p == DISTRIBUTED]
    assert sorted(shards) == [1500] * 4 + [9000]
    assert simulate(plan, lengths, model) < 0.99 * (estimate + model.micro_batch_overhead_s)


def test_shard_waste_counts_only_sequences_that_fit_a_rank() -> None:
    # Tile waste plus communication of the shards a rank could hold whole; a forced one (over
    # the bucket) is not a choice and is left out. Tile size 1: no tile waste, so each counted
    # shard adds its distributed time minus an even share of its whole time, plus its bytes.
    model = CostModel(shape=QWEN2_5_7B, tile_size=1)
    lengths = [3000, 64, 640]
    costs = SequenceCosts(lengths, 4, model)
    state = dacp_greedy.CpGroupState(costs, 1000)
    for sid in range(3):
        state.put_distributed(sid)
    expected = sum(
        costs.distributed(sid) - costs.local(sid) / 4 + costs.comm_per_token * lengths[sid]
        for sid in (1, 2)
    )
    assert dacp_refinements.shard_waste(state) == pytest.approx(expected, rel=1e-12)
    assert expected > 0


def test_slow_communication_keeps_short_sequences_whole() -> None:
    # Qwen2.5-7B's shape, CP=16 over a 25 GB/s network: the greedy, deciding longest first,
    # shards 15 of these sequences (keeping the first short one whole always raises the slowest
    # rank more than sharding it). Sharding only the 3 long ones and spreading the short ones
    # whole is 3% faster; the split construction finds it.
    model = CostModel(shape=QWEN2_5_7B, comm_bandwidth=25e9)
    lengths = [2900, 2700, 2200] + [300] * 30 + [80] * 20
    plan = plan_global_batch(lengths, dp_size=1, cp_size=16, bucket_size=13_000, cost_model=model)
    (mb,) = plan.micro_batches[0]
    shards = [lengths[sid] for sid, p in zip(mb.sequence_ids, mb.placement) if p == DISTRIBUTED]
    assert sorted(shards) == [2200, 2700, 2900]
    costs = SequenceCosts(lengths, 16, model)
    base, rest = dacp._forced(range(len(lengths)), costs, 13_000)
    greedy = base.copy()
    assert dacp_greedy.greedy(greedy, rest, look_ahead=True)
    assert len(greedy.distributed) == 15
    assert simulate(plan, lengths, model) < 0.98 * (
        greedy.estimate() + model.micro_batch_overhead_s
    )


def test_dacp_falls_back_to_memory_only_sharding_where_its_choices_leave_no_room() -> None:
    # CP=3, 1000 tokens per rank: the look-ahead greedy shards the 739-token sequence by choice
    # (its shard takes 247 tokens on every rank) and then no rank has room for the 430- and
    # 395-token ones, nor for their shards. The paper-rule candidate (shard only what memory
    # forces) fits: the placement must exist (exact token check, no tolerance).
    lengths = [508, 430, 395, 739, 611]
    costs = SequenceCosts(lengths, 3, CostModel(shape=QWEN2_5_7B, tile_size=128))
    base, rest = dacp._forced(range(5), costs, 1000)
    assert not dacp_greedy.greedy(base.copy(), rest, look_ahead=True)
    placement = place_micro_batch(range(5), costs, 1000)
    assert placement is not None
    assert place_micro_batch(range(5), costs, 1000, PlannerOptions(dacp_paper_rule=False)) is None
    tokens = [0, 0, 0]
    for s, p in zip(lengths, placement, strict=True):
        for r in range(3) if p == DISTRIBUTED else (p,):
            tokens[r] += math.ceil(s / 3) if p == DISTRIBUTED else s
    assert max(tokens) <= 1000
