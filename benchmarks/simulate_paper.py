"""Reproduce the paper's settings in simulation and compare the planner's policies.

Settings (Skrull, arXiv 2505.19609, 4 nodes x 8 H100): Qwen2.5-0.5B with DP=4, CP=8, 64
sequences per DP rank, BucketSize 26K; Qwen2.5-7B with DP=2, CP=16, 40 per DP rank, 13K. The
length distributions are rebuilt from the shares the paper publishes (its Table 1): the share
of sequences under 1K / 4K / 8K / 32K / 128K tokens and the longest one; inside each band
lengths are drawn log-uniformly. Times come from :func:`lightning_skrull.scheduling.simulate`
with the cost model of each model's real shape and the default H100-class constants, then
again with the compute constants ``benchmarks/cost_probe.py`` measured on one H200 (kept in
``benchmarks/measured/``); the lower bound from :func:`lightning_skrull.scheduling.lower_bound`.
A table varies the K/V all-gather bandwidth (CP groups that span nodes); the last one plans
with the default constants and with constants calibrated online (the closed loop of
``benchmarks/calibration_sim.py``) on machines with slower and faster links and larger
overheads.

Run::

    python -m benchmarks.simulate_paper            # prints the tables, writes docs/
    python -m benchmarks.simulate_paper --batches 5 --no-write
    python -m benchmarks.simulate_paper --ablation   # each step beyond the paper off alone
    python -m benchmarks.simulate_paper --calibration-steps 0   # without the calibration table
    python -m benchmarks.simulate_paper --topology-only   # only the CP-block topology table

It writes ``docs/simulate_paper.md`` (the tables and the command) and
``docs/img/simulate_paper.png`` (a chart; needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import calibration_sim, topology_table
from benchmarks.lengths import DATASETS, SHORTEST, Dataset, sample_lengths
from lightning_skrull.scheduling import (
    POLICIES,
    CostModel,
    GlobalBatchPlan,
    PlannerOptions,
    lower_bound,
    plan_global_batch,
    simulate,
)
from lightning_skrull.scheduling.baselines import plan_static_unpacked
from lightning_skrull.scheduling.shapes import QWEN2_5_0_5B, QWEN2_5_7B, ModelShape

ROOT = Path(__file__).resolve().parent.parent
DEEPSPEED = "deepspeed"
"""Label of the paper's DeepSpeed baseline: static CP, one sequence per micro-batch."""
CEILING = "ceiling"
"""Key of the speedups a plan at the lower bound on every batch would have (no plan does better)."""

PAPER_SPEEDUP = {  # Skrull over DeepSpeed, paper's Table / summary
    ("Qwen2.5-0.5B", "Wikipedia"): 7.54,
    ("Qwen2.5-0.5B", "LMsysChat1M"): 6.17,
    ("Qwen2.5-0.5B", "ChatQA2-Long-SFT"): 2.79,
    ("Qwen2.5-7B", "Wikipedia"): 2.60,
    ("Qwen2.5-7B", "LMsysChat1M"): 2.14,
    ("Qwen2.5-7B", "ChatQA2-Long-SFT"): 1.35,
}
LONG_TAILED = ("Wikipedia", "LMsysChat1M")
MEASURED = ROOT / "benchmarks" / "measured" / "cost_probe_h200.json"
"""Compute constants measured by ``benchmarks/cost_probe.py`` on one H200 (kept in the repo)."""


@dataclass(frozen=True)
class Setting:
    """One model x parallel layout of the paper."""

    model: str
    shape: ModelShape
    dp_size: int
    cp_size: int
    per_dp_rank: int
    bucket_size: int


def settings() -> list[Setting]:
    """The paper's two model settings (the published shapes; nothing is downloaded)."""
    return [
        Setting(
            "Qwen2.5-0.5B", QWEN2_5_0_5B, dp_size=4, cp_size=8, per_dp_rank=64, bucket_size=26_000
        ),
        Setting(
            "Qwen2.5-7B", QWEN2_5_7B, dp_size=2, cp_size=16, per_dp_rank=40, bucket_size=13_000
        ),
    ]


def plan_for(policy: str, lengths: list[int], s: Setting, model: CostModel) -> GlobalBatchPlan:
    """Plan with a planner policy, or the paper's DeepSpeed baseline."""
    if policy == DEEPSPEED:
        return GlobalBatchPlan(
            micro_batches=tuple(tuple(r) for r in plan_static_unpacked(lengths, s.dp_size)),
            dp_size=s.dp_size,
            cp_size=s.cp_size,
            bucket_size=s.bucket_size,
            policy=DEEPSPEED,
        )
    return plan_global_batch(
        lengths,
        dp_size=s.dp_size,
        cp_size=s.cp_size,
        bucket_size=s.bucket_size,
        cost_model=model,
        policy=policy,
    )


def timed_plan(policy: str, lengths: list[int], s: Setting, model: CostModel, repeats: int):
    """Plan ``repeats`` times; returns the plan and the least CPU time of one run, in ms.

    CPU time of this process, not wall time: on a shared machine it is the steadier figure.
    """
    best = math.inf
    plan = None
    for _ in range(repeats):
        t0 = time.process_time()
        plan = plan_for(policy, lengths, s, model)
        best = min(best, time.process_time() - t0)
    assert plan is not None
    return plan, best * 1e3


def setting_batches(s: Setting, dataset: Dataset, batches: int, seed: int) -> list[list[int]]:
    """The global batches of one setting: the same for every policy and every constant tried."""
    rng = random.Random(f"{seed}-{s.model}-{dataset.name}")
    n = s.dp_size * s.per_dp_rank
    return [sample_lengths(dataset, n, s.cp_size * s.bucket_size, rng) for _ in range(batches)]


def measured_constants(report: dict) -> dict[str, dict[str, float]]:
    """Per model: the ``achieved_flops`` and ``micro_batch_overhead_s`` of a probe report
    (the JSON ``benchmarks/cost_probe.py`` writes, e.g. :data:`MEASURED`)."""
    return {
        name: {k: m["full_model"][k] for k in ("achieved_flops", "micro_batch_overhead_s")}
        for name, m in report["models"].items()
    }


def run_setting(
    s: Setting,
    dataset: Dataset,
    batches: int,
    seed: int,
    constants: dict[str, float] | None = None,
) -> dict[str, dict]:
    """Mean time, lower-bound ratio and planning time of every policy on one setting.

    ``constants`` replace the cost model's defaults (the planner plans with them too).
    """
    model = CostModel(shape=s.shape, **(constants or {}))
    policies = [*POLICIES, DEEPSPEED]
    times: dict[str, list[float]] = {p: [] for p in policies}
    ratios: dict[str, list[float]] = {p: [] for p in policies}
    plan_ms: dict[str, list[float]] = {p: [] for p in policies}
    bounds: list[float] = []
    for lengths in setting_batches(s, dataset, batches, seed):
        bound = lower_bound(
            lengths,
            dp_size=s.dp_size,
            cp_size=s.cp_size,
            bucket_size=s.bucket_size,
            cost_model=model,
        )
        bounds.append(bound)
        for p in policies:
            plan, ms = timed_plan(p, lengths, s, model, repeats=3)
            t = simulate(plan, lengths, model)
            times[p].append(t)
            ratios[p].append(t / bound)
            plan_ms[p].append(ms)
    static = statistics.fmean(times["static"])
    deepspeed = statistics.fmean(times[DEEPSPEED])
    bound_mean = statistics.fmean(bounds)
    out: dict[str, dict] = {
        # What a plan meeting the lower bound on every batch would reach: no plan does better.
        CEILING: {"vs_static": static / bound_mean, "vs_deepspeed": deepspeed / bound_mean}
    }
    for p in policies:
        mean = statistics.fmean(times[p])
        out[p] = {
            "time_s": mean,
            "vs_static": static / mean,
            "vs_deepspeed": deepspeed / mean,
            "vs_bound": statistics.fmean(ratios[p]),
            "plan_ms": statistics.fmean(plan_ms[p]),
            "plan_ms_max": max(plan_ms[p]),
        }
    return out


class PlanTimer:
    """Skrull planning time of fixed batches, one run of every batch per :meth:`round`.

    The benchmark calls :meth:`round` between its other parts, so the runs of one batch are
    spread over the whole benchmark: on a shared machine other processes only ever add CPU time
    (the same batch took 36 and 58 ms minutes apart), and runs taken back to back all land in the
    same busy or quiet spell. The least run of a batch is its planning cost; the median of all
    its runs shows what the machine's load added.
    """

    def __init__(self) -> None:
        self.work: dict[Any, tuple[Setting, list[list[int]]]] = {}
        self.ms: dict[Any, list[list[float]]] = {}

    def add(self, key: Any, s: Setting, batches: list[list[int]]) -> None:
        """Time ``batches`` planned for ``s``'s layout under ``key``."""
        self.work[key] = (s, batches)
        self.ms[key] = [[] for _ in batches]

    def round(self) -> None:
        """Plan every batch once, recording its CPU time."""
        for key, (s, batches) in self.work.items():
            model = CostModel(shape=s.shape)
            for lengths, runs in zip(batches, self.ms[key], strict=True):
                t0 = time.process_time()
                plan_for("skrull", lengths, s, model)
                runs.append((time.process_time() - t0) * 1e3)

    @property
    def runs(self) -> int:
        """Runs of each batch so far."""
        return min((len(r) for rows in self.ms.values() for r in rows), default=0)

    def rows(self) -> list[tuple[Any, float, float, float]]:
        """Per key: mean and max over batches of each batch's least run, and the median of
        every run (ms)."""
        out = []
        for key, rows in self.ms.items():
            least = [min(r) for r in rows]
            every = [x for r in rows for x in r]
            out.append((key, statistics.fmean(least), max(least), statistics.median(every)))
        return out


CLUSTER = Setting(
    "Qwen2.5-7B", QWEN2_5_7B, dp_size=64, cp_size=16, per_dp_rank=64, bucket_size=13_000
)
"""Cluster scale: DP=64 x CP=16, 4096 sequences per global batch (7B's bucket)."""


def plan_timers(cluster_batches: int, batches: int, seed: int) -> tuple[PlanTimer, PlanTimer]:
    """Timers of skrull's planning: the cluster-scale batches (keyed by dataset) and the
    256-sequence Qwen2.5-0.5B batches of the tables (keyed by ``(model, dataset)``)."""
    cluster, paper = PlanTimer(), PlanTimer()
    s = CLUSTER
    small = settings()[0]
    for dataset in DATASETS:
        rng = random.Random(f"{seed}-cluster-{dataset.name}")
        n, capacity = s.dp_size * s.per_dp_rank, s.cp_size * s.bucket_size
        cluster.add(
            dataset.name,
            s,
            [sample_lengths(dataset, n, capacity, rng) for _ in range(cluster_batches)],
        )
        paper.add(
            (small.model, dataset.name), small, setting_batches(small, dataset, batches, seed)
        )
    return cluster, paper


OVERHEADS_S = (10e-3, 20e-3)
"""Per-micro-batch overheads of the sensitivity table (the default is 2 ms)."""


def summed_times(
    policies: tuple[str, ...], batches: list[list[int]], s: Setting, model: CostModel
) -> list[float]:
    """Each policy's simulated seconds summed over ``batches``, planned under ``model``."""
    return [
        sum(simulate(plan_for(p, lengths, s, model), lengths, model) for lengths in batches)
        for p in policies
    ]


def overhead_sensitivity(batches: int, seed: int) -> dict[tuple[str, str], list[float]]:
    """Skrull's speedup over the DeepSpeed baseline when a micro-batch costs more fixed time."""
    out: dict[tuple[str, str], list[float]] = {}
    for s in settings():
        for dataset in DATASETS:
            speedups = []
            same = setting_batches(s, dataset, batches, seed)
            for overhead in OVERHEADS_S:
                model = CostModel(shape=s.shape, micro_batch_overhead_s=overhead)
                ours, theirs = summed_times(("skrull", DEEPSPEED), same, s, model)
                speedups.append(theirs / ours)
            out[(s.model, dataset.name)] = speedups
    return out


def measured_tables(results, measured, source: dict) -> list[str]:
    """The report's section on the constants measured on one GPU."""
    lines = [
        "",
        "## Under the compute constants measured on one H200",
        "",
        "`benchmarks/cost_probe.py` timed forward + backward of single micro-batches through "
        f"this package on an {source['device']} (torch {source['torch']}, attention "
        f"{source['attention_backend']}) and fitted the cost model's compute constants; 7B "
        "was measured at 2 and 4 layers and its fixed cost extrapolated linearly to 28 (the "
        "numbers are in `benchmarks/measured/cost_probe_h200.json` and docs/benchmarks.md). "
        "Communication keeps its default constants (one GPU cannot measure them). The same "
        "batches, planned and simulated with the measured constants:",
        "",
        "| model | dataset | achieved TFLOP/s | fixed ms per micro-batch | skrull / lower bound "
        "| vs static | vs deepspeed | ceiling vs static | ceiling vs deepspeed | paper vs deepspeed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, res in results.items():
        r, c = res["skrull"], res[CEILING]
        k = measured[key[0]]
        lines.append(
            f"| {key[0]} | {key[1]} | {k['achieved_flops'] / 1e12:.0f} | "
            f"{k['micro_batch_overhead_s'] * 1e3:.1f} | {r['vs_bound']:.3f} | "
            f"{r['vs_static']:.2f}x | {r['vs_deepspeed']:.2f}x | {c['vs_static']:.2f}x | "
            f"{c['vs_deepspeed']:.2f}x | {PAPER_SPEEDUP[key]:.2f}x |"
        )
    lines += ["", "Targets (skrull, measured compute constants):", ""]
    lines += [line for line in target_lines(results, []) if "planning" not in line]
    return lines


BANDWIDTHS = (100e9, 50e9, 25e9, 12.5e9)
"""K/V all-gather bandwidths of the communication table: the default (NVLink-class), and what
a CP group spanning nodes gets over 400, 200 and 100 Gb/s InfiniBand per GPU."""


def bandwidth_sensitivity(batches: int, seed: int) -> dict[tuple[str, str], list[tuple]]:
    """Skrull over packed static, the ceiling, and skrull over the lower bound, for both models
    at each bandwidth of :data:`BANDWIDTHS` (the same batches)."""
    out: dict[tuple[str, str], list[tuple]] = {}
    for s in settings():
        for dataset in DATASETS:
            cells = []
            same = setting_batches(s, dataset, batches, seed)
            for bandwidth in BANDWIDTHS:
                model = CostModel(shape=s.shape, comm_bandwidth=bandwidth)
                ours, theirs = summed_times(("skrull", "static"), same, s, model)
                bound = sum(
                    lower_bound(lengths, dp_size=s.dp_size, cp_size=s.cp_size,
                                bucket_size=s.bucket_size, cost_model=model)
                    for lengths in same
                )  # fmt: skip
                cells.append((theirs / ours, theirs / bound, ours / bound))
            out[(s.model, dataset.name)] = cells
    return out


def calibration_section(
    steps: int,
    held: int,
    seed: int,
    machines: dict[str, dict[str, float]] | None = None,
    datasets: tuple[str, ...] | None = None,
    layouts: list[Setting] | None = None,
) -> list[str]:
    """Markdown lines: per paper setting, machine and dataset, the ratio to the true machine's
    lower bound of plans from the default constants, from constants calibrated online over
    ``steps`` global batches, and from the true constants (``held`` held-out batches each)."""
    machines = calibration_sim.MACHINES if machines is None else machines
    datasets = tuple(d.name for d in DATASETS) if datasets is None else datasets
    lines = [
        "",
        "## Default constants against calibrated ones",
        "",
        "The default constants were never measured on the machine a user trains on. Online "
        'calibration (`SkrullStrategy(calibration="online")`, docs/calibration.md) refits them '
        f"while it trains: here a closed loop plans {steps} global batches with the "
        "calibrator's current model, \"measures\" every micro-batch with the machine's true "
        "constants times 3% log-normal noise and refits every 3 steps; "
        f"{held} held-out batches per row are then planned with the default constants, the "
        "calibrated ones and the true ones, and judged on the true machine: the ratio of the "
        "summed simulated time to the summed lower bound (lower is better). The prediction "
        "error is the calibrated model's median relative error on the micro-batches it saw.",
        "",
    ]
    rows: list[str] = []
    for i, s in enumerate(settings() if layouts is None else layouts):
        layout = calibration_sim.Layout(s.shape, s.dp_size, s.cp_size, s.bucket_size, s.per_dp_rank)
        found = calibration_sim.compare(layout, machines, datasets, steps, held, seed)
        table = calibration_sim.comparison_lines(found, model=s.model)
        rows += table if i == 0 else table[2:]
    return lines + rows


def format_tables(
    results,
    cluster,
    sensitivity,
    args,
    measured_section=(),
    bandwidths=None,
    paper_timing=(),
    runs=0,
    calibration=(),
) -> str:
    """The Markdown report; ``cluster`` and ``paper_timing`` hold :meth:`PlanTimer.rows` from
    ``runs`` runs of every batch (see :func:`plan_timers`)."""
    lines = [
        "Length distributions are rebuilt from the shares published in the paper's Table 1 "
        f"(log-uniform inside each band, shortest sample {SHORTEST} tokens, lengths above one CP "
        "group's capacity cut to it); times are simulated with the cost model, not measured.",
        f"{args.batches} global batches per setting, seed {args.seed}. `deepspeed` = static CP "
        "with one sequence per micro-batch (the paper's DeepSpeed baseline as we read it); "
        "`static` = the same with packing. Planning time: least CPU time of 3 runs back to "
        "back, mean over batches; the planning targets are judged on the timing table below.",
        "",
    ]
    header = (
        "| model | dataset | policy | iteration (s) | vs static | vs deepspeed | "
        "/ lower bound | plan (ms) |"
    )
    lines += [header, "|---|---|---|---:|---:|---:|---:|---:|"]
    for (model, dataset), res in results.items():
        for p, r in res.items():
            if p == CEILING:
                continue
            lines.append(
                f"| {model} | {dataset} | {p} | {r['time_s']:.4f} | {r['vs_static']:.2f}x | "
                f"{r['vs_deepspeed']:.2f}x | {r['vs_bound']:.3f} | {r['plan_ms']:.2f} |"
            )
    lines += [
        "",
        "Skrull's planning time: Qwen2.5-0.5B's 256-sequence batches of the table above "
        "(DP=4 x CP=8) and cluster-scale batches (DP=64 x CP=16, 4096 sequences, BucketSize "
        f"13K). Every batch planned {runs} times, the runs spread over the whole benchmark; a "
        "batch's least CPU time is its planning cost (mean and max over batches), the median "
        "of all its runs shows what the machine's load added:",
        "",
        "| batches | dataset | plan mean (ms) | plan max (ms) | median of all runs (ms) |",
        "|---|---|---:|---:|---:|",
    ]
    for key, mean, worst, median in paper_timing:
        lines.append(
            f"| {key[0]}, 256 sequences | {key[1]} | {mean:.2f} | {worst:.2f} | {median:.2f} |"
        )
    for name, mean, worst, median in cluster:
        lines.append(
            f"| DP=64 x CP=16, 4096 sequences | {name} | {mean:.1f} | {worst:.1f} | {median:.1f} |"
        )
    lines += [
        "",
        "The speedup over the DeepSpeed baseline depends mostly on the fixed cost of a "
        "micro-batch (launches, weight traffic), which the default model guesses at 2 ms (one "
        "H200 measured 53 ms for 0.5B and 69 ms for 7B: the last section); skrull over "
        "DeepSpeed with other values (same batches):",
        "",
        "| model | dataset | 2 ms (default) | "
        + " | ".join(f"{o * 1e3:.0f} ms" for o in OVERHEADS_S)
        + " | paper |",
        "|---|---|---:|" + "---:|" * len(OVERHEADS_S) + "---:|",
    ]
    for key, speedups in sensitivity.items():
        cells = " | ".join(f"{x:.2f}x" for x in speedups)
        lines.append(
            f"| {key[0]} | {key[1]} | {results[key]['skrull']['vs_deepspeed']:.2f}x | {cells} "
            f"| {PAPER_SPEEDUP[key]:.2f}x |"
        )
    lines += [
        "",
        "The most any plan could gain under the default model: the baseline's mean time over "
        "the mean lower bound (a plan at the bound on every batch).",
        "",
        "| model | dataset | ceiling vs static | ceiling vs deepspeed | paper vs deepspeed |",
        "|---|---|---:|---:|---:|",
    ]
    for key, res in results.items():
        c = res[CEILING]
        lines.append(
            f"| {key[0]} | {key[1]} | {c['vs_static']:.2f}x | {c['vs_deepspeed']:.2f}x "
            f"| {PAPER_SPEEDUP[key]:.2f}x |"
        )
    if bandwidths:
        lines += [
            "",
            "Skrull when the K/V all-gather is slower: Qwen2.5-7B's CP group of 16 spans two "
            "nodes of 8 GPUs, so a real all-gather crosses the inter-node network, and so does "
            "a CP group of 8 on nodes of fewer GPUs (the default assumes 100 GB/s, "
            "NVLink-class; 50, 25 and 12.5 GB/s are 400, 200 and 100 Gb/s InfiniBand per GPU). "
            "Same batches; skrull over packed `static` (ceiling; skrull over the lower bound):",
            "",
            "| model | dataset | " + " | ".join(f"{b / 1e9:g} GB/s" for b in BANDWIDTHS) + " |",
            "|---|---|" + "---:|" * len(BANDWIDTHS),
        ]
        for key, cells in bandwidths.items():
            row = " | ".join(
                f"{ours:.2f}x ({ceiling:.2f}x; {ratio:.3f})" for ours, ceiling, ratio in cells
            )
            lines.append(f"| {key[0]} | {key[1]} | {row} |")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines += [
        "",
        f"Planning times are CPU times of one process on a {os.cpu_count()}-core machine with "
        f"load average {load} while this ran.",
        "",
        "Targets (skrull, default constants):",
        "",
    ]
    lines += target_lines(results, cluster, paper_timing)
    lines += list(measured_section)
    lines += list(calibration)
    return "\n".join(lines) + "\n"


def _beyond(ceiling: dict[str, float], key: str, target: float) -> str:
    """A note when even a plan at the lower bound would miss ``target``."""
    if ceiling[key] >= target:
        return ""
    return f"; no plan can reach it under this model, ceiling {ceiling[key]:.2f}x"


def target_lines(results, cluster, paper_timing=()) -> list[str]:
    """One line per target: met or missed, with the numbers. ``paper_timing`` holds
    :meth:`PlanTimer.rows` keyed by ``(model, dataset)``; where given, the planning target is
    judged on them instead of the table's back-to-back runs."""
    spread = {key: worst for key, _, worst, _ in paper_timing}
    out = []
    for (model, dataset), res in results.items():
        r, ceiling = res["skrull"], res[CEILING]
        plan_max = spread.get((model, dataset), r["plan_ms_max"])
        paper = PAPER_SPEEDUP[(model, dataset)]

        checks = [
            (r["vs_bound"] <= 1.15, f"within 1.15x of the lower bound ({r['vs_bound']:.3f})"),
            (
                r["vs_deepspeed"] >= paper,
                f"at or above the paper's {paper:.2f}x over DeepSpeed ({r['vs_deepspeed']:.2f}x"
                + _beyond(ceiling, "vs_deepspeed", paper)
                + ")",
            ),
        ]
        if dataset in LONG_TAILED:
            checks.append(
                (
                    r["vs_static"] >= 1.3,
                    f">= 1.3x over packed static ({r['vs_static']:.2f}x"
                    + _beyond(ceiling, "vs_static", 1.3)
                    + ")",
                )
            )
        if model == "Qwen2.5-0.5B":
            checks.append(
                (
                    plan_max < 5.0,
                    f"planning < 5 ms per 256 sequences (max {plan_max:.2f} ms)",
                )
            )
        for ok, text in checks:
            out.append(f"- {'met' if ok else 'MISSED'}: {model} / {dataset}: {text}")
    for name, _, worst, _ in cluster:
        ok = worst < 50.0
        out.append(
            f"- {'met' if ok else 'MISSED'}: cluster-scale planning < 50 ms on {name} "
            f"(max {worst:.1f} ms)"
        )
    return out


def write_chart(results, path: Path) -> None:
    """Bar chart: speedup over the DeepSpeed baseline per setting and policy, paper marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results)
    policies = [p for p in results[keys[0]] if p not in (DEEPSPEED, CEILING)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(policies)
    for k, p in enumerate(policies):
        xs = [i + (k - len(policies) / 2 + 0.5) * width for i in range(len(keys))]
        axes[0].bar(xs, [results[key][p]["vs_deepspeed"] for key in keys], width, label=p)
        axes[1].bar(xs, [results[key][p]["vs_bound"] for key in keys], width, label=p)
    axes[0].scatter(
        range(len(keys)),
        [PAPER_SPEEDUP[key] for key in keys],
        marker="_",
        s=600,
        color="black",
        zorder=3,
        label="paper (skrull)",
    )
    labels = [f"{m.split('-')[1]}\n{d.split('-')[0]}" for m, d in keys]
    axes[0].set_title("simulated speedup over DeepSpeed baseline (higher is better)")
    axes[1].set_title("simulated time / lower bound (lower is better)")
    axes[1].axhline(1.15, color="grey", linestyle="--", linewidth=1, label="1.15 target")
    axes[1].set_ylim(bottom=0.9)
    axes[1].legend(fontsize=7)
    for ax in axes:
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels(labels, fontsize=8)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


ABLATION_SLOW_BANDWIDTH = 25e9
"""The ablation's slow-link constants: the communication table's 25 GB/s (200 Gb/s InfiniBand
per GPU, a CP group spanning nodes), other constants at their defaults."""


def ablation(batches: int, seed: int) -> str:
    """Markdown table: skrull with each step beyond the paper switched off alone
    (:class:`PlannerOptions`), on the paper's six settings, under the default constants, the
    measured ones and slow CP links (:data:`ABLATION_SLOW_BANDWIDTH`): the mean simulated
    speed-up over packed ``static``, the mean ratio to the lower bound, and the mean planning
    time (CPU ms, one run per batch)."""
    variants = [("all steps", PlannerOptions())]
    variants += [(f"no {step}", PlannerOptions(**{step: False})) for step in PlannerOptions.steps()]
    variants.append(("paper only", PlannerOptions.paper()))
    measured = measured_constants(json.loads(MEASURED.read_text()))
    keys = [(s, d) for s in settings() for d in DATASETS]
    slow = {s.model: {"comm_bandwidth": ABLATION_SLOW_BANDWIDTH} for s in settings()}
    overheads = ", ".join(
        f"{name[8:]} {c['micro_batch_overhead_s'] * 1e3:.0f} ms" for name, c in measured.items()
    )
    constant_sets = (
        ("default", None),
        (f"H200-measured (micro-batch overhead {overheads})", measured),
        (
            f"slow CP links (default, K/V all-gather at {ABLATION_SLOW_BANDWIDTH / 1e9:g} GB/s)",
            slow,
        ),
    )
    lines = []
    for label, constants in constant_sets:
        lines += [
            "",
            f"Constants: {label}. Each cell: speed-up over packed static / ratio to the lower "
            "bound / planning ms (means over the batches).",
            "",
            "| variant | "
            + " | ".join(f"{s.model[8:]} {d.name.split('-')[0]}" for s, d in keys)
            + " |",
            "|---|" + "---:|" * len(keys),
        ]
        rows: dict[str, list[str]] = {name: [] for name, _ in variants}
        for s, d in keys:
            model = CostModel(shape=s.shape, **(constants[s.model] if constants else {}))
            same = setting_batches(s, d, batches, seed)
            kw = dict(dp_size=s.dp_size, cp_size=s.cp_size, bucket_size=s.bucket_size)
            static = sum(simulate(plan_for("static", ls, s, model), ls, model) for ls in same)
            bounds = [lower_bound(ls, **kw, cost_model=model) for ls in same]
            for name, options in variants:
                total, ratio, ms = 0.0, 0.0, 0.0
                for ls, bound in zip(same, bounds, strict=True):
                    t0 = time.process_time()
                    plan = plan_global_batch(ls, **kw, cost_model=model, options=options)
                    ms += (time.process_time() - t0) * 1e3
                    t = simulate(plan, ls, model)
                    total += t
                    ratio += t / bound
                rows[name].append(
                    f"{static / total:.3f}x / {ratio / len(same):.4f} / {ms / len(same):.1f}"
                )
        lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows.items()]
    return "\n".join(lines) + "\n"


READING = """
## Reading the results

- All numbers come from the cost model. The first tables use its default constants, which are
  guesses; the last section uses the compute constants measured on one H200. They compare
  plans; they do not predict wall time of a multi-GPU run (communication is not measured).
- The lower bound relaxes a plan three ways: work spread evenly over the GPUs, sequences
  fractionally local or distributed with communication hidden behind any attention of the
  batch (local, and distributed, which K/V groups let hide other groups' exchange), and no
  balance lost to whole sequences between CP ranks. It does charge one micro-batch per DP
  rank that holds a sequence, and it forces onto the distributed path every sequence whose
  local time alone exceeds the iteration time it claims. The ratio is highest on Qwen2.5-7B's
  short-sequence sets, where whole sequences balance 16 CP ranks only in coarse steps and every
  sharded token pays exposed communication. There the DP split mattered most: balanced over
  both DP ranks, a few long sequences left no CP rank room for the medium ones to stay whole.
  GDS now also weighs a split that gathers the sequences sharded anyway on few DP ranks
  (docs/scheduling.md), planned beside the balanced one up to 128 sequences, which took the
  7B ratios from 1.12 and 1.11 to 1.06 and 1.05 (1.055 and 1.049 against the bound that also
  charges the collectives' latency);
  `benchmarks/placement_search.py` found little left in the placements themselves
  (docs/benchmarks.md).
- Against packed `static`, skrull gains what sharding short sequences costs: communication
  and attention tiles. On Qwen2.5-7B's short-sequence sets the matmuls dominate so much that
  those costs are small at the default 100 GB/s: skrull is 1.24x and 1.22x faster than
  `static` there (1.17x before GDS weighed the gathered split), and a plan at the lower bound
  would be 1.31x and 1.27x. A CP group of 16 spans two nodes, though; over the inter-node
  network (the communication table) skrull's gain grows to 1.39-1.46x, which a construction
  added to DACP for slow communication makes possible (the greedy alone stayed at 1.14x at
  25 GB/s). The baselines
  keep one K/V exchange per micro-batch, as the systems they stand for do; cut into groups
  like skrull's, packed `static` would be 4-10% faster on these settings (default constants).
- Against the unpacked DeepSpeed baseline the gain is mostly the fixed cost of its 64 tiny
  micro-batches per DP rank. Measured on one H200 that cost is 53 ms (0.5B) and 69 ms (7B) per
  micro-batch, not the default 2 ms: most of it is the host launching eager kernels layer by
  layer. With the measured constants skrull is 12-32x faster than the baseline on the
  short-sequence sets, beyond every speedup the paper reports, and 1.97x and 2.85x on
  ChatQA2-like data (the paper: 1.35x and 2.79x). On the latter every sequence is sharded, so
  no local attention hides the K/V exchange; with one all-gather per micro-batch it was fully
  exposed and skrull reached 1.76x and 2.65x. K/V groups (docs/scheduling.md) run each
  group's exchange behind the previous group's distributed attention, in the backward too.
  The paper's baseline was DeepSpeed's own engine, whose fixed cost per micro-batch we did not
  measure, so these multiples say what packing saves on this stack, not what the paper's
  baseline lost.
- Planning times move by up to 2x between identical runs on this shared machine (the same
  cluster-scale batch took 36 and 58 ms minutes apart): other processes only ever add CPU
  time. The `plan (ms)` column keeps the least of 3 runs back to back; the planning-time table
  (skrull's 256-sequence and cluster-scale batches, on which the targets are judged) spreads
  the runs of each batch over the whole benchmark and keeps the least, with the median of all
  runs beside it. Choosing K/V groups costs about 10 ms of the cluster-scale ChatQA2-like
  plans, where every one of 256 micro-batches is cut (38 ms before), and under 1 ms of the
  256-sequence ones.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=20, help="global batches per setting")
    parser.add_argument("--cluster-batches", type=int, default=3, help="batches at cluster scale")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print only; do not write docs/")
    parser.add_argument(
        "--ablation", action="store_true", help="print only the table of each step switched off"
    )
    parser.add_argument(
        "--calibration-steps",
        type=int,
        default=24,
        help="steps of the online calibration table's closed loop (0: no table)",
    )
    parser.add_argument(
        "--topology-only", action="store_true", help="print only the CP-block topology table"
    )
    args = parser.parse_args(argv)
    if args.ablation:
        print(ablation(args.batches, args.seed))
        return 0
    topology = topology_table.topology_section(
        settings(),
        lambda s, d: setting_batches(s, d, args.batches, args.seed),
        args.batches,
        args.seed,
    )
    if args.topology_only:
        print("\n".join(topology))
        return 0

    cluster, paper = plan_timers(args.cluster_batches, args.batches, args.seed)

    def time_planning() -> None:  # between the other parts: see PlanTimer
        cluster.round()
        paper.round()

    time_planning()
    results = {}
    for s in settings():
        for dataset in DATASETS:
            results[(s.model, dataset.name)] = run_setting(s, dataset, args.batches, args.seed)
            time_planning()
    sensitivity = overhead_sensitivity(args.batches, args.seed)
    time_planning()
    section: list[str] = []
    if MEASURED.exists():
        probe = json.loads(MEASURED.read_text())
        measured = measured_constants(probe)
        results_measured = {}
        for s in settings():
            for dataset in DATASETS:
                results_measured[(s.model, dataset.name)] = run_setting(
                    s, dataset, args.batches, args.seed, measured[s.model]
                )
                time_planning()
        section = measured_tables(results_measured, measured, probe)
    bandwidths = bandwidth_sensitivity(args.batches, args.seed)
    time_planning()
    calibration: list[str] = []
    if args.calibration_steps > 0:
        calibration = calibration_section(args.calibration_steps, 6, args.seed)
        time_planning()
    report = format_tables(
        results,
        cluster.rows(),
        sensitivity,
        args,
        section,
        bandwidths,
        paper_timing=paper.rows(),
        runs=cluster.runs,
        calibration=calibration,
    )
    report += "\n".join(topology) + "\n"
    print(report)
    if not args.no_write:
        command = "python -m benchmarks.simulate_paper"
        if args.batches != 20 or args.seed != 0:
            command += f" --batches {args.batches} --seed {args.seed}"
        if args.calibration_steps != 24:
            command += f" --calibration-steps {args.calibration_steps}"
        md = (
            "# Simulated reproduction of the paper's settings\n\n"
            f"Produced by `{command}`; the chart is `img/simulate_paper.png`.\n\n"
            + report
            + READING
            + "\n![speedup and ratio to the lower bound](img/simulate_paper.png)\n"
        )
        (ROOT / "docs" / "simulate_paper.md").write_text(md)
        write_chart(results, ROOT / "docs" / "img" / "simulate_paper.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
