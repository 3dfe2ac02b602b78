"""Context-parallel attention for micro-batches that mix local and distributed sequences.

Pure layout (:mod:`.layout`), backend names and kernel choice (:mod:`.backends`), the
per-micro-batch context (:mod:`.context`), the autograd K/V all-gather (:mod:`.comm`), the
schedule every backend shares (:mod:`.schedule`), two backends with one call shape
(:mod:`.sdpa`, :mod:`.flash`) and the function registered with transformers as ``"skrull"``
(:mod:`.dispatch`; transformers is imported only when it registers). Only torch is imported here.
"""

from lightning_skrull.attention.backends import (
    ATTENTION_BACKENDS,
    ATTENTION_NAME,
    AttentionBackend,
    KernelBackend,
    flash_kernel,
    resolve_backend,
)
from lightning_skrull.attention.comm import distributed_kv_bytes, gather_distributed_kv
from lightning_skrull.attention.context import (
    SkrullAttentionContext,
    attention_context,
    current_attention_context,
    has_attention_context,
)
from lightning_skrull.attention.dispatch import (
    compute_dtype,
    register_skrull_attention,
    skrull_attention_forward,
)
from lightning_skrull.attention.flash import flash_attention
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
from lightning_skrull.attention.schedule import context_parallel_attention
from lightning_skrull.attention.sdpa import sdpa_attention

__all__ = [
    "ATTENTION_BACKENDS",
    "ATTENTION_NAME",
    "AttentionBackend",
    "DistributedChunk",
    "KernelBackend",
    "RankLayout",
    "Segment",
    "SkrullAttentionContext",
    "attention_context",
    "build_rank_layout",
    "build_rank_layouts",
    "compute_dtype",
    "context_parallel_attention",
    "current_attention_context",
    "distributed_kv_bytes",
    "flash_attention",
    "flash_kernel",
    "gather_distributed_kv",
    "has_attention_context",
    "pack",
    "register_skrull_attention",
    "resolve_backend",
    "sdpa_attention",
    "skrull_attention_forward",
    "unpack",
    "zigzag_chunks",
]
