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
first and reuses its result. A stale cache (a changed file, a truncated array) is rebuilt. The
arrays are written by :func:`~lightning_skrull.data.cache_build.write_arrays`; this module
holds the key, the manifest, opening, and the build's lock and installation.
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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from lightning_skrull.data.cache_build import file_digest, file_stat, write_arrays
from lightning_skrull.data.chat import ChatTurns, check_chat_turns
from lightning_skrull.data.dataset import Origin, SFTDataset, ValueRange
from lightning_skrull.data.sample_builder import warn_straddling
from lightning_skrull.data.sources import as_paths, check_file, is_hf_dataset

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
            now = file_stat(path)
        except FileNotFoundError:
            return f"{path} no longer exists", None
        if now == {"size": entry["size"], "mtime_ns": entry["mtime_ns"]}:
            continue
        if now["size"] != entry["size"] or file_digest(path) != entry["sha256"]:
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


def _build(tmp: Path, spec: CacheSpec, num_proc: int, progress: bool | None) -> dict[str, Any]:
    """Writes the cache of ``spec`` into ``tmp``; returns its manifest."""
    written = write_arrays(
        tmp,
        spec.sources,
        tokenizer=spec.tokenizer,
        chat_template_kwargs=spec.chat_template_kwargs,
        chat_turns=spec.chat_turns,
        num_proc=num_proc,
        progress=progress,
    )
    manifest = {
        "format": CACHE_FORMAT_VERSION,
        "key": spec.key,
        "key_parts": spec.key_parts(),
        **written,
    }
    _write_json_atomic(tmp / MANIFEST, manifest)
    return manifest
