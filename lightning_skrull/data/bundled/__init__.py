"""Small SFT datasets shipped with the package, for demos and tests.

``load_bundled_dataset("mixed_tiny")``: 384 synthetic samples over a 256-token vocabulary with a
long-tailed length distribution (see docs/data.md and :mod:`.generate`).
"""

from __future__ import annotations

from importlib import resources

from lightning_skrull.data.dataset import SFTDataset
from lightning_skrull.data.sources import load_sft_data

BUNDLED_DATASETS: dict[str, int] = {"mixed_tiny": 256}
"""Name of each bundled dataset and the vocabulary size its token ids need."""


def load_bundled_dataset(name: str = "mixed_tiny") -> SFTDataset:
    """Loads a bundled dataset, validated against its vocabulary size.

    Args:
        name: one of :data:`BUNDLED_DATASETS`.

    Raises:
        ValueError: an unknown name.
    """
    if name not in BUNDLED_DATASETS:
        raise ValueError(
            f"No bundled dataset named {name!r}; choose one of {sorted(BUNDLED_DATASETS)}."
        )
    path = resources.files(__name__).joinpath(f"{name}.jsonl")
    with resources.as_file(path) as file:
        return load_sft_data(file, vocab_size=BUNDLED_DATASETS[name])
