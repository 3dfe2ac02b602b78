"""DACP: place the sequences of one micro-batch on a CP group (local or distributed).

Cost-aware version of the paper's Algorithm 1. The paper only shards a sequence when memory
forces it; here a sequence is also sharded when that lowers the micro-batch's estimated time
(one long local sequence would leave the other CP ranks idle), kept local when sharding costs
more than it balances (tiny chunks waste attention tiles and every distributed token pays
communication), and moved between ranks when that lowers the slowest rank.

Steps, for a micro-batch of sequences and a CP group of ``N`` ranks with ``C`` tokens each:

1. Sequences longer than ``C`` must be distributed.
2. Longest first, each sequence goes whole to the least-loaded rank with room, or is
   distributed, whichever gives the lower look-ahead estimate of the finished micro-batch
   (slowest rank so far vs. mean rank time once everything left is placed). A sequence that
   fits no rank whole is distributed if every rank has room for its shard, else a local
   sequence is rolled back to distributed and the sequence retried.
3. Local search on the slowest rank: move one of its sequences to another rank, distribute
   one, or bring a distributed sequence back whole, whichever lowers the estimated time most;
   repeat until nothing helps (at most ``2n + N`` moves).
4. When step 2 sharded short sequences by choice and communication is a large share of the
   estimate, or those sequences waste a large share of it (tile waste and communication), a
   second construction decides all at once: shard the ``k`` longest, spread the others whole
   over the ranks (``k`` from a bound of the result). Step 2's one-at-a-time choice shards
   the first short sequence (keeping it whole raises the slowest rank more) and then every
   one after it, paying their communication; kept if faster, then step 3.
5. The same with the paper's rule in step 2 (shard only when memory forces it), kept if
   faster; skipped or abandoned when it cannot win (see :func:`place_micro_batch`).
6. With ``PlannerOptions.dacp_blocks``: the sequences may also go to aligned blocks of the
   CP group (:mod:`~lightning_skrull.scheduling.dacp_blocks`), kept if faster.

The greedy pass of step 2 (and of the paper's Algorithm 1) and the corrected roll-back are
:mod:`~lightning_skrull.scheduling.dacp_greedy`'s; steps 3 and 4 are
:mod:`~lightning_skrull.scheduling.dacp_refinements`'. This module composes them, each step
switched by :class:`~lightning_skrull.scheduling.options.PlannerOptions`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_skrull.scheduling.dacp_blocks import place_blocks
from lightning_skrull.scheduling.dacp_greedy import CpGroupState, greedy, tail_seconds
from lightning_skrull.scheduling.dacp_refinements import (
    improve,
    shard_waste,
    split_bound,
    split_longest,
)
from lightning_skrull.scheduling.options import DEFAULT_OPTIONS, PlannerOptions
from lightning_skrull.scheduling.plan import Placement
from lightning_skrull.scheduling.sequence_costs import SequenceCosts, ascending, descending


def place_micro_batch(
    ids: Sequence[int],
    costs: SequenceCosts,
    bucket_size: int,
    options: PlannerOptions = DEFAULT_OPTIONS,
) -> tuple[Placement, ...] | None:
    """Place one micro-batch with cost-aware DACP.

    Args:
        ids: sequence ids of the micro-batch (each no longer than ``cp_size * bucket_size``).
        costs: cost table of the global batch.
        bucket_size: token budget of one CP rank.
        options: which steps beyond the paper run (module docstring).

    Returns:
        One placement per id (same order), or ``None`` when the micro-batch cannot fit.
    """
    placement = _place_whole(ids, costs, bucket_size, options)
    if placement is None or not options.dacp_blocks:
        return placement
    return place_blocks(
        ids,
        placement,
        costs,
        bucket_size,
        kv_groups=options.kv_groups,
        min_gain=options.blocks_min_gain,
    )


def _place_whole(
    ids: Sequence[int], costs: SequenceCosts, bucket_size: int, options: PlannerOptions
) -> tuple[int, ...] | None:
    """Steps 1-5 (module docstring): every sequence local or on the whole group."""
    if costs.cp_size == 1:  # one rank: nothing to shard, everything is local
        fits = sum(costs.lengths[i] for i in ids) <= bucket_size
        return (0,) * len(ids) if fits else None
    if not options.dacp_cost_aware:
        return _place_paper(ids, costs, bucket_size, options)
    # Up to three constructions, each refined by local search; the best estimate wins. When the
    # first (the greedy) sharded something by choice and communication, or the waste of what it
    # sharded by choice, is a large share of its estimate, the split construction (shard the k
    # longest, spread the rest whole) is tried too. The last shards only what memory forces (the
    # paper's rule) and is refined only if it starts no slower than the best so far ended
    # (single moves rarely recover a gap; this bounds the planning time). It is not built when
    # the first sharded nothing by choice (it would be the same placement), nor when a sequence
    # the first sharded by choice would alone, kept whole, take as long as the first's whole
    # micro-batch (then it cannot start faster). All start from the same forced shards.
    forced = _forced(ids, costs, bucket_size)
    if forced is None:
        return None
    base, rest = forced
    tails = tail_seconds(rest, costs)  # shared by every construction
    moves = 2 * len(ids) + costs.cp_size if options.dacp_local_search else 0
    first = base.copy()
    best: CpGroupState | None = None
    if greedy(first, rest, look_ahead=True, tails=tails):
        chosen, chosen_max = first.chosen_shards, first.chosen_local_max
        improve(first, max_moves=moves)
        if chosen == 0:
            return first.placement(ids)
        best = first
        estimate = first.estimate()
        if options.dacp_split and (
            costs.comm(first.dist_tokens) >= options.split_comm_share * estimate
            or shard_waste(first) >= options.split_waste_share * estimate
        ):
            split = split_longest(base, rest, estimate, tails)
            if split is not None:  # it beats the estimate
                improve(split, max_moves=moves)
                best = split
        if chosen_max >= estimate or not options.dacp_paper_rule:
            return best.placement(ids)
    elif not options.dacp_paper_rule:
        return None
    give_up = None
    if best is not None:
        give_up = options.paper_rule_start_slack * best.estimate()
    other = base  # the last use of the forced state: no copy needed
    if greedy(other, rest, look_ahead=False, give_up_at=give_up, tails=tails) and (
        give_up is None or other.estimate() < give_up
    ):
        improve(other, max_moves=moves)
        if best is None or other.estimate() < best.estimate():
            best = other
    return None if best is None else best.placement(ids)


def _place_paper(
    ids: Sequence[int], costs: SequenceCosts, bucket_size: int, options: PlannerOptions
) -> tuple[int, ...] | None:
    """The paper's Algorithm 1 (shortest first, shard only when no rank fits the sequence
    whole, corrected roll-back), then step 3 when ``options`` runs it."""
    state = CpGroupState(costs, bucket_size)
    if not greedy(state, ascending(ids, costs.lengths), look_ahead=False, most_free=True):
        return None
    if options.dacp_local_search:
        improve(state, max_moves=2 * len(ids) + costs.cp_size)
    return state.placement(ids)


def _forced(
    ids: Sequence[int], costs: SequenceCosts, bucket_size: int
) -> tuple[CpGroupState, list[int]] | None:
    """The state with every sequence longer than ``bucket_size`` distributed, and the other
    sequences longest first; ``None`` when the forced shards alone overflow a rank."""
    lengths = costs.lengths
    state = CpGroupState(costs, bucket_size)
    rest = []
    for sid in descending(ids, lengths):  # longest first, ascending ids on ties
        if lengths[sid] > bucket_size:
            state.put_distributed(sid)
        else:
            rest.append(sid)
    if state.reserved > bucket_size:
        return None
    return state, rest


def estimate_micro_batch(ids: Sequence[int], costs: SequenceCosts, bucket_size: int) -> float:
    """Quick estimate of one micro-batch of ``ids`` (fixed overhead included), without placing it.

    Sequences longer than ``bucket_size`` are distributed; of the others the ``k`` longest are
    distributed too and the rest stay whole, and the estimate is the least over ``k`` of the
    bound :func:`~lightning_skrull.scheduling.dacp_refinements.split_longest` minimises
    (distributed compute, plus the larger of the mean rank and the slowest rank that whole
    sequences force). Distributing one more sequence adds at
    least the compute it takes off the mean rank (sharding only adds tile waste and
    communication), so once the mean rank reaches the whole sequences' bound no larger ``k``
    is lower and the search stops. Used to compare DP splits (:mod:`gds`), in a few operations
    per sequence; no memory check.
    """
    if not ids:
        return 0.0
    lengths, n = costs.lengths, costs.cp_size
    lin_of, att_of = costs.linear_table, costs.local_attention_table
    order = descending(ids, lengths)  # as _forced's
    rest = [sid for sid in order if lengths[sid] <= bucket_size]
    tokens = 0
    dist_compute = 0.0
    for sid in order[: len(order) - len(rest)]:  # the forced ones lead the order
        tokens += lengths[sid]
        dist_compute += costs.distributed(sid)
    linear = sum(lin_of[sid] for sid in rest)
    attention = sum(att_of[sid] for sid in rest)
    best = math.inf
    m = len(rest)
    for k in range(m + 1):
        if k:
            sid = rest[k - 1]
            tokens += lengths[sid]
            dist_compute += costs.distributed(sid)
            linear -= lin_of[sid]
            attention -= att_of[sid]
        comm = costs.comm(tokens)
        value, mean_sets_it = split_bound(
            costs, rest, k, dist_compute, comm, linear / n, attention / n
        )
        if value < best:
            best = value
        if mean_sets_it:
            break
    return costs.cost_model.micro_batch_overhead_s + best
