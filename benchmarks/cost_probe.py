"""Measure the cost model's compute constants on one GPU, for the paper's two model shapes.

The planner's :class:`~lightning_skrull.scheduling.CostModel` needs two compute constants: the
FLOP/s the training kernels achieve and the fixed seconds every micro-batch pays whatever its
tokens (kernel launches, Python, reading every weight in the forward and twice in the backward).
The second one decides how much packing gains, and it is the one the defaults only guess.

This script times forward + backward (no optimizer step: that is paid once per step, not per
micro-batch) of single micro-batches through the package's own path (``prepare_model``,
``collate_rank``, ``forward_backward``, attention backend ``auto``, CP=1) on a decoder with
random bf16 weights. The micro-batches differ in tokens (64 up to the bucket), sequence count
and length mix, so that the two constants separate; :func:`~lightning_skrull.scheduling.fit_cost_model` fits them.

A model too big to train on one GPU (Qwen2.5-7B) is cut to a few layers and measured at two
depths. The fixed cost is linear in depth (launches and weight reads are per layer), so the
two fits give its per-layer part and the rest, extrapolated to the full depth; the FLOP/s come
from the deeper cut. Communication constants need several GPUs and are not measured here.

Prints one table and writes JSON (``$OUT/cost_probe.json``, ``benchmarks/out/`` or ``--json``)::

    python -m benchmarks.cost_probe                        # one NVIDIA GPU, about 2 minutes
    python -m benchmarks.cost_probe --device cpu --tiny    # the code paths on CPU, in seconds
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_check import (
    QWEN2_5_0_5B,
    TINY,
    default_json,
    fit_constants,
    median_seconds,
    write_json,
)

QWEN2_5_7B: dict[str, Any] = {
    **QWEN2_5_0_5B,
    "vocab_size": 152_064,
    "hidden_size": 3584,
    "intermediate_size": 18_944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "tie_word_embeddings": False,
}
"""Qwen2.5-7B's shape (random weights; nothing is downloaded)."""

# name -> (config, depths measured, tokens of the largest micro-batch)
MODELS: dict[str, tuple[dict[str, Any], tuple[int, ...], int]] = {
    "Qwen2.5-0.5B": (QWEN2_5_0_5B, (24,), 26_000),
    "Qwen2.5-7B": (QWEN2_5_7B, (2, 4), 13_000),
}


def micro_batches(bucket: int, tiny: bool) -> list[list[int]]:
    """Length lists of the measured micro-batches: few to many tokens, one to many sequences."""
    smallest = 8 if tiny else 64
    out: list[list[int]] = [[smallest], [smallest] * 8]
    for share in (0.05, 0.25, 0.5, 1.0):
        tokens = max(smallest, int(bucket * share))
        out.append([tokens])  # one sequence
        n = max(2, tokens // (64 if tiny else 1024))
        out.append([tokens // n] * n)  # many short ones
    return out


def measure(
    config: dict[str, Any], layers: int, bucket: int, device: torch.device, reps: int, tiny: bool
) -> dict[str, Any]:
    """Time every micro-batch of :func:`micro_batches` on ``config`` cut to ``layers``; fit."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lightning_skrull.data.collate import collate_rank
    from lightning_skrull.models import prepare_model
    from lightning_skrull.runtime.engine import forward_backward
    from lightning_skrull.scheduling import CostModel, GlobalBatchPlan, MicroBatchPlan

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    cfg = Qwen2Config(**{**config, "num_hidden_layers": layers}, attn_implementation="sdpa")
    torch.manual_seed(0)
    with device:  # initialise on the GPU: a 7B cut has 2B parameters
        model = Qwen2ForCausalLM(cfg).to(dtype=dtype)
    model.train()
    rng = random.Random(0)
    # The smallest micro-batch through the plain Hugging Face model first (its own SDPA
    # attention, no Skrull context): the fixed cost any training loop on this model pays.
    smallest = micro_batches(bucket, tiny)[0][0]
    plain_hf = median_seconds(
        lambda _rep: torch.randint(0, cfg.vocab_size, (1, smallest), device=device),
        lambda ids: model(input_ids=ids, labels=ids).loss.backward(),
        device,
        reps,
    )
    model.zero_grad(set_to_none=False)
    model = prepare_model(model, backend="auto")
    samples: list[tuple[GlobalBatchPlan, list[int], float]] = []
    rows = []
    for lengths in micro_batches(bucket, tiny):
        mb = MicroBatchPlan(tuple(range(len(lengths))), (0,) * len(lengths))
        plan = GlobalBatchPlan(((mb,),), dp_size=1, cp_size=1, bucket_size=max(bucket, sum(lengths)),
                               policy="skrull")  # fmt: skip

        def make_batch(
            _rep: int, plan: GlobalBatchPlan = plan, lengths: list[int] = lengths
        ) -> Any:
            data = [
                {"input_ids": [rng.randrange(cfg.vocab_size) for _ in range(n)]} for n in lengths
            ]
            return collate_rank(data, plan, dp_rank=0, cp_rank=0, world_size=1).to(device)

        seconds = median_seconds(
            make_batch,
            lambda batch: forward_backward(model, batch, cp_group=None, backend="auto"),
            device,
            reps,
        )
        model.zero_grad(set_to_none=False)
        samples.append((plan, lengths, seconds))
        rows.append({"lengths": f"{len(lengths)} x {lengths[0]}", "tokens": sum(lengths),
                     "seconds": seconds})  # fmt: skip
    fit = fit_constants(CostModel.from_hf_config(cfg), samples)
    for row, error in zip(rows, fit["relative_errors"], strict=True):
        row["fit_error"] = error
    return {
        "layers": layers,
        "achieved_flops": fit["achieved_flops"],
        "micro_batch_overhead_s": fit["micro_batch_overhead_s"],
        "max_abs_fit_error": fit["max_abs_relative_error"],
        "plain_hf_smallest_seconds": plain_hf,
        "micro_batches": rows,
    }


def extrapolate(name: str, full_layers: int, fits: list[dict[str, Any]]) -> dict[str, Any]:
    """Constants of the full-depth model from the measured cuts."""
    deepest = max(fits, key=lambda f: f["layers"])
    if len(fits) == 1:
        per_layer = None
        overhead = deepest["micro_batch_overhead_s"] * full_layers / deepest["layers"]
        if deepest["layers"] == full_layers:
            overhead = deepest["micro_batch_overhead_s"]
    else:
        a, b = sorted(fits, key=lambda f: f["layers"])[:2]
        per_layer = (b["micro_batch_overhead_s"] - a["micro_batch_overhead_s"]) / (
            b["layers"] - a["layers"]
        )
        overhead = b["micro_batch_overhead_s"] + per_layer * (full_layers - b["layers"])
    return {
        "model": name,
        "layers": full_layers,
        "achieved_flops": deepest["achieved_flops"],
        "micro_batch_overhead_s": overhead,
        "overhead_per_layer_s": per_layer,
        "measured_depths": [f["layers"] for f in fits],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every model; returns the report."""
    device = torch.device(args.device)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "reps": args.reps,
        "models": {},
    }
    from lightning_skrull.attention import resolve_backend

    report["attention_backend"] = resolve_backend("auto", device)
    for name, (config, depths, bucket) in MODELS.items():
        if args.tiny:
            config, depths, bucket = {**TINY, "num_hidden_layers": 4}, (1, 2), 256
        fits = []
        for depth in depths:
            fits.append(measure(config, depth, bucket, device, args.reps, args.tiny))
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the cut model is gone with measure's frame
        report["models"][name] = {
            "fits": fits,
            "full_model": extrapolate(name, config["num_hidden_layers"], fits),
        }
        print(name, json.dumps(report["models"][name]["full_model"]), flush=True)
    return report


def table(report: dict[str, Any]) -> str:
    """Markdown tables: every measured micro-batch, then the constants."""
    lines = [
        f"micro-batch fwd+bwd, {report['device']}, torch {report['torch']}, attention "
        f"{report['attention_backend']}, median of {report['reps']}",
        "| model | layers | micro-batch | tokens | ms | error under the fit |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for name, m in report["models"].items():
        for fit in m["fits"]:
            for row in fit["micro_batches"]:
                lines.append(
                    f"| {name} | {fit['layers']} | {row['lengths']} | {row['tokens']} | "
                    f"{row['seconds'] * 1e3:.2f} | {row['fit_error']:+.1%} |"
                )
            lines.append(
                f"| {name} | {fit['layers']} | same as the first row, plain Hugging Face | "
                f"{fit['micro_batches'][0]['tokens']} | "
                f"{fit['plain_hf_smallest_seconds'] * 1e3:.2f} | |"
            )
    lines += [
        "",
        "| model | layers | achieved TFLOP/s | fixed ms per micro-batch | per layer ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, m in report["models"].items():
        for fit in m["fits"]:
            lines.append(
                f"| {name} (measured) | {fit['layers']} | {fit['achieved_flops'] / 1e12:.0f} | "
                f"{fit['micro_batch_overhead_s'] * 1e3:.2f} | |"
            )
        full = m["full_model"]
        per = full["overhead_per_layer_s"]
        lines.append(
            f"| {name} (full depth) | {full['layers']} | {full['achieved_flops'] / 1e12:.0f} | "
            f"{full['micro_batch_overhead_s'] * 1e3:.2f} | "
            f"{'' if per is None else f'{per * 1e3:.3f}'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run, print the tables, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny model (CPU test)")
    parser.add_argument("--reps", type=int, default=3, help="measured repetitions")
    parser.add_argument("--json", type=Path, default=default_json("cost_probe.json"))
    args = parser.parse_args(argv)
    report = run(args)
    print(table(report))
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
