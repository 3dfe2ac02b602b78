"""One sample's checks, and the builder that gathers checked samples into flat arrays.

:class:`SampleBuilder` takes samples one at a time (a dict of any supported format, tokenised
with the tokenizer where needed) or a whole ``pyarrow.Table`` (a Parquet file, a
``datasets.Dataset``), checks each as it comes (flat integer ids, one label per token, no
padding marked by an ``attention_mask``), and builds one :class:`SFTDataset`, or a
:class:`Chunk` of a larger one (the cache's workers build chunks).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast, overload

import numpy as np

from lightning_skrull.data.chat import (
    ChatTurns,
    check_chat_tokenizer,
    check_chat_turns,
    sample_template_kwargs,
    sharegpt_messages,
    tokenize_chat,
    tokenize_chat_completion,
)
from lightning_skrull.data.dataset import (
    Origin,
    SFTDataset,
    check_empty_samples,
    check_int32_column,
    describe_sample,
)
from lightning_skrull.data.formats import (
    ACCEPTED_FORMATS,
    RAW_COLUMNS,
    OneFormat,
    PromptBoundaryWarning,
    SampleFormat,
    boundary_warning_text,
    check_text_tokenizer,
    sample_format,
    tokenize_prompt_completion,
    tokenize_text,
)


def _to_ids(value: object, name: str, where: str) -> np.ndarray:
    """One sample's ids or labels as a 1-D integer array, with a clear error otherwise."""
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as err:  # ragged nesting and the like
        raise ValueError(f"{where}: {name} is not a flat list of ints ({err}).") from None
    if array.ndim != 1:
        raise ValueError(
            f"{where}: {name} must be a flat list of ints, got {value!r:.80}; give one list per "
            "sample (no nesting, no batch dimension)."
        )
    if array.size and array.dtype.kind not in "iu":
        items = value if isinstance(value, (list, tuple)) else array.ravel().tolist()
        bad = [v for v in items if not isinstance(v, int) or isinstance(v, bool)]
        found = f"{bad[0]!r} ({type(bad[0]).__name__})" if bad else "ints beyond 64 bits"
        raise ValueError(
            f"{where}: {name} holds {found}; token ids must be integers. "
            "Fix: convert the ids to int when writing the data."
        )
    return _as_int64(array, f"{where}: {name}")


def _as_int64(array: np.ndarray, what: str) -> np.ndarray:
    """Integer array as int64 (one dtype, so that concatenation never turns into floats)."""
    if array.dtype == np.uint64 and array.size and int(array.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{what} holds ints beyond 64 bits; token ids must be small integers.")
    return array.astype(np.int64, copy=False)


def _check_shapes(ids: np.ndarray, labels: np.ndarray | None, where: str) -> None:
    """Refuse a sample without tokens, or with a label count other than its token count."""
    if ids.size == 0:
        raise ValueError(
            f"{where} has empty input_ids; every sample needs at least one token. Remove "
            "the sample from the data."
        )
    if labels is not None and labels.shape != ids.shape:
        raise ValueError(
            f"{where} has {labels.size} labels for {ids.size} input_ids; give exactly one "
            "label per token (-100 where the token is not supervised), or omit 'labels' "
            "to supervise every token."
        )


def _padding_error(where: str, zeros: int, length: int) -> ValueError:
    return ValueError(
        f"{where}: attention_mask has {zeros} zeros among its {length} entries, so the sample "
        "holds padding. Samples are packed whole and the mask is not read: the padding tokens "
        "would be trained on as context (left padding changes what every later token sees). "
        "Fix: keep only the tokens whose mask is 1, in input_ids and labels alike (tokenise "
        "without padding=...), or drop the attention_mask column."
    )


def _mask_shape_error(where: str, shape: tuple[int, ...], tokens: int) -> ValueError:
    return ValueError(
        f"{where}: attention_mask has shape {shape} for {tokens} input_ids; give one flat 0/1 "
        "entry per token, or drop the attention_mask column (it is not read)."
    )


def _check_attention_mask(mask: object, ids: np.ndarray, where: str) -> None:
    """Refuse a sample's ``attention_mask`` that marks padding, or does not match its ids."""
    array = np.asarray(mask)
    if array.ndim != 1 or array.shape != ids.shape:
        raise _mask_shape_error(where, array.shape, ids.size)
    zeros = int((array == 0).sum())
    if zeros:
        raise _padding_error(where, zeros, array.size)


def _check_attention_mask_column(
    table: Any, ids: Sequence[np.ndarray], source: str, start: int, row_base: int
) -> None:
    """:func:`_check_attention_mask` for a table's ``attention_mask`` column, column-wide."""
    import pyarrow.compute as pc

    column = table.column("attention_mask").combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False)
    nulls = column.is_null().to_numpy(zero_copy_only=False)
    for row, (length, null, row_ids) in enumerate(zip(lengths, nulls, ids, strict=True)):
        if not null and int(length) != row_ids.size:
            where = f"sample {start + row} ({source} row {row_base + row})"
            raise _mask_shape_error(where, (int(length),), row_ids.size)
    values = column.flatten().to_numpy(zero_copy_only=False)
    zero = np.flatnonzero(values == 0)
    if zero.size:
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        row = int(np.searchsorted(offsets, zero[0], side="right") - 1)
        in_row = values[offsets[row] : offsets[row + 1]]
        where = f"sample {start + row} ({source} row {row_base + row})"
        raise _padding_error(where, int((in_row == 0).sum()), int(lengths[row]))


class SampleBuilder:
    """Accumulates per-sample arrays, then builds one :class:`SFTDataset`."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template_kwargs: Mapping[str, Any] | None,
        chat_turns: ChatTurns = "all",
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template_kwargs = chat_template_kwargs
        self.chat_turns = check_chat_turns(chat_turns)
        self.ids: list[np.ndarray] = []
        self.labels: list[np.ndarray | None] = []
        self.origins: list[Origin] = []
        self._tokenizer_checked = False
        self.formats = OneFormat()  # of the samples that are not pre-tokenised
        self.straddling = 0  # prompt-completion samples with a token across the boundary
        self.first_straddling = ""

    def __len__(self) -> int:
        return len(self.ids)

    def add_sample(self, sample: object, where: str) -> None:
        if not isinstance(sample, Mapping):
            raise TypeError(
                f"{where} is a {type(sample).__name__}; each sample must be a dict, one of "
                f"{ACCEPTED_FORMATS}."
            )
        format_ = sample_format(sample, where)
        self.formats.see(format_, where)
        if format_ == "tokens":
            ids = _to_ids(sample["input_ids"], "input_ids", where)
            raw_labels = sample.get("labels")
            labels = None if raw_labels is None else _to_ids(raw_labels, "labels", where)
            _check_shapes(ids, labels, where)
            if sample.get("attention_mask") is not None:
                _check_attention_mask(sample["attention_mask"], ids, where)
        elif format_ in ("messages", "conversations", "conversational prompt-completion"):
            if self.tokenizer is None:
                what = {
                    "messages": "a chat sample ('messages')",
                    "conversations": "a ShareGPT chat sample ('conversations')",
                }.get(format_, f"a {format_} sample")
                raise ValueError(
                    f"{where} is {what} but no tokenizer was given; pass "
                    "tokenizer=AutoTokenizer.from_pretrained(<model>) to tokenise it with the "
                    "model's chat template."
                )
            if not self._tokenizer_checked:
                check_chat_tokenizer(self.tokenizer)
                self._tokenizer_checked = True
            kwargs = sample_template_kwargs(sample, where, self.chat_template_kwargs)
            if format_ == "conversational prompt-completion":
                raw_ids, raw_labels = tokenize_chat_completion(
                    sample["prompt"],
                    sample["completion"],
                    self.tokenizer,
                    where=where,
                    chat_template_kwargs=kwargs,
                )
            else:
                messages = (
                    sample["messages"]
                    if format_ == "messages"
                    else sharegpt_messages(
                        sample["conversations"], where, system=sample.get("system")
                    )
                )
                raw_ids, raw_labels = tokenize_chat(
                    messages,
                    self.tokenizer,
                    where=where,
                    chat_template_kwargs=kwargs,
                    chat_turns=self.chat_turns,
                )
            ids, labels = np.asarray(raw_ids, dtype=np.int64), np.asarray(raw_labels, np.int64)
        else:
            if sample_template_kwargs(sample, where, None) is not None:
                raise ValueError(
                    f"{where} is a {format_} sample with tools; tools are rendered by the chat "
                    "template, so only conversations (messages, conversations, or prompt and "
                    "completion as lists of messages) take them. Remove 'tools', or give the "
                    "sample as a conversation."
                )
            if not self._tokenizer_checked:
                check_text_tokenizer(self.tokenizer, format_, where)
                self._tokenizer_checked = True
            if format_ == "text":
                ids, labels = (
                    np.asarray(tokenize_text(sample["text"], self.tokenizer, where=where)),
                    None,
                )
            else:
                raw_ids, raw_labels, straddles = tokenize_prompt_completion(
                    sample["prompt"], sample["completion"], self.tokenizer, where=where
                )
                ids, labels = np.asarray(raw_ids, dtype=np.int64), np.asarray(raw_labels, np.int64)
                if straddles:
                    self.straddling += 1
                    self.first_straddling = self.first_straddling or where
            ids = ids.astype(np.int64, copy=False)
        self.ids.append(ids)
        self.labels.append(labels)

    def add_table(
        self, table: Any, source: str, *, start: int | None = None, row_base: int = 0
    ) -> None:
        """Adds every row of a ``pyarrow.Table`` (parquet file or ``datasets.Dataset``).

        ``start`` numbers the first row's sample (default: after the samples held) and
        ``row_base`` is that row's place in its source, for the messages of a table read in parts.
        """
        start = len(self) if start is None else start
        self.origins.append(Origin(start=start - row_base, source=source))
        names = table.column_names
        if "input_ids" in names:
            ids_column = _arrow_lists(table, "input_ids", source, start, row_base=row_base)
            labels_column = (
                _arrow_lists(table, "labels", source, start, nullable=True, row_base=row_base)
                if "labels" in names
                else [None] * len(ids_column)
            )
            if "attention_mask" in names:
                _check_attention_mask_column(table, ids_column, source, start, row_base)
            for i, (ids, labels) in enumerate(zip(ids_column, labels_column, strict=True)):
                where = f"sample {start + i} ({source} row {row_base + i})"
                _check_shapes(ids, labels, where)
                self.ids.append(ids)
                self.labels.append(labels)
        elif any(name in RAW_COLUMNS for name in names):
            for i, row in enumerate(table_rows(table)):
                self.add_sample(row, f"sample {start + i} ({source} row {row_base + i})")
        else:
            raise ValueError(
                f"{source} has columns {names}; none of them names a sample format. Accepted "
                f"formats: {ACCEPTED_FORMATS}. Rename the columns of the data."
            )

    def _flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        offsets = np.zeros(len(self.ids) + 1, dtype=np.int64)
        np.cumsum([a.size for a in self.ids], out=offsets[1:])
        ids = np.concatenate(self.ids) if self.ids else np.zeros(0, dtype=np.int64)
        labels = None
        if any(lab is not None for lab in self.labels):
            labels = np.concatenate(
                [
                    ids_i if lab is None else lab
                    for ids_i, lab in zip(self.ids, self.labels, strict=True)
                ]
            )
        return ids, offsets, labels

    def build(self) -> SFTDataset:
        ids, offsets, labels = self._flat()
        return SFTDataset(ids, offsets, labels, origins=self.origins)

    def chunk(self, start: int) -> Chunk:
        """The samples held, checked as a part of a larger dataset whose sample ``start`` is the
        first of them (the checks that concern the whole dataset are the caller's)."""
        ids, offsets, labels = self._flat()
        origins = self.origins

        def describe(index: int) -> str:
            return describe_sample(start + index, origins)

        check_empty_samples(offsets, describe)
        ids32 = check_int32_column("input_ids", ids, offsets, describe, allow_ignore=False)
        labels32 = None
        if labels is not None:
            labels32 = check_int32_column("labels", labels, offsets, describe, allow_ignore=True)
        return Chunk(
            ids32,
            labels32,
            np.diff(offsets),
            self.formats.format,
            self.formats.where,
            self.straddling,
            self.first_straddling,
        )

    def warn_straddling(self) -> None:
        """One :class:`PromptBoundaryWarning` when some prompt-completion sample had a token
        across the end of its prompt."""
        if self.straddling:
            warn_straddling(self.straddling, self.first_straddling)


def warn_straddling(count: int, first: str) -> None:
    """Warns a :class:`PromptBoundaryWarning` for ``count`` samples, the first ``first``."""
    warnings.warn(boundary_warning_text(count, first), PromptBoundaryWarning, stacklevel=3)


def table_rows(table: Any) -> list[dict[str, Any]]:
    """The rows of a table that holds samples to tokenise, as dicts (a null, where a dataset made
    by mixing sources lacks a column, is read as an absent key by :func:`sample_format`).

    Inside a row's values, dict entries that are null are dropped (:func:`_without_nulls`): an
    Arrow struct column has one type for every row, the union of every row's keys, so a message,
    a tool call's ``arguments`` or a tool schema read back holds ``None`` for each key that
    another row has and it lacks. The chat template would render those (``"unit": null`` in a
    supervised tool call, ``'tool_calls' in message`` true on every user message); without them
    the sample renders as written. An Arrow struct cannot tell such a key from one written as
    null, so an explicit null inside a nested value is dropped too.
    """
    rows = cast(list[dict[str, Any]], table.to_pylist())
    return [{key: _without_nulls(value) for key, value in row.items()} for row in rows]


def _without_nulls(value: Any) -> Any:
    """``value`` with the null entries of every dict in it dropped (list items are kept)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


@dataclass(frozen=True)
class Chunk:
    """Consecutive checked samples, flat: ``int32`` ids and labels (``None``: every token
    supervised) and the ``int64`` length of each sample; the format of the samples that were not
    pre-tokenised and the first of them, and the prompt-completion samples with a token across
    the end of the prompt (their count and the first)."""

    input_ids: np.ndarray
    labels: np.ndarray | None
    lengths: np.ndarray
    format: SampleFormat | None = None
    format_where: str = ""
    straddling: int = 0
    first_straddling: str = ""


@overload
def _arrow_lists(
    table: Any,
    name: str,
    source: str,
    start: int,
    *,
    nullable: Literal[False] = False,
    row_base: int = 0,
) -> list[np.ndarray]: ...


@overload
def _arrow_lists(
    table: Any, name: str, source: str, start: int, *, nullable: Literal[True], row_base: int = 0
) -> list[np.ndarray | None]: ...


def _arrow_lists(
    table: Any, name: str, source: str, start: int, *, nullable: bool = False, row_base: int = 0
) -> Sequence[np.ndarray | None]:
    """A list-of-int column as one array per row, checked for type and nulls column-wide.

    A row is ``None`` only for a null in a ``nullable`` column; otherwise a null is refused.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    column = table.column(name).combine_chunks()
    kind = column.type
    if nullable and pa.types.is_null(kind):  # a column of missing values only
        return [None] * len(column)
    if not (
        pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    ) or not pa.types.is_integer(kind.value_type):
        raise ValueError(
            f"{source}: column '{name}' has type {kind}; it must be a list of integers. Fix: write "
            "the ids as integers (a datasets.Dataset: dataset.cast_column"
            f"('{name}', datasets.Sequence(datasets.Value('int64'))))."
        )
    if column.null_count and not nullable:
        row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        raise ValueError(
            f"sample {start + row} ({source} row {row_base + row}): {name} is null; every sample needs a list "
            "of token ids."
        )
    values = column.flatten()
    if values.null_count:
        raise ValueError(
            f"{source}: column '{name}' contains null token ids; every id must be an integer."
        )
    flat = _as_int64(values.to_numpy(zero_copy_only=False), f"{source}: column '{name}'")
    lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False)
    nulls = column.is_null().to_numpy(zero_copy_only=False) if column.null_count else None
    splits = np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else []
    if nulls is None:
        return list(splits)
    return [None if is_null else part for part, is_null in zip(splits, nulls, strict=True)]
