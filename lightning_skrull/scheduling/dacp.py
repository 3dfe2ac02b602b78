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
   repeat until nothing helps.
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
        return [
            lin + (a if a > comm else comm) for lin, a in zip(self.linear, self.attn, strict=True)
        ]

    def rank_time(self, rank: int, comm: float) -> float:
        """Estimated seconds of one rank without the shared distributed compute."""
        a = self.attn[rank]
        return self.linear[rank] + (a if a > comm else comm)

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
        if _paper_rule_gives_up(base, rest, give_up):
            return best.placement(ids)
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
    c = base.costs
    n, lengths, local = base.n, c.lengths, c.local_table
    m = len(rest)
    if m < 2:
        return None
    lin_of, att_of = c.linear_table, c.local_attention_table
    suffix_lin, suffix_att = tails  # seconds of rest[i:], all local
    lin0 = sum(base.linear)
    att0 = sum(base.attn)
    best_k, best_value = 0, math.inf
    dist, tokens = base.dist_compute, base.dist_tokens
    for k in range(m + 1):
        if k:
            sid = rest[k - 1]
            dist += c.distributed_lower_bound(sid)
            tokens += lengths[sid]
        longest = local[rest[k]] if k < m else 0.0
        if k + n < m:  # n + 1 sequences on n ranks: two of them share one
            longest = max(longest, local[rest[k + n - 1]] + local[rest[k + n]])
        comm = c.comm(tokens)
        mean_att = (att0 + suffix_att[k]) / n
        mean = (lin0 + suffix_lin[k]) / n + (mean_att if mean_att > comm else comm)
        value = dist + (mean if mean > longest else longest)
        if value < best_value:
            best_k, best_value = k, value
    if best_k in (0, m) or best_value >= beat * (1.0 - _REL_GAIN):
        return None
    # Spread the rest on plain lists first; build the state only if the result wins. The
    # estimate only grows while spreading (each rank's load, the communication and the
    # distributed compute), so the spreading stops as soon as it reaches ``beat``.
    beat *= 1.0 - _REL_GAIN
    linear, attn, tokens_of = list(base.linear), list(base.attn), list(base.tokens)
    shards = list(rest[:best_k])
    reserved = base.reserved + sum(c.shard(sid) for sid in shards)
    if max(tokens_of) + reserved > base.cap:
        return None
    dist_tokens = base.dist_tokens + sum(lengths[sid] for sid in shards)
    comm = c.comm(dist_tokens)
    dist = base.dist_compute + sum(c.distributed(sid) for sid in shards)
    top = max(lin + (a if a > comm else comm) for lin, a in zip(linear, attn, strict=True))
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
            top = max(top, lin + (a if a > comm else comm))
        elif max(tokens_of) + reserved + c.shard(sid) <= base.cap:
            shards.append(sid)
            reserved += c.shard(sid)
            dist_tokens += s
            comm = c.comm(dist_tokens)
            dist += c.distributed(sid)
            top = max(lin + (a if a > comm else comm) for lin, a in zip(linear, attn, strict=True))
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
    lin_of, att_of, local = costs.linear_table, costs.local_attention_table, costs.local_table
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
        # The bound of _split_longest, spelled out here too: this loop is a hot path.
        longest = local[rest[k]] if k < m else 0.0
        if k + n < m:  # n + 1 sequences on n ranks: two of them share one
            longest = max(longest, local[rest[k + n - 1]] + local[rest[k + n]])
        comm = costs.comm(tokens)
        mean_att = attention / n
        mean = linear / n + (mean_att if mean_att > comm else comm)
        value = dist_compute + (mean if mean > longest else longest)
        if value < best:
            best = value
        if mean >= longest:
            break
    return costs.cost_model.micro_batch_overhead_s + best


def _paper_rule_gives_up(base: CpGroupState, rest: Sequence[int], give_up_at: float) -> bool:
    """Whether :func:`_greedy` with the paper's rule, started from ``base``, stops by its first
    local placement, answered without building anything.

    Until a sequence stays whole, every rank holds only the shards, so the rule distributes each
    sequence that does not fit next to them (failing when even its shard does not fit) and keeps
    the first one that fits whole on rank 0, giving up when that rank plus the distributed compute
    reaches ``give_up_at``; this replays exactly that prefix.
    """
    c = base.costs
    lengths, cap = c.lengths, base.cap
    reserved, dist_tokens, dist_compute = base.reserved, base.dist_tokens, base.dist_compute
    n, comm_fixed, per_token = base.n, c.comm_fixed, c.comm_per_token
    for sid in rest:
        s = lengths[sid]
        if s + reserved <= cap:
            comm = c.comm(dist_tokens)
            att = c.local_attention(sid)
            first = c.linear(sid) + (att if att > comm else comm)
            return first + dist_compute >= give_up_at
        shard = -(-s // n)  # c.shard(sid), inlined as below: this loop runs per micro-batch
        if reserved + shard > cap:
            return True  # nothing local to roll back: the construction fails
        reserved += shard
        dist_tokens += s
        dist_compute += c.distributed(sid)
        if comm_fixed + per_token * dist_tokens + dist_compute >= give_up_at:  # c.comm(...)
            return True
    return False


def _greedy(
    state: CpGroupState,
    rest: Sequence[int],
    look_ahead: bool,
    give_up_at: float | None = None,
    tails: tuple[list[float], list[float]] | None = None,
    most_free: bool = False,
) -> bool:
    """Place ``rest`` (longest first), choosing local or distributed by a look-ahead estimate.

    The estimate of the finished micro-batch is the larger of the slowest rank so far and the
    mean rank time once every remaining sequence is placed locally (a lower bound of what is
    left to balance), plus the distributed compute. Keeping a sequence local is chosen on
    ties; a sequence that fits no rank whole is distributed, or a local one is rolled back.

    ``tails`` is :func:`_tails` of ``rest``, when the caller already has it. With
    ``most_free``, a sequence whose least-loaded rank has no room goes to the rank with most
    free tokens (the paper's rule) instead of the least-loaded rank with room.

    Returns:
        ``False`` when the micro-batch cannot fit, or when the estimate so far (slowest rank
        plus distributed compute) reaches ``give_up_at``.
    """
    if give_up_at is None:
        give_up_at = math.inf
    costs, n, cap = state.costs, state.n, state.cap
    lengths = costs.lengths
    tokens, linear, attn, where = state.tokens, state.linear, state.attn, state.where
    # Linear and attention seconds of the sequences from position i on (all assumed local).
    tail_lin, tail_att = _tails(rest, costs) if tails is None else tails
    lin_of, att_of = costs.linear_table, costs.local_attention_table
    comm_fixed, comm_per_token = costs.comm_fixed, costs.comm_per_token
    comm = costs.comm(state.dist_tokens)
    times: list[float] | None = state.rank_times(comm)
    # max over ranks of linear + max(c, attention) == max(max_lin + c, max_lin_att) for any c.
    max_lin = max(linear)
    max_lin_att = max(lin + a for lin, a in zip(linear, attn, strict=True))
    sum_lin, sum_att = sum(linear), sum(attn)
    min_tokens = min(tokens)
    max_tokens = max(tokens)  # CpGroupState.can_distribute, inlined below: a hot path
    # Until a sequence stays whole, every rank's linear and attention seconds are exactly 0, so
    # every rank's time is the communication and the first minimum is rank 0: on long-sequence
    # data most micro-batches distribute everything, and recomputing each rank's time after
    # every shard dominated.
    all_empty = not (any(tokens) or any(linear) or any(attn))
    members = state.members
    can_give_up = give_up_at != math.inf
    for i, sid in enumerate(rest):
        s = lengths[sid]
        lin_k, att_k = lin_of[sid], att_of[sid]
        while True:
            if min_tokens + state.reserved + s > cap:
                rank = -1  # fits no rank whole
            elif all_empty:
                rank = 0  # every rank has room (min_tokens is every rank's tokens)
            else:
                if times is None:  # the communication changed: every rank's time did
                    times = state.rank_times(comm)
                rank = times.index(min(times))  # first minimum: lowest rank on ties
                if tokens[rank] + state.reserved + s > cap:
                    if most_free:  # the paper's choice: most free tokens, lowest rank on ties
                        rank = tokens.index(min_tokens)
                    else:
                        rank = _least_loaded_with_room(state, sid, times)
            go_local = rank >= 0
            if go_local and look_ahead:
                # Mean rank time once everything left is placed locally (a lower bound).
                mean_lin = (sum_lin + tail_lin[i]) / n
                mean_att = (sum_att + tail_att[i]) / n
                a = attn[rank] + att_k
                top = max_lin + comm  # the slowest rank so far
                if max_lin_att > top:
                    top = max_lin_att
                new_rank = linear[rank] + lin_k + (a if a > comm else comm)
                mean = mean_lin + (mean_att if mean_att > comm else comm)
                # Sharding cannot win when keeping it whole leaves the estimate at ``top``:
                # the sharded estimate is at least ``top`` plus the sequence's linear share.
                if new_rank > top or mean > top:
                    as_local = max(top, new_rank, mean)
                    mean_lin -= lin_k / n
                    mean_att -= att_k / n
                    comm2 = comm_fixed + comm_per_token * (state.dist_tokens + s)  # costs.comm
                    as_dist = max(
                        max_lin + comm2,
                        max_lin_att,
                        mean_lin + (mean_att if mean_att > comm2 else comm2),
                    )
                    # The exact distributed cost is O(log) to compute: try its lower bounds
                    # first (the linear part alone, then the cheap bound of the whole).
                    if (
                        as_dist + lin_k / n < as_local
                        and as_dist + costs.distributed_lower_bound(sid) < as_local
                        and as_dist + costs.distributed(sid) < as_local
                        and max_tokens + state.reserved - (-s // n) <= cap
                    ):
                        go_local = False
                        state.chosen_shards += 1
                        state.chosen_local_max = max(state.chosen_local_max, lin_k + att_k)
            if go_local:
                if times is None:
                    times = state.rank_times(comm)
                all_empty = False
                if tokens[rank] == min_tokens:
                    tokens[rank] += s
                    min_tokens = min(tokens)
                else:
                    tokens[rank] += s
                if tokens[rank] > max_tokens:
                    max_tokens = tokens[rank]
                lin = linear[rank] = linear[rank] + lin_k
                a = attn[rank] = attn[rank] + att_k
                where[sid] = rank
                members[rank].append(sid)
                times[rank] = lin + (a if a > comm else comm)
                max_lin = lin if lin > max_lin else max_lin
                max_lin_att = lin + a if lin + a > max_lin_att else max_lin_att
                sum_lin += lin_k
                sum_att += att_k
                if (
                    can_give_up
                    and max(max_lin + comm, max_lin_att) + state.dist_compute >= give_up_at
                ):
                    return False
                break
            # rank >= 0: checked above
            if rank >= 0 or max_tokens + state.reserved - (-s // n) <= cap:
                state.put_distributed(sid)  # local ranks unchanged: only comm moves
                comm = costs.comm(state.dist_tokens)
                times = None
                if (
                    can_give_up
                    and max(max_lin + comm, max_lin_att) + state.dist_compute >= give_up_at
                ):
                    return False
                break
            if not state.roll_back():
                return False
            comm = costs.comm(state.dist_tokens)
            times = None
            min_tokens = min(tokens)
            max_tokens = max(tokens)
            max_lin = max(linear)
            max_lin_att = max(lin + a for lin, a in zip(linear, attn, strict=True))
            sum_lin, sum_att = sum(linear), sum(attn)
    return True


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


def _improve(state: CpGroupState, max_moves: int) -> None:
    """Apply the best improving move until none improves (or ``max_moves`` were made).

    Moves, all evaluated exactly with the micro-batch estimate: (a) move a local sequence of
    the slowest rank to the least-loaded rank with room; (b) distribute one of the two
    longest local sequences of the slowest rank; (c) bring a distributed sequence back whole
    onto the rank where it ends soonest.
    """
    c, n, cap = state.costs, state.n, state.cap
    lengths = c.lengths
    linear, attn, tokens = state.linear, state.attn, state.tokens
    for _ in range(max_moves):
        comm = c.comm(state.dist_tokens)
        dc = state.dist_compute
        times = [lin + (a if a > comm else comm) for lin, a in zip(linear, attn, strict=True)]
        top = max(times)
        b = times.index(top)
        best = (top + dc) * (1.0 - _REL_GAIN)
        move: tuple[int, int, int] | None = None  # (kind, sid, rank): 0 move, 1 shard, 2 back
        room = cap - state.reserved

        # (a) move a local sequence of the slowest rank to the least-loaded rank with room.
        ranked = sorted(range(n), key=times.__getitem__) if state.members[b] else []
        for sid in state.members[b]:
            s = lengths[sid]
            lin, att = c.linear(sid), c.local_attention(sid)
            a = attn[b] - att
            new_b = linear[b] - lin + (a if a > comm else comm)
            for r in ranked:
                if r == b or tokens[r] + s > room:
                    continue
                a = attn[r] + att
                new_r = linear[r] + lin + (a if a > comm else comm)
                value = max(_max_except(times, ranked, b, r), new_b, new_r) + dc
                if value < best:
                    best, move = value, (0, sid, r)
                break
        # (b) distribute one of the two longest local sequences of the slowest rank.
        if state.members[b]:
            others = max((tokens[r] for r in range(n) if r != b), default=0)
            lin_o, _, _ = _two_largest([linear[r] if r != b else -math.inf for r in range(n)])
            la = [linear[r] + attn[r] if r != b else -math.inf for r in range(n)]
            la_o = max(la)
            for sid in descending(state.members[b], lengths)[:2]:
                if others + c.shard(sid) > room:
                    continue
                comm2 = c.comm(state.dist_tokens + lengths[sid])
                a = attn[b] - c.local_attention(sid)
                new_b = linear[b] - c.linear(sid) + (a if a > comm2 else comm2)
                value = max(lin_o + comm2, la_o, new_b) + dc
                # The exact distributed cost takes longer to compute: try its bound first.
                if value + c.distributed_lower_bound(sid) >= best:
                    continue
                value += c.distributed(sid)
                if value < best:
                    best, move = value, (1, sid, -1)
        # (c) bring a distributed sequence back whole onto the rank where it ends soonest.
        if state.distributed:
            l1, l1_at, l2 = _two_largest(linear)
            la_all = [lin + a for lin, a in zip(linear, attn, strict=True)]
            la1, la1_at, la2 = _two_largest(la_all)
            min_la, min_lin = min(la_all), min(linear)
            dist_tokens, local_of, lin_of = state.dist_tokens, c.local_table, c.linear_table
            comm_fixed, per_token = c.comm_fixed, c.comm_per_token
            for sid in state.distributed:
                s = lengths[sid]
                if s > cap:
                    continue
                dq = c.distributed(sid)
                others = dist_tokens - s  # c.comm(others), inlined: a hot loop
                comm2 = comm_fixed + per_token * others if others else 0.0
                # A lower bound of the move's value below, whichever rank takes it back: the
                # other ranks keep at least the second-largest linear and linear + attention,
                # and the taker ends no sooner than the least-loaded rank plus the sequence.
                # The slack only guards the bound's own rounding.
                bound = max(l2 + comm2, la2, min_la + local_of[sid], min_lin + lin_of[sid] + comm2)
                if (bound + dc - dq) * _BOUND_SLACK >= best:
                    continue
                need = s - c.shard(sid)  # its shard leaves every rank
                target, target_t = -1, math.inf
                for r in range(n):
                    if tokens[r] + need <= room:
                        a = attn[r]
                        t = linear[r] + (a if a > comm2 else comm2)
                        if t < target_t:
                            target, target_t = r, t
                if target < 0:
                    continue
                a = attn[target] + c.local_attention(sid)
                new_t = linear[target] + c.linear(sid) + (a if a > comm2 else comm2)
                lin_o = l2 if target == l1_at else l1
                la_o = la2 if target == la1_at else la1
                value = max(lin_o + comm2, la_o, new_t) + dc - dq
                if value < best:
                    best, move = value, (2, sid, target)
        if move is None:
            return
        kind, sid, rank = move
        if kind == 0:
            state.take_local(sid)
            state.put_local(sid, rank)
        elif kind == 1:
            state.take_local(sid)
            state.put_distributed(sid)
        else:
            state.take_distributed(sid)
            state.put_local(sid, rank)
