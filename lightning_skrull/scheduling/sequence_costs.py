"""Per-sequence cost table of one global batch, shared by the policies while they plan."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from lightning_skrull.scheduling.cost_model import CostModel
from lightning_skrull.scheduling.plan import shard_tokens
from lightning_skrull.scheduling.tiles import (
    window_pairs,
    window_tiles,
    zigzag_tiles,
    zigzag_tiles_many,
    zigzag_window_tiles,
)

BULK_SEQUENCES = 1024
"""From this many sequences on, the first distributed cost asked for computes them all at once
(vectorised): at cluster scale on long-sequence data nearly every one is needed, and one at a
time they took a fifth of the planning time."""


def descending(ids: Iterable[int], values: Sequence[float]) -> list[int]:
    """``ids`` by descending ``values[id]``, ascending ids on ties (a stable sort of sorted ids:
    cheaper than tuple keys, and the planners' longest-first orders all break ties this way)."""
    return sorted(sorted(ids), key=values.__getitem__, reverse=True)


def ascending(ids: Iterable[int], values: Sequence[float]) -> list[int]:
    """``ids`` by ascending ``values[id]``, ascending ids on ties: the order of a micro-batch's
    sequences (shortest first) in every deal."""
    return sorted(sorted(ids), key=values.__getitem__)


class SequenceCosts:
    """Seconds of each sequence of a global batch under every placement, computed on demand.

    Local costs are computed for every sequence up front (``O(1)`` each); the distributed
    attention (``O(log length)`` to compute) only for sequences a policy actually considers
    distributing, cached per sequence id.

    Args:
        lengths: sequence lengths of the global batch.
        cp_size: ranks of one CP group.
        cost_model: the estimate to use.
    """

    def __init__(self, lengths: Sequence[int], cp_size: int, cost_model: CostModel) -> None:
        self.lengths = lengths
        self.cp_size = cp_size
        self.cost_model = cost_model
        self._linear_per_token = cost_model.linear_seconds(1)
        latency, bandwidth = cost_model.link(range(cp_size), cp_size)
        self.comm_fixed = cost_model.num_collectives(cp_size) * latency
        """Seconds of the collectives' latency, paid once any sequence is distributed."""
        self.comm_per_token = cost_model.comm_bytes(1, cp_size) / bandwidth
        """Seconds per whole token of the distributed sequences: :meth:`comm` is
        ``comm_fixed + comm_per_token * tokens`` (0 without distributed tokens or with one rank)."""
        self._seconds_per_pair = cost_model.attention_pair_seconds()
        t = cost_model.tile_size
        per_block = self._seconds_per_pair * t * t
        lin = self._linear_per_token
        # Local attention of a whole sequence: nb * (nb + 1) / 2 blocks, nb = ceil(s / tile).
        blocks = [(s + t - 1) // t for s in lengths]
        self._attn = [per_block * (nb * (nb + 1) // 2) for nb in blocks]
        # Sliding-window layers (none for most models): their own pairs, their own blocks.
        shape = cost_model.shape
        self._window = shape.sliding_window if shape.sliding_layers else 0
        self._window_seconds_per_pair = cost_model.sliding_attention_pair_seconds()
        window_block = self._window_seconds_per_pair * t * t
        if self._window:
            w = self._window
            self._attn = [
                a + window_block * window_tiles(0, s, t, w)
                for a, s in zip(self._attn, lengths, strict=True)
            ]
        # Each sequence a rank holds also pays the fixed per-sequence cost, counted with its
        # linear work: like the matmuls, it is never hidden behind communication.
        per_sequence = cost_model.per_sequence_seconds
        self.per_sequence = per_sequence
        """Fixed seconds of each sequence a CP rank holds (included in :meth:`linear`, :meth:`local`
        and :meth:`distributed`)."""
        self._linear = [s * lin + per_sequence for s in lengths]
        self._local = [s + a for s, a in zip(self._linear, self._attn, strict=True)]
        self._dist: list[float | None] = [None] * len(lengths)
        self._dist_attn: list[float | None] = [None] * len(lengths)
        # Distributed attention seconds per zigzag block on one rank, and linear per rank-token:
        # the same products CostModel.distributed_seconds forms, in the same order.
        self._per_block, self._window_block = per_block, window_block
        self._dist_block = per_block / cp_size
        self._dist_window_block = window_block / cp_size
        self._dist_linear = lin / cp_size
        self._at: dict[tuple[int, int], tuple[float, float]] = {}  # (sid, d) -> block costs
        self._links: dict[tuple[int, int], tuple[float, float]] = {}  # (start, d) -> exchange

    def linear(self, sid: int) -> float:
        """Seconds of the sequence's non-attention matmuls (all ranks together), plus its fixed
        per-sequence cost."""
        return self._linear[sid]

    def local_attention(self, sid: int) -> float:
        """Seconds of the sequence's attention when kept whole on one rank."""
        return self._attn[sid]

    def local(self, sid: int) -> float:
        """Seconds of the sequence kept whole on one rank."""
        return self._local[sid]

    @property
    def linear_table(self) -> list[float]:
        """:meth:`linear` of every sequence, by id (read-only; for hot loops)."""
        return self._linear

    @property
    def local_attention_table(self) -> list[float]:
        """:meth:`local_attention` of every sequence, by id (read-only; for hot loops)."""
        return self._attn

    @property
    def local_table(self) -> list[float]:
        """:meth:`local` of every sequence, by id (read-only; for hot loops)."""
        return self._local

    def distributed(self, sid: int) -> float:
        """Compute seconds of the sequence on each CP rank when distributed (no comm)."""
        value = self._dist[sid]
        if value is None:
            if len(self.lengths) >= BULK_SEQUENCES:
                self._fill_distributed()
                return self._dist[sid]  # type: ignore[return-value]
            s = self.lengths[sid]
            t = self.cost_model.tile_size
            tiles = zigzag_tiles(s, self.cp_size, t)
            attention = tiles * self._dist_block
            if self._window:
                windowed = zigzag_window_tiles(s, self.cp_size, t, self._window)
                attention += windowed * self._dist_window_block
            self._dist_attn[sid] = attention
            value = self._dist[sid] = s * self._dist_linear + attention + self.per_sequence
        return value

    def distributed_attention(self, sid: int) -> float:
        """Seconds of the sequence's attention on each CP rank when distributed: the part of
        :meth:`distributed` that can overlap K/V communication of later groups."""
        value = self._dist_attn[sid]
        if value is None:
            self.distributed(sid)
            value = self._dist_attn[sid]
        return value  # type: ignore[return-value]

    def _fill_distributed(self) -> None:
        """:meth:`distributed` of every sequence at once (the same products, the same floats)."""
        tile = self.cost_model.tile_size
        tiles = zigzag_tiles_many(self.lengths, self.cp_size, tile)
        lin, block = self._dist_linear, self._dist_block
        attention = [t * block for t in tiles]
        if self._window:
            w, wblock = self._window, self._dist_window_block
            attention = [
                a + zigzag_window_tiles(s, self.cp_size, tile, w) * wblock
                for a, s in zip(attention, self.lengths, strict=True)
            ]
        p = self.per_sequence
        self._dist = [s * lin + a + p for s, a in zip(self.lengths, attention, strict=True)]
        self._dist_attn = list(attention)

    def distributed_lower_bound(self, sid: int) -> float:
        """Cheap lower bound of :meth:`distributed` (``O(1)``).

        The tiled attention of the zigzag chunks computes at least every causal pair, and
        every non-empty chunk at least one block row against all keys before its end; when
        all ``M = 2 * cp_size`` chunks are non-empty, ``sum(b[i + 1]) >= s * (M + 1) / 2 - M``.
        A sliding-window layer computes at least its :func:`window_pairs`.
        """
        s = self.lengths[sid]
        m = 2 * self.cp_size
        t = self.cost_model.tile_size
        pairs = s * (s + 1) / 2
        if s >= m:  # every chunk is non-empty
            pairs = max(pairs, t * (s * (m + 1) / 2 - m))
        seconds = s * self._linear_per_token + pairs * self._seconds_per_pair
        if self._window:
            seconds += window_pairs(s, self._window) * self._window_seconds_per_pair
        arithmetic = seconds / self.cp_size
        return arithmetic + self.per_sequence

    def shard(self, sid: int) -> int:
        """Tokens the sequence takes on every CP rank when distributed (the ceiling)."""
        return shard_tokens(self.lengths[sid], self.cp_size)

    def comm(self, distributed_tokens: int) -> float:
        """Communication seconds of a micro-batch whose distributed sequences hold that many tokens."""
        if distributed_tokens == 0 or self.cp_size == 1:
            return 0.0
        return self.comm_fixed + self.comm_per_token * distributed_tokens

    # ------------------------------------------------------------------ blocks (CpBlock)
    def shard_at(self, sid: int, size: int) -> int:
        """Tokens the sequence takes on every rank of a block of ``size`` ranks (the ceiling)."""
        return -(-self.lengths[sid] // size)

    def block_costs(self, sid: int, size: int) -> tuple[float, float]:
        """``(linear, attention)`` seconds of the sequence on each rank of a block of ``size``
        ranks (``size == cp_size``: the whole group); the linear part holds the fixed
        per-sequence cost."""
        key = (sid, size)
        found = self._at.get(key)
        if found is None:
            if size == self.cp_size:
                att = self.distributed_attention(sid)
                found = (self.distributed(sid) - att, att)
            else:
                found = self._block_costs(self.lengths[sid], size)
            self._at[key] = found
        return found

    def _block_costs(self, s: int, size: int) -> tuple[float, float]:
        t = self.cost_model.tile_size
        attention = zigzag_tiles(s, size, t) * (self._per_block / size)
        if self._window:
            windowed = zigzag_window_tiles(s, size, t, self._window)
            attention += windowed * (self._window_block / size)
        return s * self._linear_per_token / size + self.per_sequence, attention

    def exchange(self, tokens: int, start: int, size: int) -> float:
        """Seconds of the K/V exchange of a block of ``size`` ranks from ``start`` holding
        sequences of ``tokens`` whole tokens (its links by
        :meth:`~lightning_skrull.scheduling.cost_model.CostModel.link`)."""
        if tokens == 0:
            return 0.0
        fixed, per_token = self.exchange_constants(start, size)
        return fixed + per_token * tokens

    def exchange_constants(self, start: int, size: int) -> tuple[float, float]:
        """``(fixed, per_token)`` seconds of a block's exchange: :meth:`exchange` is
        ``fixed + per_token * tokens``."""
        key = (start, size)
        found = self._links.get(key)
        if found is None:
            model = self.cost_model
            latency, bandwidth = model.link(range(start, start + size), self.cp_size)
            found = (
                model.num_collectives(size) * latency,
                model.comm_bytes(1, size) / bandwidth,
            )
            self._links[key] = found
        return found
