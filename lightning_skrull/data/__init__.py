"""Data layer: SFT samples, their validation, the bundled demo data and the global-batch sampler."""

from lightning_skrull.data.bundled import BUNDLED_DATASETS, load_bundled_dataset
from lightning_skrull.data.chat import ChatTurns, tokenize_chat
from lightning_skrull.data.dataset import IGNORE_INDEX, SFTDataset, TruncationWarning
from lightning_skrull.data.formats import PromptBoundaryWarning
from lightning_skrull.data.sampler import GlobalBatchSampler
from lightning_skrull.data.sources import load_sft_data

__all__ = [
    "BUNDLED_DATASETS",
    "IGNORE_INDEX",
    "ChatTurns",
    "GlobalBatchSampler",
    "PromptBoundaryWarning",
    "SFTDataset",
    "TruncationWarning",
    "load_bundled_dataset",
    "load_sft_data",
    "tokenize_chat",
]
