"""The ``sdpa`` backend: pure PyTorch, any device and dtype (float64 included).

Local sequences: consecutive short sequences share one SDPA call with a block-diagonal causal
boolean mask (each query sees the keys of its own sequence up to itself, so no row is fully
masked); a group holds as many as fit :data:`LOCAL_GROUP_MASK_ELEMENTS` (its tokens squared).
A sequence too long to share a group runs alone with ``is_causal=True`` and no mask, so its
cost is what SDPA costs on it alone (no mask over the packed buffer), and the mask memory stays
bounded whatever the lengths. The groups and their masks are built once per micro-batch (kept
by ``SkrullAttentionContext.cached``) and shared by every layer. Grouping trades SDPA calls (each
with its autograd node, views and dispatch, tens of microseconds on CPU whatever its size) for
masked-out work: a group of ``G`` tokens computes ``G x G`` scores, as SDPA on CPU does not
skip the masked blocks. The bound is where the two balance for short sequences on CPU
(docs/benchmarks.md).

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
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from lightning_skrull.attention.context import SkrullAttentionContext
from lightning_skrull.attention.schedule import context_parallel_attention

MASK_ELEMENTS_PER_CALL = 1 << 22
"""Largest boolean mask (elements) one SDPA call of a distributed chunk builds (4 MiB)."""

LOCAL_GROUP_MASK_ELEMENTS = 1 << 12
"""Largest block-diagonal mask (elements, a group's tokens squared) of one SDPA call over a
group of local sequences: groups of up to 64 tokens. Read at each call; ``0`` runs every local
sequence in its own call."""


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


def group_local_lengths(
    lengths: Sequence[int], max_mask_elements: int
) -> tuple[tuple[int, ...], ...]:
    """Consecutive local sequences in groups whose tokens squared fit ``max_mask_elements``.

    Sequences are taken in packed order; a group is closed when the next sequence would take it
    over the bound. A sequence that alone exceeds the bound is a group of its own.

    Args:
        lengths: the local sequences' lengths in packed order.
        max_mask_elements: largest ``(sum of a group's lengths) ** 2``; ``0`` = one sequence
            per group.

    Returns:
        The lengths, in packed order, cut into groups.

    Raises:
        ValueError: ``max_mask_elements`` is negative.
    """
    if max_mask_elements < 0:
        raise ValueError(
            f"max_mask_elements={max_mask_elements} is negative; pass 0 (one SDPA call per local "
            "sequence) or a positive number of mask elements."
        )
    groups: list[tuple[int, ...]] = []
    current: list[int] = []
    tokens = 0
    for n in lengths:
        if current and (tokens + n) ** 2 > max_mask_elements:
            groups.append(tuple(current))
            current, tokens = [], 0
        current.append(n)
        tokens += n
    if current:
        groups.append(tuple(current))
    return tuple(groups)


def block_causal_mask(lengths: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean ``[G, G]`` mask (``G = sum(lengths)``) of sequences laid end to end, each causal.

    ``True`` = attend: position ``i`` sees ``j`` when both are in one sequence and ``j <= i``.
    Every row sees at least its own position.
    """
    seq = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
    )
    pos = torch.arange(seq.numel(), device=device)
    return (seq.unsqueeze(1) == seq.unsqueeze(0)) & (pos.unsqueeze(0) <= pos.unsqueeze(1))


@dataclass(frozen=True)
class LocalGroups:
    """The local sequences of a micro-batch in SDPA calls.

    Attributes:
        sizes: tokens of each group, in packed order (they sum to the local tokens).
        masks: per group, its :func:`block_causal_mask`, or ``None`` for a group of one
            sequence (run with ``is_causal=True``).
    """

    sizes: tuple[int, ...]
    masks: tuple[torch.Tensor | None, ...]


def local_groups(
    ctx: SkrullAttentionContext, max_mask_elements: int, device: torch.device
) -> LocalGroups:
    """The micro-batch's :class:`LocalGroups`, built once per context, bound and device."""

    def build() -> LocalGroups:
        groups = group_local_lengths(ctx.layout.local_lengths, max_mask_elements)
        return LocalGroups(
            sizes=tuple(sum(g) for g in groups),
            masks=tuple(block_causal_mask(g, device) if len(g) > 1 else None for g in groups),
        )

    return ctx.cached(("sdpa_local_groups", max_mask_elements, device), build)


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: SkrullAttentionContext,
    *,
    scale: float | None = None,
    group_mask_elements: int | None = None,
) -> torch.Tensor:
    """Causal attention of each local sequence on its own, short ones grouped in one call.

    Args:
        q: ``[n_local, Hq, D]`` the local part of the packed queries.
        k: ``[n_local, Hkv, D]``.
        v: ``[n_local, Hkv, D]``.
        ctx: the micro-batch's attention context (``layout.local_lengths`` is read).
        scale: softmax scale; ``None`` = ``D ** -0.5``.
        group_mask_elements: bound of :func:`group_local_lengths`; ``None`` =
            :data:`LOCAL_GROUP_MASK_ELEMENTS`, ``0`` = one SDPA call per sequence.

    Returns:
        ``[n_local, Hq, D]``.
    """
    if group_mask_elements is None:
        group_mask_elements = LOCAL_GROUP_MASK_ELEMENTS
    groups = local_groups(ctx, group_mask_elements, q.device)
    if len(groups.sizes) == 1:
        mask = groups.masks[0]
        return _sdpa(q, k, v, scale=scale, is_causal=mask is None, mask=mask)
    # One split per tensor: its backward is one concatenation. Slicing each group out
    # instead costs a zero-filled gradient of the whole buffer per group in the backward.
    outs = [
        _sdpa(qs, ks, vs, scale=scale, is_causal=mask is None, mask=mask)
        for qs, ks, vs, mask in zip(
            q.split(groups.sizes),
            k.split(groups.sizes),
            v.split(groups.sizes),
            groups.masks,
            strict=True,
        )
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
