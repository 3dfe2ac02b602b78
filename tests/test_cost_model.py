"""The cost model: FLOPs by hand and by torch's FLOP counter, tiles, communication, fitting."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from lightning_skrull.scheduling import (
    POLICIES,
    CostModel,
    FitSample,
    fit_cost_model,
    plan_global_batch,
    simulate,
)
from lightning_skrull.scheduling.cost_model import (
    QWEN2_5_0_5B,
    QWEN2_5_7B,
    causal_tiles,
    zigzag_bounds,
    zigzag_tiles,
    zigzag_tiles_many,
)
from lightning_skrull.scheduling.sequence_costs import BULK_SEQUENCES, SequenceCosts

TINY = dict(
    hidden_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
    intermediate_size=16,
    vocab_size=10,
)


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
        assert forward.get_total_flops() == expected
        with FlopCounterMode(display=False) as train:
            model(input_ids=ids, use_cache=False).logits.sum().backward()
        assert train.get_total_flops() == 3 * expected  # the train_flops_factor


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
