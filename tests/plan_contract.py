"""The contract every plan of ``plan_global_batch`` keeps, checked from the lengths alone (token
counts with ``math.ceil``, not the plan types' own helpers), and the random global batches the
property tests draw."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from lightning_skrull.scheduling import DISTRIBUTED, CostModel, GlobalBatchPlan


def rank_tokens(plan: GlobalBatchPlan, lengths: list[int], mb_index: tuple[int, int]) -> list[int]:
    """Tokens of every CP rank of one micro-batch, computed independently of the plan types."""
    dp_rank, i = mb_index
    mb = plan.micro_batches[dp_rank][i]
    tokens = [0] * plan.cp_size
    for sid, where in zip(mb.sequence_ids, mb.placement, strict=True):
        if where == DISTRIBUTED:
            for j in range(plan.cp_size):
                tokens[j] += math.ceil(lengths[sid] / plan.cp_size)
        else:
            tokens[where] += lengths[sid]
    return tokens


def check_contract(plan: GlobalBatchPlan, lengths: list[int], dp: int, cp: int, c: int) -> None:
    """Every sequence exactly once, placements in range, no CP rank over its bucket."""
    assert plan.dp_size == dp and plan.cp_size == cp and plan.bucket_size == c
    assert len(plan.micro_batches) == dp
    seen = sorted(sid for mbs in plan.micro_batches for mb in mbs for sid in mb.sequence_ids)
    assert seen == list(range(len(lengths)))
    for d, mbs in enumerate(plan.micro_batches):
        for i, mb in enumerate(mbs):
            assert mb.sequence_ids, "no empty micro-batch"
            assert all(p == DISTRIBUTED or 0 <= p < cp for p in mb.placement)
            assert max(rank_tokens(plan, lengths, (d, i))) <= c


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[int], int, int, int]:
    """A global batch whose sequences all fit one CP group, with its layout."""
    cp = draw(st.integers(1, 8))
    dp = draw(st.integers(1, 4))
    c = draw(st.integers(1, 400))
    lengths = draw(st.lists(st.integers(1, cp * c), max_size=40))
    return lengths, dp, cp, c


SMALL_TILES = CostModel(tile_size=16)  # tiles matter at these small lengths
