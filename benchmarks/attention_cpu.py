"""Context-parallel attention on CPU: all-distributed vs the planner's mixed placement.

Times forward + backward of the attention of one long-tailed micro-batch on ``--cp-size`` CPU
processes (gloo, one thread each) for

* ``all distributed``: every sequence sharded over the CP group (zigzag), as ring/CP systems do;
* ``mixed (planner)``: the placement ``plan_global_batch(..., policy="skrull")`` chooses, short
  sequences kept whole on one rank and only long ones sharded;

against plain SDPA on each whole sequence in one process (one thread). A step time is the
slowest rank's median over ``--iters`` runs; the CPU column (the compute thread's CPU time,
slowest rank) is the figure to read on a shared machine. Also prints the bytes each rank receives in the
forward all-gather and sends in the backward reduce-scatter, per attention layer.

Run: ``python -m benchmarks.attention_cpu`` (about a minute on two free cores).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_skrull.attention import (
    SkrullAttentionContext,
    build_rank_layout,
    distributed_kv_bytes,
    pack,
    sdpa_attention,
)
from lightning_skrull.runtime.launch import spawn
from lightning_skrull.scheduling import DISTRIBUTED, plan_global_batch

LONG_TAILED = [3072, 640, 384, 256, 192, 160, 128, 128, 96, 64, 64, 48, 32, 32, 24, 16]
"""A micro-batch with one long sequence and many short ones (the SFT long tail)."""


def _sequences(lengths: list[int], args: argparse.Namespace) -> dict[int, tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(0)
    heads = (args.heads, args.kv_heads, args.kv_heads)
    return {
        s: tuple(torch.randn(n, h, args.head_dim, generator=gen) for h in heads)
        for s, n in enumerate(lengths)
    }


def _time(fn: Any, iters: int, barrier: bool) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds of this (compute) thread per run."""
    times, cpu = [], []
    for i in range(iters + 1):
        if barrier:
            dist.barrier()
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn()
        if i:  # the first run warms up
            times.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
    return statistics.median(times), statistics.median(cpu)


def _rank_step(
    rank: int, world_size: int, lengths: list[int], placements: dict[str, list[int]], args: Any
) -> dict[str, tuple[float, float, int, int]]:
    """Per placement: (wall s, CPU s, tokens on this rank, bytes received per layer)."""
    group = dist.new_group(list(range(world_size)))
    seqs = _sequences(lengths, args)
    ids = list(range(len(lengths)))
    out = {}
    for name, placement in placements.items():
        layout = build_rank_layout(ids, placement, lengths, cp_rank=rank, cp_size=world_size)
        ctx = SkrullAttentionContext.build(layout, group=group, backend="sdpa")
        q, k, v = (
            pack(layout, {s: t[i] for s, t in seqs.items()}).requires_grad_() for i in range(3)
        )

        def step(
            q: torch.Tensor = q,
            k: torch.Tensor = k,
            v: torch.Tensor = v,
            ctx: SkrullAttentionContext = ctx,
        ) -> None:
            sdpa_attention(q, k, v, ctx).sum().backward()

        seconds, cpu = _time(step, args.iters, barrier=True)
        sent = distributed_kv_bytes(ctx, args.kv_heads, args.head_dim, torch.float32)
        out[name] = (seconds, cpu, layout.num_tokens, sent)
    return out


def _single_process(lengths: list[int], args: argparse.Namespace) -> tuple[float, float]:
    seqs = _sequences(lengths, args)
    leaves = [tuple(t.clone().requires_grad_() for t in seq) for seq in seqs.values()]

    def step() -> None:
        for q, k, v in leaves:
            F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0),
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                is_causal=True,
                enable_gqa=True,
            ).sum().backward()

    torch.set_num_threads(1)
    return _time(step, args.iters, barrier=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=LONG_TAILED)
    parser.add_argument("--cp-size", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    lengths: list[int] = args.lengths
    n = args.cp_size
    bucket = max(max(-(-length // n) for length in lengths), -(-sum(lengths) // n) + 64)
    plan = plan_global_batch(lengths, dp_size=1, cp_size=n, bucket_size=bucket, policy="skrull")
    (micro_batches,) = plan.micro_batches
    if len(micro_batches) != 1:
        raise SystemExit(f"the planner split the batch into {len(micro_batches)} micro-batches")
    mb = micro_batches[0]
    order = {sid: where for sid, where in zip(mb.sequence_ids, mb.placement, strict=True)}
    placements = {
        "all distributed": [DISTRIBUTED] * len(lengths),
        "mixed (planner)": [order[s] for s in range(len(lengths))],
    }
    results = spawn(_rank_step, n, lengths, placements, args, timeout=900)
    single = _single_process(lengths, args)

    dtype_bytes = 4
    print(
        f"{len(lengths)} sequences, {sum(lengths)} tokens (longest {max(lengths)}), CP {n}, "
        f"heads {args.heads}/{args.kv_heads}, head dim {args.head_dim}, float32, 1 thread/rank"
    )
    sharded = [s for s, p in enumerate(placements["mixed (planner)"]) if p == DISTRIBUTED]
    print(f"planner shards sequences {sharded} (lengths {[lengths[s] for s in sharded]})")
    print()
    header = (
        f"{'placement':<18}{'fwd+bwd ms':>12}{'max rank CPU ms':>17}{'tokens/rank':>16}"
        f"{'KV bytes/layer':>16}"
    )
    print(header)
    print("-" * len(header))
    for name in placements:
        per_rank = [results[r][name] for r in range(n)]
        seconds = max(p[0] for p in per_rank)
        cpu = max(p[1] for p in per_rank)
        tokens = "/".join(str(p[2]) for p in per_rank)
        sent = max(p[3] for p in per_rank)
        print(f"{name:<18}{seconds * 1e3:>12.1f}{cpu * 1e3:>17.1f}{tokens:>16}{sent:>16,}")
    wall, cpu = single
    print(f"{'single process':<18}{wall * 1e3:>12.1f}{cpu * 1e3:>17.1f}{sum(lengths):>16}{0:>16,}")
    print()
    kv_row = 2 * args.kv_heads * args.head_dim * dtype_bytes
    print(
        "KV bytes/layer: what one rank receives in the forward all-gather of K and V (the "
        "backward reduce-scatter sends as much); (cp_size - 1) x the largest rank's distributed "
        f"tokens x {kv_row} bytes."
    )


if __name__ == "__main__":
    main()
