"""The ``flash`` backend (flash-attn varlen kernels, CUDA only) and backend selection.

flash-attn is an optional GPU extra (``pip install flash-attn``); it is imported lazily, so this
module imports everywhere. Local sequences run as one ``flash_attn_varlen_func`` call with
``cu_seqlens_q == cu_seqlens_k``. The distributed chunks run as a second call whose keys are, per
chunk, the prefix ``[0, chunk.end)`` of its whole (all-gathered) sequence, with separate
``cu_seqlens_q`` / ``cu_seqlens_k``: flash-attn >= 2.1 aligns the causal mask to the bottom
right when ``seqlen_q != seqlen_k``, which is exactly "query ``i`` of the chunk sees keys up to
``chunk.start + i``". GQA is native (no repeated K/V).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch

from lightning_skrull.attention.comm import context_parallel_attention
from lightning_skrull.attention.context import SkrullAttentionContext

log = logging.getLogger(__name__)

_FLASH_FIX = (
    "install it with `pip install flash-attn` on a CUDA machine, or use backend='sdpa' "
    "(pure PyTorch, any device)"
)


def flash_attn_available() -> bool:
    """Whether the ``flash_attn`` package can be imported (without importing it)."""
    return importlib.util.find_spec("flash_attn") is not None


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The attention backend to use on ``device``.

    Args:
        backend: ``"auto"`` (``"flash"`` on CUDA when flash-attn is installed, else
            ``"sdpa"``), ``"sdpa"`` or ``"flash"``.
        device: the activations' device.

    Returns:
        ``"sdpa"`` or ``"flash"``. The choice is logged once per (request, device type).

    Raises:
        ValueError: unknown name, or ``"flash"`` without CUDA or without flash-attn.
    """
    device = torch.device(device)
    if backend not in ("auto", "sdpa", "flash"):
        raise ValueError(f"unknown attention backend {backend!r}; use 'auto', 'sdpa' or 'flash'.")
    if backend == "flash":
        if device.type != "cuda":
            raise ValueError(
                f"attention backend 'flash' needs a CUDA device, got {device}; use "
                "backend='sdpa' (or 'auto')."
            )
        if not flash_attn_available():
            raise ValueError(
                f"attention backend 'flash' needs flash-attn, not installed: {_FLASH_FIX}."
            )
        chosen = "flash"
    elif backend == "sdpa":
        chosen = "sdpa"
    else:
        chosen = "flash" if device.type == "cuda" and flash_attn_available() else "sdpa"
    _log_choice(backend, device.type, chosen)
    return chosen


@functools.cache
def _log_choice(requested: str, device_type: str, chosen: str) -> None:
    why = ""
    if requested == "auto" and chosen == "sdpa":
        why = " (flash-attn not installed)" if device_type == "cuda" else f" ({device_type} device)"
    log.info("lightning-skrull attention backend: %s%s", chosen, why)


def _varlen_func() -> Callable[..., Any]:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(f"the 'flash' attention backend needs flash-attn: {_FLASH_FIX}.") from err
    return flash_attn_varlen_func


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: SkrullAttentionContext,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of the local sequences: one varlen call, ``cu_seqlens_q == _k``."""
    max_len = max(ctx.layout.local_lengths)
    return _varlen_func()(
        q,
        k,
        v,
        cu_seqlens_q=ctx.local_cu_seqlens,
        cu_seqlens_k=ctx.local_cu_seqlens,
        max_seqlen_q=max_len,
        max_seqlen_k=max_len,
        softmax_scale=scale,
        causal=True,
    )


def distributed_attention(
    q: torch.Tensor,
    k_whole: torch.Tensor,
    v_whole: torch.Tensor,
    ctx: SkrullAttentionContext,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """This rank's distributed chunks against their key prefixes: one varlen call.

    The keys of chunk ``[start, end)`` are rows ``[0, end)`` of its whole sequence, copied end
    to end (``ctx.chunk_key_index``); flash-attn's bottom-right causal alignment for
    ``seqlen_q < seqlen_k`` gives query ``i`` keys ``0 .. start + i``.
    """
    chunks = ctx.layout.distributed_chunks
    return _varlen_func()(
        q,
        k_whole.index_select(0, ctx.chunk_key_index),
        v_whole.index_select(0, ctx.chunk_key_index),
        cu_seqlens_q=ctx.chunk_cu_seqlens_q,
        cu_seqlens_k=ctx.chunk_cu_seqlens_k,
        max_seqlen_q=max(c.end - c.start for c in chunks),
        max_seqlen_k=max(c.end for c in chunks),
        softmax_scale=scale,
        causal=True,
    )


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: SkrullAttentionContext,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Context-parallel causal attention of this rank's packed tokens with flash-attn.

    Args:
        q: ``[T, Hq, D]`` queries in this rank's packed order (RoPE applied), fp16/bf16, CUDA.
        k: ``[T, Hkv, D]`` keys, ``Hq`` a multiple of ``Hkv``.
        v: ``[T, Hkv, D]`` values.
        ctx: the micro-batch's attention context.
        scale: softmax scale; ``None`` = ``D ** -0.5``.

    Returns:
        ``[T, Hq, D]`` attention output in packed order.
    """
    _varlen_func()  # fail before any collective when flash-attn is missing
    return context_parallel_attention(
        q,
        k,
        v,
        ctx,
        scale=scale,
        local_attention=local_attention,
        distributed_attention=distributed_attention,
    )
