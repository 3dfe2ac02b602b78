"""Scaffolding shared by the test modules (importable in spawned processes too).

- tiny models: :data:`TINY_QWEN2` (overrides where a test needs another shape), the tiny
  decoders of the supported architectures;
- data: :func:`make_data` (random samples with an unsupervised prompt), :func:`make_samples`
  (samples of given lengths), a word-level chat tokenizer;
- the single-process reference every parity test compares against: a plain Hugging Face model,
  one sequence at a time, summed token cross-entropy divided by the supervised tokens of the
  whole global batch; :func:`sgd_steps` trains with it, under :func:`reference_training`,
  :func:`sgd_training`, :func:`momentum_training`, :func:`bf16_policy_training` and
  :func:`hooked_reference_training`;
- Trainer runs: :class:`PlainLM` (the module of the documentation), :class:`BatchRecorder`,
  :func:`cpu_trainer`, to compare with :func:`reference_training` of the same global batches;
- :func:`count_exchanged_bytes`, what the attention's K/V exchange hands to its collectives.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
import random
import subprocess
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as L
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from lightning_skrull.attention import comm
from lightning_skrull.data.batch import RankPlanner
from lightning_skrull.scheduling import CostModel


@dataclasses.dataclass(frozen=True)
class ExchangedTensor:
    """One tensor handed to a collective of the attention's K/V exchange.

    Attributes:
        collective: ``"all_gather"`` (forward) or ``"reduce_scatter"`` (backward).
        role: ``"input"`` (what this rank contributes) or ``"output"`` (what it gets back).
        dtype: the tensor's dtype.
        nbytes: its size in bytes.
    """

    collective: str
    role: str
    dtype: torch.dtype
    nbytes: int


class ExchangeLog:
    """What :func:`count_exchanged_bytes` recorded, in call order."""

    def __init__(self) -> None:
        self.tensors: list[ExchangedTensor] = []

    def record(self, collective: str, output: torch.Tensor, input: torch.Tensor) -> None:
        """Log the input and output of one collective call."""
        for role, t in (("input", input), ("output", output)):
            self.tensors.append(
                ExchangedTensor(collective, role, t.dtype, t.numel() * t.element_size())
            )

    @property
    def dtypes(self) -> set[torch.dtype]:
        """Every dtype exchanged."""
        return {t.dtype for t in self.tensors}

    @property
    def calls(self) -> dict[str, int]:
        """Number of calls per collective."""
        counts = {"all_gather": 0, "reduce_scatter": 0}
        for t in self.tensors:
            if t.role == "input":
                counts[t.collective] += 1
        return counts

    def total_bytes(self, collective: str | None = None, role: str | None = None) -> int:
        """Bytes of the recorded tensors, optionally of one collective and/or one role."""
        return sum(
            t.nbytes
            for t in self.tensors
            if (collective is None or t.collective == collective)
            and (role is None or t.role == role)
        )


@contextmanager
def count_exchanged_bytes() -> Iterator[ExchangeLog]:
    """Record (dtype, bytes) of every tensor the attention's K/V exchange passes to a collective.

    Wraps ``lightning_skrull.attention.comm._all_gather`` (forward) and ``_reduce_scatter``
    (backward) for the ``with`` block, in this process only (enter it inside a spawned
    process to count that rank's exchange). The collectives still run. A backward that runs
    after the block is not counted.

    Example::

        with count_exchanged_bytes() as log:
            model(**batch).loss.backward()
        assert log.dtypes == {torch.bfloat16}
    """
    log = ExchangeLog()
    real_gather, real_scatter = comm._all_gather, comm._reduce_scatter

    def gather(output: torch.Tensor, input: torch.Tensor, group: Any) -> Any:
        log.record("all_gather", output, input)
        return real_gather(output, input, group)

    def scatter(output: torch.Tensor, input: torch.Tensor, group: Any) -> Any:
        log.record("reduce_scatter", output, input)
        return real_scatter(output, input, group)

    comm._all_gather, comm._reduce_scatter = gather, scatter
    try:
        yield log
    finally:
        comm._all_gather, comm._reduce_scatter = real_gather, real_scatter


# ----------------------------------------------------------------------------- tiny models
TINY_QWEN2: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
"""A Qwen2 small enough for multi-process CPU tests (two layers, GQA, untied head). Tests that
need another shape override keys: ``{**TINY_QWEN2, "intermediate_size": 48}``."""

TINY_DECODER: dict[str, Any] = {**TINY_QWEN2, "intermediate_size": 48, "use_cache": False}
"""The decoder the attention tests run, as a Qwen2 or Llama config (GQA: 4 query heads, 2 K/V
heads, head dim 8), without a KV cache."""

ARCHITECTURES = ("qwen2", "qwen3", "llama", "mistral")
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral")
"""The Mixture-of-Experts architectures (tests/models/test_moe.py), kept out of :data:`ARCHITECTURES`
whose tests loop over every dense one."""
MLA_MOE_ARCHITECTURES = ("deepseek_v3", "glm4_moe", "deepseek_v2")
"""DeepSeek-V3, GLM-4-MoE and DeepSeek-V2 (tests/models/test_mla_moe.py)."""
FAMILIES = (
    "olmo2",
    "olmo3",
    "phi3",
    "glm4",
    "smollm3",
    "granite",
    "ministral",
    "seed_oss",
    "exaone4",
)
"""More dense decoder families (tests/models/test_models.py proves each on one process), kept out of
:data:`ARCHITECTURES` so the engine tests that loop over those stay cheap."""
VOCAB = TINY_QWEN2["vocab_size"]


def tiny_qwen2(**overrides: Any) -> Qwen2ForCausalLM:
    """:data:`TINY_QWEN2` (updated with ``overrides``) initialised after ``torch.manual_seed(0)``:
    the same weights in every process."""
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**{**TINY_QWEN2, **overrides}))


_TINY_EXPERTS: dict[str, Any] = {"num_experts_per_tok": 2, "moe_intermediate_size": 16}
_TOKEN_IDS: dict[str, Any] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
"""Special token ids inside the 64-token vocabulary, set by the family, MLA-MoE and gpt-oss
configs."""


def tiny_config(arch: str, **overrides: Any) -> Any:
    """A tiny random config of ``arch`` with :data:`TINY_QWEN2`'s sizes and eager attention.

    The Mixture-of-Experts ones route each token to 2 of 8 experts (Mixtral: 2 of 4) of 16
    hidden units, in every layer but Qwen2-MoE's middle one (a dense MLP, ``mlp_only_layers``;
    that model has 3 layers and a shared expert of 24 units).
    """
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common: dict[str, Any] = {**TINY_QWEN2, "attn_implementation": "eager"}
    if arch == "qwen2":
        cls, extra = Qwen2Config, {}
    elif arch == "qwen3":
        cls, extra = Qwen3Config, {"head_dim": 8}
    elif arch == "llama":
        cls, extra = LlamaConfig, {}
    elif arch == "mistral":
        # Mistral v0.2+ checkpoints have no sliding window (the config class defaults to 4096).
        cls, extra = MistralConfig, {"sliding_window": None}
    elif arch == "qwen3_moe":
        cls, extra = Qwen3MoeConfig, {**_TINY_EXPERTS, "head_dim": 8, "num_experts": 8}
    elif arch == "qwen2_moe":
        cls, extra = (
            Qwen2MoeConfig,
            {
                **_TINY_EXPERTS,
                "num_experts": 8,
                "shared_expert_intermediate_size": 24,
                "num_hidden_layers": 3,
                "mlp_only_layers": [1],
            },
        )
    elif arch == "mixtral":
        # Mixtral's experts are intermediate_size wide; released configs have no window
        cls, extra = (
            MixtralConfig,
            {
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "intermediate_size": 16,
                "sliding_window": None,
            },
        )
    elif arch == "gemma3_text":
        # Gemma 3's text model: q/k norms, query_pre_attn_scalar, a local (sliding, RoPE base
        # 1e4) and a global (full, 1e6) layer kind; three layers: sliding, full, sliding
        cls, extra = (
            Gemma3TextConfig,
            {
                "head_dim": 8,
                "num_hidden_layers": 3,
                "sliding_window": 5,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                "query_pre_attn_scalar": 16,
            },
        )
    elif arch in FAMILIES:
        cls, extra = _family_config(arch)
    elif arch in MLA_MOE_ARCHITECTURES:
        cls, extra = _mla_moe_config(arch)
    elif arch == "gpt_oss":
        cls, extra = _gpt_oss_config()
    else:
        raise ValueError(f"unknown test architecture {arch!r}")
    return cls(**{**common, **extra, **overrides})


def _family_config(arch: str) -> tuple[type, dict[str, Any]]:
    """Config class and tiny settings of one of :data:`FAMILIES`: each family's own per-token
    pieces switched on, windows of 3 keys so the test sequences exceed them, and token ids
    inside the 64-token vocabulary."""
    import transformers

    families: dict[str, tuple[str, dict[str, Any]]] = {
        # q/k RMSNorms over all heads together
        "olmo2": ("Olmo2Config", {}),
        # and a sliding layer then a full one
        "olmo3": (
            "Olmo3Config",
            {"sliding_window": 3, "layer_types": ["sliding_attention", "full_attention"]},
        ),
        # fused qkv and gate_up projections, half the head dim rotated, a window on every layer
        "phi3": ("Phi3Config", {"partial_rotary_factor": 0.5, "sliding_window": 3}),
        # extra norms after attention and MLP, interleaved rotary on half the head dim, q/k/v bias
        "glm4": ("Glm4Config", {"head_dim": 8}),
        # a RoPE layer then a NoPE layer, which the sliding window applies to
        "smollm3": (
            "SmolLM3Config",
            {"no_rope_layer_interval": 2, "use_sliding_window": True, "sliding_window": 3},
        ),
        # embedding, residual and attention multipliers, logits divided by logits_scaling
        "granite": (
            "GraniteConfig",
            {
                "embedding_multiplier": 12.0,
                "residual_multiplier": 0.22,
                "attention_multiplier": 0.125,
                "logits_scaling": 8.0,
            },
        ),
        # a window on every layer (layer_types all sliding)
        "ministral": ("MinistralConfig", {"head_dim": 8, "sliding_window": 3}),
        # q/k/v bias; its config defaults to attention and residual dropout 0.1
        "seed_oss": (
            "SeedOssConfig",
            {"head_dim": 8, "attention_dropout": 0.0, "residual_dropout": 0.0},
        ),
        # q/k norms per head, a sliding RoPE layer then a global NoPE layer
        "exaone4": (
            "Exaone4Config",
            {"head_dim": 8, "sliding_window": 3, "sliding_window_pattern": 2},
        ),
    }
    name, extra = families[arch]
    return getattr(transformers, name), {**_TOKEN_IDS, **extra}


def _mla_moe_config(arch: str) -> tuple[type, dict[str, Any]]:
    """Config class and tiny settings of DeepSeek-V3, GLM-4-MoE and DeepSeek-V2
    (tests/models/test_mla_moe.py): 3 layers, the first dense (``first_k_dense_replace``), the others 8
    routed experts of 16 units (2 per token, in 4 groups of which a token may use 2; GLM-4.5's
    released single group for GLM-4-MoE) and a shared expert, ``routed_scaling_factor`` 2.5.
    DeepSeek's Multi-head Latent Attention: q through a rank-16 LoRA, k/v from a rank-12
    latent, q/k heads 8 + 4 (rotary) wide and values 6 wide; GLM-4-MoE: GQA 4/2 with q/k/v
    bias and q/k norms, half the head dim rotated."""
    import transformers

    experts: dict[str, Any] = {
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        **_TOKEN_IDS,
    }
    mla: dict[str, Any] = {
        "num_key_value_heads": 4,
        "q_lora_rank": 16,
        "kv_lora_rank": 12,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 6,
        "n_group": 4,
        "topk_group": 2,
    }
    if arch == "deepseek_v3":
        return transformers.DeepseekV3Config, {**experts, **mla, "norm_topk_prob": True}
    if arch == "deepseek_v2":
        # softmax router, group-limited greedy top-k (V2; V2-Lite: greedy), no q LoRA (V2-Lite)
        v2 = {**experts, **mla, "q_lora_rank": None, "topk_method": "group_limited_greedy"}
        return transformers.DeepseekV2Config, v2
    glm = {"head_dim": 8, "attention_bias": True, "use_qk_norm": True, "n_group": 1}
    return transformers.Glm4MoeConfig, {**experts, **glm, "topk_group": 1, "norm_topk_prob": True}


def _gpt_oss_config() -> tuple[type, dict[str, Any]]:
    """Config class and tiny settings of gpt-oss (tests/models/test_gpt_oss.py): head dim 8, GQA 4/2,
    a sliding layer of 3 keys then a full one (the test sequences exceed the window), q/k/v/o
    biases, 4 experts of 16 units (2 per token), and the released checkpoints' YaRN RoPE
    (factor 32 over 4096 positions). Sinks are drawn by :func:`tiny_model` like every weight;
    tests that need them to matter set them larger."""
    from transformers import GptOssConfig

    return GptOssConfig, {
        "head_dim": 8,
        "sliding_window": 3,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 16,
        "max_position_embeddings": 131072,
        **_TOKEN_IDS,
    }


GPT_OSS_MXFP4: dict[str, Any] = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
"""gpt-oss-20b's ``quantization_config``: the experts in MXFP4, everything else bf16."""


MXFP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
"""The FP4 (E2M1) value of each 4-bit code (OCP Microscaling spec)."""


def save_mxfp4_gpt_oss(directory: Any, **overrides: Any) -> dict[str, torch.Tensor]:
    """A tiny gpt-oss checkpoint stored as the released ones are: the experts' ``gate_up_proj``
    and ``down_proj`` as MXFP4 (``<name>_blocks``: two 4-bit codes a byte, low nibble first,
    16 bytes per block of 32 input units; ``<name>_scales``: the block's power-of-two exponent
    + 127), everything else bf16, ``quantization_config.quant_method: mxfp4`` in config.json.

    Encoded here from random codes and exponents, so the exact weights are known without
    transformers' decoder: returns each expert weight as the model holds it (``[experts, in,
    out]``, bf16, exact). The intermediate size is 32, a whole block.
    """
    import json
    from pathlib import Path

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config("gpt_oss", intermediate_size=32, **overrides)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    values = torch.tensor(MXFP4_VALUES)
    weights = {}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = state.pop(name).shape
        codes = torch.randint(0, 16, (experts, outputs, inputs // 32, 32), generator=gen)
        exponents = torch.randint(-6, -2, (experts, outputs, inputs // 32), generator=gen)
        blocks = values[codes] * torch.pow(2.0, exponents).unsqueeze(-1)
        weights[name] = blocks.reshape(experts, outputs, inputs).transpose(1, 2).to(torch.bfloat16)
        codes = codes.to(torch.uint8)
        state[f"{name}_blocks"] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
        state[f"{name}_scales"] = (exponents + 127).to(torch.uint8)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    fields = model.config.to_dict()
    fields["quantization_config"] = GPT_OSS_MXFP4
    (directory / "config.json").write_text(json.dumps(fields))
    return weights


def tiny_model(arch: str = "qwen2", *, seed: int = 0, **overrides: Any) -> nn.Module:
    """A tiny random causal LM in float32 (eager attention), deterministic in ``seed``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **overrides)).float()


ROPE_SCALINGS: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "original_max_position_embeddings": 16,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.5, 2.0, 3.0],
        "long_factor": [2.0, 4.0, 8.0, 16.0],
        "original_max_position_embeddings": 32,
    },
}
"""RoPE scalings of :data:`TINY_QWEN2`'s head dim 8 (four frequencies, ``rope_theta`` 1e4) that
change the frequencies for sequences of up to 69 tokens: linear divides all four by 4; YaRN
(pretrained on 32 positions, 256 / 32 = its factor 8) interpolates the three slowest and scales
cos / sin by 1.21; Llama-3 (pretrained on 16) divides the three whose wavelength exceeds 16 and
smooths the fastest. ``"dynamic"`` (NTK beyond ``max_position_embeddings``) and ``"longrope"``
(short factors up to 32 positions, long beyond) depend on the batch's largest position.
Pass as ``tiny_model(arch, rope_parameters=rope_parameters("yarn"))``."""


ROPE_SENSITIVE: dict[str, Any] = {"initializer_range": 0.2}
"""Config overrides that make a tiny model's loss depend on the rotary frequencies: at the default
initializer_range 0.02 the attention is nearly uniform and linear scaling moves the loss of
:data:`ROPE_SCALINGS`' test batches by 2e-5 (yarn by 4e-7); at 0.2 the scalings move it by
2.8e-3 to 1.2e-1 (``test_rope_scaling.py``, ``test_engine.py``)."""


def rope_parameters(kind: str, **overrides: Any) -> dict[str, Any]:
    """A fresh copy of :data:`ROPE_SCALINGS`' ``kind`` (``rope_theta`` 1e4), with ``overrides``."""
    return {**ROPE_SCALINGS[kind], "rope_theta": 10_000.0, **overrides}


# ----------------------------------------------------------------------------- data
Sample = dict[str, list[int]]
"""One training sample: ``input_ids`` and, usually, ``labels`` (-100 where not supervised)."""
Batch = Sequence[Sample]
"""A global batch of samples."""


def make_data(n: int = 24, seed: int = 0, *, longest: int = 69) -> list[Sample]:
    """``n`` samples of 3..``longest`` tokens; a random prompt prefix of each (up to half of it)
    is not supervised."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, longest + 1, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        prompt = int(torch.randint(0, length // 2 + 1, (1,), generator=g))
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def prompted_samples(lengths: Iterable[int], seed: int) -> list[Sample]:
    """Random samples of ``lengths`` in order (ids drawn from one generator of ``seed``); a
    sample over 10 tokens starts with a 5-token unsupervised prompt."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        prompt = 5 if length > 10 else 0
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def make_samples(
    lengths: Sequence[int],
    *,
    seed: int,
    prompt: dict[int, int] | None = None,
    fully_masked: Sequence[int] = (),
    without_labels: Sequence[int] = (),
) -> list[Sample]:
    """Random samples: ``prompt[i]`` first tokens of sample ``i`` masked with -100."""
    rng = random.Random(seed)
    samples: list[Sample] = []
    for i, length in enumerate(lengths):
        ids = [rng.randrange(VOCAB) for _ in range(length)]
        labels = list(ids)
        masked = length if i in fully_masked else (prompt or {}).get(i, 0)
        labels[:masked] = [-100] * masked
        samples.append(
            {"input_ids": ids} if i in without_labels else {"input_ids": ids, "labels": labels}
        )
    return samples


def supervised_tokens(samples: Sequence[Sample]) -> int:
    """Targets of the global batch: labels of tokens 1.. that are not -100."""
    return sum(
        sum(1 for label in s.get("labels", s["input_ids"])[1:] if label != -100) for s in samples
    )


CHAT_VOCAB: dict[str, int] = {
    word: i
    for i, word in enumerate(
        [
            "<unk>",
            "<|im_start|>",
            "<|im_end|>",
            "system",
            "user",
            "assistant",
            "be",
            "brief",
            "hi",
            "there",
            "hello",
            "how",
            "are",
            "you",
            "fine",
            "thanks",
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
            "tools:",
            "weather",
            "paris",
            "sunny",
            "tool",
        ]
    )
}
"""Every word :func:`make_tokenizer` knows, and its token id."""

PLAIN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
"""A chat template without generation tags (the assistant turns are found by prefix rendering)."""

CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "how are you"},
    {"role": "assistant", "content": "fine thanks"},
]


def make_tokenizer(template: str | None) -> PreTrainedTokenizerFast:
    """An offline word-level tokenizer over :data:`CHAT_VOCAB` (split on whitespace, one token
    per word) with ``template`` as its chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel(vocab=CHAT_VOCAB, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = template
    return tokenizer


# ----------------------------------------------------------------------------- references
def reference_logits(model: torch.nn.Module, sample: Sample) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [T, V] in float32, shifted target [T])`` of one sample through a plain HF model,
    one sequence alone (the independent reference of the parity tests)."""
    device = next(model.parameters()).device
    ids = torch.tensor(sample["input_ids"], device=device)[None]
    labels = torch.tensor(sample["labels"], device=device)
    target = torch.full_like(labels, -100)
    target[:-1] = labels[1:]
    return model(ids).logits[0].float(), target


def token_loss_sum(model: torch.nn.Module, sample: Sample) -> tuple[torch.Tensor, int]:
    """``(summed token cross-entropy, supervised tokens)`` of one sample, one sequence alone."""
    logits, target = reference_logits(model, sample)
    loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
    return loss, int((target != -100).sum())


def reference_loss_and_grads(
    model: nn.Module, samples: Sequence[Sample]
) -> tuple[float, dict[str, torch.Tensor]]:
    """Global token-mean loss and its gradients, each sequence run alone on one process."""
    model.zero_grad(set_to_none=True)
    total = max(supervised_tokens(samples), 1)
    loss_sum = 0.0
    for s in samples:
        ids = torch.tensor(s["input_ids"]).unsqueeze(0)
        labels = torch.tensor(s.get("labels", s["input_ids"]))
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
        token_losses = F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")
        (token_losses / total).backward()
        loss_sum += float(token_losses.detach())
    grads = {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    return loss_sum / total, grads


def reference_sgd_step(model: nn.Module, samples: Sequence[Sample], lr: float) -> float:
    """One plain SGD step of the reference; returns its loss."""
    loss, grads = reference_loss_and_grads(model, samples)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p -= lr * grads[n]
    return loss


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread inside the block, as each spawned rank runs: a tiny model's ops gain
    nothing from a second thread, and on a busy machine its waits made the references up to 10x
    slower (measured 10.5 s against 0.9 s for 4 autocast steps)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def max_param_diff(a: nn.Module, b: nn.Module) -> tuple[float, str]:
    """Largest absolute parameter difference between two models of the same shape, and where."""
    worst, where = 0.0, ""
    pb = dict(b.named_parameters())
    for n, p in a.named_parameters():
        d = float((p.detach() - pb[n].detach()).abs().max())
        if d >= worst:
            worst, where = d, n
    return worst, where


def max_grad_diff(model: nn.Module, grads: dict[str, torch.Tensor]) -> tuple[float, str, float]:
    """Largest |grad - reference| over all parameters, where, and the largest reference grad."""
    worst, where, scale = 0.0, "", 0.0
    for n, p in model.named_parameters():
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        d = float((got - grads[n]).abs().max())
        scale = max(scale, float(grads[n].abs().max()))
        if d >= worst:
            worst, where = d, n
    return worst, where, scale


def model_flops(counter: Any) -> int:
    """What a ``torch.utils.flop_counter.FlopCounterMode`` counted, less the rotary embedding's
    frequency table: transformers 5.17 forms it with a matmul (``head_dim * tokens`` FLOPs once
    per forward, nothing in backward), 5.25 without one, and the cost model charges neither."""
    table = sum(
        sum(counts.values())
        for name, counts in counter.get_flop_counts().items()
        if name.endswith("rotary_emb")
    )
    return int(counter.get_total_flops()) - int(table)


def sentinel_mask_bytes(shape: Any, experts: str | None) -> int:
    """Bytes per token that a sparse layer's ``grouped_mm`` experts keep beyond the memory
    estimate: the boolean mask of expert-parallel sentinel rows (one byte per routed row, so
    ``experts_per_token``), which transformers 5.17 applies, and autograd keeps, in every run and
    5.25 only under expert parallelism. The estimate follows 5.25 (the mask is under 0.1% of a
    layer); ``eager`` experts keep no such mask."""
    if experts != "grouped_mm":
        return 0
    from transformers.integrations import moe

    source = inspect.getsource(moe.grouped_mm_experts_forward)
    return 0 if "if self._is_expert_parallel" in source else int(shape.experts_per_token)


def greedy_generation(model: Any, prompt: torch.Tensor, max_new_tokens: int) -> Any:
    """``model.generate`` greedily from ``prompt``, returning the output with each step's
    logits."""
    return model.generate(
        prompt,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )


def generated(output: Any) -> dict[str, Any]:
    """A greedy generation's ``"tokens"`` (the sequence) and ``"logits"`` (float32, per step)."""
    return {
        "tokens": output.sequences[0].tolist(),
        "logits": torch.stack(output.logits).float().numpy(),
    }


def run_python_tool(
    args: Sequence[str], *, cwd: Any, pythonpath: str
) -> subprocess.CompletedProcess[str]:
    """``args`` run in ``cwd`` with ``PYTHONPATH=pythonpath``, output captured, 300 s at most;
    a failure is the caller's to assert."""
    env = {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.run(
        list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def output_cache(output: Any) -> Any:
    """The KV cache a transformers output carries: ``cache`` in transformers 5.25,
    ``past_key_values`` in 5.17."""
    return output.cache if hasattr(output, "cache") else output.past_key_values


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """Largest absolute difference between two state dicts of arrays with the same keys."""
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def skrull_planner(
    *,
    bucket_size: int,
    dp_size: int = 2,
    cp_size: int = 2,
    dp_rank: int = 0,
    cp_rank: int = 0,
    cost_model: CostModel | None = None,
    **options: Any,
) -> RankPlanner:
    """A :class:`RankPlanner` of the ``"skrull"`` policy for one rank (DP=2 x CP=2, rank (0, 0)
    unless given) with ``cost_model`` (the default ``CostModel()``); ``options`` go to it too."""
    return RankPlanner(
        dp_size=dp_size,
        cp_size=cp_size,
        dp_rank=dp_rank,
        cp_rank=cp_rank,
        bucket_size=bucket_size,
        policy="skrull",
        cost_model=cost_model if cost_model is not None else CostModel(),
        **options,
    )


# ----------------------------------------------------------------------------- Trainer runs
GLOBAL_BATCH = 8
BUCKET = 40  # small, so global batches need several micro-batches and long samples are sharded
LR = 0.5
# Float32 throughout. The packed, sharded computation sums the same token terms in a different
# order than the one-sequence-at-a-time reference, and DDP / ZeRO average gradients over ranks:
# parameters agree to a few float32 ulps after 3 SGD steps of lr 0.5 (measured ~6e-8).
PARAM_ATOL = 2e-6


class PlainLM(L.LightningModule):
    """The plain module of the documentation: its training_step is the HF loss."""

    def __init__(self, momentum: float = 0.0) -> None:
        super().__init__()
        self.model = tiny_qwen2()
        self.momentum = momentum

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=self.momentum)


class UnfreezingLM(PlainLM):
    """:class:`PlainLM` whose embeddings are frozen when it is built and unfrozen in a hook
    before step :data:`UNFREEZE_AT` (from 0), with the model in ``dtype``; with ``freeze_head``
    the LM head is frozen there too."""

    def __init__(self, dtype: torch.dtype = torch.float32, freeze_head: bool = False) -> None:
        super().__init__()
        self.model.to(dtype)
        self.model.model.embed_tokens.weight.requires_grad_(False)
        self.freeze_head = freeze_head

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step == UNFREEZE_AT:
            self.model.model.embed_tokens.weight.requires_grad_(True)
            if self.freeze_head:
                self.model.lm_head.weight.requires_grad_(False)


UNFREEZE_AT = 1
"""The step before which :class:`UnfreezingLM` unfreezes its embeddings."""


WARMUP = 4
"""Steps of :class:`WarmupLM`'s linear warm-up: step ``s`` (from 0) runs
``LR * min(1, (s + 1) / WARMUP)``, the CLI's schedule."""


LOSS_SCALE = 3.0
"""What :class:`ScaledBackwardLM`'s ``backward`` multiplies each micro-batch's loss by."""


class ScaledBackwardLM(PlainLM):
    """A ``backward`` override that multiplies the loss by :data:`LOSS_SCALE`, counting its
    calls in each step."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.calls_per_step: list[int] = []

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.calls += 1
        super().backward(LOSS_SCALE * loss, *args, **kwargs)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.calls_per_step.append(self.calls)
        self.calls = 0


def warmup_factor(step: int) -> float:
    """:class:`WarmupLM`'s learning rate at ``step`` (from 0), over :data:`LR`."""
    return min(1.0, (step + 1) / WARMUP)


def check_warmup_cells(
    cells: Iterable[Mapping[str, Any]],
    reference: Mapping[str, np.ndarray],
    steps: int,
    atol: float,
    key: str,
) -> None:
    """Each cell of a :class:`WarmupLM` run of ``steps`` steps: its scheduler stepped once per
    optimizer step, each step at :func:`warmup_factor`'s learning rate, and its parameters
    ``cell[key]`` within ``atol`` of ``reference``."""
    for cell in cells:
        assert cell["last_epoch"] == cell["global_step"] == steps
        assert cell["lrs"] == pytest.approx([LR * warmup_factor(s) for s in range(steps)])
        assert max_diff(cell[key], reference) < atol


class WarmupLM(PlainLM):
    """SGD with a ``LambdaLR`` warm-up over :data:`WARMUP` steps, stepped per optimizer step
    (``interval="step"``, as the CLI's ``SkrullCausalLM``), recording the learning rate each
    step ran."""

    def __init__(self) -> None:
        super().__init__()
        self.lrs: list[float] = []

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=LR)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_factor)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))


class LayerCallCounter(L.Callback):
    """Counts the calls of the first decoder layer's MLP in ``module.model`` (a Hugging Face
    causal LM whose decoder is ``.model.layers``) while training, and the
    micro-batches this rank ran, and records whether every module of the model was in training
    mode when the fit started. A layer whose activations are checkpointed runs twice per
    micro-batch: in the forward, and again to recompute them in the backward."""

    def __init__(self) -> None:
        self.calls = 0
        self.micro_batches = 0
        self.training_at_start: bool | None = None
        self._handle: Any = None

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.training_at_start = all(m.training for m in module.model.modules())
        # a module inside the layer: transformers checkpoints the layer's forward, not its
        # __call__, so hooks on the layer itself run once
        self._handle = module.model.model.layers[0].mlp.register_forward_pre_hook(self._count)

    def _count(self, *args: Any) -> None:
        self.calls += 1

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        self.micro_batches += len(batch.rank_batch.micro_batches)

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self._handle.remove()


class BatchRecorder(L.Callback):
    """Records, per training step, what this rank trained."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        rb = batch.rank_batch
        self.steps.append(
            {
                "epoch": batch.epoch,
                "index": batch.index,
                "dp_rank": rb.dp_rank,
                "cp_rank": rb.cp_rank,
                "samples": [i for mb in rb.micro_batches for i in mb.sample_indices],
                "planned": rb.num_planned_micro_batches,
                "run": len(rb.micro_batches),
                "max": batch.stats.max_micro_batches,
                "min": batch.stats.min_micro_batches,
            }
        )


def float64_params(model: nn.Module) -> dict[str, np.ndarray]:
    """Every parameter of ``model`` as a float64 array on the CPU (exact for bf16 and float32)."""
    return {k: v.detach().double().cpu().numpy() for k, v in model.named_parameters()}


class StartRecorder(BatchRecorder):
    """:class:`BatchRecorder` that also records the parameters the run starts from, after the
    strategy and the precision plugin have cast the model."""

    def __init__(self) -> None:
        super().__init__()
        self.before: dict[str, np.ndarray] = {}

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.before = float64_params(module.model)


def skrull_strategy(name: str, **kwargs: Any) -> Any:
    """A Skrull strategy by its short name in the tests: ``"ddp"`` (:class:`SkrullStrategy`),
    ``"zero2"``, ``"fsdp"`` or ``"fsdp_world"`` (``shard="world"``); ``kwargs`` go to its
    constructor."""
    from lightning_skrull import SkrullFSDPStrategy, SkrullStrategy, SkrullZero2Strategy

    if name == "fsdp_world":
        return SkrullFSDPStrategy(shard="world", **kwargs)
    classes = {"ddp": SkrullStrategy, "zero2": SkrullZero2Strategy, "fsdp": SkrullFSDPStrategy}
    return classes[name](**kwargs)


def trained_params(model: nn.Module, strategy: Any) -> dict[str, np.ndarray]:
    """``model``'s weights after a fit as float32 arrays: under FSDP the full weights, gathered
    on rank 0 (``{}`` on the other ranks), else the local module's."""
    from lightning_skrull import SkrullFSDPStrategy

    if isinstance(strategy, SkrullFSDPStrategy):
        return float32_arrays(strategy.full_state_dict())
    return float32_arrays(model.state_dict())


def float32_arrays(state: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Copies of ``state``'s tensors as float32 arrays on the CPU."""
    return {k: v.detach().float().cpu().numpy().copy() for k, v in state.items()}


def cpu_trainer(strategy: Any, **kwargs: Any) -> L.Trainer:
    """A quiet CPU ``Trainer`` over this process group's ranks (one process without one)."""
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": dist.get_world_size() if dist.is_initialized() else 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    defaults.update(kwargs)
    return L.Trainer(strategy=strategy, **defaults)


MIN_SLOWDOWN = 1.2
"""How much slower than the start model a calibrated one must predict a CPU micro-batch. An
adopted refit lowers the median |log(predicted / measured)| by at least a tenth of it; from a
start model ~20x too fast for these CPUs (log error ~3) that raises the prediction of the median
micro-batch by e**0.3 = 1.35x. 1.2x leaves room for the probe micro-batch of
:func:`predicted_seconds` not being the median one (measured: 5.6-6.2x after 9 steps)."""


def predicted_seconds(model: dict[str, Any]) -> float:
    """Seconds a cost model (as ``dataclasses.asdict`` gives it) predicts for one micro-batch
    holding one local 64-token sequence."""
    from lightning_skrull.scheduling import CostModel

    m = CostModel.from_dict(model)
    return m.local_seconds(64) + m.micro_batch_overhead_s + m.per_sequence_seconds


def built_cli(*args: str) -> Any:
    """``skrull-finetune <args>`` with the tiny CPU Trainer defaults, its classes built and
    nothing run (``SkrullCLI(..., run=False)``)."""
    from lightning_skrull import SkrullDataModule
    from lightning_skrull.causal_lm import SkrullCausalLM
    from lightning_skrull.cli import TINY_CPU_TRAINER, SkrullCLI

    return SkrullCLI(
        SkrullCausalLM,
        SkrullDataModule,
        trainer_defaults=dict(TINY_CPU_TRAINER),
        seed_everything_default=0,
        save_config_callback=None,
        run=False,
        args=list(args),
    )


# ----------------------------------------------------------------------------- one-process training
# The independent reference every parity test of training is judged against: a plain HF model
# on one process, each global batch's loss the summed token cross-entropy of its samples (one
# sequence at a time) over its supervised tokens, plain SGD. :func:`sgd_steps` is that loop; the
# functions after it pick the model, the data, the optimizer and what to record.
def reference_model() -> Qwen2ForCausalLM:
    """:class:`PlainLM`'s initial model with HF's eager attention: the reference's model."""
    return tiny_qwen2(attn_implementation="eager")


def global_batches(data: Sequence[Sample], steps: int, size: int = GLOBAL_BATCH) -> list[Batch]:
    """The first ``steps`` consecutive global batches of ``size`` samples of ``data``."""
    return [data[step * size : (step + 1) * size] for step in range(steps)]


@dataclasses.dataclass(frozen=True)
class ReferenceStep:
    """One step of :func:`sgd_steps`: the global batch's mean token loss (before any
    ``loss_scale``) and the gradient's 2-norm before clipping, as ``clip_grad_norm_`` computes
    it."""

    loss: float
    grad_norm: float


def sgd_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Batch],
    *,
    autocast: bool = False,
    loss_scale: float = 1.0,
    clip: float | None = None,
    after_backward: Callable[[int], None] | None = None,
) -> Iterator[ReferenceStep]:
    """Train ``model`` in place, one optimizer step per global batch of ``batches``, yielding
    after each step: the summed token loss of the batch's samples, one sequence at a time (the
    forward under ``torch.autocast("cpu", bfloat16)`` with ``autocast``), over its supervised
    tokens, times ``loss_scale``; its backward; ``after_backward(step)`` (from 0); the norm of
    the gradient of ``optimizer``'s parameters clipped to ``clip``; ``optimizer.step()``. The
    caller picks the threads (:func:`one_thread`)."""
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    for step, batch in enumerate(batches):
        total, tokens = torch.zeros(()), 0
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            for sample in batch:
                loss, n = token_loss_sum(model, sample)
                total, tokens = total + loss, tokens + n
        loss = total / tokens
        optimizer.zero_grad()
        (loss_scale * loss).backward()
        if after_backward is not None:
            after_backward(step)
        norm = torch.nn.utils.clip_grad_norm_(stepped, math.inf if clip is None else clip)
        optimizer.step()
        yield ReferenceStep(float(loss.detach()), float(norm))


@functools.cache
def reference_training(
    steps: int, clip: float | None = None
) -> tuple[dict[str, np.ndarray], list[float]]:
    """``(parameters, loss of each step)`` of :func:`sgd_steps` of :func:`reference_model` on
    :func:`make_data`'s global batches of :data:`GLOBAL_BATCH` (dataset order), SGD of
    :data:`LR`, the gradient's norm clipped to ``clip``."""
    model = reference_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    run = list(sgd_steps(model, optimizer, global_batches(make_data(), steps), clip=clip))
    return float32_arrays(model.state_dict()), [s.loss for s in run]


def sgd_training(
    model: nn.Module,
    data: Sequence[Sample],
    steps: int,
    *,
    autocast: bool = False,
    clip: float | None = None,
) -> list[float]:
    """Train ``model`` in place as one process would (:func:`sgd_steps`, on one thread):
    ``steps`` SGD steps of :data:`LR` on the consecutive global batches of :data:`GLOBAL_BATCH`
    samples of ``data``, the forward under ``torch.autocast("cpu", bfloat16)`` with
    ``autocast``, the gradient's norm clipped to ``clip``. Returns each step's gradient norm
    before clipping."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with one_thread():
        run = list(
            sgd_steps(model, optimizer, global_batches(data, steps), autocast=autocast, clip=clip)
        )
    return [s.grad_norm for s in run]


def momentum_training(
    batches: Sequence[Sequence[int]], momentum: float, *, autocast: bool = False
) -> Iterator[nn.Module]:
    """:func:`sgd_steps` of :func:`reference_model` on ``batches`` (indices into
    :func:`make_data`), SGD of :data:`LR` with ``momentum``, the forward under
    ``torch.autocast("cpu", bfloat16)`` with ``autocast``: the model after each step."""
    data = make_data()
    model = reference_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    for _ in sgd_steps(
        model, optimizer, ([data[i] for i in b] for b in batches), autocast=autocast
    ):
        yield model


def bf16_policy_training(
    build: Callable[[], nn.Module],
    data: Sequence[Sample],
    steps: int,
    *,
    batches: Sequence[Sequence[int]] | None = None,
    momentum: float = 0.0,
    clip: float | None = None,
    norms: list[float] | None = None,
    frozen: Sequence[Collection[str]] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(parameters before, after)`` of what FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=float32)`` does, on one process: float32 parameters (the optimizer's) of
    ``build()``, a bf16 copy of them for forward and backward (buffers stay float32: FSDP2
    casts parameters only), the bf16 gradients upcast to float32, float32 SGD of :data:`LR`
    with ``momentum``, the gradient's norm clipped to ``clip`` first; the bf16 copy made again
    from the float32 parameters each step. Global batches and loss as :func:`sgd_training`, or
    ``batches`` (indices into ``data``, one tuple per step); the parameters named in
    ``frozen[k]`` frozen in step ``k`` (no gradient: SGD leaves them); each step's gradient norm
    before clipping appended to ``norms``."""
    master, compute = build(), build()
    for p in compute.parameters():
        p.data = p.data.to(torch.bfloat16)
    pairs = list(zip(compute.parameters(), master.parameters(), strict=True))
    optimizer = torch.optim.SGD(master.parameters(), lr=LR, momentum=momentum)
    if batches is None:
        run_batches = global_batches(data, steps)
    else:
        run_batches = [[data[i] for i in batch] for batch in batches[:steps]]

    def load_compute() -> None:
        with torch.no_grad():
            for c, m in pairs:
                c.copy_(m)
                c.grad = None

    def upcast_grads(step: int) -> None:
        for c, m in pairs:
            m.grad = None if c.grad is None else c.grad.float()

    def freeze(step: int) -> None:
        if frozen is not None and step < len(frozen):
            for name, c in compute.named_parameters():
                c.requires_grad_(name not in frozen[step])

    before = float64_params(master)
    load_compute()
    freeze(0)
    with one_thread():
        for k, step in enumerate(
            sgd_steps(compute, optimizer, run_batches, clip=clip, after_backward=upcast_grads)
        ):
            if norms is not None:
                norms.append(step.grad_norm)
            load_compute()
            freeze(k + 1)
    return before, float64_params(master)


@dataclasses.dataclass(frozen=True)
class StepGradient:
    """What a step of :func:`hooked_reference_training` saw: the gradient's 2-norm and its
    smallest and largest entry magnitude, before any clipping."""

    norm: float
    smallest: float
    largest: float


@functools.cache
def hooked_reference_training(
    steps: int,
    *,
    seed: int = 0,
    batch: int = GLOBAL_BATCH,
    loss_scale: float = 1.0,
    clip_norm: float | None = None,
    clip_value: float | None = None,
    warmup: int | None = None,
    autocast: bool = False,
) -> tuple[dict[str, np.ndarray], tuple[StepGradient, ...]]:
    """:func:`reference_training` with what a LightningModule's hooks change, on one thread:
    ``steps`` SGD steps of :data:`LR` on the consecutive global batches of ``batch`` samples of
    ``make_data(steps * batch, seed)`` (with the defaults, the first global batches of
    :func:`make_data`), each step's loss multiplied by ``loss_scale`` before its backward, the
    gradient clipped by ``clip_grad_norm_(clip_norm)`` or ``clip_grad_value_(clip_value)`` (one
    of them, as Lightning clips by one algorithm), and the learning rate of step ``s`` (from 0)
    ``LR * min(1, (s + 1) / warmup)`` (the CLI's linear warm-up); the forward under
    ``torch.autocast("cpu", bfloat16)`` with ``autocast`` (float32 gradients and SGD, what
    ``"bf16-mixed"`` runs). Returns the parameters and each step's gradient before clipping."""
    if clip_norm is not None and clip_value is not None:
        raise ValueError(
            f"clip_norm={clip_norm} and clip_value={clip_value}: Lightning clips by one "
            "algorithm; pass one of them"
        )
    model = reference_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    seen = []

    def hooks(step: int) -> None:
        grads = torch.cat([p.grad.flatten().abs() for p in model.parameters()])
        seen.append(StepGradient(float(grads.norm()), float(grads.min()), float(grads.max())))
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        if warmup is not None:
            optimizer.param_groups[0]["lr"] = LR * min(1.0, (step + 1) / warmup)

    data = global_batches(make_data(steps * batch, seed), steps, batch)
    with one_thread():
        for _ in sgd_steps(
            model,
            optimizer,
            data,
            autocast=autocast,
            loss_scale=loss_scale,
            clip=clip_norm,
            after_backward=hooks,
        ):
            pass
    return float32_arrays(model.state_dict()), tuple(seen)


def mean_token_loss(model: nn.Module, samples: Sequence[Sample]) -> float:
    """Mean token loss of ``samples`` under ``model``, one sequence at a time."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            loss, n = token_loss_sum(model, sample)
            total, tokens = total + float(loss), tokens + n
    return total / tokens


def reference_loss(params: dict[str, np.ndarray], samples: Sequence[Sample]) -> float:
    """Mean token loss of ``samples`` under ``params``, one process."""
    model = reference_model()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})
    return mean_token_loss(model, samples)
