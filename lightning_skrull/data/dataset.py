"""Tokenised SFT samples: storage, validation and truncation.

An :class:`SFTDataset` holds every sample of a fine-tuning set as two flat ``int32`` arrays
(token ids and labels) plus offsets, so that the lengths the planner needs are free, memory stays
at 8 bytes per token, and validation of millions of tokens is a handful of vectorised passes.
:func:`~lightning_skrull.data.sources.load_sft_data` builds one from any supported input.

Rules checked when a dataset is built (they hold for every model):
    at least one sample; no sample without tokens; as many labels as tokens; token ids are
    non-negative integers; labels are ``-100`` or non-negative integers; at least one supervised
    token in the whole dataset.

Rules checked by :meth:`SFTDataset.validate`, once the model and the parallel layout are known:
    ids and labels below ``vocab_size``; no sample longer than ``max_tokens``
    (``cp_size * bucket_size``), or truncation to it when asked for.
"""

from __future__ import annotations

import bisect
import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils.data

from lightning_skrull.models.families.vision_language import TEXT_ONLY_FIX
from lightning_skrull.models.loss_kernels import IGNORE_INDEX

_INT32_MAX = int(np.iinfo(np.int32).max)


class TruncationWarning(UserWarning):
    """Warned once per :meth:`SFTDataset.validate` call that truncated over-long samples."""


@dataclass(frozen=True)
class Origin:
    """Where a run of consecutive samples came from, for error messages.

    Attributes:
        start: index of the first sample of the run in the dataset.
        source: a file name, ``"datasets.Dataset"``, or ``""`` for in-memory samples.
        line_numbers: 1-based line of each sample in ``source`` (JSON Lines files); ``None``
            when samples are rows counted from 0.
    """

    start: int
    source: str
    line_numbers: Sequence[int] | None = None


def describe_sample(index: int, origins: Sequence[Origin]) -> str:
    """``"sample 7 (train.jsonl line 9)"``: a sample index with its file and line or row."""
    if not origins:
        return f"sample {index}"
    pos = bisect.bisect_right([o.start for o in origins], index) - 1
    if pos < 0:
        return f"sample {index}"
    origin = origins[pos]
    if not origin.source:
        return f"sample {index}"
    local = index - origin.start
    if origin.line_numbers is not None:
        return f"sample {index} ({origin.source} line {origin.line_numbers[local]})"
    return f"sample {index} ({origin.source} row {local})"


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}; pass a positive number of tokens.")
    return int(value)


def sample_of_token(offsets: np.ndarray, flat_position: int) -> tuple[int, int]:
    """``(sample, position in it)`` of a position in the flat token array."""
    index = int(np.searchsorted(offsets, flat_position, side="right")) - 1
    return index, flat_position - int(offsets[index])


def check_empty_samples(offsets: np.ndarray, describe: Callable[[int], str]) -> None:
    """Refuses a sample without tokens (``offsets`` of the samples to check)."""
    lengths = np.diff(offsets)
    if (lengths < 0).any():
        raise ValueError("offsets must be non-decreasing.")
    empty = np.flatnonzero(lengths == 0)
    if len(empty):
        raise ValueError(
            f"{describe(int(empty[0]))} has empty input_ids ({len(empty)} such sample(s)); "
            "every sample needs at least one token. Remove empty samples from the data."
        )


def check_int32_column(
    name: str,
    values: np.ndarray,
    offsets: np.ndarray,
    describe: Callable[[int], str],
    *,
    allow_ignore: bool,
) -> np.ndarray:
    """Checks integer type and range of a flat column and returns it as ``int32``.

    ``offsets`` place the samples in ``values``; ``describe`` names sample ``i`` of them.
    """
    if values.size and values.dtype.kind not in "iu":
        raise ValueError(
            f"{name} must hold integers, got dtype {values.dtype}; convert the token ids to int "
            "(for a datasets.Dataset: dataset.cast_column(...) to a list of int64)."
        )
    if allow_ignore:
        bad = np.flatnonzero((values < 0) & (values != IGNORE_INDEX))
        rule = f"labels must be {IGNORE_INDEX} (not supervised) or a token id >= 0"
        fix = f"use {IGNORE_INDEX} for every token that is not supervised"
    else:
        bad = np.flatnonzero(values < 0)
        rule = "token ids must be >= 0"
        fix = "fix the tokenisation; padding or masking belongs in labels (-100), not input_ids"
    if len(bad):
        index, position = sample_of_token(offsets, int(bad[0]))
        raise ValueError(
            f"{describe(index)}: {name}[{position}] = {int(values[bad[0]])}; {rule}. "
            f"Fix: {fix}. ({len(bad)} such value(s) in the dataset.)"
        )
    if values.size and int(values.max()) > _INT32_MAX:
        flat = int(np.argmax(values))
        index, position = sample_of_token(offsets, flat)
        raise ValueError(
            f"{describe(index)}: {name}[{position}] = {int(values[flat])} is beyond any "
            f"vocabulary (token ids must be < 2**31); check the tokenisation of this sample."
        )
    return values.astype(np.int32, copy=False)


def empty_data_error(sources: Sequence[str]) -> ValueError:
    """The error for a dataset of 0 samples read from ``sources``."""
    where = f" (read from {', '.join(sorted(set(sources)))})" if sources else ""
    return ValueError(
        f"The training data is empty: 0 samples{where}. Give at least one sample "
        '{"input_ids": [...], "labels": [...]}.'
    )


def nothing_supervised_error(num_labels: int) -> ValueError:
    """The error for a dataset whose ``num_labels`` labels are all ``-100``."""
    return ValueError(
        f"No sample has a supervised token: all {num_labels} labels are {IGNORE_INDEX}, "
        "so training would learn nothing. Keep the labels of the tokens to learn (for "
        "chat data, the assistant turns) and set only the prompt tokens to -100."
    )


@dataclass(frozen=True)
class ValueRange:
    """The largest token id and label of a dataset, known when it was built (a cache stores
    them), so that the vocabulary check needs no pass over the tokens."""

    max_input_id: int
    max_label: int | None


class SFTDataset(torch.utils.data.Dataset):
    """Map-style dataset of tokenised SFT samples.

    ``dataset[i]`` is ``{"input_ids": list[int], "labels": list[int]}``; a label of ``-100``
    marks a token that is not supervised. Build one with
    :func:`~lightning_skrull.data.load_sft_data`; the constructor takes the flat storage directly.
    The arrays may be memory-mapped (``numpy.memmap``): they are only read, never copied.

    Args:
        input_ids: every sample's token ids, concatenated (1-D integer array).
        offsets: ``num_samples + 1`` non-decreasing positions into ``input_ids``; sample ``i`` is
            ``input_ids[offsets[i]:offsets[i + 1]]``.
        labels: same shape as ``input_ids``, or ``None`` when every token is supervised.
        origins: where the samples came from, used only to name files and lines in errors.

    Raises:
        ValueError: when a rule listed in the module docstring is broken; the message names the
            sample (and file and line when known), the value, the rule and the fix.
    """

    def __init__(
        self,
        input_ids: np.ndarray,
        offsets: np.ndarray,
        labels: np.ndarray | None = None,
        *,
        origins: Sequence[Origin] = (),
    ) -> None:
        self._origins = tuple(origins)
        offsets = np.asarray(offsets, dtype=np.int64)
        input_ids = np.asarray(input_ids)
        if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0:
            raise ValueError(
                "offsets must be a 1-D array starting at 0 with one entry per sample + 1."
            )
        if len(offsets) == 1:
            raise empty_data_error([o.source for o in self._origins if o.source])
        if input_ids.ndim != 1 or offsets[-1] != len(input_ids):
            raise ValueError(
                f"offsets end at {int(offsets[-1])} but input_ids holds {input_ids.size} tokens; "
                "they must describe the same flat array."
            )
        check_empty_samples(offsets, self.describe)
        ids32 = check_int32_column(
            "input_ids", input_ids, offsets, self.describe, allow_ignore=False
        )
        labels32: np.ndarray | None = None
        if labels is not None:
            labels = np.asarray(labels)
            if labels.shape != input_ids.shape:
                raise ValueError(
                    f"labels hold {labels.size} values but input_ids {input_ids.size}; give one label "
                    "per token."
                )
            labels32 = check_int32_column(
                "labels", labels, offsets, self.describe, allow_ignore=True
            )
            if (labels32 == IGNORE_INDEX).all():
                raise nothing_supervised_error(labels.size)
        self._set_storage(ids32, offsets, labels32, None)

    @classmethod
    def from_checked(
        cls,
        input_ids: np.ndarray,
        offsets: np.ndarray,
        labels: np.ndarray | None,
        *,
        value_range: ValueRange,
        origins: Sequence[Origin] = (),
    ) -> SFTDataset:
        """A dataset over storage that was checked when it was written (a cache).

        No pass over the tokens: the arrays (``int32`` tokens, ``int64`` offsets, typically
        memory-mapped) are used as they are; ``value_range`` replaces the vocabulary scan.
        """
        dataset = cls.__new__(cls)
        dataset._origins = tuple(origins)
        dataset._set_storage(input_ids, offsets, labels, value_range)
        return dataset

    def _set_storage(
        self,
        input_ids: np.ndarray,
        offsets: np.ndarray,
        labels: np.ndarray | None,
        value_range: ValueRange | None,
    ) -> None:
        self._input_ids = input_ids
        self._labels = labels
        self._offsets = offsets  # storage: never changed, truncation shortens _sizes only
        self._sizes = np.diff(offsets)  # tokens of each sample as trained (after truncation)
        self._lengths: list[int] = self._sizes.tolist()
        self._value_range = value_range

    # ------------------------------------------------------------------ checks
    def describe(self, index: int) -> str:
        """Names sample ``index`` with its file and line (or row) when known."""
        return describe_sample(index, self._origins)

    def validate(
        self,
        *,
        max_tokens: int | None = None,
        vocab_size: int | None = None,
        truncate: bool = False,
        image_token_id: int | None = None,
    ) -> SFTDataset:
        """Checks the samples against the model and the parallel layout; linear in tokens.

        Args:
            max_tokens: longest sequence that can be trained, ``cp_size * bucket_size`` (one
                sequence sharded over the whole CP group fills every rank's bucket).
            vocab_size: the model's vocabulary size; every token id and every supervised label
                must be below it.
            truncate: cut samples longer than ``max_tokens`` to their first ``max_tokens`` tokens,
                in place, with one :class:`TruncationWarning` that counts them. Off by default:
                an over-long sample is an error.
            image_token_id: the image placeholder token of a vision-language model trained on
                text only (:mod:`lightning_skrull.models.families.vision_language`); no input id may be it.

        Returns:
            ``self`` (truncated in place when ``truncate`` and some sample was too long).

        Raises:
            ValueError: an id or label ``>= vocab_size``, a sample longer than ``max_tokens``
                without ``truncate``, or an input id equal to ``image_token_id``.
        """
        if image_token_id is not None:
            self._check_no_image_token(image_token_id)
        if vocab_size is not None:
            vocab_size = _check_positive_int("vocab_size", vocab_size)
            known = self._value_range
            if known is None or known.max_input_id >= vocab_size:
                self._check_vocab("input_ids", self._input_ids, vocab_size)
            if self._labels is not None and (
                known is None or known.max_label is None or known.max_label >= vocab_size
            ):
                self._check_vocab("labels", self._labels, vocab_size)
        if max_tokens is not None:
            max_tokens = _check_positive_int("max_tokens", max_tokens)
            lengths = self._sizes
            too_long = np.flatnonzero(lengths > max_tokens)
            if len(too_long):
                if not truncate:
                    first = int(too_long[0])
                    longest = int(np.argmax(lengths))
                    raise ValueError(
                        f"{self.describe(first)} has {int(lengths[first])} tokens, more than "
                        f"max_tokens = {max_tokens} (cp_size * bucket_size: the most one sequence "
                        f"sharded over the whole CP group can hold). {len(too_long)} sample(s) are "
                        f"too long, the longest is {self.describe(longest)} with "
                        f"{int(lengths[longest])} tokens. Fix: raise bucket_size or cp_size so that "
                        f"cp_size * bucket_size >= {int(lengths[longest])}, or pass truncate=True "
                        f"to keep the first {max_tokens} tokens of each over-long sample."
                    )
                self._truncate(max_tokens, too_long)
        return self

    def _check_vocab(self, name: str, values: np.ndarray, vocab_size: int) -> None:
        bad = np.flatnonzero(values >= vocab_size)
        if len(bad):
            index, position = sample_of_token(self._offsets, int(bad[0]))
            raise ValueError(
                f"{self.describe(index)}: {name}[{position}] = {int(values[bad[0]])} is not below "
                f"the model's vocab_size = {vocab_size} ({len(bad)} such value(s), largest "
                f"{int(values.max())}). Fix: tokenise with the model's own tokenizer, or resize the "
                "model's embeddings (model.resize_token_embeddings) to cover the added tokens."
            )

    def _check_no_image_token(self, token_id: int) -> None:
        hits = np.flatnonzero(self._input_ids == token_id)
        if len(hits):
            index, position = sample_of_token(self._offsets, int(hits[0]))
            raise ValueError(
                f"{self.describe(index)}: input_ids[{position}] = {token_id} is the model's image "
                f"token, a placeholder for image features ({len(hits)} in the data). "
                f"{TEXT_ONLY_FIX}"
            )

    def _truncate(self, max_tokens: int, too_long: np.ndarray) -> None:
        """Shortens the over-long samples' lengths; the token storage is not touched."""
        longest = int(self._sizes.max())
        lost_all = 0
        if self._labels is not None:
            for i in too_long.tolist():
                start = int(self._offsets[i])
                kept = self._labels[start : start + max_tokens]
                lost_all += not bool((kept != IGNORE_INDEX).any())
        self._sizes = np.minimum(self._sizes, max_tokens)
        self._lengths = self._sizes.tolist()
        lost = f"; {lost_all} of them kept no supervised token" if lost_all else ""
        warnings.warn(
            f"Truncated {len(too_long)} of {len(self)} samples to max_tokens = {max_tokens} "
            f"(longest was {longest} tokens){lost}. Raise bucket_size or cp_size to "
            "train on whole samples.",
            TruncationWarning,
            stacklevel=3,
        )

    # --------------------------------------------------------------- accessors
    @property
    def lengths(self) -> list[int]:
        """Token count of every sample, in dataset order (all the planner needs)."""
        return self._lengths

    @property
    def num_tokens(self) -> int:
        """Total tokens over all samples."""
        return int(self._sizes.sum())

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def _span(self, index: int) -> tuple[int, int]:
        """``(start, end)`` of sample ``index`` in the flat storage (negative indices count from
        the end)."""
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(
                f"SFTDataset indices are ints, got {type(index).__name__}; index one sample at a time."
            ) from None
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample index {index} out of range for a dataset of {n} samples")
        start = int(self._offsets[i])
        return start, start + int(self._sizes[i])

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        start, end = self._span(index)
        ids = self._input_ids[start:end].tolist()
        labels = self._labels[start:end].tolist() if self._labels is not None else list(ids)
        return {"input_ids": ids, "labels": labels}

    def arrays(self, index: int) -> dict[str, np.ndarray]:
        """Sample ``index`` as int64 arrays (writable copies) rather than lists: what the data
        module hands the collate step.

        Every rank turns the whole global batch into tensors (for its supervised token count
        and checksum); from arrays that is a copy, from lists a per-token Python conversion:
        512 sequences of 400K tokens plan and collate in 17 ms instead of 107 ms, and the
        ``tolist`` here is saved too (docs/data.md).
        """
        start, end = self._span(index)
        ids = np.array(self._input_ids[start:end], dtype=np.int64)
        stored = self._labels[start:end] if self._labels is not None else ids
        return {"input_ids": ids, "labels": np.array(stored, dtype=np.int64)}

    def __repr__(self) -> str:
        return (
            f"SFTDataset(num_samples={len(self)}, num_tokens={self.num_tokens}, "
            f"max_length={max(self._lengths)})"
        )


class SampleView(torch.utils.data.Dataset):
    """Some samples of an :class:`SFTDataset`, in the given order (a held-out split).

    Args:
        base: the whole dataset.
        indices: the samples of the view.
    """

    def __init__(self, base: SFTDataset, indices: Sequence[int]) -> None:
        self.base = base
        self.indices = list(indices)

    @property
    def lengths(self) -> list[int]:
        """Token count of every sample of the view."""
        lengths = self.base.lengths
        return [lengths[i] for i in self.indices]

    def validate(self, **kwargs: Any) -> SampleView:
        """Validate (and, if asked, truncate) the underlying dataset."""
        self.base.validate(**kwargs)
        return self

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.base[self.indices[index]]

    def arrays(self, index: int) -> dict[str, np.ndarray]:
        """Sample ``index`` as arrays (:meth:`SFTDataset.arrays`)."""
        return self.base.arrays(self.indices[index])


def split_dataset(
    dataset: SFTDataset, num_held_out: int, *, seed: int = 0
) -> tuple[SampleView, SampleView]:
    """``(train, held_out)`` views: ``num_held_out`` samples chosen by a seeded permutation.

    Both keep dataset order among their own samples.

    Raises:
        ValueError: fewer than ``num_held_out + 1`` samples.
    """
    n = len(dataset)
    if not 0 < num_held_out < n:
        raise ValueError(
            f"val_split={num_held_out} must leave training samples: the data has {n} samples; "
            f"choose val_split in [1, {n - 1}]."
        )
    rng = torch.Generator().manual_seed(seed)
    held = set(torch.randperm(n, generator=rng)[:num_held_out].tolist())
    train = [i for i in range(n) if i not in held]
    return SampleView(dataset, train), SampleView(dataset, sorted(held))
