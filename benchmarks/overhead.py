"""Per-step overhead of ``SkrullStrategy(cp_size=1)`` against plain Lightning + HF, on CPU.

Many short sequences in one micro-batch: the step is small, so what the Skrull path adds per
step and per sequence (planning, collating, logging, attention calls and their views) shows.
For each number of sequences per micro-batch and each sequence length, the same tokens are
trained (forward, backward, SGD) by

* ``plain HF``: a plain ``L.Trainer`` (one CPU process) and the HF model with
  ``attn_implementation="sdpa"``, the sequences packed in one row with ``position_ids`` that
  restart at 0 (no cache: transformers then builds a block-diagonal causal mask over the row);
* ``per seq``: ``SkrullStrategy(cp_size=1)`` with the ``sdpa`` backend and one SDPA call per
  local sequence (``LOCAL_GROUP_MASK_ELEMENTS = 0``, ``LOCAL_BATCH_EQUAL_LENGTHS = False``);
* ``masked``: short local sequences grouped under block-diagonal masks only
  (``LOCAL_BATCH_EQUAL_LENGTHS = False``);
* ``Skrull``: the defaults (masked groups, and runs of equal lengths as one batched call).

One micro-batch per step (the bucket holds the whole global batch); every step trains the same
global batch. A step is timed from one ``on_train_batch_end`` to the next, so it includes what
the loader does (plan and collate for Skrull) and the move to the device; the table shows the
median over the timed steps of its wall time and of the main thread's CPU time
(``time.thread_time``, which a loaded machine inflates far less than wall time), and the ratio of
each Skrull variant to plain HF. Each cell runs ``--repeats`` times (3 by default), plain HF and
the variants interleaved, so a change in the machine's load hits them alike; a time is the median
over the repeats, and the range of the CPU ratio over the repeats shows the noise. Targets: at
most 1.5x plain HF at 64 sequences, 1.2x at 4.

The fixed cost of a local sequence: the same 1024 tokens as 16, 64 and 256 sequences of mixed
lengths (no two neighbours of one length, so no batched call), Skrull's defaults; the slope of
the step's CPU time over the number of sequences (least squares) is the cost of one more
sequence at a constant token count.

Model: Qwen2 architecture, random weights, 24 layers, hidden 32, 4 query / 2 K/V heads of 8,
SwiGLU 64, vocabulary 256, float32, one thread (``torch.set_num_threads(1)``).

Run::

    python -m benchmarks.overhead                 # the tables of docs/benchmarks.md
    python -m benchmarks.overhead --smoke         # 2 layers, one size, a few seconds

Absolute times depend on the machine and its load; the ratios are the figures to compare.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from benchmarks.e2e_cpu import cpu_trainer
from lightning_skrull import SkrullDataModule, SkrullStrategy
from lightning_skrull.attention import sdpa as sdpa_backend

VOCAB = 256


def model_config(layers: int) -> dict[str, Any]:
    """The benchmark model's Qwen2 config."""
    return {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 1024,
        "use_cache": False,
    }


def make_samples(num_sequences: int, length: int) -> list[dict[str, list[int]]]:
    """``num_sequences`` random sequences of ``length`` tokens, every token supervised."""
    g = torch.Generator().manual_seed(num_sequences * 1000 + length)
    ids = torch.randint(0, VOCAB, (num_sequences, length), generator=g).tolist()
    return [{"input_ids": row, "labels": row} for row in ids]


class _LM(L.LightningModule):
    """The plain module of the docs: the loss is the Hugging Face model's."""

    def __init__(self, layers: int, attn_implementation: str | None = None) -> None:
        super().__init__()
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        config = Qwen2Config(**model_config(layers))
        if attn_implementation is not None:
            config._attn_implementation = attn_implementation
        self.model = Qwen2ForCausalLM(config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


class _StepTimer(L.Callback):
    """Wall and main-thread CPU seconds from each ``on_train_batch_end`` to the next (one
    optimizer step here, with the loading of its batch)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._last: tuple[float, float] | None = None

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = (time.perf_counter(), time.thread_time())
        if self._last is not None:
            self.wall.append(now[0] - self._last[0])
            self.cpu.append(now[1] - self._last[1])
        self._last = now


def packed_batch(samples: Sequence[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """The samples in one row, positions restarting per sequence, labels shifted per sequence
    (the last token of each sequence predicts nothing), as plain HF trains packed SFT data."""
    ids, pos, shift = [], [], []
    for s in samples:
        n = len(s["input_ids"])
        ids += s["input_ids"]
        pos += list(range(n))
        shift += [*s["labels"][1:], -100]
    labels = torch.tensor([shift])
    return {
        "input_ids": torch.tensor([ids]),
        "position_ids": torch.tensor([pos]),
        "labels": labels,  # transformers computes a loss only when labels are given
        "shift_labels": labels,
    }


Times = tuple[list[float], list[float]]
"""Per-step ``(wall seconds, CPU seconds)``."""

VARIANTS: dict[str, tuple[int | None, bool | None]] = {
    "per seq": (0, False),
    "masked": (None, False),
    "Skrull": (None, None),
}
"""Skrull variants: ``(LOCAL_GROUP_MASK_ELEMENTS, LOCAL_BATCH_EQUAL_LENGTHS)``, ``None`` = the
default."""


def time_plain(samples: list[dict[str, list[int]]], layers: int, steps: int) -> Times:
    """Step seconds of plain Lightning + HF (sdpa) on the packed samples."""
    batch = packed_batch(samples)
    loader = DataLoader([batch] * (steps + 1), batch_size=None)
    timer = _StepTimer()
    cpu_trainer("auto", steps + 1, timer).fit(_LM(layers, "sdpa"), loader)
    return timer.wall, timer.cpu


def time_skrull(
    samples: list[dict[str, list[int]]],
    layers: int,
    steps: int,
    group_mask_elements: int | None = None,
    batch_equal_lengths: bool | None = None,
) -> Times:
    """Step seconds of ``SkrullStrategy(cp_size=1)`` (sdpa backend) on the samples."""
    tokens = sum(len(s["input_ids"]) for s in samples)
    data = SkrullDataModule(
        train_data=samples * (steps + 1), global_batch_size=len(samples), shuffle=False
    )
    strategy = SkrullStrategy(cp_size=1, bucket_size=tokens, attention_backend="sdpa")
    timer = _StepTimer()
    saved = sdpa_backend.LOCAL_GROUP_MASK_ELEMENTS, sdpa_backend.LOCAL_BATCH_EQUAL_LENGTHS
    if group_mask_elements is not None:
        sdpa_backend.LOCAL_GROUP_MASK_ELEMENTS = group_mask_elements
    if batch_equal_lengths is not None:
        sdpa_backend.LOCAL_BATCH_EQUAL_LENGTHS = batch_equal_lengths
    try:
        cpu_trainer(strategy, steps + 1, timer).fit(_LM(layers), data)
    finally:
        sdpa_backend.LOCAL_GROUP_MASK_ELEMENTS, sdpa_backend.LOCAL_BATCH_EQUAL_LENGTHS = saved
        if dist.is_initialized():  # the strategy's one-rank process group
            dist.destroy_process_group()
    return timer.wall, timer.cpu


def mixed_lengths(tokens: int, num_sequences: int) -> list[int]:
    """``num_sequences`` lengths around their mean that sum to ``tokens``, no two neighbours equal.

    Raises:
        ValueError: fewer than three tokens per sequence.
    """
    mean = tokens // num_sequences
    if mean < 3:
        raise ValueError(f"{tokens} tokens cannot make {num_sequences} mixed sequences")
    offsets = (-2, 1, -1, 2, 0)  # no two neighbours equal, also across the cycle
    lengths = [max(1, mean + offsets[i % 5]) for i in range(num_sequences)]

    def free(i: int, value: int) -> bool:
        return value >= 1 and all(
            not 0 <= j < num_sequences or lengths[j] != value for j in (i - 1, i + 1)
        )

    i = 0
    while (deficit := tokens - sum(lengths)) != 0:  # one token at a time, keeping neighbours apart
        step = 1 if deficit > 0 else -1
        if free(i % num_sequences, lengths[i % num_sequences] + step):
            lengths[i % num_sequences] += step
        i += 1
    return lengths


def make_mixed_samples(lengths: Sequence[int]) -> list[dict[str, list[int]]]:
    """Random sequences of the given lengths, every token supervised."""
    g = torch.Generator().manual_seed(len(lengths))
    return [
        {"input_ids": row, "labels": row}
        for row in (torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths)
    ]


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


def _median_pair(pairs: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Element-wise median of ``(wall, cpu)`` pairs."""
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


TARGETS = {4: 1.2, 64: 1.5}
"""Largest step-time ratio to plain HF, by sequences per micro-batch."""


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark, print the tables and return the grid's rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per run")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of each kind per cell, interleaved (plain, variants, plain, ...); each time is "
        "the median over the repeats of each run's median, the ratio range is over the repeats",
    )
    parser.add_argument(
        "--per-sequence",
        type=int,
        nargs="*",
        default=[16, 64, 256],
        help="sequence counts of the fixed-cost fit at 1024 tokens (none: skip it)",
    )
    parser.add_argument("--smoke", action="store_true", help="2 layers, 4 x 4 tokens, 2 steps")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sequences, args.lengths, args.layers, args.steps, args.warmup = [4], [4], 2, 2, 1
        args.per_sequence, args.repeats = [2, 3], 1
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    total = args.warmup + args.steps

    def medians(times: Times) -> tuple[float, float]:
        wall, cpu = times
        return statistics.median(wall[args.warmup :]), statistics.median(cpu[args.warmup :])

    print(
        f"Qwen2, {args.layers} layers, hidden 32, 4/2 heads of 8, float32, 1 thread; median of "
        f"{args.steps} steps after {args.warmup}, median over {args.repeats} interleaved "
        "repeats; ms per step wall / CPU, ratio to plain HF (wall / CPU) and the range of the "
        "CPU ratio over the repeats"
    )
    cells = [f"{'seqs x tokens':>13}", f"{'plain HF ms':>13}"]
    cells += [f"{name + ' ms':>13} | {'ratio':>11} | {'range':>11}" for name in args.variants]
    cells += [f"{'target':>6}"]
    header = "| " + " | ".join(cells) + " |"
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    # The first Trainer of a process pays one-off costs (tens of ms per step in its first
    # steps): one untimed run of each kind first.
    first = make_samples(args.sequences[0], args.lengths[0])
    time_plain(first, args.layers, args.warmup)
    time_skrull(first, args.layers, args.warmup)
    rows = []
    for length in args.lengths:
        for n in args.sequences:
            samples = make_samples(n, length)
            runs: dict[str, list[tuple[float, float]]] = {
                "plain": [],
                **{v: [] for v in args.variants},
            }
            for _ in range(args.repeats):  # interleaved, so a change in machine load hits all
                runs["plain"].append(medians(time_plain(samples, args.layers, total)))
                for name in args.variants:
                    times = time_skrull(samples, args.layers, total, *VARIANTS[name])
                    runs[name].append(medians(times))
            plain = _median_pair(runs["plain"])
            row: dict[str, Any] = {"sequences": n, "length": length, "plain": plain}
            line = [f"{f'{n} x {length}':>13}", f"{plain[0] * 1e3:>6.1f} / {plain[1] * 1e3:>4.1f}"]
            for name in args.variants:
                got = row[name] = _median_pair(runs[name])
                ratios = [v[1] / p[1] for v, p in zip(runs[name], runs["plain"], strict=True)]
                line.append(f"{got[0] * 1e3:>6.1f} / {got[1] * 1e3:>4.1f}")
                line.append(f"{got[0] / plain[0]:>4.2f} / {got[1] / plain[1]:>4.2f}")
                line.append(f"{min(ratios):>4.2f}-{max(ratios):>4.2f}")
            target = TARGETS.get(n)
            line.append(f"{f'{target:.1f}x' if target else '':>6}")
            rows.append(row)
            print("| " + " | ".join(line) + " |", flush=True)
    if args.per_sequence:
        tokens = 1024 if not args.smoke else 9
        cpu = []
        for n in args.per_sequence:
            samples = make_mixed_samples(mixed_lengths(tokens, n))
            cpu.append(medians(time_skrull(samples, args.layers, total))[1])
            print(f"{tokens} tokens as {n} mixed sequences: Skrull {cpu[-1] * 1e3:.1f} ms CPU")
        cost = slope(args.per_sequence, cpu)
        print(f"fixed cost of a local sequence: {cost * 1e6:.0f} us CPU per extra sequence")
        rows.append({"per_sequence_s": cost})
    return rows


if __name__ == "__main__":
    main()
