"""The fast DACP, with every step beyond the paper off, against the readable reference."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_skrull.scheduling import CostModel, MicroBatchPlan
from lightning_skrull.scheduling.dacp import place_micro_batch
from lightning_skrull.scheduling.dacp_reference import place_micro_batch_reference
from lightning_skrull.scheduling.options import PlannerOptions
from lightning_skrull.scheduling.sequence_costs import SequenceCosts
from lightning_skrull.scheduling.shapes import QWEN2_5_0_5B, QWEN2_5_7B

PAPER = PlannerOptions.paper()
MODELS = [
    CostModel(shape=shape, comm_bandwidth=bandwidth, comm_latency_s=latency)
    for shape in (QWEN2_5_0_5B, QWEN2_5_7B)
    for bandwidth in (100e9, 5e9)
    for latency in (0.0, 20e-6)
]


@st.composite
def micro_batches(draw: st.DrawFn) -> tuple[list[int], int, int, CostModel]:
    cp_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    bucket = draw(st.sampled_from([16, 100, 1000, 13_000]))
    # Lengths up to twice the bucket (some must be sharded), many short ones, many ties.
    length = st.one_of(
        st.integers(1, 2 * bucket), st.integers(1, max(1, bucket // 8)), st.sampled_from([1, 7])
    )
    lengths = draw(st.lists(length, min_size=0, max_size=3 * cp_size + 4))
    return lengths, cp_size, bucket, draw(st.sampled_from(MODELS))


@settings(max_examples=1500, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(micro_batches())
def test_fast_dacp_without_the_steps_beyond_the_paper_is_the_reference(case) -> None:
    lengths, cp_size, bucket, model = case
    lengths = [min(s, cp_size * bucket) for s in lengths]
    costs = SequenceCosts(lengths, cp_size, model)
    ids = list(range(len(lengths)))
    fast = place_micro_batch(ids, costs, bucket, PAPER)
    reference = place_micro_batch_reference(ids, costs, bucket)
    # Both add and remove the same per-sequence seconds in the same order, so ties break the
    # same way and the placements are equal, not only their estimated times (exact: 0 of
    # 1500 cases differed).
    assert fast == reference
    if fast is not None:
        mb = MicroBatchPlan(tuple(ids), fast)
        assert max(mb.tokens_per_cp_rank(lengths, cp_size)) <= bucket


def test_the_reference_rolls_back_the_sequence_that_frees_most() -> None:
    # Two ranks of 110 tokens, shortest first: 20 on rank 0, 70 on rank 1; 100 fits no rank
    # whole and its 50-token shard not beside the 70, so the 70 is rolled back (it frees 35,
    # the 20 only 10) and the 100 is sharded next to the 20 (20 + 35 + 50 = 105 tokens).
    lengths = [20, 70, 100]
    costs = SequenceCosts(lengths, 2, CostModel())
    assert place_micro_batch_reference(range(3), costs, 110) == (0, -1, -1)
    # With 90 tokens even all three sharded (10 + 35 + 50) overflow: nothing fits.
    assert place_micro_batch_reference(range(3), costs, 90) is None
