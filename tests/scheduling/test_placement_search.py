"""The placement search benchmark really searches: from a poor start it reaches DACP's
placement or better, and it refuses placements over the bucket."""

from __future__ import annotations

import random

from benchmarks import placement_search as search_mod
from lightning_skrull.scheduling import DISTRIBUTED, CostModel, plan_global_batch
from lightning_skrull.scheduling.sequence_costs import SequenceCosts
from lightning_skrull.scheduling.shapes import QWEN2_5_7B


def test_search_from_all_sharded_reaches_dacp() -> None:
    # Qwen2.5-7B, CP=16: sharding the 200-token sequences wastes tiles and communication; DACP
    # keeps them whole. Started from everything sharded, plain descent is stuck; with kicks the
    # search must find a placement at least as fast as DACP's (it may find DACP's own).
    model = CostModel(shape=QWEN2_5_7B)
    lengths = [9000] + [1500] * 4 + [200] * 30
    plan = plan_global_batch(lengths, dp_size=1, cp_size=16, bucket_size=13_000, cost_model=model)
    (mb,) = plan.micro_batches[0]
    ids = list(mb.sequence_ids)
    costs = SequenceCosts(lengths, 16, model)
    dacp = search_mod.seconds(ids, list(mb.placement), costs, model, 13_000)
    sharded = search_mod.seconds(ids, [DISTRIBUTED] * len(ids), costs, model, 13_000)
    start = [DISTRIBUTED] * len(ids)
    stuck = search_mod.descend(ids, list(start), costs, model, 13_000, random.Random(0))
    assert stuck == sharded  # no single move or swap helps: keeping one whole slows its rank
    found = search_mod.search(ids, start, costs, model, 13_000, random.Random(0), kicks=30)
    assert found < sharded * 0.99  # the kicks get it out
    assert found <= dacp * (1 + 1e-9)


def test_seconds_refuses_a_rank_over_the_bucket() -> None:
    model = CostModel()
    costs = SequenceCosts([60, 50], 2, model)
    assert search_mod.seconds([0, 1], [0, 0], costs, model, 100) is None  # 110 tokens on rank 0
    assert search_mod.seconds([0, 1], [0, 1], costs, model, 100) is not None
