"""DACP's greedy pass: the paper's Algorithm 1 with the corrected roll-back, fast.

:class:`CpGroupState` is a CP group's token and time bookkeeping while one micro-batch is
placed. :func:`greedy` places sequences one at a time, in the order given: whole on a rank, or
sharded over the group, or, when neither fits, after rolling a local sequence back to sharded
(:meth:`CpGroupState.roll_back`). Shortest first, with ``most_free`` and without
``look_ahead``, it is the paper's Algorithm 1, which
:mod:`~lightning_skrull.scheduling.dacp_reference` spells out readably (a property test holds
the two equal). With ``look_ahead`` it is step 2 of the cost-aware DACP
(:mod:`~lightning_skrull.scheduling.dacp`): it also shards a sequence that fits a rank whole
when the look-ahead estimate of the finished micro-batch says sharding is faster
(:func:`_shard_pays`).

The roll-back is the corrected one: turning local sequence ``k`` on rank ``t`` into a
distributed one frees ``S_k - ceil(S_k/N)`` tokens on ``t`` and costs every other rank
``ceil(S_k/N)`` tokens (and ``cost/N`` load); those ranks must still fit. Among the sequences
that can be rolled back, the one that frees most is chosen.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_skrull.scheduling.plan import DISTRIBUTED
from lightning_skrull.scheduling.sequence_costs import SequenceCosts


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
        return [busy(lin, a, comm) for lin, a in zip(self.linear, self.attn, strict=True)]

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


def tail_seconds(rest: Sequence[int], costs: SequenceCosts) -> tuple[list[float], list[float]]:
    """Linear and attention seconds of ``rest[i:]``, every one kept whole, for each ``i``
    (``len(rest) + 1`` entries, the last 0)."""
    lin_of, att_of = costs.linear_table, costs.local_attention_table
    tail_lin = [0.0] * (len(rest) + 1)
    tail_att = [0.0] * (len(rest) + 1)
    for i in range(len(rest) - 1, -1, -1):
        tail_lin[i] = tail_lin[i + 1] + lin_of[rest[i]]
        tail_att[i] = tail_att[i + 1] + att_of[rest[i]]
    return tail_lin, tail_att


class _Loads:
    """Running extremes and sums of the ranks' local load while :func:`greedy` places.

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


def greedy(
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

    ``tails`` is :func:`tail_seconds` of ``rest``, when the caller already has it. With
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
        tails = tail_seconds(rest, costs)
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
                times[rank] = busy(state.linear[rank], state.attn[rank], comm)
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


def _least_loaded_with_room(state: CpGroupState, sid: int, times: list[float]) -> int:
    """Rank with the lowest time that can take ``sid`` whole, or -1 (ties: lowest rank)."""
    need = state.costs.lengths[sid] + state.reserved
    best, best_t = -1, 0.0
    for r, t in enumerate(times):
        if state.tokens[r] + need <= state.cap and (best < 0 or t < best_t):
            best, best_t = r, t
    return best


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
    sequences ``tails`` (:func:`tail_seconds`) was made of."""
    c, n = state.costs, state.n
    lin_k, att_k = c.linear(sid), c.local_attention(sid)
    mean_lin = (loads.sum_lin + tails[0][i]) / n
    mean_att = (loads.sum_att + tails[1][i]) / n
    top = loads.slowest(comm)  # the slowest rank so far
    new_rank = busy(state.linear[rank] + lin_k, state.attn[rank] + att_k, comm)
    mean = busy(mean_lin, mean_att, comm)
    # Sharding cannot win when keeping it whole leaves the estimate at ``top``: the sharded
    # estimate is at least ``top`` plus the sequence's linear share.
    if not (new_rank > top or mean > top):
        return False
    as_local = max(top, new_rank, mean)
    comm2 = c.comm(state.dist_tokens + c.lengths[sid])
    as_dist = max(
        loads.max_lin + comm2,
        loads.max_lin_att,
        busy(mean_lin - lin_k / n, mean_att - att_k / n, comm2),
    )
    # The exact distributed cost is O(log) to compute: try its lower bounds first (the linear
    # part alone, then the cheap bound of the whole).
    return (
        as_dist + lin_k / n < as_local
        and as_dist + c.distributed_lower_bound(sid) < as_local
        and as_dist + c.distributed(sid) < as_local
        and loads.max_tokens + state.reserved + c.shard(sid) <= state.cap
    )


def busy(linear: float, attention: float, comm: float) -> float:
    """Seconds of a rank without the distributed compute: its linear work plus the larger of
    its local attention and the K/V communication that runs beside it."""
    return linear + (attention if attention > comm else comm)
