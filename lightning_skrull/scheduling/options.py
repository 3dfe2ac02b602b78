"""Switches of the planner's steps beyond the paper, and their thresholds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class PlannerOptions:
    """Which steps beyond the paper's Algorithms 1 and 2 the planner runs (docs/scheduling.md).

    The default runs every step but :attr:`dacp_blocks` (off until the attention and the
    runtime run block plans); :meth:`paper` switches them all off, leaving the paper's GDS
    (LPT over DP ranks, strided micro-batches) and its DACP (Algorithm 1 with the corrected
    roll-back). The flags are independent: each can be switched off (or on) alone.
    """

    dacp_cost_aware: bool = True
    """DACP step 2: place longest first and shard a sequence that fits a rank whole when the
    look-ahead estimate says sharding is faster. Off: the paper's Algorithm 1 (shortest first,
    least-loaded rank, else the rank with most free tokens, else shard, else roll back)."""

    dacp_local_search: bool = True
    """DACP step 3: move, shard or bring back single sequences while the estimate drops."""

    dacp_split: bool = True
    """DACP step 4: also try sharding the ``k`` longest and spreading the rest whole."""

    split_comm_share: float = 0.2
    """Step 4 runs when communication is at least this share of the greedy's estimate..."""

    split_waste_share: float = 0.1
    """... or when the sequences the greedy sharded by choice waste at least this share of it
    (tile waste and communication)."""

    dacp_blocks: bool = False
    """DACP step 6: shard a sequence over the smallest aligned block of the CP group that
    serves it (a ``CpBlock``) where the estimate says so, inside a node where it can
    (:mod:`~lightning_skrull.scheduling.dacp_blocks`). Off by default for now: with it off
    the plans hold no blocks."""

    blocks_min_gain: float = 0.05
    """Step 6 runs only where the micro-batch's estimate is at least this share above its mean
    rank's compute with every sequence whole (the most blocks could save)."""

    dacp_paper_rule: bool = True
    """DACP step 5: also try the longest-first greedy that shards only what memory forces."""

    paper_rule_start_slack: float = 1.0
    """Step 5's construction is refined only if it starts within this factor of the best
    estimate so far."""

    gds_deal_by_tokens: bool = True
    """GDS step 3: before adding a micro-batch, retry the same count dealt by tokens."""

    gds_gather: bool = True
    """GDS step 4: weigh the DP split that gathers the sequences sharded anyway."""

    gather_max_sequences: int = 1024
    """Step 4 is weighed only for global batches of at most this many sequences."""

    plan_both_max_sequences: int = 128
    """Up to this many sequences step 4 plans both DP splits and keeps the faster (above, a
    quick estimate picks one)."""

    gds_rows: bool = True
    """GDS step 5: also deal each DP rank's micro-batches in rows and keep the faster."""

    rows_comm_share: float = 0.15
    """Step 5 runs where the fullest micro-batch's communication is at least this share of the
    least that micro-batch can take..."""

    rows_min_fill: float = 0.5
    """... and that micro-batch holds at least this share of ``cp_size * bucket_size`` tokens."""

    rows_extra_micro_batches: int = 2
    """Step 5 tries up to this many micro-batches more than steps 2-4 used."""

    kv_groups: bool = True
    """Cut each micro-batch's K/V exchange into groups where that is faster."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise TypeError(f"PlannerOptions.{f.name}={value!r} must be a bool.")
            if f.type != "bool" and (
                isinstance(value, bool) or not isinstance(value, (int, float))
            ):
                raise TypeError(f"PlannerOptions.{f.name}={value!r} must be a number.")

    @classmethod
    def paper(cls) -> PlannerOptions:
        """Every step beyond the paper switched off."""
        return cls(**{f.name: False for f in dataclasses.fields(cls) if f.type == "bool"})

    @classmethod
    def steps(cls) -> tuple[str, ...]:
        """Names of the flags, one per step beyond the paper."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.type == "bool")


DEFAULT_OPTIONS = PlannerOptions()
"""Every step on but ``dacp_blocks``: what
:func:`~lightning_skrull.scheduling.plan_global_batch` runs by default."""
