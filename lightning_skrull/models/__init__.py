"""Hugging Face decoders under Skrull: select the attention, check the model, find it."""

from lightning_skrull.models.patching import (
    SKRULL_ATTENTION,
    SUPPORTED_ARCHITECTURES,
    attention_window,
    check_model,
    find_hf_model,
    is_prepared,
    prepare_model,
    sequence_length_limit,
)

__all__ = [
    "SKRULL_ATTENTION",
    "SUPPORTED_ARCHITECTURES",
    "attention_window",
    "check_model",
    "find_hf_model",
    "is_prepared",
    "prepare_model",
    "sequence_length_limit",
]
