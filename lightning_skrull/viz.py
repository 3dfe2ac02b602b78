"""Draw a plan: CP ranks x micro-batches, local and distributed sequences.

Needs matplotlib (``pip install lightning-skrull[viz]``); imported lazily so the rest of the
package never depends on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning_skrull.scheduling.plan import (
    DISTRIBUTED,
    GlobalBatchPlan,
    rank_or_group,
    shard_tokens,
)

if TYPE_CHECKING:
    from lightning_skrull.scheduling.cost_model import CostModel


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "plot_plan needs matplotlib; install it with `pip install lightning-skrull[viz]`."
        ) from err
    return plt


def plot_plan(
    plan: GlobalBatchPlan,
    lengths: Sequence[int],
    *,
    dp_ranks: Sequence[int] | None = None,
    title: str | None = None,
    cost_model: CostModel | None = None,
) -> Any:
    """Draw one global batch's plan and return the matplotlib ``Figure``.

    One panel per DP rank. Inside a panel, micro-batches run left to right; each micro-batch is a
    group of ``cp_size`` bars, one per CP rank, stacked with the tokens that rank holds. Local
    sequences are solid boxes (a whole sequence on one rank); a distributed sequence is a hatched
    box of the same colour on every CP rank of its micro-batch (each rank holds about
    ``length / cp_size`` of it). The dashed line is the per-rank budget ``bucket_size``.

    Args:
        plan: the plan to draw.
        lengths: sequence lengths of the global batch (indexed by sequence id).
        dp_ranks: which DP ranks to draw (default: all).
        title: figure title (default: policy and sizes).
        cost_model: when given, every micro-batch is labelled with its estimated time and
            every DP rank with the sum of its micro-batches' (``CostModel.micro_batch_seconds``,
            the terms :func:`~lightning_skrull.scheduling.simulate` adds up).
    """
    plt = _pyplot()
    from matplotlib.patches import Patch

    ranks = list(range(plan.dp_size)) if dp_ranks is None else list(dp_ranks)
    for r in ranks:
        if not 0 <= r < plan.dp_size:
            raise ValueError(f"dp_ranks contains {r}, outside 0..{plan.dp_size - 1}.")
    n = plan.cp_size
    most_mbs = max([len(plan.micro_batches[r]) for r in ranks] + [1])
    fig, axes = plt.subplots(
        len(ranks),
        1,
        figsize=(max(6.0, 0.35 * n * most_mbs + 2), 2.2 * len(ranks) + 0.8),
        squeeze=False,
    )
    cmap = plt.get_cmap("tab20")
    for ax, dp_rank in zip(axes[:, 0], ranks):
        mbs = plan.micro_batches[dp_rank]
        for m, mb in enumerate(mbs):
            base = m * (n + 1)
            heights = [0.0] * n
            for sid, placed in zip(mb.sequence_ids, mb.placement):
                where = rank_or_group(placed)
                color = cmap(sid % 20)
                if where == DISTRIBUTED:
                    share = shard_tokens(lengths[sid], n)
                    for j in range(n):
                        ax.bar(
                            base + j,
                            share,
                            bottom=heights[j],
                            color=color,
                            hatch="///",
                            edgecolor="black",
                            linewidth=0.3,
                            width=0.9,
                        )
                        heights[j] += share
                else:
                    ax.bar(
                        base + where,
                        lengths[sid],
                        bottom=heights[where],
                        color=color,
                        edgecolor="black",
                        linewidth=0.3,
                        width=0.9,
                    )
                    heights[where] += lengths[sid]
        ax.axhline(plan.bucket_size, color="black", linestyle="--", linewidth=0.8)
        ticks = [m * (n + 1) + (n - 1) / 2 for m in range(len(mbs))]
        labels = [f"mb {m}" for m in range(len(mbs))]
        ylabel = f"DP {dp_rank}\ntokens / CP rank"
        if cost_model is not None:
            seconds = [cost_model.micro_batch_seconds(mb, lengths, n) for mb in mbs]
            labels = [f"{label}\n{format_seconds(t)}" for label, t in zip(labels, seconds)]
            ylabel = f"DP {dp_rank}, est. {format_seconds(sum(seconds))}\ntokens / CP rank"
        ax.set_xticks(ticks, labels)
        ax.set_ylabel(ylabel)
        ax.set_xlim(-1, max(most_mbs, 1) * (n + 1))
    axes[-1, 0].set_xlabel(f"micro-batches; each group = CP ranks 0..{n - 1}")
    fig.legend(
        handles=[
            Patch(facecolor="lightgray", edgecolor="black", label="local (whole on one rank)"),
            Patch(
                facecolor="lightgray",
                edgecolor="black",
                hatch="///",
                label="distributed (sharded over CP)",
            ),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, 0.95),
        ncol=2,
        fontsize="small",
        frameon=False,
    )
    fig.suptitle(title or f"{plan.policy}: DP={plan.dp_size} x CP={n}, bucket {plan.bucket_size}")
    fig.tight_layout(rect=(0, 0, 1, 0.88))
    return fig


def format_seconds(seconds: float) -> str:
    """``seconds`` in a short human unit (``"850 us"``, ``"12.5 ms"``, ``"3.20 s"``)."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"
