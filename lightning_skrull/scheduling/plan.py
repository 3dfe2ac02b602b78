"""Plan data types shared by every scheduling policy.

A plan never touches torch or torch.distributed: it is plain, hashable data that every rank
computes identically from the sequence lengths of one global batch.
"""

from __future__ import annotations

import hashlib
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Policy = Literal["skrull", "dacp", "static", "sorted", "round_robin"]
"""Names of the planning policies (see :func:`~lightning_skrull.scheduling.plan_global_batch`)."""

POLICIES: tuple[Policy, ...] = typing.get_args(Policy)
"""Every policy name, in the order of :data:`Policy`."""

DISTRIBUTED = -1
"""Placement value of a sequence sharded over the whole CP group."""


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
            the CP group, ``0..cp_size-1`` = kept whole (local) on that CP rank.
        kv_groups: how the K/V exchange of the distributed sequences is cut into groups: the
            number of distributed sequences in each group, in plan order (summing to their
            count). Every group is gathered by its own collective, all started at once, so
            group ``g + 1``'s gather runs while group ``g``'s attention computes (and the other
            way round in the backward). ``()`` = one group for all of them.
    """

    sequence_ids: tuple[int, ...]
    placement: tuple[int, ...]
    kv_groups: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.sequence_ids) != len(self.placement):
            raise ValueError(
                f"MicroBatchPlan has {len(self.sequence_ids)} sequence_ids but "
                f"{len(self.placement)} placements; give one placement per sequence."
            )
        if self.kv_groups:
            check_kv_groups(self.kv_groups, len(self.distributed_ids), "MicroBatchPlan.")

    def kv_group_ranges(self) -> list[tuple[int, int]]:
        """``[start, end)`` of every K/V group over :attr:`distributed_ids` (one when ``()``)."""
        return kv_group_ranges(self.kv_groups, len(self.distributed_ids))

    def tokens_per_cp_rank(self, lengths: Sequence[int], cp_size: int) -> list[int]:
        """Tokens each CP rank holds (the planner's budget accounting, ceil for shards)."""
        tokens = [0] * cp_size
        for sid, where in zip(self.sequence_ids, self.placement, strict=True):
            if where == DISTRIBUTED:
                share = shard_tokens(lengths[sid], cp_size)
                for j in range(cp_size):
                    tokens[j] += share
            else:
                tokens[where] += lengths[sid]
        return tokens

    @property
    def distributed_ids(self) -> tuple[int, ...]:
        """Sequence ids sharded over the CP group, in plan order."""
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
        """A stable hash of the plan, used to check that every rank planned the same."""
        h = hashlib.sha256(
            repr((self.dp_size, self.cp_size, self.bucket_size, self.policy)).encode()
        )
        for dp_rank, mbs in enumerate(self.micro_batches):
            for mb in mbs:
                h.update(repr((dp_rank, mb.sequence_ids, mb.placement, mb.kv_groups)).encode())
        return h.hexdigest()
