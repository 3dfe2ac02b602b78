"""DACP's refinements of a placement: the local search (step 3) and the split (step 4).

Both work on a :class:`~lightning_skrull.scheduling.dacp_greedy.CpGroupState`.
:func:`improve` applies the best single move (transfer a sequence to another rank, shard one,
bring one back whole) while the estimate drops; :func:`split_longest` builds a second
placement that shards the ``k`` longest sequences and spreads the others whole, tried where
:func:`shard_waste` (or the communication) is a large share of the first's estimate. Where they
run is :func:`~lightning_skrull.scheduling.dacp.place_micro_batch`'s choice, switched by
``PlannerOptions.dacp_local_search`` and ``PlannerOptions.dacp_split``. :func:`split_bound`
is also the quick estimate GDS compares DP splits with
(:func:`~lightning_skrull.scheduling.dacp.estimate_micro_batch`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_skrull.scheduling.dacp_greedy import CpGroupState, busy
from lightning_skrull.scheduling.plan import DISTRIBUTED
from lightning_skrull.scheduling.sequence_costs import SequenceCosts, descending

_REL_GAIN = 1e-9
"""A move must lower the estimate by this relative amount (guards against float noise)."""
_BOUND_SLACK = 1.0 - 1e-12
"""A lower bound prunes a move only when it beats the best by more than its own rounding."""


@dataclass(frozen=True)
class Move:
    """One step of the local search (:func:`improve`).

    Attributes:
        kind: ``"transfer"`` (a local sequence to another rank), ``"shard"`` (a local sequence
            becomes distributed) or ``"gather"`` (a distributed sequence comes back whole).
        seq: the sequence id.
        src: its rank before the move (:data:`DISTRIBUTED` for ``"gather"``).
        dst: its rank after the move (:data:`DISTRIBUTED` for ``"shard"``).
        gain: seconds the micro-batch's estimate drops by.
    """

    kind: Literal["transfer", "shard", "gather"]
    seq: int
    src: int
    dst: int
    gain: float


Candidate = tuple[float, Move]
"""A move and the estimate it reaches (compared directly: no rounding through ``gain``)."""


def improve(state: CpGroupState, max_moves: int) -> None:
    """Apply the best improving move until none improves (or ``max_moves`` were made).

    Moves, all evaluated exactly with the micro-batch estimate: move a local sequence of the
    slowest rank to the least-loaded rank with room (:func:`_best_transfer`); distribute one of
    the two longest local sequences of the slowest rank (:func:`_best_shard`); bring a
    distributed sequence back whole onto the rank where it ends soonest (:func:`_best_gather`).
    Ties go to the earlier kind, in that order.
    """
    for _ in range(max_moves):
        comm = state.costs.comm(state.dist_tokens)
        times = state.rank_times(comm)
        top = max(times)
        slowest = times.index(top)
        start = top + state.dist_compute
        best: Candidate | None = None
        for find in (_best_transfer, _best_shard, _best_gather):
            beat = start * (1.0 - _REL_GAIN) if best is None else best[0]
            found = find(state, times, slowest, comm, beat, start)
            if found is not None:
                best = found
        if best is None:
            return
        _apply(state, best[1])


def _apply(state: CpGroupState, move: Move) -> None:
    """Carry out ``move`` on ``state``."""
    if move.kind == "gather":
        state.take_distributed(move.seq)
    else:
        state.take_local(move.seq)
    if move.kind == "shard":
        state.put_distributed(move.seq)
    else:
        state.put_local(move.seq, move.dst)


def _best_transfer(
    state: CpGroupState, times: list[float], b: int, comm: float, beat: float, start: float
) -> Candidate | None:
    """The local sequence of the slowest rank ``b`` whose move to the least-loaded rank with
    room lowers the estimate below ``beat`` most."""
    c, linear, attn, tokens = state.costs, state.linear, state.attn, state.tokens
    if not state.members[b]:
        return None
    room = state.cap - state.reserved
    dc = state.dist_compute
    ranked = sorted(range(state.n), key=times.__getitem__)
    best: Candidate | None = None
    for sid in state.members[b]:
        s, lin, att = c.lengths[sid], c.linear(sid), c.local_attention(sid)
        new_b = busy(linear[b] - lin, attn[b] - att, comm)
        for r in ranked:
            if r == b or tokens[r] + s > room:
                continue
            new_r = busy(linear[r] + lin, attn[r] + att, comm)
            value = max(_max_except(times, ranked, b, r), new_b, new_r) + dc
            if value < beat:
                beat, best = value, (value, Move("transfer", sid, b, r, start - value))
            break
    return best


def _best_shard(
    state: CpGroupState, times: list[float], b: int, comm: float, beat: float, start: float
) -> Candidate | None:
    """One of the two longest local sequences of the slowest rank ``b``, distributed, where
    that lowers the estimate below ``beat`` most."""
    c, n, linear, attn, tokens = state.costs, state.n, state.linear, state.attn, state.tokens
    if not state.members[b]:
        return None
    room = state.cap - state.reserved
    others = max((tokens[r] for r in range(n) if r != b), default=0)
    lin_o = max(linear[r] if r != b else -math.inf for r in range(n))
    la_o = max(linear[r] + attn[r] if r != b else -math.inf for r in range(n))
    best: Candidate | None = None
    for sid in descending(state.members[b], c.lengths)[:2]:
        if others + c.shard(sid) > room:
            continue
        comm2 = c.comm(state.dist_tokens + c.lengths[sid])
        new_b = busy(linear[b] - c.linear(sid), attn[b] - c.local_attention(sid), comm2)
        value = max(lin_o + comm2, la_o, new_b) + state.dist_compute
        # The exact distributed cost takes longer to compute: try its bound first.
        if value + c.distributed_lower_bound(sid) >= beat:
            continue
        value += c.distributed(sid)
        if value < beat:
            beat, best = value, (value, Move("shard", sid, b, DISTRIBUTED, start - value))
    return best


def _best_gather(
    state: CpGroupState, times: list[float], b: int, comm: float, beat: float, start: float
) -> Candidate | None:
    """The distributed sequence whose return, whole, to the rank where it ends soonest lowers
    the estimate below ``beat`` most."""
    c, linear, attn, tokens = state.costs, state.linear, state.attn, state.tokens
    if not state.distributed:
        return None
    room, dc = state.cap - state.reserved, state.dist_compute
    l1, l1_at, l2 = _two_largest(linear)
    la_all = [lin + a for lin, a in zip(linear, attn, strict=True)]
    la1, la1_at, la2 = _two_largest(la_all)
    min_la, min_lin = min(la_all), min(linear)
    best: Candidate | None = None
    for sid in state.distributed:
        s = c.lengths[sid]
        if s > state.cap:
            continue
        dq = c.distributed(sid)
        comm2 = c.comm(state.dist_tokens - s)
        # A lower bound of the move's value, whichever rank takes it back: the other ranks keep
        # at least the second-largest linear and linear + attention, and the taker ends no
        # sooner than the least-loaded rank plus the sequence. The slack guards its rounding.
        bound = max(l2 + comm2, la2, min_la + c.local(sid), min_lin + c.linear(sid) + comm2)
        if (bound + dc - dq) * _BOUND_SLACK >= beat:
            continue
        need = s - c.shard(sid)  # its shard leaves every rank
        fits = [r for r in range(state.n) if tokens[r] + need <= room]
        if not fits:
            continue
        target = min(fits, key=lambda r: busy(linear[r], attn[r], comm2))
        new_t = busy(linear[target] + c.linear(sid), attn[target] + c.local_attention(sid), comm2)
        lin_o = l2 if target == l1_at else l1
        la_o = la2 if target == la1_at else la1
        value = max(lin_o + comm2, la_o, new_t) + dc - dq
        if value < beat:
            beat, best = value, (value, Move("gather", sid, DISTRIBUTED, target, start - value))
    return best


def _two_largest(values: list[float]) -> tuple[float, int, float]:
    """Largest value, its index, and the largest value at any other index."""
    top = max(values)
    i = values.index(top)
    rest = values[:i] + values[i + 1 :]
    return top, i, (max(rest) if rest else -math.inf)


def _max_except(times: list[float], ranked: list[int], skip_a: int, skip_b: int) -> float:
    """Largest of ``times`` outside two ranks; ``ranked`` orders ranks by ascending time."""
    for r in reversed(ranked):
        if r != skip_a and r != skip_b:
            return times[r]
    return 0.0


def shard_waste(state: CpGroupState) -> float:
    """Seconds the distributed sequences that would fit one rank whole cost beyond an even
    spread of their whole-rank time: their tile waste and their communication."""
    c, n, cap = state.costs, state.n, state.cap
    lengths, local = c.lengths, c.local_table
    per_token = c.comm_per_token
    return sum(
        c.distributed(sid) - local[sid] / n + per_token * lengths[sid]
        for sid in state.distributed
        if lengths[sid] <= cap
    )


def split_longest(
    base: CpGroupState,
    rest: Sequence[int],
    beat: float,
    tails: tuple[list[float], list[float]],
) -> CpGroupState | None:
    """Distribute the ``k`` longest of ``rest`` and spread the others whole over the ranks.

    The greedy decides one sequence at a time, longest first, and the first sequence kept
    whole always raises the slowest rank more than sharding it would; with slow communication
    it can end up sharding everything although keeping the short ones whole, spread over the
    ranks, is faster. This construction decides all at once: ``k`` minimises a lower bound of
    the result, the distributed compute (at its cheap lower bound) plus the largest of: the
    mean local linear time per rank plus the larger of the communication and the mean local
    attention; the longest local sequence; and the two shortest of the ``n + 1`` longest local
    ones, which must share a rank. The others go longest first to the rank with the least
    local time that has room (one that fits no rank is distributed).

    ``tails`` is :func:`~lightning_skrull.scheduling.dacp_greedy.tail_seconds` of ``rest``.

    Returns:
        The state, or ``None`` when it does not ``beat`` the given estimate (checked on the
        bound before spreading and on plain lists before building), when the best ``k`` is 0
        or all of ``rest`` (the greedy's own corners), or when the shards do not fit.
    """
    m = len(rest)
    if m < 2:
        return None
    best_k, best_value = _best_split(base, rest, tails)
    if best_k in (0, m) or best_value >= beat * (1.0 - _REL_GAIN):
        return None
    return _spread(base, rest, best_k, beat * (1.0 - _REL_GAIN))


def _best_split(
    base: CpGroupState, rest: Sequence[int], tails: tuple[list[float], list[float]]
) -> tuple[int, float]:
    """The ``k`` of :func:`split_longest` with the least :func:`split_bound` (the first on
    ties), distributed compute at its cheap lower bound, and that bound."""
    c, n = base.costs, base.n
    suffix_lin, suffix_att = tails  # seconds of rest[i:], all local
    lin0, att0 = sum(base.linear), sum(base.attn)
    best_k, best_value = 0, math.inf
    dist, tokens = base.dist_compute, base.dist_tokens
    for k in range(len(rest) + 1):
        if k:
            dist += c.distributed_lower_bound(rest[k - 1])
            tokens += c.lengths[rest[k - 1]]
        mean_lin, mean_att = (lin0 + suffix_lin[k]) / n, (att0 + suffix_att[k]) / n
        value, _ = split_bound(c, rest, k, dist, c.comm(tokens), mean_lin, mean_att)
        if value < best_value:
            best_k, best_value = k, value
    return best_k, best_value


def split_bound(
    costs: SequenceCosts,
    rest: Sequence[int],
    k: int,
    dist_compute: float,
    comm: float,
    mean_lin: float,
    mean_att: float,
) -> tuple[float, bool]:
    """Lower bound of a micro-batch that distributes ``rest[:k]`` (and whatever is already
    distributed: ``dist_compute``, ``comm``) and keeps ``rest[k:]`` whole, longest first:
    the distributed compute plus the larger of the mean rank (``mean_lin`` and ``mean_att``
    per rank, the larger of attention and communication) and the slowest rank the whole
    sequences force (the longest, or the two shortest of the ``n + 1`` longest, which must
    share a rank). Also whether the mean rank sets it."""
    local, m, n = costs.local_table, len(rest), costs.cp_size
    longest = local[rest[k]] if k < m else 0.0
    if k + n < m:  # n + 1 sequences on n ranks: two of them share one
        longest = max(longest, local[rest[k + n - 1]] + local[rest[k + n]])
    mean = busy(mean_lin, mean_att, comm)
    return dist_compute + (mean if mean > longest else longest), mean >= longest


def _spread(
    base: CpGroupState, rest: Sequence[int], best_k: int, beat: float
) -> CpGroupState | None:
    """``base`` with ``rest[:best_k]`` distributed and the others spread whole, longest first,
    each to the rank with the least local time that has room (distributed when none has);
    ``None`` when the shards do not fit or the estimate reaches ``beat``."""
    c = base.costs
    lengths, local = c.lengths, c.local_table
    lin_of, att_of = c.linear_table, c.local_attention_table
    # Spread the rest on plain lists first; build the state only if the result wins. The
    # estimate only grows while spreading (each rank's load, the communication and the
    # distributed compute), so the spreading stops as soon as it reaches ``beat``.
    linear, attn, tokens_of = list(base.linear), list(base.attn), list(base.tokens)
    shards = list(rest[:best_k])
    reserved = base.reserved + sum(c.shard(sid) for sid in shards)
    if max(tokens_of) + reserved > base.cap:
        return None
    dist_tokens = base.dist_tokens + sum(lengths[sid] for sid in shards)
    comm = c.comm(dist_tokens)
    dist = base.dist_compute + sum(c.distributed(sid) for sid in shards)
    top = max(busy(lin, a, comm) for lin, a in zip(linear, attn, strict=True))
    if top + dist >= beat:
        return None
    # Least local time first, lowest rank on ties; ranks without room are set aside.
    heap = [(lin + a, r) for r, (lin, a) in enumerate(zip(linear, attn, strict=True))]
    heapq.heapify(heap)
    where: list[tuple[int, int]] = []
    for sid in rest[best_k:]:
        s = lengths[sid]
        room = base.cap - reserved
        full = []
        while heap and tokens_of[heap[0][1]] + s > room:
            full.append(heapq.heappop(heap))
        if heap:
            load, rank = heapq.heappop(heap)
            lin = linear[rank] = linear[rank] + lin_of[sid]
            a = attn[rank] = attn[rank] + att_of[sid]
            tokens_of[rank] += s
            where.append((sid, rank))
            heapq.heappush(heap, (load + local[sid], rank))
            top = max(top, busy(lin, a, comm))
        elif max(tokens_of) + reserved + c.shard(sid) <= base.cap:
            shards.append(sid)
            reserved += c.shard(sid)
            dist_tokens += s
            comm = c.comm(dist_tokens)
            dist += c.distributed(sid)
            top = max(busy(lin, a, comm) for lin, a in zip(linear, attn, strict=True))
        else:
            return None
        if top + dist >= beat:
            return None
        for item in full:
            heapq.heappush(heap, item)
    state = base.copy()
    for sid in shards:
        state.put_distributed(sid)
    for sid, rank in where:
        state.put_local(sid, rank)
    return state
