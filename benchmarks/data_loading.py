"""Time loading and validating SFT data of growing size; prints a table.

    python -m benchmarks.data_loading [--max-tokens 20000000]

Samples have long-tailed lengths (most short, a few long) over a 32K vocabulary. For each size
the table shows the seconds to build an :class:`SFTDataset` from in-memory lists, from a JSON
Lines file, from a Parquet file, and for ``validate(vocab_size=..., max_tokens=...)``; the last
column is validation throughput. Validation is vectorised and linear in tokens.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lightning_skrull.data import load_sft_data

VOCAB = 32_000


def make_samples(num_tokens: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """Samples with log-normal lengths (median ~300, tail to 32K) totalling ~num_tokens."""
    rng = np.random.default_rng(seed)
    samples, total = [], 0
    while total < num_tokens:
        length = int(min(32_000, max(16, rng.lognormal(5.7, 1.2))))
        ids = rng.integers(0, VOCAB, size=length)
        labels = ids.copy()
        labels[: length // 2] = -100
        samples.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
        total += length
    return samples


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """Seconds one call takes, and its result."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=4_000_000)
    args = parser.parse_args()
    sizes = [n for n in (250_000, 1_000_000, 4_000_000, 20_000_000) if n <= args.max_tokens]
    print(
        f"{'tokens':>11} {'samples':>8} {'lists s':>8} {'jsonl s':>8} {'parquet s':>9} "
        f"{'validate s':>10} {'Mtok/s':>7}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            samples = make_samples(size)
            jsonl, parquet = Path(tmp, "d.jsonl"), Path(tmp, "d.parquet")
            jsonl.write_text("".join(json.dumps(s) + "\n" for s in samples))
            pq.write_table(pa.Table.from_pylist(samples), parquet)
            t_lists, dataset = timed(load_sft_data, samples)
            t_jsonl, _ = timed(load_sft_data, jsonl)
            t_parquet, _ = timed(load_sft_data, parquet)
            t_validate, _ = timed(dataset.validate, vocab_size=VOCAB, max_tokens=32_000)
            tokens = dataset.num_tokens
            print(
                f"{tokens:>11,} {len(dataset):>8,} {t_lists:>8.2f} {t_jsonl:>8.2f} "
                f"{t_parquet:>9.2f} {t_validate:>10.3f} {tokens / t_validate / 1e6:>7.0f}"
            )


if __name__ == "__main__":
    main()
