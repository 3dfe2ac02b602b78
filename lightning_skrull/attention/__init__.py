"""Context-parallel attention for micro-batches that mix local and distributed sequences.

Pure layout (:mod:`.layout`), the per-micro-batch context (:mod:`.context`), the autograd K/V
all-gather (:mod:`.comm`), two backends with one call shape (:mod:`.sdpa`, :mod:`.flash`) and the
function registered with transformers as ``"skrull"`` (:mod:`.dispatch`).
"""

from lightning_skrull.attention.comm import distributed_kv_bytes, gather_distributed_kv
from lightning_skrull.attention.context import (
    SkrullAttentionContext,
    attention_context,
    current_attention_context,
)
from lightning_skrull.attention.dispatch import (
    ATTENTION_NAME,
    compute_dtype,
    register_skrull_attention,
    skrull_attention_forward,
)
from lightning_skrull.attention.flash import flash_attention, resolve_backend
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
from lightning_skrull.attention.sdpa import sdpa_attention

__all__ = [
    "ATTENTION_NAME",
    "DistributedChunk",
    "RankLayout",
    "Segment",
    "SkrullAttentionContext",
    "attention_context",
    "build_rank_layout",
    "build_rank_layouts",
    "compute_dtype",
    "current_attention_context",
    "distributed_kv_bytes",
    "flash_attention",
    "gather_distributed_kv",
    "pack",
    "register_skrull_attention",
    "resolve_backend",
    "sdpa_attention",
    "skrull_attention_forward",
    "unpack",
    "zigzag_chunks",
]
