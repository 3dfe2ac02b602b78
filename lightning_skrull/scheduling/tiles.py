"""Tile arithmetic of the attention kernels: how many blocks a tiled kernel computes.

Attention kernels work on ``tile x tile`` blocks of (query, key) pairs and compute every block
that holds at least one unmasked pair. A short sequence, and even more a short sequence cut
into ``2 * cp_size`` zigzag chunks, pays for padded blocks. A layer with a sliding window of
``W`` keys skips the key blocks wholly before each query block's window. Every count here is
exact integer arithmetic (closed forms where a plain sum would be slow), checked against
enumeration in ``tests/scheduling/test_cost_model.py``; with ``tile == 1`` the counts are the
exact numbers of (query, key) pairs. The cost model (:mod:`~lightning_skrull.scheduling.cost_model`)
multiplies them by the FLOPs of one block.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np


def causal_tiles(start: int, end: int, tile: int) -> int:
    """Blocks a tiled causal kernel computes for queries ``[start, end)`` of a sequence.

    Keys run from position 0. Query block ``u`` (``tile`` rows, the last one padded) covers
    positions up to ``min(start + (u + 1) * tile, end)`` and needs that many keys rounded up to
    whole key blocks. With ``tile == 1`` the result is the exact number of causal pairs.

    Args:
        start: first query position.
        end: one past the last query position (``end > start``).
        tile: block size of the kernel, in tokens.

    Returns:
        The number of ``tile x tile`` blocks computed.
    """
    nq = -(-(end - start) // tile)
    # Blocks u < nq - 1 end at start + (u + 1) * tile: ceil(start / tile) + u + 1 key blocks.
    return (nq - 1) * (-(-start // tile)) + (nq - 1) * nq // 2 + (-(-end // tile))


def window_pairs(length: int, window: int) -> int:
    """(query, key) pairs of a sequence under a sliding window of ``window`` keys.

    The query at position ``p`` sees keys ``[max(0, p - window + 1), p]``
    (transformers' ``sliding_window_causal_mask_function``): ``s (s + 1) / 2`` pairs for
    ``s <= window``, ``window (window + 1) / 2 + (s - window) window`` beyond.
    """
    if length <= window:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def window_tiles(start: int, end: int, tile: int, window: int) -> int:
    """Blocks a tiled sliding-window kernel computes for queries ``[start, end)`` of a sequence.

    As :func:`causal_tiles`, less the key blocks wholly before each query block's window: query
    block ``u`` starts at ``p = start + u * tile`` and needs no key block before the one holding
    ``p - window + 1``. With ``tile == 1`` the result is the exact number of pairs
    (:func:`window_pairs` for ``start == 0``).
    """
    full = causal_tiles(start, end, tile)
    nq = -(-(end - start) // tile)
    first = start - window + 1  # first key of query block u: first + u * tile, if positive
    u0 = 0 if first > 0 else -first // tile + 1  # the first block that skips a key block
    if u0 >= nq:
        return full
    n = nq - u0
    # key blocks skipped by block u >= u0: floor((first + u * tile) / tile) = first // tile + u
    return full - (n * (first // tile) + (u0 + nq - 1) * n // 2)


def zigzag_window_tiles(length: int, cp_size: int, tile: int, window: int) -> int:
    """:func:`window_tiles` summed over the non-empty zigzag chunks of :func:`zigzag_bounds`."""
    b = zigzag_bounds(length, cp_size)
    return sum(
        window_tiles(b[i], b[i + 1], tile, window) for i in range(2 * cp_size) if b[i + 1] > b[i]
    )


def zigzag_bounds(length: int, cp_size: int) -> list[int]:
    """Boundaries of the ``2 * cp_size`` zigzag chunks of a sequence (floor split, no padding).

    Chunk ``i`` is ``[b[i], b[i + 1])``; CP rank ``r`` holds chunks ``r`` and ``2N - 1 - r``.
    """
    n = 2 * cp_size
    return [i * length // n for i in range(n + 1)]


def floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``sum(floor((a * i + b) / m) for i in range(n))`` in ``O(log m)`` (non-negative a, b)."""
    total = 0
    while True:
        if a >= m:
            total += (n - 1) * n // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        y_max = a * n + b
        if y_max < m:
            return total
        n, b, m, a = y_max // m, y_max % m, a, m


@functools.lru_cache(maxsize=1 << 16)
def _residue_starts(m: int, tile: int, r: int) -> int:
    """``floor_sum(m, m * tile, r, (tile - 1) * m)``, cached: ``r < m * tile`` takes few values."""
    return floor_sum(m, m * tile, r, (tile - 1) * m)


def zigzag_tiles(length: int, cp_size: int, tile: int) -> int:
    """Blocks a tiled causal kernel computes for all ``2 * cp_size`` zigzag chunks of a sequence.

    Equal to ``sum(causal_tiles(b[i], b[i + 1], tile))`` over the non-empty chunks of
    :func:`zigzag_bounds`, in ``O(log)`` time when every chunk needs the same number of query
    blocks (the usual case), else by the plain sum.
    """
    m = 2 * cp_size
    q = length // m
    nq = -(-q // tile)
    if q == 0 or q % tile == 0:  # chunk lengths q and q + 1 need different query blocks
        b = zigzag_bounds(length, cp_size)
        return sum(causal_tiles(b[i], b[i + 1], tile) for i in range(m) if b[i + 1] > b[i])
    # sum over chunks of ceil(b_i / tile) for i < m; ceil(floor(i*s/m) / t) = floor((i*s + (t-1)*m) / (m*t)).
    # With s = k*m*t + r, each term is i*k plus a term that depends on r only (cached).
    k, r = divmod(length, m * tile)
    starts = k * (m - 1) * m // 2 + _residue_starts(m, tile, r)
    ends = starts + -(-length // tile)  # the same sum shifted by one chunk (b_0 = 0, b_m = s)
    return (nq - 1) * starts + m * (nq - 1) * nq // 2 + ends


def zigzag_tiles_many(lengths: Sequence[int], cp_size: int, tile: int) -> list[int]:
    """:func:`zigzag_tiles` of many lengths at once, vectorised; equal element by element.

    The closed form of :func:`zigzag_tiles` in integer numpy arithmetic (the residue sum
    taken directly over the ``2 * cp_size`` chunks); lengths its closed form does not cover
    go through :func:`zigzag_tiles` itself.
    """
    s = np.asarray(lengths, dtype=np.int64)
    m = 2 * cp_size
    q = s // m
    nq = -(-q // tile)
    k, r = np.divmod(s, m * tile)
    i = np.arange(m, dtype=np.int64)
    residue = ((r[:, None] * i[None, :] + (tile - 1) * m) // (m * tile)).sum(axis=1)
    starts = k * (m - 1) * m // 2 + residue
    ends = starts + -(-s // tile)
    out: list[int] = ((nq - 1) * starts + m * (nq - 1) * nq // 2 + ends).tolist()
    for j in np.flatnonzero((q == 0) | (q % tile == 0)).tolist():
        out[j] = zigzag_tiles(int(s[j]), cp_size, tile)
    return out
