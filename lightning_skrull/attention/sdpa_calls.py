"""SDPA calls of one sequence's queries against its keys: the pieces of the ``sdpa`` backend.

Each function here runs the queries of one sequence (or of a group of local sequences under one
mask, :mod:`~lightning_skrull.attention.sdpa`) in as few SDPA calls as keep every mask bounded.

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

The values may be narrower than the queries and keys (``Dv < D``, as in Multi-head Latent
Attention, :mod:`~lightning_skrull.models.families.mla`): every function here returns ``Dv``
columns (the ``D`` in the shapes below is the key's, the output's is ``Dv``). On CUDA SDPA's
memory-efficient kernel accepts such values as they are (not yet run on a GPU). On CPU only the
math kernel does, and it keeps the whole score matrix for backward, so the values are padded
with zero columns to ``D`` and the output cropped back (:func:`sdpa_heads_first`): the fused
kernel then runs, and the padded columns, weighted sums of zeros with zero gradients, change
nothing.

Attention sinks (gpt-oss's, :mod:`~lightning_skrull.models.families.sinks`): a layer's per-head
logit ``sink_h`` joins the softmax of every query
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

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from lightning_skrull.attention.schedule import crop_value, pad_value

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
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [L, Hq, D]``, ``k, v [S, Hkv, D]`` -> ``[L, Hq, D]``."""
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = sdpa_heads_first(q4, k4, v4, scale=scale, is_causal=is_causal, mask=mask, sink=sink)
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


def sdpa_heads_first(
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


__all__ = [
    "CUDA_SDPA_KERNELS",
    "MASK_ELEMENTS_PER_CALL",
    "causal_lower_right_attention",
    "sdpa_heads_first",
    "sliding_window_attention",
    "window_rows",
]
