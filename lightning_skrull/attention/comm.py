"""Autograd K/V exchange of the distributed sequences over the CP group.

The distributed sequences of a micro-batch are exchanged in one or more K/V groups
(``MicroBatchPlan.kv_groups``; one group unless the plan cuts them,
:attr:`SkrullAttentionContext.kv_group_contexts` otherwise). One group's exchange is two
autograd nodes sharing a small state object:

* **start** (:func:`gather_distributed_kv`): every CP rank lays its rows of the group's K and V
  side by side (``[n, Hkv, D + Dv]``, in their shared dtype: the attention's compute dtype; the
  value head dim ``Dv`` may differ from the key's ``D``, as in Multi-head Latent Attention),
  pads them to the largest rank's rows (ranks hold ``floor`` or ``ceil`` shares) and starts one
  ``all_gather_single`` with ``async_op=True``. The node's output is an
  empty "token" tensor; its backward waits for the group's reduce-scatter and hands this rank's
  K and V gradient rows back.
* **finish** (:meth:`PendingKV.wait`): takes the token, waits for the all-gather and returns the
  whole sequences of the group laid end to end (``layout.gather_index`` reorders the gathered
  rows). Its backward scatters the whole sequences' gradients back to their gathered rows (pad
  rows get zero), **starts** one ``reduce_scatter_single`` with ``async_op=True`` that sums every
  rank's contribution onto the owning rank, and returns at once (a zero gradient for the token).

``torch.distributed.nn.functional.all_gather`` is not used: on gloo its backward gives wrong
gradients (it reduces into a non-contiguous tensor). gloo supports ``reduce_scatter`` of a
single tensor in this torch (also asynchronously), so no all-reduce fallback is needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_skrull.attention.context import SkrullAttentionContext

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from lightning_skrull.attention.layout import RankLayout


def _all_gather(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup) -> Any:
    """Start the all-gather of ``input`` into ``output``; returns its work handle."""
    fn = getattr(dist, "all_gather_single", None)  # newer name of all_gather_into_tensor
    if fn is None:  # pragma: no cover - older torch
        fn = dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=True)


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup) -> Any:
    """Start the summing reduce-scatter of ``input`` into ``output``; returns its work handle."""
    fn = getattr(dist, "reduce_scatter_single", None)  # newer name of reduce_scatter_tensor
    if fn is None:  # pragma: no cover - older torch
        fn = dist.reduce_scatter_tensor
    return fn(output, input, op=dist.ReduceOp.SUM, group=group, async_op=True)


class _Exchange:
    """What one group's start and finish nodes share: the backward reduce-scatter in flight.

    Attributes:
        work: the reduce-scatter's work handle (``None`` before it starts, and without a
            process group, where the gradient needs no communication).
        grad_gathered: the reduce-scatter's input, kept alive until it is waited.
        grad_mine: this rank's rows of the summed gradient (the reduce-scatter's output).
    """

    def __init__(self) -> None:
        self.work: Any = None
        self.grad_gathered: torch.Tensor | None = None
        self.grad_mine: torch.Tensor | None = None

    def finish(self) -> torch.Tensor | None:
        """Wait for the reduce-scatter and release it: this rank's rows, ``None`` if none came."""
        if self.work is not None:
            self.work.wait()
        mine = self.grad_mine
        self.work = self.grad_gathered = self.grad_mine = None
        return mine


class _StartGather(torch.autograd.Function):
    """Created when the all-gather starts; backward waits for the reduce-scatter."""

    @staticmethod
    def forward(  # type: ignore[override]
        fctx: Any, k: torch.Tensor, v: torch.Tensor, exchange: _Exchange
    ) -> torch.Tensor:
        fctx.exchange = exchange
        fctx.num_rows = k.shape[0]
        fctx.key_dim = k.shape[-1]
        return k.new_empty(0)  # the token: links this node to the finish node

    @staticmethod
    def backward(  # type: ignore[override]
        fctx: Any, grad_token: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        mine = fctx.exchange.finish()
        if mine is None:
            return None, None, None
        n, d = fctx.num_rows, fctx.key_dim
        return mine[:n, :, :d], mine[:n, :, d:], None


class _FinishGather(torch.autograd.Function):
    """Waits for the all-gather; backward starts the reduce-scatter of the gradients."""

    @staticmethod
    def forward(  # type: ignore[override]
        fctx: Any,
        token: torch.Tensor,
        gathered: torch.Tensor,
        work: Any,
        gather_index: torch.Tensor,
        group: ProcessGroup | None,
        exchange: _Exchange,
        key_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if work is not None:
            work.wait()
        fctx.group = group
        fctx.exchange = exchange
        fctx.key_dim = key_dim
        fctx.width = gathered.shape[0] // (dist.get_world_size(group) if group is not None else 1)
        fctx.gathered_shape = gathered.shape
        fctx.save_for_backward(gather_index)
        k_whole = gathered[..., :key_dim].index_select(0, gather_index)
        v_whole = gathered[..., key_dim:].index_select(0, gather_index)
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
        d = fctx.key_dim
        # gather_index hits every non-pad row exactly once: a copy, not an accumulation.
        if grad_k is not None:
            grad_gathered[..., :d].index_copy_(0, gather_index, grad_k.contiguous())
        if grad_v is not None:
            grad_gathered[..., d:].index_copy_(0, gather_index, grad_v.contiguous())
        exchange = fctx.exchange
        if fctx.group is None:
            exchange.grad_mine = grad_gathered
        else:
            mine = ref.new_empty((fctx.width, *shape[1:]))
            exchange.work = _reduce_scatter(mine, grad_gathered, fctx.group)
            exchange.grad_gathered, exchange.grad_mine = grad_gathered, mine
        return ref.new_zeros(0), None, None, None, None, None, None


class PendingKV:
    """An all-gather of K/V in flight; :meth:`wait` returns the whole distributed sequences."""

    def __init__(
        self,
        token: torch.Tensor,
        gathered: torch.Tensor,
        work: Any,
        ctx: SkrullAttentionContext,
        exchange: _Exchange,
        key_dim: int,
    ) -> None:
        # The arguments of the finish node; dropped once it has run.
        self._args: tuple[object, ...] = (
            token,
            gathered,
            work,
            ctx.gather_index,
            ctx.group,
            exchange,
            key_dim,
        )
        self._done = False

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for the all-gather.

        Returns:
            ``(k_whole [sum of distributed lengths, Hkv, D], v_whole [..., Hkv, Dv])``: the
            distributed sequences in plan order, laid end to end (offsets in
            ``layout.distributed_cu_seqlens``), differentiable back to every owning rank.

        Raises:
            RuntimeError: called twice.
        """
        if self._done:
            raise RuntimeError("PendingKV.wait() was already called; call it once per gather.")
        self._done = True
        out = _FinishGather.apply(*self._args)
        self._args = ()
        return out


def check_one_dtype(**tensors: torch.Tensor) -> None:
    """Refuse tensors of different dtypes: stacking K and V would promote the exchange."""
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        got = ", ".join(f"{name} {dtype}" for name, dtype in dtypes.items())
        raise TypeError(
            f"the context-parallel attention needs one dtype for its inputs, got {got}; cast "
            "them to the compute dtype first (skrull_attention_forward does, see compute_dtype)."
        )


def check_distributed_part(k_dist: torch.Tensor, v_dist: torch.Tensor, layout: RankLayout) -> None:
    n = layout.num_distributed_tokens
    if k_dist.shape[0] != n or v_dist.shape[:-1] != k_dist.shape[:-1]:
        raise ValueError(
            f"distributed K/V have shapes {tuple(k_dist.shape)} and {tuple(v_dist.shape)} but CP "
            f"rank {layout.cp_rank} holds {n} distributed tokens; the packed input does not match "
            "the attention context's layout (build both from the same plan)."
        )


def gather_distributed_kv(
    k_dist: torch.Tensor, v_dist: torch.Tensor, ctx: SkrullAttentionContext
) -> PendingKV | None:
    """Start the all-gather of this rank's distributed part of K and V.

    Every CP rank of the micro-batch must call it (also a rank that holds no token of the
    distributed sequences): it is a collective whenever the micro-batch has a distributed
    sequence. Without one it returns ``None`` and communicates nothing; every rank agrees,
    since all know the plan. ``ctx`` may be a K/V group's context
    (:attr:`SkrullAttentionContext.kv_group_contexts`): then it gathers that group only.

    K and V travel (and their gradients come back) in their own dtype, which they must share.

    Args:
        k_dist: ``[n, Hkv, D]`` keys of this rank's distributed part (``n`` =
            ``layout.num_distributed_tokens``).
        v_dist: ``[n, Hkv, Dv]`` values, same rows, heads and dtype (``Dv`` may differ from
            ``D``).
        ctx: the micro-batch's (or K/V group's) attention context.

    Returns:
        A :class:`PendingKV`, or ``None`` when nothing is distributed.

    Raises:
        ValueError: ``k_dist`` / ``v_dist`` do not match the layout.
        TypeError: ``k_dist`` and ``v_dist`` have different dtypes.
    """
    layout = ctx.layout
    if not layout.has_distributed:
        return None
    check_one_dtype(key=k_dist, value=v_dist)
    check_distributed_part(k_dist, v_dist, layout)
    n = layout.num_distributed_tokens
    width = layout.max_distributed_tokens
    heads, key_dim = k_dist.shape[1], k_dist.shape[2]
    row = (heads, key_dim + v_dist.shape[2])
    send = k_dist.new_zeros((width, *row))
    send[:n, :, :key_dim] = k_dist.detach()
    send[:n, :, key_dim:] = v_dist.detach()
    exchange = _Exchange()
    if ctx.group is None:
        gathered, work = send, None
    else:
        gathered = send.new_empty((layout.cp_size * width, *row))
        work = _all_gather(gathered, send, ctx.group)
    token = _StartGather.apply(k_dist, v_dist, exchange)
    return PendingKV(token, gathered, work, ctx, exchange, key_dim)


def kv_group_contexts(ctx: SkrullAttentionContext) -> tuple[SkrullAttentionContext, ...]:
    """The contexts of the micro-batch's K/V groups: ``(ctx,)`` for one group, ``()`` for none."""
    if not ctx.layout.has_distributed:
        return ()
    return ctx.kv_group_contexts or (ctx,)


def distributed_kv_bytes(
    ctx: SkrullAttentionContext,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    value_head_dim: int | None = None,
) -> int:
    """Bytes this rank receives per layer in the forward all-gathers (the backward
    reduce-scatters send the same amount); 0 without distributed sequences. ``dtype`` is the
    attention's compute dtype (:func:`~lightning_skrull.attention.dispatch.compute_dtype`).

    Each K/V group's gather is padded to that group's largest rank part, so the sum over groups
    of ``(N - 1) x max_r(n_r)`` rows (never fewer than one group's padding). A row holds a key
    of ``head_dim`` and a value of ``value_head_dim`` (default: ``head_dim``) per K/V head.
    """
    layout = ctx.layout
    if layout.cp_size == 1:
        return 0
    rows = sum(
        (layout.cp_size - 1) * g.layout.max_distributed_tokens for g in kv_group_contexts(ctx)
    )
    width = head_dim + (head_dim if value_head_dim is None else value_head_dim)
    return rows * num_kv_heads * width * torch.empty((), dtype=dtype).element_size()
