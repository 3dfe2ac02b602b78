"""plot_plan draws what the plan says."""

from __future__ import annotations

import pytest

from lightning_skrull.scheduling.plan import GlobalBatchPlan, MicroBatchPlan
from lightning_skrull.viz import plot_plan


def _plan() -> tuple[GlobalBatchPlan, list[int]]:
    lengths = [10, 3, 40, 7]
    mbs = (
        (MicroBatchPlan((0, 1, 2), (0, 1, -1)),),
        (MicroBatchPlan((3,), (1,)),),
    )
    return GlobalBatchPlan(mbs, dp_size=2, cp_size=2, bucket_size=40, policy="skrull"), lengths


def test_plot_plan_draws_one_bar_per_local_sequence_and_per_rank_shard(tmp_path) -> None:
    plan, lengths = _plan()
    fig = plot_plan(plan, lengths)
    axes = fig.axes
    assert len(axes) == 2
    # DP 0: two local sequences + one distributed sequence drawn on both CP ranks = 4 bars.
    heights0 = sorted(p.get_height() for p in axes[0].patches)
    assert heights0 == [3, 10, 20, 20]
    heights1 = [p.get_height() for p in axes[1].patches]
    assert heights1 == [7]
    # The stacked top of CP rank 0 in DP 0 is 10 + 20 tokens, under the 40-token budget line.
    tops = sorted(p.get_y() + p.get_height() for p in axes[0].patches)
    assert tops[-1] == 30
    out = tmp_path / "plan.png"
    fig.savefig(out)
    assert out.stat().st_size > 1000


def test_plot_plan_rejects_unknown_dp_rank() -> None:
    plan, lengths = _plan()
    with pytest.raises(ValueError, match=r"outside 0\.\.1"):
        plot_plan(plan, lengths, dp_ranks=[2])
