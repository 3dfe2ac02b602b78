"""Online calibration in simulation: plans from the default constants against calibrated ones.

For machines unlike the defaults, a closed loop plans each global batch with the calibrator's
current model, "measures" every micro-batch with the machine's true constants (times 3%
log-normal noise), observes and refits every 3 steps, as the strategy does. Held-out batches are
then planned with the default constants, with the calibrated model and with the true constants,
and judged on the true machine, as the ratio to its lower bound. The refit's cost is measured
at cluster scale (DP64 x CP16, 4,096 sequences per step).
"""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import dataclass

from benchmarks.lengths import dataset, sample_lengths
from lightning_skrull.scheduling import (
    CostModel,
    OnlineCalibrator,
    lower_bound,
    plan_global_batch,
    simulate,
)
from lightning_skrull.scheduling.sequence_costs import SequenceCosts
from lightning_skrull.scheduling.shapes import QWEN2_5_0_5B, QWEN2_5_7B, ModelShape
from lightning_skrull.scheduling.simulate import micro_batch_terms

MACHINES = {
    "like the defaults": {},
    "slow links (12 GB/s, 300 us)": {"comm_bandwidth": 12e9, "comm_latency_s": 300e-6},
    "fast links (400 GB/s, 5 us)": {"comm_bandwidth": 400e9, "comm_latency_s": 5e-6},
    "slow links + 40 ms overhead": {
        "comm_bandwidth": 12e9,
        "comm_latency_s": 300e-6,
        "micro_batch_overhead_s": 40e-3,
    },
    "40 ms overhead + 0.5 ms per sequence": {
        "micro_batch_overhead_s": 40e-3,
        "per_sequence_seconds": 0.5e-3,
    },
}


def measure(plan, lengths, truth: CostModel, rng: random.Random, noise: float):
    costs = SequenceCosts(lengths, plan.cp_size, truth)
    return [
        [micro_batch_terms(mb, costs, truth).seconds * math.exp(rng.gauss(0, noise)) for mb in mbs]
        for mbs in plan.micro_batches
    ]


@dataclass(frozen=True)
class Layout:
    """A model on a DP x CP layout, as the closed loop and the held-out batches use it."""

    shape: ModelShape
    dp_size: int
    cp_size: int
    bucket_size: int
    per_dp_rank: int = 64


@dataclass(frozen=True)
class Comparison:
    """One machine and dataset: the ratio to the true machine's lower bound of plans from each
    model, the calibrated model's prediction error and its refits."""

    machine: str
    dataset: str
    default: float
    calibrated: float
    true: float
    error: float
    adopted: int
    refits: int


PAPER_SMALL = Layout(QWEN2_5_0_5B, 4, 8, 26_000)
"""Qwen2.5-0.5B on DP4 x CP8, bucket 26,000: the paper's first setting."""


def closed_loop(start, truth, layout: Layout, name, steps, noise, seed) -> OnlineCalibrator:
    """Calibrate ``start`` against ``truth`` for ``steps`` global batches of ``name``, refitting
    every 3 steps as the strategy does."""
    dp, cp, bucket = layout.dp_size, layout.cp_size, layout.bucket_size
    calibrator = OnlineCalibrator(start)
    rng = random.Random(seed)
    model = start
    for k in range(steps):
        lengths = sample_lengths(dataset(name), dp * layout.per_dp_rank, cp * bucket, rng)
        plan = plan_global_batch(
            lengths, dp_size=dp, cp_size=cp, bucket_size=bucket, cost_model=model
        )
        calibrator.observe(plan, lengths, measure(plan, lengths, truth, rng, noise))
        if k % 3 == 2:
            model = calibrator.refit()
    return calibrator


def ratio(model, truth, layout: Layout, batches) -> float:
    """Summed simulated time on ``truth`` of ``model``'s plans over the summed lower bound."""
    dp, cp, bucket = layout.dp_size, layout.cp_size, layout.bucket_size
    spent = bound = 0.0
    for lengths in batches:
        plan = plan_global_batch(
            lengths, dp_size=dp, cp_size=cp, bucket_size=bucket, cost_model=model
        )
        spent += simulate(plan, lengths, truth)
        bound += lower_bound(lengths, dp_size=dp, cp_size=cp, bucket_size=bucket, cost_model=truth)
    return spent / bound


def compare(
    layout: Layout,
    machines: dict[str, dict[str, float]],
    datasets: tuple[str, ...],
    steps: int,
    held: int,
    seed: int,
    noise: float = 0.03,
) -> list[Comparison]:
    """Per machine and dataset: default constants, calibrated ones and the true ones, each
    planning ``held`` held-out batches judged on the true machine."""
    start = CostModel(shape=layout.shape)
    cp, bucket = layout.cp_size, layout.bucket_size
    out = []
    for machine, constants in machines.items():
        truth = start.with_constants(**constants)
        for name in datasets:
            rng = random.Random(f"{seed}-held-{name}")
            size = layout.dp_size * layout.per_dp_rank
            batches = [sample_lengths(dataset(name), size, cp * bucket, rng) for _ in range(held)]
            calibrator = closed_loop(start, truth, layout, name, steps, noise, seed)
            out.append(
                Comparison(
                    machine,
                    name,
                    ratio(start, truth, layout, batches),
                    ratio(calibrator.cost_model, truth, layout, batches),
                    ratio(truth, truth, layout, batches),
                    calibrator.prediction_error or 0.0,
                    calibrator.adopted,
                    calibrator.refits,
                )
            )
    return out


def comparison_lines(rows: list[Comparison], model: str = "") -> list[str]:
    """The Markdown table of :func:`compare`'s rows (a model column when ``model`` is given)."""
    first = "| model " if model else ""
    lines = [
        f"{first}| machine | data | default constants | calibrated | true constants | "
        "prediction error | adopted refits |",
        ("| --- " if model else "") + "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            (f"| {model} " if model else "")
            + f"| {r.machine} | {r.dataset} | {r.default:.3f} | {r.calibrated:.3f} | "
            f"{r.true:.3f} | {100 * r.error:.1f}% | {r.adopted}/{r.refits} |"
        )
    return lines


def table(steps: int, held: int, seed: int) -> str:
    lines = [
        f"Qwen2.5-0.5B, DP4 x CP8, bucket 26,000; {steps} calibration steps (3% noise, refit "
        f"every 3), {held} held-out batches; ratio to the true machine's lower bound.",
        "",
    ]
    rows = compare(PAPER_SMALL, MACHINES, ("Wikipedia", "ChatQA2-Long-SFT"), steps, held, seed)
    return "\n".join(lines + comparison_lines(rows))


def refit_cost(steps: int, seed: int) -> str:
    dp, cp, bucket = 64, 16, 13_000
    start = CostModel(shape=QWEN2_5_7B)
    truth = start.with_constants(comm_bandwidth=12e9, comm_latency_s=300e-6)
    rng = random.Random(seed)
    calibrator = OnlineCalibrator(start)
    lines = ["| rows in window | observe (ms/step) | refit (ms) |", "| ---: | ---: | ---: |"]
    for _ in range(steps):
        lengths = sample_lengths(dataset("Wikipedia"), dp * 64, cp * bucket, rng)
        plan = plan_global_batch(
            lengths, dp_size=dp, cp_size=cp, bucket_size=bucket, cost_model=calibrator.cost_model
        )
        seconds = measure(plan, lengths, truth, rng, 0.03)
        t0 = time.perf_counter()
        calibrator.observe(plan, lengths, seconds)
        t1 = time.perf_counter()
        calibrator.refit()
        t2 = time.perf_counter()
        lines.append(
            f"| {calibrator.observed_rows} | {1e3 * (t1 - t0):.2f} | {1e3 * (t2 - t1):.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24, help="calibration steps per machine")
    parser.add_argument("--held", type=int, default=6, help="held-out batches")
    parser.add_argument("--cluster-steps", type=int, default=6, help="steps of the cost table")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(table(args.steps, args.held, args.seed))
    print()
    print("Refit cost at DP64 x CP16 (Qwen2.5-7B, Wikipedia, 4,096 sequences per step):")
    print(refit_cost(args.cluster_steps, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
