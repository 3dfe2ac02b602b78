"""gpt-oss (``GptOssForCausalLM``) under Skrull: attention sinks, the model against plain HF.

Attention sinks: every query of head ``h`` also sees a key of logit ``sink_h`` and value zero.
The context-parallel ``sdpa`` backend adds it as a key to each of its calls; it is checked
here, with emulated ranks (CP 1-4, local and distributed sequences, K/V groups, sliding windows,
GQA), against an independent reference: the scores of each whole sequence computed by hand,
the sink appended as a column of the softmax and dropped after it, as transformers' eager
gpt-oss attention does. Forward and the gradients of q, k, v and the sinks, float64, 1e-10
(summation order only, ~1e-15). The same with the sink dropped differs by more than 1e-3, so
the sinks set here matter. The real gloo collectives run the sink cases of
``test_attention_multiprocess.py``.

The whole tiny model (sliding and full layers, GQA, biases, YaRN RoPE, top-k router with bias,
clamped GLU experts) through the prepared ``"skrull"`` attention on a packed micro-batch
against plain HF eager on each sequence: loss and every gradient, float32 (bounds with each
test).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import random
from typing import Any

import pytest
import torch
from attention_reference import (
    check_call,
    dispatch_case,
    emulate_ranks,
    sink_reference,
    through_attention_function,
)
from harness import LOSS_RTOL, check_packed_parity
from helpers import (
    make_samples,
    model_flops,
    sentinel_mask_bytes,
    tiny_config,
    tiny_model,
)
from kept_bytes import kept_bytes, prepared_layer_per_token
from tiny_models import gpt_oss_model
from torch import nn

from benchmarks.memory_estimate import layer_bytes_per_token, parameter_count
from lightning_skrull.attention import (
    SkrullAttentionContext,
    attention_context,
    build_rank_layout,
    build_rank_layouts,
    dispatch,
    sdpa_calls,
    skrull_attention_forward,
    unpack,
)
from lightning_skrull.attention import sdpa as sdpa_backend
from lightning_skrull.attention.layout import RankLayout
from lightning_skrull.models import check_model, prepare_model
from lightning_skrull.models.families.moe import AUX_LOSS_MODEL_TYPES
from lightning_skrull.runtime.engine import forward_backward
from lightning_skrull.scheduling.plan import DISTRIBUTED, GlobalBatchPlan, MicroBatchPlan
from lightning_skrull.scheduling.shapes import ModelShape
from lightning_skrull.scheduling.tiles import window_pairs

HEAD_DIM = 8
TOL = 1e-10  # float64: summation order only


def _emulate(
    layouts: list[RankLayout],
    seqs: dict[int, tuple[torch.Tensor, ...]],
    sink: torch.Tensor | None,
    window: int | None,
    scale: float | None,
) -> list[torch.Tensor]:
    """Each rank's output from the sdpa backend's local and distributed parts."""
    return emulate_ranks(sdpa_backend, layouts, seqs, scale, window=window, sink=sink)  # type: ignore[arg-type]


def _sinks(hq: int, seed: int) -> torch.Tensor:
    """Sink logits of the scores' order (some well above them), so that they matter."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(hq, generator=gen, dtype=torch.float64) * 2 + 1).requires_grad_()


def _case(
    rng: random.Random, cp_size: int, hq: int, hkv: int, value_dim: int
) -> tuple[list[int], list[int], list[int], dict[int, tuple[torch.Tensor, ...]]]:
    lengths = [rng.choice([1, 2, 3, 5, 7, 2 * cp_size - 1, rng.randint(1, 70)]) for _ in range(6)]
    lengths[0] = 70  # long enough that a window bites
    ids = rng.sample(range(6), rng.randint(2, 6))
    if 0 not in ids:
        ids[0] = 0
    placement = [rng.choice([DISTRIBUTED, *range(cp_size)]) for _ in ids]
    gen = torch.Generator().manual_seed(rng.randint(0, 10**6))
    seqs = {
        s: tuple(
            torch.randn(lengths[s], h, d, generator=gen, dtype=torch.float64).requires_grad_()
            for h, d in ((hq, HEAD_DIM), (hkv, HEAD_DIM), (hkv, value_dim))
        )
        for s in ids
    }
    return lengths, ids, placement, seqs


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("window", [None, 3, 16])
def test_sinks_on_emulated_ranks_equal_eager_attention(cp_size: int, window: int | None) -> None:
    # GQA 4/2, 4/1, 2/2, a value narrower than the keys once, K/V groups once; forward and
    # the gradients of q, k, v and the sinks against sink_reference, float64, TOL.
    rng = random.Random(cp_size * 31 + (window or 0))
    for trial, (hq, hkv, value_dim) in enumerate(((4, 2, HEAD_DIM), (4, 1, 5), (2, 2, HEAD_DIM))):
        lengths, ids, placement, seqs = _case(rng, cp_size, hq, hkv, value_dim)
        kv_groups = (1, len([p for p in placement if p == DISTRIBUTED]) - 1) if trial == 2 else ()
        if kv_groups and kv_groups[1] < 1:
            kv_groups = ()
        layouts = build_rank_layouts(ids, placement, lengths, cp_size=cp_size, kv_groups=kv_groups)
        sink = _sinks(hq, trial)
        scale = 0.3 if trial == 1 else None
        got = unpack(layouts, _emulate(layouts, seqs, sink, window, scale))
        grads = {s: torch.randn_like(got[s]) for s in ids}
        torch.autograd.backward([got[s] for s in ids], [grads[s] for s in ids])
        ref_sink = sink.detach().clone().requires_grad_()
        for s in ids:
            ref_in = [t.detach().clone().requires_grad_() for t in seqs[s]]
            want = sink_reference(*ref_in, ref_sink, window, scale)
            want.backward(grads[s])
            assert (got[s] - want).abs().max().item() < TOL, (lengths, ids, placement, s)
            for name, t, r in zip("qkv", seqs[s], ref_in, strict=True):
                assert (t.grad - r.grad).abs().max().item() < TOL, (s, name)
        assert sink.grad is not None and ref_sink.grad is not None
        assert (sink.grad - ref_sink.grad).abs().max().item() < TOL
        assert ref_sink.grad.abs().max().item() > 1e-3  # the sinks' gradient is not trivially 0
        # ignoring the sink is visibly wrong: the test can fail
        plain = unpack(layouts, _emulate(layouts, seqs, None, window, scale))
        s = max(ids, key=lambda i: lengths[i])
        assert (plain[s] - got[s]).abs().max().item() > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 128])
def test_sinks_on_cuda_in_bf16(cp_size: int, window: int | None) -> None:
    # The CUDA path pads the sink column to a multiple of 8 (gpt-oss's head dim 64 -> 72) and
    # runs CUDA's fused SDPA kernels. Against sink_reference in float32 on the CPU, with
    # sink_reference itself in bf16 on CUDA as the yardstick: the relative distance (norms) of
    # each of output and q/k/v/sink gradients may be at most twice the yardstick's plus 1e-2,
    # the precision rule's form (a relative max-abs error is too noisy for the key and value
    # gradients, sums over hundreds of queries). A misplaced sink key or a lost padding column
    # gives distances of order 1.
    rng = random.Random(cp_size * 7 + (window or 0))
    lengths, ids, placement, seqs = _case(rng, cp_size, 8, 2, 64)
    lengths = [n * 9 for n in lengths]  # up to 630 tokens: the 128-token window bites
    gen = torch.Generator().manual_seed(cp_size)
    seqs = {s: tuple(torch.randn(lengths[s], h, 64, generator=gen) for h in (8, 2, 2)) for s in ids}
    layouts = build_rank_layouts(ids, placement, lengths, cp_size=cp_size)
    sink = _sinks(8, cp_size).detach().float()
    grads = {s: torch.randn(lengths[s], 8, 64, generator=gen) for s in ids}

    def run(device: str, dtype: torch.dtype, skrull: bool) -> dict[int, list[torch.Tensor]]:
        ins = {
            s: tuple(t.detach().to(device, dtype).requires_grad_() for t in seqs[s]) for s in ids
        }
        sk = sink.detach().to(device, dtype).requires_grad_()
        if skrull:
            got = unpack(layouts, _emulate(layouts, ins, sk, window, None))
        else:
            got = {s: sink_reference(*ins[s], sk, window) for s in ids}
        torch.autograd.backward([got[s] for s in ids], [grads[s].to(device, dtype) for s in ids])
        return {
            s: [got[s].float().cpu()]
            + [t.grad.float().cpu() for t in ins[s]]
            + [sk.grad.float().cpu()]
            for s in ids
        }

    want = run("cpu", torch.float32, skrull=False)
    yardstick = run("cuda", torch.bfloat16, skrull=False)
    got = run("cuda", torch.bfloat16, skrull=True)
    for s in ids:
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            err = _relative(got[s][i], want[s][i])
            ref = _relative(yardstick[s][i], want[s][i])
            assert err <= 2 * ref + 1e-2, (s, name, err, ref)
    dsink = [r[ids[0]][4] for r in (got, yardstick, want)]  # sink.grad: summed over all
    assert _relative(dsink[0], dsink[2]) <= 2 * _relative(dsink[1], dsink[2]) + 1e-2


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms), the precision rule's distance."""
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("mask_elements", [1, 7, 40, 1 << 22])
def test_sink_blocks_keep_masks_bounded(mask_elements: int) -> None:
    # A whole sequence (square, would be is_causal=True) and the tail of one, in query blocks
    # of one row, a few, or all, with and without a window: each equal to the reference, and
    # no SDPA call's mask (the sink key's column included) beyond the bound unless one row.
    gen = torch.Generator().manual_seed(mask_elements)
    q = torch.randn(23, 4, HEAD_DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(23, 2, HEAD_DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(23, 2, HEAD_DIM, generator=gen, dtype=torch.float64)
    sink = _sinks(4, 0).detach()
    masks: list[tuple[int, int]] = []
    real = sdpa_calls.F.scaled_dot_product_attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        mask = kwargs.get("attn_mask")
        masks.append(tuple(mask.shape[-2:]) if mask is not None else (0, 0))
        return real(*args, **kwargs)

    sdpa_calls.F.scaled_dot_product_attention = spy  # type: ignore[assignment]
    try:
        for window in (None, 5):
            want = sink_reference(q, k, v, sink, window)
            for start in (0, 14):
                got = sdpa_calls.sliding_window_attention(
                    q[start:], k, v, window=window or 10**6, mask_elements=mask_elements,
                    sink=sink,
                )  # fmt: skip
                assert (got - want[start:]).abs().max().item() < 1e-12, (window, start)
    finally:
        sdpa_calls.F.scaled_dot_product_attention = real  # type: ignore[assignment]
    assert all(r * c <= max(mask_elements, c) for r, c in masks), masks
    assert all(c > 0 for _, c in masks)  # every call with a sink has a mask (its sink column)


@pytest.mark.parametrize("only_local", [False, True])
def test_sinks_through_the_attention_function(only_local: bool) -> None:
    # CP 1 through skrull_attention_forward with s_aux as transformers' gpt-oss passes it:
    # local sequences grouped in a masked call, alone, batched by equal length (which with a
    # sink run one by one), and distributed chunks; the sink's gradient too. float64, TOL.
    lengths, ids, placement = dispatch_case(only_local)
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(rng.randint(0, 100))
    seqs = {
        s: tuple(torch.randn(lengths[s], h, HEAD_DIM, generator=gen, dtype=torch.float64)
                 for h in (4, 2, 2))
        for s in ids
    }  # fmt: skip
    layout = build_rank_layout(ids, placement, lengths, cp_rank=0, cp_size=1)
    for window in (None, 8):
        sink = _sinks(4, 1)
        call = through_attention_function(
            layout, seqs, scaling=0.4, sliding_window=window, s_aux=sink
        )
        ref_sink = sink.detach().clone().requires_grad_()
        reference = functools.partial(sink_reference, sink=ref_sink, window=window, scale=0.4)
        check_call(call, seqs, reference, TOL, window)
        assert (sink.grad - ref_sink.grad).abs().max().item() < TOL


def test_attention_function_refuses_bad_sinks_and_flash() -> None:
    layout = build_rank_layout([0], [0], [5], cp_rank=0, cp_size=1)
    q = torch.zeros(1, 4, 5, HEAD_DIM, dtype=torch.bfloat16)
    kv = torch.zeros(1, 2, 5, HEAD_DIM, dtype=torch.bfloat16)
    with attention_context(SkrullAttentionContext.build(layout)):
        with pytest.raises(ValueError, match=r"s_aux=\(3,\); attention sinks are one logit"):
            skrull_attention_forward(None, q, kv, kv, None, s_aux=torch.zeros(3))
    ctx = SkrullAttentionContext.build(layout)
    flash = dataclasses.replace(ctx, backend="flash", auto=False)
    with attention_context(flash):
        with pytest.raises(ValueError, match=r"'flash' cannot run .* attention sinks"):
            skrull_attention_forward(None, q, kv, kv, None, s_aux=torch.zeros(4))
    # "auto" runs the layer on sdpa: the same result as the sdpa context
    auto = dataclasses.replace(ctx, backend="flash", auto=True)
    qr = torch.randn(1, 4, 5, HEAD_DIM).bfloat16()
    kr = torch.randn(1, 2, 5, HEAD_DIM).bfloat16()
    runs = []
    for c in (auto, ctx):
        with attention_context(c):
            runs.append(skrull_attention_forward(None, qr, kr, kr, None, s_aux=torch.ones(4))[0])
    assert torch.equal(runs[0], runs[1])


# ----------------------------------------------------------------------------- the whole model


# Two micro-batches on one process (CP 1): a sequence of 23 tokens as a "distributed" one (two
# chunks, lower-right causal blocks) beside local ones, then three local ones; a fully masked
# sequence and a 1-token one. Every sequence but three exceeds the 3-key window.
SAMPLES = make_samples([23, 1, 2, 9, 17, 5], seed=1, prompt={0: 3}, fully_masked=(2,))
PLAN = GlobalBatchPlan(
    micro_batches=(
        (
            MicroBatchPlan((0, 1, 2), (DISTRIBUTED, 0, 0)),
            MicroBatchPlan((3, 4, 5), (0, 0, 0)),
        ),
    ),
    dp_size=1,
    cp_size=1,
    bucket_size=32,
    policy="hand",
)


def _own_scale(name: str) -> bool:
    """The parameters held to their own largest gradient: experts, router, sinks."""
    return ".experts." in name or ".router." in name or name.endswith("sinks")


@pytest.mark.parametrize("chunked", [False, True], ids=["dense-loss", "chunked-loss"])
def test_packed_model_equals_hf_per_sequence(chunked: bool, monkeypatch: Any) -> None:
    """Float32, HF eager on each sequence alone against the prepared model on the packed
    micro-batches: the loss to LOSS_RTOL, every gradient (sinks, biases, router, experts) to
    GRAD_RTOL of the largest and each router, expert and sink tensor to EXPERT_RTOL of its own
    largest (tests/harness.py's bounds: the same kernels, packing changes the rows the matmuls
    see and the summation order). With the sinks dropped the loss is far off."""
    ref = gpt_oss_model()
    model = prepare_model(copy.deepcopy(ref), backend="sdpa", chunked_loss=chunked)
    packed = check_packed_parity(ref, model, SAMPLES, PLAN, _own_scale)
    for calls in packed.routing.values():  # the batch reaches every expert of both layers
        used = torch.cat([c["experts"].flatten() for c in calls]).unique()
        assert len(used) == model.config.num_local_experts
    # the same run ignoring the sinks: the check above could fail
    monkeypatch.setattr(dispatch, "attention_sink", lambda s_aux, num_heads: None)
    model.zero_grad(set_to_none=True)
    wrong = forward_backward(model, packed.batch, cp_group=None, backend="sdpa")
    ref_loss = packed.reference_loss
    assert abs(float(wrong) - ref_loss) > 100 * LOSS_RTOL * ref_loss  # measured 3.2e-4 rel.


def test_setup_refuses_flash_mxfp4_experts_and_the_router_loss() -> None:
    from transformers.integrations.mxfp4 import Mxfp4GptOssExperts

    with pytest.raises(ValueError, match=r"'flash' cannot train GptOssForCausalLM.*sinks"):
        prepare_model(gpt_oss_model(), backend="flash")
    quantized = gpt_oss_model()
    for layer in quantized.model.layers:  # what from_pretrained builds with the MXFP4 kernels
        layer.mlp.experts = Mxfp4GptOssExperts(quantized.config)
    with pytest.raises(
        ValueError,
        match=r"MXFP4-quantized \(model.layers.0.mlp.experts, "
        r"model.layers.1.mlp.experts:.*Mxfp4Config\(dequantize=True\)",
    ):
        check_model(quantized)
    with pytest.raises(ValueError, match="output_router_logits=True"):
        check_model(gpt_oss_model(output_router_logits=True))
    model = prepare_model(gpt_oss_model(), backend="auto")
    assert model.config.model_type in AUX_LOSS_MODEL_TYPES
    with pytest.raises(ValueError, match="called with output_router_logits=True"):
        model(input_ids=torch.tensor([[3, 4]]), output_router_logits=True)


# ----------------------------------------------------------------------------- shape, counts
def test_published_sizes() -> None:
    """gpt-oss-20b and -120b as their config.json sets them: 20.91B and 116.83B parameters,
    3.61B and 5.13B active per token (the model card's table, which leaves the embedding out:
    half the FLOPs per token of every matmul a token runs, LM head included)."""
    from transformers import GptOssConfig

    for layers, experts, total, active in ((24, 32, 20.91, 3.61), (36, 128, 116.83, 5.13)):
        config = GptOssConfig(num_hidden_layers=layers, num_local_experts=experts)
        shape = ModelShape.from_hf_config(config)
        assert (shape.sliding_layers, shape.sliding_window, shape.num_key_value_heads) == (
            layers // 2,
            128,
            8,
        )
        assert parameter_count(shape).total / 1e9 == pytest.approx(total, abs=0.005)
        assert shape.linear_flops_per_token() / 2e9 == pytest.approx(active, abs=0.005)


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True, "num_key_value_heads": 4}])
def test_parameter_count_equals_hugging_face(overrides: dict[str, Any]) -> None:
    # Exact: q/k/v/o biases, sinks, the router's weight and bias, every expert's gate/up and
    # down projections and biases, the norms, a tied or untied head.
    model = tiny_model("gpt_oss", **overrides)
    count = parameter_count(
        ModelShape.from_hf_config(model.config), tied_head=model.config.tie_word_embeddings
    )
    assert count.total == sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
    assert count.per_layer == largest


def test_flops_match_torch_flop_counter() -> None:
    # torch's counter on HF's eager forward and backward with the eager experts (as
    # tests/scheduling/test_cost_model.py): every matmul is counted, biases, sinks, softmax and the GLU are
    # not, and eager attention computes every (query, key) pair of every layer, the window's
    # masked ones too. So the counter gives s * linear_flops_per_token + s^2 * the pair FLOPs
    # of all layers, exactly (tolerance 0), for a batch that reaches every expert.
    from torch.utils.flop_counter import FlopCounterMode

    model = tiny_model("gpt_oss", experts_implementation="eager")
    shape = ModelShape.from_hf_config(model.config)
    pair = 2 * (shape.q_dim + shape.out_dim) * shape.num_layers
    for s in (1, 5, 24):
        ids = torch.randint(0, 64, (1, s), generator=torch.Generator().manual_seed(s))
        expected = s * shape.linear_flops_per_token() + s * s * pair
        with FlopCounterMode(display=False) as forward:
            model(input_ids=ids, use_cache=False)
        assert model_flops(forward) == expected, s
        with FlopCounterMode(display=False) as train:
            model(input_ids=ids, use_cache=False).logits.sum().backward()
        assert model_flops(train) == 3 * expected
    # the cost model's own count skips the window's masked pairs of the sliding layer
    assert shape.forward_flops(24) == 24 * shape.linear_flops_per_token() + (
        24 * 25 // 2 * shape.attention_flops_per_pair()
        + window_pairs(24, 3) * shape.sliding_attention_flops_per_pair()
    )


def _mlp_kept_bytes(tokens: int, dtype: torch.dtype, experts: str) -> int:
    """Bytes autograd still holds after gpt-oss's MLP (router and experts) runs on ``tokens``
    tokens: each storage once, its parameters and its input (the norm's output, counted with
    the norms) left out."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = tiny_config("gpt_oss", hidden_size=64, intermediate_size=32, num_local_experts=8)
    config._experts_implementation = experts
    torch.manual_seed(0)
    mlp = GptOssMLP(config).to(dtype)
    for p in mlp.parameters():  # spread the tokens over the experts
        nn.init.normal_(p, std=0.1)
    x = torch.randn(1, tokens, 64, dtype=dtype, requires_grad=True)
    skip = {t.untyped_storage().data_ptr() for t in (x, *mlp.parameters())}
    return kept_bytes(lambda: mlp(x), skip)


@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_estimate_is_what_autograd_keeps(experts: str, dtype: torch.dtype) -> None:
    # The MLP's bytes per token (512 tokens less 256, so constants cancel) against the sparse
    # layer's estimate less its norms and attention (the same shape without experts: a dense
    # layer, less its SwiGLU's 4 b f), to the byte.
    kept = (_mlp_kept_bytes(512, dtype, experts) - _mlp_kept_bytes(256, dtype, experts)) / 256
    config = tiny_config("gpt_oss", hidden_size=64, intermediate_size=32, num_local_experts=8)
    shape = ModelShape.from_hf_config(config)
    attention_only = dataclasses.replace(
        shape, num_experts=0, experts_per_token=0, expert_intermediate_size=0, sparse_layers=0,
        expert_bias=False, clamped_glu=False,
    )  # fmt: skip
    b = torch.empty((), dtype=dtype).element_size()
    _, sparse = layer_bytes_per_token(shape, bytes_per_element=b, experts_implementation=experts)  # type: ignore[arg-type]
    dense, _ = layer_bytes_per_token(attention_only, bytes_per_element=b)
    kept -= sentinel_mask_bytes(shape, experts)
    assert kept == sparse - (dense - 4 * b * shape.intermediate_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_estimate_is_what_autograd_keeps(dtype: torch.dtype) -> None:
    # The whole layer to the byte, float32 and bf16: the norms (their weights applied in
    # float32), attention with its biases and sinks, the router and the grouped_mm experts.
    # Reference: the tensors autograd keeps in a forward of the prepared model (the sdpa
    # backend at CP 1, the attention training runs; HF runs gpt-oss's sinks in eager attention
    # only, which keeps the score matrix). The sinks' copies of q, k and v, which the estimate
    # leaves out, measured: on CPU q and k carry one more column per head (b (h_q + h_kv)
    # heads' worth); on CUDA that column is padded to 8 - d % 8 and masked GQA calls repeat K/V
    # over the query heads (lightning_skrull.attention.sdpa), which this CPU run cannot show.
    # CPU-only, subtracted: v padded to q's d + 1 columns (b x h_kv) and the padded output SDPA
    # saves beside the cropped copy o_proj takes (b x heads x (d + 1)); on CUDA v keeps its
    # width and the output is o_proj's input, as in tests/models/test_memory_estimate.py's dense test.
    def config(layers: int) -> Any:
        return tiny_config("gpt_oss", hidden_size=64, intermediate_size=32, num_local_experts=8,
                           num_hidden_layers=layers, layer_types=["full_attention"] * layers)  # fmt: skip

    b = torch.empty((), dtype=dtype).element_size()
    shape = ModelShape.from_hf_config(config(1))
    hq, hkv, d = shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim
    measured = prepared_layer_per_token(config, dtype)
    sink_columns = b * (hq + hkv)
    cpu_only = b * hkv + b * hq * (d + 1)
    _, sparse = layer_bytes_per_token(shape, bytes_per_element=b)
    mask = sentinel_mask_bytes(shape, "grouped_mm")
    assert measured - cpu_only - sink_columns - mask == sparse
