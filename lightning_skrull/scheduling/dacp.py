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

The roll-back is the corrected one: turning local sequence ``k`` on rank ``t`` into a
distributed one frees ``S_k - ceil(S_k/N)`` tokens on ``t`` and costs every other rank
``ceil(S_k/N)`` tokens (and ``cost/N`` load); those ranks must still fit. Among the sequences
that can be rolled back, the one that frees most is chosen.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_skrull.scheduling.options import DEFAULT_OPTIONS, PlannerOptions
from lightning_skrull.scheduling.plan import DISTRIBUTED
from lightning_skrull.scheduling.sequence_costs import SequenceCosts, ascending, descending

_REL_GAIN = 1e-9
"""A move must lower the estimate by this relative amount (guards against float noise)."""
_BOUND_SLACK = 1.0 - 1e-12
"""A lower bound prunes a move only when it beats the best by more than its own rounding."""


class CpGroupState:
    """Token and time bookkeeping of one micro-batch on a CP group while it is being placed.

    Args:
        costs: per-sequence cost table.
        bucket_size: token budget of one CP rank.
    """

    def __init__(self, costs: SequenceCosts, bucket_size: int) -> None:
        n = costs.cp_size
        self.costs = costs
        self.n = n
        self.cap = bucket_size
        self.where: dict[int, int] = {}
        self.tokens = [0] * n  # local tokens per rank
        self.linear = [0.0] * n  # local linear seconds per rank
        self.attn = [0.0] * n  # local attention seconds per rank
        self.members: list[list[int]] = [[] for _ in range(n)]
        self.reserved = 0  # shard tokens of the distributed sequences, on every rank
        self.dist_tokens = 0  # whole tokens of the distributed sequences (communication)
        self.dist_compute = 0.0  # per-rank compute seconds of the distributed sequences
        self.distributed: list[int] = []
        self.chosen_shards = 0  # sequences that fit whole but were sharded by choice
        self.chosen_local_max = 0.0  # largest whole-rank cost among those

    # --------------------------------------------------------------------- mutations
    def put_local(self, sid: int, rank: int) -> None:
        """Place ``sid`` whole on ``rank``."""
        c = self.costs
        self.where[sid] = rank
        self.tokens[rank] += c.lengths[sid]
        self.linear[rank] += c.linear(sid)
        self.attn[rank] += c.local_attention(sid)
        self.members[rank].append(sid)

    def take_local(self, sid: int) -> int:
        """Remove local ``sid`` from its rank; returns that rank."""
        c = self.costs
        rank = self.where.pop(sid)
        self.tokens[rank] -= c.lengths[sid]
        self.linear[rank] -= c.linear(sid)
        self.attn[rank] -= c.local_attention(sid)
        self.members[rank].remove(sid)
        return rank

    def put_distributed(self, sid: int) -> None:
        """Shard ``sid`` over the CP group."""
        c = self.costs
        s = c.lengths[sid]
        self.where[sid] = DISTRIBUTED
        self.reserved += -(-s // self.n)  # SequenceCosts.shard, inlined: a hot path
        self.dist_tokens += s
        self.dist_compute += c.distributed(sid)
        self.distributed.append(sid)

    def take_distributed(self, sid: int) -> None:
        """Remove distributed ``sid``."""
        c = self.costs
        del self.where[sid]
        self.reserved -= c.shard(sid)
        self.dist_tokens -= c.lengths[sid]
        self.dist_compute -= c.distributed(sid)
        self.distributed.remove(sid)

    # --------------------------------------------------------------------- queries
    def room(self, rank: int) -> int:
        """Free tokens of ``rank``."""
        return self.cap - self.tokens[rank] - self.reserved

    def can_distribute(self, sid: int) -> bool:
        """Whether every rank has room for ``sid``'s shard."""
        return max(self.tokens) + self.reserved + self.costs.shard(sid) <= self.cap

    def rank_times(self, comm: float | None = None) -> list[float]:
        """Estimated seconds of each rank without the shared distributed compute."""
        if comm is None:
            comm = self.costs.comm(self.dist_tokens)
        return [_busy(lin, a, comm) for lin, a in zip(self.linear, self.attn, strict=True)]

    def estimate(self) -> float:
        """Estimated seconds of the micro-batch (without the fixed per-micro-batch overhead)."""
        return max(self.rank_times()) + self.dist_compute

    def roll_back(self) -> bool:
        """Turn the local sequence that frees most tokens into a distributed one.

        Returns:
            ``False`` when no local sequence can be rolled back (every candidate would push
            another rank over its budget, or frees nothing).
        """
        n, c = self.n, self.costs
        best: tuple[int, int] | None = None  # (freed, -sid)
        best_sid = -1
        for rank in range(n):
            others = max((self.tokens[r] for r in range(n) if r != rank), default=0)
            for sid in self.members[rank]:
                shard = c.shard(sid)
                freed = c.lengths[sid] - shard
                if freed <= 0 or others + self.reserved + shard > self.cap:
                    continue
                key = (freed, -sid)
                if best is None or key > best:
                    best, best_sid = key, sid
        if best is None:
            return False
        self.take_local(best_sid)
        self.put_distributed(best_sid)
        return True

    def copy(self) -> CpGroupState:
        """An independent copy of this state."""
        other = CpGroupState.__new__(CpGroupState)
        other.__dict__.update(self.__dict__)
        other.where = dict(self.where)
        other.tokens = list(self.tokens)
        other.linear = list(self.linear)
        other.attn = list(self.attn)
        other.members = [list(m) for m in self.members]
        other.distributed = list(self.distributed)
        return other

    def placement(self, ids: Sequence[int]) -> tuple[int, ...]:
        """Placement of ``ids`` in that order."""
        return tuple(self.where[sid] for sid in ids)


def _least_loaded_with_room(state: CpGroupState, sid: int, times: list[float]) -> int:
    """Rank with the lowest time that can take ``sid`` whole, or -1 (ties: lowest rank)."""
    need = state.costs.lengths[sid] + state.reserved
    best, best_t = -1, 0.0
    for r, t in enumerate(times):
        if state.tokens[r] + need <= state.cap and (best < 0 or t < best_t):
            best, best_t = r, t
    return best


def place_micro_batch(
    ids: Sequence[int],
    costs: SequenceCosts,
    bucket_size: int,
    options: PlannerOptions = DEFAULT_OPTIONS,
) -> tuple[int, ...] | None:
    """Place one micro-batch with cost-aware DACP.

    Args:
        ids: sequence ids of the micro-batch (each no longer than ``cp_size * bucket_size``).
        costs: cost table of the global batch.
        bucket_size: token budget of one CP rank.
        options: which steps beyond the paper run (module docstring).

    Returns:
        One placement per id (same order), or ``None`` when the micro-batch cannot fit.
    """
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
    tails = _tails(rest, costs)  # shared by every construction
    moves = 2 * len(ids) + costs.cp_size if options.dacp_local_search else 0
    first = base.copy()
    best: CpGroupState | None = None
    if _greedy(first, rest, look_ahead=True, tails=tails):
        chosen, chosen_max = first.chosen_shards, first.chosen_local_max
        _improve(first, max_moves=moves)
        if chosen == 0:
            return first.placement(ids)
        best = first
        estimate = first.estimate()
        if options.dacp_split and (
            costs.comm(first.dist_tokens) >= options.split_comm_share * estimate
            or _shard_waste(first) >= options.split_waste_share * estimate
        ):
            split = _split_longest(base, rest, estimate, tails)
            if split is not None:  # it beats the estimate
                _improve(split, max_moves=moves)
                best = split
        if chosen_max >= estimate or not options.dacp_paper_rule:
            return best.placement(ids)
    elif not options.dacp_paper_rule:
        return None
    give_up = None
    if best is not None:
        give_up = options.paper_rule_start_slack * best.estimate()
    other = base  # the last use of the forced state: no copy needed
    if _greedy(other, rest, look_ahead=False, give_up_at=give_up, tails=tails) and (
        give_up is None or other.estimate() < give_up
    ):
        _improve(other, max_moves=moves)
        if best is None or other.estimate() < best.estimate():
            best = other
    return None if best is None else best.placement(ids)


def _place_paper(
    ids: Sequence[int], costs: SequenceCosts, bucket_size: int, options: PlannerOptions
) -> tuple[int, ...] | None:
    """The paper's Algorithm 1 (shortest first, shard only when no rank fits the sequence
    whole, corrected roll-back), then step 3 when ``options`` runs it."""
    state = CpGroupState(costs, bucket_size)
    if not _greedy(state, ascending(ids, costs.lengths), look_ahead=False, most_free=True):
        return None
    if options.dacp_local_search:
        _improve(state, max_moves=2 * len(ids) + costs.cp_size)
    return state.placement(ids)


def _tails(rest: Sequence[int], costs: SequenceCosts) -> tuple[list[float], list[float]]:
    """Linear and attention seconds of ``rest[i:]``, every one kept whole, for each ``i``
    (``len(rest) + 1`` entries, the last 0)."""
    lin_of, att_of = costs.linear_table, costs.local_attention_table
    tail_lin = [0.0] * (len(rest) + 1)
    tail_att = [0.0] * (len(rest) + 1)
    for i in range(len(rest) - 1, -1, -1):
        tail_lin[i] = tail_lin[i + 1] + lin_of[rest[i]]
        tail_att[i] = tail_att[i + 1] + att_of[rest[i]]
    return tail_lin, tail_att


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


def _shard_waste(state: CpGroupState) -> float:
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


def _split_longest(
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

    ``tails`` is :func:`_tails` of ``rest``.

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
    """The ``k`` of :func:`_split_longest` with the least :func:`_split_bound` (the first on
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
        value, _ = _split_bound(c, rest, k, dist, c.comm(tokens), mean_lin, mean_att)
        if value < best_value:
            best_k, best_value = k, value
    return best_k, best_value


def _split_bound(
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
    mean = _busy(mean_lin, mean_att, comm)
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
    top = max(_busy(lin, a, comm) for lin, a in zip(linear, attn, strict=True))
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
            top = max(top, _busy(lin, a, comm))
        elif max(tokens_of) + reserved + c.shard(sid) <= base.cap:
            shards.append(sid)
            reserved += c.shard(sid)
            dist_tokens += s
            comm = c.comm(dist_tokens)
            dist += c.distributed(sid)
            top = max(_busy(lin, a, comm) for lin, a in zip(linear, attn, strict=True))
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


def estimate_micro_batch(ids: Sequence[int], costs: SequenceCosts, bucket_size: int) -> float:
    """Quick estimate of one micro-batch of ``ids`` (fixed overhead included), without placing it.

    Sequences longer than ``bucket_size`` are distributed; of the others the ``k`` longest are
    distributed too and the rest stay whole, and the estimate is the least over ``k`` of the
    bound :func:`_split_longest` minimises (distributed compute, plus the larger of the mean rank
    and the slowest rank that whole sequences force). Distributing one more sequence adds at
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
        value, mean_sets_it = _split_bound(
            costs, rest, k, dist_compute, comm, linear / n, attention / n
        )
        if value < best:
            best = value
        if mean_sets_it:
            break
    return costs.cost_model.micro_batch_overhead_s + best


class _Loads:
    """Running extremes and sums of the ranks' local load while :func:`_greedy` places.

    The slowest rank's time is ``max(max_lin + comm, max_lin_att)`` for any communication
    ``comm`` (linear plus the larger of communication and attention), so these totals answer it
    without touching every rank after each placement.
    """

    __slots__ = ("max_lin", "max_lin_att", "max_tokens", "min_tokens", "sum_att", "sum_lin")

    def __init__(self, state: CpGroupState) -> None:
        self.reset(state)

    def reset(self, state: CpGroupState) -> None:
        """Recompute every total from ``state`` (after a roll-back)."""
        self.min_tokens, self.max_tokens = min(state.tokens), max(state.tokens)
        self.max_lin = max(state.linear)
        self.max_lin_att = max(lin + a for lin, a in zip(state.linear, state.attn, strict=True))
        self.sum_lin, self.sum_att = sum(state.linear), sum(state.attn)

    def placed(self, state: CpGroupState, rank: int, s: int, lin_k: float, att_k: float) -> None:
        """Account for a sequence of ``s`` tokens just put whole on ``rank``."""
        tokens = state.tokens[rank]
        if tokens - s == self.min_tokens:
            self.min_tokens = min(state.tokens)
        if tokens > self.max_tokens:
            self.max_tokens = tokens
        lin, a = state.linear[rank], state.attn[rank]
        self.max_lin = lin if lin > self.max_lin else self.max_lin
        self.max_lin_att = lin + a if lin + a > self.max_lin_att else self.max_lin_att
        self.sum_lin += lin_k
        self.sum_att += att_k

    def slowest(self, comm: float) -> float:
        """Seconds of the slowest rank without the distributed compute."""
        return max(self.max_lin + comm, self.max_lin_att)


def _greedy(
    state: CpGroupState,
    rest: Sequence[int],
    look_ahead: bool,
    give_up_at: float | None = None,
    tails: tuple[list[float], list[float]] | None = None,
    most_free: bool = False,
) -> bool:
    """Place ``rest`` in order, choosing local or distributed by a look-ahead estimate.

    The estimate of the finished micro-batch is the larger of the slowest rank so far and the
    mean rank time once every remaining sequence is placed locally (a lower bound of what is
    left to balance), plus the distributed compute (:func:`_shard_pays`). Keeping a sequence
    local is chosen on ties; a sequence that fits no rank whole is distributed, or a local one
    is rolled back. Without ``look_ahead`` only memory makes a sequence distributed.

    ``tails`` is :func:`_tails` of ``rest``, when the caller already has it. With
    ``most_free``, a sequence whose least-loaded rank has no room goes to the rank with most
    free tokens (the paper's rule) instead of the least-loaded rank with room.

    Returns:
        ``False`` when the micro-batch cannot fit, or when the estimate so far (slowest rank
        plus distributed compute) reaches ``give_up_at``.
    """
    give_up_at = math.inf if give_up_at is None else give_up_at
    costs, cap = state.costs, state.cap
    if not look_ahead:
        tails = None
    elif tails is None:
        tails = _tails(rest, costs)
    comm = costs.comm(state.dist_tokens)
    times: list[float] | None = state.rank_times(comm)  # None: the communication changed
    loads = _Loads(state)
    # Until a sequence stays whole every rank's time is the communication and the first
    # minimum is rank 0: long-sequence micro-batches that distribute everything skip the scan.
    all_empty = not (any(state.tokens) or any(state.linear) or any(state.attn))
    for i, sid in enumerate(rest):
        s = costs.lengths[sid]
        while True:
            if loads.min_tokens + state.reserved + s > cap:
                rank = -1  # fits no rank whole
            elif all_empty:
                rank = 0
            else:
                times = state.rank_times(comm) if times is None else times
                rank = _local_rank(state, sid, times, loads, most_free)
            if (
                rank >= 0
                and tails is not None
                and _shard_pays(state, sid, rank, tails, i, comm, loads)
            ):
                state.chosen_shards += 1
                whole = costs.linear(sid) + costs.local_attention(sid)
                state.chosen_local_max = max(state.chosen_local_max, whole)
                rank = DISTRIBUTED
            if rank >= 0:
                times = state.rank_times(comm) if times is None else times
                all_empty = False
                state.put_local(sid, rank)
                loads.placed(state, rank, s, costs.linear(sid), costs.local_attention(sid))
                times[rank] = _busy(state.linear[rank], state.attn[rank], comm)
            elif loads.max_tokens + state.reserved + costs.shard(sid) <= cap:
                state.put_distributed(sid)  # local ranks unchanged: only comm moves
                comm, times = costs.comm(state.dist_tokens), None
            elif state.roll_back():
                comm, times = costs.comm(state.dist_tokens), None
                loads.reset(state)
                continue
            else:
                return False
            if loads.slowest(comm) + state.dist_compute >= give_up_at:
                return False
            break
    return True


def _local_rank(
    state: CpGroupState, sid: int, times: list[float], loads: _Loads, most_free: bool
) -> int:
    """Rank to keep ``sid`` whole on (some rank has room): the least-loaded one (lowest on
    ties) if it has room, else the rank with most free tokens (``most_free``) or the
    least-loaded rank with room."""
    rank = times.index(min(times))
    if state.tokens[rank] + state.reserved + state.costs.lengths[sid] <= state.cap:
        return rank
    if most_free:
        return state.tokens.index(loads.min_tokens)
    return _least_loaded_with_room(state, sid, times)


def _shard_pays(
    state: CpGroupState,
    sid: int,
    rank: int,
    tails: tuple[list[float], list[float]],
    i: int,
    comm: float,
    loads: _Loads,
) -> bool:
    """Whether distributing ``sid`` gives a lower look-ahead estimate than keeping it whole on
    ``rank`` (and every rank has room for its shard). ``sid`` is at position ``i`` of the
    sequences ``tails`` (:func:`_tails`) was made of."""
    c, n = state.costs, state.n
    lin_k, att_k = c.linear(sid), c.local_attention(sid)
    mean_lin = (loads.sum_lin + tails[0][i]) / n
    mean_att = (loads.sum_att + tails[1][i]) / n
    top = loads.slowest(comm)  # the slowest rank so far
    new_rank = _busy(state.linear[rank] + lin_k, state.attn[rank] + att_k, comm)
    mean = _busy(mean_lin, mean_att, comm)
    # Sharding cannot win when keeping it whole leaves the estimate at ``top``: the sharded
    # estimate is at least ``top`` plus the sequence's linear share.
    if not (new_rank > top or mean > top):
        return False
    as_local = max(top, new_rank, mean)
    comm2 = c.comm(state.dist_tokens + c.lengths[sid])
    as_dist = max(
        loads.max_lin + comm2,
        loads.max_lin_att,
        _busy(mean_lin - lin_k / n, mean_att - att_k / n, comm2),
    )
    # The exact distributed cost is O(log) to compute: try its lower bounds first (the linear
    # part alone, then the cheap bound of the whole).
    return (
        as_dist + lin_k / n < as_local
        and as_dist + c.distributed_lower_bound(sid) < as_local
        and as_dist + c.distributed(sid) < as_local
        and loads.max_tokens + state.reserved + c.shard(sid) <= state.cap
    )


def _busy(linear: float, attention: float, comm: float) -> float:
    """Seconds of a rank without the distributed compute: its linear work plus the larger of
    its local attention and the K/V communication that runs beside it."""
    return linear + (attention if attention > comm else comm)


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


@dataclass(frozen=True)
class Move:
    """One step of the local search (:func:`_improve`).

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


def _improve(state: CpGroupState, max_moves: int) -> None:
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
        new_b = _busy(linear[b] - lin, attn[b] - att, comm)
        for r in ranked:
            if r == b or tokens[r] + s > room:
                continue
            new_r = _busy(linear[r] + lin, attn[r] + att, comm)
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
        new_b = _busy(linear[b] - c.linear(sid), attn[b] - c.local_attention(sid), comm2)
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
        target = min(fits, key=lambda r: _busy(linear[r], attn[r], comm2))
        new_t = _busy(linear[target] + c.linear(sid), attn[target] + c.local_attention(sid), comm2)
        lin_o = l2 if target == l1_at else l1
        la_o = la2 if target == la1_at else la1
        value = max(lin_o + comm2, la_o, new_t) + dc - dq
        if value < beat:
            beat, best = value, (value, Move("gather", sid, DISTRIBUTED, target, start - value))
    return best
