"""Host time to build one rank's batch of a global batch: fetch the samples, plan, collate.

Every rank plans the whole global batch and turns all of its samples into tensors (for the
global supervised-token count and the batch checksum), then collates its own micro-batches.
That runs in the DataLoader (in its workers when ``num_workers > 0``, else on the training
loop's critical path). Two ways to fetch the samples from an :class:`SFTDataset`:

* ``lists``: ``dataset[i]``, the public indexing, which returns Python lists;
* ``arrays``: ``dataset.arrays(i)``, int64 arrays, what :class:`SkrullDataModule` uses.

Lengths log-normal (median about 400 tokens, cut at 8192), rank 0 of the layout, the default
cost model, bucket 16384 tokens, one thread; median of 5 builds, ms.

Run::

    python -m benchmarks.batch_build           # the table of docs/benchmarks.md
    python -m benchmarks.batch_build --smoke   # one small global batch
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from lightning_skrull.data import SFTDataset, load_sft_data
from lightning_skrull.data.batch import RankPlanner
from lightning_skrull.scheduling import CostModel

LAYOUTS = ((64, 1, 1), (512, 8, 1), (2048, 32, 2))
"""(sequences per global batch, DP size, CP size)."""


def make_dataset(num_sequences: int, seed: int = 0) -> SFTDataset:
    """``num_sequences`` samples of log-normal lengths (every token supervised)."""
    rng = random.Random(seed)
    lengths = [min(8192, int(rng.lognormvariate(6, 1.2)) + 2) for _ in range(num_sequences)]
    return load_sft_data([{"input_ids": [t % 1000 for t in range(n)]} for n in lengths])


def build_ms(dataset: SFTDataset, planner: RankPlanner, fetch: str, repeats: int = 5) -> float:
    """Median ms of fetching every sample (``"lists"`` or ``"arrays"``) and planning and
    collating rank 0's batch."""
    indices = list(range(len(dataset)))
    times = []
    for r in range(repeats):
        start = time.perf_counter()
        if fetch == "lists":
            samples: list[Any] = [dataset[i] for i in indices]
        else:
            samples = [dataset.arrays(i) for i in indices]
        planner(samples, indices, 0, r)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Print the table; return its rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one global batch of 16 sequences")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _table(((16, 2, 1),) if args.smoke else LAYOUTS)
    finally:
        torch.set_num_threads(threads)


def _table(layouts: Sequence[tuple[int, int, int]]) -> list[dict[str, Any]]:
    """Print the table of ``layouts``; return its rows."""
    print("| sequences | DP x CP | tokens | lists ms | arrays ms | lists / arrays |")
    print("|---:|---|---:|---:|---:|---:|")
    rows = []
    for n, dp, cp in layouts:
        dataset = make_dataset(n)
        planner = RankPlanner(
            dp_size=dp,
            cp_size=cp,
            dp_rank=0,
            cp_rank=0,
            bucket_size=16384,
            policy="skrull",
            cost_model=CostModel(),
        )
        row = {
            "sequences": n,
            "layout": (dp, cp),
            "tokens": dataset.num_tokens,
            "lists_ms": build_ms(dataset, planner, "lists"),
            "arrays_ms": build_ms(dataset, planner, "arrays"),
        }
        rows.append(row)
        print(
            f"| {n} | {dp} x {cp} | {row['tokens']:,} | {row['lists_ms']:.1f} | "
            f"{row['arrays_ms']:.1f} | {row['lists_ms'] / row['arrays_ms']:.1f}x |",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
