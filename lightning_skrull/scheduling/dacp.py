"""DACP: place the sequences of one micro-batch on a CP group (local or distributed).

Cost-aware version of the paper's Algorithm 1. The paper only shards a sequence when memory
forces it; here a sequence is also sharded when that lowers the micro-batch's estimated time
(one long local sequence would leave the other CP ranks idle), kept local when sharding costs
more than it balances (tiny chunks waste attention tiles and every distributed token pays
communication).

Steps, for a micro-batch of sequences and a CP group of ``N`` ranks with ``C`` tokens each:

1. Sequences longer than ``C`` must be distributed.
2. Longest first, each sequence goes whole to the least-loaded rank with room, or is
   distributed, whichever gives the lower look-ahead estimate of the finished micro-batch
   (slowest rank so far vs. mean rank time once everything left is placed). A sequence that
   fits no rank whole is distributed if every rank has room for its shard, else a local
   sequence is rolled back to distributed and the sequence retried.
3. Should step 2 leave a sequence no room (its choices took the space), the micro-batch is
   placed again, longest first, sharding only what memory forces.

The roll-back is the corrected one: turning local sequence ``k`` on rank ``t`` into a
distributed one frees ``S_k - ceil(S_k/N)`` tokens on ``t`` and costs every other rank
``ceil(S_k/N)`` tokens (and ``cost/N`` load); those ranks must still fit. Among the sequences
that can be rolled back, the one that frees most is chosen.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_skrull.scheduling.options import DEFAULT_OPTIONS, PlannerOptions
from lightning_skrull.scheduling.plan import DISTRIBUTED
from lightning_skrull.scheduling.sequence_costs import SequenceCosts, ascending, descending


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
        return _place_paper(ids, costs, bucket_size)
    forced = _forced(ids, costs, bucket_size)
    if forced is None:
        return None
    base, rest = forced
    state = base.copy()
    if _greedy(state, rest, look_ahead=True):
        return state.placement(ids)
    # Sequences sharded by choice can leave a later one no room, where sharding only what
    # memory forces fits; this is the same forced state's last use, so no copy.
    if _greedy(base, rest, look_ahead=False):
        return base.placement(ids)
    return None


def _place_paper(
    ids: Sequence[int], costs: SequenceCosts, bucket_size: int
) -> tuple[int, ...] | None:
    """The paper's Algorithm 1: shortest first, shard only when no rank fits the sequence
    whole, corrected roll-back."""
    state = CpGroupState(costs, bucket_size)
    if not _greedy(state, ascending(ids, costs.lengths), look_ahead=False, most_free=True):
        return None
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


def estimate_micro_batch(ids: Sequence[int], costs: SequenceCosts, bucket_size: int) -> float:
    """Quick estimate of one micro-batch of ``ids`` (fixed overhead included), without placing it.

    Sequences longer than ``bucket_size`` are distributed; of the others the ``k`` longest are
    distributed too and the rest stay whole, and the estimate is the least over ``k`` of
    :func:`_split_bound` (distributed compute, plus the larger of the mean rank and the
    slowest rank that whole sequences force). Distributing one more sequence adds at
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
    most_free: bool = False,
) -> bool:
    """Place ``rest`` in order, choosing local or distributed by a look-ahead estimate.

    The estimate of the finished micro-batch is the larger of the slowest rank so far and the
    mean rank time once every remaining sequence is placed locally (a lower bound of what is
    left to balance), plus the distributed compute (:func:`_shard_pays`). Keeping a sequence
    local is chosen on ties; a sequence that fits no rank whole is distributed, or a local one
    is rolled back. Without ``look_ahead`` only memory makes a sequence distributed.

    With ``most_free``, a sequence whose least-loaded rank has no room goes to the rank with most
    free tokens (the paper's rule) instead of the least-loaded rank with room.

    Returns:
        ``False`` when the micro-batch cannot fit.
    """
    costs, cap = state.costs, state.cap
    tails = _tails(rest, costs) if look_ahead else None
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
