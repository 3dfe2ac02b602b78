"""Hugging Face decoders under Skrull: load one once per job, select the attention, check the
model, find it (inside a peft adapter model too), compute the causal-LM loss without the full
logits, normalise a custom loss as the built-in one is (:func:`token_mean_loss`), and switch it
back to transformers' attention to generate."""

from lightning_skrull.attention.backends import ATTENTION_NAME
from lightning_skrull.models.adapters import apply_lora, find_peft_model
from lightning_skrull.models.attention_modules import attention_window, unpassed_window
from lightning_skrull.models.checks import (
    SUPPORTED_ARCHITECTURES,
    check_model,
    sequence_length_limit,
    sequence_length_rule,
)
from lightning_skrull.models.chunked_loss import use_chunked_loss, use_dense_loss, uses_chunked_loss
from lightning_skrull.models.generation import plain_attention
from lightning_skrull.models.loading import (
    from_pretrained_on_rank_zero,
    launched_as_rank_zero,
    loads_weights_here,
)
from lightning_skrull.models.loss_kernels import linear_cross_entropy
from lightning_skrull.models.patching import (
    find_hf_model,
    is_prepared,
    plain_attention_name,
    prepare_model,
)
from lightning_skrull.models.rope import BATCH_DEPENDENT_ROPE_TYPES, STATIC_ROPE_TYPES
from lightning_skrull.models.token_loss import CustomLossWarning, shifted_labels, token_mean_loss

__all__ = [
    "ATTENTION_NAME",
    "BATCH_DEPENDENT_ROPE_TYPES",
    "STATIC_ROPE_TYPES",
    "SUPPORTED_ARCHITECTURES",
    "CustomLossWarning",
    "apply_lora",
    "attention_window",
    "check_model",
    "find_hf_model",
    "find_peft_model",
    "from_pretrained_on_rank_zero",
    "is_prepared",
    "launched_as_rank_zero",
    "linear_cross_entropy",
    "loads_weights_here",
    "plain_attention",
    "plain_attention_name",
    "prepare_model",
    "sequence_length_limit",
    "sequence_length_rule",
    "shifted_labels",
    "token_mean_loss",
    "unpassed_window",
    "use_chunked_loss",
    "use_dense_loss",
    "uses_chunked_loss",
]
