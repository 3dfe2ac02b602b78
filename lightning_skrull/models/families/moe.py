"""Mixture-of-Experts decoders under Skrull: what keeps their routing exact, and what is refused.

Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3, GLM-4-MoE, DeepSeek-V2 and gpt-oss replace the MLP of their
sparse layers by a top-k router and experts stored as fused 3-D parameters. The router picks
each token's experts from that token's hidden state alone, and every expert computes each of its
tokens alone: no capacity factor, no token dropping, nothing that depends on the other tokens of
the batch (Qwen2-MoE's shared expert and its sigmoid gate are per token too). Packing sequences
into micro-batches and sharding them over CP ranks therefore changes neither a token's experts
nor its result.

DeepSeek-V3's router (also GLM-4-MoE's, transformers' ``DeepseekV3TopkRouter`` /
``Glm4MoeTopkRouter``) is per token as well: sigmoid scores plus the ``e_score_correction_bias``
buffer pick the experts (the best ``topk_group`` of ``n_group`` groups, ranked by the sum of
their two best scores, then the top-k inside them), the un-biased scores weight them
(normalised when ``norm_topk_prob``, times ``routed_scaling_factor``), and shared experts run on
every token. The "auxiliary-loss-free" balancing of the DeepSeek-V3 paper updates the bias
between steps from the experts' loads; transformers keeps the bias a buffer that its forward
only reads, adds no auxiliary loss (not even with ``output_router_logits=True``, which only
returns the router logits), and does no update. DeepSeek-V2's router is a per-token softmax
with a greedy or group-limited greedy top-k, also without an auxiliary loss in transformers.
gpt-oss's router (``GptOssTopKRouter``) is a linear layer with bias whose top-k logits are
softmaxed among themselves; its experts add biases and a clamped GLU, all per token. Its
causal-LM forward adds the router auxiliary loss like Mixtral's.

Two things would break the exactness, and :func:`router_problems` refuses them at setup:

- the router auxiliary loss (``output_router_logits=True`` in a family whose forward adds it,
  :data:`AUX_LOSS_MODEL_TYPES`): :data:`AUX_LOSS_RULE`;
- Mixtral's ``router_jitter_noise > 0``: random noise drawn token by token in training.

A forward called with ``output_router_logits=True`` under the Skrull attention is refused too
for those families (:func:`refuse_router_aux_loss`, from the prepared model's forward pre-hook
and the chunked loss).

The experts must also be trainable: gpt-oss's released checkpoints hold MXFP4-quantized experts,
which train only once dequantized (:func:`quantized_experts`, :func:`quantized_expert_problems`).
"""

from __future__ import annotations

from torch import nn

# ``config.model_type`` of the supported Mixture-of-Experts architectures: the ones whose sparse
# MLP the cost model reads, one list for both
from lightning_skrull.scheduling.hf_shapes import MOE_MODEL_TYPES

AUX_LOSS_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss")
"""The ones whose causal-LM forward adds the router auxiliary loss with
``output_router_logits=True`` (DeepSeek-V3, GLM-4-MoE and DeepSeek-V2 have none in
transformers: there the flag only returns the router logits)."""

AUX_LOSS_RULE = (
    "transformers then adds router_aux_loss_coef x the load-balancing loss (Switch "
    "Transformer) to the loss; that loss multiplies each expert's fraction of routed tokens by "
    "its mean router probability over all tokens of one forward, a nonlinear function of the "
    "whole batch, so computed per micro-batch and per CP shard (over every packed token: the "
    "padding-free packed input has no attention_mask) its sum differs from the global batch's "
    "on one process, and no reduction of the per-micro-batch values recovers it"
)
"""Why the router auxiliary loss cannot be trained exactly under Skrull."""

AUX_LOSS_FIX = (
    "set config.output_router_logits=False (as the released Qwen3-MoE, Qwen2-MoE, Mixtral and "
    "gpt-oss configs do) and do not pass output_router_logits=True in the training forward; to read the "
    "router logits, run the model outside the training step (trainer.strategy.generating() or "
    "lightning_skrull.models.plain_attention(model))"
)
"""How to train a Mixture-of-Experts model without the router auxiliary loss."""


def has_router_aux_loss(model: nn.Module) -> bool:
    """Whether ``model``'s forward adds a router auxiliary loss when asked for the router
    logits (its ``model_type`` is one of :data:`AUX_LOSS_MODEL_TYPES`)."""
    return getattr(getattr(model, "config", None), "model_type", None) in AUX_LOSS_MODEL_TYPES


def router_problems(model: nn.Module) -> list[str]:
    """Reasons why a Mixture-of-Experts model would not train exactly under Skrull.

    - ``config.output_router_logits=True`` in a family that then adds the router auxiliary
      loss, which no per-micro-batch computation equals (:data:`AUX_LOSS_RULE`);
    - ``config.router_jitter_noise > 0`` (Mixtral): in training the router's input is scaled by
      uniform noise drawn from the random stream token by token, so packing and sharding change
      which token gets which draw.

    Empty for a model with neither (the dense architectures have neither field).
    """
    config = getattr(model, "config", None)
    problems: list[str] = []
    if getattr(config, "output_router_logits", False) and has_router_aux_loss(model):
        coef = getattr(config, "router_aux_loss_coef", None)
        problems.append(
            f"its config sets output_router_logits=True (router_aux_loss_coef={coef}): "
            f"{AUX_LOSS_RULE}. To train, {AUX_LOSS_FIX}"
        )
    jitter = float(getattr(config, "router_jitter_noise", 0.0) or 0.0)
    if jitter > 0.0:
        problems.append(
            f"router_jitter_noise={jitter} (the router's input is multiplied by random noise "
            "drawn token by token, which packing and sharding reorder; set "
            "config.router_jitter_noise=0.0)"
        )
    return problems


def refuse_router_aux_loss(model: nn.Module) -> None:
    """Raise for a forward of ``model`` asked for ``output_router_logits=True`` under Skrull,
    when that adds the router auxiliary loss (:func:`has_router_aux_loss`); return otherwise.

    Raises:
        ValueError: ``model`` adds the loss; the message names the value, the rule and the fix.
    """
    if not has_router_aux_loss(model):
        return
    coef = getattr(getattr(model, "config", None), "router_aux_loss_coef", None)
    raise ValueError(
        f"{type(model).__name__} was called with output_router_logits=True under the Skrull "
        f"attention (router_aux_loss_coef={coef}): {AUX_LOSS_RULE}. To train, {AUX_LOSS_FIX}."
    )


QUANTIZED_EXPERTS = ("Mxfp4GptOssExperts",)
"""Class names of transformers' quantized expert modules that hold packed weights autograd
cannot train (gpt-oss's MXFP4 experts, ``transformers.integrations.mxfp4``); matched by name, so
that the check imports no quantization kernel."""

MXFP4_FIX = (
    "load the checkpoint dequantized to bf16: AutoModelForCausalLM.from_pretrained(name, "
    "dtype=torch.bfloat16, quantization_config=Mxfp4Config(dequantize=True)) "
    "(from transformers import Mxfp4Config)"
)
"""How to load gpt-oss for fine-tuning."""


def quantized_experts(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` that are quantized experts (:data:`QUANTIZED_EXPERTS`).

    gpt-oss's released checkpoints store the experts in MXFP4. On a machine with transformers'
    MXFP4 kernels they load as ``Mxfp4GptOssExperts``, whose packed ``uint8`` weights have no
    gradient; elsewhere transformers dequantizes them to bf16 itself, and so does
    ``quantization_config=Mxfp4Config(dequantize=True)`` everywhere (:data:`MXFP4_FIX`).
    """
    return [
        name
        for name, module in model.named_modules()
        if any(cls.__name__ in QUANTIZED_EXPERTS for cls in type(module).__mro__)
    ]


def quantized_expert_problems(model: nn.Module) -> list[str]:
    """The reason a model with quantized experts (:func:`quantized_experts`) cannot be
    fine-tuned, naming the first three and the fix (:data:`MXFP4_FIX`); empty without any."""
    quantized = quantized_experts(model)
    if not quantized:
        return []
    shown = ", ".join(quantized[:3]) + (
        f" and {len(quantized) - 3} more" if len(quantized) > 3 else ""
    )
    return [
        f"its experts are MXFP4-quantized ({shown}: packed uint8 weights without "
        f"gradients, which cannot be fine-tuned); {MXFP4_FIX}"
    ]


__all__ = [
    "AUX_LOSS_FIX",
    "AUX_LOSS_MODEL_TYPES",
    "AUX_LOSS_RULE",
    "MOE_MODEL_TYPES",
    "MXFP4_FIX",
    "QUANTIZED_EXPERTS",
    "has_router_aux_loss",
    "quantized_expert_problems",
    "quantized_experts",
    "refuse_router_aux_loss",
    "router_problems",
]
