"""Memory per GPU by model size and strategy, from the analytical model (docs/strategies.md).

For Qwen2.5-7B, 14B, 32B and 72B and the Mixture-of-Experts Qwen3-30B-A3B and Mixtral-8x7B
(:data:`~benchmarks.memory_estimate.LARGE_MODELS`, the values of their published
``config.json``) under DDP, ZeRO-2, FSDP2 sharded over the CP group and FSDP2 sharded over the
world, on 80 GB and 141 GB GPUs: the model states one GPU holds
(:func:`benchmarks.memory_estimate.model_state_bytes`: parameters, gradients, AdamW
states, the strategy's working copies) and the largest ``bucket_size`` that fits next to them
with 10% of the device kept free, without and with activation checkpointing
(:func:`~benchmarks.memory_estimate.largest_bucket`, the chunked loss in bf16).
Nothing runs on a device: it prints a Markdown table.

Run::

    python -m benchmarks.memory_table                       # 4 nodes x 8 GPUs, CP 8
    python -m benchmarks.memory_table --world 16 --cp 8
"""

from __future__ import annotations

import argparse

from benchmarks.memory_estimate import (
    LARGE_MODELS,
    MEMORY_STRATEGIES,
    MemoryStrategy,
    largest_bucket,
    model_state_bytes,
)

GIB = 2**30
DEVICES = {"80 GB": 81_559 * 2**20, "141 GB": 143_771 * 2**20}
"""Device memory as CUDA reports it: H100 80GB (81,559 MiB), H200 (143,771 MiB)."""

NAMES = {
    "ddp": "DDP (`skrull`)",
    "zero2": "ZeRO-2 (`skrull_zero2`)",
    "fsdp_cp": 'FSDP2 `shard="cp"`',
    "fsdp_world": 'FSDP2 `shard="world"`',
}


def _bucket(tokens: int) -> str:
    return f"{tokens / 1000:.1f}K" if tokens else "does not fit"


def rows(world_size: int, cp_size: int) -> list[str]:
    """The table's Markdown lines."""
    head = "| model | strategy | model states / GPU |"
    rule = "|---|---|---|"
    for device in DEVICES:
        head += f" bucket, {device} | bucket + AC, {device} |"
        rule += "---|---|"
    lines = [head, rule]
    for name, shape in LARGE_MODELS.items():
        for strategy in MEMORY_STRATEGIES:
            key: MemoryStrategy = strategy  # type: ignore[assignment]
            states = model_state_bytes(shape, key, cp_size=cp_size, world_size=world_size)
            line = f"| {name} | {NAMES[strategy]} | {states.total / GIB:.1f} GiB |"
            for capacity in DEVICES.values():
                for checkpointing in (False, True):
                    tokens = largest_bucket(
                        shape,
                        key,
                        capacity,
                        cp_size=cp_size,
                        world_size=world_size,
                        activation_checkpointing=checkpointing,
                    )
                    line += f" {_bucket(tokens)} |"
            lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=32, help="GPUs in the job")
    parser.add_argument("--cp", type=int, default=8, help="GPUs per CP group")
    args = parser.parse_args(argv)
    print(f"world {args.world} GPUs, CP groups of {args.cp}, bf16 compute, AdamW")
    print("\n".join(rows(args.world, args.cp)))


if __name__ == "__main__":
    main()
