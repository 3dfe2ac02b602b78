"""Loading SFT samples from every input kind, and every validation rule with its message.

References are the plain Python samples the inputs were written from; comparisons are exact
(integers, no tolerance).
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lightning_skrull.data import IGNORE_INDEX, SFTDataset, TruncationWarning, load_sft_data
from lightning_skrull.data.cache import cached_sft_data

SAMPLES = [
    {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
    {"input_ids": [9]},  # no labels: every token supervised
    {"input_ids": [1, 2, 3, 4, 5, 6, 7], "labels": [-100, 2, 3, -100, 5, 6, 7]},
    {"input_ids": [0, 11], "labels": [-100, 11]},
]


def _expected(samples: list[dict]) -> list[dict[str, list[int]]]:
    """Independent expectation: labels default to a copy of input_ids."""
    return [
        {"input_ids": list(s["input_ids"]), "labels": list(s.get("labels") or s["input_ids"])}
        for s in samples
    ]


def _all(dataset: SFTDataset) -> list[dict[str, list[int]]]:
    return [dataset[i] for i in range(len(dataset))]


def _write_jsonl(path: Path, samples: list[dict], blank_lines_first: int = 0) -> Path:
    lines = ["\n"] * blank_lines_first + [json.dumps(s) + "\n" for s in samples]
    path.write_text("".join(lines), encoding="utf-8")
    return path


def _write_parquet(path: Path, samples: list[dict]) -> Path:
    table = pa.table(
        {
            "input_ids": [s["input_ids"] for s in samples],
            "labels": [s.get("labels") for s in samples],
        }
    )
    pq.write_table(table, path)
    return path


# ------------------------------------------------------------------ input kinds
def test_every_input_kind_loads_the_same_samples(tmp_path: Path) -> None:
    expected = _expected(SAMPLES)
    jsonl = _write_jsonl(tmp_path / "a.jsonl", SAMPLES)
    parquet = _write_parquet(tmp_path / "a.parquet", SAMPLES)
    first = _write_jsonl(tmp_path / "first.jsonl", SAMPLES[:3])
    second = _write_parquet(tmp_path / "second.parquet", SAMPLES[3:])
    hf = datasets.Dataset.from_list([{**s, "labels": s.get("labels")} for s in SAMPLES])
    inputs = {
        "list": SAMPLES,
        "generator": (s for s in SAMPLES),
        "datasets.Dataset": hf,
        "jsonl path str": str(jsonl),
        "jsonl Path": jsonl,
        "parquet": parquet,
        "list of paths": [first, second],
    }
    for kind, data in inputs.items():
        dataset = load_sft_data(data)
        assert _all(dataset) == expected, kind
        assert dataset.lengths == [len(s["input_ids"]) for s in SAMPLES], kind
    built = load_sft_data(SAMPLES)
    assert load_sft_data(built) is built


def test_datasets_view_keeps_its_order_and_numpy_and_tensor_ids_are_accepted() -> None:
    import torch

    hf = datasets.Dataset.from_list([{"input_ids": s["input_ids"]} for s in SAMPLES])
    view = hf.select([3, 0, 2])
    assert [s["input_ids"] for s in _all(load_sft_data(view))] == [
        SAMPLES[3]["input_ids"],
        SAMPLES[0]["input_ids"],
        SAMPLES[2]["input_ids"],
    ]
    loaded = load_sft_data(
        [
            {"input_ids": np.array([3, 4], dtype=np.int16)},
            {"input_ids": torch.tensor([7])},
            {"input_ids": np.array([9], dtype=np.uint64)},  # with int64: no float promotion
        ]
    )
    assert _all(loaded) == [
        {"input_ids": [3, 4], "labels": [3, 4]},
        {"input_ids": [7], "labels": [7]},
        {"input_ids": [9], "labels": [9]},
    ]


def test_getitem_indexing() -> None:
    dataset = load_sft_data(SAMPLES)
    assert len(dataset) == 4
    assert dataset[-1] == dataset[3] == _expected(SAMPLES)[3]
    assert dataset[np.int64(2)] == _expected(SAMPLES)[2]
    with pytest.raises(IndexError, match="sample index 4 out of range for a dataset of 4"):
        dataset[4]
    with pytest.raises(TypeError, match="indices are ints"):
        dataset[0:2]  # type: ignore[index]
    assert dataset.num_tokens == 14


def test_batch_build_benchmark_smoke() -> None:
    from benchmarks import batch_build

    (row,) = batch_build.main(["--smoke"])
    assert row["sequences"] == 16 and row["lists_ms"] > 0 and row["arrays_ms"] > 0


def test_arrays_hold_the_same_sample_as_getitem_and_collate_the_same() -> None:
    from lightning_skrull.data.collate import collate_rank
    from lightning_skrull.scheduling import plan_global_batch

    # with and without labels: a sample without them supervises every token
    dataset = load_sft_data([*SAMPLES, {"input_ids": [4, 5, 6]}])
    for i in range(-len(dataset), len(dataset)):
        got = dataset.arrays(i)
        assert {k: v.tolist() for k, v in got.items()} == dataset[i]
        assert all(v.dtype == np.int64 and v.flags.writeable for v in got.values())
    with pytest.raises(IndexError, match="sample index 5 out of range"):
        dataset.arrays(5)
    # the collate step makes the very same rank batch (tokens, labels, checksum) from either
    lengths = [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
    plan = plan_global_batch(lengths, dp_size=2, cp_size=2, bucket_size=8)
    for dp_rank in range(2):
        batches = [
            collate_rank(samples, plan, dp_rank=dp_rank, cp_rank=1, world_size=4)
            for samples in (
                [dataset[i] for i in range(len(dataset))],
                [dataset.arrays(i) for i in range(len(dataset))],
            )
        ]
        assert batches[0].fingerprint == batches[1].fingerprint
        assert batches[0].num_supervised_tokens == batches[1].num_supervised_tokens
        for a, b in zip(batches[0].micro_batches, batches[1].micro_batches, strict=True):
            assert a.inputs.keys() == b.inputs.keys()
            for key in a.inputs:
                assert a.inputs[key].dtype == b.inputs[key].dtype
                assert bool((a.inputs[key] == b.inputs[key]).all()), key


# ------------------------------------------------------------ structural errors
@pytest.mark.parametrize(
    ("samples", "message"),
    [
        ([], "The training data is empty: 0 samples"),
        (
            [{"input_ids": [1]}, {"input_ids": []}],
            "sample 1 has empty input_ids; every sample needs at least one token",
        ),
        (
            [{"input_ids": [1, 2], "labels": [1]}],
            "sample 0 has 1 labels for 2 input_ids; give exactly one label per token",
        ),
        ([{"input_ids": [1, 2.5]}], r"sample 0: input_ids holds 2.5 \(float\); token ids must be"),
        ([{"input_ids": [1, "x"]}], r"sample 0: input_ids holds 'x' \(str\)"),
        ([{"input_ids": [True]}], r"input_ids holds True \(bool\)"),
        ([{"input_ids": [1, 2**70]}], "input_ids holds ints beyond 64 bits"),
        ([{"input_ids": [[1, 2]]}], "input_ids must be a flat list of ints"),
        (
            [{"input_ids": [1]}, {"input_ids": [4, -3, 2]}],
            r"sample 1: input_ids\[1\] = -3; token ids must be >= 0",
        ),
        (
            [{"input_ids": [1, 2], "labels": [-1, 2]}],
            r"sample 0: labels\[0\] = -1; labels must be -100 \(not supervised\) or a token id",
        ),
        (
            [{"input_ids": [1, 2], "labels": [-100, -100]}],
            "No sample has a supervised token: all 2 labels are -100",
        ),
        ([{"input_ids": [1, 2**40]}], "beyond any vocabulary"),
        (
            [{"txt": "hello"}],
            r"sample 0 has keys \['txt'\]; none of them names a sample format. Accepted formats: "
            r"\{'input_ids'",
        ),
    ],
)
def test_bad_samples_raise_value_error_naming_sample_rule_and_fix(
    samples: list[dict], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        load_sft_data(samples)


def test_padding_marked_by_attention_mask_is_refused_in_every_input_kind(tmp_path: Path) -> None:
    # a tokenizer's left padding: the mask is not read and every sequence is packed whole, so the
    # pad tokens would be context for the real ones; refused, wherever the samples come from
    samples = [
        {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]},
        {"input_ids": [0, 0, 8, 9], "labels": [-100, -100, 8, 9], "attention_mask": [0, 0, 1, 1]},
    ]
    path = tmp_path / "padded.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    parquet = tmp_path / "padded.parquet"
    pq.write_table(pa.Table.from_pylist(samples), parquet)
    table = datasets.Dataset.from_list(samples)
    expected = {
        "list": "sample 1: attention_mask has 2 zeros among its 4 entries",
        "jsonl": r"sample 1 \(.*padded.jsonl line 2\): attention_mask has 2 zeros",
        "parquet": r"sample 1 \(.*padded.parquet row 1\): attention_mask has 2 zeros",
        "datasets": r"sample 1 \(datasets.Dataset row 1\): attention_mask has 2 zeros",
    }
    for kind, data in (
        ("list", samples),
        ("jsonl", path),
        ("parquet", parquet),
        ("datasets", table),
    ):
        with pytest.raises(ValueError, match=expected[kind]) as refused:
            load_sft_data(data)
        assert "keep only the tokens whose mask is 1" in str(refused.value)
    for data in (path, parquet):  # the data module's cache reads files in parts, same message
        with pytest.raises(ValueError, match=r"sample 1 .* attention_mask has 2 zeros"):
            cached_sft_data(data, cache_dir=tmp_path / "cache", progress=False)
    # an all-ones mask (no padding) is accepted, and changes nothing
    unpadded = [samples[0], {"input_ids": [8, 9], "attention_mask": [True, True]}]
    dataset = load_sft_data(unpadded)
    assert [dataset[i]["input_ids"] for i in range(2)] == [[5, 6, 7], [8, 9]]
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2,\) for 3 input_ids"):
        load_sft_data([{"input_ids": [1, 2, 3], "attention_mask": [1, 1]}])
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2,\) for 3 input_ids"):
        load_sft_data(
            datasets.Dataset.from_list([{"input_ids": [1, 2, 3], "attention_mask": [1, 1]}])
        )


def test_wrong_types_raise_type_error(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="sample 0 is a list; each sample must be a dict"):
        load_sft_data([[1, 2, 3]])
    with pytest.raises(TypeError, match="train_data is a dict"):
        load_sft_data({"input_ids": [[1, 2]]})
    with pytest.raises(TypeError, match="train_data is a int"):
        load_sft_data(3)
    with pytest.raises(TypeError, match=r"pass one split .*dataset\['train'\]"):
        load_sft_data(datasets.DatasetDict({"train": datasets.Dataset.from_list(SAMPLES[1:2])}))
    with pytest.raises(TypeError, match="mixes file paths and other items"):
        load_sft_data([tmp_path / "a.jsonl", {"input_ids": [1]}])


def test_file_errors_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text('{"input_ids": [1, 2]}\n\n{"input_ids": [3,\n{"input_ids": [4]}\n')
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} line 3: not valid JSON"):
        load_sft_data(path)

    # Blank lines are skipped but still counted: sample 1 sits on line 4.
    path.write_text('{"input_ids": [1]}\n\n\n{"input_ids": [2, 3], "labels": [2]}\n')
    with pytest.raises(
        ValueError, match=rf"sample 1 \({re.escape(str(path))} line 4\) has 1 labels"
    ):
        load_sft_data(path)

    path.write_bytes(b'{"input_ids": [1]}\n{"input_ids": [2], "note": "\xff"}\n')
    with pytest.raises(ValueError, match=r"line 2: not valid UTF-8"):
        load_sft_data(path)

    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="line 1\\): expected a JSON object per line, got list"):
        load_sft_data(path)

    # Errors found after concatenation still name the file and line of the sample.
    first = _write_jsonl(tmp_path / "first.jsonl", SAMPLES[:2])
    second = _write_jsonl(tmp_path / "second.jsonl", [{"input_ids": [1, -5]}], blank_lines_first=2)
    with pytest.raises(ValueError, match=rf"sample 2 \({re.escape(str(second))} line 3\)"):
        load_sft_data([first, second])

    parquet = _write_parquet(tmp_path / "p.parquet", [{"input_ids": [1]}, {"input_ids": []}])
    with pytest.raises(ValueError, match=r"sample 1 \(.*p.parquet row 1\) has empty input_ids"):
        load_sft_data(parquet)
    pq.write_table(pa.table({"input_ids": [[1.0, 2.0]]}), tmp_path / "f.parquet")
    with pytest.raises(
        ValueError,
        match=r"column 'input_ids' has type list<.*double>; it must be a list of integers",
    ):
        load_sft_data(tmp_path / "f.parquet")

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"The training data is empty: 0 samples \(read from"):
        load_sft_data(empty)
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl does not exist"):
        load_sft_data(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match=r"has suffix '\.csv'; supported files are JSON Lines"):
        (tmp_path / "data.csv").write_text("x\n")
        load_sft_data(tmp_path / "data.csv")
    with pytest.raises(ValueError, match="is a directory"):
        load_sft_data(tmp_path)


# ---------------------------------------------------------- validate(): model fit
def test_vocab_size_is_checked_on_ids_and_supervised_labels() -> None:
    dataset = load_sft_data(SAMPLES)
    assert dataset.validate(vocab_size=12) is dataset
    with pytest.raises(ValueError, match=r"sample 3: input_ids\[1\] = 11 is not below .* = 11"):
        dataset.validate(vocab_size=11)
    labels_only = load_sft_data([{"input_ids": [1, 2], "labels": [-100, 40]}])
    with pytest.raises(ValueError, match=r"sample 0: labels\[1\] = 40 is not below"):
        labels_only.validate(vocab_size=10)
    with pytest.raises(ValueError, match="vocab_size must be >= 1, got 0"):
        dataset.validate(vocab_size=0)
    with pytest.raises(TypeError, match="max_tokens must be an int"):
        dataset.validate(max_tokens=2.5)  # type: ignore[arg-type]


def test_too_long_sample_is_an_error_by_default() -> None:
    dataset = load_sft_data(SAMPLES)
    dataset.validate(max_tokens=7)  # the longest sample fits exactly
    with pytest.raises(
        ValueError,
        match=r"sample 0 has 4 tokens, more than max_tokens = 3 \(cp_size \* bucket_size.*"
        r"2 sample\(s\) are too long, the longest is sample 2 with 7 tokens.*"
        r"cp_size \* bucket_size >= 7, or pass truncate=True",
    ):
        dataset.validate(max_tokens=3)
    assert dataset.lengths == [4, 1, 7, 2]  # the failed check changed nothing


def test_truncation_is_opt_in_and_warns_once_with_a_count() -> None:
    dataset = load_sft_data(SAMPLES)
    with pytest.warns(TruncationWarning) as record:
        assert dataset.validate(max_tokens=3, truncate=True) is dataset
    assert len(record) == 1
    assert "Truncated 2 of 4 samples to max_tokens = 3 (longest was 7 tokens)" in str(
        record[0].message
    )
    # Sample 0 keeps [5, 6, 7] whose only supervised label is 7.
    expected = [
        {k: v[:3] for k, v in sample.items()} for sample in _expected(SAMPLES)
    ]  # independent: slice every list
    assert _all(dataset) == expected
    assert dataset.lengths == [3, 1, 3, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dataset.validate(max_tokens=3, truncate=True)  # nothing left to truncate: no warning


def test_truncation_counts_samples_left_without_supervision() -> None:
    dataset = load_sft_data(
        [{"input_ids": [1, 2, 3, 4], "labels": [-100, -100, -100, 4]}, {"input_ids": [1]}]
    )
    with pytest.warns(TruncationWarning, match="1 of them kept no supervised token"):
        dataset.validate(max_tokens=2, truncate=True)
    assert dataset[0] == {"input_ids": [1, 2], "labels": [IGNORE_INDEX, IGNORE_INDEX]}


def test_validate_runs_from_load_sft_data() -> None:
    with pytest.raises(ValueError, match="more than max_tokens = 2"):
        load_sft_data(SAMPLES, max_tokens=2)
    with pytest.warns(TruncationWarning, match="Truncated 2 of 4"):
        assert load_sft_data(SAMPLES, max_tokens=3, truncate=True).lengths == [3, 1, 3, 2]


def test_large_dataset_round_trips_through_flat_storage() -> None:
    # 5k samples with random lengths: vectorised checks and offsets must agree with the lists.
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 50, size=5_000)
    samples = [{"input_ids": rng.integers(0, 1000, size=n).tolist()} for n in lengths]
    dataset = load_sft_data(samples, vocab_size=1000, max_tokens=49)
    assert dataset.lengths == lengths.tolist()
    for i in (0, 1, 2_500, 4_999):
        assert dataset[i]["input_ids"] == samples[i]["input_ids"]
    samples[1_234]["input_ids"][-1] = 1000
    with pytest.raises(ValueError, match=r"sample 1234: input_ids\[\d+\] = 1000 is not below"):
        load_sft_data(samples, vocab_size=1000)
