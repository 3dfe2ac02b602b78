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

4. When every DP rank could hold its share in one micro-batch (and the batch has at most
   ``PlannerOptions.gather_max_sequences`` sequences), a second DP split is weighed:
   the sequences that will be sharded anyway (longer than the bucket, or costing more whole than
   a CP rank's mean share of the batch) packed onto as few DP ranks as their cost allows, the
   others balanced over all ranks. A sharded sequence occupies every CP rank of its micro-batch,
   leaving less room there for whole sequences; gathered on a few DP ranks, they leave the
   other ranks' CP ranks free for the medium sequences to stay whole, which elsewhere would be
   sharded and pay communication. Up to ``PlannerOptions.plan_both_max_sequences`` sequences both splits
   are planned and the faster is kept (the cost model's time of every micro-batch, K/V groups
   included; the balanced one on ties), so step 4 never makes a plan slower there. Above, only
   the split with the lower quick estimate
   (:func:`~lightning_skrull.scheduling.dacp.estimate_micro_batch` of each rank) is planned,
   and the second one only when its sharded sequences leave a DP rank free (the estimate is
   within about 10% of the plan's time, too coarse where they need every rank); if it then
   needs more than one micro-batch on a rank, the first is planned instead.

5. Where communication is slow and memory tight, each DP rank's micro-batches are also dealt in
   rows (:func:`deal_rows`) and the faster is kept. A micro-batch filled to its token budget
   leaves no CP rank room for a whole sequence next to the shards, so DACP must shard everything
   and the K/V exchange lies on every rank's critical path. Dealt in rows of ``cp_size``
   sequences of similar length (one per CP rank), over the same number of micro-batches and up
   to ``PlannerOptions.rows_extra_micro_batches`` more, a row can stay whole, balanced over the CP ranks,
   and its local attention hides the exchange of the sequences sharded next to it. Tried only
   where the rank's fullest micro-batch holds at least ``PlannerOptions.rows_min_fill`` of its token budget
   and its communication is at least ``PlannerOptions.rows_comm_share`` of the least it can take
   (elsewhere the rows won rarely and little: see those fields); kept only when the cost
   model's time of the rank's micro-batches (K/V groups included) is lower, so it never makes a
   rank slower.

The printed loop of the paper never exits on success; this one stops at the first ``m`` that
works. It always terminates: with one sequence per micro-batch every sequence fits, since none
is longer than ``cp_size * bucket_size`` (checked before planning).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

from lightning_skrull.scheduling.dacp import estimate_micro_batch
from lightning_skrull.scheduling.kv_groups import choose_kv_groups, one_group
from lightning_skrull.scheduling.options import DEFAULT_OPTIONS, PlannerOptions
from lightning_skrull.scheduling.plan import DISTRIBUTED, MicroBatchPlan, Placement
from lightning_skrull.scheduling.sequence_costs import SequenceCosts, ascending, descending
from lightning_skrull.scheduling.simulate import micro_batch_terms

Placer = Callable[[Sequence[int], SequenceCosts, int], "tuple[Placement, ...] | None"]


def balance_dp(ids: Sequence[int], dp_size: int, costs: SequenceCosts) -> list[list[int]]:
    """Balance whole sequences over DP ranks by estimated work (LPT, deterministic ties)."""
    work = costs.local_table
    order = descending(ids, work)  # equal work keeps ascending ids
    heap = [(0.0, rank) for rank in range(dp_size)]  # (work so far, rank): ties -> lowest rank
    bins: list[list[int]] = [[] for _ in range(dp_size)]
    for sid in order:
        load, rank = heap[0]
        bins[rank].append(sid)
        heapq.heapreplace(heap, (load + work[sid], rank))
    return bins


def gather_sharded(
    ids: Sequence[int],
    dp_size: int,
    costs: SequenceCosts,
    bucket_size: int,
    *,
    need_free_rank: bool = True,
) -> list[list[int]] | None:
    """The DP split of step 4 (module docstring), or ``None`` when there is none to weigh.

    A sequence is *sharded anyway* when it is longer than ``bucket_size`` or its whole-rank cost
    exceeds the batch's mean per CP rank (``sum / (dp_size * cp_size)``); it weighs
    ``cp_size * (distributed compute + communication)``, the others their whole-rank cost. The
    sharded ones, heaviest first, go to the first DP rank that stays within the mean weight per
    DP rank and within one micro-batch's tokens (``cp_size * bucket_size``), else to the least
    loaded; then the others, heaviest first, to the least loaded rank with tokens to spare (LPT).

    Args:
        need_free_rank: decline when the sharded ones would need every DP rank (their weight
            over ``dp_size - 1`` ranks' share); off where both splits are planned and compared.

    Returns:
        One list of ids per DP rank, or ``None`` when ``dp_size`` is 1, when no sequence or every
        sequence is sharded anyway, when ``need_free_rank`` declines, or when a rank ends over
        one micro-batch's tokens.
    """
    if dp_size < 2:
        return None
    n, lengths, whole = costs.cp_size, costs.lengths, costs.local_table
    per_token = costs.comm_per_token
    mean_rank = sum(whole[i] for i in ids) / (dp_size * n)
    weight: dict[int, float] = {}
    sharded: list[int] = []
    kept: list[int] = []
    for sid in sorted(ids):
        if lengths[sid] > bucket_size or whole[sid] > mean_rank:
            weight[sid] = n * (costs.distributed(sid) + per_token * lengths[sid])
            sharded.append(sid)
        else:
            weight[sid] = whole[sid]
            kept.append(sid)
    if not sharded or not kept:
        return None
    share = sum(weight.values()) / dp_size
    if need_free_rank and sum(weight[sid] for sid in sharded) > (dp_size - 1) * share:
        return None
    capacity = n * bucket_size
    bins: list[list[int]] = [[] for _ in range(dp_size)]
    load = [0.0] * dp_size
    tokens = [0] * dp_size
    for sid in sorted(sharded, key=lambda i: (-weight[i], i)):
        w, s = weight[sid], lengths[sid]
        rank = next(
            (r for r in range(dp_size) if load[r] + w <= share and tokens[r] + s <= capacity),
            -1,
        )
        if rank < 0:
            rank = min(range(dp_size), key=load.__getitem__)
        bins[rank].append(sid)
        load[rank] += w
        tokens[rank] += s
    heap = [(load[r], r) for r in range(dp_size)]  # (load, rank): ties -> lowest rank
    heapq.heapify(heap)
    for sid in sorted(kept, key=lambda i: (-weight[i], i)):
        s = lengths[sid]
        full = []
        while heap and tokens[heap[0][1]] + s > capacity:
            full.append(heapq.heappop(heap))
        if not heap:
            return None
        w, rank = heap[0]
        bins[rank].append(sid)
        tokens[rank] += s
        heapq.heapreplace(heap, (w + weight[sid], rank))
        for item in full:
            heapq.heappush(heap, item)
    if max(tokens) > capacity:  # a sharded one went over, to the least loaded rank
        return None
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


def deal_rows(
    mine: Sequence[int], m: int, lengths: Sequence[int], cp_size: int, bucket_size: int
) -> list[list[int]]:
    """Deal ``mine`` into ``m`` groups in rows (GDS step 5, module docstring).

    The sequences that fit one CP rank whole, longest first, are cut into rows of ``cp_size``
    (the last may be shorter); each row, then each longer sequence, goes to the group with the
    fewest tokens so far (lowest index on ties). Every group comes out ascending, as the other
    deals'.
    """
    order = descending(mine, lengths)
    whole = [sid for sid in order if lengths[sid] <= bucket_size]
    items = [whole[k : k + cp_size] for k in range(0, len(whole), cp_size)]
    items += [[sid] for sid in order if lengths[sid] > bucket_size]
    groups: list[list[int]] = [[] for _ in range(m)]
    heap = [(0, g) for g in range(m)]  # (tokens so far, group): ties -> lowest group
    for item in items:
        tokens, g = heap[0]
        groups[g].extend(item)
        heapq.heapreplace(heap, (tokens + sum(lengths[sid] for sid in item), g))
    return [ascending(g, lengths) for g in groups]


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
        plans.append(MicroBatchPlan(tuple(group), placement, cp_size=costs.cp_size))
    return plans


def split_micro_batches(
    ids: Sequence[int],
    costs: SequenceCosts,
    bucket_size: int,
    place: Placer,
    options: PlannerOptions = DEFAULT_OPTIONS,
) -> list[MicroBatchPlan]:
    """Deal one DP rank's sequences into the fewest micro-batches that ``place`` accepts:
    strided, or dealt by tokens where the strided deal does not fit (module docstring)."""
    if not ids:
        return []
    lengths = costs.lengths
    mine = ascending(ids, lengths)
    capacity = costs.cp_size * bucket_size
    total = sum(lengths[i] for i in mine)
    m = max(1, -(-total // capacity))
    while True:
        strided = [mine[i::m] for i in range(m)]
        plans = _place_all(strided, costs, bucket_size, place)
        if plans is not None:
            return plans
        dealt = deal_by_tokens(mine, m, lengths) if options.gds_deal_by_tokens else strided
        if sorted(dealt) != sorted(strided):  # not the same micro-batches in another order
            plans = _place_all(dealt, costs, bucket_size, place)
            if plans is not None:
                return plans
        if m >= len(mine):  # pragma: no cover - one sequence per micro-batch always fits
            raise AssertionError(
                f"no split of {len(mine)} sequences fits; planner invariant broken"
            )
        m += 1


def rows_if_faster(
    plans: list[MicroBatchPlan],
    costs: SequenceCosts,
    bucket_size: int,
    place: Placer,
    options: PlannerOptions = DEFAULT_OPTIONS,
) -> list[MicroBatchPlan]:
    """GDS step 5 on one DP rank's micro-batches: the rows dealt (:func:`deal_rows`) into as
    many micro-batches and up to ``PlannerOptions.rows_extra_micro_batches`` more, where they are faster
    (module docstring); ``plans`` itself otherwise."""
    n, lengths, distributed = costs.cp_size, costs.lengths, costs.distributed
    if n < 2 or not options.gds_rows:
        return plans
    # A few operations per sequence (the exact time of the micro-batches took a tenth of the
    # planning budget at DP=64 x CP=16): the fullest micro-batch's tokens, then its communication
    # against the least it can take (overhead, communication and distributed compute), which
    # bounds its exposed communication's share from above (the whole group's exchange; block
    # sequences, which exchange over their blocks only, are left out).
    tokens = [sum(map(lengths.__getitem__, mb.sequence_ids)) for mb in plans]
    if not tokens or max(tokens) < options.rows_min_fill * n * bucket_size:
        return plans
    fullest = plans[tokens.index(max(tokens))]
    placed = zip(fullest.sequence_ids, fullest.placement, strict=True)
    dist = [sid for sid, where in placed if where == DISTRIBUTED]
    comm = costs.comm(sum(map(lengths.__getitem__, dist)))
    floor = costs.cost_model.micro_batch_overhead_s + comm + sum(map(distributed, dist))
    if comm < options.rows_comm_share * floor:
        return plans
    mine = sorted(sid for mb in plans for sid in mb.sequence_ids)
    best = _rank_seconds(plans, costs, options)
    previous = math.inf
    for m in range(len(plans), min(len(plans) + options.rows_extra_micro_batches, len(mine)) + 1):
        groups = deal_rows(mine, m, lengths, n, bucket_size)
        if not all(groups):  # fewer rows than micro-batches: no empty micro-batch is planned
            break
        other = _place_all(groups, costs, bucket_size, place)
        if other is None:
            continue
        seconds = _rank_seconds(other, costs, options)
        if seconds < best:
            best, plans = seconds, other
        if seconds >= previous:  # one more micro-batch did not help: more will not either
            break
        previous = seconds
    return plans


def with_kv_groups(
    mb: MicroBatchPlan, costs: SequenceCosts, options: PlannerOptions
) -> MicroBatchPlan:
    """``mb`` with its K/V groups chosen, or one group when ``options`` switches them off."""
    return choose_kv_groups(mb, costs) if options.kv_groups else one_group(mb)


def _micro_batch_seconds(mb: MicroBatchPlan, costs: SequenceCosts) -> float:
    """Seconds of a micro-batch with the K/V groups it has."""
    return micro_batch_terms(mb, costs, costs.cost_model).seconds


def plan_gds(
    n: int,
    dp_size: int,
    costs: SequenceCosts,
    bucket_size: int,
    place: Placer,
    options: PlannerOptions = DEFAULT_OPTIONS,
) -> list[list[MicroBatchPlan]]:
    """GDS over all ``n`` sequences of the global batch with the given CP placement: the
    balanced DP split, or the gathered one where step 4 weighs it and it wins; then step 5 on
    every DP rank, and the K/V groups of every micro-batch."""
    ranks = _split_and_deal(n, dp_size, costs, bucket_size, place, options)
    return [
        [
            with_kv_groups(mb, costs, options)
            for mb in rows_if_faster(r, costs, bucket_size, place, options)
        ]
        for r in ranks
    ]


def _split_and_deal(
    n: int,
    dp_size: int,
    costs: SequenceCosts,
    bucket_size: int,
    place: Placer,
    options: PlannerOptions,
) -> list[list[MicroBatchPlan]]:
    """GDS steps 1-4 (module docstring)."""

    def planned(split: list[list[int]]) -> list[list[MicroBatchPlan]]:
        return [split_micro_batches(b, costs, bucket_size, place, options) for b in split]

    bins = balance_dp(range(n), dp_size, costs)
    if (
        options.gds_gather
        and n <= options.gather_max_sequences
        and sum(costs.lengths) <= dp_size * costs.cp_size * bucket_size
    ):
        both = n <= options.plan_both_max_sequences
        gathered = gather_sharded(range(n), dp_size, costs, bucket_size, need_free_rank=not both)
        if gathered is not None and both:
            ranks, balanced = planned(gathered), planned(bins)
            faster = _seconds(ranks, costs, options) < _seconds(balanced, costs, options)
            return ranks if faster else balanced
        if gathered is not None and _estimate(gathered, costs, bucket_size) < _estimate(
            bins, costs, bucket_size
        ):
            ranks = planned(gathered)
            if all(len(r) <= 1 for r in ranks):
                return ranks
    return planned(bins)


def _seconds(
    ranks: Sequence[Sequence[MicroBatchPlan]], costs: SequenceCosts, options: PlannerOptions
) -> float:
    """The slowest DP rank of planned micro-batches, each with the K/V groups it will get."""
    return max(_rank_seconds(r, costs, options) for r in ranks)


def _rank_seconds(
    plans: Sequence[MicroBatchPlan], costs: SequenceCosts, options: PlannerOptions
) -> float:
    """Seconds of one DP rank's micro-batches, each with the K/V groups it will get."""
    return sum(_micro_batch_seconds(with_kv_groups(mb, costs, options), costs) for mb in plans)


def _estimate(bins: Sequence[Sequence[int]], costs: SequenceCosts, bucket_size: int) -> float:
    """The slowest DP rank of a split, each rank estimated as one micro-batch."""
    return max(estimate_micro_batch(b, costs, bucket_size) for b in bins)
