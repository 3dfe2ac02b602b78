"""Peak memory and time of one training step: dense logits against the chunked loss, on CPU.

A Qwen2 with Qwen2.5's 151,936-token vocabulary (tied head, as Qwen2.5-0.5B) and a tiny body
(hidden 64, 2 layers), so the LM head dominates activation memory as it does for Qwen2.5-0.5B.
Each case runs in a fresh process: one warm-up step on 16 tokens, then the peak resident set
(``VmHWM``, :func:`benchmarks.rss.peak_rss_kib`) is read before and after one forward +
backward of ``N`` packed tokens (sequences of 512), and the step is timed (the fastest of
three). Three ways to run the same tokens:

- ``hf``: plain transformers (sdpa attention), full logits and ``ForCausalLMLoss``;
- ``skrull_dense``: the model prepared for Skrull (CP size 1), the dense loss;
- ``skrull_chunked``: the same with the chunked LM head + cross-entropy (the strategies' default).

``--model qwen3_moe`` measures a small Qwen3-MoE instead (:data:`MOE_CONFIG`, plain transformers
only), whose experts dominate its activations: the check of the MoE layer's estimate.

Run::

    python -m benchmarks.memory_cpu                       # 1K, 2K, 4K, 8K tokens
    python -m benchmarks.memory_cpu --tokens 1024 2048    # a quick look
    python -m benchmarks.memory_cpu --model qwen3_moe --tokens 1024 2048
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.rss import peak_rss_kib

ROOT = Path(__file__).resolve().parent.parent
"""The repository root: the working directory of the per-measurement processes."""

VOCAB = 151_936
SEQUENCE = 512
MODES = ("hf", "skrull_dense", "skrull_chunked")
TARGET_GROWTH = 0.25
"""Chunked growth over plain transformers' at 4K tokens, at most."""
TARGET_TIME = 1.1
"""Chunked step time over plain transformers', at most."""
CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "max_position_embeddings": SEQUENCE,
}
"""The measured model's Qwen2Config (the head dominates its activations)."""
MOE_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "moe_intermediate_size": 256,
    "num_experts": 8,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
    "max_position_embeddings": 16384,
}
"""The Qwen3MoeConfig of ``--model qwen3_moe`` (its four routed experts per token hold 80% of
its activations)."""
MODELS: dict[str, tuple[str, dict[str, Any], int | None]] = {
    "qwen2": ("qwen2", CONFIG, SEQUENCE),
    "qwen3_moe": ("qwen3_moe", MOE_CONFIG, None),
}
"""``--model`` choices: the ``model_type``, the config fields and the sequence length the step's
tokens are packed in. ``None``: one sequence of all of them, which plain transformers runs
without a mask; packed sequences make it build a block-causal float mask, ``tokens**2`` floats
that sdpa keeps in every layer, which would grow faster than the activations measured."""


def model_config(model: str, layers: int | None = None) -> Any:
    """The transformers config of ``--model`` ``model``, with ``layers`` decoder layers if given."""
    from transformers import AutoConfig

    model_type, fields, _ = MODELS[model]
    if layers is not None:
        fields = {**fields, "num_hidden_layers": layers}
    return AutoConfig.for_model(model_type, **fields)


def _model(model: str, layers: int | None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(model_config(model, layers))


def _samples(tokens: int, vocab: int, sequence: int | None) -> list[dict[str, list[int]]]:
    import torch

    g = torch.Generator().manual_seed(1)
    sequence = sequence or tokens
    lengths = [sequence] * (tokens // sequence) + ([tokens % sequence] if tokens % sequence else [])
    return [{"input_ids": torch.randint(0, vocab, (n,), generator=g).tolist()} for n in lengths]


def _packed(samples: list[dict[str, list[int]]]) -> dict[str, Any]:
    """Plain transformers' packed input of ``samples``: ``input_ids``, ``position_ids``
    restarting at 0 in each sequence, and each sequence's labels shifted by one: the tensors
    the Skrull collate gives one rank at CP=1 for these equal-length sequences, built here
    without importing the package, and with it Lightning (5-7 s), into a process that runs
    only transformers."""
    import torch

    ids = [torch.tensor(s["input_ids"]) for s in samples]
    labels = [torch.cat([i[1:], torch.tensor([-100])]) for i in ids]
    return {
        "input_ids": torch.cat(ids)[None],
        "position_ids": torch.cat([torch.arange(len(i)) for i in ids])[None],
        "labels": torch.cat(labels)[None],
    }


def _step_fn(mode: str, tokens: int, model_name: str = "qwen2", layers: int | None = None) -> Any:
    """A function running one forward + backward of ``tokens`` packed tokens in ``mode``."""
    model = _model(model_name, layers)
    samples = _samples(tokens, int(model.config.vocab_size), MODELS[model_name][2])
    if mode == "hf":
        model.set_attn_implementation("sdpa")
        inputs = _packed(samples)

        def step() -> None:
            model(**inputs, use_cache=False).loss.backward()

        return step
    from lightning_skrull.data.collate import collate_rank
    from lightning_skrull.models import prepare_model
    from lightning_skrull.runtime.engine import micro_batch_context
    from lightning_skrull.scheduling import plan_global_batch

    lengths = [len(s["input_ids"]) for s in samples]
    plan = plan_global_batch(lengths, dp_size=1, cp_size=1, bucket_size=max(tokens, 16))
    batch = collate_rank(samples, plan, dp_rank=0, cp_rank=0, world_size=1)
    mb = batch.micro_batches[0]
    prepare_model(model, backend="sdpa", chunked_loss=mode == "skrull_chunked")

    def skrull_step() -> None:
        with micro_batch_context(mb, None, "sdpa"):
            model(**mb.inputs).loss.backward()

    return skrull_step


def _max_rss_mib() -> float:
    return peak_rss_kib() / 1024


def measure_one(
    mode: str, tokens: int, repeats: int = 3, model: str = "qwen2", layers: int | None = None
) -> dict[str, float]:
    """Peak RSS growth (MiB) and step time (s, the fastest of ``repeats`` steps) of one case,
    in this process."""
    import torch

    torch.set_num_threads(1)
    _step_fn(mode, 16, model, layers)()  # warm-up: allocator, kernels, autograd
    step = _step_fn(mode, tokens, model, layers)
    before = _max_rss_mib()
    start = time.perf_counter()
    step()
    times = [time.perf_counter() - start]
    growth = _max_rss_mib() - before
    for _ in range(repeats - 1):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"growth_mib": growth, "step_s": min(times)}


def run(
    tokens_list: list[int],
    modes: tuple[str, ...] = MODES,
    repeats: int = 3,
    model: str = "qwen2",
    layers: int | None = None,
    malloc_mmap_threshold: int | None = None,
    parallel: int = 1,
) -> list[dict[str, Any]]:
    """Every mode at every token count, each in a fresh process (``repeats`` timed steps);
    ``layers`` overrides the model's number of decoder layers. ``malloc_mmap_threshold`` (bytes)
    fixes glibc's mmap threshold in those processes (``MALLOC_MMAP_THRESHOLD_``): every larger
    block gets its own mapping, unmapped when freed, so the peak resident set follows the live
    tensors. By default glibc raises the threshold as blocks are freed and later blocks of that
    size come from its heap, which keeps the freed ones resident. ``parallel`` processes run at
    once: each measures its own peak resident set, so the growth is the same, but the step
    times are only comparable with 1."""
    env = dict(os.environ)
    if malloc_mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(malloc_mmap_threshold)
    cases = [(tokens, mode) for tokens in tokens_list for mode in modes]

    def one(case: tuple[int, str]) -> dict[str, Any]:
        tokens, mode = case
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.memory_cpu",
                "--one",
                mode,
                str(tokens),
                str(repeats),
                "--model",
                model,
                *(["--layers", str(layers)] if layers is not None else []),
            ],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        return {"mode": mode, "tokens": tokens, **json.loads(out.stdout.strip().splitlines()[-1])}

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        return list(pool.map(one, cases))


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table: growth, MiB per token and step time, with the ratios to plain HF."""
    lines = [
        "| tokens | way | peak growth (MiB) | MiB / token | step (s) | growth / HF | time / HF |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        hf = next(r for r in rows if r["tokens"] == row["tokens"] and r["mode"] == "hf")
        lines.append(
            f"| {row['tokens']} | {row['mode']} | {row['growth_mib']:.0f} | "
            f"{row['growth_mib'] / row['tokens']:.3f} | {row['step_s']:.3f} | "
            f"{row['growth_mib'] / hf['growth_mib']:.2f} | {row['step_s'] / hf['step_s']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen2", help="measured model")
    parser.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default: the model's)"
    )
    parser.add_argument(
        "--one", nargs=3, metavar=("MODE", "TOKENS", "REPEATS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.one:
        mode, tokens, repeats = args.one[0], int(args.one[1]), int(args.one[2])
        print(json.dumps(measure_one(mode, tokens, repeats, args.model, args.layers)))
        return
    modes = MODES if args.model == "qwen2" else ("hf",)
    rows = run(args.tokens, modes, model=args.model, layers=args.layers)
    print(table(rows))
    for row in rows:
        if row["mode"] == "skrull_chunked" and row["tokens"] == 4096:
            hf = next(r for r in rows if r["tokens"] == 4096 and r["mode"] == "hf")
            growth = row["growth_mib"] / hf["growth_mib"]
            speed = row["step_s"] / hf["step_s"]
            print(
                f"\n4K tokens: growth {growth:.2f}x plain HF (target <= {TARGET_GROWTH}), "
                f"step time {speed:.2f}x (target <= {TARGET_TIME})"
            )


if __name__ == "__main__":
    main()
