"""The ``flash`` backend (FlashAttention-2 varlen kernels, CUDA only).

Two kernels can run it (chosen by :func:`~lightning_skrull.attention.backends.flash_kernel`),
both imported lazily so this module imports everywhere:

* ``flash_attn_varlen_func`` from the flash-attn package (an optional GPU extra,
  ``pip install flash-attn``), used whenever it is installed;
* otherwise PyTorch's own ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 varlen
  with autograd, in CUDA builds), called through :func:`_torch_varlen`, which maps flash-attn's
  arguments onto its signature (with or without ``enable_gqa``, by PyTorch release).

Local sequences run as one varlen call with ``cu_seqlens_q == cu_seqlens_k``. The distributed
chunks run as a second call whose keys are, per chunk, the prefix ``[0, chunk.end)`` of its
whole (all-gathered) sequence, with separate ``cu_seqlens_q`` / ``cu_seqlens_k``: both kernels
align the causal mask to the bottom right when ``seqlen_q != seqlen_k`` (flash-attn >= 2.1),
which is exactly "query ``i`` of the chunk sees keys up to ``chunk.start + i``". GQA is native
(no repeated K/V) where the kernel supports it.

A layer with a sliding window ``W`` passes ``window_size=(W - 1, 0)`` to both calls: with the
same bottom-right alignment the query at position ``p`` of a sequence sees keys
``[p - W + 1, p]``, transformers' window, and the kernel skips the key blocks outside it.
flash-attn has ``window_size`` since 2.3, PyTorch's ``varlen_attn`` in every release the package
supports (2.11 on); a flash-attn without it is refused (:func:`require_window_support`).

FlashAttention-2 kernels take one head dim for q, k and v. For values narrower than the keys
(Multi-head Latent Attention's, :mod:`~lightning_skrull.models.families.mla`) both calls pad v
with zero columns to the key's width and crop the output back (:func:`_padded_value`), as
transformers' own FlashAttention integration does. The padded columns get zero weight sums and
zero gradients, so the result is the unpadded attention's exactly. The exchange carries the
values unpadded.

Attention sinks (per-head sink logits, passed as ``s_aux``: gpt-oss's ``sinks``) are refused
(:func:`refuse_sink`): the varlen kernels have no sink term, and their autograd drops the
gradient of the log-sum-exp that a sink correction of their output would need. ``"auto"`` runs
such layers on the ``sdpa`` backend instead, which adds the sink as a key.

``"auto"`` picks this backend on CUDA whenever a kernel is installed: on an H200 with PyTorch
2.11 it ran a Qwen2.5-0.5B training step on Wikipedia-like data 1.21x faster than the ``sdpa``
backend (8-12x before that backend's CUDA fixes) and matched it to bf16 rounding, forward and
backward (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, cast

import torch

from lightning_skrull.attention.backends import FLASH_FIX, flash_kernel
from lightning_skrull.attention.context import SkrullAttentionContext
from lightning_skrull.attention.schedule import context_parallel_attention, crop_value, pad_value

log = logging.getLogger(__name__)


def window_supported() -> bool:
    """Whether the installed varlen kernel (:func:`flash_kernel`) takes a sliding window."""
    kernel = flash_kernel()
    if kernel == "flash-attn":
        from flash_attn import flash_attn_varlen_func

        return "window_size" in _parameter_names(flash_attn_varlen_func)
    return kernel == "torch"


def require_window_support() -> None:
    """Raise unless the installed varlen kernel runs sliding-window layers.

    Raises:
        ValueError: no kernel, or flash-attn < 2.3 (no ``window_size``).
    """
    if not window_supported():
        kernel = flash_kernel()
        raise ValueError(
            f"attention backend 'flash' cannot run a sliding-window layer: the installed varlen "
            f"kernel ({kernel or 'none'}) takes no window_size; install flash-attn >= 2.3 "
            "(pip install flash-attn), or uninstall flash-attn so that PyTorch's own "
            "torch.nn.attention.varlen.varlen_attn runs, or use attention_backend='sdpa' (or "
            "'auto', which falls back to it for these layers)."
        )


def _window_kwargs(window: int | None) -> dict[str, Any]:
    """flash-attn's keyword for a sliding window of ``window`` keys (none for full layers)."""
    return {} if window is None else {"window_size": (window - 1, 0)}


def _varlen_func() -> Callable[..., Any]:
    """A varlen kernel with flash-attn's keyword interface (see :func:`flash_kernel`)."""
    kernel = flash_kernel()
    if kernel == "flash-attn":
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func  # type: ignore[no-any-return]
    if kernel == "torch":
        return _torch_varlen
    raise ImportError(f"the 'flash' attention backend needs a varlen kernel: {FLASH_FIX}.")


@functools.cache
def _parameter_names(fn: Callable[..., Any]) -> frozenset[str]:
    """The parameter names of ``fn``, read once per function (the attention calls it per layer)."""
    return frozenset(inspect.signature(fn).parameters)


def _torch_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    """``flash_attn_varlen_func``'s causal call through ``torch.nn.attention.varlen``.

    Causality, and a sliding window (flash-attn's ``window_size=(left, 0)``), go as
    ``window_size=(left, 0)`` with ``left = -1`` for none. PyTorch 2.11 has no ``enable_gqa``:
    there each K/V head is repeated for its query heads, as SDPA's GQA does; later releases
    take ``enable_gqa``.
    """
    from torch.nn.attention.varlen import varlen_attn

    if not causal:  # pragma: no cover - every call in this module is causal
        raise ValueError("the skrull flash backend only runs causal attention")
    # a tuple: varlen_attn compares it with (-1, 0)
    kwargs: dict[str, Any] = {"window_size": (int(window_size[0]), 0)}
    if softmax_scale is not None:
        kwargs["scale"] = softmax_scale
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        if "enable_gqa" in _parameter_names(varlen_attn):
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
    out = varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)
    # Without ``return_aux`` the kernel returns the output alone, not ``(output, aux)``.
    return cast(torch.Tensor, out)


def _padded_value(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``v`` padded with zero columns to ``q``'s head dim (:func:`pad_value`), and ``v``'s own
    width to crop the output to (the kernels take one head dim for q, k and v)."""
    width = v.shape[-1]
    if width > q.shape[-1]:
        raise ValueError(
            f"attention backend 'flash' got a value head dim {width} wider than the query/key "
            f"head dim {q.shape[-1]}; the varlen kernels take one head dim, so use "
            "attention_backend='sdpa'."
        )
    return pad_value(v, q.shape[-1]), width


SINK_FIX = (
    "use attention_backend='sdpa', or 'auto', which runs the layers with sinks on it (it adds "
    "the sink as a key of its own)"
)
"""How to train a model with attention sinks when the ``flash`` backend was asked for."""


def refuse_sink(sink: torch.Tensor | None) -> None:
    """Raise for attention sink logits: the varlen kernels have no sink term.

    Raises:
        ValueError: ``sink`` is given.
    """
    if sink is not None:
        raise ValueError(
            "attention backend 'flash' cannot run a layer with attention sinks (gpt-oss's "
            f"per-head sink logits, s_aux): the varlen kernels have no sink term; {SINK_FIX}."
        )


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: SkrullAttentionContext,
    *,
    scale: float | None = None,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the local sequences: one varlen call, ``cu_seqlens_q == _k``."""
    refuse_sink(sink)
    max_len = max(ctx.layout.local_lengths)
    v, width = _padded_value(q, v)
    out = _varlen_func()(
        q,
        k,
        v,
        cu_seqlens_q=ctx.local_cu_seqlens,
        cu_seqlens_k=ctx.local_cu_seqlens,
        max_seqlen_q=max_len,
        max_seqlen_k=max_len,
        softmax_scale=scale,
        causal=True,
        **_window_kwargs(window),
    )
    return crop_value(out, width)


def distributed_attention(
    q: torch.Tensor,
    k_whole: torch.Tensor,
    v_whole: torch.Tensor,
    ctx: SkrullAttentionContext,
    *,
    scale: float | None = None,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's distributed chunks against their key prefixes: one varlen call.

    The keys of chunk ``[start, end)`` are rows ``[0, end)`` of its whole sequence, copied end
    to end (``ctx.chunk_key_index``); flash-attn's bottom-right causal alignment for
    ``seqlen_q < seqlen_k`` gives query ``i`` keys ``0 .. start + i`` (with a window, keys
    ``start + i - window + 1 .. start + i``).
    """
    refuse_sink(sink)
    chunks = ctx.layout.distributed_chunks
    v, width = _padded_value(q, v_whole.index_select(0, ctx.chunk_key_index))
    out = _varlen_func()(
        q,
        k_whole.index_select(0, ctx.chunk_key_index),
        v,
        cu_seqlens_q=ctx.chunk_cu_seqlens_q,
        cu_seqlens_k=ctx.chunk_cu_seqlens_k,
        max_seqlen_q=max(c.end - c.start for c in chunks),
        max_seqlen_k=max(c.end for c in chunks),
        softmax_scale=scale,
        causal=True,
        **_window_kwargs(window),
    )
    return crop_value(out, width)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: SkrullAttentionContext,
    *,
    scale: float | None = None,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Context-parallel causal attention of this rank's packed tokens with a FlashAttention-2
    varlen kernel (flash-attn, else ``torch.nn.attention.varlen``).

    Args:
        q: ``[T, Hq, D]`` queries in this rank's packed order (RoPE applied), fp16/bf16, CUDA.
        k: ``[T, Hkv, D]`` keys, ``Hq`` a multiple of ``Hkv``.
        v: ``[T, Hkv, Dv]`` values, ``Dv <= D`` (padded to ``D`` for the kernel).
        ctx: the micro-batch's attention context.
        scale: softmax scale; ``None`` = ``D ** -0.5``.
        window: the layer's sliding window (the query at position ``p`` sees keys
            ``[p - window + 1, p]``); ``None`` = full causal.
        sink: must be ``None``: attention sinks are refused (:func:`refuse_sink`).

    Returns:
        ``[T, Hq, Dv]`` attention output in packed order.

    Raises:
        ImportError: no varlen kernel installed.
        ValueError: a window with a kernel that takes none, ``Dv > D``, or a sink.
    """
    refuse_sink(sink)
    _varlen_func()  # fail before any collective when no kernel is installed
    if window is not None:
        require_window_support()
    return context_parallel_attention(
        q,
        k,
        v,
        ctx,
        scale=scale,
        window=window,
        local_attention=local_attention,
        distributed_attention=distributed_attention,
    )
