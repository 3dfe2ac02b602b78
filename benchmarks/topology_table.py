"""The topology table of ``benchmarks/simulate_paper.py``: today's plans against block plans.

Block plans (``PlannerOptions(dacp_blocks=True)``) may shard a sequence over an aligned block of
the CP group instead of the whole group (docs/scheduling.md). The table plans the paper's six
settings on one node's links, and Qwen2.5-7B at DP=2 x CP=16 over two nodes of 8 GPUs
(``CostModel(ranks_per_node=8)``, the inter-node all-gather at 25 and 50 GB/s), with and without
the block step, and reports each as its ratio to the lower bound over every plan, blocks
included (``lower_bound(..., blocks=True)``).

Only this table::

    python -m benchmarks.simulate_paper --topology-only --batches 5
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.lengths import DATASETS, Dataset
from lightning_skrull.scheduling import (
    CostModel,
    PlannerOptions,
    degree_shares,
    lower_bound,
    plan_global_batch,
    simulate,
)

INTER_NODE = (25e9, 50e9)
"""Inter-node all-gather bandwidths of the two-node rows (200 and 400 Gb/s InfiniBand per GPU)."""
RANKS_PER_NODE = 8
BLOCKS = PlannerOptions(dacp_blocks=True)


Setting = Any
"""A ``benchmarks.simulate_paper.Setting`` (``model``, ``shape``, ``dp_size``, ``cp_size``,
``bucket_size``)."""
Batches = Callable[[Any, Dataset], list[list[int]]]
"""The global batches of a setting and dataset (``simulate_paper.setting_batches``, bound)."""


def layouts(paper: Sequence[Setting]) -> list[tuple[Setting, str, CostModel | None]]:
    """``(setting, links, constants)``: the paper's settings on one node's links, then 7B (the
    second setting) over two nodes (``None``: the setting's default cost model)."""
    out: list[tuple[Setting, str, CostModel | None]] = [(s, "one node", None) for s in paper]
    seven = paper[1]
    for bandwidth in INTER_NODE:
        model = CostModel(
            shape=seven.shape, ranks_per_node=RANKS_PER_NODE, inter_node_bandwidth=bandwidth
        )
        out.append((seven, f"2 nodes x 8, {bandwidth / 1e9:g} GB/s", model))
    return out


def measure(s: Setting, model: CostModel, batches: list[list[int]]) -> dict[str, float]:
    """Means over ``batches``: both plans' ratios to the lower bound, block plans' time over
    today's, their block token share and the planning CPU ms of each."""
    kw = dict(dp_size=s.dp_size, cp_size=s.cp_size, bucket_size=s.bucket_size, cost_model=model)
    rows: dict[str, list[float]] = {
        k: [] for k in ("today", "blocks", "ratio", "share", "ms0", "ms1")
    }
    for lengths in batches:
        bound = lower_bound(lengths, **kw, blocks=True)
        t0 = time.process_time()
        today = plan_global_batch(lengths, **kw)
        t1 = time.process_time()
        ours = plan_global_batch(lengths, **kw, options=BLOCKS)
        t2 = time.process_time()
        a, b = simulate(today, lengths, model), simulate(ours, lengths, model)
        shares = degree_shares(ours, lengths)
        rows["today"].append(a / bound)
        rows["blocks"].append(b / bound)
        rows["ratio"].append(b / a)
        rows["share"].append(sum(v for d, v in shares.items() if 1 < d < s.cp_size))
        rows["ms0"].append((t1 - t0) * 1e3)
        rows["ms1"].append((t2 - t1) * 1e3)
    out = {k: statistics.fmean(v) for k, v in rows.items()}
    out["ms1_max"] = max(rows["ms1"])
    out["ratio_max"] = max(rows["ratio"])
    return out


def topology_section(
    paper: Sequence[Setting], batches_of: Batches, batches: int, seed: int
) -> list[str]:
    """Markdown lines of the table and its targets, on the paper's settings ``paper``."""
    lines = [
        "",
        "## CP blocks and the topology",
        "",
        "Plans without blocks (today's) and with `PlannerOptions(dacp_blocks=True)`, which may "
        "shard a sequence over an aligned block of the CP group (inside a node where it can). "
        "Ratios are to the lower bound over every plan, blocks included (`lower_bound(..., "
        f"blocks=True)`); means over {batches} batches per row, seed {seed}. Two-node rows: "
        f"Qwen2.5-7B at DP=2 x CP=16, `CostModel(ranks_per_node={RANKS_PER_NODE})`, the node's "
        "links at the default 100 GB/s, the inter-node all-gather as given. Planning: CPU ms, "
        "one run per batch.",
        "",
        "| model | links | dataset | today / bound | blocks / bound | blocks / today (mean; max) "
        "| tokens on blocks | plan ms today | plan ms blocks (mean; max) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    targets = []
    for s, links, constants in layouts(paper):
        model = constants or CostModel(shape=s.shape)
        for dataset in DATASETS:
            r = measure(s, model, batches_of(s, dataset))
            lines.append(
                f"| {s.model} | {links} | {dataset.name} | {r['today']:.3f} | {r['blocks']:.3f} "
                f"| {r['ratio']:.3f}; {r['ratio_max']:.3f} | {r['share']:.0%} | {r['ms0']:.1f} "
                f"| {r['ms1']:.1f}; {r['ms1_max']:.1f} |"
            )
            targets.append(_target(s, links, dataset.name, r))
    return [*lines, "", "Targets:", "", *[t for t in targets if t]]


def _target(s: Setting, links: str, dataset: str, r: dict[str, float]) -> str:
    """The target line of one row, or ``""`` where none applies."""
    if links == "one node":
        ok = r["ratio"] <= 1.01
        return (
            f"- {'met' if ok else 'MISSED'}: {s.model} / {dataset} on one node: block plans no "
            f"more than 1% slower than today's ({r['ratio']:.3f}x)"
        )
    if dataset.startswith("LMsys"):
        return ""
    ok = r["blocks"] <= 1.30
    goal = "goal 1.20 met" if r["blocks"] <= 1.20 else "goal 1.20 missed"
    return (
        f"- {'met' if ok else 'MISSED'}: {s.model} / {dataset} over {links}: block plans within "
        f"1.30x of the lower bound ({r['blocks']:.3f}, today's {r['today']:.3f}; {goal})"
    )
