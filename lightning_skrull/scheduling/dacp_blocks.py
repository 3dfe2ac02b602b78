"""DACP's block step: shard each sequence over the smallest aligned block of the CP group that
serves it (``PlannerOptions.dacp_blocks``).

The other steps choose, per sequence, between one CP rank and the whole group. Sharded over
the whole group, a sequence's K/V exchange reaches every rank, and when the group spans nodes
it crosses the inter-node links in every layer. Over a block of ``d`` ranks (a
:class:`~lightning_skrull.scheduling.plan.CpBlock`: ``d`` divides ``cp_size``, aligned) only
the block's ranks exchange it, over the links the block spans, and each of them holds
``ceil(length / d)`` of its tokens.

:func:`place_blocks` starts from the placement the other steps chose and builds a second
one with :class:`BlockBuilder`, longest first: each sequence goes whole to one rank, to one
block of each allowed size, or to the whole group, whichever gives the lowest look-ahead
estimate of the finished micro-batch. The estimate is the larger of the slowest rank so far
and the mean rank once the sequences still to place are spread evenly (their compute on the
whole group), plus the whole-group sequences' compute; every rank keeps room for the
still-undecided sequences' whole-group shares, so the memory check never fails late and a
sequence can always fall back to the whole group. Twice: with the other steps' local
sequences kept where they are (only their shards choose), and with every sequence choosing
(a local sequence may go to a block). The placement with the lowest estimate of the three is
kept, so the step never makes a micro-batch slower under the one-group estimate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_skrull.scheduling.kv_groups import choose_kv_groups
from lightning_skrull.scheduling.plan import (
    DISTRIBUTED,
    CpBlock,
    MicroBatchPlan,
    Placement,
    block_sizes_of,
)
from lightning_skrull.scheduling.sequence_costs import SequenceCosts, descending
from lightning_skrull.scheduling.simulate import micro_batch_terms

_REL_GAIN = 1e-9
"""A block placement must beat the other steps' estimate by this relative amount."""


class BlockBuilder:
    """Per-rank bookkeeping while :func:`place_blocks` builds a placement with blocks.

    Rank ``j``'s time (whole-group compute aside) is ``linear[j] + max(attention[j], comm +
    block_comm[j]) + block_attention[j]``: its local and block linear work, its exchanges
    beside its local attention, then its block attention (the one-group case of
    :func:`~lightning_skrull.scheduling.cost_model.block_rank_times`).

    Args:
        costs: the global batch's cost table.
        bucket_size: token budget of one CP rank.
        undecided: the sequences still to place; their whole-group shares are reserved.
    """

    def __init__(self, costs: SequenceCosts, bucket_size: int, undecided: Sequence[int]) -> None:
        n = costs.cp_size
        self.c, self.n, self.cap = costs, n, bucket_size
        self.sizes = block_sizes_of(n)
        self.tokens = [0] * n
        self.linear = [0.0] * n
        self.attn = [0.0] * n
        self.block_comm = [0.0] * n
        self.block_attn = [0.0] * n
        self.block_tokens = {d: [0] * (n // d) for d in self.sizes}
        self.where: dict[int, Placement] = {}
        self.reserved = sum(costs.shard(sid) for sid in undecided)
        self.rest = sum(costs.distributed(sid) for sid in undecided)
        self.wg_tokens = 0
        self.wg_compute = 0.0
        self.comm = 0.0

    def fits(self) -> bool:
        """Whether every rank has room for the reserved shares."""
        return max(self.tokens) + self.reserved <= self.cap

    def times(self, comm: float) -> list[float]:
        """Every rank's time with whole-group exchange ``comm``."""
        return [
            lin + (a if a > comm + b else comm + b) + ba
            for lin, a, b, ba in zip(
                self.linear, self.attn, self.block_comm, self.block_attn, strict=True
            )
        ]

    def estimate(self) -> float:
        """Seconds of the micro-batch as placed (all decided; no overhead)."""
        return max(self.times(self.comm)) + self.wg_compute

    # ------------------------------------------------------------------ placing
    def put_local(self, sid: int, rank: int) -> None:
        """Keep ``sid`` whole on ``rank`` (its share was not reserved)."""
        c = self.c
        self.where[sid] = rank
        self.tokens[rank] += c.lengths[sid]
        self.linear[rank] += c.linear(sid)
        self.attn[rank] += c.local_attention(sid)

    def decide(self, sid: int, where: Placement) -> None:
        """Place undecided ``sid`` (its whole-group share is reserved) at ``where``."""
        c = self.c
        self.rest -= c.distributed(sid)
        self.where[sid] = where
        if where == DISTRIBUTED:
            self.wg_tokens += c.lengths[sid]
            self.wg_compute += c.distributed(sid)
            self.comm = c.comm(self.wg_tokens)
            return
        self.reserved -= c.shard(sid)
        if isinstance(where, CpBlock):
            self._put_block(sid, where)
        else:
            self.put_local(sid, where)

    def _put_block(self, sid: int, block: CpBlock) -> None:
        c, d = self.c, block.size
        lin, att = c.block_costs(sid, d)
        k = block.start // d
        before = self.block_tokens[d][k]
        self.block_tokens[d][k] = before + c.lengths[sid]
        extra = c.exchange(before + c.lengths[sid], block.start, d)
        extra -= c.exchange(before, block.start, d)
        share = c.shard_at(sid, d)
        for j in block.ranks:
            self.tokens[j] += share
            self.linear[j] += lin
            self.block_attn[j] += att
            self.block_comm[j] += extra

    # ------------------------------------------------------------------ choosing
    def best(self, sid: int) -> Placement:
        """Where ``sid`` gives the lowest look-ahead estimate (module docstring): whole on a
        rank, on a block, or on the whole group; the earlier of those on ties.

        Kept whole, ``sid`` needs no other option when that leaves the estimate at the
        previous slowest rank or at its own mean: a block or the whole group adds at least
        the same compute to the ranks (tile waste, per-sequence cost and exchange come on
        top), so it cannot end lower.
        """
        c, n = self.c, self.n
        rest = self.rest - c.distributed(sid)
        times = self.times(self.comm)
        total = sum(times)
        free = self.cap - self.reserved + c.shard(sid)  # room once its share is released
        prefix, suffix = [0.0] * (n + 1), [0.0] * (n + 1)
        for j in range(n):
            prefix[j + 1] = max(prefix[j], times[j])
            suffix[n - 1 - j] = max(suffix[n - j], times[n - 1 - j])
        local_value, rank, local_mean = self._best_local(sid, times, total, free, rest)
        if rank is not None and local_value <= max(prefix[n], local_mean) + self.wg_compute:
            return rank
        best_value = self._whole_group(sid, rest)
        best_where: Placement = DISTRIBUTED
        found: list[tuple[float, Placement | None]] = [(local_value, rank)]
        for d in self.sizes:
            found.append(self._best_block(sid, d, times, total, prefix, suffix, free, rest))
        for value, where in found:
            if where is not None and value < best_value:
                best_value, best_where = value, where
        return best_where

    def _whole_group(self, sid: int, rest: float) -> float:
        """The look-ahead estimate with ``sid`` on the whole group."""
        c = self.c
        times = self.times(c.comm(self.wg_tokens + c.lengths[sid]))
        top, mean = max(times), sum(times) / self.n + rest
        return (top if top > mean else mean) + self.wg_compute + c.distributed(sid)

    def _best_local(
        self, sid: int, times: list[float], total: float, free: int, rest: float
    ) -> tuple[float, int | None, float]:
        """``(estimate, rank, mean part)`` with ``sid`` whole on its best rank with room
        (``(inf, None, inf)`` when none has room). Every rank's time only grows, so the rank
        is the one whose new time is least (its mean part is then least too)."""
        c, comm = self.c, self.comm
        s, lin, att = c.lengths[sid], c.linear(sid), c.local_attention(sid)
        best_new, best_rank = math.inf, None
        for r in range(self.n):
            if self.tokens[r] + s > free:
                continue
            a, b = self.attn[r] + att, comm + self.block_comm[r]
            new = self.linear[r] + lin + (a if a > b else b) + self.block_attn[r]
            if new < best_new:
                best_new, best_rank = new, r
        if best_rank is None:
            return math.inf, None, math.inf
        top = max(max(times), best_new)
        mean = (total - times[best_rank] + best_new) / self.n + rest
        return (top if top > mean else mean) + self.wg_compute, best_rank, mean

    def _best_block(
        self,
        sid: int,
        d: int,
        times: list[float],
        total: float,
        prefix: list[float],
        suffix: list[float],
        free: int,
        rest: float,
    ) -> tuple[float, Placement | None]:
        """``(estimate, block)`` with ``sid`` on its best block of ``d`` ranks with room."""
        c, comm = self.c, self.comm
        share, s = c.shard_at(sid, d), c.lengths[sid]
        lin, att = c.block_costs(sid, d)
        tokens, linear, attn = self.tokens, self.linear, self.attn
        block_comm, block_attn = self.block_comm, self.block_attn
        best: tuple[float, Placement | None] = (math.inf, None)
        for k, before in enumerate(self.block_tokens[d]):
            lo, hi = k * d, k * d + d
            if max(tokens[lo:hi]) + share > free:
                continue
            extra = comm + c.exchange(before + s, lo, d) - c.exchange(before, lo, d)
            new = [
                x + lin + (a if a > b + extra else b + extra) + ba + att
                for x, a, b, ba in zip(
                    linear[lo:hi], attn[lo:hi], block_comm[lo:hi], block_attn[lo:hi], strict=True
                )
            ]
            top = max(prefix[lo], suffix[hi], max(new))
            mean = (total + sum(new) - sum(times[lo:hi])) / self.n + rest
            value = (top if top > mean else mean) + self.wg_compute
            if value < best[0]:
                best = (value, CpBlock(start=lo, size=d))
        return best

    def placement(self, ids: Sequence[int]) -> tuple[Placement, ...]:
        """Placement of ``ids`` in that order."""
        return tuple(self.where[sid] for sid in ids)


def one_group_estimate(
    ids: Sequence[int], placement: Sequence[Placement], costs: SequenceCosts, bucket_size: int
) -> float:
    """The one-group estimate (no overhead) of a placement without blocks."""
    builder = BlockBuilder(costs, bucket_size, ())
    for sid, where in zip(ids, placement, strict=True):
        if where == DISTRIBUTED:
            builder.rest += costs.distributed(sid)
            builder.decide(sid, DISTRIBUTED)
        else:
            builder.put_local(sid, where)  # type: ignore[arg-type]
    return builder.estimate()


def _build(ids: Sequence[int], costs: SequenceCosts, bucket_size: int) -> BlockBuilder | None:
    """A placement of ``ids`` built longest first (module docstring); ``None`` when their
    whole-group shares do not fit a rank."""
    builder = BlockBuilder(costs, bucket_size, ids)
    if not builder.fits():
        return None
    for sid in descending(ids, costs.lengths):
        builder.decide(sid, builder.best(sid))
    return builder


def place_blocks(
    ids: Sequence[int],
    placement: Sequence[Placement],
    costs: SequenceCosts,
    bucket_size: int,
    *,
    kv_groups: bool,
    min_gain: float,
) -> tuple[Placement, ...]:
    """The block step on a placement of ``ids`` without blocks (module docstring): a placement
    with blocks where it is faster, else ``placement`` itself.

    Skipped where the one-group estimate is within ``min_gain`` of the mean rank's compute
    with every sequence whole (no placement does better). With ``kv_groups``, the winner is
    judged again with the K/V groups each placement gets (the one-group estimate cannot see
    the whole group's exchange hidden behind its distributed attention).
    """
    if not block_sizes_of(costs.cp_size) or not ids:
        return tuple(placement)
    start = one_group_estimate(ids, placement, costs, bucket_size)
    grouped = kv_groups and DISTRIBUTED in placement
    before = _grouped_seconds(ids, placement, costs) if grouped else start
    if before <= compute_floor(ids, costs, bucket_size) * (1.0 + min_gain):
        return tuple(placement)
    built = _build(ids, costs, bucket_size)
    if built is None or built.estimate() >= start * (1.0 - _REL_GAIN):
        return tuple(placement)
    out = built.placement(ids)
    if grouped and before <= _grouped_seconds(ids, out, costs):
        return tuple(placement)
    return out


def compute_floor(ids: Sequence[int], costs: SequenceCosts, bucket_size: int) -> float:
    """Mean rank compute of the micro-batch at its cheapest: every sequence whole, or one
    longer than ``bucket_size`` on the smallest block (or the whole group) its shard fits."""
    total = 0.0
    sizes = (*block_sizes_of(costs.cp_size), costs.cp_size)
    for sid in ids:
        if costs.lengths[sid] <= bucket_size:
            total += costs.local_table[sid]
            continue
        d = next((d for d in sizes if costs.shard_at(sid, d) <= bucket_size), costs.cp_size)
        lin, att = costs.block_costs(sid, d)
        total += d * (lin + att)
    return total / costs.cp_size


def _grouped_seconds(
    ids: Sequence[int], placement: Sequence[Placement], costs: SequenceCosts
) -> float:
    """Seconds of the micro-batch with the K/V groups :func:`choose_kv_groups` gives it."""
    mb = MicroBatchPlan(tuple(ids), tuple(placement), cp_size=costs.cp_size)
    model = costs.cost_model
    seconds = micro_batch_terms(choose_kv_groups(mb, costs), costs, model).seconds
    return seconds - model.micro_batch_overhead_s
