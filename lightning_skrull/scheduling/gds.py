"""GDS: split a global batch over DP ranks and into micro-batches (the paper's Algorithm 2).

1. Whole sequences are balanced over DP ranks by estimated time: longest work first, each to
   the DP rank with the least estimated work so far (LPT). A sequence never spans DP ranks.
2. On each DP rank, sequences sorted ascending are dealt into ``m`` strided micro-batches
   (micro-batch ``i`` gets ``my[i::m]``), so each mixes short and long sequences. ``m`` starts at
   the fewest micro-batches whose token budget ``m * cp_size * bucket_size`` could hold the rank's
   tokens and grows by one until every micro-batch fits and DACP places it.
3. When the strided deal at ``m`` does not fit (or DACP cannot place it), the same ``m`` is
   tried once more with the sequences dealt by tokens (longest first, each to the micro-batch
   with the fewest tokens so far) before ``m`` grows. The strided deal gives the micro-batch that
   gets the longest sequence the longest of every stride too, so with a few sequences near the
   group's capacity it needed up to one micro-batch per sequence, each paying the fixed cost of
   a micro-batch.

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


def deal_by_tokens(mine: Sequence[int], m: int, lengths: Sequence[int]) -> list[list[int]]:
    """Deal ascending ``mine`` into ``m`` groups: longest first, each to the group with the fewest
    tokens so far (lowest index on ties); every group ascending, as the strided deal's are."""
    groups: list[list[int]] = [[] for _ in range(m)]
    heap = [(0, g) for g in range(m)]  # (tokens so far, group): ties -> lowest group
    for sid in reversed(mine):
        tokens, g = heap[0]
        groups[g].append(sid)
        heapq.heapreplace(heap, (tokens + lengths[sid], g))
    for group in groups:
        group.reverse()
    return groups


def _place_all(
    groups: list[list[int]], costs: SequenceCosts, bucket_size: int, place: Placer
) -> list[MicroBatchPlan] | None:
    """The micro-batches of ``groups``, or ``None`` when one overflows or ``place`` refuses it."""
    lengths = costs.lengths
    capacity = costs.cp_size * bucket_size
    if any(sum(lengths[i] for i in g) > capacity for g in groups):
        return None
    plans = []
    for group in groups:
        placement = place(group, costs, bucket_size)
        if placement is None:
            return None
        plans.append(MicroBatchPlan(tuple(group), placement))
    return plans


def split_micro_batches(
    ids: Sequence[int], costs: SequenceCosts, bucket_size: int, place: Placer
) -> list[MicroBatchPlan]:
    """Deal one DP rank's sequences into the fewest micro-batches that ``place`` accepts:
    strided, or dealt by tokens where the strided deal does not fit (module docstring)."""
    if not ids:
        return []
    lengths = costs.lengths
    mine = sorted(ids, key=lambda i: (lengths[i], i))
    capacity = costs.cp_size * bucket_size
    total = sum(lengths[i] for i in mine)
    m = max(1, -(-total // capacity))
    while True:
        strided = [mine[i::m] for i in range(m)]
        plans = _place_all(strided, costs, bucket_size, place)
        if plans is not None:
            return plans
        dealt = deal_by_tokens(mine, m, lengths)
        if sorted(dealt) != sorted(strided):  # not the same micro-batches in another order
            plans = _place_all(dealt, costs, bucket_size, place)
            if plans is not None:
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
    return [split_micro_batches(b, costs, bucket_size, place) for b in bins]
