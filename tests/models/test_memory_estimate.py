"""The analytical activation-memory estimate against measured lines: the H200's fitted line for
Qwen2.5-0.5B (bf16), and the peak-RSS slope of CPU steps measured here (float32); a
Mixture-of-Experts layer's count against what autograd saves and against measured CPU steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import sentinel_mask_bytes, tiny_config
from kept_bytes import layer_per_token
from transformers import Qwen2Config

from benchmarks import memory_cpu
from benchmarks.memory_estimate import (
    activation_bytes_per_token,
    layer_bytes_per_token,
    model_state_bytes,
    parameter_count,
)
from lightning_skrull.models.checks import SUPPORTED_ARCHITECTURES
from lightning_skrull.scheduling.shapes import QWEN2_5_0_5B, QWEN3_30B_A3B, ModelShape

MIB = 2**20
H200_MIB_PER_TOKEN = 3.130
"""``bucket_size="auto"``'s fitted line on an H200 for a Qwen2.5-0.5B-shaped model in bf16 with
the dense loss (docs/benchmarks.md, GPU check): 3.130 MiB/token + 2.90 GiB."""


def test_estimate_explains_the_h200_line() -> None:
    dense = activation_bytes_per_token(QWEN2_5_0_5B, chunked_loss=False)
    # counted: 3.35 MiB/token. The count keeps every saved tensor alive at the head's backward;
    # the allocator frees some earlier, and the line also carries what is not per token. 10%.
    assert dense.total / MIB == pytest.approx(H200_MIB_PER_TOKEN, rel=0.10)
    chunked = activation_bytes_per_token(QWEN2_5_0_5B, chunked_loss=True)
    assert chunked.layers == dense.layers
    # the head is 62% of the dense step's activations and under 1% of the chunked one's
    assert dense.head / dense.total > 0.6 and chunked.head / chunked.total < 0.01


def test_estimate_matches_cpu_steps_measured_here() -> None:
    rows = memory_cpu.run([512, 1024], modes=("hf", "skrull_chunked"), repeats=1, parallel=2)
    config = Qwen2Config(**memory_cpu.CONFIG)

    def slope(mode: str) -> float:
        growth = {r["tokens"]: r["growth_mib"] for r in rows if r["mode"] == mode}
        return (growth[1024] - growth[512]) / 512

    dense = activation_bytes_per_token(config, chunked_loss=False, bytes_per_element=4)
    # float32 dense: 1.75 MiB/token counted, 1.78 measured (peak RSS moves in pages and the
    # allocator's arenas): 10%
    assert slope("hf") == pytest.approx(dense.total / MIB, rel=0.10)
    # chunked: 0.008 MiB/token counted, about 0.01 measured; what matters is that the head's
    # per-token cost is gone, so the bound is a tenth of one dense token's
    assert slope("skrull_chunked") < 0.1 * dense.total / MIB


# ----------------------------------------------------------------------------- Mixture-of-Experts
SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=96, vocab_size=128, tie_word_embeddings=False)  # fmt: skip
MOE = {
    # family: (its dense partner, the expert fields); Qwen2-MoE with its shared expert
    "qwen3_moe": ("qwen3", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=True)),
    "qwen2_moe": ("qwen2", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, norm_topk_prob=True)),
    "mixtral": ("mistral", dict(num_local_experts=8, num_experts_per_tok=2)),
}  # fmt: skip


def _config(model_type: str, layers: int, **fields: object) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **SMALL, num_hidden_layers=layers, **fields)


def _saved_bytes(config: Any, tokens: int, dtype: torch.dtype, experts: str | None) -> int:
    """Bytes of every tensor autograd saves in a forward of ``tokens`` tokens (each storage
    once, parameters left out); ``experts``: the MoE experts' implementation, None if dense."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    kwargs = {"experts_implementation": experts} if experts else {}
    model = AutoModelForCausalLM.from_config(config, **kwargs).to(dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=False)
    return sum(seen.values())


def _layer_per_token(
    model_type: str, dtype: torch.dtype, experts: str | None, **fields: object
) -> float:
    """Saved bytes per token of one decoder layer: the model with two layers less the one with
    one, at 512 tokens less 256."""
    return layer_per_token(
        lambda layers, tokens: _saved_bytes(
            _config(model_type, layers, **fields), tokens, dtype, experts
        ),
        (256, 512),
    )


@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
@pytest.mark.parametrize("family", sorted(MOE))
def test_moe_layer_estimate_is_what_autograd_saves(family: str, experts: str) -> None:
    # Reference: the tensors autograd saves in a real HF forward, counted by a saved-tensors
    # hook. A MoE layer against its family's dense layer of the same attention: the difference
    # is the MLP's replacement (router, routed rows, shared expert), which the estimate must
    # count to the byte in float32, with either way transformers runs the experts. (The shared
    # attention part is left out: CPU sdpa also saves GQA's repeated K/V and a contiguous copy of
    # its output, which flash attention on a GPU does not; the dense tests cover it.)
    dense_type, expert_fields = MOE[family]
    moe = _layer_per_token(family, torch.float32, experts, **expert_fields)
    dense = _layer_per_token(dense_type, torch.float32, None)
    moe_shape = ModelShape.from_hf_config(_config(family, 1, **expert_fields))
    dense_shape = ModelShape.from_hf_config(_config(dense_type, 1))
    counted = [
        max(layer_bytes_per_token(s, bytes_per_element=4, experts_implementation=experts))  # type: ignore[arg-type]
        for s in (moe_shape, dense_shape)
    ]
    mask = sentinel_mask_bytes(moe_shape, experts)
    assert moe - dense - mask == counted[0] - counted[1]
    if family == "qwen3_moe" and experts == "grouped_mm":
        # bf16: the routing weight of each of the k rows is bf16 (2 B), counted at its float32
        # upper bound (4 B, Mixtral's): 2 B x 2 rows over.
        moe = _layer_per_token(family, torch.bfloat16, experts, **expert_fields)
        dense = _layer_per_token(dense_type, torch.bfloat16, None)
        counted = [max(layer_bytes_per_token(s)) for s in (moe_shape, dense_shape)]
        assert counted[0] - counted[1] - (moe - dense - mask) == 2 * 2


def test_moe_estimate_matches_cpu_steps_measured_here() -> None:
    # A Qwen3-MoE whose four routed experts per token hold 80% of its activations
    # (memory_cpu.MOE_CONFIG), a forward + backward of plain transformers in float32, one
    # sequence per step. Peak RSS slope over tokens, for 2 and 6 layers: their difference over 4
    # is one layer's bytes per token, without the head and without the backward's working set of
    # the layer being differentiated (the same at any depth). glibc's mmap threshold is fixed at
    # 64 KiB so that freed forward temporaries leave the resident set (with its default dynamic
    # threshold they stay in the heap and one layer reads 20-25% over what is alive).
    slopes = {}
    for layers in (2, 6):
        rows = memory_cpu.run([1024, 2048], modes=("hf",), repeats=1, model="qwen3_moe",
                              layers=layers, malloc_mmap_threshold=65536, parallel=2)  # fmt: skip
        growth = {r["tokens"]: r["growth_mib"] for r in rows}
        slopes[layers] = (growth[2048] - growth[1024]) / 1024
    shape = ModelShape.from_hf_config(memory_cpu.model_config("qwen3_moe", layers=2))
    _, sparse = layer_bytes_per_token(shape, bytes_per_element=4)
    # one layer: 26.2 KiB/token counted, 26.4 measured (pages): 10%
    assert (slopes[6] - slopes[2]) / 4 == pytest.approx(sparse / MIB, rel=0.10)
    # the whole 2-layer step, head and the backward's working set included: 0.0586 MiB/token
    # counted, 0.0588 measured: 10%
    whole = activation_bytes_per_token(shape, chunked_loss=False, bytes_per_element=4)
    assert slopes[2] == pytest.approx(whole.total / MIB, rel=0.10)


def test_moe_parameter_count_equals_hugging_face() -> None:
    # Every expert counts, whichever few a token runs; exact against the real HF models (q/k/v
    # biases of Qwen2-MoE, q/k head norms of Qwen3-MoE, a dense first layer of Qwen3-MoE).
    from transformers import AutoModelForCausalLM

    for family, (_, fields) in MOE.items():
        extra = {"mlp_only_layers": [0]} if family == "qwen3_moe" else {}
        config = _config(family, 3, **fields, **extra)
        model = AutoModelForCausalLM.from_config(config)
        count = parameter_count(ModelShape.from_hf_config(config))
        assert count.total == sum(p.numel() for p in model.parameters()), family
        largest = max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
        assert count.per_layer == largest, family


def test_moe_model_states_count_every_expert() -> None:
    # Qwen3-30B-A3B: 30.5B parameters (its model card), 3.3B active per token (2 FLOPs each,
    # the embedding lookup aside).
    count = parameter_count(QWEN3_30B_A3B)
    assert count.total / 1e9 == pytest.approx(30.5, abs=0.05)
    active = QWEN3_30B_A3B.linear_flops_per_token() / 2 + QWEN3_30B_A3B.vocab_size * 2048
    assert active / 1e9 == pytest.approx(3.3, abs=0.1)
    ddp = model_state_bytes(QWEN3_30B_A3B, "ddp", cp_size=8, world_size=32)
    assert ddp.parameters == 4.0 * count.total
    # FSDP2's layer in flight is a whole layer: all 128 experts (604M parameters) gathered
    fsdp = model_state_bytes(QWEN3_30B_A3B, "fsdp_world", cp_size=8, world_size=32)
    assert fsdp.transient == 2.0 * count.outside_layers + 10.0 * count.per_layer
    assert count.per_layer > 128 * 3 * 2048 * 768


# ----------------------------------------------------------------------------- every family
def _vision_language(model_type: str, tied: bool, **vision: object) -> Any:
    """A tiny Gemma 3 or Mistral 3 config: a small vision tower beside a tiny text decoder."""
    from transformers import Gemma3Config, Mistral3Config

    tower = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 2, "image_size": 16, "patch_size": 4, **vision}  # fmt: skip
    if model_type == "gemma3":
        text = tiny_config("gemma3_text", vocab_size=80).to_dict()
        return Gemma3Config(text_config=text, vision_config=tower, mm_tokens_per_image=4,
                            image_token_index=70, tie_word_embeddings=tied)  # fmt: skip
    text = tiny_config("mistral", vocab_size=80).to_dict()
    return Mistral3Config(text_config=text, vision_config={"head_dim": 8, **tower},
                          image_token_index=70, tie_word_embeddings=tied)  # fmt: skip


VISION_CASES = [
    ("gemma3", {"vision_use_head": False}),
    ("gemma3", {"vision_use_head": True}),
    ("mistral3", {}),
    ("mistral3", {"multimodal_projector_bias": True, "vision_feature_layer": [-1, -2]}),
]
"""Vision-language configs: Gemma 3's tower with and without its pooling head, Mistral 3's
projector with biases over two feature layers."""


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_equals_hugging_face_for_every_architecture(tied: bool) -> None:
    # Every allow-listed model_type, built on the meta device (no memory, ~40 ms each): the
    # count, the largest decoder layer and, for the vision-language checkpoints, the tower and
    # projector and the part of them FSDP2 gathers with the root (outside the units it shards
    # on their own, decoder_layers), all equal to the Hugging Face model's, head tied or not.
    from lightning_skrull.models.families.vision_language import (
        language_model,
        text_only_unused_parameters,
    )
    from lightning_skrull.models.loading import auto_model_class
    from lightning_skrull.strategies.fsdp_sharding import decoder_layers

    configs = [
        (t, tiny_config(t, tie_word_embeddings=tied))
        for t in sorted(SUPPORTED_ARCHITECTURES)
        if t not in ("gemma3", "mistral3")
    ]
    for model_type, vision in VISION_CASES:
        fields = {k: vision.pop(k) for k in list(vision) if k != "vision_use_head"}
        config = _vision_language(model_type, tied, **vision)
        for name, value in fields.items():
            setattr(config, name, value)
        configs.append((model_type, config))
    assert {t for t, _ in configs} == set(SUPPORTED_ARCHITECTURES)
    for model_type, config in configs:
        with torch.device("meta"):
            model = auto_model_class(config).from_config(config)
        shape = ModelShape.from_hf_config(config)
        count = parameter_count(shape)
        assert shape.tied_embeddings is tied, model_type
        assert count.total == sum(p.numel() for p in model.parameters()), model_type
        decoder = language_model(model)
        layers = getattr(decoder, "model", decoder).layers
        largest = max(sum(p.numel() for p in layer.parameters()) for layer in layers)
        assert count.per_layer == largest, model_type
        unused = set(text_only_unused_parameters(model))
        sizes = {n: p.numel() for n, p in model.named_parameters() if n in unused}
        assert count.vision == sum(sizes.values()), model_type
        units = {id(p) for unit in decoder_layers(model) for p in unit.parameters()}
        root = sum(
            p.numel() for n, p in model.named_parameters() if n in unused and id(p) not in units
        )
        assert shape.vision_root_parameters == root, model_type
        assert (count.vision > 0) == (model_type in ("gemma3", "mistral3")), model_type


# (family, its tiny config's overrides): the norms and attentions that differ from Llama's
DENSE = {"llama": {}, "qwen3": {}, "gemma3_text": {}, "olmo2": {}, "olmo3": {}, "exaone4": {},
         "phi3": {"pad_token_id": 0}, "glm4": {"pad_token_id": 0}}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", sorted(DENSE))
def test_dense_layer_estimate_is_what_autograd_saves(family: str, dtype: torch.dtype) -> None:
    # Reference: the tensors autograd saves in a real HF layer (sdpa), to the byte: Llama's two
    # pre-norms, Qwen3's and EXAONE 4's per-head q/k norms, Gemma 3's four norms and OLMo 2 /
    # 3's two post-norms with their weights applied in float32 (and OLMo's q/k norms over all
    # heads), EXAONE 4's post-norms, GLM-4's four norms, fused gate/up and per-layer RoPE
    # tables, Phi-3's fused q/k/v. CPU sdpa also gives Phi-3's and GLM-4's o_proj a contiguous
    # copy of the attention output (b x heads x head_dim), which flash attention on a GPU,
    # whose output is laid out token-major, does not make: subtracted. float32 and bf16 (the float32 copies and rsqrt stay float32).
    b = torch.empty((), dtype=dtype).element_size()
    fields = DENSE[family]
    measured = _layer_per_token(family, dtype, None, **fields)
    shape = ModelShape.from_hf_config(_config(family, 1, **fields))
    dense, _ = layer_bytes_per_token(shape, bytes_per_element=b)
    cpu_only = b * shape.out_dim if family in ("phi3", "glm4") else 0
    assert measured - cpu_only == dense
