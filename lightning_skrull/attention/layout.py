"""Per-rank token layout of one micro-batch under context parallelism (pure, no process group).

A micro-batch plan places each sequence either whole on one CP rank (local) or sharded over the
whole CP group (distributed). A distributed sequence of ``s`` tokens is cut into ``2N`` zigzag
chunks (``N`` = CP size) whose sizes differ by at most one; CP rank ``r`` holds chunk ``r`` and
chunk ``2N-1-r``, which balances causal work and gives every rank ``floor(s/N)`` or
``ceil(s/N)`` tokens, for any ``s >= 1`` (chunks may be empty when ``s < 2N``; nothing is padded).

The packed token order of CP rank ``r`` is::

    [ local sequences whole, plan order ][ seq A: chunk r | chunk 2N-1-r ][ seq B: ... ] ...
      <------- local part -------------><------------- distributed part --------------->

A plan may cut the distributed sequences into K/V groups (``MicroBatchPlan.kv_groups``: how
many consecutive distributed sequences each group has, in plan order). Each group's K/V are
exchanged by a collective of their own, so with two or more groups the layout also carries one
layout per group (:attr:`RankLayout.kv_group_layouts`): the layout of a micro-batch of only that
group's sequences, all distributed. Since the distributed part is laid out sequence by sequence,
a group's packed buffer is a contiguous run of this rank's distributed part, and the groups'
runs follow each other in group order::

    [ local part ][ group 0: seq A | seq B ][ group 1: seq C ] ...

Everything here is plain Python data computed identically on every rank from the plan and the
lengths of the global batch; :mod:`lightning_skrull.attention.context` turns it into tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from lightning_skrull.scheduling.plan import (
    DISTRIBUTED,
    Placement,
    check_kv_groups,
    kv_group_ranges,
    rank_or_group,
)


class Segment(NamedTuple):
    """A contiguous run of packed tokens: tokens ``[start, end)`` of sequence ``sequence_id``."""

    sequence_id: int
    start: int
    end: int


class DistributedChunk(NamedTuple):
    """One non-empty chunk of a distributed sequence held by this rank.

    Attributes:
        index: position of the sequence in :attr:`RankLayout.distributed_sequence_ids`.
        start: first token of the chunk inside its sequence.
        end: one past the last token; the chunk's queries attend keys ``[0, end)`` of the
            sequence with lower-right causal alignment.
        packed_start: offset of the chunk in this rank's packed buffer.
    """

    # The field deliberately shadows ``tuple.index``; the chunk is never searched like a tuple.
    index: int  # type: ignore[assignment]
    start: int
    end: int
    packed_start: int


def zigzag_chunks(length: int, cp_size: int) -> list[tuple[int, int]]:
    """The ``2 * cp_size`` zigzag chunks of a distributed sequence.

    Chunk sizes differ by at most one. CP rank ``r`` holds chunk ``r`` and chunk
    ``2 * cp_size - 1 - r``; the pair holds ``floor(length / cp_size)`` or
    ``ceil(length / cp_size)`` tokens. With ``length < 2 * cp_size`` some chunks are empty.

    Args:
        length: tokens in the sequence, ``>= 1``.
        cp_size: ranks in the CP group, ``>= 1``.

    Returns:
        ``2 * cp_size`` ``(start, end)`` ranges covering ``[0, length)`` in order.

    Raises:
        ValueError: ``length < 1`` or ``cp_size < 1``.
    """
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}.")
    if length < 1:
        raise ValueError(f"a sequence must have at least one token, got length {length}.")
    num_chunks = 2 * cp_size
    base, extra = divmod(length, num_chunks)
    # `extra` chunks get one more token. Give them first to the lower chunk of pairs 0, 1, ...,
    # and, past cp_size extras, to the upper chunk of pairs 0, 1, ...: every pair then gets
    # floor(extra / cp_size) or ceil(extra / cp_size) of them, so pair sizes stay within one.
    sizes = [base] * num_chunks
    for pair in range(min(extra, cp_size)):
        sizes[pair] += 1
    for pair in range(max(0, extra - cp_size)):
        sizes[num_chunks - 1 - pair] += 1
    chunks = []
    start = 0
    for size in sizes:
        chunks.append((start, start + size))
        start += size
    return chunks


def _owner_and_offset(chunk: int, cp_size: int) -> tuple[int, bool]:
    """CP rank holding zigzag chunk ``chunk``, and whether it is that rank's second chunk."""
    if chunk < cp_size:
        return chunk, False
    return 2 * cp_size - 1 - chunk, True


@dataclass(frozen=True)
class RankLayout:
    """The packed token order of one CP rank for one micro-batch.

    Built by :func:`build_rank_layout`; plain data (tuples of ints), identical on every rank
    for the parts that describe the whole CP group (``distributed_*``, ``gather_index``).

    Attributes:
        cp_rank: this rank's index in the CP group.
        cp_size: ranks in the CP group.
        segments: packed order as runs of sequence tokens; empty chunks are left out.
        local_sequence_ids: sequences held whole by this rank, plan order.
        local_cu_seqlens: cumulative token offsets of the local sequences in the packed buffer
            (``len(local_sequence_ids) + 1`` entries, starting at 0).
        distributed_sequence_ids: sequences sharded over the CP group, plan order (same on
            every rank, also on ranks that hold no token of them).
        distributed_lengths: their lengths.
        distributed_cu_seqlens: cumulative offsets of the whole distributed sequences laid end
            to end (``len(distributed_sequence_ids) + 1`` entries).
        distributed_chunks: this rank's non-empty chunks, packed order.
        distributed_tokens_per_rank: tokens of the distributed part on every CP rank.
        max_sequence_length: longest sequence of the whole micro-batch (all CP ranks, local and
            distributed; 0 when empty), the same on every rank.
        gather_index: for every token of the whole distributed sequences laid end to end, its
            row in the all-gathered buffer (each rank's distributed part padded to
            ``max_distributed_tokens`` rows, rank after rank).
        token_sequence_ids: sequence id of every packed token.
        position_ids: position of every packed token inside its sequence (global position).
        kv_group_layouts: with two or more K/V groups, one layout per group in group order:
            that of a micro-batch of the group's distributed sequences only (no local part),
            whose packed buffer is this rank's rows of the group, a contiguous run of the
            distributed part, and whose ``gather_index`` indexes the group's own all-gathered
            buffer (each rank's rows of the group padded to the group's largest). Empty with
            one group (``kv_groups`` of ``()`` or of one count), where the fields above
            describe the only exchange.
    """

    cp_rank: int
    cp_size: int
    segments: tuple[Segment, ...]
    local_sequence_ids: tuple[int, ...]
    local_cu_seqlens: tuple[int, ...]
    distributed_sequence_ids: tuple[int, ...]
    distributed_lengths: tuple[int, ...]
    distributed_cu_seqlens: tuple[int, ...]
    distributed_chunks: tuple[DistributedChunk, ...]
    distributed_tokens_per_rank: tuple[int, ...]
    max_sequence_length: int
    gather_index: tuple[int, ...] = field(repr=False)
    token_sequence_ids: tuple[int, ...] = field(repr=False)
    position_ids: tuple[int, ...] = field(repr=False)
    kv_group_layouts: tuple[RankLayout, ...] = field(default=(), repr=False)

    @property
    def num_tokens(self) -> int:
        """Tokens packed on this rank (0 is allowed)."""
        return len(self.token_sequence_ids)

    @property
    def num_local_tokens(self) -> int:
        """Tokens of the local sequences (the packed buffer's first part)."""
        return self.local_cu_seqlens[-1]

    @property
    def num_distributed_tokens(self) -> int:
        """Tokens of distributed sequences held by this rank (the packed buffer's second part)."""
        return self.distributed_tokens_per_rank[self.cp_rank]

    @property
    def max_distributed_tokens(self) -> int:
        """Rows each rank contributes to the all-gather (its distributed part, padded)."""
        return max(self.distributed_tokens_per_rank)

    @property
    def has_distributed(self) -> bool:
        """Whether the micro-batch has a distributed sequence (then every CP rank communicates)."""
        return bool(self.distributed_sequence_ids)

    @property
    def local_lengths(self) -> tuple[int, ...]:
        """Lengths of the local sequences, plan order."""
        cu = self.local_cu_seqlens
        return tuple(cu[i + 1] - cu[i] for i in range(len(cu) - 1))


def _check_plan(
    sequence_ids: Sequence[int],
    placement: Sequence[Placement],
    lengths: Sequence[int],
    cp_rank: int,
    cp_size: int,
) -> None:
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}.")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}.")
    if len(sequence_ids) != len(placement):
        raise ValueError(
            f"got {len(sequence_ids)} sequence_ids but {len(placement)} placements; give one "
            "placement per sequence."
        )
    if len(set(sequence_ids)) != len(sequence_ids):
        raise ValueError(f"sequence_ids {tuple(sequence_ids)} contain duplicates; each once.")
    for sid, placed in zip(sequence_ids, placement, strict=True):
        where = rank_or_group(placed)
        if not 0 <= sid < len(lengths):
            raise ValueError(
                f"sequence id {sid} is out of range for {len(lengths)} lengths; sequence ids "
                "index the lengths of the whole global batch."
            )
        if lengths[sid] < 1:
            raise ValueError(f"sequence {sid} has length {lengths[sid]}; lengths must be >= 1.")
        if where != DISTRIBUTED and not 0 <= where < cp_size:
            raise ValueError(
                f"sequence {sid} has placement {where}; use -1 (distributed) or a CP rank in "
                f"[0, {cp_size})."
            )


def build_rank_layout(
    sequence_ids: Sequence[int],
    placement: Sequence[Placement],
    lengths: Sequence[int],
    *,
    cp_rank: int,
    cp_size: int,
    kv_groups: Sequence[int] = (),
) -> RankLayout:
    """The packed token layout of CP rank ``cp_rank`` for one micro-batch.

    Args:
        sequence_ids: the micro-batch's sequences (``MicroBatchPlan.sequence_ids``).
        placement: same order; ``-1`` = distributed, ``0..cp_size-1`` = local on that CP rank.
        lengths: lengths of the whole global batch, indexed by sequence id.
        cp_rank: the CP rank whose layout to build.
        cp_size: ranks in the CP group.
        kv_groups: distributed sequences per K/V group, in plan order
            (``MicroBatchPlan.kv_groups``); ``()`` = one group. With two or more groups the
            layout gets :attr:`RankLayout.kv_group_layouts`; the other fields do not change.

    Returns:
        The rank's :class:`RankLayout`.

    Raises:
        ValueError: inconsistent plan (length mismatch, duplicate or out-of-range ids, bad
            placement, length < 1, bad rank, ``kv_groups`` not positive counts summing to the
            number of distributed sequences).
    """
    placement = [rank_or_group(where) for where in placement]  # a CpBlock is refused
    _check_plan(sequence_ids, placement, lengths, cp_rank, cp_size)
    segments: list[Segment] = []
    local_ids: list[int] = []
    local_cu = [0]
    for sid, where in zip(sequence_ids, placement, strict=True):
        if where == cp_rank:
            local_ids.append(sid)
            local_cu.append(local_cu[-1] + lengths[sid])
            segments.append(Segment(sid, 0, lengths[sid]))

    dist_ids = [
        sid for sid, where in zip(sequence_ids, placement, strict=True) if where == DISTRIBUTED
    ]
    check_kv_groups(kv_groups, len(dist_ids))
    dist_lengths = [lengths[sid] for sid in dist_ids]
    dist_cu = [0]
    for length in dist_lengths:
        dist_cu.append(dist_cu[-1] + length)

    # Every rank's distributed part, to place each token in the padded all-gathered buffer.
    tokens_per_rank = [0] * cp_size
    chunk_offsets: list[list[int]] = []  # per sequence, per chunk: offset in its owner's part
    all_chunks = [zigzag_chunks(length, cp_size) for length in dist_lengths]
    for chunks in all_chunks:
        offsets = [0] * len(chunks)
        for owner in range(cp_size):
            for c in (owner, 2 * cp_size - 1 - owner):
                offsets[c] = tokens_per_rank[owner]
                tokens_per_rank[owner] += chunks[c][1] - chunks[c][0]
        chunk_offsets.append(offsets)
    width = max(tokens_per_rank)
    gather_index: list[int] = []
    for chunks, offsets in zip(all_chunks, chunk_offsets, strict=True):
        for c, (start, end) in enumerate(chunks):
            owner, _ = _owner_and_offset(c, cp_size)
            row = owner * width + offsets[c]
            gather_index.extend(range(row, row + end - start))

    dist_chunks: list[DistributedChunk] = []
    packed = local_cu[-1]
    for index, (sid, chunks) in enumerate(zip(dist_ids, all_chunks, strict=True)):
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            start, end = chunks[c]
            if end > start:
                dist_chunks.append(DistributedChunk(index, start, end, packed))
                segments.append(Segment(sid, start, end))
                packed += end - start

    token_sids: list[int] = []
    positions: list[int] = []
    for seg in segments:
        token_sids.extend([seg.sequence_id] * (seg.end - seg.start))
        positions.extend(range(seg.start, seg.end))
    ranges = kv_group_ranges(kv_groups, len(dist_ids))
    group_layouts = (
        tuple(
            build_rank_layout(
                dist_ids[start:end],
                [DISTRIBUTED] * (end - start),
                lengths,
                cp_rank=cp_rank,
                cp_size=cp_size,
            )
            for start, end in ranges
        )
        if len(ranges) > 1
        else ()
    )
    return RankLayout(
        cp_rank=cp_rank,
        cp_size=cp_size,
        segments=tuple(segments),
        local_sequence_ids=tuple(local_ids),
        local_cu_seqlens=tuple(local_cu),
        distributed_sequence_ids=tuple(dist_ids),
        distributed_lengths=tuple(dist_lengths),
        distributed_cu_seqlens=tuple(dist_cu),
        distributed_chunks=tuple(dist_chunks),
        distributed_tokens_per_rank=tuple(tokens_per_rank),
        max_sequence_length=max((lengths[sid] for sid in sequence_ids), default=0),
        gather_index=tuple(gather_index),
        token_sequence_ids=tuple(token_sids),
        position_ids=tuple(positions),
        kv_group_layouts=group_layouts,
    )


def build_rank_layouts(
    sequence_ids: Sequence[int],
    placement: Sequence[Placement],
    lengths: Sequence[int],
    *,
    cp_size: int,
    kv_groups: Sequence[int] = (),
) -> list[RankLayout]:
    """The layouts of every CP rank of a micro-batch, indexed by CP rank (see
    :func:`build_rank_layout` for ``kv_groups``)."""
    placement = [rank_or_group(where) for where in placement]  # a CpBlock is refused
    return [
        build_rank_layout(
            sequence_ids, placement, lengths, cp_rank=r, cp_size=cp_size, kv_groups=kv_groups
        )
        for r in range(cp_size)
    ]


def pack(layout: RankLayout, per_sequence: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """This rank's packed tensor from whole per-sequence tensors.

    Args:
        layout: the rank's layout.
        per_sequence: for each sequence id of the micro-batch (at least those the rank holds),
            a tensor whose dim 0 is the sequence's tokens.

    Returns:
        The rank's tokens along dim 0, in packed order (``layout.num_tokens`` rows; an empty
        tensor with the trailing shape of the inputs when the rank holds no token).

    Raises:
        ValueError: a sequence the rank holds is missing or too short.
    """
    pieces = []
    for seg in layout.segments:
        if seg.sequence_id not in per_sequence:
            raise ValueError(
                f"pack: no tensor for sequence {seg.sequence_id}, which CP rank "
                f"{layout.cp_rank} holds; pass every sequence of the micro-batch."
            )
        tensor = per_sequence[seg.sequence_id]
        if tensor.shape[0] < seg.end:
            raise ValueError(
                f"pack: sequence {seg.sequence_id} has {tensor.shape[0]} rows but the layout "
                f"needs {seg.end}; give one row per token."
            )
        pieces.append(tensor[seg.start : seg.end])
    if pieces:
        return torch.cat(pieces, dim=0)
    template = next(iter(per_sequence.values()), None)
    if template is None:
        return torch.empty(0)
    return template.new_empty((0, *template.shape[1:]))


def unpack(
    layouts: Sequence[RankLayout], per_rank: Sequence[torch.Tensor]
) -> dict[int, torch.Tensor]:
    """Whole per-sequence tensors from every CP rank's packed tensor (inverse of :func:`pack`).

    Args:
        layouts: the layouts of every CP rank of one micro-batch, indexed by CP rank.
        per_rank: each rank's packed tensor, same order, tokens along dim 0.

    Returns:
        ``{sequence_id: tensor}`` with the sequence's tokens in order along dim 0.

    Raises:
        ValueError: counts do not match, or the layouts do not cover every token exactly once.
    """
    if len(layouts) != len(per_rank):
        raise ValueError(f"unpack: {len(layouts)} layouts but {len(per_rank)} tensors; one each.")
    pieces: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
    lengths: dict[int, int] = {}
    for layout in layouts:
        lengths.update(
            zip(layout.distributed_sequence_ids, layout.distributed_lengths, strict=True)
        )
        lengths.update(zip(layout.local_sequence_ids, layout.local_lengths, strict=True))
    for layout, tensor in zip(layouts, per_rank, strict=True):
        if tensor.shape[0] != layout.num_tokens:
            raise ValueError(
                f"unpack: CP rank {layout.cp_rank} tensor has {tensor.shape[0]} rows but its "
                f"layout has {layout.num_tokens} tokens."
            )
        offset = 0
        for seg in layout.segments:
            size = seg.end - seg.start
            pieces.setdefault(seg.sequence_id, []).append(
                (seg.start, seg.end, tensor[offset : offset + size])
            )
            offset += size
    out: dict[int, torch.Tensor] = {}
    for sid, runs in pieces.items():
        runs.sort(key=lambda run: run[0])
        expected = 0
        for start, end, _ in runs:
            if start != expected:
                raise ValueError(
                    f"unpack: sequence {sid} tokens [{expected}, {start}) are missing or "
                    "repeated; pass the layouts of every CP rank of the same micro-batch."
                )
            expected = end
        if expected != lengths[sid]:
            raise ValueError(
                f"unpack: sequence {sid} has {lengths[sid]} tokens but only [0, {expected}) "
                "arrived; pass the layouts of every CP rank of the same micro-batch."
            )
        out[sid] = torch.cat([run[2] for run in runs], dim=0)
    return out
