"""Entry point of the planner: ``plan_global_batch``."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from numbers import Integral

from lightning_skrull.scheduling.baselines import (
    place_round_robin,
    plan_data_order,
    plan_sorted,
    plan_static,
)
from lightning_skrull.scheduling.cost_model import CostModel
from lightning_skrull.scheduling.dacp import place_micro_batch
from lightning_skrull.scheduling.gds import plan_gds, with_kv_groups
from lightning_skrull.scheduling.options import DEFAULT_OPTIONS, PlannerOptions
from lightning_skrull.scheduling.plan import POLICIES, GlobalBatchPlan, MicroBatchPlan, Policy
from lightning_skrull.scheduling.sequence_costs import SequenceCosts
from lightning_skrull.scheduling.topology import check_topology

DEFAULT_COST_MODEL = CostModel()
"""Cost model used when none is given: Qwen2.5-0.5B shape, H100-class constants."""


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
    if value < 1:
        raise ValueError(f"{name}={value} is invalid; it must be >= 1.")
    return int(value)


def _check_options(options: object) -> PlannerOptions:
    if options is None:
        return DEFAULT_OPTIONS
    if not isinstance(options, PlannerOptions):
        raise TypeError(
            f"options must be a PlannerOptions or None, got {type(options).__name__}; "
            "build one with PlannerOptions(gds_rows=False, ...)."
        )
    return options


def validate_lengths(lengths: Sequence[int], cp_size: int, bucket_size: int) -> list[int]:
    """Check the lengths of a global batch and return them as a list of ints.

    Raises:
        TypeError: when ``lengths`` is not a sequence of ints.
        ValueError: for a length below 1 or a sequence longer than ``cp_size * bucket_size``.
    """
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__len__"):
        raise TypeError(
            f"lengths must be a sequence of ints (token counts), got {type(lengths).__name__}."
        )
    capacity = cp_size * bucket_size
    out: list[int] = list(lengths)
    # Fast path (plain ints, all in range): three passes in C instead of a checked loop.
    if not out or (all(type(s) is int for s in out) and min(out) >= 1 and max(out) <= capacity):
        return out
    out = []
    for index, s in enumerate(lengths):
        if type(s) is not int and (isinstance(s, bool) or not isinstance(s, Integral)):
            raise TypeError(
                f"lengths[{index}]={s!r} ({type(s).__name__}) is not an int; give token counts."
            )
        if s < 1:
            raise ValueError(
                f"lengths[{index}]={s} is invalid: every sample has at least one token; "
                "drop empty samples before planning."
            )
        if s > capacity:
            raise ValueError(
                f"sequence {index} has {s} tokens, more than the capacity of one CP group "
                f"(cp_size * bucket_size = {cp_size} * {bucket_size} = {capacity}); truncate or "
                "drop it, or raise cp_size or bucket_size."
            )
        out.append(int(s))
    return out


def plan_global_batch(
    lengths: Sequence[int],
    *,
    dp_size: int,
    cp_size: int,
    bucket_size: int,
    cost_model: CostModel | None = None,
    policy: Policy = "skrull",
    options: PlannerOptions | None = None,
) -> GlobalBatchPlan:
    """Plan one optimizer step: micro-batches per DP rank and the placement of each sequence.

    Deterministic: the same arguments give the same plan on every rank (no randomness, ties
    broken by rank and sequence index).

    Args:
        lengths: token count of every sequence of the global batch (each >= 1).
        dp_size: data-parallel ranks.
        cp_size: ranks of one context-parallel group.
        bucket_size: tokens one CP rank may hold in one micro-batch; a local sequence costs its
            rank its length, a distributed one ``ceil(length / cp_size)`` on every rank (on a
            block of ``d`` ranks, ``ceil(length / d)`` on each of them).
        cost_model: time estimate the cost-aware policies optimise; default
            :data:`DEFAULT_COST_MODEL`. Build one with ``CostModel.from_hf_config(config)``.
        policy: one of :data:`POLICIES`.
        options: which steps beyond the paper ``skrull`` and ``dacp`` run; default
            :class:`PlannerOptions` ``()``, every step on.

    Returns:
        The plan; ``plan.micro_batches[dp_rank]`` lists that rank's micro-batches (possibly
        none). An empty ``lengths`` gives a plan with no micro-batches.

    Raises:
        TypeError: for a non-int size or length, or a cost model or options of the wrong type.
        ValueError: for a size below 1, a length below 1, a sequence longer than
            ``cp_size * bucket_size`` (naming its index, length and the capacity), an
            unknown policy, or a cost model whose ``ranks_per_node`` does not fit the layout
            (:func:`~lightning_skrull.scheduling.topology.check_topology`).
    """
    dp_size = _check_size("dp_size", dp_size)
    cp_size = _check_size("cp_size", cp_size)
    bucket_size = _check_size("bucket_size", bucket_size)
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is unknown; choose one of {', '.join(POLICIES)}.")
    if cost_model is None:
        cost_model = DEFAULT_COST_MODEL
    elif not isinstance(cost_model, CostModel):
        raise TypeError(
            f"cost_model must be a CostModel or None, got {type(cost_model).__name__}; "
            "build one with CostModel.from_hf_config(config)."
        )
    check_topology(cost_model.ranks_per_node, dp_size=dp_size, cp_size=cp_size)
    options = _check_options(options)
    checked = validate_lengths(lengths, cp_size, bucket_size)
    n = len(checked)
    ranks: list[list[MicroBatchPlan]]
    if policy == "static":
        ranks = plan_static(checked, dp_size, cp_size, bucket_size)
    elif policy == "sorted":
        ranks = plan_sorted(checked, dp_size, cp_size, bucket_size)
    else:
        costs = SequenceCosts(checked, cp_size, cost_model)
        dacp = functools.partial(place_micro_batch, options=options)
        if policy == "skrull":
            ranks = plan_gds(n, dp_size, costs, bucket_size, dacp, options)
        elif policy == "dacp":
            ranks = plan_data_order(n, dp_size, costs, bucket_size, dacp)
        else:
            ranks = plan_data_order(n, dp_size, costs, bucket_size, place_round_robin)
        if policy == "dacp":  # skrull's micro-batches come with theirs (GDS)
            ranks = [[with_kv_groups(mb, costs, options) for mb in r] for r in ranks]
    return GlobalBatchPlan(
        micro_batches=tuple(tuple(r) for r in ranks),
        dp_size=dp_size,
        cp_size=cp_size,
        bucket_size=bucket_size,
        policy=policy,
    )
