"""What the chunked loss's memory buys the planner: the paper's settings with a larger bucket.

The activation memory per token with the dense and the chunked loss comes from
:func:`benchmarks.memory_estimate.activation_bytes_per_token` (bf16; it matches the
H200's measured 3.13 MiB/token for Qwen2.5-0.5B to 4%). With the same device and the same fixed
memory (parameters, optimizer), the bucket grows by ``alpha_dense / alpha_chunked``: the paper's
26K tokens per rank for Qwen2.5-0.5B and 13K for 7B (H100 80GB) become the buckets below.

The global batches are drawn exactly as ``benchmarks/simulate_paper.py`` draws them (lengths cut
to the original bucket's capacity, so both buckets plan the very same sequences), planned with
the ``skrull`` policy at both buckets, and simulated with the default constants and with the
H200-fitted ones. The table shows the mean simulated step time at the paper's bucket over the
one at the larger bucket (above 1: the larger bucket is faster).

Run::

    python -m benchmarks.bucket_gain               # 20 batches per setting, about a minute
    python -m benchmarks.bucket_gain --batches 3   # a quick look
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import benchmarks.simulate_paper as sp
from benchmarks.lengths import DATASETS
from benchmarks.memory_estimate import activation_bytes_per_token
from lightning_skrull.scheduling import CostModel, plan_global_batch, simulate


def larger_bucket(setting: sp.Setting) -> int:
    """The paper's bucket scaled by the dense over the chunked activation bytes per token."""
    dense = activation_bytes_per_token(setting.shape, chunked_loss=False).total
    chunked = activation_bytes_per_token(setting.shape, chunked_loss=True).total
    return int(setting.bucket_size * dense / chunked)


def gain(batches: int, seed: int) -> list[dict[str, object]]:
    """Per setting, dataset and constants: the step-time ratio of the two buckets."""
    measured = sp.measured_constants(json.loads(sp.MEASURED.read_text()))
    rows: list[dict[str, object]] = []
    for s in sp.settings():
        bigger = dataclasses.replace(s, bucket_size=larger_bucket(s))
        for dataset in DATASETS:
            batches_ = sp.setting_batches(s, dataset, batches, seed)
            for name, constants in (("default", {}), ("H200", measured[s.model])):
                model = CostModel(shape=s.shape, **constants)
                ratios = []
                for lengths in batches_:
                    times = [
                        simulate(
                            plan_global_batch(
                                lengths,
                                dp_size=x.dp_size,
                                cp_size=x.cp_size,
                                bucket_size=x.bucket_size,
                                cost_model=model,
                            ),
                            lengths,
                            model,
                        )
                        for x in (s, bigger)
                    ]
                    ratios.append(times[0] / times[1])
                rows.append(
                    {
                        "model": s.model,
                        "dataset": dataset.name,
                        "constants": name,
                        "bucket": s.bucket_size,
                        "larger": bigger.bucket_size,
                        "speedup": statistics.fmean(ratios),
                    }
                )
    return rows


def table(rows: list[dict[str, object]]) -> str:
    """A Markdown table of :func:`gain`'s rows."""
    lines = [
        "| model | dataset | bucket -> with chunked loss | speed-up, default constants | "
        "speed-up, H200 constants |",
        "|---|---|---|---|---|",
    ]
    keyed = {(r["model"], r["dataset"], r["constants"]): r for r in rows}
    for model, dataset in dict.fromkeys((r["model"], r["dataset"]) for r in rows):
        d, h = keyed[(model, dataset, "default")], keyed[(model, dataset, "H200")]
        lines.append(
            f"| {model} | {dataset} | {d['bucket']:,} -> {d['larger']:,} | "
            f"{d['speedup']:.3f}x | {h['speedup']:.3f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(table(gain(args.batches, args.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
