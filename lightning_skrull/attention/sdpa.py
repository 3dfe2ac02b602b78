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

Sliding windows: a layer with ``sliding_window=W`` lets the query at position ``p`` of a sequence
see keys ``[p - W + 1, p]`` (transformers' ``sliding_window_causal_mask_function``). Where no
query of a call reaches ``W`` keys back (a sequence, or a chunk ending, within ``W`` tokens)
the call is the causal one above, unchanged. Otherwise a masked group gets the window in its
block-diagonal mask, and a longer sequence or chunk runs in query blocks like the distributed
chunks' (:func:`sliding_window_attention`): block ``[a, a + b)`` attends only keys
``[a - W + 1, a + b)``, so the keys outside every query's window are skipped and each mask has
at most ``b x (b + W - 1)`` elements, within :data:`MASK_ELEMENTS_PER_CALL`.

GQA uses ``enable_gqa=True``: K/V are not repeated by this code (the fused kernels read shared
heads directly; the math fallback repeats internally).

The values may be narrower than the queries and keys (Multi-head Latent Attention, DeepSeek-V3:
``D = 192``, ``Dv = 128``): every function here returns ``Dv`` columns (the ``D`` in the shapes
below is the key's, the output's is ``Dv``). On CUDA SDPA's memory-efficient kernel accepts
such values as they are (not yet run on a GPU). On CPU only the math kernel does, and it keeps the whole score matrix for
backward, so the values are padded with zero columns to ``D`` and the output cropped back
(:func:`_sdpa_heads_first`): the fused kernel then runs, and the padded columns, weighted sums
of zeros with zero gradients, change nothing.

Attention sinks (gpt-oss): a layer's per-head logit ``sink_h`` joins the softmax of every query
of head ``h`` as a key whose value is zero, so the output is the attention over the real keys
times ``sigmoid(lse - sink_h)`` (``lse`` the log-sum-exp of the query's scores). Each SDPA call
here holds all the keys of its queries, so the sink is added to each call as one more key, in
front of the real ones (:func:`_with_sink_key`): the queries get one more column,
``sink_h / scale``, the keys a zero column and, in front, a key that is zero but for a 1 in
that column, the values a zero row. Its score is ``sink_h`` for every query of head ``h``,
every query sees it (each mask gets a leading ``True`` column; a lower-right causal call over
``L`` queries and ``S`` keys becomes one over ``S + 1`` keys, which sees the new first key from
every row), and autograd gives the gradients of q, k, v and the sink exactly (the sink's summed
over this rank's queries; the strategies reduce it over the ranks as any other parameter's).
A call that would run ``is_causal=True`` on a sequence too long for one mask runs in the query
blocks of a lower-right call instead, so no mask outgrows :data:`MASK_ELEMENTS_PER_CALL`.

On CUDA, SDPA is restricted to its flash, memory-efficient and math kernels. PyTorch prefers
cuDNN's kernel on Hopper, which builds an execution plan for every new shape: with the many
different sequence lengths of a packed batch that cost 7.3 s per layer (forward + backward) on
an H200 for a Wikipedia-like global batch whose kernels then run in 28 ms (docs/benchmarks.md).
Masked calls there repeat K/V for GQA: the memory-efficient kernel takes a mask but not GQA, the
flash kernel GQA but not a mask, and the math kernel, which takes both, keeps the scores.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from lightning_skrull.attention.context import SkrullAttentionContext
from lightning_skrull.attention.schedule import context_parallel_attention, crop_value, pad_value

MASK_ELEMENTS_PER_CALL = 1 << 22
"""Largest boolean mask (elements) one SDPA call of a distributed chunk builds (4 MiB)."""

LOCAL_GROUP_MASK_ELEMENTS = 1 << 12
"""Largest block-diagonal mask (elements, a group's tokens squared) of one SDPA call over a
group of local sequences: groups of up to 64 tokens. Read at each call; ``0`` (with
:data:`LOCAL_BATCH_EQUAL_LENGTHS` off) runs every local sequence in its own call."""

LOCAL_BATCH_EQUAL_LENGTHS = True
"""Whether a run of consecutive local sequences of one length, too long for one masked group,
is one batched causal SDPA call (:func:`plan_local_calls`). Read at each call."""


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
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [L, Hq, D]``, ``k, v [S, Hkv, D]`` -> ``[L, Hq, D]``."""
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = _sdpa_heads_first(q4, k4, v4, scale=scale, is_causal=is_causal, mask=mask, sink=sink)
    return out.squeeze(0).transpose(0, 1)


def _with_sink_key(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink: torch.Tensor,
    *,
    scale: float,
    is_causal: bool,
    mask: torch.Tensor | CausalBias | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | CausalBias | None]:
    """q, k, v and the mask of one SDPA call with the sink as a key in front of the real ones.

    ``q [..., Hq, L, D]`` gets the column ``sink / scale`` (zero-padded to a multiple of 8
    columns on CUDA, whose fused kernels want one), ``k [..., Hkv, S, D]`` zero columns and the
    sink key (a 1 in the sink column, zeros elsewhere), ``v`` a zero row in front: the sink
    key's score is ``sink_h`` for head ``h``, its value zero. The mask sees the sink key from
    every query (see the module docstring); ``is_causal`` (``L == S``) becomes a lower-right
    causal mask over ``S + 1`` keys.
    """
    num_q, num_k, dim = q.shape[-2], k.shape[-2], q.shape[-1]
    extra = 1 if not q.is_cuda else 8 - dim % 8
    column = (sink / scale).to(q.dtype).reshape(-1, 1, 1).expand(*q.shape[:-1], 1)
    q = F.pad(torch.cat([q, column], dim=-1), (0, extra - 1))
    key = k.new_zeros((*k.shape[:-2], 1, dim + extra))
    key[..., dim] = 1
    k = torch.cat([key, F.pad(k, (0, extra))], dim=-2)
    v = F.pad(v, (0, 0, 1, 0))
    if isinstance(mask, CausalBias):  # lower-right causal over S keys -> over S + 1
        return q, k, v, causal_lower_right(num_q, num_k + 1)
    if isinstance(mask, torch.Tensor):
        return q, k, v, F.pad(mask, (1, 0), value=True)
    if not is_causal:
        return q, k, v, None
    if _lower_right_bias(q):
        return q, k, v, causal_lower_right(num_q, num_k + 1)
    rows = torch.arange(num_q, device=q.device).unsqueeze(1)
    cols = torch.arange(num_k + 1, device=q.device).unsqueeze(0)
    return q, k, v, cols <= rows + 1


def _sdpa_heads_first(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None,
    is_causal: bool = False,
    mask: torch.Tensor | CausalBias | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA on ``q [..., Hq, L, D]``, ``k, v [..., Hkv, S, Dv]`` (GQA allowed) -> ``[..., Hq, L, Dv]``.

    With ``sink`` (``[Hq]`` logits), the sink is a key of the call (:func:`_with_sink_key`).
    """
    width = v.shape[-1]
    if sink is not None:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        q, k, v, mask = _with_sink_key(q, k, v, sink, scale=scale, is_causal=is_causal, mask=mask)
        is_causal = False
    gqa = q.shape[-3] != k.shape[-3]
    restrict = _restrict_kernels(q)
    if restrict and gqa and mask is not None:
        groups = q.shape[-3] // k.shape[-3]
        k, v, gqa = k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3), False
    if not q.is_cuda:
        v = pad_value(v, q.shape[-1])  # CPU's fused kernel takes one head dim
    with sdpa_kernel(list(CUDA_SDPA_KERNELS)) if restrict else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa
        )
    return crop_value(out, width)


def causal_lower_right_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    mask_elements: int = MASK_ELEMENTS_PER_CALL,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the last ``L`` positions of a sequence against its first ``S``.

    Args:
        q: ``[L, Hq, D]`` queries at positions ``S - L .. S - 1``.
        k: ``[S, Hkv, D]`` keys at positions ``0 .. S - 1`` (``S >= L``).
        v: ``[S, Hkv, D]`` values.
        scale: softmax scale; ``None`` = ``D ** -0.5``.
        mask_elements: largest mask one SDPA call may build.
        sink: attention sink logits ``[Hq]``, or ``None`` (module docstring).

    Returns:
        ``[L, Hq, D]``.
    """
    num_q, num_k = q.shape[0], k.shape[0]
    offset = num_k - num_q
    # with a sink, a square call needs a mask (the sink key): one call while it fits
    if offset == 0 and (sink is None or num_q * (num_k + 1) <= mask_elements):
        return _sdpa(q, k, v, scale=scale, is_causal=True, sink=sink)
    if _lower_right_bias(q):
        return _sdpa(q, k, v, scale=scale, mask=causal_lower_right(num_q, num_k), sink=sink)
    block = max(1, mask_elements // num_k)
    outs = []
    for a in range(0, num_q, block):
        b = min(block, num_q - a)
        keys = offset + a + b  # the block's last query sees key offset + a + b - 1
        rows = torch.arange(offset + a, offset + a + b, device=q.device).unsqueeze(1)
        cols = torch.arange(keys, device=q.device).unsqueeze(0)
        mask = cols <= rows
        outs.append(_sdpa(q[a : a + b], k[:keys], v[:keys], scale=scale, mask=mask, sink=sink))
    return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]


def window_rows(num_keys: int, window: int, mask_elements: int) -> int:
    """Query rows per SDPA call of :func:`sliding_window_attention`.

    The largest ``b`` whose mask, ``b`` rows by at most ``min(num_keys, b + window - 1)``
    keys, fits ``mask_elements`` (at least 1).
    """
    if num_keys * num_keys <= mask_elements:
        return num_keys
    w = window - 1
    rows = (math.isqrt(w * w + 4 * mask_elements) - w) // 2  # b * (b + w) <= mask_elements
    return max(1, rows, mask_elements // num_keys)


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    scale: float | None = None,
    mask_elements: int = MASK_ELEMENTS_PER_CALL,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sliding-window causal attention of the last ``L`` positions of a sequence against its
    first ``S``: the query at position ``p`` sees keys ``[max(0, p - window + 1), p]``.

    Queries run in blocks of :func:`window_rows` rows; each block attends only the keys some
    query of it sees, with a boolean mask built on the fly. Without a query that reaches
    ``window`` keys back (``S <= window``) it is :func:`causal_lower_right_attention`.

    Args:
        q: ``[L, Hq, D]`` queries at positions ``S - L .. S - 1``.
        k: ``[S, Hkv, D]`` keys at positions ``0 .. S - 1`` (``S >= L``).
        v: ``[S, Hkv, D]`` values.
        window: keys each query sees, itself included (``>= 1``).
        scale: softmax scale; ``None`` = ``D ** -0.5``.
        mask_elements: largest mask one SDPA call may build.
        sink: attention sink logits ``[Hq]``, or ``None`` (module docstring); every query sees
            the sink, whatever its window.

    Returns:
        ``[L, Hq, D]``.
    """
    num_q, num_k = q.shape[0], k.shape[0]
    if num_k <= window:
        return causal_lower_right_attention(
            q, k, v, scale=scale, mask_elements=mask_elements, sink=sink
        )
    offset = num_k - num_q
    block = window_rows(num_k, window, mask_elements)
    outs = []
    for a in range(0, num_q, block):
        b = min(block, num_q - a)
        first = offset + a  # position of the block's first query
        lo, hi = max(0, first - window + 1), first + b  # keys the block's queries see
        rows = torch.arange(first, hi, device=q.device).unsqueeze(1)
        cols = torch.arange(lo, hi, device=q.device).unsqueeze(0)
        mask = (cols <= rows) & (cols > rows - window)
        outs.append(_sdpa(q[a : a + b], k[lo:hi], v[lo:hi], scale=scale, mask=mask, sink=sink))
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
        out = _sdpa_heads_first(q, k, v, scale=scale, is_causal=mask is None, mask=mask, sink=sink)
        return out.transpose(1, 2)
    # [1, H, n * L, D] -> [n, H, L, D]: views (a dim split and a transpose), no copy
    shape = (len(call.lengths), call.lengths[0])
    qb, kb, vb = (t.squeeze(0).unflatten(1, shape).transpose(0, 1) for t in (q, k, v))
    out = _sdpa_heads_first(qb, kb, vb, scale=scale, is_causal=True)  # [n, Hq, L, D]
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
        sink: the layer's attention sink logits ``[Hq]``, or ``None`` (module docstring).

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
        sink: the layer's attention sink logits ``[Hq]``, or ``None`` (module docstring).

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
        sink: the layer's attention sink logits ``[Hq]`` (gpt-oss), or ``None`` (module
            docstring).

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
