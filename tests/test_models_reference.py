"""Tiny random HF decoders and the single-process reference every parity test compares against.

The reference never packs, shards or uses the Skrull attention: it runs each sequence of a
global batch alone through the plain Hugging Face model (eager attention), takes the standard
shifted cross-entropy summed over supervised tokens, and divides by the supervised tokens of the
whole global batch. The tests at the bottom check the reference itself against transformers'
own loss.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURES = ("qwen2", "qwen3", "llama", "mistral")
VOCAB = 64


def tiny_config(arch: str, **overrides: Any) -> Any:
    """A tiny random config (hidden 32, 2 layers, 4 heads, 2 KV heads, vocab 64)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "attn_implementation": "eager",
    }
    if arch == "qwen2":
        cls, extra = Qwen2Config, {}
    elif arch == "qwen3":
        cls, extra = Qwen3Config, {"head_dim": 8}
    elif arch == "llama":
        cls, extra = LlamaConfig, {}
    elif arch == "mistral":
        # Mistral v0.2+ checkpoints have no sliding window (the config class defaults to 4096).
        cls, extra = MistralConfig, {"sliding_window": None}
    else:
        raise ValueError(f"unknown test architecture {arch!r}")
    return cls(**{**common, **extra, **overrides})


def tiny_model(arch: str = "qwen2", *, seed: int = 0, **overrides: Any) -> nn.Module:
    """A tiny random causal LM in float32 (eager attention), deterministic in ``seed``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **overrides)).float()


def make_samples(
    lengths: Sequence[int],
    *,
    seed: int,
    prompt: dict[int, int] | None = None,
    fully_masked: Sequence[int] = (),
    without_labels: Sequence[int] = (),
) -> list[dict[str, list[int]]]:
    """Random samples: ``prompt[i]`` first tokens of sample ``i`` masked with -100."""
    rng = random.Random(seed)
    samples: list[dict[str, list[int]]] = []
    for i, length in enumerate(lengths):
        ids = [rng.randrange(VOCAB) for _ in range(length)]
        labels = list(ids)
        masked = length if i in fully_masked else (prompt or {}).get(i, 0)
        labels[:masked] = [-100] * masked
        samples.append(
            {"input_ids": ids} if i in without_labels else {"input_ids": ids, "labels": labels}
        )
    return samples


def supervised_tokens(samples: Sequence[dict[str, list[int]]]) -> int:
    """Targets of the global batch: labels of tokens 1.. that are not -100."""
    return sum(
        sum(1 for label in s.get("labels", s["input_ids"])[1:] if label != -100) for s in samples
    )


def reference_loss_and_grads(
    model: nn.Module, samples: Sequence[dict[str, list[int]]]
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


def reference_sgd_step(
    model: nn.Module, samples: Sequence[dict[str, list[int]]], lr: float
) -> float:
    """One plain SGD step of the reference; returns its loss."""
    loss, grads = reference_loss_and_grads(model, samples)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p -= lr * grads[n]
    return loss


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


def test_reference_matches_transformers_loss_on_one_batch() -> None:
    """The reference equals transformers' own loss and gradients on a padded-free batch.

    Two sequences of equal length run as one HF batch with ``labels`` (HF shifts them and takes
    the mean over supervised tokens); the reference runs them one by one. Float32, same kernels
    up to the batch dimension: atol 1e-6.
    """
    model = tiny_model("qwen2", seed=3)
    samples = make_samples([9, 9], seed=4, prompt={0: 3})
    ref_loss, ref_grads = reference_loss_and_grads(model, samples)
    ids = torch.tensor([s["input_ids"] for s in samples])
    labels = torch.tensor([s["labels"] for s in samples])
    out = model(input_ids=ids, labels=labels, use_cache=False)
    out.loss.backward()
    assert abs(float(out.loss.detach()) - ref_loss) < 1e-6
    diff, where, scale = max_grad_diff(model, ref_grads)
    assert scale > 1e-3
    assert diff < 1e-6, f"{where} differs by {diff}"
