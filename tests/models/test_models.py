"""prepare_model: what it accepts, what it refuses and how; find_hf_model; CP=1 parity per model."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import one_rank_plan
from helpers import (
    ARCHITECTURES,
    FAMILIES,
    MLA_MOE_ARCHITECTURES,
    MOE_ARCHITECTURES,
    make_samples,
    max_grad_diff,
    output_cache,
    reference_loss_and_grads,
    tiny_config,
    tiny_model,
    tiny_qwen2,
)
from torch import nn

from lightning_skrull.data.collate import collate_rank
from lightning_skrull.models import (
    ATTENTION_NAME,
    SUPPORTED_ARCHITECTURES,
    attention_window,
    find_hf_model,
    is_prepared,
    prepare_model,
    sequence_length_limit,
    unpassed_window,
)
from lightning_skrull.runtime.engine import forward_backward, micro_batch_context, train_step
from lightning_skrull.runtime.process_groups import ParallelLayout


def test_prepare_selects_skrull_attention_and_leaves_the_config_cache_setting() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = tiny_model("qwen2")
    assert model.config.use_cache is True  # the config default: forwards would build a cache
    assert not is_prepared(model)
    assert prepare_model(model, backend="sdpa") is model
    assert model.config._attn_implementation == ATTENTION_NAME
    assert model.model.config._attn_implementation == ATTENTION_NAME
    assert model.config.use_cache is True  # the user's setting, saved by save_pretrained
    assert ATTENTION_NAME in ALL_ATTENTION_FUNCTIONS.valid_keys()
    assert is_prepared(model)
    hooks = len(model._forward_pre_hooks), len(model.model._forward_pre_hooks)
    prepare_model(model, backend="sdpa")  # again: nothing is added
    assert (len(model._forward_pre_hooks), len(model.model._forward_pre_hooks)) == hooks
    assert set(SUPPORTED_ARCHITECTURES) == {
        *ARCHITECTURES,
        *MOE_ARCHITECTURES,
        *MLA_MOE_ARCHITECTURES,
        "gemma3_text",
        # Gemma 3 4B-27B and Mistral Small 3.x on text only: tests/models/test_gemma3_multimodal.py
        "gemma3",
        "mistral3",
        # attention sinks: tests/models/test_gpt_oss.py
        "gpt_oss",
        *FAMILIES,
    }


_PHI3_LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.5],
    "long_factor": [2.0, 4.0],
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "original_max_position_embeddings": 16,
}
"""Phi-3's longrope on the tiny Phi-3's 4 rotated dims (head dim 8, partial_rotary_factor 0.5):
short factors up to 16 positions, long ones beyond."""


@pytest.mark.parametrize(
    ("arch", "overrides", "prepare_kwargs"),
    [
        *[(arch, {}, {}) for arch in ARCHITECTURES],
        # a Mistral v0.1-style window exactly as long as the longest sequence: accepted, exact
        ("mistral", {"sliding_window": 7}, {"max_sequence_length": 7}),
        # windows shorter than the sequences: Mistral on every layer, Qwen2 on its second
        # layer only (layer_types [full, sliding])
        ("mistral", {"sliding_window": 3}, {}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 2, "max_window_layers": 1}, {}),
        # Gemma 3 text: layers sliding (5 keys, RoPE base 1e4), full (1e6), sliding; a window
        # of 3 so the 7-token sequence exceeds it, and its final logit soft-capping
        ("gemma3_text", {"sliding_window": 3, "final_logit_softcapping": 30.0}, {}),
        # the other dense families (tests/helpers.py FAMILIES: windows of 3, NoPE layers,
        # multipliers, Granite's logits_scaling), through the chunked loss in 3-token chunks
        *[(arch, {}, {"chunked_loss": True, "chunk_tokens": 3}) for arch in FAMILIES],
        # Phi-3's longrope below its threshold (16 tokens; the longest sequence has 7)
        ("phi3", {"rope_parameters": _PHI3_LONGROPE}, {"max_sequence_length": 16}),
    ],
    ids=[
        *ARCHITECTURES,
        "mistral-window-7",
        "mistral-window-3",
        "qwen2-mixed-window-2",
        "gemma3-text-window-3",
        *FAMILIES,
        "phi3-longrope",
    ],
)
def test_prepared_model_on_one_rank_equals_reference(
    arch: str, overrides: dict[str, int], prepare_kwargs: dict[str, int]
) -> None:
    """CP=1, one process: packed micro-batches of the Skrull path vs sequences run alone
    (the reference applies its sliding window through transformers' own mask).

    float32; only the summation order differs (packing, one division per micro-batch): atol 1e-5.
    """
    samples = make_samples([7, 1, 2, 5], seed=1, prompt={0: 3}, fully_masked=(2,))
    plan = one_rank_plan((0, 1), (2, 3), bucket_size=8)
    ref = tiny_model(arch, seed=4, **overrides)
    model = prepare_model(copy.deepcopy(ref), backend="sdpa", **prepare_kwargs)
    ref_loss, ref_grads = reference_loss_and_grads(ref, samples)
    batch = collate_rank(samples, plan, dp_rank=0, cp_rank=0, world_size=1)
    loss = forward_backward(model, batch, cp_group=None, backend="sdpa")
    assert abs(float(loss) - ref_loss) < 1e-5
    diff, where, scale = max_grad_diff(model, ref_grads)
    assert scale > 1e-2
    assert diff < 1e-5, f"{where} differs by {diff}"


def test_prepare_accepts_a_window_no_sequence_can_reach() -> None:
    model = tiny_model("mistral", sliding_window=64)
    assert prepare_model(model, backend="sdpa", max_sequence_length=64) is model
    # Qwen2 with use_sliding_window but no layer past max_window_layers: no window is applied
    qwen = tiny_model("qwen2", use_sliding_window=True, max_window_layers=2)
    assert attention_window(qwen) is None
    prepare_model(qwen, backend="sdpa")


class _OpaqueAttention(nn.Module):
    """An attention that computes everything itself (no AttentionInterface)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states: torch.Tensor, **kwargs: object) -> tuple[torch.Tensor, None]:
        return hidden_states, None


class _NoRopeAttention(nn.Module):
    """Calls the interface, but never applies RoPE."""

    def forward(self, hidden_states: torch.Tensor, **kwargs: object) -> tuple[torch.Tensor, None]:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)
        return attention_interface(self, hidden_states, hidden_states, hidden_states, None)


def _replace_attention(factory: Callable[[nn.Module], nn.Module]) -> nn.Module:
    model = tiny_model("qwen2")
    for layer in model.model.layers:
        layer.self_attn = factory(layer.self_attn)
    return model


def _encoder_decoder() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(
        T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    )


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    )


def _non_causal() -> nn.Module:
    model = tiny_model("qwen2")
    model.config.is_causal = False
    return model


def _sequence_classifier() -> nn.Module:
    from transformers import Qwen2ForSequenceClassification

    return Qwen2ForSequenceClassification(tiny_config("qwen2", num_labels=2))


@pytest.mark.parametrize(
    ("make", "kwargs", "message"),
    [
        (_encoder_decoder, {}, r"T5ForConditionalGeneration cannot .*encoder-decoder"),
        (_gpt2, {}, r"GPT2LMHeadModel cannot .*model_type 'gpt2' is not a supported architecture"),
        (_non_causal, {}, r"Qwen2ForCausalLM cannot .*is_causal=False"),
        (_sequence_classifier, {}, r"Qwen2ForSequenceClassification cannot .*not a causal LM"),
        (
            lambda: tiny_model("qwen2_moe", use_sliding_window=True, sliding_window=4096),
            {},
            r"Qwen2MoeForCausalLM cannot .*sliding attention window of 4096 tokens in the mask "
            r"it builds but does not pass it to the attention function.*no max_sequence_length",
        ),
        (
            lambda: tiny_model("qwen2_moe", use_sliding_window=True, sliding_window=4096),
            {"max_sequence_length": 5000},
            r"Qwen2MoeForCausalLM cannot .*window of 4096 tokens.*max_sequence_length=5000 exceeds",
        ),
        (
            lambda: tiny_model("gemma3_text", attn_logit_softcapping=50.0),
            {},
            r"Gemma3ForCausalLM cannot .*attn_logit_softcapping=50.0 \(the Skrull attention has "
            r"no soft-capping",
        ),
        (
            lambda: tiny_model("gemma3_text", use_bidirectional_attention=True),
            {},
            r"Gemma3ForCausalLM cannot .*use_bidirectional_attention=True",
        ),
        (
            lambda: tiny_model("llama", attention_dropout=0.1),
            {},
            r"LlamaForCausalLM cannot .*attention_dropout=0.1",
        ),
        (
            lambda: _replace_attention(_OpaqueAttention),
            {},
            r"Qwen2ForCausalLM cannot .*_OpaqueAttention.forward does not call the attention "
            r"through transformers' AttentionInterface",
        ),
        (
            lambda: _replace_attention(lambda _: _NoRopeAttention()),
            {},
            r"_NoRopeAttention.forward does not apply RoPE",
        ),
    ],
    ids=[
        "encoder-decoder",
        "unknown-architecture",
        "non-causal",
        "not-a-causal-lm",
        "qwen2-moe-unpassed-window",
        "qwen2-moe-window-shorter-than-sequences",
        "gemma3-attention-softcap",
        "gemma3-bidirectional",
        "attention-dropout",
        "attention-outside-interface",
        "no-rope-before-attention",
    ],
)
def test_unsupported_models_are_refused_with_class_and_reason(make, kwargs, message) -> None:
    model = make()
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=message):
        prepare_model(model, backend="sdpa", **kwargs)
    assert model.config._attn_implementation == before  # refused models are left untouched


def test_windows_passed_to_the_attention_need_no_length_promise() -> None:
    # Mistral v0.1's default window, and Qwen2 / Qwen3 sliding layers, pass sliding_window= to
    # the attention function, which applies it: no limit on the sequences
    for model in (
        tiny_model("mistral", sliding_window=4096),
        tiny_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1),
        tiny_model("qwen3", use_sliding_window=True, sliding_window=16, max_window_layers=1),
    ):
        assert attention_window(model) is not None and unpassed_window(model) is None
        prepare_model(model, backend="sdpa")
        assert sequence_length_limit(model) is None


def test_prepare_refuses_non_models_and_unknown_backends() -> None:
    with pytest.raises(TypeError, match=r"expects a transformers PreTrainedModel.*Linear"):
        prepare_model(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown attention backend 'bogus'"):
        prepare_model(tiny_model("qwen2"), backend="bogus")


def test_flash_backend_needs_a_varlen_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_skrull.attention import backends

    model = tiny_model("qwen2")
    if backends.flash_kernel() is not None:  # flash-attn, or torch.nn.attention.varlen
        assert prepare_model(model, backend="flash") is model
    monkeypatch.setattr(backends, "flash_kernel", lambda: None)
    with pytest.raises(ValueError, match="needs a FlashAttention varlen kernel"):
        prepare_model(model, backend="flash")


class _Holder(nn.Module):
    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


def test_find_hf_model_returns_the_outermost_model() -> None:
    lm = tiny_model("qwen2")
    assert find_hf_model(_Holder(model=lm, head=nn.Linear(2, 2))) is lm
    assert find_hf_model(lm) is lm
    nested = _Holder(wrapper=_Holder(lm=lm))
    assert find_hf_model(nested) is lm


def test_find_hf_model_needs_a_name_when_ambiguous() -> None:
    policy, reference = tiny_model("qwen2"), tiny_model("llama")
    holder = _Holder(policy=policy, reference=reference)
    with pytest.raises(
        ValueError, match=r"several transformers models: policy \(Qwen2ForCausalLM\)"
    ):
        find_hf_model(holder)
    assert find_hf_model(holder, attribute="reference") is reference
    with pytest.raises(ValueError, match="no submodule 'missing'"):
        find_hf_model(holder, attribute="missing")
    with pytest.raises(ValueError, match="holds no transformers PreTrainedModel"):
        find_hf_model(_Holder(head=nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="is a Linear, not a transformers PreTrainedModel"):
        find_hf_model(_Holder(head=nn.Linear(2, 2)), attribute="head")


# ----------------------------------------------------------------------------- after training
WORLD_OF_ONE = ParallelLayout(rank=0, world_size=1, dp_size=1, cp_size=1, dp_rank=0, cp_rank=0)


def test_prepared_forward_builds_no_cache_although_the_config_asks_for_one() -> None:
    """With a cache, transformers does not treat packed input as packed: every forward of a
    prepared model (the outer causal LM and its inner model) runs with ``use_cache=False``."""
    model = prepare_model(tiny_model("qwen2", seed=3), backend="sdpa")
    assert model.config.use_cache is True
    outputs: list[Any] = []
    for sub in (model, model.model):
        sub.register_forward_hook(lambda module, args, out: outputs.append(out))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    samples = make_samples([7, 5, 3], seed=2)
    train_step(model, optimizer, samples, layout=WORLD_OF_ONE, bucket_size=16)
    assert len(outputs) >= 2
    assert all(output_cache(out) is None for out in outputs)
    # an explicit use_cache=True is overridden the same way
    plan = one_rank_plan((0, 1), bucket_size=16)
    mb = collate_rank(samples[:2], plan, dp_rank=0, cp_rank=0, world_size=1).micro_batches[0]
    with torch.no_grad(), micro_batch_context(mb, None, "sdpa"):
        model(**mb.inputs, use_cache=True)
    assert output_cache(outputs[-1]) is None


def test_save_pretrained_after_training_keeps_the_users_config(tmp_path: Path) -> None:
    """A checkpoint saved after Skrull training loads and generates with plain transformers."""
    from transformers import AutoModelForCausalLM

    model = prepare_model(tiny_model("qwen2", seed=3), backend="sdpa")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    samples = make_samples([7, 5, 3], seed=2)
    train_step(model, optimizer, samples, layout=WORLD_OF_ONE, bucket_size=16)
    model.save_pretrained(tmp_path)

    text = (tmp_path / "config.json").read_text()
    assert json.loads(text)["use_cache"] is True  # the tiny config's (transformers') default
    assert ATTENTION_NAME not in text  # transformers does not save the attention name

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config._attn_implementation != ATTENTION_NAME
    assert loaded.config.use_cache is True
    prompt = torch.tensor([[5, 9, 2, 7]])
    out = loaded.generate(
        prompt,
        max_new_tokens=3,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        pad_token_id=0,
    )
    cache = output_cache(out)
    assert cache is not None and cache.get_seq_length() == prompt.shape[1] + 2
    # reference: the trained weights in a plain model (eager attention), greedy, no cache
    ref = tiny_model("qwen2")
    ref.load_state_dict(model.state_dict())
    ids = prompt
    for logits in out.logits:
        ref_logits = ref(input_ids=ids, use_cache=False).logits[:, -1]
        # float32, sdpa with a cache vs eager without: summation order only (measured 6e-8)
        assert torch.allclose(logits, ref_logits, atol=1e-5)
        ids = torch.cat([ids, ref_logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out.sequences, ids)

    # the trained model itself generates with its cache again once it leaves the Skrull attention
    model.set_attn_implementation("sdpa")
    assert output_cache(model(input_ids=prompt)) is not None


def test_write_pretrained_records_the_written_dtype_and_casts_on_request(tmp_path: Path) -> None:
    """The strategies' writer (``trainer.strategy.save_pretrained``): ``config.json`` records
    the dtype of the tensors written, so ``dtype="auto"`` loads them unrounded."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lightning_skrull.models.saving import cpu_state_dict, write_pretrained

    model = tiny_qwen2()
    # float32 trained weights beside a frozen bf16 embedding: written as they are, config
    # float32 (the widest), so nothing is rounded on loading
    state = cpu_state_dict(model)
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"].bfloat16()
    write_pretrained(model, model, state, tmp_path / "mixed")
    config = json.loads((tmp_path / "mixed" / "config.json").read_text())
    assert config["dtype"] == "float32" and config["architectures"] == ["Qwen2ForCausalLM"]
    written = load_file(tmp_path / "mixed" / "model.safetensors")
    assert written["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert written["lm_head.weight"].dtype == torch.float32
    # dtype= casts every floating-point tensor, and the config says so
    write_pretrained(model, model, cpu_state_dict(model), tmp_path / "bf16", dtype=torch.bfloat16)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto")
    assert loaded.dtype == torch.bfloat16
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value.bfloat16()), key


def test_save_pretrained_refuses_a_non_float_dtype_and_a_strategy_not_set_up(
    tmp_path: Path,
) -> None:
    from lightning_skrull import SkrullStrategy

    strategy = SkrullStrategy()
    with pytest.raises(ValueError, match=r"dtype=torch\.int8.*floating-point torch\.dtype"):
        strategy.save_pretrained(tmp_path, dtype=torch.int8)
    with pytest.raises(RuntimeError, match=r"after trainer\.fit"):
        strategy.save_pretrained(tmp_path)
