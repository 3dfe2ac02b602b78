"""DACP as the paper reads: Algorithm 1 with the corrected roll-back, for one micro-batch.

The readable reference a reviewer reads: the paper's algorithm in one short function, without
the incremental bookkeeping, the inlined hot paths and the steps beyond the paper of the fast
version (:mod:`~lightning_skrull.scheduling.dacp_greedy`, composed by
:mod:`~lightning_skrull.scheduling.dacp`). It ships in the package beside the fast version as the
statement of what that one computes: with every step beyond the paper off
(``PlannerOptions.paper()``), :func:`~lightning_skrull.scheduling.dacp.place_micro_batch`, which
``plan_global_batch(..., options=PlannerOptions.paper())`` runs for every micro-batch, must
return the same placements as :func:`place_micro_batch_reference`, tie for tie
(``tests/scheduling/test_dacp_reference.py``, on 1,500 random micro-batches). The planner never
calls it.

A rank's load is its estimated seconds without the shared distributed compute: local linear
time plus the larger of its local attention and the K/V communication of the distributed
sequences. A distributed sequence takes ``ceil(length / cp_size)`` tokens of every rank
(shards are not padded).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_skrull.scheduling.plan import DISTRIBUTED, shard_tokens
from lightning_skrull.scheduling.sequence_costs import SequenceCosts, ascending


def place_micro_batch_reference(
    ids: Sequence[int], costs: SequenceCosts, bucket_size: int
) -> tuple[int, ...] | None:
    """Shortest first: whole on the least-loaded rank, else on the rank with most free tokens,
    else sharded over every rank, else roll back and retry; ``None`` when nothing rolls back."""
    n, lengths = costs.cp_size, costs.lengths
    tokens, linear, attention = [0] * n, [0.0] * n, [0.0] * n
    members: list[list[int]] = [[] for _ in range(n)]
    where: dict[int, int] = {}
    shared = {"tokens": 0, "reserved": 0}  # of the distributed sequences: whole, per rank

    def keep(sid: int, rank: int, sign: int) -> None:  # add (sign 1) or remove (-1) whole
        tokens[rank] += sign * lengths[sid]
        linear[rank] += sign * costs.linear(sid)
        attention[rank] += sign * costs.local_attention(sid)
        if sign > 0:
            members[rank].append(sid)
        else:
            members[rank].remove(sid)
        where[sid] = rank

    def shard(sid: int) -> None:
        shared["tokens"] += lengths[sid]
        shared["reserved"] += shard_tokens(lengths[sid], n)
        where[sid] = DISTRIBUTED

    def fits(rank: int, need: int) -> bool:
        return tokens[rank] + shared["reserved"] + need <= bucket_size

    def roll_back() -> bool:  # the local sequence that frees most; every other rank must fit
        options = [
            (lengths[sid] - shard_tokens(lengths[sid], n), -sid, rank)
            for rank in range(n)
            for sid in members[rank]
            if all(fits(r, shard_tokens(lengths[sid], n)) for r in range(n) if r != rank)
        ]
        best = max((o for o in options if o[0] > 0), default=None)
        if best is not None:
            keep(-best[1], best[2], -1)
            shard(-best[1])
        return best is not None

    for sid in ascending(ids, lengths):
        while True:
            comm = costs.comm(shared["tokens"])
            load = [lin + max(a, comm) for lin, a in zip(linear, attention, strict=True)]
            least_loaded = load.index(min(load))
            most_free = tokens.index(min(tokens))
            if fits(least_loaded, lengths[sid]) or fits(most_free, lengths[sid]):
                keep(sid, least_loaded if fits(least_loaded, lengths[sid]) else most_free, 1)
                break
            if all(fits(r, shard_tokens(lengths[sid], n)) for r in range(n)):
                shard(sid)
                break
            if not roll_back():
                return None
    return tuple(where[sid] for sid in ids)
