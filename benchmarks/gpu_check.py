"""GPU check: backends agree, step throughput under skrull and static, memory against the budget.

Run through ``benchmarks/gpu_check.sh`` on one NVIDIA GPU (only PyTorch and this package
needed; the ``flash`` backend runs flash-attn when installed, else PyTorch's own varlen kernel).
Eight checks, one summary block, one JSON file (rewritten after each check):

1. **Backends agree.** The ``flash`` and ``sdpa`` backends give the same attention output and
   input gradients on the same packed layout (local sequences and sequences on the distributed
   path, bf16), and the Skrull model loss with each backend equals the plain Hugging Face model
   run one sequence at a time. Without a varlen kernel only the second part runs.
2. **Throughput.** Training steps (forward, backward, AdamW) of a Qwen2.5-0.5B-shaped model with
   random bf16 weights at CP=1, the same global batches under ``skrull`` and ``static`` (the
   ``auto`` attention backend: flash when a varlen kernel exists) and, when that is flash,
   ``skrull`` with the sdpa backend too, interleaved; median step time and tokens/s per run,
   for a Wikipedia-like and a ChatQA2-like global batch (the paper's length shares, lengths cut
   to the bucket).
   The measured steps of the ``auto`` runs also fit the cost model's compute constants
   (:func:`lightning_skrull.scheduling.fit_cost_model`: achieved FLOP/s and seconds per
   micro-batch; at CP=1 nothing is communicated), reported with each step's error under the fit.
3. **Memory.** Peak CUDA memory of one-sequence steps at three token counts is fitted with
   :func:`lightning_skrull.runtime.memory.fit_memory_model`; the fit's prediction for the largest
   micro-batch of the throughput steps is compared with their measured peak, and
   :func:`lightning_skrull.runtime.memory.choose_bucket_size` gives the bucket this GPU would hold.

4. **Chunked loss.** Peak memory per token of one-sequence steps, dense loss against chunked
   (:func:`check_chunked_loss`), the ``"auto"`` bucket of each and the analytical estimate.
5. **bf16 at CP>1.** One attention layer under autocast(bf16) at an emulated CP size, ``sdpa``
   against what ``"auto"`` picks (:func:`check_cp_bf16`).
6. **FSDP2 on one GPU.** A few ``bf16-mixed`` steps of ``SkrullFSDPStrategy`` through a
   Lightning Trainer, peak memory against the analytical model states (:func:`check_fsdp`).
7. **Fused loss kernels.** Which of Liger Kernel and Cut Cross-Entropy are importable and what
   the loss kernel ``"auto"`` picks; each installed one against the float64 dense loss (loss and
   gradients under autocast(bf16), within twice the chunked path's distance plus one bf16
   rounding), and forward + backward time and peak memory of the dense loss, the chunked path
   and each installed kernel at Qwen2.5's head (4096 tokens, :func:`check_fused_kernels`). The
   fused kernels are tested only when their packages are importable
   (``pip install "lightning-skrull[fused]"`` for Liger Kernel, ``pip install
   cut-cross-entropy`` for the other); one that is not is reported, not failed.
8. **Host overhead.** Forward and backward of small micro-batches (1 x 128 up to 64 x 4
   tokens, so the fixed cost dominates) through the plain HF model and through the package's
   path at CP=1 (``sdpa``, and ``flash`` when ``"auto"`` picks it): host ms (wall time to
   backward's return, unsynchronised), Skrull's own host ms (its minus plain HF's), summed
   kernel ms from ``torch.profiler`` and synchronised wall ms per micro-batch, against the goal
   of 10 ms host time at Qwen2.5-0.5B's shape; then the Skrull path with compiled decoder
   layers when the deadline leaves time for a first compile (:func:`check_host_overhead`).

A check that raises is reported as an error (the run fails) and the others still run.
``--device cpu --tiny`` runs every code path with a tiny model on CPU in seconds (the memory
check needs CUDA and reports ``n/a``, the fused kernels "needs CUDA"); the test suite runs it
that way. A deadline (``--budget-s``) stops the throughput loop early rather than overrunning;
what ran is reported.

Usage::

    bash benchmarks/gpu_check.sh                      # JSON to $OUT/gpu_check.json or benchmarks/out/
    python -m benchmarks.gpu_check --device cpu --tiny --json /tmp/gpu_check.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback

from benchmarks.lengths import dataset, sample_lengths

QWEN2_5_0_5B: dict[str, Any] = {
    "vocab_size": 151_936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 32_768,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "use_cache": False,
}
"""Qwen2.5-0.5B's shape (random weights; nothing is downloaded)."""

TINY: dict[str, Any] = {
    **QWEN2_5_0_5B,
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
}
"""A model for running every code path on CPU in seconds."""

POLICIES = ("skrull", "static")
SECTIONS = (
    "backends",
    "throughput",
    "memory",
    "chunked_loss",
    "cp_bf16",
    "fsdp",
    "fused_kernels",
    "host_overhead",
)
"""The report's checks, in the order they run."""
RESERVED_S = {
    "memory": 45.0,
    "chunked_loss": 45.0,
    "cp_bf16": 30.0,
    "fsdp": 75.0,
    "fused_kernels": 30.0,
    "host_overhead": 40.0,
}
"""Seconds of ``--budget-s`` kept on a GPU for the checks after the throughput loop (which
stops early to leave them); a check starts only with half its share left."""
SDPA_RUN = "skrull+sdpa"
"""The throughput run of ``skrull`` with the sdpa backend, when ``auto`` picks flash."""

# bf16 keeps 8 mantissa bits: two correct kernels that sum in different orders differ by a few
# bf16 ulps of values of order 1 (measured up to ~1e-2 on attention outputs of flash-attn vs
# PyTorch's kernels). The loss is a mean over thousands of tokens, so it agrees more closely.
BF16_ATOL = 3e-2
BF16_LOSS_RTOL = 1e-2
# float32 (the CPU run): the packed computation sums the same terms in another order.
FP32_LOSS_RTOL = 1e-5


@dataclass(frozen=True)
class Settings:
    """Sizes of one run."""

    model: dict[str, Any]
    dtype: torch.dtype
    bucket_size: int
    batch_sizes: dict[str, int]
    steps: int
    scale: int  # lengths of the paper's table are divided by this


def settings(tiny: bool, device: torch.device, bucket: int | None, steps: int) -> Settings:
    """Sizes for the device: the paper's bucket (26K for 0.5B on 80 GB) scaled to its memory."""
    if tiny:
        return Settings(TINY, torch.float32, bucket or 256, {"Wikipedia": 8, "ChatQA2-Long-SFT": 4},
                        min(steps, 2), 128)  # fmt: skip
    if bucket is None:
        total = (
            torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
        )
        bucket = max(2048, min(26_000, int(26_000 * total / 80e9)) // 128 * 128)
    return Settings(QWEN2_5_0_5B, torch.bfloat16, bucket, {"Wikipedia": 64, "ChatQA2-Long-SFT": 8},
                    steps, 1)  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(
    make_input: Callable[[int], Any], run: Callable[[Any], Any], device: torch.device, reps: int
) -> float:
    """Median seconds of ``run(make_input(rep))`` over ``reps`` repetitions after one warm-up
    (``rep`` 0); the input is new every repetition and made outside the timing."""
    times = []
    for rep in range(reps + 1):
        arg = make_input(rep)
        _sync(device)
        start = time.perf_counter()
        run(arg)
        _sync(device)
        if rep:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _model(config: dict[str, Any], dtype: torch.dtype, device: torch.device, attn: str) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(**config, attn_implementation=attn)
    return Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype)


# --------------------------------------------------------------------------- 1. backends
def check_backends(s: Settings, device: torch.device) -> dict[str, Any]:
    """Flash vs SDPA on the same layout, and the Skrull model loss vs plain HF."""
    from lightning_skrull.attention import SkrullAttentionContext, build_rank_layout
    from lightning_skrull.attention.backends import flash_kernel
    from lightning_skrull.data.collate import collate_rank
    from lightning_skrull.models import prepare_model
    from lightning_skrull.runtime.engine import micro_batch_context
    from lightning_skrull.scheduling import DISTRIBUTED, GlobalBatchPlan, MicroBatchPlan

    rng = random.Random(0)
    lengths = [rng.randint(2, s.bucket_size // 4) for _ in range(6)]
    # Half local, half on the distributed path (at CP=1 a distributed sequence runs as its two
    # zigzag chunks, the second against the gathered prefix: the code path CP>1 uses).
    placement = tuple(0 if i % 2 else DISTRIBUTED for i in range(len(lengths)))
    mb = MicroBatchPlan(tuple(range(len(lengths))), placement)
    plan = GlobalBatchPlan(
        ((mb,),), dp_size=1, cp_size=1, bucket_size=sum(lengths), policy="skrull"
    )
    out: dict[str, Any] = {"lengths": lengths, "flash_kernel": flash_kernel()}
    flash = device.type == "cuda" and out["flash_kernel"] is not None
    if flash:
        from lightning_skrull.attention.flash import flash_attention
        from lightning_skrull.attention.sdpa import sdpa_attention

        layout = build_rank_layout(
            mb.sequence_ids, mb.placement, lengths, cp_rank=0, cp_size=1, kv_groups=mb.kv_groups
        )
        heads, kv_heads = s.model["num_attention_heads"], s.model["num_key_value_heads"]
        dim = s.model["head_dim"]
        g = torch.Generator(device=device).manual_seed(0)
        t = layout.num_tokens

        def rand(h: int) -> torch.Tensor:
            x = torch.randn((t, h, dim), generator=g, device=device, dtype=torch.bfloat16)
            return x.requires_grad_()

        q, k, v = rand(heads), rand(kv_heads), rand(kv_heads)
        results = {}
        for name, fn in (("flash", flash_attention), ("sdpa", sdpa_attention)):
            ctx = SkrullAttentionContext.build(layout, group=None, backend=name, device=device)
            o = fn(q, k, v, ctx)
            grads = torch.autograd.grad(o.float().square().sum(), (q, k, v))
            results[name] = (o.detach(), grads)
        diff = (results["flash"][0].float() - results["sdpa"][0].float()).abs().max().item()
        gdiff = max(
            ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()
            for a, b in zip(results["flash"][1], results["sdpa"][1])
        )
        out["flash_vs_sdpa_max_abs_diff"] = diff
        out["flash_vs_sdpa_max_rel_grad_diff"] = gdiff
        out["flash_vs_sdpa_ok"] = diff <= BF16_ATOL and gdiff <= BF16_ATOL
    else:
        out["flash_vs_sdpa_ok"] = None
        out["flash_vs_sdpa_skipped"] = (
            "no varlen kernel installed" if device.type == "cuda" else "flash needs CUDA"
        )
    # The Skrull model (each backend) against the plain HF model, one sequence at a time.
    g = torch.Generator().manual_seed(1)
    vocab = s.model["vocab_size"]
    samples = [{"input_ids": torch.randint(0, vocab, (n,), generator=g).tolist()} for n in lengths]
    plain = _model(s.model, s.dtype, device, "sdpa")
    with torch.no_grad():
        total = sum(
            plain(input_ids=ids, labels=ids).loss.float() * (ids.shape[1] - 1)
            for ids in (torch.tensor(x["input_ids"], device=device)[None] for x in samples)
        )
    reference = float(total) / sum(n - 1 for n in lengths)
    batch = collate_rank(samples, plan, dp_rank=0, cp_rank=0, world_size=1).to(device)
    rtol = BF16_LOSS_RTOL if s.dtype == torch.bfloat16 else FP32_LOSS_RTOL
    out["reference_loss"] = reference
    for backend in ("sdpa", "flash") if flash else ("sdpa",):
        model = prepare_model(_model(s.model, s.dtype, device, "sdpa"), backend=backend)
        with torch.no_grad(), micro_batch_context(batch.micro_batches[0], None, backend):
            loss = float(model(**batch.micro_batches[0].inputs).loss)
        out[f"{backend}_loss"] = loss
        out[f"{backend}_loss_ok"] = abs(loss - reference) <= rtol * abs(reference)
    return out


# --------------------------------------------------------------------------- 2. throughput
def check_throughput(s: Settings, device: torch.device, deadline: float) -> dict[str, Any]:
    """Median step time and tokens/s of ``skrull`` and ``static`` (``auto`` backend) and, when
    that is flash, of ``skrull`` with the sdpa backend, at CP=1, interleaved."""
    from lightning_skrull.data.collate import tokens_per_cp_rank
    from lightning_skrull.models import prepare_model
    from lightning_skrull.runtime.engine import train_step
    from lightning_skrull.runtime.process_groups import ParallelLayout
    from lightning_skrull.scheduling import CostModel

    layout = ParallelLayout(rank=0, world_size=1, dp_size=1, cp_size=1, dp_rank=0, cp_rank=0)
    model = prepare_model(_model(s.model, s.dtype, device, "sdpa"), backend="auto")
    cost_model = CostModel.from_hf_config(model.config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    rng = random.Random(0)
    vocab = s.model["vocab_size"]
    from lightning_skrull.attention import resolve_backend
    from lightning_skrull.attention.backends import flash_kernel

    backend = resolve_backend("auto", device)
    runs = {p: (p, backend) for p in POLICIES}
    if backend == "flash":
        runs[SDPA_RUN] = ("skrull", "sdpa")
    out: dict[str, Any] = {
        "bucket_size": s.bucket_size,
        "attention_backend": backend,
        "flash_kernel": flash_kernel() if backend == "flash" else None,
        "datasets": {},
    }
    peak = 0
    peak_tokens = 0
    fit_samples: list[tuple[Any, list[int], float]] = []  # (plan, lengths, seconds)
    for name, size in s.batch_sizes.items():
        batches = []
        for _ in range(1 + s.steps):  # the first is a warm-up
            lengths = sample_lengths(dataset(name), size, s.bucket_size, rng, scale=s.scale)
            batches.append(
                [{"input_ids": [rng.randrange(vocab) for _ in range(n)]} for n in lengths]
            )
        times: dict[str, list[float]] = {r: [] for r in runs}
        tokens: dict[str, list[int]] = {r: [] for r in runs}
        skipped = 0
        order = list(runs)
        for k, samples in enumerate(batches):
            for run in order[k % len(order) :] + order[: k % len(order)]:  # rotate the order
                policy, backend = runs[run]
                if time.monotonic() > deadline:
                    skipped += 1
                    continue
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                _sync(device)
                t = time.perf_counter()
                result = train_step(
                    model,
                    optimizer,
                    samples,
                    layout=layout,
                    bucket_size=s.bucket_size,
                    policy=policy,
                    cost_model=cost_model,
                    backend=backend,
                    verify_plan=False,
                )
                _sync(device)
                elapsed = time.perf_counter() - t
                lengths = [len(x["input_ids"]) for x in samples]
                most = max(
                    tokens_per_cp_rank(mb, lengths, 1)[0] for mb in result.plan.micro_batches[0]
                )
                if device.type == "cuda" and k > 0:
                    step_peak = torch.cuda.max_memory_allocated(device)
                    if step_peak > peak:
                        peak, peak_tokens = step_peak, most
                if k > 0:
                    times[run].append(elapsed)
                    tokens[run].append(sum(lengths))
                    if run in POLICIES:  # the "auto" backend's steps
                        fit_samples.append((result.plan, lengths, elapsed))
        cell: dict[str, Any] = {"global_batch": size, "skipped_steps": skipped}
        for run in runs:
            if times[run]:
                rates = [n / t for n, t in zip(tokens[run], times[run])]
                cell[run] = {
                    "steps": len(times[run]),
                    "median_step_s": statistics.median(times[run]),
                    "median_tokens_per_s": statistics.median(rates),
                    "tokens_per_step": statistics.median(tokens[run]),
                }
        if all(p in cell for p in POLICIES):
            cell["skrull_speedup"] = (
                cell["static"]["median_step_s"] / cell["skrull"]["median_step_s"]
            )
        if "skrull" in cell and SDPA_RUN in cell:
            cell["flash_speedup"] = (
                cell[SDPA_RUN]["median_step_s"] / cell["skrull"]["median_step_s"]
            )
        out["datasets"][name] = cell
    out["cost_model_fit"] = fit_constants(cost_model, fit_samples)
    out["peak_bytes"] = peak or None
    out["peak_micro_batch_tokens"] = peak_tokens or None
    del model, optimizer
    return out


def fit_constants(model: Any, samples: list[tuple[Any, list[int], float]]) -> dict[str, Any]:
    """The cost model's constants fitted to measured steps, and each step's relative error.

    The measured step includes the optimizer step, which the model does not: it shows up in
    the fitted seconds per micro-batch.
    """
    from lightning_skrull.scheduling import fit_cost_model, simulate

    if len(samples) < 2:
        return {"skipped": f"{len(samples)} measured steps; the fit needs 2"}
    fitted = fit_cost_model(model, samples)
    errors = [simulate(p, lengths, fitted) / t - 1.0 for p, lengths, t in samples]
    return {
        "steps": len(samples),
        "achieved_flops": fitted.achieved_flops,
        "micro_batch_overhead_s": fitted.micro_batch_overhead_s,
        "default_achieved_flops": model.achieved_flops,
        "default_micro_batch_overhead_s": model.micro_batch_overhead_s,
        "relative_errors": errors,
        "max_abs_relative_error": max(abs(e) for e in errors),
    }


# --------------------------------------------------------------------------- 3. memory
def check_memory(s: Settings, device: torch.device, throughput: dict[str, Any]) -> dict[str, Any]:
    """Fit peak memory against tokens and compare with the throughput steps' peak."""
    from lightning_skrull.models import prepare_model
    from lightning_skrull.runtime.engine import train_step
    from lightning_skrull.runtime.memory import (
        choose_bucket_size,
        fit_memory_model,
        probe_peak_memory,
    )
    from lightning_skrull.runtime.process_groups import ParallelLayout

    if device.type != "cuda":
        return {"skipped": "peak memory is measured on CUDA only"}
    layout = ParallelLayout(rank=0, world_size=1, dp_size=1, cp_size=1, dp_rank=0, cp_rank=0)
    model = prepare_model(_model(s.model, s.dtype, device, "sdpa"), backend="auto")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    vocab = s.model["vocab_size"]

    def run(tokens: int) -> None:
        sample = {"input_ids": torch.randint(0, vocab, (tokens,)).tolist()}
        train_step(model, optimizer, [sample], layout=layout, bucket_size=s.bucket_size)

    run(s.bucket_size // 8)  # optimizer state exists from here on, as in the measured steps
    probes = [s.bucket_size // 4, s.bucket_size // 2, 3 * s.bucket_size // 4]
    peaks = probe_peak_memory(run, probes, device=device)
    fit = fit_memory_model(probes, peaks)
    capacity = torch.cuda.get_device_properties(device).total_memory
    out: dict[str, Any] = {
        "probe_tokens": probes,
        "probe_peak_bytes": peaks,
        "alpha_bytes_per_token": fit.alpha,
        "beta_bytes": fit.beta,
        "fit_max_relative_error": fit.max_relative_error,
        "predicted_at_bucket_bytes": fit.predict(s.bucket_size),
        "device_bytes": capacity,
    }
    try:
        out["largest_bucket_for_device"] = choose_bucket_size(fit, capacity)
    except ValueError as err:
        out["largest_bucket_for_device"] = None
        out["bucket_error"] = str(err)
    measured, tokens = throughput.get("peak_bytes"), throughput.get("peak_micro_batch_tokens")
    if measured and tokens:
        predicted = fit.predict(tokens)
        out["throughput_peak_bytes"] = measured
        out["throughput_peak_tokens"] = tokens
        out["predicted_for_those_tokens_bytes"] = predicted
        out["prediction_error"] = (predicted - measured) / measured
    return out


# --------------------------------------------------------------------------- 4. chunked loss
def check_chunked_loss(s: Settings, device: torch.device, deadline: float) -> dict[str, Any]:
    """Peak memory per token of one-sequence steps with the dense loss and the chunked one.

    One model, prepared twice (``chunked_loss=False``, then ``True``: preparing again swaps the
    loss), the same AdamW; each line is probed at ``bucket_size="auto"``'s token counts, fitted
    with :func:`~lightning_skrull.runtime.memory.fit_memory_model` and turned into the bucket
    ``"auto"`` would choose; the analytical per-token estimate of
    :mod:`benchmarks.memory_estimate` stands beside each fitted slope.
    """
    from benchmarks.memory_estimate import activation_bytes_per_token
    from lightning_skrull.models import prepare_model
    from lightning_skrull.models.loss_kernels import resolve_loss_kernel
    from lightning_skrull.runtime.engine import train_step
    from lightning_skrull.runtime.memory import (
        AUTO_PROBE_TOKENS,
        AUTO_SAFETY_MARGIN,
        choose_bucket_size,
        fit_memory_model,
        probe_peak_memory,
    )
    from lightning_skrull.runtime.process_groups import ParallelLayout

    cuda = device.type == "cuda"
    probes = list(AUTO_PROBE_TOKENS) if cuda else [16, 32]
    element = torch.finfo(s.dtype).bits // 8
    layout = ParallelLayout(rank=0, world_size=1, dp_size=1, cp_size=1, dp_rank=0, cp_rank=0)
    model = _model(s.model, s.dtype, device, "sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    vocab = s.model["vocab_size"]
    out: dict[str, Any] = {
        "probe_tokens": probes,
        "loss_kernel": resolve_loss_kernel("auto", device.type, s.dtype),
        "bytes_per_element": element,
        "lines": {},
    }
    if cuda:
        out["device_bytes"] = torch.cuda.get_device_properties(device).total_memory

    def run(tokens: int) -> None:
        sample = {"input_ids": torch.randint(0, vocab, (tokens,)).tolist()}
        train_step(model, optimizer, [sample], layout=layout, bucket_size=max(probes),
                   verify_plan=False)  # fmt: skip

    for name, chunked in (("dense", False), ("chunked", True)):
        estimate = activation_bytes_per_token(
            model.config, chunked_loss=chunked, bytes_per_element=element
        )
        line: dict[str, Any] = {
            "chunked_loss": chunked,
            "estimate_bytes_per_token": estimate.total,
            "estimate_layers_bytes_per_token": estimate.layers,
            "estimate_head_bytes_per_token": estimate.head,
        }
        out["lines"][name] = line
        if time.monotonic() > deadline:
            line["skipped"] = "deadline"
            continue
        prepare_model(model, backend="auto", chunked_loss=chunked)
        run(probes[0])  # warm-up: optimizer state exists from here on
        if not cuda:
            for tokens in probes:
                run(tokens)
            line["probe_peak_bytes"] = "n/a (peak memory is measured on CUDA only)"
            continue
        peaks = probe_peak_memory(run, probes, device=device)
        fit = fit_memory_model(probes, peaks)
        line.update(
            probe_peak_bytes=peaks,
            alpha_bytes_per_token=fit.alpha,
            beta_bytes=fit.beta,
            fit_max_relative_error=fit.max_relative_error,
            measured_over_estimate=fit.alpha / estimate.total,
        )
        try:
            line["auto_bucket"] = choose_bucket_size(
                fit, out["device_bytes"], safety_margin=AUTO_SAFETY_MARGIN
            )
        except ValueError as err:
            line["auto_bucket"] = None
            line["bucket_error"] = str(err)
    lines = out["lines"]
    if all("alpha_bytes_per_token" in lines[k] for k in ("dense", "chunked")):
        out["alpha_ratio_dense_over_chunked"] = (
            lines["dense"]["alpha_bytes_per_token"] / lines["chunked"]["alpha_bytes_per_token"]
        )
        if lines["dense"].get("auto_bucket") and lines["chunked"].get("auto_bucket"):
            out["auto_bucket_gain"] = (
                lines["chunked"]["auto_bucket"] / lines["dense"]["auto_bucket"]
            )
    return out


# --------------------------------------------------------------------------- 5. bf16 at CP>1
def _emulated_context(layout: Any, backend: str, device: torch.device, auto: bool) -> Any:
    """A rank's attention context without a process group (the ranks run in this process)."""
    from lightning_skrull.attention import SkrullAttentionContext

    return SkrullAttentionContext._make(layout, None, backend, device, auto)


def check_cp_bf16(s: Settings, device: torch.device, deadline: float) -> dict[str, Any]:
    """Tokens/s of one attention layer under ``torch.autocast(bfloat16)`` at an emulated CP
    size: ``sdpa`` (before) against the backend ``"auto"`` resolves to (after: flash on CUDA
    with a varlen kernel).

    The ranks of a CP group run one after another in this process, as the attention tests
    emulate them: each rank's distributed chunks attend the whole sequences' K/V directly (what
    the all-gather delivers), so no collective is timed. The inputs are what a layer sees under
    ``precision="bf16-mixed"``: q and k float32 (the rotary embedding multiplies by float32
    cos/sin), v bf16, cast to :func:`~lightning_skrull.attention.dispatch.compute_dtype`
    (bf16 under autocast) as the dispatch does. The global batch is a ChatQA2-like one planned
    with ``skrull`` at that CP size.
    """
    from lightning_skrull.attention import build_rank_layouts, pack, resolve_backend
    from lightning_skrull.attention import flash as flash_backend
    from lightning_skrull.attention import sdpa as sdpa_backend
    from lightning_skrull.attention.dispatch import compute_dtype
    from lightning_skrull.scheduling import CostModel, plan_global_batch

    cp = 2 if s.scale > 1 else 4
    reps = 1 if s.scale > 1 else 3
    heads, kv_heads = s.model["num_attention_heads"], s.model["num_key_value_heads"]
    dim = s.model["head_dim"]
    rng = random.Random(0)
    size = 8
    lengths = sample_lengths(dataset("ChatQA2-Long-SFT"), size, cp * s.bucket_size, rng,
                             scale=s.scale)  # fmt: skip
    from transformers import Qwen2Config

    cost_model = CostModel.from_hf_config(Qwen2Config(**s.model))
    plan = plan_global_batch(lengths, dp_size=1, cp_size=cp, bucket_size=s.bucket_size,
                             cost_model=cost_model, policy="skrull")  # fmt: skip
    micro_batches = plan.micro_batches[0]
    auto = resolve_backend("auto", device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        probe = torch.zeros(1, device=device)
        dtype = compute_dtype(probe, probe, probe.to(torch.bfloat16))
    after = auto if dtype in (torch.float16, torch.bfloat16) else "sdpa"
    modules = {"sdpa": sdpa_backend, "flash": flash_backend}
    out: dict[str, Any] = {
        "cp_size": cp,
        "lengths": lengths,
        "micro_batches": len(micro_batches),
        "distributed_sequences": sum(p < 0 for mb in micro_batches for p in mb.placement),
        "compute_dtype": str(dtype),
        "auto_backend": after,
        "runs": {},
    }
    g = torch.Generator(device=device).manual_seed(0)

    def inputs(mb: Any, rep: int) -> tuple[list[Any], dict[int, tuple[torch.Tensor, ...]]]:
        lens = [n + rep for n in lengths]  # new shapes every repetition, as training has
        layouts = build_rank_layouts(mb.sequence_ids, mb.placement, lens, cp_size=cp)
        seqs = {}
        for sid in mb.sequence_ids:
            n = lens[sid]
            q = torch.randn(n, heads, dim, generator=g, device=device).requires_grad_()
            k = torch.randn(n, kv_heads, dim, generator=g, device=device).requires_grad_()
            v = torch.randn(n, kv_heads, dim, generator=g, device=device, dtype=torch.bfloat16)
            seqs[sid] = (q, k, v.requires_grad_())
        return layouts, seqs

    def rank_step(module: Any, backend: str, layouts: list[Any], rank: int,
                  seqs: dict[int, tuple[torch.Tensor, ...]]) -> torch.Tensor:  # fmt: skip
        layout = layouts[rank]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            ctx = _emulated_context(layout, backend, device, auto=True)
            q, k, v = (pack(layout, {i: t[j] for i, t in seqs.items()}) for j in range(3))
            cd = compute_dtype(q, k, v)
            q, k, v = q.to(cd), k.to(cd), v.to(cd)
            n = layout.num_local_tokens
            parts = []
            if n:
                parts.append(module.local_attention(q[:n], k[:n], v[:n], ctx))
            if layout.distributed_chunks:
                ids = layouts[0].distributed_sequence_ids
                k_whole = torch.cat([seqs[i][1] for i in ids]).to(cd)
                v_whole = torch.cat([seqs[i][2] for i in ids]).to(cd)
                parts.append(module.distributed_attention(q[n:], k_whole, v_whole, ctx))
            o = torch.cat(parts) if parts else q[:0]
        return o

    runs = {"before (sdpa)": "sdpa", f"after (auto: {after})": after}
    totals = {label: {"seconds": 0.0, "slowest": 0.0, "tokens": 0, "done": 0} for label in runs}
    # The two backends on the same inputs: the outputs of the first micro-batch's ranks.
    layouts, seqs = inputs(micro_batches[0], 0)
    with torch.no_grad():
        outputs = [
            torch.cat([rank_step(modules[b], b, layouts, r, seqs).float() for r in range(cp)])
            for b in dict.fromkeys(runs.values())
        ]
    del layouts, seqs
    diff = (outputs[0] - outputs[-1]).abs().max().item()
    out["max_abs_diff"] = diff
    out["outputs_agree"] = diff <= BF16_ATOL
    del outputs
    # Micro-batch by micro-batch, both backends in turn, so a deadline leaves both with the same
    # micro-batches timed.
    for mb in micro_batches:
        if time.monotonic() > deadline:
            break
        for k, (label, backend) in enumerate(runs.items()):
            rank_seconds = []
            for rank in range(cp):

                def make(rep: int, mb: Any = mb, shift: int = k * (reps + 1)) -> Any:
                    return inputs(mb, rep + shift)  # shapes no other call has seen

                def step(arg: Any, backend: str = backend, rank: int = rank) -> None:
                    o = rank_step(modules[backend], backend, arg[0], rank, arg[1])
                    o.float().square().mean().backward()

                rank_seconds.append(median_seconds(make, step, device, reps))
            t = totals[label]
            t["seconds"] += sum(rank_seconds)
            t["slowest"] += max(rank_seconds)  # the ranks' attention when they run in parallel
            t["tokens"] += sum(lengths[sid] for sid in mb.sequence_ids)
            t["done"] += 1
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for label, backend in runs.items():
        t = totals[label]
        cell: dict[str, Any] = {"backend": backend, "micro_batches_timed": t["done"]}
        if t["done"]:
            cell.update(
                tokens=t["tokens"],
                rank_seconds_total=t["seconds"],
                tokens_per_s_per_gpu=t["tokens"] / t["seconds"],
                parallel_step_seconds=t["slowest"],
                tokens_per_s_cp_group=t["tokens"] / t["slowest"],
            )
        out["runs"][label] = cell
    before, after_cell = (out["runs"][label] for label in runs)
    if "rank_seconds_total" in before:
        out["speedup"] = before["rank_seconds_total"] / after_cell["rank_seconds_total"]
    return out


# --------------------------------------------------------------------------- 6. FSDP smoke
class _WorldOfOne:
    """A one-process run of a Lightning strategy that needs ``torch.distributed``: Lightning
    initialises the process group (gloo on CPU, NCCL on CUDA) itself; this removes it and the
    environment variables it set afterwards, so later checks (and a test process) are not left
    with a process group they did not make."""

    def __enter__(self) -> _WorldOfOne:
        import torch.distributed as dist

        self.had_group = dist.is_available() and dist.is_initialized()
        self.environ = dict(os.environ)
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        if not self.had_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(self.environ)


def check_fsdp(s: Settings, device: torch.device, deadline: float) -> dict[str, Any]:
    """A few training steps through ``SkrullFSDPStrategy`` on one device and a real Trainer
    (``precision="bf16-mixed"``, ``attention_backend="auto"``, the chunked loss), its peak
    memory, and the analytical estimate of what the rank holds."""
    import lightning.pytorch as pl

    from benchmarks.memory_estimate import (
        activation_bytes_per_token,
        model_state_bytes,
        parameter_count,
    )
    from lightning_skrull import SkrullDataModule, SkrullFSDPStrategy
    from lightning_skrull.attention import resolve_backend
    from lightning_skrull.models.loss_kernels import resolve_loss_kernel
    from lightning_skrull.scheduling import CostModel

    cuda = device.type == "cuda"
    steps, global_batch = 3, 4
    rng = random.Random(0)
    vocab = s.model["vocab_size"]
    lengths = sample_lengths(dataset("ChatQA2-Long-SFT"), global_batch * steps, s.bucket_size,
                             rng, scale=s.scale)  # fmt: skip
    data = [{"input_ids": [rng.randrange(vocab) for _ in range(n)]} for n in lengths]
    timer = _StepTimer(device, deadline)

    class SmokeLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model(s.model, torch.float32, torch.device("cpu"), "sdpa")

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            return self.model(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-5)

    module = SmokeLM()
    shape = CostModel.from_hf_config(module.model.config).shape
    tied = bool(s.model.get("tie_word_embeddings"))
    params = sum(p.numel() for p in module.model.parameters())
    strategy = SkrullFSDPStrategy(
        cp_size=1, bucket_size=s.bucket_size, attention_backend="auto", calibration="off",
        log_stats=False,
    )  # fmt: skip
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    with _WorldOfOne():
        trainer = pl.Trainer(
            accelerator="cuda" if cuda else "cpu",
            devices=[device.index or 0] if cuda else 1,
            strategy=strategy,
            precision="bf16-mixed",
            max_steps=steps,
            callbacks=[timer],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        datamodule = SkrullDataModule(train_data=data, global_batch_size=global_batch,
                                      shuffle=False)  # fmt: skip
        trainer.fit(module, datamodule)
        mesh = tuple(strategy._device_mesh.shape)
    # The strategy table's shapes have untied heads; a tied head is one tensor: 16 B (float32
    # parameter, gradient, two moments) and 2 B (its gathered bf16 copy) fewer per parameter.
    untied = dataclasses.replace(shape, tied_embeddings=False)
    states = model_state_bytes(untied, "fsdp_cp", cp_size=1, world_size=1)
    count = parameter_count(shape, tied_head=tied)
    untied_extra = parameter_count(untied).total - count.total
    tokens = max(timer.micro_batch_tokens, default=0)
    per_token = activation_bytes_per_token(shape, chunked_loss=True).total
    out: dict[str, Any] = {
        "precision": "bf16-mixed",
        "attention_backend": resolve_backend("auto", device),
        "loss_kernel": resolve_loss_kernel("auto", device.type, torch.bfloat16),
        "mesh": list(mesh),
        "steps": trainer.global_step,
        "losses": timer.losses,
        "parameters": params,
        "parameter_count_matches": count.total == params,
        "estimate_model_state_bytes": states.total,
        "estimate_model_state": {
            "parameters": states.parameters,
            "gradients": states.gradients,
            "optimizer": states.optimizer,
            "transient": states.transient,
        },
        "tied_head": tied,
        "estimate_model_state_bytes_tied": states.total - 18 * untied_extra,
        "largest_micro_batch_tokens": tokens,
        "estimate_activation_bytes": per_token * tokens,
        "estimate_peak_bytes": states.total - 18 * untied_extra + per_token * tokens,
    }
    if len(timer.seconds) > 1:  # the first step warms up
        out["median_step_s"] = statistics.median(timer.seconds[1:])
        out["median_tokens_per_s"] = statistics.median(
            n / t for n, t in zip(timer.tokens[1:], timer.seconds[1:])
        )
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
        out["peak_bytes"] = peak
        out["estimate_over_measured"] = out["estimate_peak_bytes"] / peak
    else:
        out["peak_bytes"] = "n/a (peak memory is measured on CUDA only)"
    out["ok"] = trainer.global_step == steps and all(math.isfinite(x) for x in timer.losses)
    return out


class _StepTimer(Callback):
    """Times each training step (synchronised), records its tokens and loss; stops the fit at
    the deadline."""

    def __init__(self, device: torch.device, deadline: float) -> None:
        super().__init__()
        self.device, self.deadline = device, deadline
        self.seconds: list[float] = []
        self.tokens: list[int] = []
        self.losses: list[float] = []
        self.micro_batch_tokens: list[int] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
        _sync(self.device)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                           index: int) -> None:  # fmt: skip
        _sync(self.device)
        self.seconds.append(time.perf_counter() - self._start)
        mbs = batch.rank_batch.micro_batches
        self.tokens.append(sum(int(mb.inputs["input_ids"].numel()) for mb in mbs))
        self.micro_batch_tokens.extend(int(mb.inputs["input_ids"].numel()) for mb in mbs)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))
        if time.monotonic() > self.deadline:
            trainer.should_stop = True


# --------------------------------------------------------------------------- 7. fused kernels
FUSED_LOSS_TOKENS = 4096
"""Tokens of the fused-kernel check on a GPU (at Qwen2.5-0.5B's vocabulary and hidden size): a
micro-batch's worth, so the float64 reference's ``[tokens, vocab]`` logits (5 GB) still fit."""
FUSED_WEIGHT_STD = 0.05
"""Standard deviation of the check's random head: logits of standard deviation about 1.5 at
hidden size 896 (unit hidden states), a softmax neither flat nor one-hot."""
BF16_ROUNDING = 2.0**-8
"""One bf16 rounding, relative (8 significant bits)."""
CHUNKED_LOSS_RTOL = BF16_ROUNDING
CHUNKED_GRAD_RTOL = 2.0**-6
"""How far from float64 the chunked path may be before the fused kernels' tolerance (twice its
distance) means nothing: its loss within one bf16 rounding (a mean of float32 log-sum-exps of
bf16 logits), its gradients within four (norm-relative; the logits' gradient is rounded to bf16
before both matmuls)."""


def _relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    """``||got - reference|| / ||reference||`` in float64 (Frobenius norms)."""
    diff = torch.linalg.vector_norm(got.double() - reference)
    return float(diff / torch.linalg.vector_norm(reference).clamp_min(1e-300))


def _loss_case(
    tokens: int, vocab: int, hidden_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random float32 hidden states ``[tokens, H]``, head ``[V, H]`` and targets with ``-100``
    on a prompt (the first eighth) and on every fifth position after it."""
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=g, device=device)
    weight = torch.randn(vocab, hidden_size, generator=g, device=device) * FUSED_WEIGHT_STD
    target = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    target[: tokens // 8] = -100
    target[::5] = -100
    return hidden, weight, target


def _bf16_loss_and_grads(
    kernel: str, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Loss and gradients of float32 leaves under ``autocast(bfloat16)``, as ``bf16-mixed``."""
    from lightning_skrull.models.loss_kernels import linear_cross_entropy

    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, target, kernel=kernel)
    loss.backward()
    assert h.grad is not None and w.grad is not None
    return float(loss.detach()), h.grad, w.grad


def _distances(
    kernel: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ref_loss: float,
    ref_grads: tuple[torch.Tensor, torch.Tensor],
) -> dict[str, Any]:
    """A kernel's bf16 loss and its distances from the float64 reference."""
    loss, grad_h, grad_w = _bf16_loss_and_grads(kernel, hidden, weight, target)
    return {
        "loss": loss,
        "loss_abs_err": abs(loss - ref_loss),
        "grad_hidden_rel_err": _relative_error(grad_h, ref_grads[0]),
        "grad_weight_rel_err": _relative_error(grad_w, ref_grads[1]),
    }


def judge_fused_kernel(
    kernel: dict[str, Any], chunked: dict[str, Any], ref_loss: float
) -> dict[str, Any]:
    """The tolerances of a fused kernel's distances from float64 (:func:`_distances`) and
    whether it is within them: its loss within twice the chunked path's distance plus one bf16
    rounding of the loss, each gradient (norm-relative) within twice the chunked path's plus one
    bf16 rounding."""
    out: dict[str, Any] = {
        "loss_tolerance": 2 * chunked["loss_abs_err"] + BF16_ROUNDING * abs(ref_loss)
    }
    for grad in ("grad_hidden", "grad_weight"):
        out[f"{grad}_tolerance"] = 2 * chunked[f"{grad}_rel_err"] + BF16_ROUNDING
    out["ok"] = (
        kernel["loss_abs_err"] <= out["loss_tolerance"]
        and kernel["grad_hidden_rel_err"] <= out["grad_hidden_tolerance"]
        and kernel["grad_weight_rel_err"] <= out["grad_weight_tolerance"]
    )
    return out


def check_fused_kernels(
    s: Settings, device: torch.device, deadline: float, tokens: int | None = None
) -> dict[str, Any]:
    """The optional fused loss kernels (Liger Kernel, Cut Cross-Entropy) against float64, and
    forward + backward time and peak memory of every loss path, at Qwen2.5's head.

    Reports which fused kernels are importable and what ``kernel="auto"`` resolves to in bf16
    here. Correctness, on CUDA for each installed kernel: the loss and the gradients of the
    hidden states and the head under ``autocast(bfloat16)`` (float32 leaves, as
    ``bf16-mixed``) against the dense loss in float64, within :func:`judge_fused_kernel`'s
    tolerances. The chunked path itself must be within
    :data:`CHUNKED_LOSS_RTOL` / :data:`CHUNKED_GRAD_RTOL`. Timing, for the dense loss
    (``F.cross_entropy`` of the bf16 logits in float32, as transformers' loss; the "before"),
    the chunked path and each installed kernel: bf16 leaves, forward + backward, synchronised,
    median after one warm-up, and on CUDA the peak memory above the inputs (the gradients
    included). On CPU the fused kernels report "needs CUDA" and the peaks ``n/a``.
    """
    import torch.nn.functional as F

    from lightning_skrull.models.loss_kernels import (
        FUSED_KERNEL_MODULES,
        installed_fused_kernels,
        linear_cross_entropy,
        resolve_loss_kernel,
    )

    cuda = device.type == "cuda"
    if tokens is None:
        tokens = FUSED_LOSS_TOKENS if s.scale == 1 else 256
    vocab, hidden_size = s.model["vocab_size"], s.model["hidden_size"]
    installed = installed_fused_kernels()
    reps = 5 if cuda else 2
    hidden, weight, target = _loss_case(tokens, vocab, hidden_size, device)
    out: dict[str, Any] = {
        "installed": list(installed),
        "compute_dtype": str(torch.bfloat16),
        "auto_kernel": resolve_loss_kernel("auto", device.type, torch.bfloat16),
        "tokens": tokens,
        "vocab": vocab,
        "hidden": hidden_size,
        "ignored_tokens": int((target == -100).sum()),
        "reps": reps,
        "kernels": {},
        "timing": {},
    }
    runnable: list[str] = []
    for name, module in FUSED_KERNEL_MODULES.items():
        if not cuda:
            out["kernels"][name] = {"installed": name in installed, "skipped": "needs CUDA"}
        elif name not in installed:
            out["kernels"][name] = {
                "installed": False,
                "skipped": f"not installed (no module {module!r})",
            }
        else:
            out["kernels"][name] = {"installed": True}
            runnable.append(name)

    # Correctness: float64 dense reference, then the chunked path, then each kernel.
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = F.cross_entropy(h64 @ w64.T, target, ignore_index=-100)
    ref.backward()
    ref_loss = float(ref.detach())
    assert h64.grad is not None and w64.grad is not None
    ref_grads = (h64.grad, w64.grad)
    del ref, h64, w64
    out["reference_loss"] = ref_loss

    case = (hidden, weight, target, ref_loss, ref_grads)
    chunked = out["chunked"] = _distances("chunked", *case)
    chunked["ok"] = (
        chunked["loss_abs_err"] <= CHUNKED_LOSS_RTOL * abs(ref_loss)
        and chunked["grad_hidden_rel_err"] <= CHUNKED_GRAD_RTOL
        and chunked["grad_weight_rel_err"] <= CHUNKED_GRAD_RTOL
    )
    for name in runnable:
        cell = out["kernels"][name]
        if time.monotonic() > deadline:
            cell["skipped"] = "deadline"
            continue
        cell.update(_distances(name, *case))
        cell.update(judge_fused_kernel(cell, chunked, ref_loss))
    del case, ref_grads
    if cuda:
        torch.cuda.empty_cache()

    # Time and peak memory of each path in bf16.
    h16 = hidden.to(torch.bfloat16).requires_grad_()
    w16 = weight.to(torch.bfloat16).requires_grad_()
    del hidden, weight

    def dense() -> torch.Tensor:
        logits = F.linear(h16, w16)
        return F.cross_entropy(logits.float(), target, ignore_index=-100)

    paths: dict[str, Callable[[], torch.Tensor]] = {"dense": dense}
    for name in ("chunked", *runnable):
        paths[name] = partial(linear_cross_entropy, h16, w16, target, kernel=name)

    def fresh(rep: int) -> None:
        h16.grad = w16.grad = None

    for name, loss_fn in paths.items():
        if time.monotonic() > deadline:
            out["timing"][name] = {"skipped": "deadline"}
            continue

        def step(arg: None, loss_fn: Callable[[], torch.Tensor] = loss_fn) -> None:
            loss_fn().backward()

        seconds = median_seconds(fresh, step, device, reps)
        cell = out["timing"][name] = {"ms": seconds * 1e3}
        if cuda:
            fresh(0)
            _sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            step(None)
            _sync(device)
            cell["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
        else:
            cell["peak_bytes"] = "n/a (peak memory is measured on CUDA only)"
    timed = out["timing"]
    if "ms" in timed.get("chunked", {}):
        for name, cell in timed.items():
            if "ms" in cell and name != "chunked":
                cell["time_over_chunked"] = cell["ms"] / timed["chunked"]["ms"]
                if cuda:
                    cell["peak_over_chunked"] = cell["peak_bytes"] / timed["chunked"]["peak_bytes"]
    out["ok"] = (
        chunked["ok"]
        and all(c.get("ok") is not False for c in out["kernels"].values())
        and _all_finite(out)
    )
    return out


# --------------------------------------------------------------------------- 8. host overhead
HOST_MICRO_BATCHES = ((1, 128), (4, 32), (16, 16), (64, 4))
"""The host-overhead check's micro-batches, ``(sequences, tokens each)``: few tokens, so the
fixed cost of a micro-batch dominates its time."""
HOST_GOAL_MS = 10.0
"""The goal for the Skrull path's host time per micro-batch at Qwen2.5-0.5B's shape."""
HOST_COMPILE_NEED_S = 60.0
"""Seconds before the deadline the compiled-layers run needs to start: the first compile of a
24-layer model's decoder layer takes tens of seconds."""
PLAIN_HF = "plain HF"
"""The host-overhead check's reference run."""


def kernel_ms(events: Iterable[Any]) -> float | None:
    """Summed device self time of the GPU activities (kernels, copies, fills) of a
    ``torch.profiler`` trace's events, in ms (the profiler table's "Self CUDA time total");
    ``None`` when the trace holds none (no CUDA, or the profiler could not record them)."""
    from torch.autograd import DeviceType

    times = [
        e.self_device_time_total
        for e in events
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    return sum(times) / 1e3 if times else None


def _profiled_kernel_ms(step: Callable[[], Any], device: torch.device) -> float | None:
    """Kernel ms of one ``step()`` under ``torch.profiler``; ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        _sync(device)
    return kernel_ms(prof.events())


def time_micro_batches(
    steps: dict[str, Callable[[], torch.Tensor]], device: torch.device, warmup: int, reps: int
) -> dict[str, dict[str, float]]:
    """Median times in ms of each ``step()`` (one micro-batch's forward and backward, returning
    its loss) over ``reps`` calls after ``warmup``, the steps interleaved (the order rotates).

    Each cell: ``host_ms`` (wall time up to the return of backward, unsynchronised: what the
    host takes to issue the work when the kernels keep up), ``thread_cpu_ms`` (the main
    thread's CPU time; on CUDA autograd runs the backward in its own device thread, so this is
    the forward's share), ``process_cpu_ms`` (every thread of the process), ``wall_ms``
    (synchronised) and ``loss`` (of the last call; no optimizer step, so every call's).
    """
    keys = ("host_ms", "thread_cpu_ms", "process_cpu_ms", "wall_ms")
    times: dict[str, dict[str, list[float]]] = {name: {k: [] for k in keys} for name in steps}
    losses: dict[str, float] = {}
    order = list(steps)
    for rep in range(warmup + reps):
        for name in order[rep % len(order) :] + order[: rep % len(order)]:
            _sync(device)
            wall, cpu, process = time.perf_counter(), time.thread_time(), time.process_time()
            loss = steps[name]()
            host = time.perf_counter() - wall
            cpu, process = time.thread_time() - cpu, time.process_time() - process
            _sync(device)
            elapsed = time.perf_counter() - wall
            losses[name] = float(loss)
            if rep >= warmup:
                for key, value in zip(keys, (host, cpu, process, elapsed)):
                    times[name][key].append(value * 1e3)
    return {
        name: {**{k: statistics.median(v) for k, v in cell.items()}, "loss": losses[name]}
        for name, cell in times.items()
    }


def check_host_overhead(s: Settings, device: torch.device, deadline: float) -> dict[str, Any]:
    """The fixed cost of a micro-batch: forward and backward of small packed micro-batches
    through the plain HF model and through the package's path at CP=1, host against kernels.

    ``plain HF``: the model with ``attn_implementation="sdpa"`` on the sequences packed in one
    row, ``position_ids`` restarting per sequence (``benchmarks.overhead.packed_batch``).
    ``Skrull <backend>``: a copy of the same weights after
    :func:`~lightning_skrull.models.prepare_model` (the chunked loss, as the strategies run it),
    the micro-batch of :func:`~lightning_skrull.data.collate.collate_rank` through
    :func:`~lightning_skrull.runtime.engine.forward_backward` (attention context, dispatch,
    loss), with the ``sdpa`` backend and, when ``"auto"`` picks it, ``flash``. Both compute the
    same mean token cross-entropy. Per micro-batch: the times of :func:`time_micro_batches`, the
    kernel ms of one profiled call on CUDA, and for the Skrull runs their own host ms (theirs
    minus plain HF's) and the goal (:data:`HOST_GOAL_MS`, for Qwen2.5-0.5B's shape only).
    Then the Skrull path with compiled decoder layers (:func:`_time_compiled`) when the
    deadline leaves :data:`HOST_COMPILE_NEED_S`. On CPU with one intra-op thread.
    """
    threads = torch.get_num_threads()
    if device.type == "cpu":  # one thread, as benchmarks/overhead.py: host time, not a thread pool
        torch.set_num_threads(1)
    try:
        return _host_overhead(s, device, deadline)
    finally:
        torch.set_num_threads(threads)


def _host_overhead(s: Settings, device: torch.device, deadline: float) -> dict[str, Any]:
    """:func:`check_host_overhead`'s measurements."""
    import copy

    from benchmarks.overhead import packed_batch
    from lightning_skrull.attention import resolve_backend
    from lightning_skrull.data.collate import collate_rank
    from lightning_skrull.models import prepare_model
    from lightning_skrull.models.loss_kernels import resolve_loss_kernel
    from lightning_skrull.runtime.engine import forward_backward
    from lightning_skrull.scheduling import GlobalBatchPlan, MicroBatchPlan

    cuda = device.type == "cuda"
    warmup, reps = (2, 5) if cuda else (1, 2)
    auto = resolve_backend("auto", device)
    backends = ("sdpa", "flash") if auto == "flash" else ("sdpa",)
    plain = _model(s.model, s.dtype, device, "sdpa")
    skrull = prepare_model(copy.deepcopy(plain), backend="sdpa", chunked_loss=True)
    goal = s.model == QWEN2_5_0_5B
    out: dict[str, Any] = {
        "warmup": warmup,
        "reps": reps,
        "runs": [PLAIN_HF, *(f"Skrull {b}" for b in backends)],
        "loss_kernel": resolve_loss_kernel("auto", device.type, s.dtype),
        "goal_ms": HOST_GOAL_MS if goal else None,
        "micro_batches": {},
    }
    g = torch.Generator().manual_seed(0)
    batches: dict[str, Any] = {}
    for n, length in HOST_MICRO_BATCHES:
        key = f"{n} x {length}"
        if time.monotonic() > deadline:
            out["micro_batches"][key] = {"skipped": "deadline"}
            continue
        rows = torch.randint(0, s.model["vocab_size"], (n, length), generator=g).tolist()
        samples = [{"input_ids": row, "labels": row} for row in rows]
        inputs = {k: v.to(device) for k, v in packed_batch(samples).items()}
        mb = MicroBatchPlan(tuple(range(n)), (0,) * n)
        plan = GlobalBatchPlan(((mb,),), dp_size=1, cp_size=1, bucket_size=n * length,
                               policy="skrull")  # fmt: skip
        batch = batches[key] = collate_rank(samples, plan, dp_rank=0, cp_rank=0, world_size=1).to(
            device
        )
        steps: dict[str, Callable[[], torch.Tensor]] = {
            PLAIN_HF: partial(_plain_step, plain, inputs)
        }
        for b in backends:
            steps[f"Skrull {b}"] = partial(
                forward_backward, skrull, batch, cp_group=None, backend=b
            )
        cell: dict[str, Any] = {"tokens": n * length}
        cell.update(time_micro_batches(steps, device, warmup, reps))
        reference = cell[PLAIN_HF]
        for name, step in steps.items():
            cell[name]["kernel_ms"] = _profiled_kernel_ms(step, device)
            if name != PLAIN_HF:
                cell[name]["own_host_ms"] = cell[name]["host_ms"] - reference["host_ms"]
                cell[name]["loss_rel_diff"] = abs(cell[name]["loss"] / reference["loss"] - 1.0)
                cell[name]["goal_met"] = cell[name]["host_ms"] <= HOST_GOAL_MS if goal else None
        out["micro_batches"][key] = cell
    del plain
    try:
        out["compiled"] = _time_compiled(skrull, batches, auto, device, deadline, warmup, reps)
    except Exception as err:  # an unshipped path: reported beside the eager numbers
        traceback.print_exc()
        out["compiled"] = {"error": f"{type(err).__name__}: {str(err)[:500]}"}
    out["ok"] = "error" not in out["compiled"] and _all_finite(out)
    return out


def _plain_step(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Forward and backward of a plain HF model; returns the loss."""
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach()


def _all_finite(value: Any) -> bool:
    """No NaN or infinity anywhere in a report's (nested) numbers."""
    if isinstance(value, dict):
        return all(_all_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_all_finite(v) for v in value)
    return not isinstance(value, float) or math.isfinite(value)


def _time_compiled(
    model: Any,
    batches: dict[str, Any],
    backend: str,
    device: torch.device,
    deadline: float,
    warmup: int,
    reps: int,
) -> dict[str, Any]:
    """The Skrull path with compiled decoder layers: every layer ``layer.compile(dynamic=True)``
    (one layer class, so one compiled code serves all), the attention function excluded with
    ``torch.compiler.disable`` (so the graph breaks only there, at the context variable); then
    the seconds of the first call (the compile), the graphs made and those made after it
    (recompiles), the graph breaks, and each micro-batch's times as the eager runs'.

    Inductor on CUDA; on CPU dynamo's ``eager`` backend (the same graph capture without code
    generation, so the run is cheap: an inductor build on CPU takes over ten seconds even for the
    tiny model, and did not cut the host time there, docs/benchmarks.md). The model's layers are uncompiled and the
    registered attention restored afterwards.
    """
    from torch._dynamo.utils import counters
    from transformers import AttentionInterface

    from lightning_skrull.attention.dispatch import skrull_attention_forward
    from lightning_skrull.models import ATTENTION_NAME
    from lightning_skrull.runtime.engine import forward_backward

    left = deadline - time.monotonic()
    if left < HOST_COMPILE_NEED_S:
        return {
            "skipped": f"deadline: {left:.0f} s of --budget-s left, a first compile needs "
            f"about {HOST_COMPILE_NEED_S:.0f}"
        }
    compiler = "inductor" if device.type == "cuda" else "eager"
    layers = model.model.layers
    out: dict[str, Any] = {
        "compiler": compiler,
        "attention_backend": backend,
        "layers": len(layers),
        "micro_batches": {},
    }
    torch._dynamo.reset()
    counters.clear()
    AttentionInterface.register(ATTENTION_NAME, torch.compiler.disable(skrull_attention_forward))
    try:
        for layer in layers:
            layer.compile(dynamic=True, backend=compiler)
        for key, batch in batches.items():
            if time.monotonic() > deadline:
                out["micro_batches"][key] = {"skipped": "deadline"}
                continue
            step = partial(forward_backward, model, batch, cp_group=None, backend=backend)
            if "first_call_s" not in out:
                _sync(device)
                start = time.perf_counter()
                step()
                _sync(device)
                out["first_call_s"] = time.perf_counter() - start
                out["graphs_after_first_call"] = counters["stats"]["unique_graphs"]
            cell = time_micro_batches({"c": step}, device, warmup, reps)["c"]
            out["micro_batches"][key] = {**cell, "kernel_ms": _profiled_kernel_ms(step, device)}
        out["graphs"] = counters["stats"]["unique_graphs"]
        out["recompiles"] = out["graphs"] - out.get("graphs_after_first_call", 0)
        out["graph_breaks"] = sum(counters["graph_break"].values())
    finally:
        AttentionInterface.register(ATTENTION_NAME, skrull_attention_forward)
        for layer in layers:
            layer._compiled_call_impl = None
        torch._dynamo.reset()
    return out


# --------------------------------------------------------------------------- report
def summary(report: dict[str, Any]) -> str:
    """The human-readable block printed at the end."""
    lines = ["===== lightning-skrull GPU check =====", f"device: {report['device_name']}"]
    parts = {
        "backends": _summary_backends,
        "throughput": _summary_throughput,
        "memory": _summary_memory,
        "chunked_loss": _summary_chunked_loss,
        "cp_bf16": _summary_cp_bf16,
        "fsdp": _summary_fsdp,
        "fused_kernels": _summary_fused_kernels,
        "host_overhead": _summary_host_overhead,
    }
    for name, part in parts.items():
        section = report.get(name)
        if section is None:
            continue
        if "error" in section:
            lines.append(f"{name}: ERROR ({section['error']})")
        elif "skipped" in section and name != "memory":
            lines.append(f"{name}: skipped ({section['skipped']})")
        else:
            lines.extend(part(section))
    lines.append(f"passed: {report['passed']}  ({report['wall_s']:.0f} s)")
    lines.append("=" * 38)
    return "\n".join(lines)


def _gib(x: Any) -> str:
    return f"{x / 2**30:.2f} GiB" if isinstance(x, (int, float)) else "n/a"


def _mib(x: Any) -> str:
    return f"{x / 2**20:.3f} MiB" if isinstance(x, (int, float)) else "n/a"


def _summary_chunked_loss(c: dict[str, Any]) -> list[str]:
    lines = [f"chunked loss ({c['loss_kernel']} kernel) vs dense, one-sequence steps at "
             f"{c['probe_tokens']} tokens, per token (measured / analytical):"]  # fmt: skip
    for name, line in c["lines"].items():
        if "skipped" in line:
            lines.append(f"  {name}: skipped ({line['skipped']})")
            continue
        fit = (
            f"{_mib(line['alpha_bytes_per_token'])}/token + {_gib(line['beta_bytes'])} (fit "
            f"error {line['fit_max_relative_error']:.1%}), {line['measured_over_estimate']:.2f}x "
            f"the estimate; auto bucket {line['auto_bucket']}"
            if "alpha_bytes_per_token" in line
            else "n/a (CUDA only)"
        )
        lines.append(
            f"  {name}: {fit}; estimate {_mib(line['estimate_bytes_per_token'])}/token "
            f"(layers {_mib(line['estimate_layers_bytes_per_token'])}, head "
            f"{_mib(line['estimate_head_bytes_per_token'])})"
        )
    if "alpha_ratio_dense_over_chunked" in c:
        gain = f", auto bucket {c['auto_bucket_gain']:.2f}x" if "auto_bucket_gain" in c else ""
        lines.append(
            f"  dense / chunked: {c['alpha_ratio_dense_over_chunked']:.2f}x per token{gain}"
        )
    return lines


def _summary_cp_bf16(c: dict[str, Any]) -> list[str]:
    agree = c.get("outputs_agree")
    check = (
        "" if agree is None
        else f"; outputs {'agree' if agree else 'MISMATCH'} (max |diff| {c['max_abs_diff']:.2e})"
    )  # fmt: skip
    lines = [
        f"attention under autocast(bf16) at emulated CP={c['cp_size']} ({c['micro_batches']} "
        f"micro-batches, {c['distributed_sequences']} distributed sequences, compute dtype "
        f"{c['compute_dtype']}){check}:"
    ]
    for label, cell in c["runs"].items():
        if "tokens_per_s_per_gpu" in cell:
            lines.append(
                f"  {label}: {cell['tokens_per_s_per_gpu']:,.0f} tok/s per GPU, "
                f"{cell['tokens_per_s_cp_group']:,.0f} tok/s per CP group "
                f"({cell['micro_batches_timed']} micro-batches, one layer fwd+bwd)"
            )
        else:
            lines.append(f"  {label}: nothing timed (deadline)")
    if "speedup" in c:
        lines.append(f"  after over before: {c['speedup']:.2f}x")
    return lines


def _summary_fsdp(f: dict[str, Any]) -> list[str]:
    speed = (
        f", {f['median_step_s']:.3f} s/step {f['median_tokens_per_s']:,.0f} tok/s"
        if "median_step_s" in f
        else ""
    )
    ratio = (
        f" ({f['estimate_over_measured']:.2f}x measured)" if "estimate_over_measured" in f else ""
    )
    return [
        f"FSDP2 on one device, mesh {tuple(f['mesh'])}, {f['precision']}, "
        f"{f['attention_backend']} attention, {f['loss_kernel']} loss: "
        f"{'OK' if f['ok'] else 'FAILED'} "
        f"({f['steps']} steps, losses {', '.join(f'{x:.3f}' for x in f['losses'])}){speed}",
        f"  peak {_gib(f['peak_bytes'])}; estimate {_gib(f['estimate_peak_bytes'])}{ratio} = "
        f"model states {_gib(f['estimate_model_state_bytes_tied'])} (strategy table: "
        f"{_gib(f['estimate_model_state_bytes'])} with the head untied) + activations "
        f"{_gib(f['estimate_activation_bytes'])} at {f['largest_micro_batch_tokens']} tokens",
    ]


def _summary_fused_kernels(f: dict[str, Any]) -> list[str]:
    installed = ", ".join(f["installed"]) or "none"
    lines = [
        f'fused loss kernels: installed {installed}; "auto" in bf16 here: {f["auto_kernel"]}; '
        f"{f['tokens']} tokens ({f['ignored_tokens']} labels -100) x vocab {f['vocab']:,} x "
        f"hidden {f['hidden']}, autocast(bf16) against float64 (loss |diff|, gradients "
        "norm-relative):"
    ]
    c = f["chunked"]
    lines.append(
        f"  chunked: loss {c['loss_abs_err']:.2e}, grad hidden {c['grad_hidden_rel_err']:.2e}, "
        f"grad weight {c['grad_weight_rel_err']:.2e} (bounds {CHUNKED_LOSS_RTOL:.2e} relative, "
        f"{CHUNKED_GRAD_RTOL:.2e}): {'OK' if c['ok'] else 'MISMATCH'}"
    )
    for name, k in f["kernels"].items():
        if "skipped" in k:
            lines.append(f"  {name}: {k['skipped']}")
            continue
        lines.append(
            f"  {name}: loss {k['loss_abs_err']:.2e} (tolerance {k['loss_tolerance']:.2e}), "
            f"grad hidden {k['grad_hidden_rel_err']:.2e} ({k['grad_hidden_tolerance']:.2e}), "
            f"grad weight {k['grad_weight_rel_err']:.2e} ({k['grad_weight_tolerance']:.2e}): "
            f"{'OK' if k['ok'] else 'MISMATCH'}"
        )
    lines.append(
        f"  forward + backward in bf16, median of {f['reps']} after 1; peak above the inputs, "
        "gradients included:"
    )
    lines.append("  | path | ms | peak | time / chunked's | peak / chunked's |")
    for name, t in f["timing"].items():
        if "skipped" in t:
            lines.append(f"  | {name} | skipped ({t['skipped']}) |")
            continue
        speed = f"{t['time_over_chunked']:.2f}x" if "time_over_chunked" in t else "1"
        peak = f"{t['peak_over_chunked']:.2f}x" if "peak_over_chunked" in t else "n/a"
        if name == "chunked" and isinstance(t["peak_bytes"], int):
            peak = "1"
        lines.append(f"  | {name} | {t['ms']:.2f} | {_mib(t['peak_bytes'])} | {speed} | {peak} |")
    return lines


def _summary_host_overhead(h: dict[str, Any]) -> list[str]:
    def ms(x: Any) -> str:
        return f"{x:.2f}" if isinstance(x, (int, float)) else "n/a"

    goal = h["goal_ms"]
    lines = [
        f"host overhead per micro-batch at CP=1 (forward + backward, ms, median of {h['reps']} "
        f"after {h['warmup']}; host = wall time to backward's return, unsynchronised, CPU times "
        f"in the JSON; Skrull with the chunked loss, {h['loss_kernel']} kernel):",
        f"  | seqs x tokens | Skrull run | host HF | host Skrull | Skrull's own | kernels HF / "
        f"Skrull | wall HF / Skrull | {f'goal {goal:.0f} ms' if goal else 'goal (0.5B only)'} |",
    ]
    for key, cell in h["micro_batches"].items():
        if "skipped" in cell:
            lines.append(f"  | {key} | skipped ({cell['skipped']}) |")
            continue
        plain = cell[PLAIN_HF]
        for run in h["runs"][1:]:
            c = cell[run]
            met = "n/a" if c["goal_met"] is None else "met" if c["goal_met"] else "missed"
            lines.append(
                f"  | {key} | {run.removeprefix('Skrull ')} | {ms(plain['host_ms'])} | "
                f"{ms(c['host_ms'])} | {c['own_host_ms']:+.2f} | {ms(plain['kernel_ms'])} / "
                f"{ms(c['kernel_ms'])} | {ms(plain['wall_ms'])} / {ms(c['wall_ms'])} | {met} |"
            )
    c = h["compiled"]
    if "skipped" in c or "error" in c:
        what = f"skipped ({c['skipped']})" if "skipped" in c else f"ERROR ({c['error']})"
        return [*lines, f"  compiled decoder layers: {what}"]
    lines.append(
        f"  compiled decoder layers ({c['compiler']}, {c['layers']} layers, "
        f"{c['attention_backend']} attention outside): first call "
        f"{c.get('first_call_s', math.nan):.1f} s, {c['graphs']} graphs, "
        f"{c['recompiles']} after the first call, {c['graph_breaks']} graph breaks"
    )
    eager = f"Skrull {c['attention_backend']}"
    lines.append("  | seqs x tokens | host compiled / eager | kernels | wall |")
    for key, m in c["micro_batches"].items():
        if "skipped" in m:
            lines.append(f"  | {key} | skipped ({m['skipped']}) |")
            continue
        e = h["micro_batches"][key][eager]
        lines.append(
            "  | "
            + " | ".join(
                [key, *(f"{ms(m[k])} / {ms(e[k])}" for k in ("host_ms", "kernel_ms", "wall_ms"))]
            )
            + " |"
        )
    return lines


def _summary_backends(b: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if b["flash_vs_sdpa_ok"] is None:
        lines.append(f"flash vs sdpa: skipped ({b['flash_vs_sdpa_skipped']})")
    else:
        lines.append(
            f"flash ({b.get('flash_kernel')} kernel) vs sdpa: "
            f"{'OK' if b['flash_vs_sdpa_ok'] else 'MISMATCH'} (max |out diff| "
            f"{b['flash_vs_sdpa_max_abs_diff']:.2e}, max rel grad diff "
            f"{b['flash_vs_sdpa_max_rel_grad_diff']:.2e}, tolerance {BF16_ATOL})"
        )
    for backend in ("sdpa", "flash"):
        if f"{backend}_loss" in b:
            ok = "OK" if b[f"{backend}_loss_ok"] else "MISMATCH"
            lines.append(
                f"skrull loss ({backend}) vs plain HF: {ok} ({b[f'{backend}_loss']:.6f} vs "
                f"{b['reference_loss']:.6f})"
            )
    return lines


def _summary_throughput(t: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    flash = f" ({t['flash_kernel']} kernel)" if t.get("flash_kernel") else ""
    lines.append(
        f"throughput at CP=1, bucket {t['bucket_size']} tokens, {t['attention_backend']} "
        f"attention{flash}:"
    )
    for name, cell in t["datasets"].items():
        parts = []
        for p in (*POLICIES, SDPA_RUN):
            if p in cell:
                c = cell[p]
                parts.append(
                    f"{p} {c['median_step_s']:.3f} s/step {c['median_tokens_per_s']:,.0f} tok/s"
                )
        speed = f", skrull {cell['skrull_speedup']:.2f}x" if "skrull_speedup" in cell else ""
        if "flash_speedup" in cell:
            speed += f", flash over sdpa {cell['flash_speedup']:.2f}x"
        skipped = (
            f" ({cell['skipped_steps']} steps skipped: deadline)" if cell["skipped_steps"] else ""
        )
        lines.append(
            f"  {name} ({cell['global_batch']} seq): " + "; ".join(parts) + speed + skipped
        )
    f = t.get("cost_model_fit", {})
    if "steps" in f:
        lines.append(
            f"cost model fit ({f['steps']} steps): {f['achieved_flops'] / 1e12:.3g} TFLOP/s "
            f"achieved, {f['micro_batch_overhead_s'] * 1e3:.2f} ms per micro-batch (defaults "
            f"{f['default_achieved_flops'] / 1e12:.0f} and "
            f"{f['default_micro_batch_overhead_s'] * 1e3:.2f}); largest step error "
            f"{f['max_abs_relative_error']:.1%}"
        )
    return lines


def _summary_memory(m: dict[str, Any]) -> list[str]:
    gib = 2**30
    lines: list[str] = []
    if "skipped" in m:
        lines.append(f"memory: skipped ({m['skipped']})")
    else:
        lines.append(
            f"memory: {m['alpha_bytes_per_token'] / 2**20:.3f} MiB/token + "
            f"{m['beta_bytes'] / gib:.2f} GiB (fit error {m['fit_max_relative_error']:.1%}); "
            f"predicted at bucket {m['predicted_at_bucket_bytes'] / gib:.2f} GiB of "
            f"{m['device_bytes'] / gib:.0f} GiB; largest bucket for this device "
            f"{m['largest_bucket_for_device']}"
        )
        if "prediction_error" in m:
            lines.append(
                f"  throughput steps: peak {m['throughput_peak_bytes'] / gib:.2f} GiB at "
                f"{m['throughput_peak_tokens']} tokens/micro-batch, predicted "
                f"{m['predicted_for_those_tokens_bytes'] / gib:.2f} GiB "
                f"({m['prediction_error']:+.1%})"
            )
    return lines


def run(args: argparse.Namespace) -> dict[str, Any]:
    """All checks; returns the report (also written as JSON)."""
    start = time.monotonic()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --device cpu --tiny")
    s = settings(args.tiny, device, args.bucket, args.steps)
    report: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "tiny": args.tiny,
        "model": {k: v for k, v in s.model.items() if isinstance(v, (int, float, bool))},
        "dtype": str(s.dtype),
    }
    end = start + args.budget_s
    reserve = sum(RESERVED_S.values()) if device.type == "cuda" else 0.0
    json_path: Path | None = getattr(args, "json", None)

    def section(name: str, check: Callable[[], dict[str, Any]]) -> None:
        """Run one check unless too little time is left; an error is reported, not raised, so
        the other checks still run; the report so far is written after each."""
        left = end - time.monotonic()
        need = RESERVED_S.get(name, 0.0) / 2 if device.type == "cuda" else 0.0
        if left < need:
            report[name] = {
                "skipped": f"deadline: {left:.0f} s of --budget-s left, {need:.0f} needed"
            }
        else:
            try:
                report[name] = check()
            except Exception as err:  # reported, and the run goes on
                traceback.print_exc()
                report[name] = {"error": f"{type(err).__name__}: {str(err)[:500]}"}
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if json_path is not None:
            write_json(json_path, {**report, "partial": True}, default=str)

    section("backends", lambda: check_backends(s, device))
    section("throughput", lambda: check_throughput(s, device, end - reserve))
    section("memory", lambda: check_memory(s, device, report["throughput"]))
    section("chunked_loss", lambda: check_chunked_loss(s, device, end))
    section("cp_bf16", lambda: check_cp_bf16(s, device, end))
    section("fsdp", lambda: check_fsdp(s, device, end))
    section("fused_kernels", lambda: check_fused_kernels(s, device, end))
    section("host_overhead", lambda: check_host_overhead(s, device, end))
    report["passed"] = passed(report)
    report["wall_s"] = time.monotonic() - start
    return report


def passed(report: dict[str, Any]) -> bool:
    """Every check that ran agrees, and nothing failed with an error (a check skipped at the
    deadline is reported as skipped, not failed; the throughput runs must each have run). The
    host-overhead check fails only on an error or a non-finite number: its goal is reported,
    met or missed, not enforced; a fused loss kernel that is not installed is reported, not
    failed."""
    b, t = report["backends"], report["throughput"]
    if any("error" in report[name] for name in SECTIONS):
        return False
    chunked = report["chunked_loss"].get("lines", {})
    return bool(
        b.get("flash_vs_sdpa_ok") is not False
        and all(v for k, v in b.items() if k.endswith("_loss_ok"))
        and all(p in c for c in t.get("datasets", {}).values() for p in POLICIES)
        and not any("bucket_error" in line for line in chunked.values())
        and report["cp_bf16"].get("outputs_agree") is not False
        and report["fsdp"].get("ok") is not False
        and report["fused_kernels"].get("ok") is not False
        and report["host_overhead"].get("ok") is not False
    )


def default_json(name: str) -> Path:
    """Where a GPU benchmark writes its JSON unless told: ``$OUT`` (the device machine's
    folder that comes back), else ``benchmarks/out/``."""
    return Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "out") / name


def write_json(
    path: Path, report: dict[str, Any], default: Callable[[Any], Any] | None = None
) -> None:
    """Write a benchmark's report, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=default))


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run, print the summary, write the JSON; exit 1 if a check failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:1, or cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny model and sizes (CPU test)")
    parser.add_argument("--bucket", type=int, default=None, help="tokens per micro-batch")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per policy and set")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=360.0,
        help="stop measuring after this many seconds (the checks after the "
        "throughput loop keep their share of it)",
    )
    parser.add_argument("--json", type=Path, default=default_json("gpu_check.json"))
    args = parser.parse_args(argv)
    report = run(args)
    print(summary(report), flush=True)
    write_json(args.json, report, default=str)
    print(f"wrote {args.json}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
