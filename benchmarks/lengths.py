"""The paper's datasets as length distributions, and the one sampler every benchmark draws with.

The shares are the paper's Table 1 (arXiv 2505.19609): the cumulative share of sequences under
1K, 4K, 8K, 32K and 128K tokens, and the longest sequence. Inside a band lengths are drawn
log-uniform.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Dataset:
    """A length distribution rebuilt from the paper's Table 1.

    Attributes:
        name: dataset name.
        shares: cumulative share of sequences under 1K, 4K, 8K, 32K and 128K tokens.
        longest: the longest sequence the paper reports, in tokens.
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
"""Upper edges of the bands of :attr:`Dataset.shares`, in tokens."""
SHORTEST = 64
"""Shortest sample drawn (the paper gives no lower edge for the first band)."""


def dataset(name: str) -> Dataset:
    """The dataset of :data:`DATASETS` called ``name``.

    Raises:
        ValueError: if no dataset has that name.
    """
    for d in DATASETS:
        if d.name == name:
            return d
    names = ", ".join(d.name for d in DATASETS)
    raise ValueError(f"unknown dataset {name!r}: the paper's datasets are {names}")


def sample_lengths(
    dataset: Dataset, n: int, capacity: int, rng: random.Random, *, scale: int = 1
) -> list[int]:
    """Draw ``n`` lengths: a band by its published share, then log-uniform inside the band.

    Every drawn length is divided by ``scale`` (CPU runs use the distributions scaled down) and
    is at least 1.

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
