"""Reading SFT samples from every supported input into an :class:`SFTDataset`.

Supported ``train_data``:
- a sequence of dicts ``{"input_ids": [...], "labels": [...]}`` (``labels`` optional);
- a sequence of chat dicts ``{"messages": [{"role": ..., "content": ...}, ...]}`` or ShareGPT
  dicts ``{"conversations": [{"from": ..., "value": ...}, ...]}`` (either with its own
  ``tools``), text dicts ``{"text": ...}`` or prompt-completion dicts ``{"prompt": ..., "completion": ...}`` (strings,
  or lists of messages), which need ``tokenizer`` (:mod:`lightning_skrull.data.formats`); a
  sample holding ``input_ids`` is read from them whatever else it holds, and a dataset holds one
  of the other formats (pre-tokenised samples mix with any);
- a ``datasets.Dataset`` with an ``input_ids`` (and optional ``labels``) column, or the columns
  of one of the other formats;
- a path, or a list of paths, to JSON Lines (``.jsonl``, ``.json``) or Parquet (``.parquet``)
  files, concatenated in the order given;
- an :class:`SFTDataset`, returned as it is.

Each sample is checked and gathered into flat arrays by
:class:`~lightning_skrull.data.sample_builder.SampleBuilder`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from lightning_skrull.data.chat import ChatTurns
from lightning_skrull.data.dataset import Origin, SFTDataset
from lightning_skrull.data.sample_builder import SampleBuilder

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)

SFTData = Any
"""Anything :func:`load_sft_data` accepts (see the module docstring)."""


def add_jsonl_line(
    builder: SampleBuilder, path: object, number: int, line: bytes, index: int
) -> None:
    """Parses line ``number`` of a JSON Lines file (not blank) as sample ``index``."""
    try:
        sample = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} line {number}: not valid JSON ({err.msg} at column {err.colno}). "
            "JSON Lines needs one complete JSON object per line; fix or remove that line."
        ) from None
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path} line {number}: not valid UTF-8 ({err.reason}); save the file as UTF-8."
        ) from None
    where = f"sample {index} ({path} line {number})"
    if not isinstance(sample, dict):
        raise ValueError(f"{where}: expected a JSON object per line, got {type(sample).__name__}.")
    builder.add_sample(sample, where)


def _read_jsonl(path: Path, builder: SampleBuilder) -> None:
    start = len(builder)
    line_numbers: list[int] = []
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            add_jsonl_line(builder, path, number, line, start + len(line_numbers))
            line_numbers.append(number)
    # An int64 array (8 bytes a line, not a Python int) that Origin only indexes like a sequence.
    numbers = cast(Sequence[int], np.asarray(line_numbers, dtype=np.int64))
    builder.origins.append(Origin(start, str(path), numbers))


def _read_parquet(path: Path, builder: SampleBuilder) -> None:
    import pyarrow.parquet as pq

    builder.add_table(pq.read_table(path), str(path))


def as_paths(train_data: object) -> list[Path] | None:
    if isinstance(train_data, (str, os.PathLike)):
        return [Path(train_data)]
    if isinstance(train_data, (list, tuple)) and train_data:
        is_path = [isinstance(p, (str, os.PathLike)) for p in train_data]
        if all(is_path):
            return [Path(p) for p in train_data]
        if any(is_path):
            raise TypeError(
                "train_data mixes file paths and other items; give either a list of paths or a "
                "list of sample dicts."
            )
    return None


def is_hf_dataset(train_data: object) -> bool:
    module = sys.modules.get("datasets")  # a datasets.Dataset implies the module is imported
    if module is None:
        return False
    if isinstance(train_data, (module.DatasetDict, module.IterableDataset)):
        raise TypeError(
            f"train_data is a datasets.{type(train_data).__name__}; pass one split as a "
            "map-style datasets.Dataset (e.g. dataset['train'], or load it without streaming)."
        )
    return isinstance(train_data, module.Dataset)


def load_sft_data(
    train_data: SFTData,
    *,
    tokenizer: Any = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    chat_turns: ChatTurns = "all",
    max_tokens: int | None = None,
    vocab_size: int | None = None,
    truncate: bool = False,
) -> SFTDataset:
    """Reads and validates SFT samples from any supported input (see the module docstring).

    Args:
        train_data: samples in memory, a ``datasets.Dataset``, file path(s), or an
            :class:`SFTDataset`.
        tokenizer: a Hugging Face tokenizer; needed for chat samples (``"messages"``, a fast
            tokenizer with a chat template), whose non-assistant tokens get label ``-100``, and
            for text and prompt-completion samples, whose prompt tokens get label ``-100``
            (:mod:`lightning_skrull.data.formats`).
        chat_template_kwargs: extra keyword arguments for ``tokenizer.apply_chat_template``, for
            every sample; a sample's own ``tools`` are added to them (not both for one sample).
        chat_turns: which assistant turns of a chat sample are supervised: ``"all"``, or
            ``"last"`` (the sample then ends with its last assistant turn).
        max_tokens, vocab_size, truncate: when given, :meth:`SFTDataset.validate` runs with them.

    Returns:
        The dataset, in input order (files in the order given, lines in file order).

    Warns:
        PromptBoundaryWarning: prompt-completion samples with a token across the end of the
            prompt (counted once).

    Raises:
        ValueError: bad data; the message names the sample, file and line, the rule and the fix.
        TypeError: an unsupported ``train_data`` type.
        FileNotFoundError: a path that does not exist.
    """
    if isinstance(train_data, SFTDataset):
        dataset = train_data
    else:
        builder = SampleBuilder(tokenizer, chat_template_kwargs, chat_turns)
        paths = as_paths(train_data)
        if paths is not None:
            for path in paths:
                _read_file(path, builder)
        elif is_hf_dataset(train_data):
            table = train_data.with_format("arrow")[0 : len(train_data)]
            builder.add_table(table, "datasets.Dataset")
        elif isinstance(train_data, Mapping) or not isinstance(train_data, Iterable):
            raise TypeError(
                f"train_data is a {type(train_data).__name__}; give a list of sample dicts, a "
                "datasets.Dataset, or path(s) to .jsonl / .parquet files."
            )
        else:
            for i, sample in enumerate(train_data):
                builder.add_sample(sample, f"sample {i}")
        dataset = builder.build()
        builder.warn_straddling()
    if max_tokens is not None or vocab_size is not None:
        dataset.validate(max_tokens=max_tokens, vocab_size=vocab_size, truncate=truncate)
    return dataset


def check_file(path: Path) -> str:
    """``"jsonl"`` or ``"parquet"``: the kind of a data file, which must exist."""
    if path.is_dir():
        raise ValueError(f"{path} is a directory; pass the .jsonl or .parquet files in it.")
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; check the train_data path.")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    raise ValueError(
        f"{path} has suffix {path.suffix!r}; supported files are JSON Lines "
        f"({', '.join(JSONL_SUFFIXES)}) and Parquet ({', '.join(PARQUET_SUFFIXES)})."
    )


def _read_file(path: Path, builder: SampleBuilder) -> None:
    if check_file(path) == "jsonl":
        _read_jsonl(path, builder)
    else:
        _read_parquet(path, builder)
