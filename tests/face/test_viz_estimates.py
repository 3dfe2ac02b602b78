"""plot_plan labels micro-batches and DP ranks with the cost model's estimate when given one."""

from __future__ import annotations

import pytest

from lightning_skrull.scheduling import CostModel, dp_rank_seconds
from lightning_skrull.scheduling.plan import GlobalBatchPlan, MicroBatchPlan
from lightning_skrull.viz import format_seconds, plot_plan


def test_labels_carry_the_estimates_simulate_adds_up() -> None:
    lengths = [900, 30, 4000, 70, 500]
    plan = GlobalBatchPlan(
        (
            (MicroBatchPlan((0, 1), (0, 1)), MicroBatchPlan((2,), (-1,))),
            (MicroBatchPlan((3, 4), (1, 0)),),
        ),
        dp_size=2,
        cp_size=2,
        bucket_size=2048,
        policy="skrull",
    )
    model = CostModel()
    fig = plot_plan(plan, lengths, cost_model=model)
    top, bottom = fig.axes
    # Independent reference: the micro-batch times from the cost model, one by one.
    mb_times = [model.micro_batch_seconds(mb, lengths, 2) for mb in plan.micro_batches[0]]
    labels = [t.get_text() for t in top.get_xticklabels()]
    assert labels == [f"mb {m}\n{format_seconds(t)}" for m, t in enumerate(mb_times)]
    # The DP rank's label is the sum that dp_rank_seconds (what simulate maximises) reports.
    per_rank = dp_rank_seconds(plan, lengths, model)
    assert per_rank[0] == pytest.approx(sum(mb_times), rel=1e-12)
    assert top.get_ylabel().startswith(f"DP 0, est. {format_seconds(per_rank[0])}")
    assert bottom.get_ylabel().startswith(f"DP 1, est. {format_seconds(per_rank[1])}")
    # Without a cost model the labels stay plain.
    plain = plot_plan(plan, lengths)
    assert [t.get_text() for t in plain.axes[0].get_xticklabels()] == ["mb 0", "mb 1"]


def test_format_seconds_picks_the_unit() -> None:
    assert format_seconds(0.00085) == "850 us"
    assert format_seconds(0.0125) == "12.5 ms"
    assert format_seconds(3.2) == "3.20 s"
