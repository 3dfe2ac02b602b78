"""Judge a plan: its estimated iteration time, and a lower bound no plan can beat."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_skrull.scheduling.cost_model import CostModel
from lightning_skrull.scheduling.costs import SequenceCosts
from lightning_skrull.scheduling.plan import DISTRIBUTED, GlobalBatchPlan, MicroBatchPlan


def _check_plan(plan: GlobalBatchPlan, lengths: Sequence[int]) -> None:
    if not isinstance(plan, GlobalBatchPlan):
        raise TypeError(f"plan must be a GlobalBatchPlan, got {type(plan).__name__}.")
    n = len(lengths)
    for sid in plan.all_sequence_ids():
        if not 0 <= sid < n:
            raise ValueError(
                f"plan refers to sequence {sid} but lengths has {n} entries; pass the lengths "
                "the plan was made from."
            )


@dataclass(frozen=True)
class MicroBatchTerms:
    """The terms of a micro-batch's time on its slowest CP rank (see :func:`micro_batch_terms`).

    Attributes:
        seconds: estimated seconds of the micro-batch.
        compute_seconds: compute on the slowest rank's critical path (local linear, distributed
            compute, and the local attention when it hides the communication).
        comm_exposed: whether the communication, not the local attention, sets the overlap.
        distributed_tokens: whole tokens of the distributed sequences.
    """

    seconds: float
    compute_seconds: float
    comm_exposed: bool
    distributed_tokens: int


def micro_batch_terms(
    mb: MicroBatchPlan, costs: SequenceCosts, cost_model: CostModel
) -> MicroBatchTerms:
    """Estimated time of a micro-batch, split into its terms on the slowest CP rank."""
    n = costs.cp_size
    linear = [0.0] * n
    attn = [0.0] * n
    dist_tokens = 0
    dist_compute = 0.0
    for sid, where in zip(mb.sequence_ids, mb.placement, strict=True):
        if where == DISTRIBUTED:
            dist_tokens += costs.lengths[sid]
            dist_compute += costs.distributed(sid)
        else:
            linear[where] += costs.linear(sid)
            attn[where] += costs.local_attention(sid)
    comm = costs.comm(dist_tokens)
    times = [lin + max(comm, a) for lin, a in zip(linear, attn, strict=True)]
    j = max(range(n), key=times.__getitem__)
    exposed = comm > attn[j]
    compute = linear[j] + dist_compute + (0.0 if exposed else attn[j])
    seconds = cost_model.micro_batch_overhead_s + times[j] + dist_compute
    return MicroBatchTerms(seconds, compute, exposed, dist_tokens)


def dp_rank_seconds(
    plan: GlobalBatchPlan, lengths: Sequence[int], cost_model: CostModel
) -> list[float]:
    """Estimated seconds of every DP rank: the sum of its micro-batch times."""
    _check_plan(plan, lengths)
    costs = SequenceCosts(lengths, plan.cp_size, cost_model)
    return [
        sum(micro_batch_terms(mb, costs, cost_model).seconds for mb in mbs)
        for mbs in plan.micro_batches
    ]


def simulate(plan: GlobalBatchPlan, lengths: Sequence[int], cost_model: CostModel) -> float:
    """Estimated seconds of one iteration (forward + backward of every micro-batch).

    The slowest DP rank's sum of micro-batch times; a micro-batch takes its slowest CP rank's
    ``overhead + linear + max(comm, local attention) + distributed compute``
    (see :class:`CostModel`). The optimizer step and the gradient all-reduce are not included:
    they are the same for every plan.

    Args:
        plan: the plan to judge.
        lengths: the lengths it was planned from.
        cost_model: the estimate.

    Returns:
        Seconds; 0.0 for a plan with no micro-batches.
    """
    return max(dp_rank_seconds(plan, lengths, cost_model), default=0.0)


def lower_bound(
    lengths: Sequence[int], *, dp_size: int, cp_size: int, bucket_size: int, cost_model: CostModel
) -> float:
    """Seconds no plan can beat under ``cost_model`` (for any policy).

    What it assumes, precisely: every sequence runs at its cheapest compute placement (whole
    on one rank if it fits the bucket, else distributed, whichever costs fewer GPU-seconds);
    that work is spread perfectly evenly over all ``dp_size * cp_size`` GPUs; communication is
    entirely hidden; and the micro-batch count is the fewest the token budget allows
    (``ceil(sum of tokens / (cp_size * bucket_size))`` over all DP ranks together, each paying
    the fixed overhead), shared evenly by the DP ranks. Sequences are indivisible across DP
    ranks, so the bound is also at least the time of the single slowest sequence run alone in
    a micro-batch (its cheaper placement, communication included when distributed). The
    result is the larger of the two.

    Args:
        lengths: sequence lengths of the global batch.
        dp_size: DP ranks.
        cp_size: ranks of one CP group.
        bucket_size: tokens per CP rank per micro-batch.
        cost_model: the estimate.

    Returns:
        The bound in seconds (0.0 for an empty batch).
    """
    if not lengths:
        return 0.0
    costs = SequenceCosts(lengths, cp_size, cost_model)
    overhead = cost_model.micro_batch_overhead_s
    total_work = 0.0
    total_tokens = 0
    slowest = 0.0
    for sid, s in enumerate(lengths):
        dist = costs.distributed(sid)
        if s <= bucket_size:
            work = min(costs.local(sid), cp_size * dist)
            alone = min(costs.local(sid), dist + costs.comm(s))
            total_tokens += s
        else:
            work = cp_size * dist
            alone = dist + costs.comm(s)
            total_tokens += cp_size * costs.shard(sid)
        total_work += work
        slowest = max(slowest, alone)
    micro_batches = -(-total_tokens // (cp_size * bucket_size))
    spread = (total_work / cp_size + overhead * micro_batches) / dp_size
    return max(spread, overhead + slowest)
