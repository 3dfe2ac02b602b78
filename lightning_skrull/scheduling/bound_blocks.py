"""The lower bound's relaxation when sequences may also be sharded over blocks of the CP group.

:func:`~lightning_skrull.scheduling.simulate.lower_bound` with ``blocks=True`` bounds every plan,
those with ``CpBlock`` placements too. Its relaxation is the block-free one's with more choices
per sequence: kept whole (unless forced off one rank), or sharded over a block of any size
``d`` its shard fits (``ceil(length / d) <= bucket_size``), or over the whole group. In the
mean CP rank's time a sequence on a block of ``d`` ranks adds ``d / N`` of its per-rank
compute, and ``d / N`` of its exchange less its attention to the communication that the
batch's attention must hide; its exchange is priced at the cheapest block of that size (the
links inside a node where any block of that size sits in one). Each sequence's share over its
choices is fractional; the least total is the maximum over ``lam`` in ``[0, 1]`` of the dual
``lam * latency + sum_i min_k (a_ik + lam * b_ik)``, found exactly by walking the breakpoints
of the concave sum (:func:`best_dual`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_skrull.scheduling.plan import block_sizes_of
from lightning_skrull.scheduling.sequence_costs import SequenceCosts


def _degrees(costs: SequenceCosts) -> list[tuple[int, float, float]]:
    """``(d, fixed, per_token)`` of every sharding degree, the cheapest block of each size."""
    n = costs.cp_size
    out = []
    for d in block_sizes_of(n):
        links = [costs.exchange_constants(k * d, d) for k in range(n // d)]
        out.append((d, min(f for f, _ in links), min(p for _, p in links)))
    if n > 1:
        out.append((n, costs.comm_fixed, costs.comm_per_token))
    return out


def sequence_choices(
    sid: int,
    costs: SequenceCosts,
    degrees: Sequence[tuple[int, float, float]],
    bucket_size: int,
    forced: bool,
) -> tuple[list[tuple[float, float]], float]:
    """The ``(mean-rank seconds, excess communication)`` of each choice of ``sid``, and the
    least time of a micro-batch holding it alone (no overhead)."""
    n, s = costs.cp_size, costs.lengths[sid]
    choices: list[tuple[float, float]] = []
    alone = math.inf
    if not forced:
        choices.append((costs.local(sid) / n, -costs.local_attention(sid) / n))
        alone = costs.local(sid)
    for d, fixed, per_token in degrees:
        if costs.shard_at(sid, d) > bucket_size:
            continue
        lin, att = costs.block_costs(sid, d)
        share = d / n
        choices.append((share * (lin + att), share * (per_token * s - att)))
        alone = min(alone, lin + att + fixed + per_token * s)
    return choices, alone


def best_dual(latency: float, choices: Sequence[Sequence[tuple[float, float]]]) -> float:
    """``max over lam in [0, 1] of lam * latency + sum_i min_k (a_ik + lam * b_ik)``.

    Each sequence's ``min_k`` is the lower envelope of its lines: concave, piecewise linear.
    Walking ``lam`` up from 0, each envelope switches to lines of ever smaller slope; the sum's
    slope only falls, and the maximum sits where it turns negative (or at ``lam = 1``).
    """
    value, slope = 0.0, latency
    events: list[tuple[float, float]] = []  # (lam, slope change)
    for lines in choices:
        a, b = min(lines)  # the envelope at lam = 0 (lowest slope on ties)
        value += a
        slope += b
        lam = 0.0
        while True:
            step = math.inf
            nxt = (a, b)
            for a2, b2 in lines:
                if b2 < b:
                    t = (a2 - a) / (b - b2)
                    if lam <= t < step:
                        step, nxt = t, (a2, b2)
            if step >= 1.0:
                break
            events.append((step, nxt[1] - b))
            lam, (a, b) = step, nxt
    lam = 0.0
    events.sort()
    for t, change in events:
        if slope <= 0:
            break
        value += slope * (t - lam)
        lam = t
        slope += change
    if slope > 0:
        value += slope * (1.0 - lam)
    return value


def block_relaxation(
    lengths: Sequence[int],
    costs: SequenceCosts,
    forced: Sequence[bool],
    dp_size: int,
    bucket_size: int,
    overhead: float,
) -> float:
    """The relaxation of :func:`~lightning_skrull.scheduling.simulate.lower_bound` with
    blocks, the ``forced`` sequences off one rank (module docstring)."""
    n = costs.cp_size
    degrees = _degrees(costs)
    choices = []
    slowest = 0.0
    forced_tokens = 0
    for sid, s in enumerate(lengths):
        options, alone = sequence_choices(sid, costs, degrees, bucket_size, forced[sid])
        choices.append(options)
        slowest = max(slowest, alone)
        forced_tokens += s if forced[sid] else 0
    latency = 0.0
    if forced_tokens and degrees:  # each micro-batch holding one pays its exchange's latency
        least = min(d / n * fixed for d, fixed, _ in degrees)
        latency = least * -(-forced_tokens // (n * bucket_size))
    ranks = min(dp_size, len(lengths))
    micro_batches = max(-(-sum(lengths) // (n * bucket_size)), ranks)
    work = best_dual(latency, choices)
    spread = (work + overhead * micro_batches) / ranks
    return max(spread, overhead + slowest)
