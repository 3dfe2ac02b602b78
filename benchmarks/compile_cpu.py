"""Step time of a compiled model against the eager one under ``SkrullStrategy``, on CPU.

One process (``SkrullStrategy(cp_size=1)``), the tiny Qwen2 of the tests (2 layers, hidden 32,
4 query / 2 K/V heads of 8, SwiGLU 64, vocabulary 64, float32, one thread), SGD. The data are
random sequences of 8 to 120 tokens, global batches of 8, a 128-token bucket: every step runs 2
to 5 micro-batches, each of another packed length and another layout of sequences, so a graph
specialised on a layout would have to compile again. Variants:

* ``eager``: the model as loaded;
* ``torch.compile(model, dynamic=True)``: inductor, every size symbolic from the first call;
* ``torch.compile(model)``: inductor with dynamo's default, static shapes at the first call and
  dynamic ones after the first size that differs (one recompile);
* ``layer.compile(dynamic=True)`` of each decoder layer.

The Skrull attention runs eagerly inside every compiled variant (dynamo breaks the graph there).
A step is timed from one ``on_train_batch_end`` to the next (loading, planning and collating its
batch included); per variant the table shows the first step's seconds (the first compile), the
frames dynamo compiled after the first step (recompiles), its graph breaks and graphs, and the
median over the steps after the last compile of the step's wall and main-thread CPU milliseconds
and their ratio to eager. Each variant runs ``--repeats`` times interleaved with the others; a
time is the median over the repeats, the range of the CPU ratio over them shows the noise.

Run::

    python -m benchmarks.compile_cpu               # the table of docs/benchmarks.md
    python -m benchmarks.compile_cpu --smoke       # one repeat, 6 steps

Absolute times depend on the machine and its load; the ratios are the figures to compare.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from typing import Any

import lightning.pytorch as L
import torch

from benchmarks.e2e_cpu import cpu_trainer
from lightning_skrull import SkrullDataModule, SkrullStrategy

VOCAB = 64
VARIANTS = (
    "eager",
    "torch.compile(model, dynamic=True)",
    "torch.compile(model)",
    "layer.compile(dynamic=True)",
)


def make_samples(num: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """``num`` random sequences of 8 to 120 tokens, every token supervised."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 121, (num,), generator=g).tolist()
    out = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": ids})
    return out


class _LM(L.LightningModule):
    """The documentation's module, its model compiled as ``variant`` says."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        config = Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        )
        model: Any = Qwen2ForCausalLM(config)
        if variant == "torch.compile(model, dynamic=True)":
            model = torch.compile(model, dynamic=True)
        elif variant == "torch.compile(model)":
            model = torch.compile(model)
        elif variant == "layer.compile(dynamic=True)":
            for layer in model.model.layers:
                layer.compile(dynamic=True)
        self.model = model

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class _StepRecorder(L.Callback):
    """Per step: wall and main-thread CPU seconds since the last step ended (the first from
    the fit's start), micro-batches run and dynamo's frame count when it ended."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        self._last: tuple[float, float] | None = None

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self._last = (time.perf_counter(), time.thread_time())

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        from torch._dynamo.utils import counters

        now = (time.perf_counter(), time.thread_time())
        assert self._last is not None
        self.rows.append(
            {
                "wall": now[0] - self._last[0],
                "cpu": now[1] - self._last[1],
                "micro_batches": len(batch.rank_batch.micro_batches),
                "frames": counters["frames"]["total"],
            }
        )
        self._last = now


def run(variant: str, steps: int) -> dict[str, Any]:
    """One fit of ``steps`` steps of ``variant``; its per-step rows and dynamo's counts."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    recorder = _StepRecorder()
    trainer = cpu_trainer(SkrullStrategy(cp_size=1, bucket_size=128), steps, recorder)
    data = SkrullDataModule(train_data=make_samples(8 * steps), global_batch_size=8, shuffle=False)
    trainer.fit(_LM(variant), data)
    rows = recorder.rows
    # the step of the last compile (its frame count is the final one for the first time)
    last_compile = min(i for i, r in enumerate(rows) if r["frames"] == rows[-1]["frames"])
    steady = rows[last_compile + 1 :]
    return {
        "first_s": rows[0]["wall"],
        "recompiles": rows[-1]["frames"] - rows[0]["frames"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
        "wall_ms": 1e3 * statistics.median(r["wall"] for r in steady),
        "cpu_ms": 1e3 * statistics.median(r["cpu"] for r in steady),
        "micro_batches": sorted({int(r["micro_batches"]) for r in rows}),
        "steady_steps": len(steady),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="one repeat of 6 steps")
    args = parser.parse_args(argv)
    steps, repeats = (6, 1) if args.smoke else (args.steps, args.repeats)
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for _ in range(repeats):
        for variant in VARIANTS:
            results[variant].append(run(variant, steps))
    eager_cpu = [r["cpu_ms"] for r in results["eager"]]
    print(
        f"{steps} steps of 8 sequences (8-120 tokens), micro-batches per step "
        f"{results['eager'][0]['micro_batches']}, {repeats} repeat(s)\n"
    )
    print(
        "| variant | first step s | recompiles after step 1 | graph breaks | graphs "
        "| step wall ms | step CPU ms | CPU / eager (range) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for variant, rs in results.items():
        ratios = [r["cpu_ms"] / e for r, e in zip(rs, eager_cpu, strict=True)]
        med = statistics.median
        print(
            f"| {variant} | {med(r['first_s'] for r in rs):.1f} "
            f"| {max(r['recompiles'] for r in rs)} | {max(r['graph_breaks'] for r in rs)} "
            f"| {max(r['graphs'] for r in rs)} | {med(r['wall_ms'] for r in rs):.1f} "
            f"| {med(r['cpu_ms'] for r in rs):.1f} "
            f"| {med(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )


if __name__ == "__main__":
    main()
