"""Writing a cache's arrays: tokenisation tasks, their worker pool, and the writer.

:func:`write_arrays` reads the sources of a cache (JSON Lines in tasks of lines, Parquet files
and ``datasets.Dataset`` in record batches), has the samples to tokenise converted in order by
a pool of worker processes (:class:`~lightning_skrull.data.sample_builder.SampleBuilder` checks
each chunk as :func:`~lightning_skrull.data.sources.load_sft_data` would), and appends the
checked chunks to the flat files of :mod:`~lightning_skrull.data.cache`'s layout. The key, the
manifest and the build's locking and installation are :mod:`~lightning_skrull.data.cache`'s.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np

from lightning_skrull.data.chat import ChatTurns
from lightning_skrull.data.dataset import (
    IGNORE_INDEX,
    Origin,
    empty_data_error,
    nothing_supervised_error,
)
from lightning_skrull.data.formats import RAW_COLUMNS, OneFormat
from lightning_skrull.data.sample_builder import Chunk, SampleBuilder, table_rows
from lightning_skrull.data.sources import add_jsonl_line, check_file

_LINES_PER_CHUNK = 512
_ROWS_PER_BATCH = 8192


def file_digest(path: Path) -> str:
    """SHA-256 of a file's contents, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def file_stat(path: Path) -> dict[str, int]:
    """A file's size and modification time (what opening a cache compares first)."""
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


@dataclass(frozen=True)
class _LinesTask:
    """Lines of a JSON Lines file: sample ``start`` is on line ``numbers[0]``."""

    source: str
    start: int
    numbers: list[int]
    lines: list[bytes]


@dataclass(frozen=True)
class _RowsTask:
    """Rows of a table to tokenise (chat, text, prompt-completion): sample ``start`` is row
    ``row_base`` of ``source``."""

    source: str
    start: int
    row_base: int
    rows: list[dict[str, Any]]


_Task = _LinesTask | _RowsTask


def _convert(
    task: _Task,
    tokenizer: Any,
    chat_template_kwargs: Mapping[str, Any] | None,
    chat_turns: ChatTurns,
) -> Chunk:
    builder = SampleBuilder(tokenizer, chat_template_kwargs, chat_turns)
    if isinstance(task, _LinesTask):
        builder.origins.append(Origin(task.start, task.source, cast(Sequence[int], task.numbers)))
        for k, (number, line) in enumerate(zip(task.numbers, task.lines, strict=True)):
            add_jsonl_line(builder, task.source, number, line, task.start + k)
    else:
        builder.origins.append(Origin(task.start - task.row_base, task.source))
        for k, row in enumerate(task.rows):
            where = f"sample {task.start + k} ({task.source} row {task.row_base + k})"
            builder.add_sample(row, where)
    return builder.chunk(task.start)


# A worker process serves one build: its tokenizer is set once, when the pool starts it.
_worker_args: tuple[Any, Mapping[str, Any] | None, ChatTurns] = (None, None, "all")


def _init_worker(
    tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None, chat_turns: ChatTurns
) -> None:
    global _worker_args
    _worker_args = (tokenizer, chat_template_kwargs, chat_turns)


def _convert_in_worker(task: _Task) -> Chunk:
    return _convert(task, *_worker_args)


class _Converter:
    """Converts tasks in order: the first in this process, the rest on a pool of ``num_proc``
    workers started at the second task (small data never starts one), with a bounded number in
    flight so that memory stays flat."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template_kwargs: Mapping[str, Any] | None,
        chat_turns: ChatTurns,
        num_proc: int,
    ) -> None:
        self.num_proc = num_proc
        self.pool: Any = None
        self.seen = 0
        self._args = (tokenizer, chat_template_kwargs, chat_turns)

    def map(self, tasks: Iterator[_Task]) -> Iterator[Chunk]:
        pending: deque[Any] = deque()
        for task in tasks:
            self.seen += 1
            if self.num_proc <= 1 or self.seen == 1:
                while pending:
                    yield pending.popleft().get()
                yield _convert(task, *self._args)
                continue
            if self.pool is None:
                methods = multiprocessing.get_all_start_methods()
                # fork, as DataLoader workers do: no re-import of the package per worker
                context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
                self.pool = context.Pool(
                    self.num_proc,
                    initializer=_init_worker,
                    initargs=self._args,
                )
            pending.append(self.pool.apply_async(_convert_in_worker, (task,)))
            if len(pending) >= 2 * self.num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


class _Writer:
    """Appends checked chunks to the cache's flat files and keeps the per-sample counts."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.ids: BinaryIO = (directory / "input_ids.int32").open("wb")
        self.labels: BinaryIO = (directory / "labels.int32").open("wb")
        self.lengths: list[np.ndarray] = []
        self.num_samples = 0
        self.num_tokens = 0
        self.has_labels = False
        self.supervised = 0
        self.max_input_id = -1
        self.max_label = IGNORE_INDEX
        self.formats = OneFormat()
        self.straddling = 0
        self.first_straddling = ""

    def add(self, chunk: Chunk) -> None:
        self.formats.see(chunk.format, chunk.format_where)
        self.straddling += chunk.straddling
        self.first_straddling = self.first_straddling or chunk.first_straddling
        self.ids.write(chunk.input_ids.tobytes())
        labels = chunk.input_ids if chunk.labels is None else chunk.labels
        self.labels.write(labels.tobytes())
        self.has_labels |= chunk.labels is not None
        self.lengths.append(chunk.lengths)
        self.num_samples += len(chunk.lengths)
        self.num_tokens += chunk.input_ids.size
        if chunk.input_ids.size:
            self.max_input_id = max(self.max_input_id, int(chunk.input_ids.max()))
            self.max_label = max(self.max_label, int(labels.max()))
            self.supervised += int((labels != IGNORE_INDEX).sum())

    def finish(self) -> None:
        for handle in (self.ids, self.labels):
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
        if not self.has_labels:
            (self.directory / "labels.int32").unlink()
        offsets = np.zeros(self.num_samples + 1, dtype=np.int64)
        if self.lengths:
            np.cumsum(np.concatenate(self.lengths), out=offsets[1:])
        _write_array(self.directory / "offsets.int64", offsets)


def _write_array(path: Path, values: np.ndarray) -> None:
    with path.open("wb") as handle:
        handle.write(values.tobytes())
        handle.flush()
        os.fsync(handle.fileno())


def _progress(total: int, desc: str, unit: str, enabled: bool | None) -> Any:
    from tqdm.auto import tqdm

    # disable=None: shown only when stderr is a terminal
    disable = None if enabled is None else not enabled
    return tqdm(
        total=total, desc=desc, unit=unit, unit_scale=True, disable=disable, mininterval=1.0
    )


def _jsonl_tasks(
    path: Path, start: int, numbers: list[int], digest: Any, advance: Callable[[int], Any]
) -> Iterator[_LinesTask]:
    """Tasks of ``_LINES_PER_CHUNK`` non-blank lines; records line numbers and hashes the file."""
    batch_numbers: list[int] = []
    lines: list[bytes] = []
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            digest.update(line)
            advance(len(line))
            if not line.strip():
                continue
            batch_numbers.append(number)
            lines.append(line)
            if len(lines) == _LINES_PER_CHUNK:
                yield _LinesTask(str(path), start + len(numbers), batch_numbers, lines)
                numbers.extend(batch_numbers)
                batch_numbers, lines = [], []
    if lines:
        yield _LinesTask(str(path), start + len(numbers), batch_numbers, lines)
        numbers.extend(batch_numbers)


def _table_chunks(
    batches: Iterator[Any],
    source: str,
    start: int,
    converter: _Converter,
    advance: Callable[[int], Any],
) -> Iterator[Chunk]:
    """Chunks of a table read in record batches: id columns converted here (vectorised), rows to
    tokenise (chat, text, prompt-completion) by the converter's workers."""
    import pyarrow as pa

    row = 0
    for batch in batches:
        table = pa.Table.from_batches([batch]) if isinstance(batch, pa.RecordBatch) else batch
        names = table.column_names
        if "input_ids" not in names and any(name in RAW_COLUMNS for name in names):
            rows = table_rows(table)
            tasks = [
                _RowsTask(source, start + row + at, row + at, rows[at : at + _LINES_PER_CHUNK])
                for at in range(0, len(rows), _LINES_PER_CHUNK)
            ]
            yield from converter.map(iter(tasks))
        else:
            builder = SampleBuilder(None, None)
            builder.add_table(table, source, start=start + row, row_base=row)
            yield builder.chunk(start + row)
        row += len(table)
        advance(len(table))


def write_arrays(
    tmp: Path,
    sources: tuple[Path, ...] | Any,
    *,
    tokenizer: Any,
    chat_template_kwargs: Mapping[str, Any] | None,
    chat_turns: ChatTurns,
    num_proc: int,
    progress: bool | None,
) -> dict[str, Any]:
    """Tokenises ``sources`` and writes the cache's arrays into ``tmp``.

    Args:
        tmp: the directory being built.
        sources: file paths, or one ``datasets.Dataset`` (see ``CacheSpec.sources``).
        tokenizer: the tokenizer for chat, text and prompt-completion samples (or ``None``).
        chat_template_kwargs: extra arguments of ``apply_chat_template``.
        chat_turns: which assistant turns of chat samples are supervised.
        num_proc: worker processes that tokenise.
        progress: show a progress bar (``None``: when stderr is a terminal).

    Returns:
        What the manifest records of the arrays and their sources (all but the key).

    Raises:
        ValueError: bad data, with the same message :func:`load_sft_data` gives.
    """
    started = time.perf_counter()
    writer = _Writer(tmp)
    converter = _Converter(tokenizer, chat_template_kwargs, chat_turns, num_proc)
    files: list[dict[str, Any]] = []
    origins: list[dict[str, Any]] = []
    try:
        if isinstance(sources, tuple):
            for k, path in enumerate(sources):
                stat = file_stat(path)
                start = writer.num_samples
                if check_file(path) == "jsonl":
                    digest = hashlib.sha256()
                    numbers: list[int] = []
                    with _progress(stat["size"], f"Tokenising {path.name}", "B", progress) as bar:
                        tasks = _jsonl_tasks(path, start, numbers, digest, bar.update)
                        for chunk in converter.map(tasks):
                            writer.add(chunk)
                    lines = f"lines-{k}.int64"
                    _write_array(tmp / lines, np.asarray(numbers, dtype=np.int64))
                    sha = digest.hexdigest()
                    origins.append(
                        {"start": start, "source": str(path), "lines": lines, "count": len(numbers)}
                    )
                else:
                    import pyarrow.parquet as pq

                    parquet = pq.ParquetFile(path)
                    rows = parquet.metadata.num_rows
                    with _progress(rows, f"Tokenising {path.name}", "rows", progress) as bar:
                        batches = parquet.iter_batches(batch_size=_ROWS_PER_BATCH)
                        for chunk in _table_chunks(
                            batches, str(path), start, converter, bar.update
                        ):
                            writer.add(chunk)
                    sha = file_digest(path)
                    origins.append(
                        {"start": start, "source": str(path), "lines": None, "count": rows}
                    )
                files.append({"path": str(path.resolve()), **stat, "sha256": sha})
        else:
            dataset = sources
            arrow = dataset.with_format("arrow")
            rows = len(dataset)
            batches = (arrow[at : at + _ROWS_PER_BATCH] for at in range(0, rows, _ROWS_PER_BATCH))
            with _progress(rows, "Tokenising datasets.Dataset", "rows", progress) as bar:
                for chunk in _table_chunks(batches, "datasets.Dataset", 0, converter, bar.update):
                    writer.add(chunk)
            origins.append({"start": 0, "source": "datasets.Dataset", "lines": None, "count": rows})
    finally:
        converter.close()
    writer.finish()
    if writer.num_samples == 0:
        raise empty_data_error([str(p) for p in sources] if isinstance(sources, tuple) else [])
    if writer.has_labels and writer.supervised == 0:
        raise nothing_supervised_error(writer.num_tokens)
    return {
        "files": files,
        "origins": origins,
        "num_samples": writer.num_samples,
        "num_tokens": writer.num_tokens,
        "has_labels": writer.has_labels,
        "max_input_id": writer.max_input_id,
        "max_label": writer.max_label if writer.has_labels else None,
        "supervised_tokens": writer.supervised,
        "sample_format": writer.formats.format or "tokens",
        "straddling": {"count": writer.straddling, "first": writer.first_straddling},
        "build_seconds": round(time.perf_counter() - started, 3),
        "checked": "every sample passed the checks of load_sft_data",
    }
