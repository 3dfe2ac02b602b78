"""Autograd all-gather of the distributed sequences' K and V over the CP group.

Forward: every CP rank stacks its distributed part of K and V (``[n, 2, Hkv, D]``), pads it to
the largest rank's part (ranks hold ``floor`` or ``ceil`` shares), and one
``all_gather_into_tensor`` is started with ``async_op=True``; the caller computes the local
sequences while it is in flight and then calls :meth:`PendingKV.wait`, which returns the whole
distributed sequences laid end to end (``layout.gather_index`` reorders the gathered rows).

Backward: the gradients of the whole sequences are scattered back to their gathered rows (pad
rows get zero) and one ``reduce_scatter`` sums every rank's contribution onto the owning rank.
The group, the index and the sizes are saved at forward, so backward needs no context.

``torch.distributed.nn.functional.all_gather`` is not used: on gloo its backward gives wrong
gradients (it reduces into a non-contiguous tensor). gloo supports ``reduce_scatter`` of a
single tensor in this torch, so no all-reduce fallback is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_skrull.attention.context import SkrullAttentionContext

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def _all_gather(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup) -> Any:
    fn = getattr(dist, "all_gather_single", None)  # newer name of all_gather_into_tensor
    if fn is None:  # pragma: no cover - older torch
        fn = dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=True)


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup) -> None:
    fn = getattr(dist, "reduce_scatter_single", None)  # newer name of reduce_scatter_tensor
    if fn is None:  # pragma: no cover - older torch
        fn = dist.reduce_scatter_tensor
    fn(output, input, op=dist.ReduceOp.SUM, group=group)


class _GatheredKV(torch.autograd.Function):
    """Waits for the started all-gather; backward reduce-scatters the gradients."""

    @staticmethod
    def forward(  # type: ignore[override]
        fctx: Any,
        k: torch.Tensor,
        v: torch.Tensor,
        gathered: torch.Tensor,
        work: Any,
        gather_index: torch.Tensor,
        group: ProcessGroup | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if work is not None:
            work.wait()
        fctx.group = group
        fctx.num_rows = k.shape[0]
        fctx.width = gathered.shape[0] // (dist.get_world_size(group) if group is not None else 1)
        fctx.gathered_shape = gathered.shape
        fctx.save_for_backward(gather_index)
        k_whole = gathered[:, 0].index_select(0, gather_index)
        v_whole = gathered[:, 1].index_select(0, gather_index)
        return k_whole, v_whole

    @staticmethod
    def backward(  # type: ignore[override]
        fctx: Any, grad_k: torch.Tensor | None, grad_v: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        (gather_index,) = fctx.saved_tensors
        shape = fctx.gathered_shape
        ref = grad_k if grad_k is not None else grad_v
        assert ref is not None
        grad_gathered = ref.new_zeros(shape)
        # gather_index hits every non-pad row exactly once: a copy, not an accumulation.
        if grad_k is not None:
            grad_gathered[:, 0].index_copy_(0, gather_index, grad_k.contiguous())
        if grad_v is not None:
            grad_gathered[:, 1].index_copy_(0, gather_index, grad_v.contiguous())
        if fctx.group is None:
            mine = grad_gathered
        else:
            mine = ref.new_empty((fctx.width, *shape[1:]))
            _reduce_scatter(mine, grad_gathered, fctx.group)
        n = fctx.num_rows
        return mine[:n, 0], mine[:n, 1], None, None, None, None


class PendingKV:
    """An all-gather of K/V in flight; :meth:`wait` returns the whole distributed sequences."""

    def __init__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        gathered: torch.Tensor,
        work: Any,
        ctx: SkrullAttentionContext,
    ) -> None:
        # The arguments of the gather's autograd function; dropped once it has run.
        self._args: tuple[object, ...] = (k, v, gathered, work, ctx.gather_index, ctx.group)
        self._done = False

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for the all-gather.

        Returns:
            ``(k_whole, v_whole)``, each ``[sum of distributed lengths, Hkv, D]``: the
            distributed sequences in plan order, laid end to end (offsets in
            ``layout.distributed_cu_seqlens``), differentiable back to every owning rank.

        Raises:
            RuntimeError: called twice.
        """
        if self._done:
            raise RuntimeError("PendingKV.wait() was already called; call it once per gather.")
        self._done = True
        out = _GatheredKV.apply(*self._args)
        self._args = ()
        return out


def gather_distributed_kv(
    k_dist: torch.Tensor, v_dist: torch.Tensor, ctx: SkrullAttentionContext
) -> PendingKV | None:
    """Start the all-gather of this rank's distributed part of K and V.

    Every CP rank of the micro-batch must call it (also a rank that holds no token of the
    distributed sequences): it is a collective whenever the micro-batch has a distributed
    sequence. Without one it returns ``None`` and communicates nothing; every rank agrees,
    since all know the plan.

    Args:
        k_dist: ``[n, Hkv, D]`` keys of this rank's distributed part (``n`` =
            ``layout.num_distributed_tokens``).
        v_dist: ``[n, Hkv, D]`` values, same shape.
        ctx: the micro-batch's attention context.

    Returns:
        A :class:`PendingKV`, or ``None`` when nothing is distributed.

    Raises:
        ValueError: ``k_dist`` / ``v_dist`` do not match the layout.
    """
    layout = ctx.layout
    if not layout.has_distributed:
        return None
    n = layout.num_distributed_tokens
    if k_dist.shape[0] != n or v_dist.shape != k_dist.shape:
        raise ValueError(
            f"distributed K/V have shapes {tuple(k_dist.shape)} and {tuple(v_dist.shape)} but CP "
            f"rank {layout.cp_rank} holds {n} distributed tokens; the packed input does not match "
            "the attention context's layout (build both from the same plan)."
        )
    width = layout.max_distributed_tokens
    heads_dim = k_dist.shape[1:]
    send = k_dist.new_zeros((width, 2, *heads_dim))
    send[:n, 0] = k_dist.detach()
    send[:n, 1] = v_dist.detach()
    if ctx.group is None:
        return PendingKV(k_dist, v_dist, send, None, ctx)
    gathered = send.new_empty((layout.cp_size * width, 2, *heads_dim))
    work = _all_gather(gathered, send, ctx.group)
    return PendingKV(k_dist, v_dist, gathered, work, ctx)


def distributed_kv_bytes(
    ctx: SkrullAttentionContext, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes this rank receives per layer in the forward all-gather (the backward
    reduce-scatter sends the same amount); 0 without distributed sequences."""
    layout = ctx.layout
    if not layout.has_distributed or layout.cp_size == 1:
        return 0
    rows = (layout.cp_size - 1) * layout.max_distributed_tokens
    return rows * 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


LocalAttention = Callable[..., torch.Tensor]
"""``fn(q, k, v, ctx, *, scale) -> out`` over the local part (``[n_local, H, D]`` tensors)."""

DistributedAttention = Callable[..., torch.Tensor]
"""``fn(q_dist, k_whole, v_whole, ctx, *, scale) -> out`` over this rank's distributed chunks."""


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
) -> torch.Tensor:
    """The schedule shared by every backend.

    Starts the all-gather of the distributed part's K/V, runs ``local_attention`` on the local
    sequences while it is in flight, waits, then runs ``distributed_attention`` on this rank's
    distributed chunks against the whole gathered sequences. A rank with no distributed query
    still joins the all-gather and, through a zero-weighted term, the backward reduce-scatter.

    Args:
        q: ``[T, Hq, D]`` in this rank's packed order.
        k: ``[T, Hkv, D]``.
        v: ``[T, Hkv, D]``.
        ctx: the micro-batch's attention context.
        scale: softmax scale; ``None`` = ``D ** -0.5``.
        local_attention: the backend's local-sequence attention.
        distributed_attention: the backend's distributed-chunk attention.

    Returns:
        ``[T, Hq, D]`` in packed order.
    """
    n_local = ctx.layout.num_local_tokens
    (q_local, q_dist), (k_local, k_dist), (v_local, v_dist) = (
        _local_and_distributed(t, n_local) for t in (q, k, v)
    )
    pending = gather_distributed_kv(k_dist, v_dist, ctx)
    outs = []
    if n_local:
        outs.append(local_attention(q_local, k_local, v_local, ctx, scale=scale))
    if pending is not None:
        k_whole, v_whole = pending.wait()
        if ctx.layout.distributed_chunks:
            outs.append(distributed_attention(q_dist, k_whole, v_whole, ctx, scale=scale))
        else:
            # No query here, but the gathered K/V must stay in the graph so that this rank's
            # backward joins the other ranks' reduce-scatter.
            outs.append(q.new_zeros((0, *q.shape[1:])) + 0 * (k_whole.sum() + v_whole.sum()))
    if not outs:  # no token on this rank: an empty output that stays in the graph
        return q[:0] * 0
    return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]
