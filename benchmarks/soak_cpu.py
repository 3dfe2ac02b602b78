"""Soak run on CPU: resident memory over a few hundred small Skrull steps.

Trains a tiny Qwen2 with ``Trainer.fit`` on ``--world`` gloo processes (``--cp-size`` ranks per CP
group) for ``--steps`` optimizer steps over many short epochs (a fresh loader iterator every
epoch, a validation pass every few epochs), and reads every rank's resident set size (RSS) every
``--every`` steps, after a garbage collection and glibc's ``malloc_trim`` (which hands freed heap
pages back to the system), so that the figure is memory actually kept, together with the number
of objects the garbage collector tracks (a leak of Python objects shows there first).
Prints the table, then the growth of each rank from the first reading after ``--warmup`` steps
to the last and over the second half of the run, and exits non-zero when a rank grew by more
than ``--max-growth-mib``.

Run: ``python -m benchmarks.soak_cpu`` (two processes, 600 steps: about four minutes on two
cores).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
from typing import Any

import lightning.pytorch as L
import psutil
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lightning_skrull.runtime.launch import spawn

CFG: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def make_data(n: int, seed: int) -> list[dict[str, list[int]]]:
    """Long-tailed lengths (4..300 tokens), a random unsupervised prompt each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(4 + 296 * float(torch.rand((), generator=g)) ** 3)
        ids = torch.randint(0, CFG["vocab_size"], (length,), generator=g).tolist()
        prompt = int(torch.randint(0, length // 2 + 1, (1,), generator=g))
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


class SoakLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Qwen2ForCausalLM(Qwen2Config(**CFG))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _malloc_trim() -> None:
    """Return freed heap pages to the system (glibc); a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class RssProbe(L.Callback):
    """``(step, RSS, gc-tracked objects)`` of this process every ``every`` optimizer steps."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.readings: list[tuple[int, int, int]] = []
        self.process = psutil.Process()

    def on_train_batch_end(self, trainer: Any, module: Any, out: Any, batch: Any, i: int) -> None:
        step = trainer.global_step
        if step % self.every == 0:
            gc.collect()
            _malloc_trim()
            rss = self.process.memory_info().rss
            self.readings.append((step, rss, len(gc.get_objects())))


def _soak(rank: int, world_size: int, args: argparse.Namespace) -> list[tuple[int, int, int]]:
    from lightning_skrull import SkrullDataModule, SkrullStrategy

    probe = RssProbe(args.every)
    trainer = L.Trainer(
        strategy=SkrullStrategy(cp_size=args.cp_size, bucket_size=args.bucket_size),
        accelerator="cpu",
        devices=world_size,
        max_steps=args.steps,
        check_val_every_n_epoch=5,
        callbacks=[probe],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    data = SkrullDataModule(
        make_data(args.samples, seed=0),
        global_batch_size=args.global_batch_size,
        val_data=make_data(16, seed=1),
    )
    trainer.fit(SoakLM(), data)
    return probe.readings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="processes")
    parser.add_argument("--cp-size", type=int, default=2, help="ranks per CP group")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps")
    parser.add_argument("--every", type=int, default=50, help="steps between RSS readings")
    parser.add_argument("--warmup", type=int, default=100, help="steps before the baseline")
    parser.add_argument("--samples", type=int, default=48, help="training samples")
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--bucket-size", type=int, default=256, help="tokens per CP rank")
    parser.add_argument("--max-growth-mib", type=float, default=16.0, help="allowed growth")
    args = parser.parse_args()

    readings = spawn(_soak, args.world, args, timeout=3600)
    mib = 2**20
    print(
        f"RSS (MiB) and gc-tracked objects per rank, {args.world} processes, cp_size "
        f"{args.cp_size}, {args.steps} steps"
    )
    ranks = range(args.world)
    print("| step | " + " | ".join(f"rank {r} RSS | rank {r} objects" for r in ranks) + " |")
    print("|---:|" + "---:|---:|" * args.world)
    for row in zip(*readings, strict=True):
        cells = " | ".join(f"{rss / mib:.1f} | {objects}" for _, rss, objects in row)
        print(f"| {row[0][0]} | {cells} |")
    worst = 0.0
    print()
    for rank, series in enumerate(readings):
        after = [(step, rss, objects) for step, rss, objects in series if step >= args.warmup]
        half = after[len(after) // 2 :]
        growth = (after[-1][1] - after[0][1]) / mib
        late = (half[-1][1] - half[0][1]) / mib
        worst = max(worst, growth)
        print(
            f"rank {rank}: {growth:+.1f} MiB from step {after[0][0]} to {after[-1][0]}, "
            f"{late:+.1f} MiB from step {half[0][0]}; objects {after[-1][2] - after[0][2]:+d}"
        )
    verdict = "no growth beyond noise" if worst <= args.max_growth_mib else "MEMORY GROWS"
    print(f"\nlargest growth {worst:+.1f} MiB, limit {args.max_growth_mib:.0f} MiB: {verdict}")
    return 0 if worst <= args.max_growth_mib else 1


if __name__ == "__main__":
    raise SystemExit(main())
