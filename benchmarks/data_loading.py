"""Time loading and validating SFT data, and the start-up of a 4-process run on large data.

    python -m benchmarks.data_loading [--max-tokens 20000000]      # both parts
    python -m benchmarks.data_loading --part load                  # the first only
    python -m benchmarks.data_loading --part startup [--conversations 20000 --tokens 40000000]

Part ``load``: samples with long-tailed lengths (most short, a few long) over a 32K vocabulary.
For each size the table shows the seconds to build an :class:`SFTDataset` from in-memory lists,
from a JSON Lines file, from a Parquet file, and for ``validate(vocab_size=..., max_tokens=...)``;
the last column is validation throughput. Validation is vectorised and linear in tokens.

Part ``startup``: a generated chat set and a generated
pre-tokenised Parquet set through ``SkrullDataModule`` on 4 processes (DP 2 x CP 2), cold (empty
cache) and warm, against the same run on tiny in-memory data: time to the first training step,
and each rank's unique memory (USS) growth against the token bytes. It also prints tokenisation
throughput with ``num_proc`` 1 and 2, and the start-up a 2.5B-token corpus would take.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lightning_skrull.data import load_sft_data

VOCAB = 32_000


def make_samples(num_tokens: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """Samples with log-normal lengths (median ~300, tail to 32K) totalling ~num_tokens."""
    rng = np.random.default_rng(seed)
    samples, total = [], 0
    while total < num_tokens:
        length = int(min(32_000, max(16, rng.lognormal(5.7, 1.2))))
        ids = rng.integers(0, VOCAB, size=length)
        labels = ids.copy()
        labels[: length // 2] = -100
        samples.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
        total += length
    return samples


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """Seconds one call takes, and its result."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=4_000_000)
    parser.add_argument("--part", choices=("load", "startup", "all"), default="all")
    parser.add_argument("--conversations", type=int, default=20_000)
    parser.add_argument("--tokens", type=int, default=40_000_000)
    args = parser.parse_args()
    if args.part in ("load", "all"):
        load_table(args.max_tokens)
    if args.part in ("startup", "all"):
        startup_tables(args.conversations, args.tokens)


def load_table(max_tokens: int) -> None:
    """Part ``load``: one process, growing sizes."""
    sizes = [n for n in (250_000, 1_000_000, 4_000_000, 20_000_000) if n <= max_tokens]
    print(
        f"{'tokens':>11} {'samples':>8} {'lists s':>8} {'jsonl s':>8} {'parquet s':>9} "
        f"{'validate s':>10} {'Mtok/s':>7}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            samples = make_samples(size)
            jsonl, parquet = Path(tmp, "d.jsonl"), Path(tmp, "d.parquet")
            jsonl.write_text("".join(json.dumps(s) + "\n" for s in samples))
            pq.write_table(pa.Table.from_pylist(samples), parquet)
            t_lists, dataset = timed(load_sft_data, samples)
            t_jsonl, _ = timed(load_sft_data, jsonl)
            t_parquet, _ = timed(load_sft_data, parquet)
            t_validate, _ = timed(dataset.validate, vocab_size=VOCAB, max_tokens=32_000)
            tokens = dataset.num_tokens
            print(
                f"{tokens:>11,} {len(dataset):>8,} {t_lists:>8.2f} {t_jsonl:>8.2f} "
                f"{t_parquet:>9.2f} {t_validate:>10.3f} {tokens / t_validate / 1e6:>7.0f}"
            )


# --------------------------------------------------------------------------- part startup
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CP_SIZE = 2
BUCKET = 16_384  # cp_size * bucket_size holds the longest generated sample (32,000 tokens)
GLOBAL_BATCH = 16
TARGET_COLD, TARGET_WARM, TARGET_USS = 1.5, 0.2, 0.25


def _words(rng: np.random.Generator, count: int) -> list[str]:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    return ["".join(rng.choice(letters, size=int(n))) for n in rng.integers(2, 10, size=count)]


def make_chats(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` conversations (system, then one to three user/assistant exchanges) of random
    words with Zipf-like frequencies; about 190 tokens each under :func:`make_tokenizer`."""
    rng = np.random.default_rng(seed)
    vocab = _words(rng, 6_000)
    weights = 1.0 / np.arange(1, len(vocab) + 1)
    weights /= weights.sum()

    def text(mean: float) -> str:
        n = max(1, int(rng.exponential(mean)))
        return " ".join(vocab[i] for i in rng.choice(len(vocab), size=n, p=weights))

    chats = []
    for _ in range(count):
        messages = [{"role": "system", "content": text(8)}]
        for _ in range(int(rng.integers(1, 4))):
            messages.append({"role": "user", "content": text(25)})
            messages.append({"role": "assistant", "content": text(45)})
        chats.append({"messages": messages})
    return chats


def make_tokenizer(chats: list[dict[str, Any]]) -> Any:
    """A byte-level BPE tokenizer (8K vocabulary) trained on the chats, with a chat template
    of the Qwen shape: a fast tokenizer as a real model ships, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8_000, special_tokens=["<|im_start|>", "<|im_end|>"], show_progress=False
    )
    backend.train_from_iterator(
        (m["content"] for c in chats[:2_000] for m in c["messages"]), trainer
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_pretokenised(path: Path, num_tokens: int, seed: int = 0) -> int:
    """A Parquet file of ``input_ids`` and ``labels`` (the first half of each sample masked),
    log-normal lengths (median ~300, tail to 32K), ~``num_tokens`` tokens; returns the count."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(5.7, 1.2, size=num_tokens // 150), 16, 32_000).astype(np.int64)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), num_tokens)) + 1]
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    total = int(offsets[-1])
    ids = rng.integers(0, VOCAB, size=total, dtype=np.int32)
    position = np.arange(total) - np.repeat(offsets[:-1], lengths)
    labels = np.where(position < np.repeat(lengths // 2, lengths), -100, ids).astype(np.int32)
    arrow_offsets = pa.array(offsets.astype(np.int32))
    table = pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(arrow_offsets, pa.array(ids)),
            "labels": pa.ListArray.from_arrays(arrow_offsets, pa.array(labels)),
        }
    )
    pq.write_table(table, path)
    return total


def _uss() -> int:
    """This process's unique memory (bytes): psutil's USS, else /proc smaps_rollup."""
    try:
        import psutil

        return int(psutil.Process().memory_full_info().uss)
    except ImportError:
        fields = Path("/proc/self/smaps_rollup").read_text().split("\n")
        kib = [
            int(f.split()[1]) for f in fields if f.startswith(("Private_Clean", "Private_Dirty"))
        ]
        return 1024 * sum(kib)


class _StartupLM(L.LightningModule):
    """A one-layer Qwen2 model whose vocabulary holds ``vocab`` ids; its training step is the
    plain HF loss."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32_768,
        )
        self.model = Qwen2ForCausalLM(config)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.model(**batch).loss

    def configure_optimizers(self) -> Any:
        import torch

        return torch.optim.SGD(self.parameters(), lr=0.1)


class _FirstStep(L.Callback):
    def __init__(self) -> None:
        self.at: tuple[float, int] | None = None

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
        if self.at is None:
            self.at = (time.perf_counter(), _uss())


def _rank_startup(
    rank: int, world_size: int, data: Any, tokenizer: Any, cache_dir: str, vocab: int
) -> tuple[float, int]:
    """Seconds from the ranks' start (after imports, aligned) to the first training step, and
    this rank's USS growth over that time."""
    import logging
    import warnings

    import torch.distributed as dist

    from benchmarks.e2e_cpu import cpu_trainer
    from lightning_skrull import SkrullDataModule, SkrullStrategy

    warnings.filterwarnings("ignore")  # the table, not Lightning's advice, on the console
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_skrull"):
        logging.getLogger(name).setLevel(logging.ERROR)
    module = _StartupLM(vocab)
    first = _FirstStep()
    # over the spawned process group's world_size ranks
    trainer = cpu_trainer(SkrullStrategy(cp_size=CP_SIZE, bucket_size=BUCKET), 1, first)
    dist.barrier()
    start, uss = time.perf_counter(), _uss()
    datamodule = SkrullDataModule(
        train_data=data, global_batch_size=GLOBAL_BATCH, tokenizer=tokenizer, cache_dir=cache_dir
    )
    trainer.fit(module, datamodule)
    assert first.at is not None
    return first.at[0] - start, first.at[1] - uss


def _startup(data: Any, tokenizer: Any, cache_dir: Path, vocab: int) -> tuple[float, float]:
    """``(seconds to the first step, largest USS growth of a rank)`` of a 4-process run."""
    from lightning_skrull.runtime.launch import spawn

    results = spawn(_rank_startup, 4, data, tokenizer, str(cache_dir), vocab, timeout=900)
    return max(r[0] for r in results), max(r[1] for r in results)


def startup_tables(conversations: int, num_tokens: int) -> None:
    """Part ``startup``: prints the throughput and start-up tables."""
    from lightning_skrull.data.cache import cached_sft_data

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        chats = make_chats(conversations)
        tokenizer = make_tokenizer(chats)
        chat_path = tmp / "chat.jsonl"
        chat_path.write_text("".join(json.dumps(c) + "\n" for c in chats))
        del chats
        parquet = tmp / "pretokenised.parquet"
        write_pretokenised(parquet, num_tokens)

        print("\nTokenisation / conversion in one process (tokens per second)")
        print(f"{'data':>14} {'how':>22} {'tokens':>12} {'seconds':>8} {'tokens/s':>10}")
        throughput: dict[tuple[str, str], float] = {}
        sizes: dict[str, tuple[int, int]] = {}
        for name, path, tok in (("chat", chat_path, tokenizer), ("pre-tokenised", parquet, None)):
            seconds, direct = timed(load_sft_data, path, tokenizer=tok)
            sizes[name] = (direct.num_tokens, 8 * direct.num_tokens)  # int32 ids + labels
            rows = [("load_sft_data", seconds)]
            del direct
            for num_proc in (1, 2):
                seconds, _ = timed(
                    cached_sft_data,
                    path,
                    tokenizer=tok,
                    cache_dir=tmp / f"np{num_proc}",
                    num_proc=num_proc,
                    progress=False,
                )
                rows.append((f"cache build num_proc={num_proc}", seconds))
                shutil.rmtree(tmp / f"np{num_proc}")
            for how, seconds in rows:
                rate = sizes[name][0] / seconds
                throughput[name, how] = rate
                print(f"{name:>14} {how:>22} {sizes[name][0]:>12,} {seconds:>8.1f} {rate:>10,.0f}")

        print("\n4 processes (DP 2 x CP 2): time to the first step and unique memory growth")
        tiny = make_samples(20_000)
        base_s, base_uss = _startup(tiny, None, tmp / "unused", VOCAB)
        print(
            f"tiny in-memory data ({sum(len(s['input_ids']) for s in tiny):,} tokens): first "
            f"step after {base_s:.1f} s, USS growth {base_uss / 2**20:.0f} MiB (the baseline)"
        )
        header = (
            f"{'data':>14} {'run':>5} {'first step s':>12} {'extra s':>8} {'x 1-proc tok.':>13} "
            f"{'target':>7} {'USS extra MiB':>13} {'of token B':>10} {'target':>7}"
        )
        print(header)
        extra_by: dict[tuple[str, str], float] = {}
        for name, path, tok, vocab in (
            ("chat", chat_path, tokenizer, len(tokenizer)),
            ("pre-tokenised", parquet, None, VOCAB),
        ):
            one_process = sizes[name][0] / throughput[name, "load_sft_data"]
            cache = tmp / f"cache-{name}"
            for run, target in (("cold", TARGET_COLD), ("warm", TARGET_WARM)):
                seconds, uss = _startup(path, tok, cache, vocab)
                extra, extra_uss = seconds - base_s, uss - base_uss
                extra_by[name, run] = extra
                share = extra_uss / sizes[name][1]
                print(
                    f"{name:>14} {run:>5} {seconds:>12.1f} {extra:>8.1f} "
                    f"{extra / one_process:>13.2f} {'<= ' + str(target):>7} "
                    f"{extra_uss / 2**20:>13.0f} {share:>10.2f} {'<= ' + str(TARGET_USS):>7}"
                )
            shutil.rmtree(cache)

        corpus = 2.5e9
        print(f"\nExtrapolated to a {corpus / 1e9:.1f}B-token corpus (linear in tokens)")
        for name in ("chat", "pre-tokenised"):
            scale = corpus / sizes[name][0]
            cold = corpus / throughput[name, "cache build num_proc=2"]
            today = corpus / throughput[name, "load_sft_data"]
            print(
                f"{name:>14}: today every rank of every run {today / 3600:.1f} h; cached: the "
                f"first run {cold / 3600:.1f} h once per corpus at num_proc=2 (divide by the "
                f"workers beyond 2), later runs {extra_by[name, 'warm'] * scale:.0f} s"
            )


if __name__ == "__main__":
    main()
