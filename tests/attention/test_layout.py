"""The pure per-rank token layout: every rank of CP sizes 1-5, checked in one process.

Everything here is exact (integer bookkeeping, tensors moved without arithmetic), so every
comparison is equality.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_skrull.attention.layout import (
    RankLayout,
    build_rank_layout,
    build_rank_layouts,
    pack,
    unpack,
    zigzag_chunks,
)
from lightning_skrull.scheduling.plan import DISTRIBUTED, MicroBatchPlan, shard_tokens


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4, 5])
def test_zigzag_chunks_sizes_and_pairs(cp_size: int) -> None:
    for length in range(1, 6 * cp_size + 40):
        chunks = zigzag_chunks(length, cp_size)
        assert len(chunks) == 2 * cp_size
        # contiguous, in order, covering [0, length)
        assert chunks[0][0] == 0 and chunks[-1][1] == length
        assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
        sizes = [end - start for start, end in chunks]
        assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1, (length, sizes)
        for rank in range(cp_size):
            held = sizes[rank] + sizes[2 * cp_size - 1 - rank]
            assert held in (length // cp_size, shard_tokens(length, cp_size)), (length, rank)


def test_zigzag_chunks_example_and_errors() -> None:
    assert zigzag_chunks(10, 2) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert zigzag_chunks(1, 3) == [(0, 1), (1, 1), (1, 1), (1, 1), (1, 1), (1, 1)]
    with pytest.raises(ValueError, match="length 0"):
        zigzag_chunks(0, 2)
    with pytest.raises(ValueError, match="cp_size"):
        zigzag_chunks(5, 0)


@st.composite
def micro_batches(draw: st.DrawFn) -> tuple[int, list[int], list[int], list[int]]:
    """(cp_size, lengths of a global batch, sequence_ids of one micro-batch, placement)."""
    cp_size = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=12))
    ids = draw(st.permutations(range(len(lengths))))
    ids = ids[: draw(st.integers(0, len(ids)))]
    placement = [draw(st.sampled_from([DISTRIBUTED, *range(cp_size)])) for _ in ids]
    return cp_size, lengths, list(ids), placement


def _check_layouts(
    layouts: list[RankLayout],
    cp_size: int,
    lengths: list[int],
    ids: list[int],
    placement: list[int],
) -> None:
    plan = MicroBatchPlan(tuple(ids), tuple(placement))
    seen: dict[int, list[int]] = {sid: [] for sid in ids}
    for rank, layout in enumerate(layouts):
        assert layout.cp_rank == rank and layout.cp_size == cp_size
        # per-token views agree with the segments
        expect_sids = [s.sequence_id for s in layout.segments for _ in range(s.start, s.end)]
        expect_pos = [p for s in layout.segments for p in range(s.start, s.end)]
        assert list(layout.token_sequence_ids) == expect_sids
        assert list(layout.position_ids) == expect_pos
        for sid, pos in zip(layout.token_sequence_ids, layout.position_ids, strict=True):
            seen[sid].append(pos)
        # local part first, whole, plan order
        local = [sid for sid, p in zip(ids, placement, strict=True) if p == rank]
        assert list(layout.local_sequence_ids) == local
        assert layout.num_local_tokens == sum(lengths[s] for s in local)
        assert layout.num_tokens == layout.num_local_tokens + layout.num_distributed_tokens
        # each distributed sequence: floor or ceil of s / N tokens on this rank
        for sid in layout.distributed_sequence_ids:
            held = sum(1 for t in layout.token_sequence_ids if t == sid)
            assert held in (lengths[sid] // cp_size, shard_tokens(lengths[sid], cp_size))
        # the planner's budget (ceil per shard) is never exceeded
        assert layout.num_tokens <= plan.tokens_per_cp_rank(lengths, cp_size)[rank]
    for sid in ids:  # every token exactly once over all ranks
        assert sorted(seen[sid]) == list(range(lengths[sid])), sid
    longest = max((lengths[s] for s in ids), default=0)
    assert all(layout.max_sequence_length == longest for layout in layouts)
    counts = tuple(layout.num_distributed_tokens for layout in layouts)
    assert all(layout.distributed_tokens_per_rank == counts for layout in layouts)


def _gather_like_comm(layouts: list[RankLayout], packed: list[torch.Tensor]) -> torch.Tensor:
    """What the all-gather produces: each rank's distributed part, padded, rank after rank."""
    width = layouts[0].max_distributed_tokens
    gathered = torch.full((len(layouts) * width,), -1, dtype=torch.long)
    for layout, tensor in zip(layouts, packed, strict=True):
        part = tensor[layout.num_local_tokens :]
        gathered[layout.cp_rank * width : layout.cp_rank * width + part.shape[0]] = part
    return gathered


@settings(max_examples=150, deadline=None)
@given(micro_batches())
def test_layout_covers_every_token_and_inverts(
    case: tuple[int, list[int], list[int], list[int]],
) -> None:
    cp_size, lengths, ids, placement = case
    layouts = build_rank_layouts(ids, placement, lengths, cp_size=cp_size)
    _check_layouts(layouts, cp_size, lengths, ids, placement)
    # token value = 1000 * sequence id + position: pack then unpack is the identity
    per_sequence = {sid: 1000 * sid + torch.arange(lengths[sid]) for sid in ids}
    packed = [pack(layout, per_sequence) for layout in layouts]
    for layout, tensor in zip(layouts, packed, strict=True):
        assert tensor.tolist() == [
            1000 * s + p
            for s, p in zip(layout.token_sequence_ids, layout.position_ids, strict=True)
        ]
    back = unpack(layouts, packed)
    assert set(back) == set(ids)
    for sid in ids:
        assert torch.equal(back[sid], per_sequence[sid])
    # gather_index rebuilds the whole distributed sequences from the padded all-gather
    dist_ids = layouts[0].distributed_sequence_ids
    whole = _gather_like_comm(layouts, packed)[list(layouts[0].gather_index)]
    expect = [1000 * sid + p for sid in dist_ids for p in range(lengths[sid])]
    assert whole.tolist() == expect


def test_rank_with_no_tokens_and_all_ranks_empty_micro_batch() -> None:
    # one distributed token over 3 ranks: ranks 1 and 2 hold nothing
    layouts = build_rank_layouts([0], [DISTRIBUTED], [1], cp_size=3)
    assert [lay.num_tokens for lay in layouts] == [1, 0, 0]
    assert all(lay.has_distributed for lay in layouts)
    per_sequence = {0: torch.tensor([[7.0, 8.0]])}
    packed = [pack(lay, per_sequence) for lay in layouts]
    assert packed[1].shape == (0, 2)
    assert torch.equal(unpack(layouts, packed)[0], per_sequence[0])
    empty = build_rank_layout([], [], [3], cp_rank=0, cp_size=2)
    assert empty.num_tokens == 0 and not empty.has_distributed
    assert pack(empty, {}).shape == (0,)


def test_example_layout_of_two_ranks() -> None:
    # seq 0 (10 tokens) distributed, seq 1 local on rank 1, seq 2 local on rank 0
    lay0, lay1 = build_rank_layouts([0, 1, 2], [DISTRIBUTED, 1, 0], [10, 2, 3], cp_size=2)
    assert lay0.position_ids == (0, 1, 2, 0, 1, 2, 8, 9)
    assert lay0.token_sequence_ids == (2, 2, 2, 0, 0, 0, 0, 0)
    assert lay1.position_ids == (0, 1, 3, 4, 5, 6, 7)
    assert lay0.local_cu_seqlens == (0, 3) and lay1.local_cu_seqlens == (0, 2)
    assert lay0.distributed_tokens_per_rank == (5, 5)
    # rank 0's part is chunks 0 and 3, rank 1's chunks 1 and 2
    assert lay0.gather_index == (0, 1, 2, 5, 6, 7, 8, 9, 3, 4)


def test_plan_errors_name_the_value() -> None:
    with pytest.raises(ValueError, match="placements"):
        build_rank_layout([0, 1], [0], [3, 4], cp_rank=0, cp_size=2)
    with pytest.raises(ValueError, match="duplicates"):
        build_rank_layout([0, 0], [0, 1], [3], cp_rank=0, cp_size=2)
    with pytest.raises(ValueError, match="out of range"):
        build_rank_layout([5], [0], [3], cp_rank=0, cp_size=2)
    with pytest.raises(ValueError, match="placement 2"):
        build_rank_layout([0], [2], [3], cp_rank=0, cp_size=2)
    with pytest.raises(ValueError, match="cp_rank"):
        build_rank_layout([0], [0], [3], cp_rank=2, cp_size=2)
    with pytest.raises(ValueError, match="length 0"):
        build_rank_layout([0], [0], [0], cp_rank=0, cp_size=2)


def test_pack_and_unpack_reject_inconsistent_input() -> None:
    layouts = build_rank_layouts([0, 1], [DISTRIBUTED, 0], [6, 2], cp_size=2)
    with pytest.raises(ValueError, match="no tensor for sequence 1"):
        pack(layouts[0], {0: torch.zeros(6)})
    with pytest.raises(ValueError, match="rows"):
        pack(layouts[0], {0: torch.zeros(6), 1: torch.zeros(1)})
    per_sequence = {0: torch.arange(6), 1: torch.arange(2)}
    packed = [pack(lay, per_sequence) for lay in layouts]
    with pytest.raises(ValueError, match=r"missing|only"):  # one rank's part is missing
        unpack(layouts[:1], packed[:1])
    with pytest.raises(ValueError, match="missing or repeated"):  # same rank twice
        unpack([layouts[1], layouts[1]], [packed[1], packed[1]])
    with pytest.raises(ValueError, match="rows"):
        unpack(layouts, [packed[1], packed[0]])
