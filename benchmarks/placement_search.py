"""Search for faster placements than DACP's, micro-batch by micro-batch, where skrull's plans
are furthest from the lower bound.

For every micro-batch of skrull's plan (same batches as ``simulate_paper.py``), an iterated
local search looks for a placement with a lower estimate. The local search moves one sequence
to any placement (sharded or whole on any CP rank) or swaps the placements of two sequences
while that lowers the estimate and every CP rank stays within the bucket. It starts from the
all-sharded placement and from DACP's own; then, ``kicks`` times, the best placement so far
has 1-4 random sequences moved to random placements and is searched again, kept if faster. Placements are judged by the
simulator's :func:`~lightning_skrull.scheduling.simulate.micro_batch_terms`, not by DACP's own
bookkeeping. The micro-batches themselves (GDS's grouping) are kept.

Run::

    python -m benchmarks.placement_search               # 2 batches per case, 20 kicks
    python -m benchmarks.placement_search --batches 5 --kicks 50
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

from benchmarks.lengths import dataset
from benchmarks.simulate_paper import (
    MEASURED,
    measured_constants,
    plan_for,
    setting_batches,
    settings,
)
from lightning_skrull.scheduling import DISTRIBUTED, CostModel, MicroBatchPlan
from lightning_skrull.scheduling.kv_groups import choose_kv_groups
from lightning_skrull.scheduling.sequence_costs import SequenceCosts
from lightning_skrull.scheduling.simulate import micro_batch_terms

CASES = (
    ("Qwen2.5-0.5B", "ChatQA2-Long-SFT", "default"),
    ("Qwen2.5-0.5B", "ChatQA2-Long-SFT", "measured"),
    ("Qwen2.5-7B", "Wikipedia", "default"),
    ("Qwen2.5-7B", "Wikipedia", "measured"),
    ("Qwen2.5-7B", "LMsysChat1M", "default"),
)
"""(model, dataset, constants) where skrull's ratio to the lower bound was highest (1.09-1.15
before K/V groups; 1.03-1.12 in docs/simulate_paper.md now)."""


def seconds(
    ids: list[int], placement: list[int], costs: SequenceCosts, model: CostModel, bucket: int
) -> float | None:
    """Estimated seconds of a micro-batch, or ``None`` when a CP rank is over the bucket.

    Each placement is judged with its own best K/V groups, as the planner would give it.
    """
    mb = MicroBatchPlan(tuple(ids), tuple(placement))
    if max(mb.tokens_per_cp_rank(costs.lengths, costs.cp_size)) > bucket:
        return None
    return micro_batch_terms(choose_kv_groups(mb, costs), costs, model).seconds


def descend(
    ids: list[int],
    placement: list[int],
    costs: SequenceCosts,
    model: CostModel,
    bucket: int,
    rng: random.Random,
) -> float:
    """Local search in place: single moves and pair swaps while they lower the estimate."""
    n = costs.cp_size
    best = seconds(ids, placement, costs, model, bucket)
    if best is None:
        return float("inf")
    free = [k for k, sid in enumerate(ids) if costs.lengths[sid] <= bucket]  # others: forced
    improved = True
    while improved:
        improved = False
        for k in rng.sample(free, len(free)):
            for option in [DISTRIBUTED, *range(n)]:
                if option == placement[k]:
                    continue
                old, placement[k] = placement[k], option
                value = seconds(ids, placement, costs, model, bucket)
                if value is not None and value < best * (1 - 1e-9):
                    best, improved = value, True
                else:
                    placement[k] = old
        if improved:
            continue
        for i, a in enumerate(free):
            for b in free[i + 1 :]:
                if placement[a] == placement[b]:
                    continue
                placement[a], placement[b] = placement[b], placement[a]
                value = seconds(ids, placement, costs, model, bucket)
                if value is not None and value < best * (1 - 1e-9):
                    best, improved = value, True
                else:
                    placement[a], placement[b] = placement[b], placement[a]
    return best


def search(
    ids: list[int],
    start: list[int],
    costs: SequenceCosts,
    model: CostModel,
    bucket: int,
    rng: random.Random,
    kicks: int,
) -> float:
    """Iterated local search from ``start``: the least estimate found."""
    best_placement = list(start)
    best = descend(ids, best_placement, costs, model, bucket, rng)
    free = [k for k, sid in enumerate(ids) if costs.lengths[sid] <= bucket]
    if not free:
        return best
    options = [DISTRIBUTED, *range(costs.cp_size)]
    for _ in range(kicks):
        placement = list(best_placement)
        for k in rng.sample(free, min(len(free), rng.randint(1, 4))):
            placement[k] = rng.choice(options)
        value = descend(ids, placement, costs, model, bucket, rng)
        if value < best * (1 - 1e-9):
            best, best_placement = value, placement
    return best


def run_case(
    model_name: str, dataset_name: str, constants: str, batches: int, kicks: int, seed: int
) -> dict[str, float]:
    """Largest and mean gain of the search over DACP's placement, per micro-batch."""
    s = next(x for x in settings() if x.model == model_name)
    extra = measured_constants(json.loads(MEASURED.read_text()))[s.model]
    model = CostModel(shape=s.shape, **(extra if constants == "measured" else {}))
    rng = random.Random(seed)
    gains = []
    for lengths in setting_batches(s, dataset(dataset_name), batches, seed):
        plan = plan_for("skrull", lengths, s, model)
        costs = SequenceCosts(lengths, s.cp_size, model)
        for mbs in plan.micro_batches:
            for mb in mbs:
                ids = list(mb.sequence_ids)
                dacp = seconds(ids, list(mb.placement), costs, model, s.bucket_size)
                assert dacp is not None
                best = dacp
                for init in ([DISTRIBUTED] * len(ids), list(mb.placement)):
                    found = search(ids, init, costs, model, s.bucket_size, rng, kicks)
                    best = min(best, found)
                gains.append((dacp - best) / dacp)
    return {
        "micro_batches": len(gains),
        "improved": sum(1 for g in gains if g > 1e-9),
        "max_gain": max(gains),
        "mean_gain": statistics.fmean(gains),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=2, help="global batches per case")
    parser.add_argument("--kicks", type=int, default=20, help="perturbations per start")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(
        f"Iterated local search from the all-sharded and DACP's placement, {args.kicks} kicks "
        f"each, every micro-batch of {args.batches} "
        f"global batches per case (seed {args.seed}); gain = 1 - best found / DACP's estimate, "
        "per micro-batch (its fixed cost included).\n"
    )
    print("| model | dataset | constants | micro-batches | improved | largest gain | mean gain |")
    print("|---|---|---|---:|---:|---:|---:|")
    for model_name, dataset_name, constants in CASES:
        r = run_case(model_name, dataset_name, constants, args.batches, args.kicks, args.seed)
        print(
            f"| {model_name} | {dataset_name} | {constants} | {r['micro_batches']} | "
            f"{r['improved']} | {r['max_gain']:.2%} | {r['mean_gain']:.2%} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
