"""The ``sdpa`` backend: pure PyTorch, any device and dtype (float64 included).

Local sequences: one ``scaled_dot_product_attention(..., is_causal=True)`` per sequence, so a
sequence of ``s`` tokens costs what SDPA costs on it alone (no mask over the packed buffer).

Distributed chunks: a chunk holding tokens ``[start, end)`` of a sequence attends keys
``[0, end)`` of the whole (all-gathered) sequence with lower-right causal alignment: query
``i`` sees keys ``0 .. start + i``. A square chunk (``start == 0``) uses ``is_causal=True``.
On CUDA (half or single precision) the chunk is one SDPA call with PyTorch's
``causal_lower_right`` bias, which the flash and memory-efficient kernels apply without building
a mask. Elsewhere the queries are processed in blocks of ``b`` rows; block ``[a, a + b)``
attends keys ``[0, start + a + b)`` with a boolean mask of ``b x (start + a + b)`` built on the
fly, ``b`` chosen so the mask has at most :data:`MASK_ELEMENTS_PER_CALL` elements. The mask is
therefore O(s) per call for a long sequence, never the quadratic ``Lq x Lk`` (nor one over the
buffer). On CPU, SDPA runs these masks through its fused flash kernel (no score matrix kept).
On CUDA those blocks cost one kernel call each (hundreds for a long chunk), which is why the
bias is used there.

GQA uses ``enable_gqa=True``: K/V are not repeated by this code (the fused kernels read shared
heads directly; the math fallback repeats internally).

On CUDA, SDPA is restricted to its flash, memory-efficient and math kernels. PyTorch prefers
cuDNN's kernel on Hopper, which builds an execution plan for every new shape: with the many
different sequence lengths of a packed batch that cost 7.3 s per layer (forward + backward) on
an H200 for a Wikipedia-like global batch whose kernels then run in 28 ms (docs/benchmarks.md).
Masked calls there repeat K/V for GQA: the memory-efficient kernel takes a mask but not GQA, the
flash kernel GQA but not a mask, and the math kernel, which takes both, keeps the scores.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from lightning_skrull.attention.context import SkrullAttentionContext
from lightning_skrull.attention.schedule import context_parallel_attention

MASK_ELEMENTS_PER_CALL = 1 << 22
"""Largest boolean mask (elements) one SDPA call of a distributed chunk builds (4 MiB)."""


CUDA_SDPA_KERNELS = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)
"""The SDPA kernels allowed on CUDA, in PyTorch's order (no cuDNN: a plan build per shape)."""


def _restrict_kernels(t: torch.Tensor) -> bool:
    """Whether SDPA on ``t``'s device runs under :data:`CUDA_SDPA_KERNELS`."""
    return t.is_cuda


_BIAS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Dtypes of SDPA's CUDA kernels that apply lower-right causal masks without building them."""


def _lower_right_bias(t: torch.Tensor) -> bool:
    """Whether a lower-right causal call on ``t`` uses ``causal_lower_right`` (no mask built)."""
    return t.is_cuda and t.dtype in _BIAS_DTYPES


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None,
    is_causal: bool = False,
    mask: torch.Tensor | CausalBias | None = None,
) -> torch.Tensor:
    """``q [L, Hq, D]``, ``k, v [S, Hkv, D]`` -> ``[L, Hq, D]``."""
    gqa = q.shape[1] != k.shape[1]
    restrict = _restrict_kernels(q)
    if restrict and gqa and mask is not None:
        groups = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), False
    with sdpa_kernel(list(CUDA_SDPA_KERNELS)) if restrict else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=gqa,
        )
    return out.squeeze(0).transpose(0, 1)


def causal_lower_right_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    mask_elements: int = MASK_ELEMENTS_PER_CALL,
) -> torch.Tensor:
    """Causal attention of the last ``L`` positions of a sequence against its first ``S``.

    Args:
        q: ``[L, Hq, D]`` queries at positions ``S - L .. S - 1``.
        k: ``[S, Hkv, D]`` keys at positions ``0 .. S - 1`` (``S >= L``).
        v: ``[S, Hkv, D]`` values.
        scale: softmax scale; ``None`` = ``D ** -0.5``.
        mask_elements: largest mask one SDPA call may build.

    Returns:
        ``[L, Hq, D]``.
    """
    num_q, num_k = q.shape[0], k.shape[0]
    offset = num_k - num_q
    if offset == 0:
        return _sdpa(q, k, v, scale=scale, is_causal=True)
    if _lower_right_bias(q):
        return _sdpa(q, k, v, scale=scale, mask=causal_lower_right(num_q, num_k))
    block = max(1, mask_elements // num_k)
    outs = []
    for a in range(0, num_q, block):
        b = min(block, num_q - a)
        keys = offset + a + b  # the block's last query sees key offset + a + b - 1
        rows = torch.arange(offset + a, offset + a + b, device=q.device).unsqueeze(1)
        cols = torch.arange(keys, device=q.device).unsqueeze(0)
        outs.append(_sdpa(q[a : a + b], k[:keys], v[:keys], scale=scale, mask=cols <= rows))
    return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: SkrullAttentionContext,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of each local sequence on its own.

    Args:
        q: ``[n_local, Hq, D]`` the local part of the packed queries.
        k: ``[n_local, Hkv, D]``.
        v: ``[n_local, Hkv, D]``.
        ctx: the micro-batch's attention context (``layout.local_cu_seqlens`` is read).
        scale: softmax scale; ``None`` = ``D ** -0.5``.

    Returns:
        ``[n_local, Hq, D]``.
    """
    lengths = ctx.layout.local_lengths
    if len(lengths) == 1:
        return _sdpa(q, k, v, scale=scale, is_causal=True)
    # One split per tensor: its backward is one concatenation. Slicing each sequence out
    # instead costs a zero-filled gradient of the whole buffer per sequence in the backward.
    outs = [
        _sdpa(qs, ks, vs, scale=scale, is_causal=True)
        for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)
    ]
    return torch.cat(outs, dim=0)


def distributed_attention(
    q: torch.Tensor,
    k_whole: torch.Tensor,
    v_whole: torch.Tensor,
    ctx: SkrullAttentionContext,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Lower-right causal attention of this rank's distributed chunks on the whole sequences.

    Args:
        q: ``[n_dist, Hq, D]`` the distributed part of the packed queries.
        k_whole: ``[sum of distributed lengths, Hkv, D]`` the whole distributed sequences laid
            end to end (offsets ``layout.distributed_cu_seqlens``).
        v_whole: same shape as ``k_whole``.
        ctx: the micro-batch's attention context.
        scale: softmax scale; ``None`` = ``D ** -0.5``.

    Returns:
        ``[n_dist, Hq, D]``.
    """
    layout = ctx.layout
    chunks = layout.distributed_chunks
    # Split, not slice, for the same reason as local_attention: the chunks tile q in packed
    # order, and each chunk's keys are a prefix of its own sequence's part of k_whole.
    qs = q.split([c.end - c.start for c in chunks]) if len(chunks) > 1 else (q,)
    ks = k_whole.split(layout.distributed_lengths)
    vs = v_whole.split(layout.distributed_lengths)
    outs = [
        causal_lower_right_attention(
            q_chunk, ks[c.index][: c.end], vs[c.index][: c.end], scale=scale
        )
        for q_chunk, c in zip(qs, chunks, strict=True)
    ]
    return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: SkrullAttentionContext,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Context-parallel causal attention of this rank's packed tokens with PyTorch SDPA.

    Starts the all-gather of the distributed part's K/V, computes the local sequences while it
    is in flight, then the distributed chunks against the gathered key prefixes.

    Args:
        q: ``[T, Hq, D]`` queries in this rank's packed order (RoPE applied).
        k: ``[T, Hkv, D]`` keys, ``Hq`` a multiple of ``Hkv``.
        v: ``[T, Hkv, D]`` values.
        ctx: the micro-batch's attention context.
        scale: softmax scale; ``None`` = ``D ** -0.5``.

    Returns:
        ``[T, Hq, D]`` attention output in packed order.
    """
    return context_parallel_attention(
        q,
        k,
        v,
        ctx,
        scale=scale,
        local_attention=local_attention,
        distributed_attention=distributed_attention,
    )
