"""DACP: place the sequences of one micro-batch on a CP group (local or distributed).

Cost-aware version of the paper's Algorithm 1. The paper only shards a sequence when memory
forces it; here a sequence is also sharded when that lowers the micro-batch's estimated time
(one long local sequence would leave the other CP ranks idle), kept local when sharding costs
more than it balances (tiny chunks waste attention tiles and every distributed token pays
communication), and moved between ranks when that lowers the slowest rank.

Steps, for a micro-batch of sequences and a CP group of ``N`` ranks with ``C`` tokens each:

1. Sequences longer than ``C`` must be distributed.
2. Longest first, a sequence whose local work exceeds the mean work per rank is distributed
   when the estimate says the micro-batch gets faster.
3. The others are placed longest first on the CP rank with the lowest estimated time that has
   room (LPT). A sequence that fits nowhere is distributed if every rank has room for its
   shard, else a local sequence is rolled back to distributed and the placement retried.
4. Local search on the slowest rank: move one of its sequences to another rank, distribute one,
   or bring a distributed sequence back to a rank, whichever lowers the estimated micro-batch
   time most; repeat until nothing helps.

The roll-back is the corrected one: turning local sequence ``k`` on rank ``t`` into a
distributed one frees ``S_k - ceil(S_k/N)`` tokens on ``t`` and costs every other rank
``ceil(S_k/N)`` tokens (and ``cost/N`` load); those ranks must still fit. Among the sequences
that can be rolled back, the one that frees most is chosen.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_skrull.scheduling.costs import SequenceCosts
from lightning_skrull.scheduling.plan import DISTRIBUTED

_REL_GAIN = 1e-9
"""A move must lower the estimate by this relative amount (guards against float noise)."""


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
        self.where[sid] = DISTRIBUTED
        self.reserved += c.shard(sid)
        self.dist_tokens += c.lengths[sid]
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
    ids: Sequence[int], costs: SequenceCosts, bucket_size: int
) -> tuple[int, ...] | None:
    """Place one micro-batch with cost-aware DACP.

    Args:
        ids: sequence ids of the micro-batch (each no longer than ``cp_size * bucket_size``).
        costs: cost table of the global batch.
        bucket_size: token budget of one CP rank.

    Returns:
        One placement per id (same order), or ``None`` when the micro-batch cannot fit.
    """
    lengths = costs.lengths
    n = costs.cp_size
    state = CpGroupState(costs, bucket_size)
    order = sorted(ids, key=lambda i: (-lengths[i], i))

    # 1. Sequences longer than one rank's budget must be sharded.
    rest = []
    for sid in order:
        if lengths[sid] > bucket_size:
            state.put_distributed(sid)
        else:
            rest.append(sid)
    if state.reserved > bucket_size:
        return None

    # 2. Shard a sequence whose work alone exceeds a fair share, when the estimate improves.
    if n > 1:
        work = sum(costs.local(sid) for sid in rest)
        kept = []
        for idx, sid in enumerate(rest):
            w = costs.local(sid)
            if w * n <= work:
                kept.extend(rest[idx:])
                break
            comm_now = costs.comm(state.dist_tokens)
            comm_then = costs.comm(state.dist_tokens + lengths[sid])
            as_local = max(w, work / n) + comm_now
            as_dist = (work - w) / n + costs.distributed(sid) + comm_then
            if as_dist < as_local and state.can_distribute(sid):
                state.put_distributed(sid)
                work -= w
            else:
                kept.append(sid)
        rest = kept

    # 3. LPT placement with fallback to sharding and roll-back.
    for sid in rest:
        while True:
            rank = _least_loaded_with_room(state, sid, state.rank_times())
            if rank >= 0:
                state.put_local(sid, rank)
                break
            if state.can_distribute(sid):
                state.put_distributed(sid)
                break
            if not state.roll_back():
                return None

    # 4. Local search on the slowest rank.
    if n > 1:
        _improve(state, max_moves=2 * len(order) + n)
    return state.placement(ids)


def _max_except(times: list[float], ranked: list[int], skip_a: int, skip_b: int) -> float:
    """Largest of ``times`` outside two ranks; ``ranked`` orders ranks by ascending time."""
    for r in reversed(ranked):
        if r != skip_a and r != skip_b:
            return times[r]
    return 0.0


def _improve(state: CpGroupState, max_moves: int) -> None:
    """Apply the best improving move until none improves (or ``max_moves`` were made)."""
    c, n, cap = state.costs, state.n, state.cap
    lengths = c.lengths
    for _ in range(max_moves):
        comm = c.comm(state.dist_tokens)
        times = state.rank_times(comm)
        b = max(range(n), key=times.__getitem__)
        current = times[b] + state.dist_compute
        ranked = sorted(range(n), key=times.__getitem__)
        best = current * (1.0 - _REL_GAIN)
        move: tuple[str, int, int] | None = None

        # (a) move a local sequence of the slowest rank to the least-loaded rank with room.
        for sid in state.members[b]:
            s = lengths[sid]
            lin, att = c.linear(sid), c.local_attention(sid)
            new_b = state.linear[b] - lin + max(comm, state.attn[b] - att)
            for r in ranked:
                if r == b or state.tokens[r] + state.reserved + s > cap:
                    continue
                new_r = state.linear[r] + lin + max(comm, state.attn[r] + att)
                value = max(_max_except(times, ranked, b, r), new_b, new_r) + state.dist_compute
                if value < best:
                    best, move = value, ("move", sid, r)
                break
        # (b) distribute one of the two longest local sequences of the slowest rank.
        longest = sorted(state.members[b], key=lambda i: (-lengths[i], i))[:2]
        for sid in longest:
            shard = c.shard(sid)
            others = max((state.tokens[r] for r in range(n) if r != b), default=0)
            if others + state.reserved + shard > cap:
                continue
            comm2 = c.comm(state.dist_tokens + lengths[sid])
            value = 0.0
            for r in range(n):
                lin, att = state.linear[r], state.attn[r]
                if r == b:
                    lin -= c.linear(sid)
                    att -= c.local_attention(sid)
                value = max(value, lin + max(comm2, att))
            value += state.dist_compute + c.distributed(sid)
            if value < best:
                best, move = value, ("distribute", sid, -1)
        # (c) bring a distributed sequence back whole onto the least-loaded rank with room.
        for sid in state.distributed:
            s = lengths[sid]
            if s > cap:
                continue
            reserved2 = state.reserved - c.shard(sid)
            comm2 = c.comm(state.dist_tokens - s)
            lin_q, att_q = c.linear(sid), c.local_attention(sid)
            times2 = [lin + max(comm2, a) for lin, a in zip(state.linear, state.attn, strict=True)]
            target = -1
            for r in sorted(range(n), key=lambda r: (times2[r], r)):
                if state.tokens[r] + reserved2 + s <= cap:
                    target = r
                    break
            if target < 0:
                continue
            times2[target] = state.linear[target] + lin_q + max(comm2, state.attn[target] + att_q)
            value = max(times2) + state.dist_compute - c.distributed(sid)
            if value < best:
                best, move = value, ("local", sid, target)
        if move is None:
            return
        kind, sid, rank = move
        if kind == "move":
            state.take_local(sid)
            state.put_local(sid, rank)
        elif kind == "distribute":
            state.take_local(sid)
            state.put_distributed(sid)
        else:
            state.take_distributed(sid)
            state.put_local(sid, rank)
