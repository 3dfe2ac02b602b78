"""Tokenise once, cache on disk, memory-map: SFT data at the size of long-context corpora.

:func:`cached_sft_data` turns data files (JSON Lines, Parquet) or a file-backed
``datasets.Dataset`` into a directory of flat arrays, then returns an :class:`SFTDataset` over
memory maps of them. Every process that opens the same cache maps the same files: the operating
system keeps one copy of the tokens per machine, and each process holds only the lengths.

Layout of one cache (a directory named ``<first file's stem>-<key>``)::

    input_ids.int32   every sample's token ids, concatenated
    labels.int32      the labels, same shape (absent when no sample has labels)
    offsets.int64     num_samples + 1 positions into the flat arrays
    lines-<k>.int64   the line of each sample of JSON Lines source k (for error messages)
    manifest.json     written last: the key, the sources' size, mtime and SHA-256, the counts,
                      the largest id and label, and where each sample came from

The key (a hash) covers everything that changes the tokens: the data sources (file paths, or a
``datasets.Dataset`` fingerprint), the tokenizer (its full ``tokenizer.json``, chat template and
``eos_token``), ``chat_template_kwargs`` and :data:`CACHE_FORMAT_VERSION`. The files' contents
are checked on open without reading them: size and modification time must equal those stored; when only the
time differs, the file is hashed once and compared with the SHA-256 stored at build. Truncation
is not part of the key: the cache holds whole samples, and truncation shortens lengths when the
dataset is validated (see :meth:`SFTDataset.validate`).

A build writes into ``<name>.tmp-<pid>-<random>`` under an exclusive lock (``<name>.lock``),
then renames it into place: a cache directory is complete or absent, an interrupted build leaves
only a temporary directory (removed by the next builder), and a second builder waits for the
first and reuses its result. A stale cache (a changed file, a truncated array) is rebuilt.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import multiprocessing
import os
import pickle
import shutil
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np

from lightning_skrull.data.chat import ChatTurns, check_chat_turns
from lightning_skrull.data.dataset import (
    IGNORE_INDEX,
    Origin,
    SFTDataset,
    ValueRange,
    empty_data_error,
    nothing_supervised_error,
)
from lightning_skrull.data.formats import RAW_COLUMNS, OneFormat
from lightning_skrull.data.sources import (
    Chunk,
    SampleBuilder,
    add_jsonl_line,
    as_paths,
    check_file,
    is_hf_dataset,
    table_rows,
    warn_straddling,
)

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: the atomic rename alone keeps caches whole
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 3
"""Bumped whenever the cache layout or the tokenisation changes: older caches are rebuilt
(3: chat turns and conversational completions end at their end-of-turn token, and Arrow
rows lose the null entries of their nested dicts)."""

MANIFEST = "manifest.json"
_LINES_PER_CHUNK = 512
_ROWS_PER_BATCH = 8192


CACHE_ENV = "LIGHTNING_SKRULL_CACHE"
"""An environment variable that, when set, names the directory of caches."""


def default_cache_dir() -> Path:
    """``$LIGHTNING_SKRULL_CACHE`` when set, else ``$HF_HOME/lightning_skrull/data`` when
    ``HF_HOME`` is set, else ``$XDG_CACHE_HOME/lightning_skrull/data`` (``~/.cache`` when that
    is unset)."""
    own = os.environ.get(CACHE_ENV)
    if own:
        return Path(own).expanduser()
    hf_home = os.environ.get("HF_HOME")
    if hf_home:
        return Path(hf_home).expanduser() / "lightning_skrull" / "data"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "lightning_skrull" / "data"


def default_num_proc() -> int:
    """Tokenisation workers: the CPUs this process may use, at most 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


def is_cacheable(data: object) -> bool:
    """Whether :func:`cached_sft_data` takes ``data``: file path(s), or a ``datasets.Dataset``
    backed by files (an in-memory one has no stable fingerprint and is loaded directly)."""
    if as_paths(data) is not None:
        return True
    return is_hf_dataset(data) and bool(getattr(data, "cache_files", None))


# --------------------------------------------------------------------------- the key
def _stable(value: object) -> object:
    """A JSON-able stand-in for a value of ``chat_template_kwargs`` that json cannot write."""
    if callable(value):  # tools given as Python functions: their name and docstring
        name = f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
        return f"<callable {name} {getattr(value, '__doc__', '')}>"
    return repr(value)


def tokenizer_fingerprint(tokenizer: Any) -> str | None:
    """SHA-256 of what makes a tokenizer's tokens: its class, its full definition (a fast
    tokenizer's ``tokenizer.json``, else its vocabulary), its chat template and its
    ``eos_token`` (appended to text and prompt-completion samples)."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = backend.to_str()
    else:
        definition = json.dumps(tokenizer.get_vocab(), sort_keys=True)
    digest = hashlib.sha256()
    parts = (
        type(tokenizer).__qualname__,
        definition,
        str(tokenizer.chat_template),
        str(getattr(tokenizer, "eos_token", None)),
    )
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


@dataclass(frozen=True)
class CacheSpec:
    """Everything that makes a cache: its sources, how they are tokenised, and where it lives.

    Attributes:
        sources: file paths (as given: errors name them so), or one ``datasets.Dataset``.
        tokenizer: the tokenizer for chat samples (or ``None``).
        chat_template_kwargs: extra arguments of ``apply_chat_template``.
        root: the cache directory that holds this cache.
        chat_turns: which assistant turns of chat samples are supervised.
    """

    sources: tuple[Path, ...] | Any
    tokenizer: Any
    chat_template_kwargs: Mapping[str, Any] | None
    root: Path
    chat_turns: ChatTurns = "all"

    def key_parts(self) -> dict[str, Any]:
        """What the key hashes (stored in the manifest, readable)."""
        if isinstance(self.sources, tuple):
            sources = [str(p.resolve()) for p in self.sources]
        else:
            sources = [f"datasets.Dataset {self.sources._fingerprint} ({len(self.sources)} rows)"]
        return {
            "format": CACHE_FORMAT_VERSION,
            "sources": sources,
            "tokenizer": tokenizer_fingerprint(self.tokenizer),
            "chat_template_kwargs": json.dumps(
                self.chat_template_kwargs or {}, sort_keys=True, default=_stable
            ),
            "chat_turns": self.chat_turns,
        }

    @functools.cached_property
    def key(self) -> str:
        """A 20-hex-digit hash of :meth:`key_parts`."""
        text = json.dumps(self.key_parts(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    @property
    def path(self) -> Path:
        """The cache's directory."""
        if isinstance(self.sources, tuple):
            stem = self.sources[0].stem
        else:
            stem = "dataset"
        return self.root / f"{stem}-{self.key}"


def make_spec(
    data: object,
    *,
    tokenizer: Any = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    chat_turns: ChatTurns = "all",
    cache_dir: str | os.PathLike[str] | None = None,
) -> CacheSpec:
    """The :class:`CacheSpec` of ``data`` (see :func:`is_cacheable`)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    paths = as_paths(data)
    if paths is not None:
        for path in paths:
            check_file(path)
        sources: Any = tuple(paths)
    elif is_cacheable(data):
        sources = data
    else:
        raise TypeError(
            f"{type(data).__name__} cannot be cached; give file path(s) or a file-backed "
            "datasets.Dataset (in-memory data is loaded with load_sft_data)."
        )
    return CacheSpec(sources, tokenizer, chat_template_kwargs, root, check_chat_turns(chat_turns))


# --------------------------------------------------------------------------- opening
@dataclass(frozen=True)
class CachedData:
    """An opened cache: the dataset over its memory maps, and what was done to get it."""

    dataset: SFTDataset
    path: Path
    built: bool
    seconds: float

    @property
    def num_bytes(self) -> int:
        """Bytes of the cache on disk."""
        return sum(f.stat().st_size for f in self.path.iterdir())

    def describe(self) -> str:
        """One log line: where the cache is, its size, and whether it was built or reused."""
        verb = "built" if self.built else "reused"
        data = self.dataset
        return (
            f"SFT data cache {verb} in {self.seconds:.1f} s: {self.path} ({len(data):,} samples, "
            f"{data.num_tokens:,} tokens, {self.num_bytes / 2**20:,.1f} MiB)"
        )


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _file_stat(path: Path) -> dict[str, int]:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _stale_reason(directory: Path, spec: CacheSpec) -> tuple[str | None, dict[str, Any] | None]:
    """``(why the cache cannot be used, None)`` or ``(None, its manifest)``."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return "absent", None
    except (OSError, ValueError) as err:
        return f"unreadable manifest ({err})", None
    if manifest.get("format") != CACHE_FORMAT_VERSION or manifest.get("key") != spec.key:
        return "written by another version or for other data", None
    n, tokens = manifest["num_samples"], manifest["num_tokens"]
    expected = {"input_ids.int32": 4 * tokens, "offsets.int64": 8 * (n + 1)}
    if manifest["has_labels"]:
        expected["labels.int32"] = 4 * tokens
    for origin in manifest["origins"]:
        if origin["lines"] is not None:
            expected[origin["lines"]] = 8 * origin["count"]
    for name, size in expected.items():
        file = directory / name
        if not file.is_file() or file.stat().st_size != size:
            return f"{name} is missing or not {size} bytes (an interrupted build)", None
    refreshed = False
    for entry in manifest["files"]:
        path = Path(entry["path"])
        try:
            now = _file_stat(path)
        except FileNotFoundError:
            return f"{path} no longer exists", None
        if now == {"size": entry["size"], "mtime_ns": entry["mtime_ns"]}:
            continue
        if now["size"] != entry["size"] or _file_digest(path) != entry["sha256"]:
            return f"{path} changed since the cache was built", None
        entry.update(now)  # touched, same content: remember the new time
        refreshed = True
    if refreshed:
        with contextlib.suppress(OSError):  # a read-only cache stays usable
            _write_json_atomic(directory / MANIFEST, manifest)
    return None, manifest


def _write_json_atomic(path: Path, value: Mapping[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def open_cache(directory: Path, manifest: Mapping[str, Any]) -> SFTDataset:
    """The dataset of a complete cache, over read-only memory maps of its files."""
    n, tokens = int(manifest["num_samples"]), int(manifest["num_tokens"])
    ids = np.memmap(directory / "input_ids.int32", dtype=np.int32, mode="r", shape=(tokens,))
    labels = None
    if manifest["has_labels"]:
        labels = np.memmap(directory / "labels.int32", dtype=np.int32, mode="r", shape=(tokens,))
    offsets = np.memmap(directory / "offsets.int64", dtype=np.int64, mode="r", shape=(n + 1,))
    origins = []
    for origin in manifest["origins"]:
        lines = None
        if origin["lines"] is not None:
            lines = cast(
                Sequence[int],
                np.memmap(
                    directory / origin["lines"], dtype=np.int64, mode="r", shape=(origin["count"],)
                ),
            )
        origins.append(Origin(origin["start"], origin["source"], lines))
    value_range = ValueRange(manifest["max_input_id"], manifest["max_label"])
    return SFTDataset.from_checked(ids, offsets, labels, value_range=value_range, origins=origins)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``lock_path`` (waits for another holder)."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cached_sft_data(
    data: object,
    *,
    tokenizer: Any = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    chat_turns: ChatTurns = "all",
    cache_dir: str | os.PathLike[str] | None = None,
    num_proc: int | None = None,
    progress: bool | None = None,
) -> CachedData:
    """Opens the cache of ``data``, building it first when it is absent or stale.

    Args:
        data: file path(s) (JSON Lines, Parquet) or a file-backed ``datasets.Dataset``.
        tokenizer: a fast Hugging Face tokenizer with a chat template, for chat samples.
        chat_template_kwargs: extra arguments of ``apply_chat_template``.
        chat_turns: which assistant turns of chat samples are supervised (``"all"`` or
            ``"last"``).
        cache_dir: the directory of caches (default :func:`default_cache_dir`).
        num_proc: worker processes that tokenise (default :func:`default_num_proc`).
        progress: show a progress bar while building (default: when stderr is a terminal).

    Returns:
        The opened cache (its dataset is checked as :func:`load_sft_data` checks it).

    Raises:
        ValueError: bad data, with the same message :func:`load_sft_data` gives.
    """
    start = time.perf_counter()
    spec = make_spec(
        data,
        tokenizer=tokenizer,
        chat_template_kwargs=chat_template_kwargs,
        chat_turns=chat_turns,
        cache_dir=cache_dir,
    )
    final = spec.path
    reason, manifest = _stale_reason(final, spec)
    built = False
    if manifest is None:
        spec.root.mkdir(parents=True, exist_ok=True)
        with _exclusive(spec.root / f"{final.name}.lock"):
            reason, manifest = _stale_reason(final, spec)  # another builder may have finished
            if manifest is None:
                log.info("Building the SFT data cache %s (%s)", final, reason)
                for leftover in spec.root.glob(f"{final.name}.tmp-*"):
                    shutil.rmtree(leftover, ignore_errors=True)  # builds that were interrupted
                tmp = spec.root / f"{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                try:
                    tmp.mkdir()
                    manifest = _build_apart(tmp, spec, num_proc or default_num_proc(), progress)
                    _install(tmp, final)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                built = True
    dataset = open_cache(final, manifest)
    straddling = manifest.get("straddling") or {"count": 0}
    if straddling["count"]:
        warn_straddling(straddling["count"], straddling["first"])
    cached = CachedData(dataset, final, built, time.perf_counter() - start)
    log.info(cached.describe())
    return cached


def _build_apart(
    tmp: Path, spec: CacheSpec, num_proc: int, progress: bool | None
) -> dict[str, Any]:
    """:func:`_build` in a forked child process, so that the memory the build allocates (parse
    buffers, Arrow batches, allocator caches) is returned when it exits rather than kept by
    the training process; in this process where ``fork`` does not exist."""
    if "fork" not in multiprocessing.get_all_start_methods():  # pragma: no cover - not POSIX
        return _build(tmp, spec, num_proc, progress)
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_build_in_child, args=(send, tmp, spec, num_proc, progress))
    child.start()
    send.close()
    try:
        ok, result = receive.recv()
    except EOFError:
        child.join()
        raise RuntimeError(
            f"The process that built the SFT data cache in {tmp} died (exit code "
            f"{child.exitcode}) before it finished; out of memory? Run again to rebuild it."
        ) from None
    finally:
        receive.close()
        if child.is_alive():
            child.join(timeout=60)
            if child.is_alive():
                child.terminate()
    if ok:
        return cast(dict[str, Any], result)
    raise cast(BaseException, result)


def _build_in_child(
    send: Any, tmp: Path, spec: CacheSpec, num_proc: int, progress: bool | None
) -> None:
    try:
        result: tuple[bool, Any] = (True, _build(tmp, spec, num_proc, progress))
    except BaseException as err:  # sent to the parent, which raises it
        try:
            pickle.dumps(err)
            result = (False, err)
        except Exception:  # an exception that does not pickle: its type and message
            result = (False, RuntimeError(f"{type(err).__name__}: {err}"))
    send.send(result)
    send.close()


def _install(tmp: Path, final: Path) -> None:
    """Renames the complete ``tmp`` to ``final``, moving a stale ``final`` out of the way."""
    if final.exists():
        stale = final.with_name(f"{final.name}.stale-{uuid.uuid4().hex[:8]}")
        os.rename(final, stale)
        shutil.rmtree(stale, ignore_errors=True)  # processes that still map it keep their pages
    os.rename(tmp, final)


# --------------------------------------------------------------------------- building
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

    def __init__(self, spec: CacheSpec, num_proc: int) -> None:
        self.spec = spec
        self.num_proc = num_proc
        self.pool: Any = None
        self.seen = 0
        self._args = (spec.tokenizer, spec.chat_template_kwargs, spec.chat_turns)

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


def _build(tmp: Path, spec: CacheSpec, num_proc: int, progress: bool | None) -> dict[str, Any]:
    """Writes the cache of ``spec`` into ``tmp``; returns its manifest."""
    started = time.perf_counter()
    writer = _Writer(tmp)
    converter = _Converter(spec, num_proc)
    files: list[dict[str, Any]] = []
    origins: list[dict[str, Any]] = []
    try:
        if isinstance(spec.sources, tuple):
            for k, path in enumerate(spec.sources):
                stat = _file_stat(path)
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
                    sha = _file_digest(path)
                    origins.append(
                        {"start": start, "source": str(path), "lines": None, "count": rows}
                    )
                files.append({"path": str(path.resolve()), **stat, "sha256": sha})
        else:
            dataset = spec.sources
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
        raise empty_data_error(
            [str(p) for p in spec.sources] if isinstance(spec.sources, tuple) else []
        )
    if writer.has_labels and writer.supervised == 0:
        raise nothing_supervised_error(writer.num_tokens)
    manifest = {
        "format": CACHE_FORMAT_VERSION,
        "key": spec.key,
        "key_parts": spec.key_parts(),
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
    _write_json_atomic(tmp / MANIFEST, manifest)
    return manifest
