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
makes it slower. Sequences on blocks (``CpBlock``) are in no K/V group: their per-rank work
and exchange only change what the groups can hide, so a micro-batch with blocks keeps the
chosen groups only where its time (:func:`~lightning_skrull.scheduling.simulate.
micro_batch_terms`) is lower than with one group.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from lightning_skrull.scheduling.plan import DISTRIBUTED, CpBlock, MicroBatchPlan
from lightning_skrull.scheduling.sequence_costs import SequenceCosts
from lightning_skrull.scheduling.simulate import micro_batch_terms

MAX_KV_GROUPS = 8
"""Most K/V groups of one micro-batch: each adds two collectives per layer."""

FIRST_PROBE = 0.1
"""The first span tried above the lower limit, as a fraction of it: on the paper's settings the
least span lies 0-9% above the limit."""

SPAN_TOLERANCE = 2e-3
"""The span is searched to this fraction of itself (a span up to 0.2% longer than the least one
is accepted: on the paper's settings that costs under 0.02% of the iteration time and takes 40%
fewer trials than 0.01%), and groups are kept only when they shorten the single group's span by
more than this fraction."""


def _greedy_groups(
    sent: Sequence[float], after: Sequence[float], latency: float, span: float
) -> tuple[list[int], float] | None:
    """The fewest contiguous groups whose pipeline span is at most ``span`` (as the end of each
    group) and their actual span, or ``None`` when there are none.

    ``sent[i]`` is the communication of sequences ``0..i-1`` (``sent[0] == 0``), ``after[i]``
    the distributed attention of sequences ``i`` to the end. Group ``g`` (0-based) covering
    ``[a, b)`` lies on a path of length ``sent[b] + (g + 1) * latency + after[a]``. Extending a
    group as far as that stays within ``span`` never hurts a later group (it starts later, with
    less attention after it, and with fewer groups before it), so taking each group as long as
    possible decides feasibility and gives the fewest groups.
    """
    n = len(sent) - 1
    ends: list[int] = []
    longest = 0.0
    i = 0
    for g in range(1, MAX_KV_GROUPS + 1):
        fixed = g * latency + after[i]
        # The last end b > i with sent[b] + fixed <= span (sent is non-decreasing).
        end = bisect.bisect_right(sent, span - fixed, i + 1) - 1
        if end == i:
            return None
        path = sent[end] + fixed
        if path > longest:
            longest = path
        ends.append(end)
        if end == n:
            return ends, longest
        i = end
    return None


def choose_kv_groups(mb: MicroBatchPlan, costs: SequenceCosts) -> MicroBatchPlan:
    """``mb`` with the K/V groups that minimise its estimated time (module docstring).

    Args:
        mb: a placed micro-batch (its ``kv_groups`` are ignored).
        costs: the global batch's cost table.

    Returns:
        ``mb`` itself when one group is as fast, else a copy with ``kv_groups`` set.
    """
    if costs.cp_size == 1 or costs.comm_per_token == 0.0:
        return one_group(mb)
    chosen = _choose(mb, costs)
    if chosen.kv_groups and mb.block_sizes():
        single = one_group(mb)
        model = costs.cost_model
        if (
            micro_batch_terms(single, costs, model).seconds
            <= micro_batch_terms(chosen, costs, model).seconds
        ):
            return single
    return chosen


def _choose(mb: MicroBatchPlan, costs: SequenceCosts) -> MicroBatchPlan:
    """:func:`choose_kv_groups` over the local and whole-group sequences."""
    n = costs.cp_size
    linear_t, attention_t = costs.linear_table, costs.local_attention_table
    dist: list[int] = []
    linear: list[float] = []  # per CP rank, of the local sequences (empty: none)
    attn: list[float] = []
    for sid, where in zip(mb.sequence_ids, mb.placement, strict=True):
        if where == DISTRIBUTED:
            dist.append(sid)
            continue
        if isinstance(where, CpBlock):
            continue
        if not linear:
            linear, attn = [0.0] * n, [0.0] * n
        linear[where] += linear_t[sid]
        attn[where] += attention_t[sid]
    if len(dist) < 2:
        return one_group(mb)
    lengths, per_token = costs.lengths, costs.comm_per_token
    sent = [0.0]  # communication of the first i distributed sequences
    acc = 0.0
    for sid in dist:
        acc += per_token * lengths[sid]
        sent.append(acc)
    after = [0.0] * (len(dist) + 1)  # distributed attention of sequences i.. end
    for i in range(len(dist) - 1, -1, -1):
        after[i] = after[i + 1] + costs.distributed_attention(dist[i])
    latency = costs.comm_fixed
    total = after[0]
    one = latency + sent[-1] + total  # the span of a single group
    # Below this span the slowest rank is set by its own attention, not by the pipeline.
    floor = total
    if linear:
        floor += max(lin + a for lin, a in zip(linear, attn, strict=True)) - max(linear)
    if one <= floor:
        return one_group(mb)
    # Every cut has a first group (its exchange before all attention) and a last one (all
    # exchange before its attention): its span is at least either path with one sequence.
    lo = max(floor, latency + sent[1] + total, sent[-1] + latency + after[-2])
    best, hi = [len(dist)], one  # group ends
    # The least span is usually a few percent above ``lo`` (and almost never ``lo`` itself):
    # probe just above it first, and again after each miss there; else halve the interval.
    ask = min((lo + hi) / 2, lo * (1 + FIRST_PROBE))
    while True:
        found = _greedy_groups(sent, after, latency, ask)
        if found is None:
            lo = ask
        else:
            best, hi = found  # the span these groups reach, at most the one asked for
        if hi - lo <= SPAN_TOLERANCE * hi:
            break
        ask = min((lo + hi) / 2, lo * (1 + FIRST_PROBE)) if ask == lo else (lo + hi) / 2
    if len(best) == 1 or hi > one * (1 - SPAN_TOLERANCE):
        return one_group(mb)
    counts = tuple(end - start for start, end in zip([0, *best], best, strict=False))
    return MicroBatchPlan(mb.sequence_ids, mb.placement, counts, cp_size=mb.cp_size)


def one_group(mb: MicroBatchPlan) -> MicroBatchPlan:
    """``mb`` with one K/V group (``kv_groups=()``)."""
    if not mb.kv_groups:
        return mb
    return MicroBatchPlan(mb.sequence_ids, mb.placement, cp_size=mb.cp_size)
