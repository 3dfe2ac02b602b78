"""The chunked LM head + cross-entropy equals transformers' dense loss, values and gradients.

References are independent of the package: ``torch.nn.functional.cross_entropy`` on the full
logits, and an unmodified Hugging Face causal LM given ``labels``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import TINY_QWEN2, tiny_model
from transformers import Qwen2Config, Qwen2ForCausalLM

from lightning_skrull.models import (
    linear_cross_entropy,
    prepare_model,
    use_chunked_loss,
    use_dense_loss,
    uses_chunked_loss,
)
from lightning_skrull.models.chunked_loss import check_chunked_loss_supported

# float32: the chunked sums run over the same terms in another order (chunks, then the
# loss's float32 accumulation); measured relative differences below 2e-7.
FP32_REL = 1e-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _dense(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    num_items: float | None,
    softcap: float | None = None,
) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if softcap is not None:  # as Gemma's forward soft-caps the full logits
        logits = torch.tanh(logits / softcap) * softcap
    if num_items is None:
        return torch.nn.functional.cross_entropy(logits, target, ignore_index=-100)
    total = torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
    return total / num_items


def _case(n: int, ignore: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, 24, generator=g)
    weight = torch.randn(97, 24, generator=g) * 0.3
    bias = torch.randn(97, generator=g) * 0.1
    target = torch.randint(0, 97, (n,), generator=g)
    if ignore == "some":
        target[::3] = -100
    elif ignore == "first_chunk":
        target[:7] = -100  # a whole chunk of 7 without a supervised token
    return hidden, weight, bias, target


@pytest.mark.parametrize("chunk", [1, 5, 7, 40, 1000])  # odd sizes, one chunk, beyond the tokens
@pytest.mark.parametrize("ignore", ["none", "some", "first_chunk"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("num_items", [None, 13.0])
@pytest.mark.parametrize("softcap", [None, 2.0])  # 2.0: below these logits' range, so it bites
def test_loss_and_gradients_equal_the_dense_loss(
    chunk: int, ignore: str, with_bias: bool, num_items: float | None, softcap: float | None
) -> None:
    hidden, weight, bias, target = _case(40, ignore)
    b = bias if with_bias else None
    inputs = [t.clone().requires_grad_() for t in (hidden, weight, *([b] if with_bias else []))]
    ref_inputs = [t.clone().requires_grad_() for t in inputs]
    got = linear_cross_entropy(
        inputs[0],
        inputs[1],
        target,
        bias=inputs[2] if with_bias else None,
        num_items_in_batch=num_items,
        chunk_tokens=chunk,
        softcap=softcap,
    )
    ref = _dense(
        ref_inputs[0],
        ref_inputs[1],
        ref_inputs[2] if with_bias else None,
        target,
        num_items,
        softcap,
    )
    if softcap is not None:  # the cap changes the loss, so the comparison could fail
        uncapped = _dense(hidden, weight, bias if with_bias else None, target, num_items)
        assert abs(float(uncapped) - float(ref.detach())) > 1e-2
    assert got.dtype == torch.float32
    assert float(got.detach()) == pytest.approx(float(ref.detach()), rel=FP32_REL)
    for g, r in zip(
        torch.autograd.grad(got * 1.7, inputs),
        torch.autograd.grad(ref * 1.7, ref_inputs),
        strict=True,
    ):
        assert _rel(g, r) < FP32_REL


def test_without_autograd_the_loss_is_the_same() -> None:
    hidden, weight, _, target = _case(10, "some")
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, target, chunk_tokens=3)
    assert float(loss) == pytest.approx(
        float(_dense(hidden, weight, None, target, None)), rel=FP32_REL
    )


def test_bad_shapes_and_chunks_are_refused() -> None:
    hidden, weight, _, target = _case(10, "none")
    with pytest.raises(ValueError, match="one target per hidden row"):
        linear_cross_entropy(hidden, weight, target[:-1])
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        linear_cross_entropy(hidden, weight, target, chunk_tokens=0)
    with pytest.raises(ValueError, match=r"softcap=0\.0 must be positive"):
        linear_cross_entropy(hidden, weight, target, softcap=0.0)


# ----------------------------------------------------------------------------- HF models
def _model(tied: bool, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**{**TINY_QWEN2, "tie_word_embeddings": tied}))


def _batch(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY_QWEN2["vocab_size"], (1, 23), generator=g)
    labels = ids.clone()
    labels[0, :6] = -100  # an unsupervised prompt
    return {"input_ids": ids, "labels": labels}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("extra", [{}, {"num_items_in_batch": torch.tensor(7.0)}])
def test_routed_model_equals_plain_transformers(tied: bool, extra: dict[str, Any]) -> None:
    plain, routed = _model(tied), _model(tied)
    use_chunked_loss(routed, chunk_tokens=5)
    assert uses_chunked_loss(routed) and not uses_chunked_loss(plain)
    batch = _batch()
    ref = plain(**batch, **extra)
    out = routed(**batch, **extra)
    assert out.logits is None and ref.logits is not None
    assert float(out.loss) == pytest.approx(float(ref.loss), rel=FP32_REL)
    ref.loss.backward()
    out.loss.backward()
    ref_grads, got_grads = _grads(plain), _grads(routed)
    assert ref_grads.keys() == got_grads.keys()
    names = sorted(ref_grads)
    every = _rel(
        torch.cat([got_grads[n].flatten() for n in names]),
        torch.cat([ref_grads[n].flatten() for n in names]),
    )
    assert every < FP32_REL  # all gradients together (measured ~1e-7)
    for name in names:
        # one parameter alone: a small-norm gradient (a norm weight's, ~1e-4) carries the
        # float32 rounding of the other summation order through every layer (measured 1.2e-6)
        assert _rel(got_grads[name], ref_grads[name]) < 5 * FP32_REL, name
    # without labels the original forward runs and returns the logits
    logits = routed(input_ids=batch["input_ids"]).logits
    torch.testing.assert_close(logits, plain(input_ids=batch["input_ids"]).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("arch", "setting", "value", "neutral"),
    [
        # Gemma 3's forward soft-caps the logits before its loss; the routed forward caps each
        # chunk
        ("gemma3_text", "final_logit_softcapping", 0.1, None),
        # Granite's divides the logits by logits_scaling; the routed forward divides the hidden
        # states (and a head bias) instead: the same logits up to rounding
        ("granite", "logits_scaling", 8.0, 1.0),
    ],
)
def test_logit_transforms_equal_plain_transformers(
    arch: str, setting: str, value: float, neutral: float | None
) -> None:
    plain, routed = (tiny_model(arch, seed=3, **{setting: value}) for _ in range(2))
    use_chunked_loss(routed, chunk_tokens=5)
    batch = _batch()
    ref, out = plain(**batch), routed(**batch)
    without = tiny_model(arch, seed=3, **{setting: neutral})(**batch)
    assert abs(float(without.loss) - float(ref.loss)) > 1e-2  # the setting changes the loss
    assert out.logits is None
    assert float(out.loss) == pytest.approx(float(ref.loss), rel=FP32_REL)
    ref.loss.backward()
    out.loss.backward()
    ref_grads, got_grads = _grads(plain), _grads(routed)
    names = sorted(ref_grads)
    every = _rel(
        torch.cat([got_grads[n].flatten() for n in names]),
        torch.cat([ref_grads[n].flatten() for n in names]),
    )
    assert every < FP32_REL


class _LmKwargsQwen2(Qwen2ForCausalLM):
    """Names its ``**`` parameter ``lm_kwargs``, as ``Gemma3ForConditionalGeneration`` of
    transformers 5.17 does: ``shift_labels`` and ``num_items_in_batch`` arrive in it."""

    def forward(self, input_ids: Any = None, labels: Any = None, **lm_kwargs: Any) -> Any:
        return super().forward(input_ids=input_ids, labels=labels, **lm_kwargs)


@pytest.mark.parametrize("named", ["kwargs", "lm_kwargs"])
def test_pre_shifted_labels_are_used_as_given(named: str) -> None:
    """Shifted again, or normalised by the local count, the loss would differ by far more than
    float32 rounding (it did, for the lm_kwargs forward, before the routed forward looked the
    ``**`` parameter's name up)."""
    plain, routed = _model(False), _model(False)
    if named == "lm_kwargs":
        routed.__class__ = _LmKwargsQwen2
    use_chunked_loss(routed, chunk_tokens=4)
    batch = _batch()
    shift = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    kwargs = {"shift_labels": shift, "num_items_in_batch": torch.tensor(9.0)}
    ref = plain(**batch, **kwargs).loss
    got = routed(**batch, **kwargs).loss
    assert float(got.detach()) == pytest.approx(float(ref.detach()), rel=FP32_REL)


def test_bf16_autocast_is_as_close_to_float32_as_the_dense_loss() -> None:
    plain, routed = _model(False), _model(False)
    use_chunked_loss(routed, chunk_tokens=6)
    batch = _batch()
    ref32 = plain(**batch).loss
    ref32.backward()
    grads32 = _grads(plain)
    plain.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dense16 = plain(**batch).loss
        chunked16 = routed(**batch).loss
    dense16.backward()
    chunked16.backward()
    dense_grads, chunked_grads = _grads(plain), _grads(routed)
    dense_dist = max(_rel(dense_grads[n], grads32[n]) for n in grads32)
    chunked_dist = max(_rel(chunked_grads[n], grads32[n]) for n in grads32)
    # the chunked head runs its matmuls in bf16 as lm_head does under autocast; its gradient
    # accumulates over chunks in float32. Bound: twice the dense bf16 distance plus one bf16
    # rounding (2**-8), the rule of the precision matrix (measured: dense ~1e-2, chunked below it)
    assert chunked_dist <= 2 * dense_dist + 2**-8
    assert abs(float(chunked16) - float(ref32)) <= 2 * abs(float(dense16) - float(ref32)) + 2**-8


def test_prepare_model_switches_it_on_and_off() -> None:
    model = _model(False)
    prepare_model(model, chunked_loss=True, chunk_tokens=3)
    assert uses_chunked_loss(model)
    prepare_model(model)
    assert not uses_chunked_loss(model)
    use_chunked_loss(model)
    use_dense_loss(model)
    assert not uses_chunked_loss(model)


def test_unsupported_model_is_refused_with_the_fix() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match="chunked_loss=False"):
        check_chunked_loss_supported(gpt2)
