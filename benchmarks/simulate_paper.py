"""Reproduce the paper's settings in simulation and compare the planner's policies.

Settings (Skrull, arXiv 2505.19609, 4 nodes x 8 H100): Qwen2.5-0.5B with DP=4, CP=8, 64
sequences per DP rank, BucketSize 26K; Qwen2.5-7B with DP=2, CP=16, 40 per DP rank, 13K. The
length distributions are rebuilt from the shares the paper publishes (its Table 1): the share
of sequences under 1K / 4K / 8K / 32K / 128K tokens and the longest one; inside each band
lengths are drawn log-uniformly. Times come from :func:`lightning_skrull.scheduling.simulate`
with the cost model of each model's real shape and the default H100-class constants; the
lower bound from :func:`lightning_skrull.scheduling.lower_bound`.

Run::

    python benchmarks/simulate_paper.py            # prints the tables, writes docs/
    python benchmarks/simulate_paper.py --batches 5 --no-write

It writes ``docs/simulate_paper.md`` (the tables and the command) and
``docs/img/simulate_paper.png`` (a chart; needs matplotlib).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from transformers import Qwen2Config

from lightning_skrull.scheduling import (
    POLICIES,
    CostModel,
    GlobalBatchPlan,
    lower_bound,
    plan_global_batch,
    simulate,
)
from lightning_skrull.scheduling.baselines import plan_static_unpacked

ROOT = Path(__file__).resolve().parent.parent
DEEPSPEED = "deepspeed"
"""Label of the paper's DeepSpeed baseline: static CP, one sequence per micro-batch."""
CEILING = "ceiling"
"""Key of the speedups a plan at the lower bound on every batch would have (no plan does better)."""


@dataclass(frozen=True)
class Dataset:
    """A length distribution rebuilt from the paper's Table 1.

    Attributes:
        name: dataset name.
        shares: cumulative share of sequences under 1K, 4K, 8K, 32K and 128K tokens.
        longest: the longest sequence the paper reports.
    """

    name: str
    shares: tuple[float, float, float, float, float]
    longest: int


DATASETS = (
    Dataset("Wikipedia", (0.879, 0.993, 0.999, 0.9999, 1.0), 78_000),
    Dataset("LMsysChat1M", (0.871, 0.994, 0.999, 0.9998, 0.9999), 1_643_000),
    Dataset("ChatQA2-Long-SFT", (0.219, 0.315, 0.404, 0.999, 1.0), 99_000),
)
EDGES = (1_024, 4_096, 8_192, 32_768, 131_072)
SHORTEST = 64
"""Shortest sample drawn (the paper gives no lower edge for the first band)."""

PAPER_SPEEDUP = {  # Skrull over DeepSpeed, paper's Table / summary
    ("Qwen2.5-0.5B", "Wikipedia"): 7.54,
    ("Qwen2.5-0.5B", "LMsysChat1M"): 6.17,
    ("Qwen2.5-0.5B", "ChatQA2-Long-SFT"): 2.79,
    ("Qwen2.5-7B", "Wikipedia"): 2.60,
    ("Qwen2.5-7B", "LMsysChat1M"): 2.14,
    ("Qwen2.5-7B", "ChatQA2-Long-SFT"): 1.35,
}
LONG_TAILED = ("Wikipedia", "LMsysChat1M")


@dataclass(frozen=True)
class Setting:
    """One model x parallel layout of the paper."""

    model: str
    config: Qwen2Config
    dp_size: int
    cp_size: int
    per_dp_rank: int
    bucket_size: int


def settings() -> list[Setting]:
    """The paper's two model settings, configs built here (no download)."""
    small = Qwen2Config(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=4864,
        vocab_size=151936,
    )
    large = Qwen2Config(
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=18944,
        vocab_size=152064,
    )
    return [
        Setting("Qwen2.5-0.5B", small, dp_size=4, cp_size=8, per_dp_rank=64, bucket_size=26_000),
        Setting("Qwen2.5-7B", large, dp_size=2, cp_size=16, per_dp_rank=40, bucket_size=13_000),
    ]


def sample_lengths(
    dataset: Dataset, n: int, capacity: int, rng: random.Random, *, scale: int = 1
) -> list[int]:
    """Draw ``n`` lengths: a band by its published share, then log-uniform inside the band.

    Every drawn length is divided by ``scale`` (the CPU benchmark runs the distributions scaled
    down); ``dataset`` needs only ``shares`` and ``longest``.

    Lengths above ``capacity`` (one CP group's tokens) are cut to it: the paper does not say how
    it handled them, and the planner refuses them rather than dropping them silently.
    """
    lows = (SHORTEST, *EDGES[:-1])
    highs = tuple(min(e, dataset.longest) for e in EDGES)
    shares = [dataset.shares[0]] + [
        dataset.shares[i] - dataset.shares[i - 1] for i in range(1, len(EDGES))
    ]
    tail = 1.0 - dataset.shares[-1]
    bands = list(zip(lows, highs, shares, strict=True))
    if tail > 0:
        bands.append((EDGES[-1], dataset.longest, tail))
    out = []
    for _ in range(n):
        u = rng.random()
        for lo, hi, share in bands:
            if u < share or (lo, hi, share) == bands[-1]:
                break
            u -= share
        length = int(math.exp(rng.uniform(math.log(lo), math.log(max(hi, lo + 1))))) // scale
        out.append(max(1, min(length, capacity)))
    return out


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


def run_setting(s: Setting, dataset: Dataset, batches: int, seed: int) -> dict[str, dict]:
    """Mean time, lower-bound ratio and planning time of every policy on one setting."""
    model = CostModel.from_hf_config(s.config)
    rng = random.Random(f"{seed}-{s.model}-{dataset.name}")
    n = s.dp_size * s.per_dp_rank
    policies = [*POLICIES, DEEPSPEED]
    times: dict[str, list[float]] = {p: [] for p in policies}
    ratios: dict[str, list[float]] = {p: [] for p in policies}
    plan_ms: dict[str, list[float]] = {p: [] for p in policies}
    bounds: list[float] = []
    for _ in range(batches):
        lengths = sample_lengths(dataset, n, s.cp_size * s.bucket_size, rng)
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


CLUSTER_REPEATS = 5
"""Runs per cluster-scale batch; the least CPU time counts (the machine is shared)."""


def cluster_planning(batches: int, seed: int) -> list[tuple[str, float, float]]:
    """Skrull planning time at DP=64 x CP=16 with 4096 sequences (BucketSize 13K)."""
    s = settings()[1]
    model = CostModel.from_hf_config(s.config)
    rows = []
    for dataset in DATASETS:
        rng = random.Random(f"{seed}-cluster-{dataset.name}")
        ms = []
        for _ in range(batches):
            lengths = sample_lengths(dataset, 4096, 16 * s.bucket_size, rng)
            best = math.inf
            for _ in range(CLUSTER_REPEATS):
                t0 = time.process_time()
                plan_global_batch(
                    lengths, dp_size=64, cp_size=16, bucket_size=s.bucket_size, cost_model=model
                )
                best = min(best, time.process_time() - t0)
            ms.append(best * 1e3)
        rows.append((dataset.name, statistics.fmean(ms), max(ms)))
    return rows


OVERHEADS_S = (10e-3, 20e-3)
"""Per-micro-batch overheads of the sensitivity table (the default is 2 ms)."""


def overhead_sensitivity(batches: int, seed: int) -> dict[tuple[str, str], list[float]]:
    """Skrull's speedup over the DeepSpeed baseline when a micro-batch costs more fixed time."""
    out: dict[tuple[str, str], list[float]] = {}
    for s in settings():
        for dataset in DATASETS:
            speedups = []
            for overhead in OVERHEADS_S:
                model = CostModel.from_hf_config(s.config, micro_batch_overhead_s=overhead)
                rng = random.Random(f"{seed}-{s.model}-{dataset.name}")
                n = s.dp_size * s.per_dp_rank
                ours, theirs = 0.0, 0.0
                for _ in range(batches):
                    lengths = sample_lengths(dataset, n, s.cp_size * s.bucket_size, rng)
                    ours += simulate(plan_for("skrull", lengths, s, model), lengths, model)
                    theirs += simulate(plan_for(DEEPSPEED, lengths, s, model), lengths, model)
                speedups.append(theirs / ours)
            out[(s.model, dataset.name)] = speedups
    return out


def format_tables(results, cluster, sensitivity, args) -> str:
    """The Markdown report."""
    lines = [
        "Length distributions are rebuilt from the shares published in the paper's Table 1 "
        f"(log-uniform inside each band, shortest sample {SHORTEST} tokens, lengths above one CP "
        "group's capacity cut to it); times are simulated with the cost model, not measured.",
        f"{args.batches} global batches per setting, seed {args.seed}. `deepspeed` = static CP "
        "with one sequence per micro-batch (the paper's DeepSpeed baseline as we read it); "
        "`static` = the same with packing. Planning time: least CPU time of 3 runs, mean over "
        "batches (max over batches in the targets).",
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
        "Cluster-scale planning (skrull, DP=64 x CP=16, 4096 sequences, BucketSize 13K; "
        f"least CPU time of {CLUSTER_REPEATS} runs per batch):",
        "",
    ]
    lines += ["| dataset | plan mean (ms) | plan max (ms) |", "|---|---:|---:|"]
    for name, mean, worst in cluster:
        lines.append(f"| {name} | {mean:.1f} | {worst:.1f} |")
    lines += [
        "",
        "The speedup over the DeepSpeed baseline depends mostly on the fixed cost of a "
        "micro-batch (launches, weight traffic), which the default model guesses at 2 ms; "
        "skrull over DeepSpeed with other values (same batches):",
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
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines += [
        "",
        f"Planning times are CPU times of one process on a {os.cpu_count()}-core machine with "
        f"load average {load} while this ran.",
        "",
        "Targets (skrull, default constants):",
        "",
    ]
    lines += target_lines(results, cluster)
    return "\n".join(lines) + "\n"


def _beyond(ceiling: dict[str, float], key: str, target: float) -> str:
    """A note when even a plan at the lower bound would miss ``target``."""
    if ceiling[key] >= target:
        return ""
    return f"; no plan can reach it under this model, ceiling {ceiling[key]:.2f}x"


def target_lines(results, cluster) -> list[str]:
    """One line per target: met or missed, with the numbers."""
    out = []
    for (model, dataset), res in results.items():
        r, ceiling = res["skrull"], res[CEILING]
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
                    r["plan_ms_max"] < 5.0,
                    f"planning < 5 ms per 256 sequences (max {r['plan_ms_max']:.2f} ms)",
                )
            )
        for ok, text in checks:
            out.append(f"- {'met' if ok else 'MISSED'}: {model} / {dataset}: {text}")
    for name, _, worst in cluster:
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


READING = """
## Reading the results

- All numbers come from the cost model with its default, unmeasured constants (see
  `scheduling.md`); they compare plans, they do not predict wall time. Fit the constants to
  your hardware (`CostModel.fit`) before trusting absolute values.
- The lower bound spreads work perfectly over the CP ranks of a micro-batch. On the Qwen2.5-7B
  short-sequence sets (40 sequences per DP rank over 16 CP ranks, about 2.5 per rank) whole
  sequences cannot be balanced that finely, so the bound is loose there: on a batch we checked
  by hand, the best plan of the family "shard the k longest, balance the rest" (all k tried)
  was 2.4% faster than skrull's and still 19% above the bound.
- Against packed `static`, skrull gains what sharding short sequences costs: communication
  and attention tiles. On the short-sequence sets with Qwen2.5-7B the matmuls dominate so much
  that those costs are small (about 13% here); with Qwen2.5-0.5B they are not (about 1.5x).
- Against the unpacked DeepSpeed baseline the gain is mostly the fixed cost of its 64 tiny
  micro-batches per DP rank, which the model does not know; the sensitivity table shows the
  paper's speedups fall between the 2 ms and 10 ms columns on the short-sequence sets and
  beyond even the 20 ms column on ChatQA2.
- The ceiling table is why the paper-speedup targets are missed on all six settings: with the
  default constants even a plan at the lower bound on every batch would stay below the
  paper's figure (for example 5.89x against 7.54x). The paper's baseline ran DeepSpeed ZeRO-2,
  which reduces gradients in every micro-batch's backward, a fixed cost per micro-batch far
  above our 2 ms guess; only measured constants (`CostModel.fit`) can settle the comparison.
  The same table bounds the gain over packed `static` on Qwen2.5-7B's short-sequence sets at
  1.36x and 1.31x, so the 1.3x target there would need a plan within 1-5% of the bound.
- Planning times move by up to 1.5x between identical runs on this shared machine (we saw
  the same batch take 50 and 95 ms); the table keeps the least of several runs, so a max just
  above a target can be noise, but a mean above it is not.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=20, help="global batches per setting")
    parser.add_argument("--cluster-batches", type=int, default=3, help="batches at cluster scale")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print only; do not write docs/")
    args = parser.parse_args(argv)

    results = {}
    for s in settings():
        for dataset in DATASETS:
            results[(s.model, dataset.name)] = run_setting(s, dataset, args.batches, args.seed)
    cluster = cluster_planning(args.cluster_batches, args.seed)
    sensitivity = overhead_sensitivity(args.batches, args.seed)
    report = format_tables(results, cluster, sensitivity, args)
    print(report)
    if not args.no_write:
        command = "python benchmarks/simulate_paper.py"
        if args.batches != 20 or args.seed != 0:
            command += f" --batches {args.batches} --seed {args.seed}"
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
