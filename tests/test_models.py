"""prepare_model: what it accepts, what it refuses and how; find_hf_model; CP=1 parity per model."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from test_models_reference import (
    ARCHITECTURES,
    make_samples,
    max_grad_diff,
    reference_loss_and_grads,
    tiny_config,
    tiny_model,
)
from torch import nn

from lightning_skrull.data.collate import collate_rank
from lightning_skrull.engine import forward_backward
from lightning_skrull.models import (
    SKRULL_ATTENTION,
    SUPPORTED_ARCHITECTURES,
    attention_window,
    find_hf_model,
    is_prepared,
    prepare_model,
)
from lightning_skrull.scheduling import GlobalBatchPlan, MicroBatchPlan


def test_prepare_selects_skrull_attention_and_turns_the_cache_off() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = tiny_model("qwen2")
    assert model.config.use_cache is True  # the config default this must override
    assert prepare_model(model, backend="sdpa") is model
    assert model.config._attn_implementation == SKRULL_ATTENTION
    assert model.model.config._attn_implementation == SKRULL_ATTENTION
    assert model.config.use_cache is False
    assert SKRULL_ATTENTION in ALL_ATTENTION_FUNCTIONS.valid_keys()
    assert is_prepared(model)
    assert set(SUPPORTED_ARCHITECTURES) == set(ARCHITECTURES)


@pytest.mark.parametrize(
    ("arch", "overrides", "prepare_kwargs"),
    [
        *[(arch, {}, {}) for arch in ARCHITECTURES],
        # a Mistral v0.1-style window exactly as long as the longest sequence: accepted, exact
        ("mistral", {"sliding_window": 7}, {"max_sequence_length": 7}),
    ],
    ids=[*ARCHITECTURES, "mistral-window-7"],
)
def test_prepared_model_on_one_rank_equals_reference(
    arch: str, overrides: dict[str, int], prepare_kwargs: dict[str, int]
) -> None:
    """CP=1, one process: packed micro-batches of the Skrull path vs sequences run alone.

    float32; only the summation order differs (packing, one division per micro-batch): atol 1e-5.
    """
    samples = make_samples([7, 1, 2, 5], seed=1, prompt={0: 3}, fully_masked=(2,))
    plan = GlobalBatchPlan(
        micro_batches=((MicroBatchPlan((0, 1), (0, 0)), MicroBatchPlan((2, 3), (0, 0))),),
        dp_size=1,
        cp_size=1,
        bucket_size=8,
        policy="hand",
    )
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
            lambda: tiny_model("qwen2", use_sliding_window=True, max_window_layers=1),
            {},
            r"Qwen2ForCausalLM cannot .*sliding attention window of 4096 tokens.*no "
            r"max_sequence_length",
        ),
        (
            lambda: tiny_model("mistral", sliding_window=4096),
            {"max_sequence_length": 5000},
            r"MistralForCausalLM cannot .*window of 4096 tokens.*max_sequence_length=5000 exceeds",
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
        "qwen2-sliding-window",
        "mistral-window-shorter-than-sequences",
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


def test_default_mistral_config_is_refused_without_a_length_promise() -> None:
    with pytest.raises(ValueError, match="sliding attention window of 4096"):
        prepare_model(tiny_model("mistral", sliding_window=4096))


def test_prepare_refuses_non_models_and_unknown_backends() -> None:
    with pytest.raises(TypeError, match=r"expects a transformers PreTrainedModel.*Linear"):
        prepare_model(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown attention backend 'bogus'"):
        prepare_model(tiny_model("qwen2"), backend="bogus")


def test_flash_backend_needs_a_varlen_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_skrull.attention import flash

    model = tiny_model("qwen2")
    if flash.flash_kernel() is not None:  # flash-attn, or torch.nn.attention.varlen
        assert prepare_model(model, backend="flash") is model
    monkeypatch.setattr(flash, "flash_kernel", lambda: None)
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
