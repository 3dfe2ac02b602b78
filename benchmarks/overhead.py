"""Per-step overhead of ``SkrullStrategy(cp_size=1)`` against plain Lightning + HF, on CPU.

Many short sequences in one micro-batch: the step is small, so what the Skrull path adds per
sequence and per layer (attention calls, their autograd nodes and views) shows. For each
number of sequences per micro-batch and each sequence length, the same tokens are trained
(forward, backward, SGD) by

* ``plain HF``: a plain ``L.Trainer`` (one CPU process) and the HF model with
  ``attn_implementation="sdpa"``, the sequences packed in one row with ``position_ids`` that
  restart at 0 (no cache: transformers then builds a block-diagonal causal mask over the row);
* ``Skrull, per sequence``: ``SkrullStrategy(cp_size=1)`` with the ``sdpa`` backend and one
  SDPA call per local sequence (``LOCAL_GROUP_MASK_ELEMENTS = 0``);
* ``Skrull, grouped``: the same with the default grouping of short local sequences
  (:data:`lightning_skrull.attention.sdpa.LOCAL_GROUP_MASK_ELEMENTS`).

One micro-batch per step (the bucket holds the whole global batch); every step trains the same
global batch. The table shows the median step time (``on_train_batch_start`` to
``on_train_batch_end``) and the ratio of each Skrull variant to plain HF.

Model: Qwen2 architecture, random weights, 24 layers, hidden 32, 4 query / 2 K/V heads of 8,
SwiGLU 64, vocabulary 256, float32, one thread (``torch.set_num_threads(1)``).

Run::

    python -m benchmarks.overhead                 # the table of docs/benchmarks.md, ~5 min
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
    """Wall seconds of each training batch (one optimizer step here)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.seconds.append(time.perf_counter() - self._t0)


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


def time_plain(samples: list[dict[str, list[int]]], layers: int, steps: int) -> list[float]:
    """Step seconds of plain Lightning + HF (sdpa) on the packed samples."""
    batch = packed_batch(samples)
    loader = DataLoader([batch] * steps, batch_size=None)
    timer = _StepTimer()
    cpu_trainer("auto", steps, timer).fit(_LM(layers, "sdpa"), loader)
    return timer.seconds


def time_skrull(
    samples: list[dict[str, list[int]]], layers: int, steps: int, group_mask_elements: int
) -> list[float]:
    """Step seconds of ``SkrullStrategy(cp_size=1)`` (sdpa backend) on the samples."""
    tokens = sum(len(s["input_ids"]) for s in samples)
    data = SkrullDataModule(
        train_data=samples * steps, global_batch_size=len(samples), shuffle=False
    )
    strategy = SkrullStrategy(cp_size=1, bucket_size=tokens, attention_backend="sdpa")
    timer = _StepTimer()
    saved = sdpa_backend.LOCAL_GROUP_MASK_ELEMENTS
    sdpa_backend.LOCAL_GROUP_MASK_ELEMENTS = group_mask_elements
    try:
        cpu_trainer(strategy, steps, timer).fit(_LM(layers), data)
    finally:
        sdpa_backend.LOCAL_GROUP_MASK_ELEMENTS = saved
        if dist.is_initialized():  # the strategy's one-rank process group
            dist.destroy_process_group()
    return timer.seconds


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark, print the table and return its rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per run")
    parser.add_argument("--smoke", action="store_true", help="2 layers, 4 x 4 tokens, 2 steps")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sequences, args.lengths, args.layers, args.steps, args.warmup = [4], [4], 2, 2, 1
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    grouped = sdpa_backend.LOCAL_GROUP_MASK_ELEMENTS
    total = args.warmup + args.steps

    def median(seconds: list[float]) -> float:
        return statistics.median(seconds[args.warmup :])

    print(
        f"Qwen2, {args.layers} layers, hidden 32, 4/2 heads of 8, float32, 1 thread; "
        f"median of {args.steps} steps after {args.warmup}"
    )
    header = (
        f"| {'seqs x tokens':>13} | {'plain HF ms':>11} | {'per-seq ms':>10} | {'ratio':>5} | "
        f"{'grouped ms':>10} | {'ratio':>5} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c) + 0) for c in header.split("|")[1:-1]) + "|")
    # The first Trainer of a process pays one-off costs (tens of ms per step in its first
    # steps): one untimed run of each kind first.
    first = make_samples(args.sequences[0], args.lengths[0])
    time_plain(first, args.layers, args.warmup)
    time_skrull(first, args.layers, args.warmup, grouped)
    rows = []
    for length in args.lengths:
        for n in args.sequences:
            samples = make_samples(n, length)
            plain = median(time_plain(samples, args.layers, total))
            before = median(time_skrull(samples, args.layers, total, 0))
            after = median(time_skrull(samples, args.layers, total, grouped))
            row = {"sequences": n, "length": length, "plain": plain, "before": before,
                   "after": after}  # fmt: skip
            rows.append(row)
            print(
                f"| {f'{n} x {length}':>13} | {plain * 1e3:>11.1f} | {before * 1e3:>10.1f} | "
                f"{before / plain:>5.2f} | {after * 1e3:>10.1f} | {after / plain:>5.2f} |",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
