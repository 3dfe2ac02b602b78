"""K/V groups: cut a micro-batch's K/V exchange so it runs behind the distributed attention.

With one group, the all-gather of every distributed sequence's K/V (and the reduce-scatter of
their gradients) can only hide behind the local sequences' attention (the paper's Eq. 2). A
micro-batch with little local work, e.g. one where every sequence is distributed, then waits
for the whole exchange. Cut into groups that are all started together, the exchange of group
``g + 1`` runs while group ``g``'s distributed attention computes; only the first group's
exchange waits on nothing but the local attention (:func:`~lightning_skrull.scheduling.
cost_model.kv_pipeline_span`). Each group pays the collectives' latency again, so more groups
are not always faster.

:func:`choose_kv_groups` picks, for the distributed sequences in plan order, the contiguous
groups with the least estimated micro-batch time, and among those the fewest groups (at most
:data:`MAX_KV_GROUPS`). It changes no placement; a micro-batch keeps one group unless that
makes it slower.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from lightning_skrull.scheduling.costs import SequenceCosts
from lightning_skrull.scheduling.plan import DISTRIBUTED, MicroBatchPlan

MAX_KV_GROUPS = 8
"""Most K/V groups of one micro-batch: each adds two collectives per layer."""

SPAN_TOLERANCE = 1e-4
"""The span is searched to this fraction of itself (a 0.01% longer span than the least one is
accepted; the cost model resolves nothing that fine), and groups are kept only when they
shorten the single group's span by more than this fraction."""


def _greedy_groups(
    sent: Sequence[float], after: Sequence[float], latency: float, span: float
) -> tuple[list[int], float] | None:
    """The fewest contiguous groups whose pipeline span is at most ``span`` and their actual
    span, or ``None`` when there are none.

    ``sent[i]`` is the communication of sequences ``0..i-1`` (``sent[0] == 0``), ``after[i]``
    the distributed attention of sequences ``i`` to the end. Group ``g`` (0-based) covering
    ``[a, b)`` lies on a path of length ``sent[b] + (g + 1) * latency + after[a]``. Extending a
    group as far as that stays within ``span`` never hurts a later group (it starts later, with
    less attention after it, and with fewer groups before it), so taking each group as long as
    possible decides feasibility and gives the fewest groups.
    """
    n = len(sent) - 1
    groups: list[int] = []
    longest = 0.0
    i = 0
    while i < n:
        if len(groups) == MAX_KV_GROUPS:
            return None
        fixed = (len(groups) + 1) * latency + after[i]
        # The last end b with sent[b] + fixed <= span (sent is non-decreasing).
        end = min(n, bisect.bisect_right(sent, span - fixed) - 1)
        if end <= i:
            return None
        groups.append(end - i)
        longest = max(longest, sent[end] + fixed)
        i = end
    return groups, longest


def choose_kv_groups(mb: MicroBatchPlan, costs: SequenceCosts) -> MicroBatchPlan:
    """``mb`` with the K/V groups that minimise its estimated time (module docstring).

    Args:
        mb: a placed micro-batch (its ``kv_groups`` are ignored).
        costs: the global batch's cost table.

    Returns:
        ``mb`` itself when one group is as fast, else a copy with ``kv_groups`` set.
    """
    dist = [sid for sid, where in zip(mb.sequence_ids, mb.placement, strict=True) if where < 0]
    if len(dist) < 2 or costs.cp_size == 1 or costs.comm_per_token == 0.0:
        return _one_group(mb)
    n = costs.cp_size
    linear = [0.0] * n
    attn = [0.0] * n
    for sid, where in zip(mb.sequence_ids, mb.placement, strict=True):
        if where != DISTRIBUTED:
            linear[where] += costs.linear(sid)
            attn[where] += costs.local_attention(sid)
    lengths = costs.lengths
    sent = [0.0]  # communication of the first i distributed sequences
    for sid in dist:
        sent.append(sent[-1] + costs.comm_per_token * lengths[sid])
    after = [0.0] * (len(dist) + 1)  # distributed attention of sequences i.. end
    for i in range(len(dist) - 1, -1, -1):
        after[i] = after[i + 1] + costs.distributed_attention(dist[i])
    latency = costs.comm_fixed
    total = after[0]
    one = latency + sent[-1] + total  # the span of a single group
    # Below this span the slowest rank is set by its own attention, not by the pipeline.
    floor = max(lin + a for lin, a in zip(linear, attn, strict=True)) + total - max(linear)
    if one <= floor:
        return _one_group(mb)
    lo = max(floor, latency + sent[1] + total)
    found = _greedy_groups(sent, after, latency, lo)
    if found is None:
        best, hi = [len(dist)], one
        while hi - lo > SPAN_TOLERANCE * hi:
            # A quarter of the way down from the best span so far: groups found reach a
            # span at most that (often far shorter); none found raises the floor.
            step = (hi - lo) / 4
            if step <= SPAN_TOLERANCE * hi:  # the last try: just under the best span
                found = _greedy_groups(sent, after, latency, hi * (1 - SPAN_TOLERANCE))
                if found is None:
                    break
            else:
                found = _greedy_groups(sent, after, latency, hi - step)
                if found is None:
                    lo = hi - step
                    continue
            best, hi = found
    else:
        best, hi = found
    if len(best) == 1 or hi > one * (1 - SPAN_TOLERANCE):
        return _one_group(mb)
    return MicroBatchPlan(mb.sequence_ids, mb.placement, tuple(best))


def _one_group(mb: MicroBatchPlan) -> MicroBatchPlan:
    if not mb.kv_groups:
        return mb
    return MicroBatchPlan(mb.sequence_ids, mb.placement)
