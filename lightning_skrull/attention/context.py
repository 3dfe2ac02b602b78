"""The explicit per-micro-batch attention context.

The engine builds one :class:`SkrullAttentionContext` per micro-batch from this rank's
:class:`~lightning_skrull.attention.layout.RankLayout` and sets it around the model's forward
(and backward, which needs nothing from it) with :func:`attention_context`. The registered
attention function reads it with :func:`current_attention_context`. A context variable is the
only per-batch state; nothing else is global.

Example::

    layout = build_rank_layout(
        mb.sequence_ids, mb.placement, lengths, cp_rank=r, cp_size=n, kv_groups=mb.kv_groups
    )
    ctx = SkrullAttentionContext.build(layout, group=cp_group, backend="auto", device=device)
    with attention_context(ctx):
        loss = model(**batch).loss
    loss.backward()
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from lightning_skrull.attention.backends import resolve_backend
from lightning_skrull.attention.layout import RankLayout

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_T = TypeVar("_T")


@dataclass(frozen=True)
class SkrullAttentionContext:
    """This rank's layout of one micro-batch as device tensors, its CP group and its backend.

    Build it with :meth:`build`. Attributes:
        layout: the rank's :class:`RankLayout` (plain data).
        group: the CP process group, ``None`` when ``cp_size == 1``.
        backend: ``"sdpa"`` or ``"flash"``.
        device: device of the index tensors (that of the activations).
        local_cu_seqlens: int32 ``[num_local + 1]`` offsets of the local sequences.
        gather_index: int64 rows of the all-gathered buffer that give the whole distributed
            sequences laid end to end (empty without distributed sequences).
        chunk_cu_seqlens_q: int32 offsets of this rank's distributed chunks inside the
            distributed part of the packed buffer (``[num_chunks + 1]``).
        chunk_cu_seqlens_k: int32 offsets of each chunk's key prefix (``[0, chunk.end)`` of its
            sequence) laid end to end, for varlen kernels.
        chunk_key_index: int64 rows of the whole distributed sequences that form those key
            prefixes; built only for the ``flash`` backend (empty otherwise).
        auto: the backend was chosen by ``"auto"``: a ``flash`` context then runs a float32 or
            float64 compute dtype (which FlashAttention kernels refuse; see
            :func:`~lightning_skrull.attention.dispatch.compute_dtype`) with ``sdpa``.
        kv_group_contexts: with two or more K/V groups (``layout.kv_group_layouts``), one full
            context per group in group order, same group, backend and device: each describes
            the group's distributed sequences alone, so a backend's distributed attention and
            :func:`~lightning_skrull.attention.comm.gather_distributed_kv` run on a group as
            on a whole micro-batch. Empty with one group.

    Data a backend derives from the layout and needs in every layer (the ``sdpa`` backend's
    groups of local sequences and their masks) is built on first use and kept with the context
    by :meth:`cached`, so it is made once per micro-batch, not once per layer.
    """

    layout: RankLayout
    group: ProcessGroup | None
    backend: str
    device: torch.device
    local_cu_seqlens: torch.Tensor
    gather_index: torch.Tensor
    chunk_cu_seqlens_q: torch.Tensor
    chunk_cu_seqlens_k: torch.Tensor
    chunk_key_index: torch.Tensor
    auto: bool = False
    kv_group_contexts: tuple[SkrullAttentionContext, ...] = ()
    _cache: dict[Hashable, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def cached(self, key: Hashable, build: Callable[[], _T]) -> _T:
        """``build()`` on the first call with ``key``, the same object on every later one.

        For per-micro-batch data that every layer's attention shares (index tensors, masks).
        ``key`` must name everything the result depends on besides the layout (a bound, a
        device, a dtype).
        """
        try:
            return self._cache[key]
        except KeyError:
            value = self._cache[key] = build()
            return value

    @classmethod
    def build(
        cls,
        layout: RankLayout,
        *,
        group: ProcessGroup | None = None,
        backend: str = "sdpa",
        device: torch.device | str = "cpu",
    ) -> SkrullAttentionContext:
        """Make the context of one micro-batch.

        Args:
            layout: this rank's layout.
            group: the CP process group (its size must be ``layout.cp_size`` and this process's
                rank in it ``layout.cp_rank``); ``None`` only when ``cp_size == 1``.
            backend: ``"sdpa"``, ``"flash"``, or ``"auto"`` (flash on CUDA when a varlen kernel
                is installed, else sdpa; see :func:`~lightning_skrull.attention.resolve_backend`).
            device: where the activations live.

        Raises:
            ValueError: unknown backend, or a group that does not match the layout.
            TypeError: ``layout`` is not a :class:`RankLayout`.
        """
        if not isinstance(layout, RankLayout):
            raise TypeError(
                f"layout must be a RankLayout, got {type(layout).__name__}; build it with "
                "build_rank_layout(...)."
            )
        device = torch.device(device)
        auto = backend == "auto"
        backend = resolve_backend(backend, device)
        _check_group(layout, group)
        return cls._make(layout, group, backend, device, auto)

    @classmethod
    def _make(
        cls,
        layout: RankLayout,
        group: ProcessGroup | None,
        backend: str,
        device: torch.device,
        auto: bool,
    ) -> SkrullAttentionContext:
        """The context of a checked layout and a resolved backend, with its groups' contexts."""
        return cls(
            layout=layout,
            group=group,
            backend=backend,
            device=device,
            **_index_tensors(layout, backend, device),
            auto=auto,
            kv_group_contexts=tuple(
                cls._make(group_layout, group, backend, device, auto)
                for group_layout in layout.kv_group_layouts
            ),
        )

    @property
    def cp_size(self) -> int:
        """Ranks in the CP group."""
        return self.layout.cp_size

    @property
    def cp_rank(self) -> int:
        """This rank's index in the CP group."""
        return self.layout.cp_rank

    @property
    def num_tokens(self) -> int:
        """Tokens packed on this rank."""
        return self.layout.num_tokens


def _index_tensors(
    layout: RankLayout, backend: str, device: torch.device
) -> dict[str, torch.Tensor]:
    """The device tensors of a context (no process group involved)."""

    def ints(values: list[int] | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device)

    chunks = layout.distributed_chunks
    start = layout.num_local_tokens
    q_cu = [0] + [c.packed_start - start + c.end - c.start for c in chunks]
    k_cu = [0]
    for c in chunks:
        k_cu.append(k_cu[-1] + c.end)
    key_index: list[int] = []
    if backend == "flash":
        for c in chunks:
            first = layout.distributed_cu_seqlens[c.index]
            key_index.extend(range(first, first + c.end))
    return {
        "local_cu_seqlens": ints(layout.local_cu_seqlens, torch.int32),
        "gather_index": ints(layout.gather_index, torch.int64),
        "chunk_cu_seqlens_q": ints(q_cu, torch.int32),
        "chunk_cu_seqlens_k": ints(k_cu, torch.int32),
        "chunk_key_index": ints(key_index, torch.int64),
    }


def _check_group(layout: RankLayout, group: ProcessGroup | None) -> None:
    if group is None:
        if layout.cp_size > 1:
            raise ValueError(
                f"the layout is for cp_size {layout.cp_size} but group is None; pass the CP "
                "process group (torch.distributed.new_group over the CP ranks)."
            )
        return
    import torch.distributed as dist

    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if size != layout.cp_size or rank != layout.cp_rank:
        raise ValueError(
            f"the CP group has size {size} and this process is its rank {rank}, but the layout is "
            f"for cp_rank {layout.cp_rank} of cp_size {layout.cp_size}; build the layout with this "
            "process's rank in the group it is given."
        )


_CURRENT: contextvars.ContextVar[SkrullAttentionContext | None] = contextvars.ContextVar(
    "skrull_attention_context", default=None
)

# Contexts open anywhere in the process, innermost last, with the thread that opened each. On
# CUDA, autograd runs backward, and with it the recomputation of checkpointed layers, on its own
# device thread, which does not see the training loop's context variables; there the open
# context is looked up here instead (only when a single thread has contexts open, so it is
# unambiguous).
_OPEN: list[tuple[int, SkrullAttentionContext]] = []
_OPEN_LOCK = threading.Lock()


@contextmanager
def attention_context(ctx: SkrullAttentionContext) -> Iterator[SkrullAttentionContext]:
    """Make ``ctx`` the current attention context inside the ``with`` block (nestable).

    The context is visible in this thread (a context variable) and, while no other thread has
    a context open, to threads that run this thread's backward (autograd's device threads).

    Raises:
        TypeError: ``ctx`` is not a :class:`SkrullAttentionContext`.
    """
    if not isinstance(ctx, SkrullAttentionContext):
        raise TypeError(
            f"attention_context expects a SkrullAttentionContext, got {type(ctx).__name__}; "
            "build one with SkrullAttentionContext.build(layout, ...)."
        )
    entry = (threading.get_ident(), ctx)
    token = _CURRENT.set(ctx)
    with _OPEN_LOCK:
        _OPEN.append(entry)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)
        with _OPEN_LOCK:
            for i in range(len(_OPEN) - 1, -1, -1):
                if _OPEN[i][0] == entry[0] and _OPEN[i][1] is ctx:
                    del _OPEN[i]
                    break


def has_attention_context() -> bool:
    """Whether this thread is inside an :func:`attention_context` (a micro-batch is running)."""
    return _CURRENT.get() is not None


def current_attention_context() -> SkrullAttentionContext:
    """The context set by this thread's innermost :func:`attention_context`.

    On a thread without one (autograd's device thread running a backward on CUDA), the
    innermost context open in the process, provided a single thread has contexts open.

    Raises:
        RuntimeError: called outside ``attention_context`` (the model ran the ``"skrull"``
            attention without the engine setting this micro-batch's layout), or from a thread
            without one while several threads have one open (ambiguous).
    """
    ctx = _CURRENT.get()
    if ctx is not None:
        return ctx
    with _OPEN_LOCK:
        threads = {ident for ident, _ in _OPEN}
        if len(threads) == 1:  # e.g. autograd's device thread running that thread's backward
            return _OPEN[-1][1]
    if len(threads) > 1:
        raise RuntimeError(
            "the 'skrull' attention ran on a thread without its own attention_context while "
            f"{len(threads)} threads have one open, so it is ambiguous which micro-batch it "
            "belongs to; run each model's forward and backward from one thread at a time."
        )
    raise RuntimeError(
        "the 'skrull' attention ran outside attention_context(...): no micro-batch layout is "
        "set. Run the forward inside `with attention_context(SkrullAttentionContext.build("
        "layout, group=..., device=...)):` (the Skrull engine/strategy does this for you). To "
        "generate or evaluate outside training, run the model inside `with "
        "lightning_skrull.models.plain_attention(model):`, which switches it to transformers' "
        "attention for the block."
    )
