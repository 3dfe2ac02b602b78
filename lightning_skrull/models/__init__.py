"""Hugging Face decoders under Skrull: select the attention, check the model, find it."""

from lightning_skrull.attention.backends import ATTENTION_NAME
from lightning_skrull.models.patching import (
    SUPPORTED_ARCHITECTURES,
    attention_window,
    check_model,
    find_hf_model,
    is_prepared,
    prepare_model,
    sequence_length_limit,
)

__all__ = [
    "ATTENTION_NAME",
    "SUPPORTED_ARCHITECTURES",
    "attention_window",
    "check_model",
    "find_hf_model",
    "is_prepared",
    "prepare_model",
    "sequence_length_limit",
]
