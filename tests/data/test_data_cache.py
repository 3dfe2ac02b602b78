"""The on-disk token cache: equal to direct loading, rebuilt when anything that changes the tokens
changes, whole under interruption and concurrent builders, and read identically by every rank.

The reference is :func:`load_sft_data` on the same input, the in-memory path (itself checked
against plain Python samples in test_data_dataset.py and test_data_chat.py). Comparisons are
exact: token ids are integers, and the one training check compares parameters with the plain HF
reference to the float32 tolerance of the parity tests (see helpers.PARAM_ATOL).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import (
    BUCKET,
    CONVERSATION,
    GLOBAL_BATCH,
    PARAM_ATOL,
    PLAIN_TEMPLATE,
    BatchRecorder,
    PlainLM,
    cpu_trainer,
    make_data,
    make_tokenizer,
    max_diff,
    reference_training,
    skrull_planner,
)

from lightning_skrull import SkrullDataModule
from lightning_skrull.data import SFTDataset, TruncationWarning, load_sft_data
from lightning_skrull.data.cache import (
    MANIFEST,
    CachedData,
    cached_sft_data,
    default_cache_dir,
    default_num_proc,
)
from lightning_skrull.data.loader import GlobalBatchStream, SkrullDataLoader
from lightning_skrull.data.sampler import GlobalBatchSampler
from lightning_skrull.runtime.launch import spawn

GENERATION_TEMPLATE = PLAIN_TEMPLATE.replace(
    "{{ m['content'] }}<|im_end|> ",
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|> "
    "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|> {% endif %}",
)
# More conversations than one tokenisation task holds (512), so that num_proc=2 starts workers.
CHATS = [{"messages": CONVERSATION[: 2 + k % 4]} for k in range(1100)]


def _samples(dataset: SFTDataset | Any) -> list[dict[str, list[int]]]:
    return [dataset[i] for i in range(len(dataset))]


def _digest(dataset: SFTDataset | Any) -> str:
    return hashlib.sha256(json.dumps(_samples(dataset)).encode()).hexdigest()


def _jsonl(path: Path, samples: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    return path


def _cache(data: object, root: Path, **kwargs: Any) -> CachedData:
    return cached_sft_data(data, cache_dir=root, progress=False, **kwargs)


def _entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock"))


# ------------------------------------------------------------------ equal to direct loading
def test_cache_equals_direct_loading_for_every_input_kind(tmp_path: Path) -> None:
    tokenizer = make_tokenizer(PLAIN_TEMPLATE)
    chat = _jsonl(tmp_path / "chat.jsonl", CHATS)
    pq.write_table(pa.Table.from_pylist(CHATS), tmp_path / "chat.parquet")
    data = make_data(300)
    ids = _jsonl(tmp_path / "ids.jsonl", data)
    pq.write_table(pa.Table.from_pylist(data), tmp_path / "ids.parquet")
    hf = datasets.Dataset.from_parquet(
        str(tmp_path / "ids.parquet"), cache_dir=str(tmp_path / "hf")
    )
    cases: list[tuple[object, Any]] = [
        (chat, tokenizer),
        (tmp_path / "chat.parquet", tokenizer),
        ([ids, tmp_path / "ids.parquet"], None),
        (hf, None),
    ]
    for data_in, tok in cases:
        cached = _cache(data_in, tmp_path / "cache", tokenizer=tok, num_proc=2)
        assert cached.built
        direct = load_sft_data(data_in, tokenizer=tok)
        assert cached.dataset.lengths == direct.lengths
        assert _samples(cached.dataset) == _samples(direct)
        assert isinstance(cached.dataset._input_ids, np.memmap)  # mapped, not read in
        again = _cache(data_in, tmp_path / "cache", tokenizer=tok, num_proc=2)
        assert not again.built and again.path == cached.path
        assert _samples(again.dataset) == _samples(direct)
    # num_proc 1 and 2 write the same bytes
    one = _cache(chat, tmp_path / "one", tokenizer=tokenizer, num_proc=1)
    two = _cache(chat, tmp_path / "cache", tokenizer=tokenizer, num_proc=2)
    for name in ("input_ids.int32", "labels.int32", "offsets.int64", "lines-0.int64"):
        assert (one.path / name).read_bytes() == (two.path / name).read_bytes()


def test_truncation_and_validation_work_on_the_mapped_tokens(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", make_data(40, longest=69))
    cached = _cache(path, tmp_path / "cache").dataset
    storage = cached._input_ids
    direct = load_sft_data(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cached.validate(max_tokens=30, vocab_size=64, truncate=True)
        direct.validate(max_tokens=30, vocab_size=64, truncate=True)
    messages = [str(w.message) for w in caught if issubclass(w.category, TruncationWarning)]
    assert len(messages) == 2 and messages[0] == messages[1]
    assert _samples(cached) == _samples(direct) and cached.num_tokens == direct.num_tokens
    assert cached._input_ids is storage  # truncation shortened lengths, copied no tokens
    # the same cache serves an untruncated run: truncation is not part of the key
    fresh = _cache(path, tmp_path / "cache")
    assert not fresh.built and max(fresh.dataset.lengths) > 30


# ------------------------------------------------------------------ invalidation
def test_what_changes_the_tokens_invalidates_the_cache(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    chats = [{"messages": CONVERSATION}, {"messages": CONVERSATION[:3]}]
    path = _jsonl(tmp_path / "chat.jsonl", chats)
    base = make_tokenizer(PLAIN_TEMPLATE)
    first = _cache(path, root, tokenizer=base)
    assert first.built
    assert not _cache(path, root, tokenizer=make_tokenizer(PLAIN_TEMPLATE)).built  # equal one

    changed = {
        "template": dict(tokenizer=make_tokenizer(GENERATION_TEMPLATE)),
        "chat_template_kwargs": dict(tokenizer=base, chat_template_kwargs={"x": 1}),
        "chat_turns": dict(tokenizer=base, chat_turns="last"),
    }
    vocab_changed = make_tokenizer(PLAIN_TEMPLATE)
    vocab_changed.add_tokens(["thanks!"])
    changed["tokenizer"] = dict(tokenizer=vocab_changed)
    for what, kwargs in changed.items():
        cached = _cache(path, root, **kwargs)
        assert cached.built and cached.path != first.path, what

    # the file: touched without change (hash compared, reused), then changed (rebuilt in place)
    os.utime(path, ns=(1, 1))
    assert not _cache(path, root, tokenizer=base).built
    _jsonl(path, chats[::-1])
    rebuilt = _cache(path, root, tokenizer=base)
    assert rebuilt.built and rebuilt.path == first.path
    assert _samples(rebuilt.dataset) == _samples(load_sft_data(path, tokenizer=base))
    # one cache per key, nothing half-written left behind
    assert not [n for n in _entries(root) if ".tmp-" in n or ".stale-" in n]


def test_an_interrupted_or_damaged_build_is_rebuilt(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    path = _jsonl(tmp_path / "d.jsonl", make_data(50))
    expected = _samples(load_sft_data(path))
    cached = _cache(path, root)
    # a process killed while building left its temporary directory: removed, never read
    leftover = root / f"{cached.path.name}.tmp-99999-deadbeef"
    leftover.mkdir()
    (leftover / "input_ids.int32").write_bytes(b"\0" * 12)
    # an array cut short (a copy that stopped, a full disk)
    ids = cached.path / "input_ids.int32"
    ids.write_bytes(ids.read_bytes()[:-4])
    again = _cache(path, root)
    assert again.built and _samples(again.dataset) == expected
    assert not leftover.exists()
    # no manifest: the build never finished
    (again.path / MANIFEST).unlink()
    third = _cache(path, root)
    assert third.built and _samples(third.dataset) == expected
    # a build that fails on bad data leaves no temporary directory, and the old cache (of the
    # file before its change) is still refused
    _jsonl(path, [*make_data(5), {"input_ids": [1, -2]}])
    for _ in range(2):
        with pytest.raises(ValueError, match=r"sample 5 \(.*d.jsonl line 6\): input_ids\[1\]"):
            _cache(path, root)
    assert _entries(root) == [third.path.name]


def test_a_cache_of_an_older_format_version_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a version bump marks a change of the tokenisation (3: chat turns end at their end-of-turn
    # token): a cache written by the version before must not be read
    import lightning_skrull.data.cache as cache

    path = _jsonl(tmp_path / "chat.jsonl", CHATS[:4])
    tokenizer = make_tokenizer(PLAIN_TEMPLATE)
    with monkeypatch.context() as patch:
        patch.setattr(cache, "CACHE_FORMAT_VERSION", cache.CACHE_FORMAT_VERSION - 1)
        older = _cache(path, tmp_path / "cache", tokenizer=tokenizer)
    assert older.built
    current = _cache(path, tmp_path / "cache", tokenizer=tokenizer)
    assert current.built and current.path != older.path
    assert _samples(current.dataset) == _samples(load_sft_data(path, tokenizer=tokenizer))
    assert not _cache(path, tmp_path / "cache", tokenizer=tokenizer).built


# ------------------------------------------------------------------ same errors as before
def _bad_inputs(tmp_path: Path) -> dict[str, tuple[Path, Any]]:
    tokenizer = make_tokenizer(PLAIN_TEMPLATE)
    good = make_data(4)
    late_chat_error = [*CHATS[:700], {"messages": CONVERSATION[2:]}]  # in the second task
    null_row = pa.table({"input_ids": [[1, 2], None]})
    pq.write_table(null_row, tmp_path / "null.parquet")
    pq.write_table(pa.table({"input_ids": [[1.0]]}), tmp_path / "float.parquet")
    (tmp_path / "broken.jsonl").write_text('{"input_ids": [1]}\n\n{"input_ids": [2,\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    return {
        "invalid JSON": (tmp_path / "broken.jsonl", None),
        "negative id after blank lines": (
            _jsonl(tmp_path / "neg.jsonl", [*good, {"input_ids": [3, -1]}]),
            None,
        ),
        "label count": (_jsonl(tmp_path / "lab.jsonl", [{"input_ids": [1], "labels": []}]), None),
        "nothing supervised": (
            _jsonl(tmp_path / "sup.jsonl", [{"input_ids": [1, 2], "labels": [-100, -100]}]),
            None,
        ),
        "empty": (tmp_path / "empty.jsonl", None),
        "null row": (tmp_path / "null.parquet", None),
        "float ids": (tmp_path / "float.parquet", None),
        "chat starts with assistant": (_jsonl(tmp_path / "c.jsonl", late_chat_error), tokenizer),
        "chat without tokenizer": (_jsonl(tmp_path / "c2.jsonl", CHATS[:2]), None),
        "missing file": (tmp_path / "missing.jsonl", None),
    }


def test_bad_samples_get_the_same_errors_as_direct_loading(tmp_path: Path) -> None:
    for case, (path, tokenizer) in _bad_inputs(tmp_path).items():
        with pytest.raises((ValueError, FileNotFoundError)) as direct:
            load_sft_data(path, tokenizer=tokenizer)
        with pytest.raises(type(direct.value)) as cached:
            _cache(path, tmp_path / "cache", tokenizer=tokenizer, num_proc=2)
        assert str(cached.value) == str(direct.value), case
    # the checks of a run (vocabulary, length) still name the file and line
    samples = make_data(30)
    samples[20]["input_ids"][1] = 63
    path = _jsonl(tmp_path / "run.jsonl", samples)
    path.write_text("\n" + path.read_text())  # every sample one line lower
    for kwargs in ({"vocab_size": 63}, {"max_tokens": 10}):
        with pytest.raises(ValueError) as direct:
            load_sft_data(path).validate(**kwargs)
        with pytest.raises(ValueError) as cached:
            _cache(path, tmp_path / "cache").dataset.validate(**kwargs)
        assert str(cached.value) == str(direct.value)
        assert re.search(rf"sample \d+ \({re.escape(str(path))} line \d+\)", str(cached.value))


# ------------------------------------------------------------------ where the cache lives
def test_default_cache_dir_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("LIGHTNING_SKRULL_CACHE")
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "lightning_skrull" / "data"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert default_cache_dir() == tmp_path / "hf" / "lightning_skrull" / "data"
    monkeypatch.setenv("LIGHTNING_SKRULL_CACHE", str(tmp_path / "own"))
    assert default_cache_dir() == tmp_path / "own"
    assert 1 <= default_num_proc() <= 8


def test_data_module_caches_files_only(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    for data in (make_data(10), "bundled:mixed_tiny"):  # in memory: loaded as before
        dm = SkrullDataModule(train_data=data, global_batch_size=2, cache_dir=root)
        dm.prepare_data()
        dm.setup("fit")
        assert dm.train_dataset is not None and not root.exists()
    path = _jsonl(tmp_path / "d.jsonl", make_data(10))
    dm = SkrullDataModule(train_data=path, val_data=path, global_batch_size=2, cache_dir=root)
    dm.prepare_data()
    assert len(_entries(root)) == 1  # train and validation share one cache
    dm.setup("fit")
    assert _samples(dm.train_dataset) == _samples(load_sft_data(path))
    with pytest.raises(ValueError, match="num_proc must be >= 1"):
        SkrullDataModule(train_data=path, num_proc=0)


# ------------------------------------------------------------------ resume
def _loader(dataset: SFTDataset) -> SkrullDataLoader:

    sampler = GlobalBatchSampler(len(dataset), 8, shuffle=True, seed=3)
    planner = skrull_planner(dp_rank=1, bucket_size=50)
    return SkrullDataLoader(GlobalBatchStream(dataset, sampler, planner))


def _batch_tokens(batch: Any) -> list[list[list[int]]]:
    return [mb.inputs["input_ids"].tolist() for mb in batch.rank_batch.micro_batches]


def test_resume_mid_epoch_from_the_cache_gives_the_same_batches(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", make_data(40))
    whole = [_batch_tokens(b) for b in _loader(load_sft_data(path))]  # in memory, no resume
    first = _loader(_cache(path, tmp_path / "cache").dataset)
    it = iter(first)
    trained = [_batch_tokens(next(it)) for _ in range(2)]
    state = first.state_dict()
    resumed = _loader(_cache(path, tmp_path / "cache").dataset)  # a new process would reopen
    resumed.load_state_dict(state)
    assert trained + [_batch_tokens(b) for b in resumed] == whole
    assert len(whole) == 5


# ------------------------------------------------------------------ several processes
def _ranks_train_from_one_cache(rank: int, world_size: int, path: str, root: str) -> Any:
    from lightning_skrull import SkrullStrategy

    # both ranks build at once, as the local rank 0 of two nodes sharing the directory would
    built = cached_sft_data(path, cache_dir=root, progress=False).built
    data = SkrullDataModule(
        train_data=path, global_batch_size=GLOBAL_BATCH, shuffle=False, cache_dir=root
    )
    recorder = BatchRecorder()
    trainer = cpu_trainer(
        SkrullStrategy(cp_size=1, bucket_size=2 * BUCKET), max_steps=3, callbacks=[recorder]
    )
    model = PlainLM()
    trainer.fit(model, data)  # prepare_data on rank 0 and setup on both: the cache is reused
    params = {k: v.detach().numpy().copy() for k, v in model.model.state_dict().items()}
    return built, _digest(data.train_dataset), recorder.steps, params


def test_concurrent_builders_make_one_cache_that_every_rank_reads_alike(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", make_data())
    root = tmp_path / "cache"
    results = spawn(_ranks_train_from_one_cache, 2, str(path), str(root), timeout=240)
    built, digests, steps, params = zip(*results, strict=True)
    assert sorted(built) == [False, True]  # one built; the other waited on the lock, then reused
    assert len(_entries(root)) == 1  # one cache, no temporary directory left
    expected = _digest(load_sft_data(path))
    assert list(digests) == [expected, expected]
    assert [len(s) for s in steps] == [3, 3]
    # the DP ranks ran different numbers of micro-batches in some step
    assert any(a["run"] != b["run"] for a, b in zip(steps[0], steps[1], strict=True))
    reference, _ = reference_training(3)
    for rank_params in params:
        assert max_diff(rank_params, reference) < PARAM_ATOL  # see helpers.PARAM_ATOL
