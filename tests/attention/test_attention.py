"""Single-process tests of the attention backends, context, dispatch and registration.

Ranks are emulated in one process where no collective is needed: each rank's distributed
chunks attend the whole sequences' K/V directly (what the all-gather delivers), so the math of
the layout and of the lower-right causal blocks is checked for CP sizes 1-5 without spawning.
The real collectives are tested in ``test_attention_multiprocess.py``.

Tolerances: float64 1e-10 (only the softmax summation order differs from the reference,
~1e-15); bf16 on GPU 2e-2 (bf16 has 8 bits of mantissa, ~4e-3 relative per rounding, and the two
kernels round differently).
"""

from __future__ import annotations

import functools
import logging
import random
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from attention_reference import (
    HEAD_DIM,
    check_call,
    dispatch_case,
    emulate_ranks,
    hf_window_mask,
    random_case,
    random_seqs,
    sdpa_reference,
    through_attention_function,
    varlen_reference,
    window_reference,
)
from helpers import TINY_DECODER
from torch.nn.attention.bias import CausalBias

from lightning_skrull.attention import (
    ATTENTION_NAME,
    SkrullAttentionContext,
    attention_context,
    backends,
    build_rank_layout,
    build_rank_layouts,
    current_attention_context,
    distributed_kv_bytes,
    gather_distributed_kv,
    pack,
    register_skrull_attention,
    resolve_backend,
    sdpa_attention,
    sdpa_calls,
    skrull_attention_forward,
    unpack,
)
from lightning_skrull.attention import flash as flash_backend
from lightning_skrull.attention import sdpa as sdpa_backend
from lightning_skrull.scheduling.plan import DISTRIBUTED


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 2), (4, 1), (2, 2)])
def test_emulated_ranks_equal_sdpa_on_whole_sequences(cp_size: int, hq: int, hkv: int) -> None:
    rng = random.Random(cp_size * 10 + hkv)
    for trial in range(4):
        lengths, ids, placement = random_case(rng, cp_size)
        seqs = random_seqs(lengths, ids, hq, hkv, torch.float64)
        layouts = build_rank_layouts(ids, placement, lengths, cp_size=cp_size)
        scale = 0.25 if trial % 2 else None
        got = unpack(layouts, emulate_ranks(sdpa_backend, layouts, seqs, scale))
        for s in ids:
            err = (got[s] - sdpa_reference(*seqs[s], scale=scale)).abs().max().item()
            assert err < 1e-10, (lengths, ids, placement, s, err)


@pytest.mark.parametrize("mask_elements", [1, 7, 40, 1 << 22])
def test_lower_right_blocks_equal_the_tail_of_full_causal_attention(mask_elements: int) -> None:
    # queries are the last 9 of 23 positions: blocks of 1, a few, or all rows give the same
    gen = torch.Generator().manual_seed(0)
    q_all = torch.randn(23, 4, HEAD_DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(23, 2, HEAD_DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(23, 2, HEAD_DIM, generator=gen, dtype=torch.float64)
    want = sdpa_reference(q_all, k, v)[14:]
    got = sdpa_calls.causal_lower_right_attention(q_all[14:], k, v, mask_elements=mask_elements)
    assert (got - want).abs().max().item() < 1e-12


def test_window_semantics_are_transformers_own() -> None:
    # transformers: query i sees key j iff 0 <= i - j < W (the window counts the query itself)
    mask = hf_window_mask(7, 3)
    rows, cols = torch.arange(7).unsqueeze(1), torch.arange(7).unsqueeze(0)
    assert torch.equal(mask, (rows - cols >= 0) & (rows - cols < 3))
    assert torch.equal(sdpa_backend.block_causal_mask([7], window=3), mask)
    assert torch.equal(sdpa_backend.block_causal_mask([7], window=7), hf_window_mask(7, 7))


@pytest.mark.parametrize("window", [1, 2, 5, 9, 23, 40])
@pytest.mark.parametrize("mask_elements", [1, 7, 40, 1 << 22])
def test_sliding_window_blocks_equal_the_tail_of_windowed_attention(
    window: int, mask_elements: int
) -> None:
    # queries are the last 9 of 23 positions, against transformers' window mask: blocks of one
    # row, a few rows, or all; windows inside, at and beyond the sequence. float64, 1e-12.
    gen = torch.Generator().manual_seed(window)
    q_all = torch.randn(23, 4, HEAD_DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(23, 2, HEAD_DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(23, 2, HEAD_DIM, generator=gen, dtype=torch.float64)
    want = window_reference(q_all, k, v, window)[14:]
    got = sdpa_calls.sliding_window_attention(
        q_all[14:], k, v, window=window, mask_elements=mask_elements
    )
    assert (got - want).abs().max().item() < 1e-12
    # the block's keys are the window's: a wrong window (one more key) differs
    wrong = sdpa_calls.sliding_window_attention(q_all[14:], k, v, window=window + 1)
    assert window >= 23 or (wrong - want).abs().max().item() > 1e-3


def test_sliding_window_masks_stay_bounded() -> None:
    # a long sequence with a small window: every SDPA call's mask fits the bound and its keys
    # are only those the block's queries see (no call reads the whole prefix)
    assert sdpa_calls.window_rows(10, 4, 1 << 22) == 10  # all fits: one call
    for keys, window, bound in ((100_000, 4096, 1 << 22), (5000, 8, 1000), (50, 1, 1)):
        rows = sdpa_calls.window_rows(keys, window, bound)
        assert rows >= 1 and (rows == 1 or rows * min(keys, rows + window - 1) <= bound)
    shapes: list[tuple[int, int]] = []
    real = sdpa_calls._sdpa

    def spy(q, k, v, *, scale, is_causal=False, mask=None, sink=None):
        shapes.append(tuple(mask.shape))
        return real(q, k, v, scale=scale, is_causal=is_causal, mask=mask, sink=sink)

    q = torch.randn(3000, 2, HEAD_DIM, dtype=torch.float64)
    kv = torch.randn(3000, 1, HEAD_DIM, dtype=torch.float64)
    sdpa_calls._sdpa = spy
    try:
        out = sdpa_calls.sliding_window_attention(q, kv, kv, window=16, mask_elements=4096)
    finally:
        sdpa_calls._sdpa = real
    assert max(r * c for r, c in shapes) <= 4096 and max(c for _, c in shapes) < 16 + 64
    want = window_reference(q[-65:], kv[-65:], kv[-65:], 16)[-50:]  # the last 50 queries
    assert (out[-50:] - want).abs().max().item() < 1e-12


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("window", [1, 2, 3, 6, 13, 70])
def test_emulated_ranks_with_a_window_equal_sdpa_with_transformers_mask(
    cp_size: int, window: int
) -> None:
    # Windows shorter than, equal to and longer than the sequences; with lengths up to 70 over
    # 2N chunks, windows cut inside one zigzag chunk and across several. Forward and q/k/v
    # gradients against plain SDPA with transformers' mask on each whole sequence, float64,
    # 1e-10 (summation order only).
    rng = random.Random(cp_size * 100 + window)
    for trial in range(3):
        lengths, ids, placement = random_case(rng, cp_size)
        lengths[ids[0]] = window  # a sequence exactly as long as the window
        hq, hkv = ((4, 2), (4, 1), (2, 2))[trial]
        seqs = {
            s: tuple(t.requires_grad_() for t in qkv)
            for s, qkv in random_seqs(lengths, ids, hq, hkv, torch.float64).items()
        }
        layouts = build_rank_layouts(ids, placement, lengths, cp_size=cp_size)
        scale = 0.25 if trial % 2 else None
        got = unpack(layouts, emulate_ranks(sdpa_backend, layouts, seqs, scale, window=window))
        grads = {s: torch.randn_like(got[s]) for s in ids}
        torch.autograd.backward([got[s] for s in ids], [grads[s] for s in ids])
        for s in ids:
            ref_in = [t.detach().clone().requires_grad_() for t in seqs[s]]
            want = window_reference(*ref_in, window, scale=scale)
            want.backward(grads[s])
            err = (got[s] - want).abs().max().item()
            assert err < 1e-10, (lengths, ids, placement, s, err)
            for name, t, r in zip("qkv", seqs[s], ref_in, strict=True):
                assert (t.grad - r.grad).abs().max().item() < 1e-10, (s, name)
            if lengths[s] > window:  # the window bites: full causal attention differs
                assert (got[s] - sdpa_reference(*ref_in, scale=scale)).abs().max().item() > 1e-6


def test_cp1_through_dispatch_with_gradients() -> None:
    # cp_size 1: a "distributed" sequence is two chunks on the one rank, no collective
    lengths, ids, placement = [6, 1, 9, 4], [2, 0, 1, 3], [0, DISTRIBUTED, DISTRIBUTED, 0]
    seqs = random_seqs(lengths, ids, 4, 2, torch.float64)
    layout = build_rank_layout(ids, placement, lengths, cp_rank=0, cp_size=1)
    call = through_attention_function(layout, seqs, scaling=0.4)
    assert call.weights is None and call.shape == (1, layout.num_tokens, 4, HEAD_DIM)
    check_call(call, seqs, lambda q, k, v: sdpa_reference(q, k, v, scale=0.4), 1e-10)


@pytest.mark.parametrize("only_local", [False, True])
def test_cp1_through_dispatch_with_a_window(only_local: bool) -> None:
    # The layer's window arrives as transformers passes it (sliding_window=); local sequences
    # grouped in a masked call, alone, and batched by equal length, and distributed chunks,
    # forward and gradients against transformers' mask, float64 1e-10. A window no sequence
    # is longer than leaves the full causal calls.
    lengths, ids, placement = dispatch_case(only_local)
    seqs = random_seqs(lengths, ids, 4, 2, torch.float64)
    layout = build_rank_layout(ids, placement, lengths, cp_rank=0, cp_size=1)
    for window in (3, 8, 69, 70):
        call = through_attention_function(layout, seqs, scaling=0.4, sliding_window=window)
        reference = functools.partial(window_reference, window=window, scale=0.4)
        check_call(call, seqs, reference, 1e-10, window)


def test_no_distributed_sequence_starts_no_gather() -> None:
    layout = build_rank_layout([0, 1], [0, 0], [3, 2], cp_rank=0, cp_size=1)
    ctx = SkrullAttentionContext.build(layout)
    k = torch.zeros(0, 2, HEAD_DIM)
    assert gather_distributed_kv(k, k, ctx) is None
    assert distributed_kv_bytes(ctx, 2, HEAD_DIM, torch.float32) == 0


def test_gather_rejects_a_mismatched_distributed_part() -> None:
    layout = build_rank_layout([0], [DISTRIBUTED], [6], cp_rank=0, cp_size=1)
    ctx = SkrullAttentionContext.build(layout)
    with pytest.raises(ValueError, match="holds 6 distributed tokens"):
        gather_distributed_kv(torch.zeros(5, 2, HEAD_DIM), torch.zeros(5, 2, HEAD_DIM), ctx)


def test_context_variable_scoping_and_errors() -> None:
    with pytest.raises(RuntimeError, match="outside attention_context"):
        current_attention_context()
    one = SkrullAttentionContext.build(build_rank_layout([0], [0], [3], cp_rank=0, cp_size=1))
    two = SkrullAttentionContext.build(build_rank_layout([0], [0], [5], cp_rank=0, cp_size=1))
    with attention_context(one):
        assert current_attention_context() is one
        with attention_context(two):
            assert current_attention_context() is two
        assert current_attention_context() is one
    with pytest.raises(RuntimeError):
        current_attention_context()
    with pytest.raises(TypeError, match="SkrullAttentionContext"):
        with attention_context("not a context"):  # type: ignore[arg-type]
            pass
    with pytest.raises(TypeError, match="RankLayout"):
        SkrullAttentionContext.build("layout")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group is None"):
        SkrullAttentionContext.build(build_rank_layout([0], [0], [3], cp_rank=0, cp_size=2))


def test_dispatch_refuses_unsupported_inputs() -> None:
    layout = build_rank_layout([0], [0], [5], cp_rank=0, cp_size=1)
    q = torch.zeros(1, 4, 5, HEAD_DIM)
    kv = torch.zeros(1, 2, 5, HEAD_DIM)
    with pytest.raises(RuntimeError, match="outside attention_context"):
        skrull_attention_forward(None, q, kv, kv, None)
    training, evaluating = torch.nn.Linear(1, 1).train(), torch.nn.Linear(1, 1).eval()
    with attention_context(SkrullAttentionContext.build(layout)):
        with pytest.raises(ValueError, match="batch size 1"):
            skrull_attention_forward(
                None,
                q.expand(2, -1, -1, -1),
                kv.expand(2, -1, -1, -1),
                kv.expand(2, -1, -1, -1),
                None,
            )
        with pytest.raises(ValueError, match="dropout"):
            skrull_attention_forward(training, q, kv, kv, None, dropout=0.1)
        skrull_attention_forward(evaluating, q, kv, kv, None, dropout=0.1)  # inert in eval
        # a window is an int >= 1 (Qwen2-MoE's config writes 0 for "none"); None = full
        for bad in (0, -3, 2.5, True):
            with pytest.raises(ValueError, match=f"sliding_window={bad!r}; a window is an int"):
                skrull_attention_forward(None, q, kv, kv, None, sliding_window=bad)
        skrull_attention_forward(None, q, kv, kv, None, sliding_window=4)
        skrull_attention_forward(None, q, kv, kv, None, sliding_window=None)
        with pytest.raises(ValueError, match="attention_mask"):
            skrull_attention_forward(None, q, kv, kv, torch.ones(1, 1, 5, 5, dtype=torch.bool))
        with pytest.raises(ValueError, match="holds 5"):
            skrull_attention_forward(None, q[:, :, :4], kv[:, :, :4], kv[:, :, :4], None)
        with pytest.raises(ValueError, match="causal only"):
            skrull_attention_forward(None, q, kv, kv, None, is_causal=False)
        with pytest.raises(ValueError, match="softcap"):
            skrull_attention_forward(None, q, kv, kv, None, softcap=30.0)


def test_resolve_backend(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_skrull.attention.backends"):
        assert resolve_backend("auto", "cpu") == "sdpa"
    assert resolve_backend("sdpa", "cpu") == "sdpa"
    with pytest.raises(ValueError, match="CUDA device"):
        resolve_backend("flash", "cpu")
    with pytest.raises(ValueError, match="unknown attention backend 'ring'"):
        resolve_backend("ring", "cpu")
    if backends.flash_kernel() is None:
        with pytest.raises(ValueError, match="pip install flash-attn"):
            resolve_backend("flash", "cuda")
    else:  # flash-attn, or PyTorch's varlen kernel (this PyTorch has one)
        assert resolve_backend("flash", "cuda") == "flash"
    # "auto" on CUDA: flash whenever a kernel is installed
    want = "sdpa" if backends.flash_kernel() is None else "flash"
    assert resolve_backend("auto", "cuda") == want


@pytest.mark.parametrize("auto", [True, False])
def test_flash_context_on_float_activations(auto: bool) -> None:
    # FlashAttention kernels compute in fp16/bf16 only: a context "auto" resolved to flash runs
    # float32/64 activations with sdpa (same result as sdpa, float64 to 0); an explicit
    # "flash" refuses them with the dtype and the fix.
    import dataclasses

    lengths, ids, placement = [5, 9], [0, 1], [0, DISTRIBUTED]
    layout = build_rank_layout(ids, placement, lengths, cp_rank=0, cp_size=1)
    sdpa_ctx = SkrullAttentionContext.build(layout)
    flash_ctx = dataclasses.replace(sdpa_ctx, backend="flash", auto=auto)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, h, 14, HEAD_DIM, generator=gen, dtype=torch.float64) for h in (4, 2, 2)
    )

    def run(ctx: SkrullAttentionContext) -> torch.Tensor:
        with attention_context(ctx):
            return skrull_attention_forward(None, q, k, v, None, scaling=None)[0]

    if auto:
        assert torch.equal(run(flash_ctx), run(sdpa_ctx))
    else:
        with pytest.raises(ValueError, match=r"float16 and bfloat16 only.*float64.*'sdpa'"):
            run(flash_ctx)


def test_registration_and_a_tiny_hf_model_on_packed_input() -> None:
    transformers = pytest.importorskip("transformers")
    assert register_skrull_attention() == ATTENTION_NAME == register_skrull_attention()
    assert transformers.AttentionInterface()["skrull"] is skrull_attention_forward
    config = transformers.LlamaConfig(**TINY_DECODER)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double().eval()
    lengths = [5, 9, 3]
    tokens = {s: torch.randint(0, 64, (n,)) for s, n in enumerate(lengths)}
    layout = build_rank_layout([0, 1, 2], [0, DISTRIBUTED, 0], lengths, cp_rank=0, cp_size=1)
    input_ids = pack(layout, tokens).unsqueeze(0)
    model.set_attn_implementation("skrull")
    with attention_context(SkrullAttentionContext.build(layout)):
        # transformers builds no mask for "skrull": a 2-D mask of ones is dropped, none arrives
        logits = model(
            input_ids=input_ids,
            position_ids=torch.tensor([layout.position_ids]),
            attention_mask=torch.ones_like(input_ids),
        ).logits[0]
    model.set_attn_implementation("sdpa")
    got = unpack([layout], [logits])
    for s, ids in tokens.items():
        want = model(input_ids=ids.unsqueeze(0)).logits[0]
        assert (got[s] - want).abs().max().item() < 1e-10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 2), (4, 4)])
def test_flash_equals_sdpa_on_emulated_ranks(cp_size: int, hq: int, hkv: int) -> None:
    # The real kernel (flash-attn, else torch.nn.attention.varlen) on random layouts, local and
    # distributed chunks, in bf16, against the sdpa backend on the same bf16 inputs; both are
    # compared with float32 whole-sequence attention. bf16 keeps 8 mantissa bits: the output
    # and gradient errors of each kernel are a few bf16 ulps of values of order 1, so the flash
    # error may be at most twice the sdpa error plus 1e-2. A wrong causal alignment of the
    # distributed chunks (seqlen_q < seqlen_k) gives errors of order 1.
    if backends.flash_kernel() is None:
        pytest.skip("no varlen kernel: neither flash-attn nor torch.nn.attention.varlen")
    rng = random.Random(cp_size)
    for _ in range(3):
        lengths, ids, placement = random_case(rng, cp_size)
        lengths = [n * 17 for n in lengths]  # several kernel tiles per sequence
        layouts = build_rank_layouts(ids, placement, lengths, cp_size=cp_size)
        base = random_seqs(lengths, ids, hq, hkv, torch.float32, device="cuda", head_dim=64)
        out_grad = {s: torch.randn_like(base[s][0]) for s in ids}
        results = {}
        for name, module, dtype in (
            ("flash", flash_backend, torch.bfloat16),
            ("sdpa", sdpa_backend, torch.bfloat16),
            ("fp32", sdpa_backend, torch.float32),
        ):
            seqs = {s: tuple(t.to(dtype).requires_grad_() for t in qkv) for s, qkv in base.items()}
            backend = "flash" if name == "flash" else "sdpa"
            out = unpack(layouts, emulate_ranks(module, layouts, seqs, None, backend))
            torch.autograd.backward([out[s].float() for s in ids], [out_grad[s] for s in ids])
            results[name] = {
                s: [out[s].detach().float()] + [t.grad.float() for t in seqs[s]] for s in ids
            }
        for s in ids:
            for i, what in enumerate(("out", "dq", "dk", "dv")):
                want = results["fp32"][s][i]
                err_flash = (results["flash"][s][i] - want).abs().max().item()
                err_sdpa = (results["sdpa"][s][i] - want).abs().max().item()
                assert err_flash <= 2 * err_sdpa + 1e-2, (lengths, ids, placement, s, what,
                                                          err_flash, err_sdpa)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("window", [1, 40, 200, 5000])
def test_flash_with_a_window_equals_whole_sequence_sdpa(cp_size: int, window: int) -> None:
    # The real kernel with window_size=(W - 1, 0) on random layouts (lengths up to ~1200, so
    # windows cut inside chunks, across them, and exceed the sequences) in bf16, against plain
    # SDPA with transformers' window mask on each whole sequence in float32. The yardstick is
    # the same whole-sequence SDPA in bf16: the flash error may be at most twice its error plus
    # 1e-2 (bf16 keeps 8 mantissa bits; both round differently). A window off by one key, or
    # aligned top-left in the distributed chunks, gives errors of order 1.
    if backends.flash_kernel() is None:
        pytest.skip("no varlen kernel: neither flash-attn nor torch.nn.attention.varlen")
    if not flash_backend.window_supported():
        pytest.skip("the installed varlen kernel takes no window_size")
    rng = random.Random(cp_size * 7 + window)
    for _ in range(3):
        lengths, ids, placement = random_case(rng, cp_size)
        lengths = [n * 17 for n in lengths]
        layouts = build_rank_layouts(ids, placement, lengths, cp_size=cp_size)
        base = random_seqs(lengths, ids, 4, 2, torch.float32, device="cuda", head_dim=64)
        out_grad = {s: torch.randn_like(base[s][0]) for s in ids}
        seqs = {s: tuple(t.bfloat16().requires_grad_() for t in qkv) for s, qkv in base.items()}
        out = unpack(layouts, emulate_ranks(flash_backend, layouts, seqs, None, "flash", window))
        torch.autograd.backward([out[s].float() for s in ids], [out_grad[s] for s in ids])
        for s in ids:
            results = {}
            for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
                ref_in = [t.to(dtype).requires_grad_() for t in base[s]]
                ref = window_reference(*ref_in, window)
                ref.float().backward(out_grad[s])
                results[name] = [ref.detach().float()] + [t.grad.float() for t in ref_in]
            got = [out[s].detach().float()] + [t.grad.float() for t in seqs[s]]
            for i, what in enumerate(("out", "dq", "dk", "dv")):
                want = results["fp32"][i]
                err_flash = (got[i] - want).abs().max().item()
                err_sdpa = (results["bf16"][i] - want).abs().max().item()
                assert err_flash <= 2 * err_sdpa + 1e-2, (lengths, ids, placement, s, what,
                                                          err_flash, err_sdpa)  # fmt: skip


def test_sdpa_attention_is_the_sdpa_backend_entry_point() -> None:
    # the public entry point runs the same schedule as the parts (cp_size 1, no group)
    lengths, ids, placement = [4, 7], [0, 1], [DISTRIBUTED, 0]
    seqs = random_seqs(lengths, ids, 2, 1, torch.float64)
    layout = build_rank_layout(ids, placement, lengths, cp_rank=0, cp_size=1)
    ctx = SkrullAttentionContext.build(layout)
    q, k, v = (pack(layout, {s: t[i] for s, t in seqs.items()}) for i in range(3))
    out = unpack([layout], [sdpa_attention(q, k, v, ctx)])
    for s in ids:
        assert (out[s] - sdpa_reference(*seqs[s])).abs().max().item() < 1e-10


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_sdpa_backend_with_the_cuda_kernel_choice(monkeypatch, cp_size: int, bias: bool) -> None:
    # The CUDA branch of the sdpa backend (SDPA kernels restricted, K/V repeated for masked GQA
    # calls, distributed chunks through the causal_lower_right bias or, for dtypes whose CUDA
    # kernels lack it, mask blocks) run on CPU: it equals whole-sequence SDPA, forward and
    # gradients, float64 to 1e-10.
    calls: list[tuple[int, int, bool]] = []
    biases: list[bool] = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, *, attn_mask, is_causal, scale, enable_gqa):
        calls.append((q.shape[1], k.shape[1], attn_mask is not None))
        biases.append(isinstance(attn_mask, CausalBias))
        return real_sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                         enable_gqa=enable_gqa)  # fmt: skip

    monkeypatch.setattr(sdpa_calls, "_restrict_kernels", lambda t: True)
    monkeypatch.setattr(sdpa_calls, "_lower_right_bias", lambda t: bias)
    monkeypatch.setattr(sdpa_calls, "F", types.SimpleNamespace(scaled_dot_product_attention=spy))
    rng = random.Random(7 + cp_size)
    for _ in range(4):
        lengths, ids, placement = random_case(rng, cp_size)
        seqs = {
            s: tuple(t.requires_grad_() for t in qkv)
            for s, qkv in random_seqs(lengths, ids, 4, 2, torch.float64).items()
        }
        layouts = build_rank_layouts(ids, placement, lengths, cp_size=cp_size)
        got = unpack(layouts, emulate_ranks(sdpa_backend, layouts, seqs, None))
        for s in ids:
            ref_in = [t.detach().clone().requires_grad_() for t in seqs[s]]
            want = sdpa_reference(*ref_in)
            grad = torch.randn_like(want)
            want.backward(grad)
            got_grads = torch.autograd.grad(got[s], seqs[s], grad, retain_graph=True)
            assert (got[s] - want).abs().max().item() < 1e-10
            for g, r in zip(got_grads, ref_in, strict=True):
                assert (g - r.grad).abs().max().item() < 1e-10
    assert calls and all(hkv == 4 for hq, hkv, masked in calls if masked)  # repeated K/V
    assert any(hkv == 2 for hq, hkv, masked in calls if not masked)  # GQA kept without a mask
    assert any(biases) == bias  # every case has a distributed chunk that is not square


def _torch_varlen_reference(signature: str):
    """``torch.nn.attention.varlen.varlen_attn`` as PyTorch documents it, on top of
    :func:`varlen_reference`, with each of its signatures in the supported releases:
    ``"window_size"`` (PyTorch >= 2.13: causal is ``window_size=(-1, 0)``, a tuple; ``scale`` and
    ``enable_gqa`` exist) or ``"window_size_no_gqa"`` (2.11, the GPU machines' torch: the same
    without ``enable_gqa``). It asserts the arguments a wrong call would get wrong silently:
    causality, and equal head counts without GQA."""
    varlen = varlen_reference()

    def new(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
            window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None,
            num_splits=None):  # fmt: skip
        assert window_size[1] == 0 and window_size[0] >= -1 and isinstance(window_size, tuple)
        assert enable_gqa or q.shape[1] == k.shape[1]
        return varlen(q, k, v, cu_seqlens_q=cu_seq_q, cu_seqlens_k=cu_seq_k, max_seqlen_q=max_q,
                      max_seqlen_k=max_k, softmax_scale=scale, causal=True,
                      window_size=window_size)  # fmt: skip

    def without_gqa(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1)):  # fmt: skip
        return new(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size)

    return {"window_size": new, "window_size_no_gqa": without_gqa}[signature]


def _flash_contract(cp_size: int, hq: int, hkv: int, window: int | None = None) -> None:
    """The flash backend on random layouts against whole-sequence SDPA (with transformers'
    window mask for a ``window``): forward and the gradients of q, k and v, float64 to 1e-10
    (the same terms summed in another order)."""
    rng = random.Random(100 + cp_size * 10 + hkv + (window or 0))
    for trial in range(4):
        lengths, ids, placement = random_case(rng, cp_size)
        seqs = {
            s: tuple(t.requires_grad_() for t in qkv)
            for s, qkv in random_seqs(lengths, ids, hq, hkv, torch.float64).items()
        }
        layouts = build_rank_layouts(ids, placement, lengths, cp_size=cp_size)
        scale = 0.3 if trial % 2 else None
        got = unpack(layouts, emulate_ranks(flash_backend, layouts, seqs, scale, "flash", window))
        grads = {s: torch.randn_like(got[s]) for s in ids}
        torch.autograd.backward([got[s] for s in ids], [grads[s] for s in ids])
        got_grads = {s: [t.grad.clone() for t in seqs[s]] for s in ids}
        for s in ids:
            ref_in = [t.detach().clone().requires_grad_() for t in seqs[s]]
            want = window_reference(*ref_in, window, scale=scale)
            want.backward(grads[s])
            err = (got[s].detach() - want.detach()).abs().max().item()
            assert err < 1e-10, (lengths, ids, placement, s, err)
            for name, g, r in zip("qkv", got_grads[s], ref_in, strict=True):
                assert (g - r.grad).abs().max().item() < 1e-10, (s, name)


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 2), (4, 1)])
@pytest.mark.parametrize("window", [None, 5])
def test_flash_backend_call_contract_on_cpu(
    monkeypatch, cp_size: int, hq: int, hkv: int, window: int | None
) -> None:
    # The flash backend's own code (offsets, key prefixes copied end to end, max lengths, the
    # bottom-right causal alignment it relies on, window_size=(W - 1, 0) for a window) checked
    # on CPU against whole-sequence SDPA, with flash-attn's kernel replaced by its documented
    # semantics. The kernel itself is checked on GPU (test_flash_equals_sdpa_...).
    monkeypatch.setattr(flash_backend, "_varlen_func", varlen_reference)
    _flash_contract(cp_size, hq, hkv, window)


@pytest.mark.parametrize("signature", ["window_size", "window_size_no_gqa"])
@pytest.mark.parametrize("cp_size", [1, 3])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 2), (2, 2)])
def test_flash_backend_on_torch_varlen_call_contract_on_cpu(
    monkeypatch, signature: str, cp_size: int, hq: int, hkv: int
) -> None:
    # Without flash-attn the backend calls torch.nn.attention.varlen.varlen_attn; with each of
    # its signatures (GQA native, or K/V repeated on torch 2.11) it gives the same results as
    # whole-sequence SDPA, forward and gradients, sliding windows included.
    import torch.nn.attention.varlen as torch_varlen

    monkeypatch.setattr(backends, "flash_attn_available", lambda: False)
    monkeypatch.setattr(torch_varlen, "varlen_attn", _torch_varlen_reference(signature))
    assert backends.flash_kernel() == "torch"
    _flash_contract(cp_size, hq, hkv)
    assert flash_backend.window_supported()
    _flash_contract(cp_size, hq, hkv, window=3)


def test_flash_attn_without_window_size_refuses_a_window(monkeypatch) -> None:
    # flash-attn < 2.3 has no window_size: a windowed layer is refused with the fix, not run
    # as full causal attention.
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False):  # fmt: skip
        raise AssertionError("a windowed layer must not reach a kernel without window_size")

    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = flash_attn_varlen_func  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    monkeypatch.setattr(backends, "flash_attn_available", lambda: True)
    assert backends.flash_kernel() == "flash-attn"
    assert not flash_backend.window_supported()
    layout = build_rank_layout([0], [0], [5], cp_rank=0, cp_size=1)
    q = torch.zeros(5, 4, HEAD_DIM)
    kv = torch.zeros(5, 2, HEAD_DIM)
    with pytest.raises(ValueError, match=r"takes no window_size; install flash-attn >= 2\.3"):
        flash_backend.flash_attention(q, kv, kv, SkrullAttentionContext.build(layout), window=3)


def test_flash_backend_contract_test_notices_top_left_alignment(monkeypatch) -> None:
    # The distributed chunks need bottom-right alignment; a kernel aligned top-left gives
    # other outputs, so the contract test above would fail on it.
    monkeypatch.setattr(flash_backend, "_varlen_func", lambda: varlen_reference(False))
    lengths, ids, placement = [9, 12], [0, 1], [DISTRIBUTED, 0]
    seqs = random_seqs(lengths, ids, 4, 2, torch.float64)
    layouts = build_rank_layouts(ids, placement, lengths, cp_size=2)
    got = unpack(layouts, emulate_ranks(flash_backend, layouts, seqs, None, "flash"))
    assert (got[1] - sdpa_reference(*seqs[1])).abs().max().item() < 1e-10  # local: square, same
    assert (got[0] - sdpa_reference(*seqs[0])).abs().max().item() > 1e-3


def test_checkpoint_recompute_on_another_thread_finds_the_context() -> None:
    # On CUDA, autograd runs backward (and so the recomputation of checkpointed layers) on its
    # own device thread, where context variables set by the training loop are not visible. A
    # backward started from a fresh thread reproduces that on CPU: the recomputed attention
    # must still find the micro-batch's context, and the gradients must equal a run without
    # checkpointing. float64, 1e-10.
    import threading

    transformers = pytest.importorskip("transformers")
    register_skrull_attention()
    config = transformers.Qwen2Config(**TINY_DECODER)
    lengths = [5, 9, 3]
    gen = torch.Generator().manual_seed(0)
    tokens = {s: torch.randint(0, 64, (n,), generator=gen) for s, n in enumerate(lengths)}
    layout = build_rank_layout([0, 1, 2], [0, DISTRIBUTED, 0], lengths, cp_rank=0, cp_size=1)
    input_ids = pack(layout, tokens).unsqueeze(0)
    position_ids = torch.tensor([layout.position_ids])

    def grads(checkpointed: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(config).double().train()
        model.set_attn_implementation("skrull")
        if checkpointed:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        errors: list[BaseException] = []
        with attention_context(SkrullAttentionContext.build(layout)):
            loss = model(input_ids=input_ids, position_ids=position_ids).logits.square().mean()

            def backward() -> None:
                try:
                    loss.backward()
                except BaseException as err:  # re-raised in the test thread
                    errors.append(err)

            thread = threading.Thread(target=backward)
            thread.start()
            thread.join()
        if errors:
            raise errors[0]
        return {n: p.grad for n, p in model.named_parameters()}

    plain, checkpointed = grads(False), grads(True)
    for name, g in plain.items():
        assert (checkpointed[name] - g).abs().max().item() < 1e-10, name


def test_context_seen_from_a_thread_without_one_only_when_unambiguous() -> None:
    import threading

    one = SkrullAttentionContext.build(build_rank_layout([0], [0], [3], cp_rank=0, cp_size=1))
    two = SkrullAttentionContext.build(build_rank_layout([0], [0], [5], cp_rank=0, cp_size=1))

    def look() -> object:
        seen: list[object] = []

        def run() -> None:
            try:
                seen.append(current_attention_context())
            except RuntimeError as err:
                seen.append(err)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        return seen[0]

    with attention_context(one), attention_context(two):
        assert look() is two  # the innermost context of the one thread that has any
        opened, release = threading.Event(), threading.Event()

        def hold() -> None:
            with attention_context(one):
                opened.set()
                release.wait()

        holder = threading.Thread(target=hold)
        holder.start()
        opened.wait()
        try:
            err = look()
            assert isinstance(err, RuntimeError) and "ambiguous" in str(err)
            assert current_attention_context() is two  # a thread's own context always wins
        finally:
            release.set()
            holder.join()
    err = look()
    assert isinstance(err, RuntimeError) and "outside attention_context" in str(err)
