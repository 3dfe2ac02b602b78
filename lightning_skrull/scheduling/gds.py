"""GDS: split a global batch over DP ranks and into micro-batches (the paper's Algorithm 2).

1. Whole sequences are balanced over DP ranks by estimated time: longest work first, each to
   the DP rank with the least estimated work so far (LPT). A sequence never spans DP ranks.
2. On each DP rank, sequences sorted ascending are dealt into ``m`` strided micro-batches
   (micro-batch ``i`` gets ``my[i::m]``), so each mixes short and long sequences. ``m`` starts at
   the fewest micro-batches whose token budget ``m * cp_size * bucket_size`` could hold the rank's
   tokens and grows by one until every micro-batch fits and DACP places it.

The printed loop of the paper never exits on success; this one stops at the first ``m`` that
works. It always terminates: with one sequence per micro-batch every sequence fits, since none
is longer than ``cp_size * bucket_size`` (checked before planning).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from lightning_skrull.scheduling.costs import SequenceCosts
from lightning_skrull.scheduling.plan import MicroBatchPlan

Placer = Callable[[Sequence[int], SequenceCosts, int], "tuple[int, ...] | None"]


def balance_dp(ids: Sequence[int], dp_size: int, costs: SequenceCosts) -> list[list[int]]:
    """Balance whole sequences over DP ranks by estimated work (LPT, deterministic ties)."""
    work = costs.local_table
    # Descending work; the sort is stable, so equal work keeps ascending ids.
    order = sorted(sorted(ids), key=work.__getitem__, reverse=True)
    heap = [(0.0, rank) for rank in range(dp_size)]  # (work so far, rank): ties -> lowest rank
    bins: list[list[int]] = [[] for _ in range(dp_size)]
    for sid in order:
        load, rank = heap[0]
        bins[rank].append(sid)
        heapq.heapreplace(heap, (load + work[sid], rank))
    return bins


def split_strided(
    ids: Sequence[int], costs: SequenceCosts, bucket_size: int, place: Placer
) -> list[MicroBatchPlan]:
    """Deal one DP rank's sequences into the fewest strided micro-batches that ``place`` accepts."""
    if not ids:
        return []
    lengths = costs.lengths
    mine = sorted(ids, key=lambda i: (lengths[i], i))
    capacity = costs.cp_size * bucket_size
    total = sum(lengths[i] for i in mine)
    m = max(1, -(-total // capacity))
    while True:
        groups = [mine[i::m] for i in range(m)]
        if all(sum(lengths[i] for i in g) <= capacity for g in groups):
            plans = []
            for group in groups:
                placement = place(group, costs, bucket_size)
                if placement is None:
                    break
                plans.append(MicroBatchPlan(tuple(group), placement))
            else:
                return plans
        if m >= len(mine):  # pragma: no cover - one sequence per micro-batch always fits
            raise AssertionError(
                f"no split of {len(mine)} sequences fits; planner invariant broken"
            )
        m += 1


def plan_gds(
    n: int, dp_size: int, costs: SequenceCosts, bucket_size: int, place: Placer
) -> list[list[MicroBatchPlan]]:
    """GDS over all ``n`` sequences of the global batch with the given CP placement."""
    bins = balance_dp(range(n), dp_size, costs)
    return [split_strided(b, costs, bucket_size, place) for b in bins]
