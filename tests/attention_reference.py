"""Independent attention references and emulated ranks shared by the attention and model tests.

- whole-sequence references: plain causal SDPA (:func:`sdpa_reference`), with transformers'
  sliding-window mask (:func:`window_reference`), with attention sinks as transformers' eager
  gpt-oss attention (:func:`sink_reference`), and FlashAttention-2's documented varlen
  semantics in plain PyTorch (:func:`varlen_reference`);
- ranks emulated in one process (:func:`emulate_ranks`): each rank's local and distributed parts
  of a backend, the distributed part attending the whole sequences' K/V (what the all-gather
  delivers);
- random and fixed layouts (:func:`random_case`, :func:`random_seqs`, :func:`dispatch_case`), and
  a CP-1 call of the registered attention function with its gradients
  (:func:`through_attention_function`).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from lightning_skrull.attention import (
    SkrullAttentionContext,
    attention_context,
    pack,
    skrull_attention_forward,
    unpack,
)
from lightning_skrull.attention.context import _index_tensors
from lightning_skrull.attention.layout import RankLayout
from lightning_skrull.scheduling.plan import DISTRIBUTED

HEAD_DIM = 8


def sdpa_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Plain causal SDPA on one whole sequence, K/V heads repeated for GQA: ``[L, H, D]``."""
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(groups, dim=1).transpose(0, 1),
        v.repeat_interleave(groups, dim=1).transpose(0, 1),
        is_causal=True,
        scale=scale,
    ).transpose(0, 1)


def hf_window_mask(length: int, window: int) -> torch.Tensor:
    """transformers' own sliding-window causal mask of one sequence, ``[L, L]`` bool."""
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    mask = sdpa_mask(
        batch_size=1,
        q_length=length,
        kv_length=length,
        mask_function=sliding_window_causal_mask_function(window),
        allow_is_causal_skip=False,
    )
    return mask[0, 0]


def window_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain SDPA on one whole sequence with transformers' sliding-window mask (``None``: plain
    causal), K/V heads repeated for GQA: ``[L, H, D]``."""
    if window is None:
        return sdpa_reference(q, k, v, scale)
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(groups, dim=1).transpose(0, 1),
        v.repeat_interleave(groups, dim=1).transpose(0, 1),
        attn_mask=hf_window_mask(q.shape[0], window).to(q.device),
        scale=scale,
    ).transpose(0, 1)


def emulated_context(
    layout: RankLayout, backend: str, device: torch.device
) -> SkrullAttentionContext:
    """A context without process group, for calling the backends' parts directly."""
    return SkrullAttentionContext(
        layout=layout,
        group=None,
        backend=backend,
        device=device,
        **_index_tensors(layout, backend, device),
    )


def emulate_ranks(
    module: object,
    layouts: list[RankLayout],
    seqs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    scale: float | None,
    backend: str = "sdpa",
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Each rank's output computed with the backend's local and distributed parts (the
    distributed part attends the whole sequences' K/V, what the all-gather delivers); ``sink``:
    attention sink logits, passed only when given."""
    dist_ids = layouts[0].distributed_sequence_ids
    k_whole = torch.cat([seqs[s][1] for s in dist_ids]) if dist_ids else None
    v_whole = torch.cat([seqs[s][2] for s in dist_ids]) if dist_ids else None
    outs = []
    for layout in layouts:
        device = next(iter(seqs.values()))[0].device
        ctx = emulated_context(layout, backend, device)
        q, k, v = (pack(layout, {s: t[i] for s, t in seqs.items()}) for i in range(3))
        n = layout.num_local_tokens
        parts = []
        kw: dict[str, Any] = {"scale": scale, "window": window}
        if sink is not None:
            kw["sink"] = sink
        if n:
            parts.append(module.local_attention(q[:n], k[:n], v[:n], ctx, **kw))
        if layout.distributed_chunks:
            parts.append(module.distributed_attention(q[n:], k_whole, v_whole, ctx, **kw))
        outs.append(torch.cat(parts) if parts else q[:0])
    return outs


def random_case(rng: random.Random, cp_size: int) -> tuple[list[int], list[int], list[int]]:
    lengths = [
        rng.choice([1, 2, 3, 5, 7, 11, 13, 2 * cp_size - 1, rng.randint(1, 70)]) for _ in range(6)
    ]
    ids = rng.sample(range(6), rng.randint(1, 6))
    placement = [rng.choice([DISTRIBUTED, *range(cp_size)]) for _ in ids]
    return lengths, ids, placement


def random_seqs(
    lengths: list[int],
    ids: list[int],
    hq: int,
    hkv: int,
    dtype: torch.dtype,
    device: str = "cpu",
    head_dim: int = HEAD_DIM,
) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(sum(lengths) * 31 + hq * 7 + hkv)
    return {
        s: tuple(
            torch.randn(lengths[s], h, head_dim, generator=gen, dtype=torch.float64).to(
                device, dtype
            )
            for h in (hq, hkv, hkv)
        )
        for s in ids
    }


def dispatch_case(only_local: bool) -> tuple[list[int], list[int], list[int]]:
    """``(lengths, ids, placement)`` of CP 1 through the attention function: local sequences
    that group in a masked call, one alone, three of one length (batched), and, unless
    ``only_local``, four distributed ones."""
    lengths = [6, 1, 9, 4, 40, 40, 40, 3, 2, 70]
    ids = list(range(len(lengths)))
    placement = [0] * len(ids) if only_local else [0, DISTRIBUTED, DISTRIBUTED, 0, 0, 0, 0, 0,
                                                   DISTRIBUTED, DISTRIBUTED]  # fmt: skip
    return lengths, ids, placement


def varlen_reference(bottom_right: bool = True):
    """``flash_attn_varlen_func`` as flash-attn documents it, in plain PyTorch (any device).

    Segment ``i`` is queries ``q[cu_q[i]:cu_q[i+1]]`` against keys ``k[cu_k[i]:cu_k[i+1]]``;
    with ``causal=True`` and ``seqlen_q < seqlen_k`` the mask is aligned to the bottom right
    (flash-attn >= 2.1): query ``j`` sees keys ``0 .. j + seqlen_k - seqlen_q``. GQA shares
    each K/V head among ``Hq / Hkv`` query heads. It also checks what the kernel requires of
    its arguments (int32 offsets on the tensors' device, ``max_seqlen`` covering every segment),
    which a wrong call would violate silently on a GPU. ``bottom_right=False`` gives the
    top-left alignment of older flash-attn, to show the tests notice the difference.
    ``window_size=(left, right)`` (flash-attn >= 2.3): query ``j`` also sees no key before
    ``j + seqlen_k - seqlen_q - left`` (``left = -1``: no limit; causal needs ``right`` 0 or -1).
    """

    def varlen(
        q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
        window_size=(-1, -1),
    ):  # fmt: skip
        for cu, rows in ((cu_seqlens_q, q.shape[0]), (cu_seqlens_k, k.shape[0])):
            assert cu.dtype == torch.int32 and cu.device == q.device
            assert cu[0].item() == 0 and cu[-1].item() == rows
            assert bool((cu[1:] >= cu[:-1]).all())
        assert cu_seqlens_q.numel() == cu_seqlens_k.numel()
        assert max_seqlen_q >= int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        assert max_seqlen_k >= int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())
        assert causal and q.shape[1] % k.shape[1] == 0
        groups = q.shape[1] // k.shape[1]
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        outs = []
        for i in range(cu_seqlens_q.numel() - 1):
            qs = q[int(cu_seqlens_q[i]) : int(cu_seqlens_q[i + 1])]
            ks = k[int(cu_seqlens_k[i]) : int(cu_seqlens_k[i + 1])].repeat_interleave(groups, 1)
            vs = v[int(cu_seqlens_k[i]) : int(cu_seqlens_k[i + 1])].repeat_interleave(groups, 1)
            lq, lk = qs.shape[0], ks.shape[0]
            scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
            offset = lk - lq if bottom_right else 0
            rows = torch.arange(lq).unsqueeze(1)
            cols = torch.arange(lk).unsqueeze(0)
            scores = scores.masked_fill(cols > rows + offset, float("-inf"))
            assert window_size[1] in (-1, 0)
            if window_size[0] >= 0:
                scores = scores.masked_fill(cols < rows + offset - window_size[0], float("-inf"))
            outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
        return torch.cat(outs)

    return varlen


def sink_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink: torch.Tensor,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """transformers' eager gpt-oss attention on one whole sequence: ``[L, Hq, Dv]``.

    Scores by hand, the causal (and window) mask, the sink logit appended as a last column,
    the softmax over keys and sink, the sink's column dropped, then the values.
    """
    length, hq, dim = q.shape
    groups = hq // k.shape[1]
    kr, vr = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kr) * (dim**-0.5 if scale is None else scale)
    rows, cols = torch.arange(length).unsqueeze(1), torch.arange(length).unsqueeze(0)
    allowed = cols <= rows
    if window is not None:
        allowed &= rows - cols < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    logits = torch.cat([scores, sink.reshape(hq, 1, 1).expand(hq, length, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, vr)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionCall:
    """One CP-1 call of the registered attention function on packed sequences, unpacked per
    sequence id."""

    out: dict[int, torch.Tensor]
    """Each sequence's output ``[L, Hq, Dv]``."""
    grads: dict[str, dict[int, torch.Tensor]]
    """``"q"``, ``"k"``, ``"v"``: each sequence's gradient of that input."""
    grad_out: dict[int, torch.Tensor]
    """Each sequence's part of the random upstream gradient the backward ran with."""
    shape: tuple[int, ...]
    """The packed output's shape, ``(1, tokens, Hq, Dv)``."""
    weights: Any
    """The attention weights the function returned (``None``: it returns none)."""


def through_attention_function(
    layout: RankLayout, seqs: dict[int, tuple[torch.Tensor, ...]], **kwargs: Any
) -> AttentionCall:
    """``skrull_attention_forward`` on ``seqs`` packed by ``layout`` (CP 1, no process group),
    as transformers calls it (``[1, H, T, D]`` inputs, ``kwargs`` such as ``scaling`` or
    ``sliding_window``), then its backward from a random gradient."""
    q, k, v = (pack(layout, {s: t[i] for s, t in seqs.items()}).requires_grad_() for i in range(3))
    with attention_context(SkrullAttentionContext.build(layout)):
        out, weights = skrull_attention_forward(
            None, *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), None, **kwargs
        )
    grad_out = torch.randn_like(out[0])
    out[0].backward(grad_out)
    return AttentionCall(
        out=unpack([layout], [out[0].detach()]),
        grads={n: unpack([layout], [t.grad]) for n, t in (("q", q), ("k", k), ("v", v))},
        grad_out=unpack([layout], [grad_out]),
        shape=tuple(out.shape),
        weights=weights,
    )


def check_call(
    call: AttentionCall,
    seqs: dict[int, tuple[torch.Tensor, ...]],
    reference: Callable[..., torch.Tensor],
    tol: float,
    *label: Any,
) -> None:
    """Each sequence of ``call`` against ``reference(q, k, v)`` of that whole sequence: the
    output and the q, k and v gradients (from the same upstream gradient) within ``tol``;
    ``label`` names the case in a failure."""
    for s, got in call.out.items():
        ref_in = [t.detach().clone().requires_grad_() for t in seqs[s]]
        ref = reference(*ref_in)
        ref.backward(call.grad_out[s])
        assert (got - ref.detach()).abs().max().item() < tol, (*label, s)
        for name, t in zip("qkv", ref_in, strict=True):
            assert (call.grads[name][s] - t.grad).abs().max().item() < tol, (*label, s, name)
