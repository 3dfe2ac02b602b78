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

Distributed chunks: each chunk of a distributed sequence attends the prefix of its whole
(all-gathered) sequence that ends with it, with lower-right causal alignment. A layer's sliding
window and its attention sinks apply to both parts. How one sequence's queries run in SDPA
calls (bounded masks, the ``causal_lower_right`` bias on CUDA, the window's query blocks, values
narrower than the keys, the sink as a key of its own, the CUDA kernels allowed) is
:mod:`~lightning_skrull.attention.sdpa_calls`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_skrull.attention.context import SkrullAttentionContext
from lightning_skrull.attention.schedule import context_parallel_attention
from lightning_skrull.attention.sdpa_calls import (
    causal_lower_right_attention,
    sdpa_heads_first,
    sliding_window_attention,
)

LOCAL_GROUP_MASK_ELEMENTS = 1 << 12
"""Largest block-diagonal mask (elements, a group's tokens squared) of one SDPA call over a
group of local sequences: groups of up to 64 tokens. Read at each call; ``0`` (with
:data:`LOCAL_BATCH_EQUAL_LENGTHS` off) runs every local sequence in its own call."""

LOCAL_BATCH_EQUAL_LENGTHS = True
"""Whether a run of consecutive local sequences of one length, too long for one masked group,
is one batched causal SDPA call (:func:`plan_local_calls`). Read at each call."""


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


def block_causal_mask(
    lengths: Sequence[int], device: torch.device | str = "cpu", window: int | None = None
) -> torch.Tensor:
    """Boolean ``[G, G]`` mask (``G = sum(lengths)``) of sequences laid end to end, each causal.

    ``True`` = attend: position ``i`` sees ``j`` when both are in one sequence and ``j <= i``,
    and, with a ``window``, ``i - j < window``. Every row sees at least its own position.
    """
    seq = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
    )
    pos = torch.arange(seq.numel(), device=device)
    rows, cols = pos.unsqueeze(1), pos.unsqueeze(0)
    mask = (seq.unsqueeze(1) == seq.unsqueeze(0)) & (cols <= rows)
    if window is not None:
        mask &= cols > rows - window
    return mask


@dataclass(frozen=True)
class LocalCall:
    """One SDPA call over consecutive local sequences.

    Attributes:
        lengths: its sequences' lengths, packed order.
        batched: the sequences (all of one length) run along SDPA's batch dimension with
            ``is_causal=True``; otherwise one sequence runs causal, several with a
            :func:`block_causal_mask`.
    """

    lengths: tuple[int, ...]
    batched: bool = False

    @property
    def tokens(self) -> int:
        """Tokens of the call."""
        return sum(self.lengths)


def plan_local_calls(
    lengths: Sequence[int], max_mask_elements: int, batch_equal_lengths: bool = True
) -> tuple[LocalCall, ...]:
    """The SDPA calls of the local sequences, in packed order.

    A run of two or more consecutive sequences of one length that does not fit one masked group
    (its tokens squared exceed ``max_mask_elements``) is one batched causal call: the run's
    tokens viewed as ``[count, length]`` along SDPA's batch dimension with ``is_causal=True``, so
    no mask and no masked-out work. The sequences between such runs are cut by
    :func:`group_local_lengths`.

    Args:
        lengths: the local sequences' lengths in packed order.
        max_mask_elements: bound of :func:`group_local_lengths`.
        batch_equal_lengths: whether runs of equal lengths become batched calls.

    Returns:
        The calls; their sequences, concatenated, are ``lengths``.

    Raises:
        ValueError: ``max_mask_elements`` is negative.
    """
    calls: list[LocalCall] = []
    pending: list[int] = []

    def flush() -> None:
        calls.extend(LocalCall(g) for g in group_local_lengths(pending, max_mask_elements))
        pending.clear()

    i = 0
    while i < len(lengths):
        j = i + 1
        while j < len(lengths) and lengths[j] == lengths[i]:
            j += 1
        run = tuple(lengths[i:j])
        if batch_equal_lengths and len(run) > 1 and sum(run) ** 2 > max_mask_elements:
            flush()
            calls.append(LocalCall(run, batched=True))
        else:
            pending.extend(run)
        i = j
    flush()  # also refuses a negative bound
    return tuple(calls)


@dataclass(frozen=True)
class LocalCalls:
    """The local sequences of a micro-batch as SDPA calls, with what each call needs.

    Attributes:
        calls: the calls, packed order.
        sizes: tokens of each call (they sum to the local tokens).
        masks: per call, its :func:`block_causal_mask` (with the window) for a masked group,
            ``None`` otherwise.
        window: the sliding window of the layers these calls serve; ``None`` = full causal
            (also when no local sequence is longer than the window).
    """

    calls: tuple[LocalCall, ...]
    sizes: tuple[int, ...]
    masks: tuple[torch.Tensor | None, ...]
    window: int | None = None


def local_calls(
    ctx: SkrullAttentionContext,
    max_mask_elements: int,
    device: torch.device,
    batch_equal_lengths: bool = True,
    window: int | None = None,
) -> LocalCalls:
    """The micro-batch's :class:`LocalCalls`, built once per context, bound, device and window.

    A window no local sequence is longer than changes nothing: those calls are the full
    causal ones (the same cached object).
    """
    lengths = ctx.layout.local_lengths
    if window is not None and window >= max(lengths, default=0):
        window = None

    def build() -> LocalCalls:
        calls = plan_local_calls(lengths, max_mask_elements, batch_equal_lengths)
        return LocalCalls(
            calls=calls,
            sizes=tuple(c.tokens for c in calls),
            masks=tuple(
                block_causal_mask(c.lengths, device, window)
                if len(c.lengths) > 1 and not c.batched
                else None
                for c in calls
            ),
            window=window,
        )

    key = ("sdpa_local_calls", max_mask_elements, batch_equal_lengths, device, window)
    return ctx.cached(key, build)


def _local_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    call: LocalCall,
    mask: torch.Tensor | None,
    scale: float | None,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """One call on ``[1, H, tokens, D]`` inputs -> ``[1, tokens, Hq, D]``."""
    windowed = window is not None and call.lengths[0] > window
    if mask is None and (windowed or sink is not None):
        # One sequence, or a batched run of one length, longer than the window (or with a
        # sink, whose causal call needs a mask): each sequence in query blocks whose masks
        # stay bounded, skipping the keys outside the window.
        q3, k3, v3 = (t.squeeze(0).transpose(0, 1) for t in (q, k, v))  # [tokens, H, D]
        outs = [
            sliding_window_attention(qs, ks, vs, window=window, scale=scale, sink=sink)
            if window is not None
            else causal_lower_right_attention(qs, ks, vs, scale=scale, sink=sink)
            for qs, ks, vs in zip(
                q3.split(call.lengths), k3.split(call.lengths), v3.split(call.lengths), strict=True
            )
        ]
        return (torch.cat(outs) if len(outs) > 1 else outs[0]).unsqueeze(0)
    if not call.batched:
        out = sdpa_heads_first(q, k, v, scale=scale, is_causal=mask is None, mask=mask, sink=sink)
        return out.transpose(1, 2)
    # [1, H, n * L, D] -> [n, H, L, D]: views (a dim split and a transpose), no copy
    shape = (len(call.lengths), call.lengths[0])
    qb, kb, vb = (t.squeeze(0).unflatten(1, shape).transpose(0, 1) for t in (q, k, v))
    out = sdpa_heads_first(qb, kb, vb, scale=scale, is_causal=True)  # [n, Hq, L, D]
    return out.transpose(1, 2).flatten(0, 1).unsqueeze(0)


def local_attention_heads_first(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: SkrullAttentionContext,
    *,
    scale: float | None = None,
    group_mask_elements: int | None = None,
    batch_equal_lengths: bool | None = None,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each local sequence on its own, in SDPA's own layout.

    What the attention function runs when the micro-batch has no distributed sequence: the
    inputs come as transformers passes them and go to SDPA without transposes, so a
    micro-batch in one call costs one SDPA call and one view per layer.

    Args:
        q: ``[1, Hq, n_local, D]`` the local queries.
        k: ``[1, Hkv, n_local, D]``.
        v: ``[1, Hkv, n_local, D]``.
        ctx: the micro-batch's attention context (``layout.local_lengths`` is read).
        scale: softmax scale; ``None`` = ``D ** -0.5``.
        group_mask_elements: bound of :func:`group_local_lengths`; ``None`` =
            :data:`LOCAL_GROUP_MASK_ELEMENTS`, ``0`` = one SDPA call per sequence (with
            ``batch_equal_lengths=False``).
        batch_equal_lengths: see :func:`plan_local_calls`; ``None`` =
            :data:`LOCAL_BATCH_EQUAL_LENGTHS`.
        window: the layer's sliding window (each query sees the ``window`` keys up to itself);
            ``None`` = full causal.
        sink: the layer's attention sink logits ``[Hq]``, or ``None``
            (:mod:`~lightning_skrull.attention.sdpa_calls`).

    Returns:
        ``[1, n_local, Hq, D]``.
    """
    if group_mask_elements is None:
        group_mask_elements = LOCAL_GROUP_MASK_ELEMENTS
    if batch_equal_lengths is None:
        batch_equal_lengths = LOCAL_BATCH_EQUAL_LENGTHS
    plan = local_calls(ctx, group_mask_elements, q.device, batch_equal_lengths, window)
    window = plan.window
    if len(plan.calls) == 1:
        return _local_call(q, k, v, plan.calls[0], plan.masks[0], scale, window, sink)
    # One split per tensor: its backward is one concatenation. Slicing each call's part out
    # instead costs a zero-filled gradient of the whole buffer per call in the backward.
    outs = [
        _local_call(qs, ks, vs, call, mask, scale, window, sink)
        for qs, ks, vs, call, mask in zip(
            q.split(plan.sizes, 2),
            k.split(plan.sizes, 2),
            v.split(plan.sizes, 2),
            plan.calls,
            plan.masks,
            strict=True,
        )
    ]
    return torch.cat(outs, dim=1)


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: SkrullAttentionContext,
    *,
    scale: float | None = None,
    group_mask_elements: int | None = None,
    batch_equal_lengths: bool | None = None,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each local sequence on its own, short ones grouped in one call.

    The backend's local attention in the packed layout of :func:`sdpa_attention`:
    :func:`local_attention_heads_first` on transposed views.

    Args:
        q: ``[n_local, Hq, D]`` the local part of the packed queries.
        k: ``[n_local, Hkv, D]``.
        v: ``[n_local, Hkv, D]``.
        ctx: the micro-batch's attention context (``layout.local_lengths`` is read).
        scale: softmax scale; ``None`` = ``D ** -0.5``.
        group_mask_elements: as for :func:`local_attention_heads_first`.
        batch_equal_lengths: as for :func:`local_attention_heads_first`.
        window: as for :func:`local_attention_heads_first`.
        sink: as for :func:`local_attention_heads_first`.

    Returns:
        ``[n_local, Hq, D]``.
    """
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = local_attention_heads_first(
        q4,
        k4,
        v4,
        ctx,
        scale=scale,
        group_mask_elements=group_mask_elements,
        batch_equal_lengths=batch_equal_lengths,
        window=window,
        sink=sink,
    )
    return out.squeeze(0)


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
    """Lower-right causal attention of this rank's distributed chunks on the whole sequences.

    Args:
        q: ``[n_dist, Hq, D]`` the distributed part of the packed queries.
        k_whole: ``[sum of distributed lengths, Hkv, D]`` the whole distributed sequences laid
            end to end (offsets ``layout.distributed_cu_seqlens``).
        v_whole: same shape as ``k_whole``.
        ctx: the micro-batch's attention context.
        scale: softmax scale; ``None`` = ``D ** -0.5``.
        window: the layer's sliding window; ``None`` = full causal. A chunk ending within it
            runs as without one.
        sink: the layer's attention sink logits ``[Hq]``, or ``None``
            (:mod:`~lightning_skrull.attention.sdpa_calls`).

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
            q_chunk, ks[c.index][: c.end], vs[c.index][: c.end], scale=scale, sink=sink
        )
        if window is None or c.end <= window
        else sliding_window_attention(
            q_chunk,
            ks[c.index][: c.end],
            vs[c.index][: c.end],
            window=window,
            scale=scale,
            sink=sink,
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
    window: int | None = None,
    sink: torch.Tensor | None = None,
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
        window: the layer's sliding window (transformers' ``sliding_window``: the query at
            position ``p`` sees keys ``[p - window + 1, p]``); ``None`` = full causal.
        sink: the layer's attention sink logits ``[Hq]``, or ``None``
            (:mod:`~lightning_skrull.attention.sdpa_calls`).

    Returns:
        ``[T, Hq, D]`` attention output in packed order.
    """
    return context_parallel_attention(
        q,
        k,
        v,
        ctx,
        scale=scale,
        window=window,
        sink=sink,
        local_attention=local_attention,
        distributed_attention=distributed_attention,
    )
