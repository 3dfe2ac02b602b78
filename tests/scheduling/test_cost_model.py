"""The cost model: FLOPs by hand and by torch's FLOP counter, tiles, communication, fitting."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from helpers import model_flops
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from lightning_skrull.scheduling import (
    POLICIES,
    CostModel,
    FitSample,
    ModelShape,
    fit_cost_model,
    plan_global_batch,
    simulate,
)
from lightning_skrull.scheduling.sequence_costs import BULK_SEQUENCES, SequenceCosts
from lightning_skrull.scheduling.shapes import QWEN2_5_0_5B, QWEN2_5_7B
from lightning_skrull.scheduling.tiles import (
    causal_tiles,
    window_pairs,
    window_tiles,
    zigzag_bounds,
    zigzag_tiles,
    zigzag_tiles_many,
    zigzag_window_tiles,
)

TINY = dict(
    hidden_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
    intermediate_size=16,
    vocab_size=10,
)


DENSE_FIELDS = ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "vocab_size")  # fmt: skip


def tiny_model() -> CostModel:
    return CostModel.from_hf_config(Qwen2Config(**TINY))


def test_flops_by_hand_for_a_small_config() -> None:
    shape = tiny_model().shape
    # Per layer and token: q 2*8*8=128, k 2*8*4=64, v 64, o 2*8*8=128,
    # MLP gate/up/down 3*2*8*16=768 -> 1152; two layers 2304; LM head 2*8*10=160.
    assert shape.linear_flops_per_token() == 2464
    # Per (query, key) pair and layer: QK^T 2*4 and PV 2*4 per head, 2 heads -> 32; two layers.
    assert shape.attention_flops_per_pair() == 64
    # 5 tokens, causal: 5*6/2 = 15 pairs.
    assert shape.forward_flops(5) == 5 * 2464 + 15 * 64 == 13280


def test_flops_match_torch_flop_counter_on_a_real_qwen2() -> None:
    # Independent reference: torch counts every matmul of a real HF Qwen2 forward/backward.
    # Eager attention multiplies the full square (masking comes after), so the counter sees
    # s*s pairs where the model charges the causal s*(s+1)/2; the test adds the difference.
    # Exact: both count 2*M*N*K per matmul; biases, norms, softmax are not counted by either.
    config = Qwen2Config(**TINY, attn_implementation="eager", tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    shape = tiny_model().shape
    for s in (1, 5, 13):
        ids = torch.randint(0, 10, (1, s))
        with FlopCounterMode(display=False) as forward:
            model(input_ids=ids, use_cache=False)
        full_square = s * s - s * (s + 1) // 2
        expected = shape.forward_flops(s) + full_square * shape.attention_flops_per_pair()
        assert model_flops(forward) == expected
        with FlopCounterMode(display=False) as train:
            model(input_ids=ids, use_cache=False).logits.sum().backward()
        assert model_flops(train) == 3 * expected  # the train_flops_factor


def test_from_hf_config_reads_gqa_and_defaults() -> None:
    shape = tiny_model().shape
    assert (shape.q_dim, shape.kv_dim, shape.num_layers) == (8, 4, 2)
    no_gqa = CostModel.from_hf_config(
        Qwen2Config(
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=None,
            intermediate_size=8,
            vocab_size=4,
        )
    )
    assert no_gqa.shape.head_dim == 4 and no_gqa.shape.num_key_value_heads == 4
    model = CostModel.from_hf_config(Qwen2Config(**TINY), achieved_flops=1e12, tile_size=64)
    assert (model.achieved_flops, model.tile_size) == (1e12, 64)


def test_named_shapes_are_the_published_configs() -> None:
    # Qwen2.5-0.5B and -7B's config.json values (hidden, layers, heads, KV heads, MLP, vocab).
    for shape, (h, layers, heads, kv, ffn, vocab) in (
        (QWEN2_5_0_5B, (896, 24, 14, 2, 4864, 151936)),
        (QWEN2_5_7B, (3584, 28, 28, 4, 18944, 152064)),
    ):
        config = Qwen2Config(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab)  # fmt: skip
        assert CostModel.from_hf_config(config).shape == shape


def test_from_hf_config_refuses_a_config_without_the_shape() -> None:
    class NotADecoder:
        hidden_size = 8

    with pytest.raises(ValueError, match=r"lacks .*num_hidden_layers"):
        CostModel.from_hf_config(NotADecoder())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("achieved_flops", 0.0),
        ("comm_bandwidth", -1.0),
        ("micro_batch_overhead_s", -1e-3),
        ("tile_size", 0),
        ("bytes_per_element", 1.5),
        ("comm_latency_s", float("inf")),
    ],
)
def test_invalid_constants_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"CostModel.{field}="):
        CostModel(**{field: value})


def brute_force_blocks(start: int, end: int, tile: int) -> int:
    """Blocks (query tile x key tile) holding at least one causal pair, by enumeration."""
    blocks = 0
    q_tiles = range(start, end, tile)
    for q0 in q_tiles:
        q1 = min(q0 + tile, end)
        for k0 in range(0, q1, tile):  # key tiles aligned at position 0
            if k0 <= q1 - 1:  # the last query of the tile sees key k0
                blocks += 1
    return blocks


def test_causal_tiles_counts_the_blocks_a_kernel_computes() -> None:
    rng = random.Random(0)
    for _ in range(300):
        tile = rng.choice([1, 3, 16, 128])
        start = rng.randint(0, 400)
        end = start + rng.randint(1, 400)
        assert causal_tiles(start, end, tile) == brute_force_blocks(start, end, tile)
    assert causal_tiles(0, 7, 1) == 7 * 8 // 2  # tile 1: exact causal pairs


def test_zigzag_tiles_sums_the_chunks() -> None:
    rng = random.Random(1)
    lengths = list(range(1, 120)) + [rng.randint(1, 300_000) for _ in range(100)]
    for s in lengths:
        for cp in (1, 3, 8):
            for tile in (1, 64, 128):
                b = zigzag_bounds(s, cp)
                assert b[0] == 0 and b[-1] == s
                reference = sum(
                    brute_force_blocks(b[i], b[i + 1], tile)
                    if s < 2_000
                    else causal_tiles(b[i], b[i + 1], tile)
                    for i in range(2 * cp)
                    if b[i + 1] > b[i]
                )
                assert zigzag_tiles(s, cp, tile) == reference


def test_zigzag_tiles_many_equals_one_at_a_time() -> None:
    # The vectorised form against the scalar one, including lengths its closed form leaves to
    # the scalar (q == 0 or q a multiple of the tile), and the cost table's bulk path.
    rng = random.Random(3)
    for cp in (1, 3, 16):
        for tile in (1, 64, 128):
            lengths = [rng.randint(1, 300_000) for _ in range(500)] + list(range(0, 200))
            lengths += [2 * cp * tile * k for k in range(1, 20)]
            assert zigzag_tiles_many(lengths, cp, tile) == [
                zigzag_tiles(s, cp, tile) for s in lengths
            ]
    model = CostModel(tile_size=64)
    lengths = [rng.randint(1, 100_000) for _ in range(BULK_SEQUENCES)]
    bulk = SequenceCosts(lengths, 16, model)
    small = SequenceCosts(lengths[:10], 16, model)
    assert [bulk.distributed(i) for i in range(10)] == [small.distributed(i) for i in range(10)]
    assert bulk.distributed(10) == model.distributed_seconds(lengths[10], 16)


def test_sharding_a_short_sequence_wastes_tiles() -> None:
    model = CostModel()  # tile 128
    # 512 tokens whole: 4 x 5 / 2 = 10 blocks. Over 8 ranks: 16 chunks of 32 tokens, each a
    # padded block row against its keys: ceil(end / 128) blocks each, 40 in all (5 per rank).
    assert causal_tiles(0, 512, 128) == 10
    assert zigzag_tiles(512, 8, 128) == sum((32 * (i + 1) + 127) // 128 for i in range(16)) == 40
    whole = model.local_attention_seconds(512)
    per_rank = model.distributed_attention_seconds(512, 8)
    assert per_rank * 8 == pytest.approx(whole * 4.0, rel=1e-12)  # 4x the work, spread


def test_distributed_lower_bound_is_a_lower_bound() -> None:
    rng = random.Random(2)
    lengths = list(range(1, 400)) + [rng.randint(1, 400_000) for _ in range(500)]
    for tile in (1, 16, 128):
        for cp in (1, 2, 3, 8, 16):
            costs = SequenceCosts(lengths, cp, CostModel(tile_size=tile))
            for sid in range(len(lengths)):
                assert costs.distributed_lower_bound(sid) <= costs.distributed(sid) * (1 + 1e-12)


def test_communication_by_hand() -> None:
    model = CostModel.from_hf_config(
        Qwen2Config(**TINY), comm_latency_s=1e-3, comm_bandwidth=1e6, bytes_per_element=2
    )
    # 2 layers x 2 directions = 4 collectives; per token K and V of kv_dim 4 in 2 bytes = 16 B;
    # 100 tokens over 4 ranks: each receives 3/4 of them.
    assert model.num_collectives(4) == 4
    assert model.comm_bytes(100, 4) == 4 * 16 * 100 * 3 / 4
    assert model.comm_seconds(100, 4) == pytest.approx(4e-3 + 4800 / 1e6, rel=1e-12)
    assert model.comm_seconds(0, 4) == 0.0 and model.comm_seconds(100, 1) == 0.0


def synthetic_samples(truth: CostModel, count: int, seed: int) -> list[FitSample]:
    """Steps of various shapes timed by ``truth`` itself (a perfect measurement)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        cp = rng.choice([2, 4, 8])
        c = rng.choice([4_000, 8_000, 16_000])
        lengths = [
            min(int(rng.lognormvariate(7, 1.3)) + 1, cp * c) for _ in range(rng.randint(4, 60))
        ]
        plan = plan_global_batch(
            lengths,
            dp_size=rng.choice([1, 2]),
            cp_size=cp,
            bucket_size=c,
            cost_model=truth,
            policy=rng.choice(POLICIES),
        )
        out.append(FitSample(plan, lengths, simulate(plan, lengths, truth)))
    return out


def test_fit_recovers_the_constants() -> None:
    truth = CostModel(
        achieved_flops=3e14, micro_batch_overhead_s=5e-3, comm_latency_s=50e-6, comm_bandwidth=40e9
    )
    fitted = fit_cost_model(CostModel(), synthetic_samples(truth, 30, seed=0))
    # Noise-free data from the same model family: exact up to least-squares round-off.
    for name in ("achieved_flops", "micro_batch_overhead_s", "comm_latency_s", "comm_bandwidth"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6), name


def test_fit_keeps_what_the_samples_cannot_identify() -> None:
    truth = CostModel(achieved_flops=2e14, micro_batch_overhead_s=1e-3)
    rng = random.Random(3)
    samples = []
    for _ in range(12):  # CP = 1: no communication at all
        lengths = [rng.randint(10, 5_000) for _ in range(rng.randint(2, 20))]
        plan = plan_global_batch(lengths, dp_size=1, cp_size=1, bucket_size=8_000, cost_model=truth)
        samples.append((plan, lengths, simulate(plan, lengths, truth)))
    start = CostModel(comm_latency_s=7e-6, comm_bandwidth=12e9)
    fitted = fit_cost_model(start, samples)
    assert fitted.achieved_flops == pytest.approx(2e14, rel=1e-6)
    assert fitted.micro_batch_overhead_s == pytest.approx(1e-3, rel=1e-6)
    assert (fitted.comm_latency_s, fitted.comm_bandwidth) == (7e-6, 12e9)


def test_fit_needs_two_samples_and_positive_times() -> None:
    plan = plan_global_batch([5], dp_size=1, cp_size=1, bucket_size=8)
    with pytest.raises(ValueError, match="at least 2 measured steps"):
        fit_cost_model(CostModel(), [(plan, [5], 1.0)])
    with pytest.raises(ValueError, match=r"seconds=0\.0 is invalid"):
        fit_cost_model(CostModel(), [(plan, [5], 1.0), (plan, [5], 0.0)])
    with pytest.raises(TypeError, match="FitSample or"):
        fit_cost_model(CostModel(), [plan, plan])


def test_from_dict_inverts_asdict() -> None:
    import dataclasses

    model = CostModel().with_constants(achieved_flops=1.5e14, per_sequence_seconds=3e-4)
    assert CostModel.from_dict(dataclasses.asdict(model)) == model


# ----------------------------------------------------------------------------- Mixture-of-Experts
MOE_TINY = dict(TINY, hidden_size=8, intermediate_size=12, tie_word_embeddings=False)
MOE_FAMILIES = {
    # Qwen3-MoE with its first layer dense (mlp_only_layers): a dense MLP of intermediate_size
    # there, 6 experts of width 4 (2 per token) on the other two.
    "qwen3_moe": dict(MOE_TINY, num_hidden_layers=3, mlp_only_layers=[0], num_experts=6,
                      num_experts_per_tok=2, moe_intermediate_size=4, norm_topk_prob=True),
    # Qwen2-MoE: the same experts plus a shared expert of width 8 and its sigmoid gate.
    "qwen2_moe": dict(MOE_TINY, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=4,
                      shared_expert_intermediate_size=8),
    # Mixtral: 4 experts of intermediate_size, 2 per token, on every layer.
    "mixtral": dict(MOE_TINY, num_local_experts=4, num_experts_per_tok=2),
    # DeepSeek-V3: Multi-head Latent Attention (q LoRA rank 6, k/v latent 5, q/k heads 4 + 2
    # rotary, values 3; its config's head_dim is the rotary part's), first layer dense, 8
    # sigmoid-routed experts in 4 groups (3 per token, from 2 groups: with 2, the 24 test tokens
    # leave an expert without one) and 2 shared ones; tests/models/test_mla_moe.py.
    "deepseek_v3": dict(MOE_TINY, num_hidden_layers=3, num_key_value_heads=2, head_dim=2,
                        q_lora_rank=6, kv_lora_rank=5, qk_nope_head_dim=4, qk_rope_head_dim=2,
                        v_head_dim=3, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                        topk_group=2, moe_intermediate_size=4, n_shared_experts=2,
                        first_k_dense_replace=1),
    # GLM-4-MoE: GQA 2/1 with q/k/v bias and q/k norms, the DeepSeek-V3 router in one group.
    "glm4_moe": dict(MOE_TINY, num_hidden_layers=3, num_key_value_heads=1, head_dim=4,
                     attention_bias=True, use_qk_norm=True, n_routed_experts=6,
                     num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=4,
                     n_shared_experts=1, first_k_dense_replace=1),
    # DeepSeek-V2-Lite's attention (no q LoRA; a latent of 6, an even width its complex RoPE
    # needs under the counter), softmax routing, group-limited greedy, 3 experts per token (with
    # 2, the 24 test tokens leave an expert without one).
    "deepseek_v2": dict(MOE_TINY, num_hidden_layers=3, num_key_value_heads=2, head_dim=2,
                        q_lora_rank=None, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=3,
                        n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                        topk_method="group_limited_greedy", moe_intermediate_size=4,
                        n_shared_experts=2, first_k_dense_replace=1),
}  # fmt: skip


def moe_model(family: str, **overrides: object) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **{**MOE_FAMILIES[family], **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, experts_implementation="eager")


def test_moe_flops_by_hand() -> None:
    from transformers import AutoConfig

    shape = CostModel.from_hf_config(
        AutoConfig.for_model("qwen2_moe", **MOE_FAMILIES["qwen2_moe"])
    ).shape
    assert (shape.num_experts, shape.experts_per_token, shape.sparse_layers) == (6, 2, 2)
    # Per sparse layer and token: router 2*8*6 = 96; two experts of 3 matmuls 2*8*4 each: 384;
    # shared expert 3 * 2*8*8 = 384 and its gate 2*8 = 16 -> 880.
    assert shape.sparse_mlp_flops_per_token() == 880
    # Attention projections 2 * (128 + 64) = 384 per layer (as the dense test), LM head 160.
    assert shape.linear_flops_per_token() == 2 * (384 + 880) + 160
    qwen3 = CostModel.from_hf_config(
        AutoConfig.for_model("qwen3_moe", **MOE_FAMILIES["qwen3_moe"])
    ).shape
    # Layer 0 is dense (mlp_only_layers): 3 * 2*8*12 = 576; the two sparse ones 96 + 384.
    assert (qwen3.sparse_layers, qwen3.dense_layers) == (2, 1)
    assert qwen3.linear_flops_per_token() == 3 * 384 + 576 + 2 * 480 + 160


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_moe_flops_match_torch_flop_counter(family: str) -> None:
    # Independent reference: torch's counter on a real HF MoE forward and backward, with
    # transformers' "eager" experts (a loop over the experts that got tokens; its default
    # "grouped_mm" kernel is not counted by FlopCounterMode). Every matmul costs 2*M*N*K and
    # M, an expert's rows, sums over the experts to tokens x top-k exactly however the router
    # spreads the tokens: the loop skips an expert with no rows, which would cost 0 anyway. So
    # the count is exact (tolerance 0), checked with a router that spreads the tokens over every
    # expert and with one (zero weights, every probability equal) that sends every token to the
    # same top-k experts.
    model = moe_model(family)
    shape = CostModel.from_hf_config(model.config).shape
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    assert len(gates) == shape.sparse_layers
    chosen: list[torch.Tensor] = []
    for gate in gates:
        gate.register_forward_hook(lambda _m, _i, out: chosen.append(out[2]))
    for concentrated in (False, True):
        if concentrated:
            with torch.no_grad():
                for gate in gates:
                    gate.weight.zero_()
        for s in (1, 5, 24):
            chosen.clear()
            ids = torch.randint(0, 10, (1, s), generator=torch.Generator().manual_seed(s))
            with FlopCounterMode(display=False) as forward:
                model(input_ids=ids, use_cache=False)
            hit = [int(c.unique().numel()) for c in chosen]
            if s == 24:
                k = shape.experts_per_token
                assert hit == [k] * len(gates) if concentrated else min(hit) == shape.num_experts
            full_square = s * s - s * (s + 1) // 2
            expected = shape.forward_flops(s) + full_square * shape.attention_flops_per_pair()
            assert model_flops(forward) == expected, (family, concentrated, s)
            with FlopCounterMode(display=False) as train:
                model(input_ids=ids, use_cache=False).logits.sum().backward()
            assert model_flops(train) == 3 * expected  # the train_flops_factor


def test_moe_shape_reads_the_configs() -> None:
    from transformers import AutoConfig, MixtralConfig, Qwen3MoeConfig

    from lightning_skrull.scheduling.shapes import MIXTRAL_8X7B, QWEN3_30B_A3B

    # the published config.json values of Qwen/Qwen3-30B-A3B and mistralai/Mixtral-8x7B-v0.1
    qwen3 = Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                           num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                           moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                           decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                           vocab_size=151936, tie_word_embeddings=False)  # fmt: skip
    assert ModelShape.from_hf_config(qwen3) == QWEN3_30B_A3B
    mixtral = MixtralConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, intermediate_size=14336, num_local_experts=8,
                            num_experts_per_tok=2, vocab_size=32000)  # fmt: skip
    assert ModelShape.from_hf_config(mixtral) == MIXTRAL_8X7B
    # A Qwen3-MoE with no sparse layer (every layer in mlp_only_layers) is a dense decoder.
    dense = AutoConfig.for_model("qwen3_moe", **dict(MOE_FAMILIES["qwen3_moe"],
                                                     mlp_only_layers=[0, 1, 2]))  # fmt: skip
    assert ModelShape.from_hf_config(dense).num_experts == 0


def test_unknown_moe_config_is_refused() -> None:
    from transformers import AutoConfig

    olmoe = AutoConfig.for_model("olmoe", hidden_size=8, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=4, vocab_size=10)  # fmt: skip
    with pytest.raises(ValueError, match=r"model_type='olmoe'.*num_experts.*does not read"):
        CostModel.from_hf_config(olmoe)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(experts_per_token=2), "num_experts=0 but expert fields"),
        (dict(num_experts=4, experts_per_token=5, expert_intermediate_size=4, sparse_layers=2),
         "1 <= experts_per_token <= num_experts"),
        (dict(num_experts=4, experts_per_token=2, expert_intermediate_size=4, sparse_layers=3),
         "1 <= sparse_layers <= num_layers"),
        (dict(num_experts=-1), r"num_experts=-1 is invalid; give an int >= 0"),
        (dict(qk_norm=1), r"qk_norm=1 is invalid; give a bool"),
    ],
)  # fmt: skip
def test_invalid_moe_shapes_are_refused(fields: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(tiny_model().shape, **fields)


def test_a_checkpointed_dense_model_still_loads() -> None:
    # Cost models saved before the expert fields existed: the dict has the seven dense fields.
    values = dataclasses.asdict(CostModel())
    values["shape"] = {k: v for k, v in values["shape"].items() if k in DENSE_FIELDS}
    assert CostModel.from_dict(values) == CostModel()


# ----------------------------------------------------------------------------- sliding windows
def hf_window_mask(length: int, window: int) -> torch.Tensor:
    """transformers' own sliding-window causal mask of one sequence, ``[L, L]`` bool."""
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    return sdpa_mask(
        batch_size=1,
        q_length=length,
        kv_length=length,
        mask_function=sliding_window_causal_mask_function(window),
        allow_is_causal_skip=False,
    )[0, 0]


def brute_force_window_blocks(start: int, end: int, tile: int, window: int) -> int:
    """Blocks (query tile x key tile, key tiles aligned at 0) holding at least one pair that
    transformers' window mask of the whole sequence allows, by enumeration."""
    mask = hf_window_mask(end, window)
    blocks = 0
    for q0 in range(start, end, tile):
        rows = mask[q0 : min(q0 + tile, end)]
        blocks += sum(bool(rows[:, k0 : k0 + tile].any()) for k0 in range(0, end, tile))
    return blocks


def test_window_pairs_count_transformers_mask() -> None:
    # W (W + 1) / 2 + (s - W) W pairs for s > W, s (s + 1) / 2 otherwise: the True entries of
    # transformers' own mask, windows shorter than, equal to and longer than the sequence
    for length in (1, 2, 7, 30, 64):
        for window in (1, 2, 5, 7, 30, 100):
            assert window_pairs(length, window) == int(hf_window_mask(length, window).sum())
    assert window_pairs(10, 4) == 4 * 5 // 2 + 6 * 4


def test_window_tiles_count_the_blocks_a_kernel_computes() -> None:
    rng = random.Random(5)
    for _ in range(150):
        tile = rng.choice([1, 3, 16])
        window = rng.choice([1, 2, 5, 17, 40, 500])
        start = rng.randint(0, 90)
        end = start + rng.randint(1, 90)
        want = brute_force_window_blocks(start, end, tile, window)
        assert window_tiles(start, end, tile, window) == want, (start, end, tile, window)
    # tile 1: exact pairs; a window no query reaches back past: the causal blocks
    assert window_tiles(0, 50, 1, 8) == window_pairs(50, 8)
    assert window_tiles(10, 400, 128, 400) == causal_tiles(10, 400, 128)
    # a long sequence: far fewer blocks than causal (4096 window, 32k tokens, tile 128)
    assert window_tiles(0, 32768, 128, 4096) < causal_tiles(0, 32768, 128) / 3
    for s in (1, 5, 33, 97, 1000):
        for cp in (1, 2, 3):
            b = zigzag_bounds(s, cp)
            want = sum(
                brute_force_window_blocks(b[i], b[i + 1], 16, 12) if s < 200 else
                window_tiles(b[i], b[i + 1], 16, 12)
                for i in range(2 * cp)
                if b[i + 1] > b[i]
            )  # fmt: skip
            assert zigzag_window_tiles(s, cp, 16, 12) == want


def window_config(**overrides: object) -> Qwen2Config:
    return Qwen2Config(**{**TINY, "num_hidden_layers": 4, **overrides})


def test_windowed_shape_from_configs() -> None:
    from transformers import MistralConfig

    dense = ModelShape.from_hf_config(window_config())
    assert (dense.sliding_window, dense.sliding_layers) == (0, 0)
    # use_sliding_window=False: transformers drops the window, so does the shape
    assert ModelShape.from_hf_config(window_config(sliding_window=8)).sliding_layers == 0
    mixed = ModelShape.from_hf_config(
        window_config(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    )
    assert (mixed.sliding_window, mixed.sliding_layers, mixed.full_attention_layers) == (8, 3, 1)
    mistral = ModelShape.from_hf_config(MistralConfig(**{**TINY, "sliding_window": 16}))
    assert (mistral.sliding_window, mistral.sliding_layers) == (16, 2)
    for fields in ({"sliding_window": 8}, {"sliding_layers": 1}, {"sliding_window": 8,
                                                                  "sliding_layers": 5}):  # fmt: skip
        with pytest.raises(ValueError, match="a model without a window leaves both at 0"):
            dataclasses.replace(dense, num_layers=4, **fields)


def test_windowed_flops_count_each_layer_kind_apart() -> None:
    # A Qwen2 whose layers 1..3 slide over 8 tokens: forward FLOPs = the linear ones + the
    # causal pairs of layer 0 + transformers' window-mask pairs of layers 1..3, each pair
    # 4 * q_dim; counted here from the masks themselves, layer by layer.
    config = window_config(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    shape = ModelShape.from_hf_config(config)
    q_dim = shape.q_dim
    for length in (1, 8, 9, 30, 70):
        pairs = 0
        for layer_type in config.layer_types:
            window = 8 if layer_type == "sliding_attention" else length
            pairs += int(hf_window_mask(length, window).sum())
        linear = length * shape.linear_flops_per_token()
        assert shape.forward_flops(length) == linear + pairs * 4 * q_dim
    # no window: the dense numbers, unchanged
    dense = dataclasses.replace(shape, sliding_window=0, sliding_layers=0)
    assert dense.forward_flops(70) == 70 * dense.linear_flops_per_token() + 70 * 71 // 2 * (
        4 * 4 * q_dim
    )


@pytest.mark.parametrize("tile", [1, 16, 128])
def test_windowed_cost_model_and_cost_table(tile: int) -> None:
    # The cost of each layer kind apart: full layers as a dense model of those layers, sliding
    # layers by their window tiles; a window no sequence exceeds costs what full attention
    # does; the planners' table (one at a time and bulk) equals the cost model, and its lower
    # bound stays below.
    shape = dataclasses.replace(QWEN2_5_0_5B, sliding_window=1000, sliding_layers=18)
    model = CostModel(shape=shape, tile_size=tile)
    full_only = CostModel(shape=dataclasses.replace(shape, sliding_window=0, sliding_layers=0,
                                                    num_layers=6), tile_size=tile)  # fmt: skip
    q4 = 4 * shape.q_dim * 18
    for s in (1, 200, 1000, 1001, 5000, 70_000):
        t = tile
        want = full_only.local_attention_seconds(s) + model._seconds(
            window_tiles(0, s, t, 1000) * t * t * q4
        )
        assert model.local_attention_seconds(s) == pytest.approx(want, rel=1e-12)
        for cp in (2, 3):
            want = full_only.distributed_attention_seconds(s, cp) + model._seconds(
                zigzag_window_tiles(s, cp, t, 1000) * t * t * q4 / cp
            )
            assert model.distributed_attention_seconds(s, cp) == pytest.approx(want, rel=1e-12)
    dense = CostModel(shape=QWEN2_5_0_5B, tile_size=tile)
    for s in (1, 999, 1000):  # within the window: the full-attention cost
        assert model.local_attention_seconds(s) == pytest.approx(
            dense.local_attention_seconds(s), rel=1e-12
        )
    assert model.local_attention_seconds(70_000) < dense.local_attention_seconds(70_000) / 3
    rng = random.Random(tile)
    lengths = [rng.randint(1, 100_000) for _ in range(BULK_SEQUENCES)]
    for cp in (1, 4):
        bulk = SequenceCosts(lengths, cp, model)
        small = SequenceCosts(lengths[:20], cp, model)
        for sid in range(20):
            s = lengths[sid]
            assert small.local(sid) == pytest.approx(model.local_seconds(s), rel=1e-12)
            assert small.distributed(sid) == pytest.approx(
                model.distributed_seconds(s, cp), rel=1e-12
            )
            assert bulk.distributed(sid) == small.distributed(sid)
            assert small.distributed_lower_bound(sid) <= small.distributed(sid) * (1 + 1e-12)


def test_dense_costs_do_not_change() -> None:
    # Without a window the shape's pairs are those of every layer, bit for bit as before
    # windows were counted: the formulas of the full-attention model, written out here.
    model = CostModel(tile_size=64)
    shape = model.shape
    assert shape.sliding_layers == 0 and shape.full_attention_layers == shape.num_layers
    per_pair = shape.num_layers * 4 * shape.q_dim
    for s in (1, 63, 64, 65, 4096, 100_003):
        assert model.local_attention_seconds(s) == model._seconds(
            causal_tiles(0, s, 64) * 64 * 64 * per_pair
        )
        assert model.distributed_attention_seconds(s, 4) == model._seconds(
            zigzag_tiles(s, 4, 64) * 64 * 64 * per_pair / 4
        )
        assert shape.forward_flops(s) == s * shape.linear_flops_per_token() + s * (s + 1) // 2 * (
            per_pair
        )
