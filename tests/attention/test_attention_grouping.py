"""The ``sdpa`` backend's grouping of short local sequences into few SDPA calls.

Short sequences of mixed lengths share one call with a block-diagonal mask; a run of equal
lengths is one batched causal call.

Parity is checked against plain causal SDPA on each sequence alone, forward and the gradients
of q, k and v, in float64 to 1e-10: the grouped call computes the same terms, the masked-out
keys contribute exact zeros, so only the summation order differs (measured: ~1e-16).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_DECODER

from benchmarks import overhead
from lightning_skrull.attention import (
    SkrullAttentionContext,
    attention_context,
    build_rank_layout,
    pack,
    register_skrull_attention,
    sdpa_attention,
    sdpa_calls,
    unpack,
)
from lightning_skrull.attention import sdpa as sdpa_backend
from lightning_skrull.attention.sdpa import (
    block_causal_mask,
    group_local_lengths,
    local_attention,
    local_calls,
    plan_local_calls,
)

TOL = 1e-10
"""float64, same terms in another summation order (measured ~1e-16)."""


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None):
    """Plain causal SDPA on one sequence, K/V repeated for GQA: ``[L, H, D]``."""
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(groups, 1).transpose(0, 1),
        v.repeat_interleave(groups, 1).transpose(0, 1),
        is_causal=True,
        scale=scale,
    ).transpose(0, 1)


def _local_context(lengths: list[int]) -> SkrullAttentionContext:
    """A cp_size 1 context with every sequence local."""
    ids = list(range(len(lengths)))
    layout = build_rank_layout(ids, [0] * len(ids), lengths, cp_rank=0, cp_size=1)
    return SkrullAttentionContext.build(layout)


# ----------------------------------------------------------------------------- grouping
def test_group_local_lengths() -> None:
    assert group_local_lengths([3, 1, 2], 0) == ((3,), (1,), (2,))  # 0 = one call each
    assert group_local_lengths([], 64) == ()
    # bound 64 = groups of up to 8 tokens; a group that reaches exactly 8 is kept whole
    assert group_local_lengths([1] * 9, 64) == ((1,) * 8, (1,))
    assert group_local_lengths([4, 4, 1], 64) == ((4, 4), (1,))
    assert group_local_lengths([4, 5], 64) == ((4,), (5,))  # 9 tokens: 81 > 64
    # a sequence over the bound alone, its neighbours grouped around it
    assert group_local_lengths([2, 3, 20, 1, 1], 64) == ((2, 3), (20,), (1, 1))
    assert group_local_lengths([9, 9], 64) == ((9,), (9,))
    with pytest.raises(ValueError, match=r"max_mask_elements=-1 is negative"):
        group_local_lengths([1], -1)


def test_block_causal_mask() -> None:
    lengths = [1, 3, 2]
    mask = block_causal_mask(lengths)
    seq = [s for s, n in enumerate(lengths) for _ in range(n)]
    want = torch.tensor(
        [[seq[i] == seq[j] and j <= i for j in range(len(seq))] for i in range(len(seq))]
    )
    assert mask.dtype == torch.bool and torch.equal(mask, want)
    assert bool(mask.any(dim=1).all())  # no fully masked row: every query sees itself


def test_plan_local_calls() -> None:
    def calls(lengths: list[int], bound: int, batch: bool = True) -> list[tuple[int, ...]]:
        # a batched call shown as ("b", length, count)
        return [
            ("b", c.lengths[0], len(c.lengths)) if c.batched else c.lengths
            for c in plan_local_calls(lengths, bound, batch)
        ]

    # a run too long for one masked group (bound 64 = 8 tokens) is one batched call
    assert calls([4, 4, 4], 64) == [("b", 4, 3)]
    assert calls([1, 4, 4, 4, 2, 3], 64) == [(1,), ("b", 4, 3), (2, 3)]
    # a run that fits a group joins the masked grouping with its neighbours
    assert calls([2, 2, 1, 3], 64) == [(2, 2, 1, 3)]
    # equal long sequences (each over the bound alone) are batched too
    assert calls([20, 20, 5], 64) == [("b", 20, 2), (5,)]
    assert calls([20, 5], 64) == [(20,), (5,)]
    # switched off: the plain grouping; bound 0 and no batching: one call per sequence
    assert calls([4, 4, 4], 64, batch=False) == [(4, 4), (4,)]
    assert calls([4, 4, 1], 0, batch=False) == [(4,), (4,), (1,)]
    assert calls([4, 4, 1], 0) == [("b", 4, 2), (1,)]
    assert calls([], 64) == []
    with pytest.raises(ValueError, match=r"max_mask_elements=-1 is negative"):
        plan_local_calls([4, 4], -1)


def test_calls_are_built_once_per_context() -> None:
    ctx = _local_context([2, 1, 3, 40])
    cpu = torch.device("cpu")
    first = local_calls(ctx, 64, cpu)
    assert first is local_calls(ctx, 64, cpu)  # shared by every layer
    assert first.sizes == (6, 40) and first.masks[1] is None
    assert first.masks[0] is not None and torch.equal(first.masks[0], block_causal_mask([2, 1, 3]))
    assert local_calls(ctx, 0, cpu, batch_equal_lengths=False).sizes == (2, 1, 3, 40)


# ----------------------------------------------------------------------------- parity
CASES = {
    "many tiny": [1, 2, 1, 3, 1, 1, 4, 2] * 8,
    "one-token": [1] * 70,
    "mixed tiny and long": [1, 3, 200, 2, 1, 70, 5, 1, 1, 130, 2],
    "at the bound": [4, 4, 8, 1, 7, 9, 8],  # bound 64: groups (4, 4), (8,), (1, 7), (9,), (8,)
    # runs of equal lengths, short and long, between mixed ones (batched calls)
    "equal runs": [4] * 40 + [1, 2] + [16] * 8 + [3] * 3 + [90, 90] + [1] * 5,
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    ("bound", "batch"),
    [(0, False), (64, True), (sdpa_backend.LOCAL_GROUP_MASK_ELEMENTS, True),
     (sdpa_backend.LOCAL_GROUP_MASK_ELEMENTS, False), (1 << 18, True)],
)  # fmt: skip
@pytest.mark.parametrize(("hq", "hkv", "scale"), [(4, 2, None), (2, 2, 0.3)])
def test_grouped_equals_sdpa_per_sequence(
    case: str, bound: int, batch: bool, hq: int, hkv: int, scale: float | None
) -> None:
    lengths = CASES[case]
    ctx = _local_context(lengths)
    gen = torch.Generator().manual_seed(len(lengths) + bound % 997)
    seqs = {
        s: [torch.randn(n, h, 8, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv)]
        for s, n in enumerate(lengths)
    }
    q, k, v = (pack(ctx.layout, {s: t[i] for s, t in seqs.items()}) for i in range(3))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = local_attention(
        *leaves, ctx, scale=scale, group_mask_elements=bound, batch_equal_lengths=batch
    )
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got_grads = torch.autograd.grad(out, leaves, grad)
    got = unpack([ctx.layout], [out.detach()])
    got_g = [unpack([ctx.layout], [g]) for g in got_grads]
    grad_s = unpack([ctx.layout], [grad])
    for s in seqs:
        ref_in = [t.clone().requires_grad_() for t in seqs[s]]
        want = _reference(*ref_in, scale)
        want.backward(grad_s[s])
        assert (got[s] - want).abs().max().item() < TOL, (case, s)
        for name, g, r in zip("qkv", got_g, ref_in, strict=True):
            assert (g[s] - r.grad).abs().max().item() < TOL, (case, s, name)
    calls = plan_local_calls(lengths, bound, batch)
    if bound >= 64 or batch:  # the case exercises grouping: some call holds several sequences
        assert any(len(c.lengths) > 1 for c in calls)
    if not batch:
        assert not any(c.batched for c in calls)
    elif case == "equal runs" and bound <= sdpa_backend.LOCAL_GROUP_MASK_ELEMENTS:
        assert any(c.batched for c in calls)
    assert all(c.tokens**2 <= bound for c in calls if len(c.lengths) > 1 and not c.batched)


# ----------------------------------------------------------------------------- call count
@pytest.mark.parametrize(
    ("lengths", "max_calls", "masked"),
    [([1 + s % 4 for s in range(64)], 3, True), ([4] * 64, 1, False)],
    ids=["mixed", "equal"],
)
def test_sdpa_calls_per_layer_for_64_tiny_sequences(
    monkeypatch: pytest.MonkeyPatch, lengths: list[int], max_calls: int, masked: bool
) -> None:
    # A 3-layer HF decoder on 64 sequences of 1-4 tokens through the "skrull" attention: at most
    # 3 masked SDPA calls per layer (160 tokens in groups of up to 64), against 64 per sequence;
    # 64 sequences of 4 tokens: one batched causal call per layer. The logits equal those of
    # HF's own sdpa attention on each sequence alone (float64, TOL: the same terms summed in
    # another order).
    transformers = pytest.importorskip("transformers")
    register_skrull_attention()
    layers = 3
    config = transformers.Qwen2Config(**{**TINY_DECODER, "num_hidden_layers": layers})
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).double().eval()
    ctx = _local_context(lengths)
    tokens = {s: torch.randint(0, 64, (n,)) for s, n in enumerate(lengths)}
    input_ids = pack(ctx.layout, tokens).unsqueeze(0)
    calls = []
    real_sdpa = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(kwargs.get("attn_mask") is not None)
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(sdpa_calls.F, "scaled_dot_product_attention", counting)
    model.set_attn_implementation("skrull")
    with attention_context(ctx):
        logits = model(input_ids=input_ids, position_ids=torch.tensor([ctx.layout.position_ids]))
    monkeypatch.undo()
    assert 0 < len(calls) <= max_calls * layers
    assert all(m == masked for m in calls)  # grouped with a mask, or batched without one
    model.set_attn_implementation("sdpa")
    got = unpack([ctx.layout], [logits.logits[0]])
    for s, ids in tokens.items():
        want = model(input_ids=ids.unsqueeze(0)).logits[0]
        assert (got[s] - want).abs().max().item() < TOL


def test_sdpa_attention_groups_by_default() -> None:
    # The backend entry point (what every layer calls) groups with the default bound.
    lengths = [2] * 40
    ctx = _local_context(lengths)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(80, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    assert torch.equal(
        sdpa_attention(q, k, v, ctx),
        local_attention(q, k, v, ctx, group_mask_elements=sdpa_backend.LOCAL_GROUP_MASK_ELEMENTS),
    )
    # 40 two-token sequences: one batched causal call (80 tokens are over one masked group)
    plan = local_calls(ctx, sdpa_backend.LOCAL_GROUP_MASK_ELEMENTS, q.device)
    assert [(c.lengths, c.batched) for c in plan.calls] == [((2,) * 40, True)]


def test_overhead_benchmark_smoke(world_of_one: None) -> None:
    # benchmarks/overhead.py runs (2 layers, one size): each variant trains and is timed, and
    # the fixed cost per sequence is fitted (its sign is the machine's noise at this size).
    *grid, fixed = overhead.main(["--smoke"])
    (row,) = grid
    assert row["sequences"] == 4 and row["length"] == 4
    for key in ("plain", *overhead.VARIANTS):
        wall, cpu = row[key]
        assert wall > 0 and cpu > 0
    assert isinstance(fixed["per_sequence_s"], float)
