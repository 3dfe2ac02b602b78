"""Plan data types shared by every scheduling policy.

A plan never touches torch or torch.distributed: it is plain, hashable data that every rank
computes identically from the sequence lengths of one global batch.
"""

from __future__ import annotations

import hashlib
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

Policy = Literal["skrull", "dacp", "static", "sorted", "round_robin"]
"""Names of the planning policies (see :func:`~lightning_skrull.scheduling.plan_global_batch`)."""

POLICIES: tuple[Policy, ...] = typing.get_args(Policy)
"""Every policy name, in the order of :data:`Policy`."""

DISTRIBUTED = -1
"""Placement value of a sequence sharded over the whole CP group."""


@dataclass(frozen=True, order=True)
class CpBlock:
    """An aligned block of a CP group: ``size`` consecutive CP ranks from ``start``.

    ``size`` divides ``cp_size``, ``start % size == 0`` and ``1 < size < cp_size`` (a block of
    the whole group is :data:`DISTRIBUTED`, of one rank a local placement). A sequence on a
    block is split zigzag into ``2 * size`` chunks; block rank ``j`` holds chunks ``j`` and
    ``2 * size - 1 - j`` and budgets ``shard_tokens(length, size)`` tokens.
    """

    start: int
    size: int

    def __post_init__(self) -> None:
        for name in ("start", "size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"CpBlock.{name}={value!r} must be an int.")
        if self.size < 2 or self.start < 0 or self.start % self.size:
            raise ValueError(
                f"CpBlock(start={self.start}, size={self.size}) is not an aligned block: the "
                "size must be >= 2 and the start a multiple of it, >= 0; use a local rank for "
                "one rank, DISTRIBUTED for the whole group."
            )

    @property
    def ranks(self) -> range:
        """The CP ranks of the block."""
        return range(self.start, self.start + self.size)


Placement: TypeAlias = int | CpBlock
"""Where one sequence of a micro-batch runs: a CP rank (kept whole), :data:`DISTRIBUTED`, or a
:class:`CpBlock`; read it with :meth:`MicroBatchPlan.cp_ranks`."""


def block_sizes_of(cp_size: int) -> tuple[int, ...]:
    """The block sizes a CP group of ``cp_size`` ranks allows: its divisors ``1 < d < cp_size``,
    ascending."""
    return tuple(d for d in range(2, cp_size) if cp_size % d == 0)


def check_block(block: CpBlock, cp_size: int, owner: str = "") -> None:
    """Refuse a block that does not fit a CP group of ``cp_size`` ranks (``0``: unknown).

    Raises:
        ValueError: naming the block (prefixed by ``owner``), the rule and the fix.
    """
    if cp_size and (
        cp_size % block.size or block.size >= cp_size or block.start + block.size > cp_size
    ):
        raise ValueError(
            f"{owner}{block!r} does not fit a CP group of {cp_size}: a block's size must divide "
            f"cp_size and be below it (allowed: {block_sizes_of(cp_size)}), and the block must "
            "end within the group; use DISTRIBUTED for the whole group."
        )


def shard_tokens(length: int, cp_size: int) -> int:
    """Most tokens one CP rank holds of a distributed sequence of ``length`` tokens.

    The attention layout splits a distributed sequence so every CP rank holds
    ``floor(length / cp_size)`` or ``ceil(length / cp_size)`` tokens; the planner budgets the
    ceiling.
    """
    return -(-length // cp_size)


def check_kv_groups(kv_groups: Sequence[int], num_distributed: int, owner: str = "") -> None:
    """Refuse K/V group counts that are not positive ints summing to ``num_distributed``.

    Raises:
        ValueError: naming the counts (prefixed by ``owner``), the rule and the fix.
    """
    if not kv_groups:
        return
    if (
        any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in kv_groups)
        or sum(kv_groups) != num_distributed
    ):
        raise ValueError(
            f"{owner}kv_groups={tuple(kv_groups)} must be positive counts of distributed "
            f"sequences summing to their number ({num_distributed}); pass "
            "MicroBatchPlan.kv_groups, or () for one group."
        )


def kv_group_ranges(kv_groups: Sequence[int], num_distributed: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges over the distributed sequences of a micro-batch, one per K/V group.

    ``kv_groups`` gives the sequences per group (see :attr:`MicroBatchPlan.kv_groups`); ``()``
    is one group of all ``num_distributed`` (none when there are none).
    """
    if not kv_groups:
        return [(0, num_distributed)] if num_distributed else []
    out = []
    start = 0
    for g in kv_groups:
        out.append((start, start + g))
        start += g
    return out


@dataclass(frozen=True)
class MicroBatchPlan:
    """One micro-batch of one DP rank: which sequences, and where each one runs.

    Attributes:
        sequence_ids: indices into the global batch's ``lengths``.
        placement: same order as ``sequence_ids``; ``-1`` (:data:`DISTRIBUTED`) = sharded over
            the CP group, ``0..cp_size-1`` = kept whole (local) on that CP rank, a
            :class:`CpBlock` = sharded over that block. :meth:`cp_ranks` reads any of them.
        kv_groups: how the K/V exchange of the distributed sequences is cut into groups: the
            number of distributed sequences in each group, in plan order (summing to their
            count). Every group is gathered by its own collective, all started at once, so
            group ``g + 1``'s gather runs while group ``g``'s attention computes (and the other
            way round in the backward). ``()`` = one group for all of them. Sequences on
            blocks are not in any K/V group: each block size has one exchange.
        cp_size: ranks of the CP group the plan is for (``0``: not known); set by the planner.
            Blocks are checked against it; it takes no part in comparisons or digests.
    """

    sequence_ids: tuple[int, ...]
    placement: tuple[Placement, ...]
    kv_groups: tuple[int, ...] = ()
    cp_size: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if len(self.sequence_ids) != len(self.placement):
            raise ValueError(
                f"MicroBatchPlan has {len(self.sequence_ids)} sequence_ids but "
                f"{len(self.placement)} placements; give one placement per sequence."
            )
        for where in self.placement:
            if isinstance(where, CpBlock):
                check_block(where, self.cp_size, "MicroBatchPlan: ")
        if self.kv_groups:
            check_kv_groups(self.kv_groups, len(self.distributed_ids), "MicroBatchPlan.")

    def cp_ranks(self, i: int) -> range:
        """The CP ranks holding the ``i``-th sequence of the micro-batch: one rank when kept
        whole, a block's ranks, or ``range(cp_size)`` when sharded over the whole group.

        Raises:
            RuntimeError: for a whole-group sequence when the plan's ``cp_size`` is 0.
        """
        where = self.placement[i]
        if isinstance(where, CpBlock):
            return where.ranks
        if where == DISTRIBUTED:
            if not self.cp_size:
                raise RuntimeError(
                    "MicroBatchPlan.cp_ranks needs the plan's cp_size for a sequence sharded "
                    "over the whole group; build the plan with cp_size=... (the planner does)."
                )
            return range(self.cp_size)
        return range(where, where + 1)

    def block_sizes(self) -> tuple[int, ...]:
        """The sharding degrees in use other than the whole group, ascending."""
        return tuple(sorted({p.size for p in self.placement if isinstance(p, CpBlock)}))

    def block_ids(self, size: int) -> tuple[int, ...]:
        """Sequence ids sharded over blocks of ``size`` ranks, in plan order."""
        return tuple(
            s
            for s, p in zip(self.sequence_ids, self.placement, strict=True)
            if isinstance(p, CpBlock) and p.size == size
        )

    def with_placement(self, placement: tuple[Placement, ...]) -> MicroBatchPlan:
        """The same sequences with another placement (one K/V group, the same ``cp_size``)."""
        return MicroBatchPlan(self.sequence_ids, placement, cp_size=self.cp_size)

    def kv_group_ranges(self) -> list[tuple[int, int]]:
        """``[start, end)`` of every K/V group over :attr:`distributed_ids` (one when ``()``)."""
        return kv_group_ranges(self.kv_groups, len(self.distributed_ids))

    def tokens_per_cp_rank(self, lengths: Sequence[int], cp_size: int) -> list[int]:
        """Tokens each CP rank holds (the planner's budget accounting, ceil for shards)."""
        tokens = [0] * cp_size
        for sid, where in zip(self.sequence_ids, self.placement, strict=True):
            if isinstance(where, CpBlock):
                share = shard_tokens(lengths[sid], where.size)
                for j in where.ranks:
                    tokens[j] += share
            elif where == DISTRIBUTED:
                share = shard_tokens(lengths[sid], cp_size)
                for j in range(cp_size):
                    tokens[j] += share
            else:
                tokens[where] += lengths[sid]
        return tokens

    @property
    def distributed_ids(self) -> tuple[int, ...]:
        """Sequence ids sharded over the whole CP group, in plan order (blocks: :meth:`block_ids`)."""
        return tuple(
            s for s, p in zip(self.sequence_ids, self.placement, strict=True) if p == DISTRIBUTED
        )


@dataclass(frozen=True)
class GlobalBatchPlan:
    """The plan of one optimizer step: micro-batches for every DP rank.

    Attributes:
        micro_batches: ``micro_batches[dp_rank]`` is that DP rank's list of micro-batches, run in
            order. DP ranks may have different counts (zero too, when the global batch has fewer
            sequences than DP ranks).
        dp_size: number of DP ranks.
        cp_size: number of ranks in one CP group.
        bucket_size: token budget of one CP rank in one micro-batch.
        policy: name of the policy that made the plan.
    """

    micro_batches: tuple[tuple[MicroBatchPlan, ...], ...]
    dp_size: int
    cp_size: int
    bucket_size: int
    policy: str

    def num_micro_batches(self, dp_rank: int) -> int:
        """Number of micro-batches of ``dp_rank``."""
        return len(self.micro_batches[dp_rank])

    def all_sequence_ids(self) -> list[int]:
        """Every sequence id of the plan, DP rank by DP rank, micro-batch by micro-batch."""
        return [s for rank in self.micro_batches for mb in rank for s in mb.sequence_ids]

    def digest(self) -> str:
        """A stable hash of the plan, used to check that every rank planned the same (a block
        enters it by its ``repr``)."""
        h = hashlib.sha256(
            repr((self.dp_size, self.cp_size, self.bucket_size, self.policy)).encode()
        )
        for dp_rank, mbs in enumerate(self.micro_batches):
            for mb in mbs:
                h.update(repr((dp_rank, mb.sequence_ids, mb.placement, mb.kv_groups)).encode())
        return h.hexdigest()


def degree_shares(plan: GlobalBatchPlan, lengths: Sequence[int]) -> dict[int, float]:
    """Share of the plan's tokens at each sharding degree: ``1`` = kept whole on one rank, each
    block size, and ``plan.cp_size`` = sharded over the whole group; ascending degrees, only
    those in use (the values sum to 1; ``{}`` for a plan without tokens)."""
    tokens: dict[int, int] = {}
    for mbs in plan.micro_batches:
        for mb in mbs:
            for sid, where in zip(mb.sequence_ids, mb.placement, strict=True):
                if isinstance(where, CpBlock):
                    degree = where.size
                else:
                    degree = plan.cp_size if where == DISTRIBUTED else 1
                tokens[degree] = tokens.get(degree, 0) + lengths[sid]
    total = sum(tokens.values())
    return {d: tokens[d] / total for d in sorted(tokens)} if total else {}


def rank_or_group(where: Placement) -> int:
    """``where`` as a local CP rank or :data:`DISTRIBUTED`, for the readers that run plans.

    The attention layout, the collate and the plan pictures run whole-rank and whole-group
    placements; CP blocks are planned (``PlannerOptions.dacp_blocks``) but not yet run.

    Raises:
        ValueError: ``where`` is a :class:`CpBlock`, naming it and the fix.
    """
    if isinstance(where, CpBlock):
        raise ValueError(
            f"placement {where!r} shards a sequence over a block of the CP group, which the "
            "attention layout does not run yet; plan with PlannerOptions(dacp_blocks=False) "
            "(the default)."
        )
    return where
