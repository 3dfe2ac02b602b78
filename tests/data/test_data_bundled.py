"""The bundled ``mixed_tiny`` dataset: loads, validates, matches docs/data.md, and is learnable.

The structure checks read only the shipped file (not the generator), so they are an independent
check of what the generator claims. Comparisons are exact.
"""

from __future__ import annotations

import statistics
from importlib import resources
from pathlib import Path

import pytest

from lightning_skrull.data import BUNDLED_DATASETS, load_bundled_dataset
from lightning_skrull.data.bundled.generate import generate_mixed_tiny, write_jsonl

# The length distribution documented in docs/data.md ("The bundled dataset").
DOCUMENTED = {
    "samples": 384,
    "tokens": 68_471,
    "supervised": 16_974,
    "min": 16,
    "median": 78,
    "max": 2020,
    "bands": {(16, 63): 178, (64, 255): 158, (256, 1023): 36, (1024, 2048): 12},
}
BOS, EOS, TASK_CHAIN, TASK_MAP, SEP = 0, 1, 2, 3, 4


def test_loads_validates_and_has_the_documented_distribution() -> None:
    dataset = load_bundled_dataset("mixed_tiny")
    dataset.validate(vocab_size=BUNDLED_DATASETS["mixed_tiny"], max_tokens=DOCUMENTED["max"])
    lengths = dataset.lengths
    assert len(dataset) == DOCUMENTED["samples"]
    assert sum(lengths) == DOCUMENTED["tokens"]
    assert (min(lengths), statistics.median(lengths), max(lengths)) == (
        DOCUMENTED["min"],
        DOCUMENTED["median"],
        DOCUMENTED["max"],
    )
    for (low, high), count in DOCUMENTED["bands"].items():
        assert sum(low <= n <= high for n in lengths) == count, (low, high)
    supervised = sum(
        sum(label != -100 for label in dataset[i]["labels"]) for i in range(len(dataset))
    )
    assert supervised == DOCUMENTED["supervised"]
    with pytest.raises(ValueError, match=r"No bundled dataset named 'huge'; choose one of"):
        load_bundled_dataset("huge")


def test_shipped_file_is_what_the_committed_generator_writes(tmp_path: Path) -> None:
    shipped = resources.files("lightning_skrull.data.bundled").joinpath("mixed_tiny.jsonl")
    regenerated = tmp_path / "mixed_tiny.jsonl"
    write_jsonl(generate_mixed_tiny(), regenerated)
    assert regenerated.read_bytes() == shipped.read_bytes()
    assert len(shipped.read_bytes()) < 1_000_000


def test_prompt_is_masked_and_answers_follow_one_fixed_permutation() -> None:
    dataset = load_bundled_dataset()
    mapping: dict[int, int] = {}

    def learn(source: int, target: int) -> None:
        assert mapping.setdefault(source, target) == target, "answers disagree on the rule"

    for i in range(len(dataset)):
        ids, labels = dataset[i]["input_ids"], dataset[i]["labels"]
        sep = ids.index(SEP)
        assert ids[0] == BOS and ids[-1] == EOS and ids[1] in (TASK_CHAIN, TASK_MAP)
        assert labels[: sep + 1] == [-100] * (sep + 1)  # BOS, task, prompt and SEP masked
        assert labels[sep + 1 :] == ids[sep + 1 :]  # answer and EOS supervised
        prompt, answer = ids[2:sep], ids[sep + 1 : -1]
        assert 1 <= len(answer) <= len(prompt)
        if ids[1] == TASK_CHAIN:
            for source, target in zip([prompt[-1], *answer[:-1]], answer, strict=True):
                learn(source, target)
        else:
            for source, target in zip(prompt, answer, strict=False):
                learn(source, target)
    # One function over the content tokens, and a permutation (no two tokens map to one).
    assert len(set(mapping.values())) == len(mapping) > 200
