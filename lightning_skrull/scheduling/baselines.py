"""Baseline policies the paper compares Skrull against, and the data-order micro-batching.

* ``static``: every sequence distributed over the CP group; DP rank ``d`` takes sequences
  ``d, d + dp, d + 2 dp, ...`` (what a ``DistributedSampler`` gives) and fills micro-batches in
  that order up to the per-rank token budget. DeepSpeed-style static CP with packing.
* ``static_unpacked`` (not a planner policy; used by the benchmark): the same with one sequence
  per micro-batch, the paper's DeepSpeed baseline as we read it.
* ``sorted``: LongAlign sorted batching. The global batch is sorted by length and cut into
  ``dp`` runs of neighbours (as equal in count as possible, the first runs one longer), DP rank
  ``d`` takes run ``d`` and packs it into micro-batches up to the budget (all distributed).
  LongAlign shuffles its batches; inside one global batch that order does not change the time,
  so the planner deals them deterministically.
* ``round_robin``: the paper's Algorithm 4 on data-order micro-batches: shortest first, each
  sequence local on the rank with most free tokens, else distributed, else the corrected
  roll-back.
* ``dacp``: cost-aware DACP on data-order micro-batches (no GDS).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_skrull.scheduling.dacp_greedy import CpGroupState
from lightning_skrull.scheduling.gds import Placer
from lightning_skrull.scheduling.plan import DISTRIBUTED, MicroBatchPlan, shard_tokens
from lightning_skrull.scheduling.sequence_costs import SequenceCosts, ascending


def data_order_ranks(n: int, dp_size: int) -> list[list[int]]:
    """Sequence ids of each DP rank in data order, dealt like a ``DistributedSampler``."""
    return [list(range(rank, n, dp_size)) for rank in range(dp_size)]


def pack_distributed(
    ids: Sequence[int], lengths: Sequence[int], cp_size: int, bucket_size: int
) -> list[MicroBatchPlan]:
    """Fill micro-batches in the given order, every sequence distributed, up to the budget."""
    plans: list[MicroBatchPlan] = []
    current: list[int] = []
    used = 0
    for sid in ids:
        shard = shard_tokens(lengths[sid], cp_size)
        if current and used + shard > bucket_size:
            plans.append(
                MicroBatchPlan(tuple(current), (DISTRIBUTED,) * len(current), cp_size=cp_size)
            )
            current, used = [], 0
        current.append(sid)
        used += shard
    if current:
        plans.append(MicroBatchPlan(tuple(current), (DISTRIBUTED,) * len(current), cp_size=cp_size))
    return plans


def plan_static(
    lengths: Sequence[int], dp_size: int, cp_size: int, bucket_size: int
) -> list[list[MicroBatchPlan]]:
    """Static CP with packing: all distributed, data-order micro-batches."""
    return [
        pack_distributed(ids, lengths, cp_size, bucket_size)
        for ids in data_order_ranks(len(lengths), dp_size)
    ]


def plan_static_unpacked(
    lengths: Sequence[int], dp_size: int, cp_size: int = 0
) -> list[list[MicroBatchPlan]]:
    """Static CP, one sequence per micro-batch (the paper's DeepSpeed baseline)."""
    return [
        [MicroBatchPlan((sid,), (DISTRIBUTED,), cp_size=cp_size) for sid in ids]
        for ids in data_order_ranks(len(lengths), dp_size)
    ]


def plan_sorted(
    lengths: Sequence[int], dp_size: int, cp_size: int, bucket_size: int
) -> list[list[MicroBatchPlan]]:
    """LongAlign sorted batching: sort, give each DP rank a run of neighbours, pack them."""
    order = ascending(range(len(lengths)), lengths)
    base, extra = divmod(len(order), dp_size)
    ranks: list[list[MicroBatchPlan]] = []
    start = 0
    for rank in range(dp_size):
        stop = start + base + (1 if rank < extra else 0)
        ranks.append(pack_distributed(order[start:stop], lengths, cp_size, bucket_size))
        start = stop
    return ranks


def place_round_robin(
    ids: Sequence[int], costs: SequenceCosts, bucket_size: int
) -> tuple[int, ...] | None:
    """The paper's Algorithm 4 (with the corrected roll-back) for one micro-batch."""
    lengths = costs.lengths
    state = CpGroupState(costs, bucket_size)
    for sid in ascending(ids, lengths):
        while True:
            rank = max(range(costs.cp_size), key=lambda r: (state.room(r), -r))
            if state.room(rank) >= lengths[sid]:
                state.put_local(sid, rank)
                break
            if state.can_distribute(sid):
                state.put_distributed(sid)
                break
            if not state.roll_back():
                return None
    return state.placement(ids)


def split_data_order(
    ids: Sequence[int], costs: SequenceCosts, bucket_size: int, place: Placer
) -> list[MicroBatchPlan]:
    """Fill micro-batches in data order up to the group's tokens, each placed by ``place``.

    A micro-batch that ``place`` rejects gives its last sequence back to the next one.
    """
    lengths = costs.lengths
    capacity = costs.cp_size * bucket_size
    plans: list[MicroBatchPlan] = []
    pending = list(ids)
    while pending:
        take, used = 0, 0
        while take < len(pending) and used + lengths[pending[take]] <= capacity:
            used += lengths[pending[take]]
            take += 1
        take = max(take, 1)  # a sequence over C * N is rejected before planning
        while True:
            group = pending[:take]
            placement = place(group, costs, bucket_size)
            if placement is not None:
                break
            if take == 1:  # pragma: no cover - a single sequence always fits
                raise AssertionError(f"sequence {group[0]} does not fit alone")
            take -= 1
        plans.append(MicroBatchPlan(tuple(group), placement, cp_size=costs.cp_size))
        pending = pending[take:]
    return plans


def plan_data_order(
    n: int, dp_size: int, costs: SequenceCosts, bucket_size: int, place: Placer
) -> list[list[MicroBatchPlan]]:
    """Data-order micro-batches on every DP rank, placed by ``place``."""
    return [
        split_data_order(ids, costs, bucket_size, place) for ids in data_order_ranks(n, dp_size)
    ]
