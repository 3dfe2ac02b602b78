"""Judge a plan: its estimated iteration time, and a lower bound no plan can beat."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_skrull.scheduling.bound_blocks import block_relaxation
from lightning_skrull.scheduling.cost_model import CostModel, block_rank_times, kv_pipeline_span
from lightning_skrull.scheduling.plan import (
    DISTRIBUTED,
    CpBlock,
    GlobalBatchPlan,
    MicroBatchPlan,
    block_sizes_of,
)
from lightning_skrull.scheduling.sequence_costs import SequenceCosts
from lightning_skrull.scheduling.topology import check_topology


def _check_plan(plan: GlobalBatchPlan, lengths: Sequence[int]) -> None:
    if not isinstance(plan, GlobalBatchPlan):
        raise TypeError(f"plan must be a GlobalBatchPlan, got {type(plan).__name__}.")
    n = len(lengths)
    for sid in plan.all_sequence_ids():
        if not 0 <= sid < n:
            raise ValueError(
                f"plan refers to sequence {sid} but lengths has {n} entries; pass the lengths "
                "the plan was made from."
            )


@dataclass(frozen=True)
class MicroBatchTerms:
    """The terms of a micro-batch's time on its slowest CP rank (see :func:`micro_batch_terms`).

    Attributes:
        seconds: estimated seconds of the micro-batch.
        compute_seconds: compute on the slowest rank's critical path (local linear, distributed
            compute, and whatever attention the communication does not replace on that path),
            without the fixed per-sequence cost.
        exposed_collectives: collectives on the critical path (each pays ``comm_latency_s``).
        exposed_tokens: whole tokens of the distributed sequences whose exchange lies on the
            critical path (its bytes over the bandwidth count).
        distributed_tokens: whole tokens of the distributed sequences.
        sequences: sequences the slowest rank holds (its local ones and every distributed one),
            each paying ``per_sequence_seconds``.
    """

    seconds: float
    compute_seconds: float
    exposed_collectives: int
    exposed_tokens: int
    distributed_tokens: int
    sequences: int = 0


def micro_batch_terms(
    mb: MicroBatchPlan, costs: SequenceCosts, cost_model: CostModel
) -> MicroBatchTerms:
    """Estimated time of a micro-batch, split into its terms on the slowest CP rank.

    Communication counts as exposed when it is at least the attention that could hide it
    (ties included, so that a micro-batch with nothing to hide it behind exposes it even when
    the model thinks it free: a fit can then see what it really costs). A micro-batch with
    blocks is timed by :func:`~lightning_skrull.scheduling.cost_model.block_rank_times`
    (:func:`block_terms`).
    """
    if mb.block_sizes():
        return block_terms(mb, costs, cost_model)
    n = costs.cp_size
    linear = [0.0] * n
    attn = [0.0] * n
    count = [0] * n
    dist: list[int] = []
    dist_compute = 0.0
    for sid, where in zip(mb.sequence_ids, mb.placement, strict=True):
        if where == DISTRIBUTED:
            dist.append(sid)
            dist_compute += costs.distributed(sid)
        else:
            assert isinstance(where, int)  # blocks took block_terms
            linear[where] += costs.linear(sid)
            attn[where] += costs.local_attention(sid)
            count[where] += 1
    lengths = costs.lengths
    dist_tokens = sum(lengths[sid] for sid in dist)
    ranges = mb.kv_group_ranges()
    collectives = cost_model.num_collectives(n)
    fixed = costs.per_sequence
    if len(ranges) > 1:
        tokens = [sum(lengths[sid] for sid in dist[a:b]) for a, b in ranges]
        att = [sum(costs.distributed_attention(sid) for sid in dist[a:b]) for a, b in ranges]
        span, g = kv_pipeline_span([costs.comm(t) for t in tokens], att)
        total = sum(att)
        times = [lin + max(a + total, span) for lin, a in zip(linear, attn, strict=True)]
        j = max(range(n), key=times.__getitem__)
        seconds = cost_model.micro_batch_overhead_s + times[j] + (dist_compute - total)
        held = count[j] + len(dist)
        if span >= attn[j] + total:  # the pipeline's longest path: groups 0..g sent, g.. computed
            compute = linear[j] + dist_compute - total + sum(att[g:]) - fixed * held
            return MicroBatchTerms(
                seconds, compute, collectives * (g + 1), sum(tokens[: g + 1]), dist_tokens, held
            )
        compute = linear[j] + dist_compute + attn[j] - fixed * held
        return MicroBatchTerms(seconds, compute, 0, 0, dist_tokens, held)
    comm = costs.comm(dist_tokens)
    times = [lin + max(comm, a) for lin, a in zip(linear, attn, strict=True)]
    j = max(range(n), key=times.__getitem__)
    exposed = bool(dist) and n > 1 and comm >= attn[j]
    held = count[j] + len(dist)
    compute = linear[j] + dist_compute + (0.0 if exposed else attn[j]) - fixed * held
    seconds = cost_model.micro_batch_overhead_s + times[j] + dist_compute
    if exposed:
        return MicroBatchTerms(seconds, compute, collectives, dist_tokens, dist_tokens, held)
    return MicroBatchTerms(seconds, compute, 0, 0, dist_tokens, held)


def block_terms(mb: MicroBatchPlan, costs: SequenceCosts, cost_model: CostModel) -> MicroBatchTerms:
    """:func:`micro_batch_terms` of a micro-batch with blocks. Its seconds are exact under the
    model; where the exchange is exposed on the slowest rank, the exposed collectives and
    tokens count the whole group's and that rank's blocks' together (one figure, though
    blocks inside a node and across nodes differ in link constants)."""
    n, lengths = costs.cp_size, costs.lengths
    linear, attn, block_attn, count = [0.0] * n, [0.0] * n, [0.0] * n, [0] * n
    block_tokens: dict[CpBlock, int] = {}
    dist: list[int] = []
    for sid, where in zip(mb.sequence_ids, mb.placement, strict=True):
        if isinstance(where, CpBlock):
            block_tokens[where] = block_tokens.get(where, 0) + lengths[sid]
            lin, share = costs.block_costs(sid, where.size)
            for j in where.ranks:
                linear[j] += lin
                block_attn[j] += share
                count[j] += 1
        elif where == DISTRIBUTED:
            dist.append(sid)
        else:
            linear[where] += costs.linear(sid)
            attn[where] += costs.local_attention(sid)
            count[where] += 1
    block_comm, block_held = [0.0] * n, [0] * n
    for block, held in block_tokens.items():
        seconds = costs.exchange(held, block.start, block.size)
        for j in block.ranks:
            block_comm[j] += seconds
            block_held[j] += held
    ranges = mb.kv_group_ranges()
    tokens = [sum(lengths[sid] for sid in dist[a:b]) for a, b in ranges]
    att = [sum(costs.distributed_attention(sid) for sid in dist[a:b]) for a, b in ranges]
    dist_compute = sum(costs.distributed(sid) for sid in dist)
    comm = [costs.comm(t) for t in tokens]
    times = block_rank_times(linear, attn, block_comm, block_attn, comm, att)
    j = max(range(n), key=times.__getitem__)
    seconds = cost_model.micro_batch_overhead_s + times[j] + (dist_compute - sum(att))
    held = count[j] + len(dist)
    dist_tokens = sum(tokens)
    first = block_comm[j] + (comm[0] if comm else 0.0)
    compute = linear[j] + dist_compute + block_attn[j] - costs.per_sequence * held
    if (block_comm[j] or comm) and first >= attn[j]:
        collectives = cost_model.num_collectives(n) * (1 if dist else 0)
        collectives += cost_model.num_collectives(2) * len(mb.block_sizes())
        exposed = block_held[j] + (tokens[0] if tokens else 0)
        return MicroBatchTerms(seconds, compute, collectives, exposed, dist_tokens, held)
    return MicroBatchTerms(seconds, compute + attn[j], 0, 0, dist_tokens, held)


def dp_rank_seconds(
    plan: GlobalBatchPlan, lengths: Sequence[int], cost_model: CostModel
) -> list[float]:
    """Estimated seconds of every DP rank: the sum of its micro-batch times."""
    _check_plan(plan, lengths)
    check_topology(cost_model.ranks_per_node, dp_size=plan.dp_size, cp_size=plan.cp_size)
    costs = SequenceCosts(lengths, plan.cp_size, cost_model)
    return [
        sum(micro_batch_terms(mb, costs, cost_model).seconds for mb in mbs)
        for mbs in plan.micro_batches
    ]


def simulate(plan: GlobalBatchPlan, lengths: Sequence[int], cost_model: CostModel) -> float:
    """Estimated seconds of one iteration (forward + backward of every micro-batch).

    The slowest DP rank's sum of micro-batch times; a micro-batch takes its slowest CP rank's
    ``overhead + linear + per_sequence * sequences + max(comm, local attention) + distributed
    compute``
    (see :class:`CostModel`). The optimizer step and the gradient all-reduce are not included:
    they are the same for every plan.

    Args:
        plan: the plan to judge.
        lengths: the lengths it was planned from.
        cost_model: the estimate.

    Returns:
        Seconds; 0.0 for a plan with no micro-batches.
    """
    return max(dp_rank_seconds(plan, lengths, cost_model), default=0.0)


def lower_bound(
    lengths: Sequence[int],
    *,
    dp_size: int,
    cp_size: int,
    bucket_size: int,
    cost_model: CostModel,
    blocks: bool = False,
) -> float:
    """Seconds no plan can beat under ``cost_model`` (for any policy).

    The bound is the larger of two relaxations, tightened by a third fact.

    **Work spread evenly.** A micro-batch lasts at least its CP ranks' *mean* time, and a DP
    rank at least the mean over DP ranks. The mean CP-rank time of a micro-batch is at least
    ``overhead + (local compute)/N + distributed compute + max(0, comm - (local attention)/N
    - distributed attention)`` (communication hides only behind attention: local, and, with
    K/V groups, the distributed attention of other groups). Summed over all micro-batches and
    relaxed so that each sequence may be *fractionally* local or distributed, the best split
    is a small linear programme solved exactly (greedy, fractional-knapsack style): a sequence
    is distributed when that saves compute, and it may use only as much communication as the
    attention left in the batch can hide. Sequences longer than ``bucket_size`` are always
    distributed. Every micro-batch holding a distributed sequence pays the collectives'
    latency: it is charged for the fewest micro-batches the forced sequences (below) fit in
    (their shards' tokens over ``cp_size * bucket_size``), not for the others. Nor is the
    imbalance that whole sequences leave between CP ranks; the micro-batch count is the fewest
    the token budget allows
    (``ceil(sum of tokens / (cp_size * bucket_size))`` over all DP ranks), but at least one per
    DP rank that can hold a sequence, each paying the fixed overhead. Everything is divided
    evenly over those ``min(dp_size, len(lengths))`` DP ranks: a plan that leaves some DP ranks
    empty gives the others more work and saves no more overheads than it leaves out.

    **Sequences are indivisible.** A sequence never spans DP ranks or micro-batches, so the
    iteration lasts at least one micro-batch holding only the slowest sequence at its cheaper
    placement (communication included when distributed).

    **A local sequence sits whole on one CP rank.** A plan that lasts ``T`` keeps local only
    sequences with ``overhead + local time <= T``; every longer one is distributed, paying its
    tile waste and communication. Both relaxations are taken with those sequences forced onto
    the distributed path, and the bound is the least ``T`` that is at least its own
    relaxation (found by bisection over the sequences' local times; the relaxation can only
    fall as ``T`` grows). Without this, a batch of sequences each longer than a CP rank's mean
    share is bounded as if it could be spread evenly while kept local.

    Args:
        lengths: sequence lengths of the global batch.
        dp_size: DP ranks.
        cp_size: ranks of one CP group.
        bucket_size: tokens per CP rank per micro-batch.
        cost_model: the estimate.
        blocks: bound plans that shard sequences over blocks of the CP group too
            (``PlannerOptions.dacp_blocks``; the relaxation of
            :mod:`~lightning_skrull.scheduling.bound_blocks`). Without it the bound holds for
            plans without blocks.

    Returns:
        The bound in seconds (0.0 for an empty batch).
    """
    if not lengths:
        return 0.0
    check_topology(cost_model.ranks_per_node, dp_size=dp_size, cp_size=cp_size)
    costs = SequenceCosts(lengths, cp_size, cost_model)
    relax = block_relaxation if blocks and block_sizes_of(cp_size) else _relaxation
    return _least_time(lengths, costs, relax, dp_size, bucket_size)


Relaxation = Callable[[Sequence[int], SequenceCosts, Sequence[bool], int, int, float], float]
"""A relaxation of :func:`lower_bound` given which sequences are forced off one rank."""


def _least_time(
    lengths: Sequence[int],
    costs: SequenceCosts,
    relax: Relaxation,
    dp_size: int,
    bucket_size: int,
) -> float:
    """The least iteration time ``T`` at least ``relax`` with the sequences whose local time
    exceeds ``T`` forced off one rank (:func:`lower_bound`'s third fact)."""
    overhead = costs.cost_model.micro_batch_overhead_s
    # A sequence kept local makes its CP rank last at least overhead + its local time; an
    # iteration shorter than that must distribute it. Sequences over the bucket always are.
    limits = [
        overhead + costs.local(sid) if s <= bucket_size else math.inf
        for sid, s in enumerate(lengths)
    ]
    cuts = sorted({x for x in limits if x < math.inf})

    def interval(k: int) -> tuple[float, float, float]:
        """``(lo, hi, relaxation)`` of iteration times ``[lo, hi)`` between two limits."""
        lo = cuts[k - 1] if k > 0 else 0.0
        hi = cuts[k] if k < len(cuts) else math.inf
        forced = [x >= hi for x in limits]
        return lo, hi, relax(lengths, costs, forced, dp_size, bucket_size, overhead)

    # No plan lasts T < relaxation(forced at T); the relaxation only falls as T grows, so
    # the iteration times a plan could have form [T*, inf). Bisect for the first interval
    # that holds a point of it.
    first, last = 0, len(cuts)
    best = interval(last)
    while first < last:
        mid = (first + last) // 2
        found = interval(mid)
        if max(found[0], found[2]) < found[1]:
            last, best = mid, found
        else:
            first = mid + 1
    return max(best[0], best[2])


def _relaxation(
    lengths: Sequence[int],
    costs: SequenceCosts,
    forced: Sequence[bool],
    dp_size: int,
    bucket_size: int,
    overhead: float,
) -> float:
    """The two relaxations of :func:`lower_bound` with the ``forced`` sequences distributed."""
    n = costs.cp_size
    per_token_comm = costs.comm(2) - costs.comm(1)  # bytes over bandwidth, latency excluded
    total = 0.0  # per-rank seconds summed over the batch, every optional sequence local
    excess = 0.0  # communication minus the attention that could hide it, likewise
    total_tokens = 0
    forced_tokens = 0  # per-rank tokens of the forced sequences, summed over the CP ranks
    slowest = 0.0
    options: list[tuple[float, float]] = []  # (added seconds, added excess) of distributing
    for sid, s in enumerate(lengths):
        dist = costs.distributed(sid)
        # Distributed, a sequence's own attention can hide other groups' communication.
        dist_excess = per_token_comm * s - costs.distributed_attention(sid)
        if forced[sid]:
            total += dist
            excess += dist_excess
            forced_tokens += n * costs.shard(sid)
            slowest = max(slowest, dist + costs.comm(s))
            continue
        local = costs.local(sid) / n
        hide = costs.local_attention(sid) / n
        total_tokens += s
        slowest = max(slowest, min(costs.local(sid), dist + costs.comm(s)))
        total += local
        excess -= hide
        options.append((dist - local, dist_excess + hide))
    if forced_tokens:  # the micro-batches holding them each pay the collectives' latency
        excess += costs.comm_fixed * -(-forced_tokens // (n * bucket_size))
    total_tokens += forced_tokens
    # A DP rank that holds a sequence runs at least one micro-batch, and fewer ranks only
    # raise the mean: spread over every rank that can hold one, each paying one overhead.
    ranks = min(dp_size, len(lengths))
    micro_batches = max(-(-total_tokens // (n * bucket_size)), ranks)
    work = total + _least_exposed(excess, options)
    spread = (work + overhead * micro_batches) / ranks
    return max(spread, overhead + slowest)


def _least_exposed(excess: float, options: Sequence[tuple[float, float]]) -> float:
    """``min over x in [0, 1]^n of  sum(x_i * a_i) + max(0, excess + sum(x_i * b_i))``.

    The fractional choice of which optional sequences to distribute (``(a_i, b_i)`` = seconds
    and excess communication that distributing sequence ``i`` adds). Solved exactly through
    its dual: the value is the maximum over ``lam`` in ``[0, 1]`` of the concave
    ``lam * excess + sum(min(0, a_i + lam * b_i))``, found by walking the breakpoints
    ``lam = -a_i / b_i`` in order until its slope turns negative.
    """
    value = 0.0  # sum of a_i over the terms active at lam = 0
    slope = excess  # d/dlam of the dual at lam = 0+
    events: list[tuple[float, float]] = []  # (lam, b): a term enters or leaves there
    for a, b in options:
        if b == 0.0:
            if a < 0:
                value += a
            continue
        t = -a / b
        if b > 0:  # active (a + lam b < 0) for lam < t
            if t > 0:
                value += a
                slope += b
                if t < 1:
                    events.append((t, b))
        elif t <= 0:  # b < 0: active for lam > t, so on all of (0, 1]
            value += a
            slope += b
        elif t < 1:
            events.append((t, b))
    lam = 0.0
    if slope > 0:
        events.sort()
        for t, b in events:
            value += slope * (t - lam)
            lam = t
            slope -= abs(b)  # a term leaves (b > 0) or enters (b < 0): a + t * b == 0 here
            if slope <= 0:
                break
        else:
            value += slope * (1.0 - lam)
    return value
