"""The context-parallel attention schedule shared by every backend.

:func:`context_parallel_attention` splits this rank's packed q/k/v into its local and its
distributed part, starts the K/V exchange of every K/V group (:mod:`.comm`), runs the backend's
local attention while the exchanges are in flight, and then each group's distributed attention.

Schedule of :func:`context_parallel_attention` with groups ``0 .. G-1``, forward::

    start gather 0, 1, ..., G-1        (all in flight at once)
    local attention                    (gathers run behind it)
    wait gather 0, distributed attention of group 0
    wait gather 1, distributed attention of group 1   (gather 1 also ran behind group 0)
    ...

Autograd runs the nodes ready to run in decreasing creation order, and each start node is
created before the local attention and each finish node after it, so the backward is::

    distributed attention backward of group G-1, start reduce-scatter G-1
    distributed attention backward of group G-2, start reduce-scatter G-2  (G-1 in flight)
    ...
    distributed attention backward of group 0, start reduce-scatter 0
    local attention backward           (every reduce-scatter still in flight runs behind it)
    wait reduce-scatter G-1, ..., wait reduce-scatter 0

Group ``g``'s gather is thus hidden behind the local attention and the distributed attention of
groups ``< g``, and its reduce-scatter behind the distributed attention backward of groups
``< g`` and the local attention backward. With one group only the local attention hides the
communication, in both directions. The group's gradient buffer (``N x max_r(n_r)`` rows of K
and V) stays alive from its reduce-scatter's start to its wait. The group, the index and the
sizes are saved at forward, so backward needs no context.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_skrull.attention.comm import (
    check_distributed_part,
    check_one_dtype,
    gather_distributed_kv,
    kv_group_contexts,
)
from lightning_skrull.attention.context import SkrullAttentionContext

LocalAttention = Callable[..., torch.Tensor]
"""``fn(q, k, v, ctx, *, scale, window) -> out`` over the local part (``[n_local, H, D]``
tensors); ``window`` is the layer's sliding window or ``None``. A layer with attention sinks
also passes ``sink=`` (its per-head sink logits ``[Hq]``)."""

DistributedAttention = Callable[..., torch.Tensor]
"""``fn(q_dist, k_whole, v_whole, ctx, *, scale, window) -> out`` over this rank's distributed
chunks (and ``sink=`` as for :data:`LocalAttention`)."""


def pad_value(v: torch.Tensor, width: int) -> torch.Tensor:
    """``v`` with zero columns appended up to ``width`` (itself when it is that wide).

    Kernels that take one head dim for q, k and v get values narrower than the keys (Multi-head
    Latent Attention) this way: the padded columns of the output are weighted sums of zeros,
    their gradients zero, so cropping them (:func:`crop_value`) gives the unpadded attention
    exactly.
    """
    return v if v.shape[-1] == width else torch.nn.functional.pad(v, (0, width - v.shape[-1]))


def crop_value(out: torch.Tensor, width: int) -> torch.Tensor:
    """``out``'s first ``width`` columns: the value's own width after :func:`pad_value`."""
    return out if out.shape[-1] == width else out[..., :width]


def _local_and_distributed(t: torch.Tensor, n_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t[:n_local], t[n_local:]``, with a backward that costs one copy of ``t`` at most.

    The backward of a slice is a zero-filled gradient of the whole tensor; when both parts are
    used, one split (whose backward is one concatenation) replaces two slices. An empty part
    is never used, so its slice costs nothing.
    """
    if n_local == 0:
        return t[:0], t
    if n_local == t.shape[0]:
        return t, t[n_local:]
    first, second = t.split([n_local, t.shape[0] - n_local])
    return first, second


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: SkrullAttentionContext,
    *,
    scale: float | None,
    local_attention: LocalAttention,
    distributed_attention: DistributedAttention,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """The schedule shared by every backend (see the module docstring).

    Starts the all-gather of every K/V group's part of the distributed K/V at once, runs
    ``local_attention`` on the local sequences while they are in flight, then, group by group,
    waits for the group's gather and runs ``distributed_attention`` on this rank's chunks of the
    group against the group's whole gathered sequences. The backward starts each group's
    reduce-scatter as soon as the group's attention backward is done and waits for them all
    after the local attention backward. A rank with no query chunk in a group still joins the
    group's all-gather and, through a zero-weighted term, its backward reduce-scatter.

    Args:
        q: ``[T, Hq, D]`` in this rank's packed order.
        k: ``[T, Hkv, D]``.
        v: ``[T, Hkv, D]``.
        ctx: the micro-batch's attention context.
        scale: softmax scale; ``None`` = ``D ** -0.5``.
        local_attention: the backend's local-sequence attention.
        distributed_attention: the backend's distributed-chunk attention, called once per K/V
            group with the group's context.
        window: the layer's sliding window, passed to both; ``None`` = full causal. The K/V
            exchange is the same either way.
        sink: the layer's attention sink logits ``[Hq]``, passed to both as ``sink=``
            (not passed when ``None``). Every query's keys are in one call of each, so the sink
            needs no exchange.

    Returns:
        ``[T, Hq, D]`` in packed order.

    Raises:
        ValueError: the distributed part of ``k`` / ``v`` does not match the layout.
        TypeError: ``q``, ``k`` and ``v`` have different dtypes.
    """
    check_one_dtype(query=q, key=k, value=v)
    layout = ctx.layout
    n_local = layout.num_local_tokens
    (q_local, q_dist), (k_local, k_dist), (v_local, v_dist) = (
        _local_and_distributed(t, n_local) for t in (q, k, v)
    )
    groups = kv_group_contexts(ctx)
    if len(groups) > 1:
        check_distributed_part(k_dist, v_dist, layout)
        sizes = [g.layout.num_distributed_tokens for g in groups]
        q_parts, k_parts, v_parts = (t.split(sizes) for t in (q_dist, k_dist, v_dist))
    else:  # one group (or none: then nothing is gathered)
        q_parts, k_parts, v_parts = ((t,) if groups else () for t in (q_dist, k_dist, v_dist))
    # Every gather starts before any attention runs (and so, in the backward, every
    # reduce-scatter is waited only after all attention backwards).
    pending = [
        gather_distributed_kv(k_g, v_g, g)
        for g, k_g, v_g in zip(groups, k_parts, v_parts, strict=True)
    ]
    outs = []
    kwargs = {"scale": scale, "window": window, **({"sink": sink} if sink is not None else {})}
    if n_local:
        outs.append(local_attention(q_local, k_local, v_local, ctx, **kwargs))
    for g, q_g, gather in zip(groups, q_parts, pending, strict=True):
        assert gather is not None  # a group has a distributed sequence
        k_whole, v_whole = gather.wait()
        if g.layout.distributed_chunks:
            outs.append(distributed_attention(q_g, k_whole, v_whole, g, **kwargs))
        else:
            # No query here, but the gathered K/V must stay in the graph so that this rank's
            # backward joins the other ranks' reduce-scatter.
            outs.append(q.new_zeros((0, *q.shape[1:])) + 0 * (k_whole.sum() + v_whole.sum()))
    if not outs:  # no token on this rank: an empty output that stays in the graph
        return q[:0] * 0
    return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]
