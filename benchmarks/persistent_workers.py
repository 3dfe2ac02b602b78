"""What restarting the DataLoader workers costs per epoch, by worker start method, on CPU.

    python -m benchmarks.persistent_workers [--epochs 4 --workers 2 --samples 2048]

One rank's :class:`SkrullDataLoader` (DP 2 x CP 2 plans, global batches of 64 samples with the
long-tailed lengths of :mod:`benchmarks.data_loading`), iterated for several epochs with no
training in between, so the times are the data path alone. For each start method the table
shows the seconds of the first batch of an epoch and of a whole epoch, after the first epoch,
with the workers started anew every epoch (``persistent_workers=False``) and kept alive
(``True``); the last column is what a restart costs per epoch (and per validation run, whose
loader restarts its workers the same way). The batches of both settings are checked equal.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from typing import Any

from benchmarks.data_loading import make_samples
from lightning_skrull.data import load_sft_data
from lightning_skrull.data.batch import RankPlanner
from lightning_skrull.data.loader import GlobalBatchStream, SkrullDataLoader
from lightning_skrull.data.sampler import GlobalBatchSampler
from lightning_skrull.scheduling import CostModel

BUCKET = 16_384  # tokens per CP rank: the longest sample, 32K tokens, fits the CP group


def _loader(dataset: Any, workers: int, persistent: bool, method: str) -> SkrullDataLoader:
    sampler = GlobalBatchSampler(len(dataset), 64, shuffle=True, seed=0)
    planner = RankPlanner(
        dp_size=2,
        cp_size=2,
        dp_rank=0,
        cp_rank=0,
        bucket_size=BUCKET,
        policy="skrull",
        cost_model=CostModel(),
    )
    loader = SkrullDataLoader(
        GlobalBatchStream(dataset, sampler, planner),
        num_workers=workers,
        persistent_workers=persistent,
    )
    loader.multiprocessing_context = method
    return loader


def _epochs(loader: SkrullDataLoader, epochs: int) -> tuple[list[float], list[float], list[Any]]:
    """Seconds to the first batch and of the whole epoch, for each epoch; the batches."""
    firsts, totals, batches = [], [], []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        start = time.perf_counter()
        first = None
        for batch in loader:
            if first is None:
                first = time.perf_counter() - start
            batches.append((batch.epoch, batch.index, batch.rank_batch.sample_indices))
        firsts.append(first or 0.0)
        totals.append(time.perf_counter() - start)
    return firsts, totals, batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--methods", default="fork,forkserver,spawn")
    args = parser.parse_args()
    samples = _samples(args.samples)
    dataset = load_sft_data(samples)
    print(
        f"{len(dataset)} samples, {dataset.num_tokens} tokens, {args.workers} workers, "
        f"epochs 2-{args.epochs} (median)"
    )
    print(
        f"{'start method':>12} {'first batch s':>14} {'persistent':>11} {'epoch s':>9} "
        f"{'persistent':>11} {'restart s/epoch':>16}"
    )
    for method in args.methods.split(","):
        row: dict[bool, tuple[float, float]] = {}
        seen = {}
        for persistent in (False, True):
            loader = _loader(dataset, args.workers, persistent, method)
            firsts, totals, seen[persistent] = _epochs(loader, args.epochs)
            del loader
            row[persistent] = (statistics.median(firsts[1:]), statistics.median(totals[1:]))
        assert seen[False] == seen[True], "persistent workers built other batches"
        print(
            f"{method:>12} {row[False][0]:>14.3f} {row[True][0]:>11.3f} {row[False][1]:>9.3f} "
            f"{row[True][1]:>11.3f} {row[False][1] - row[True][1]:>16.3f}"
        )


def _samples(count: int) -> list[dict[str, list[int]]]:
    """``count`` samples of :func:`make_samples`'s lengths."""
    out: list[dict[str, list[int]]] = []
    tokens = 2_000_000
    while len(out) < count:
        out = make_samples(tokens)
        tokens *= 2
    return out[:count]


if __name__ == "__main__":
    multiprocessing.freeze_support()
    main()
