"""K/V groups: the pipeline span, the time model with groups, the chooser, and the bound.

Every time here is checked against an independent computation: a hand-computed pipeline, the
cost model's own per-rank formula, all contiguous partitions tried exhaustively, and the
fractional relaxation solved by enumerating its vertices.
"""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_skrull.scheduling import CostModel, lower_bound, plan_global_batch, simulate
from lightning_skrull.scheduling.cost_model import kv_pipeline_span
from lightning_skrull.scheduling.kv_groups import MAX_KV_GROUPS, SPAN_TOLERANCE, choose_kv_groups
from lightning_skrull.scheduling.plan import DISTRIBUTED, GlobalBatchPlan, MicroBatchPlan
from lightning_skrull.scheduling.sequence_costs import SequenceCosts
from lightning_skrull.scheduling.simulate import _least_exposed, micro_batch_terms

# Measured-like constants where the exchange of long distributed sequences is exposed: the
# fixed cost per micro-batch of an H200 and NVLink bandwidth (docs/simulate_paper.md).
EXPOSED = CostModel(achieved_flops=3.0e14, micro_batch_overhead_s=0.05)


def _time(mb: MicroBatchPlan, lengths: list[int], cp: int, model: CostModel) -> float:
    return model.micro_batch_seconds(mb, lengths, cp)


def test_pipeline_span_by_hand() -> None:
    # Paths: group 0 = 1 + (3 + 1) = 5, group 1 = (1 + 2) + 1 = 4.
    assert kv_pipeline_span([1.0, 2.0], [3.0, 1.0]) == (5.0, 0)
    # Paths: 1 + (2 + 1) = 4, (1 + 5) + 1 = 7.
    assert kv_pipeline_span([1.0, 5.0], [2.0, 1.0]) == (7.0, 1)
    assert kv_pipeline_span([], []) == (0.0, 0)


def test_micro_batch_plan_checks_kv_groups() -> None:
    MicroBatchPlan((0, 1, 2), (DISTRIBUTED, 0, DISTRIBUTED), (1, 1))
    for bad in ((1,), (2, 1), (0, 2), (True, 1)):
        with pytest.raises(ValueError, match="kv_groups"):
            MicroBatchPlan((0, 1, 2), (DISTRIBUTED, 0, DISTRIBUTED), bad)
    one = MicroBatchPlan((0, 1), (DISTRIBUTED, DISTRIBUTED))
    two = MicroBatchPlan((0, 1), (DISTRIBUTED, DISTRIBUTED), (1, 1))
    assert one.kv_group_ranges() == [(0, 2)]
    assert two.kv_group_ranges() == [(0, 1), (1, 2)]
    plans = [
        GlobalBatchPlan(((mb,),), dp_size=1, cp_size=2, bucket_size=10, policy="x")
        for mb in (one, two)
    ]
    assert plans[0].digest() != plans[1].digest()


def test_time_with_groups_is_the_two_stage_pipeline() -> None:
    # Three distributed sequences and one local one on CP rank 0, in two groups (1 + 2).
    cp = 4
    lengths = [30_000, 50_000, 60_000, 2_000]
    mb = MicroBatchPlan((0, 1, 2, 3), (DISTRIBUTED, DISTRIBUTED, DISTRIBUTED, 0), (1, 2))
    m = EXPOSED
    c = [m.comm_seconds(30_000, cp), m.comm_seconds(110_000, cp)]
    d = [m.distributed_attention_seconds(s, cp) for s in lengths[:3]]
    dist_linear = m.linear_seconds(140_000 / cp)
    local = m.local_attention_seconds(2_000)
    # The last attention ends at the latest of: local attention then all attention, or a
    # group's exchange (after those before it) then the attention from that group on.
    span = max(local + sum(d), c[0] + sum(d), c[0] + c[1] + d[1] + d[2])
    expected = m.micro_batch_overhead_s + dist_linear + m.linear_seconds(2_000) + span
    assert _time(mb, lengths, cp, m) == pytest.approx(expected, rel=1e-12)
    costs = SequenceCosts(lengths, cp, m)
    assert micro_batch_terms(mb, costs, m).seconds == pytest.approx(expected, rel=1e-12)
    # One group is the paper's Eq. 2: the whole exchange hides only behind the local attention.
    one = MicroBatchPlan(mb.sequence_ids, mb.placement)
    comm = m.comm_seconds(140_000, cp)
    eq2 = (
        m.micro_batch_overhead_s + dist_linear + sum(d) + m.linear_seconds(2_000) + max(comm, local)
    )
    assert _time(one, lengths, cp, m) == pytest.approx(eq2, rel=1e-12)
    assert _time(mb, lengths, cp, m) < _time(one, lengths, cp, m)


def _random_micro_batch(rng: random.Random, cp: int) -> tuple[MicroBatchPlan, list[int]]:
    n = rng.randint(1, 7)
    lengths = [rng.choice([rng.randint(1, 500), rng.randint(1_000, 60_000)]) for _ in range(n)]
    placement = tuple(rng.choice([DISTRIBUTED, DISTRIBUTED, rng.randrange(cp)]) for _ in lengths)
    return MicroBatchPlan(tuple(range(n)), placement), lengths


def _partitions(n: int):
    """Every way to cut ``n`` items into contiguous non-empty groups, as group sizes."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        sizes, size = [], 1
        for cut in cuts:
            if cut:
                sizes.append(size)
                size = 1
            else:
                size += 1
        yield (*sizes, size)


def test_chooser_matches_every_contiguous_partition() -> None:
    rng = random.Random(7)
    grouped = 0
    for _ in range(300):
        cp = rng.choice([2, 4, 8])
        model = rng.choice([EXPOSED, CostModel(), CostModel(comm_bandwidth=20e9)])
        mb, lengths = _random_micro_batch(rng, cp)
        costs = SequenceCosts(lengths, cp, model)
        chosen = choose_kv_groups(mb, costs)
        assert (chosen.sequence_ids, chosen.placement) == (mb.sequence_ids, mb.placement)
        k = len(mb.distributed_ids)
        one = _time(mb, lengths, cp, model)
        best = (
            min(
                _time(MicroBatchPlan(mb.sequence_ids, mb.placement, p), lengths, cp, model)
                for p in _partitions(k)
                if len(p) <= MAX_KV_GROUPS
            )
            if k
            else one
        )
        got = _time(chosen, lengths, cp, model)
        assert got <= one * (1 + 1e-12)  # never slower than one group
        # Within the search tolerance of the best partition (a span tolerance, so the time
        # tolerance is at most the same fraction).
        assert got <= best * (1 + SPAN_TOLERANCE)
        if chosen.kv_groups:
            grouped += 1
            assert got < one * (1 - SPAN_TOLERANCE / 2)  # groups only where they pay
    assert grouped > 20  # the cases exercise the pipeline


def test_chooser_keeps_one_group_when_local_attention_hides_the_exchange() -> None:
    # One long local sequence per rank: its attention outlasts the small exchange.
    cp = 2
    lengths = [20_000, 20_000, 500, 600]
    mb = MicroBatchPlan((0, 1, 2, 3), (0, 1, DISTRIBUTED, DISTRIBUTED))
    assert choose_kv_groups(mb, SequenceCosts(lengths, cp, EXPOSED)) is mb
    # Nothing or one sequence distributed: nothing to cut.
    for placement in ((0, 1, 0, 1), (0, 1, DISTRIBUTED, 0)):
        single = MicroBatchPlan((0, 1, 2, 3), placement)
        assert choose_kv_groups(single, SequenceCosts(lengths, cp, EXPOSED)) is single


def test_planner_groups_only_the_cost_aware_policies() -> None:
    rng = random.Random(3)
    lengths = [rng.randint(20_000, 90_000) for _ in range(24)]
    kw = dict(dp_size=2, cp_size=8, bucket_size=26_000, cost_model=EXPOSED)
    for policy in ("skrull", "dacp"):
        plan = plan_global_batch(lengths, policy=policy, **kw)
        assert any(mb.kv_groups for r in plan.micro_batches for mb in r)
    for policy in ("static", "sorted", "round_robin"):
        plan = plan_global_batch(lengths, policy=policy, **kw)
        assert not any(mb.kv_groups for r in plan.micro_batches for mb in r)


def _primal_by_vertices(excess: float, options: list[tuple[float, float]]) -> float:
    """The relaxation's minimum: its vertices have at most one fractional choice."""

    def value(x: list[float]) -> float:
        added = sum(xi * a for xi, (a, _) in zip(x, options))
        return added + max(0.0, excess + sum(xi * b for xi, (_, b) in zip(x, options)))

    best = float("inf")
    for bits in itertools.product((0.0, 1.0), repeat=len(options)):
        x = list(bits)
        best = min(best, value(x))
        for i, (_, b) in enumerate(options):
            if b != 0.0:
                rest = excess + sum(x[j] * options[j][1] for j in range(len(x)) if j != i)
                xi = -rest / b
                if 0.0 < xi < 1.0:
                    best = min(best, value([*x[:i], xi, *x[i + 1 :]]))
    return best


def test_least_exposed_solves_the_relaxation_exactly() -> None:
    rng = random.Random(11)
    for _ in range(1_500):
        options = [
            (rng.uniform(-2, 2), rng.choice([0.0, rng.uniform(-2, 2)]))
            for _ in range(rng.randint(0, 6))
        ]
        excess = rng.uniform(-3, 3)
        # Float summation orders differ; values are O(10).
        assert _least_exposed(excess, options) == pytest.approx(
            _primal_by_vertices(excess, options), abs=1e-12
        )


def test_bound_stays_below_pipelined_plans_of_long_sequences() -> None:
    # Long-sequence batches where nearly every micro-batch is grouped: the bound must let
    # the distributed attention hide communication, or these plans would beat it.
    rng = random.Random(5)
    grouped = 0
    for _ in range(10):
        lengths = [rng.randint(5_000, 100_000) for _ in range(32)]
        for model in (EXPOSED, CostModel(), CostModel(comm_bandwidth=20e9)):
            kw = dict(dp_size=2, cp_size=8, bucket_size=26_000, cost_model=model)
            plan = plan_global_batch(lengths, **kw)
            grouped += sum(1 for r in plan.micro_batches for mb in r if mb.kv_groups)
            assert simulate(plan, lengths, model) >= lower_bound(lengths, **kw) * (1 - 1e-9)
    assert grouped > 50
