"""Context-parallel attention for micro-batches that mix local and distributed sequences."""

from lightning_skrull.attention.context import (
    SkrullAttentionContext,
    attention_context,
    current_attention_context,
)
from lightning_skrull.attention.layout import (
    DistributedChunk,
    RankLayout,
    Segment,
    build_rank_layout,
    build_rank_layouts,
    pack,
    unpack,
    zigzag_chunks,
)

__all__ = [
    "DistributedChunk",
    "RankLayout",
    "Segment",
    "SkrullAttentionContext",
    "attention_context",
    "build_rank_layout",
    "build_rank_layouts",
    "current_attention_context",
    "pack",
    "unpack",
    "zigzag_chunks",
]
