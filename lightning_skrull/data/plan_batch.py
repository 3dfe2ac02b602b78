"""From the samples of one global batch to this rank's micro-batches: plan, then collate.

Every path that turns a global batch into a rank's share goes through :func:`plan_rank_batch`:
the engine's :func:`~lightning_skrull.runtime.engine.train_step`, the data module's
:class:`~lightning_skrull.data.batch.RankPlanner` and the memory probe of ``bucket_size="auto"``
(:class:`~lightning_skrull.runtime.memory.ProbeStep`). The sample lengths the plan is made from
are measured once, by :func:`~lightning_skrull.data.collate.sample_lengths`, and collated from
the same list.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lightning_skrull.data.collate import RankBatch, collate_rank, sample_lengths
from lightning_skrull.scheduling import CostModel, GlobalBatchPlan, Policy, plan_global_batch

MicroBatchPadding = Literal["none", "one", "equal"]
"""How a DP rank's micro-batches are padded with placeholder ones (zero loss, zero gradient):
``"none"``: exactly the planned ones (a rank the plan leaves empty runs none); ``"one"``: a
rank the plan leaves empty runs one (DDP needs one backward per rank and step); ``"equal"``:
every rank runs the plan's largest count (ZeRO-2 reduces gradients in every backward)."""


@dataclass(frozen=True, kw_only=True)
class BatchPlanning:
    """How a global batch is planned, and which rank's share of it is collated.

    Attributes:
        dp_size: DP ranks.
        cp_size: ranks per CP group.
        dp_rank: this rank's DP rank.
        cp_rank: this rank's CP rank.
        bucket_size: tokens one CP rank may hold in one micro-batch.
        policy: the planner's policy.
        cost_model: the planner's cost model (``None``: the planner's default).
        padding: which placeholder micro-batches pad this DP rank (:data:`MicroBatchPadding`).
    """

    dp_size: int
    cp_size: int
    dp_rank: int
    cp_rank: int
    bucket_size: int
    policy: Policy = "skrull"
    cost_model: CostModel | None = None
    padding: MicroBatchPadding = "none"

    @property
    def world_size(self) -> int:
        """Ranks over which gradients are averaged."""
        return self.dp_size * self.cp_size


@dataclass(frozen=True)
class PlannedBatch:
    """One global batch, planned, and this rank's share of it.

    Attributes:
        plan: the global batch's plan (the same on every rank).
        lengths: the samples' lengths the plan was made from.
        rank_batch: this rank's micro-batches.
    """

    plan: GlobalBatchPlan
    lengths: list[int]
    rank_batch: RankBatch


def plan_rank_batch(
    samples: Sequence[Mapping[str, Any]],
    planning: BatchPlanning,
    *,
    plan: GlobalBatchPlan | None = None,
    lengths: Sequence[int] | None = None,
    sample_indices: Sequence[int] | None = None,
) -> PlannedBatch:
    """Plan the global batch ``samples`` and collate this rank's micro-batches of it.

    Args:
        samples: the global batch: mappings with ``input_ids`` and optional ``labels``.
        planning: the layout, the planner's settings and the padding.
        plan: use this plan instead of planning (it must be for ``planning``'s DP and CP sizes).
        lengths: the samples' lengths when the caller measured them already with
            :func:`~lightning_skrull.data.collate.sample_lengths`; measured here otherwise.
        sample_indices: dataset indices of ``samples``, recorded in the micro-batches.

    Returns:
        The :class:`PlannedBatch` (its rank batch on CPU).

    Raises:
        ValueError: a plan for other sizes, a sequence longer than the CP group's capacity, or
            malformed samples (see :func:`~lightning_skrull.data.collate.collate_rank`).
        TypeError: a sample that is not a mapping with integer ``input_ids``.
    """
    measured = sample_lengths(samples) if lengths is None else list(lengths)
    if plan is None:
        plan = plan_global_batch(
            measured,
            dp_size=planning.dp_size,
            cp_size=planning.cp_size,
            bucket_size=planning.bucket_size,
            cost_model=planning.cost_model,
            policy=planning.policy,
        )
    elif (plan.dp_size, plan.cp_size) != (planning.dp_size, planning.cp_size):
        raise ValueError(
            f"the plan is for dp_size {plan.dp_size} x cp_size {plan.cp_size} but the world is "
            f"{planning.dp_size} x {planning.cp_size}; plan with the layout's sizes."
        )
    rank_batch = collate_rank(
        samples,
        plan,
        dp_rank=planning.dp_rank,
        cp_rank=planning.cp_rank,
        world_size=planning.world_size,
        sample_indices=sample_indices,
        min_micro_batches=_min_micro_batches(plan, planning.padding),
        lengths=measured,
    )
    return PlannedBatch(plan=plan, lengths=measured, rank_batch=rank_batch)


def _min_micro_batches(plan: GlobalBatchPlan, padding: MicroBatchPadding) -> int | None:
    if padding == "none":
        return None
    if padding == "one":
        return 1
    return max(max(len(mbs) for mbs in plan.micro_batches), 1)
