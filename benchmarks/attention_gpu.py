"""Attention kernels on one GPU: where the time of the ``sdpa`` and ``flash`` backends goes.

One attention layer of Qwen2.5-0.5B's shape (14 query heads, 2 K/V heads, head dim 64, bf16),
forward and backward, over a Wikipedia-like and a ChatQA2-like global batch (the paper's length
shares, cut to the bucket) packed on one rank at CP=1, two ways: every sequence local (what
``skrull`` plans at CP=1) and every sequence on the distributed path (what ``static`` plans:
two zigzag chunks, the second against the sequence's prefix). Rows:

* ``flash``: the flash backend (flash-attn, else ``torch.nn.attention.varlen``), one varlen call
  per part;
* ``sdpa``: the sdpa backend as shipped (on CUDA: no cuDNN, K/V repeated for masked calls);
* ``sdpa, PyTorch's choice``: the same calls without the backend's own kernel restriction, so
  PyTorch picks the SDPA kernel;
* ``sdpa[<kernel>]``: those calls with SDPA restricted to one kernel
  (``torch.nn.attention.sdpa_kernel``); ``n/a`` when that kernel refuses the inputs;
* ``sdpa, K/V repeated``: PyTorch's choice with K/V repeated to 14 heads (no ``enable_gqa``).

Every measured repetition uses new lengths (each length plus the repetition's index), as
training does; kernels that build a plan per shape pay for it here. Prints one table (ms per
layer, median of ``--reps``) and writes JSON to ``$OUT/attention_gpu.json`` or ``--json``.

    python -m benchmarks.attention_gpu                 # one NVIDIA GPU
    python -m benchmarks.attention_gpu --rows flash,sdpa   # only the two shipped backends
    python -m benchmarks.attention_gpu --device cpu --tiny   # the code paths on CPU
"""

from __future__ import annotations

import argparse
import contextlib
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_check import default_json, median_seconds, write_json
from benchmarks.lengths import dataset, sample_lengths
from lightning_skrull.attention import SkrullAttentionContext, build_rank_layout, sdpa_calls
from lightning_skrull.attention import flash as flash_backend
from lightning_skrull.attention.backends import flash_kernel
from lightning_skrull.attention.sdpa import sdpa_attention
from lightning_skrull.scheduling import DISTRIBUTED

HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64
"""Qwen2.5-0.5B's attention shape."""


def _kernels() -> dict[str, Any]:
    from torch.nn.attention import SDPBackend

    names = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
             "cudnn": "CUDNN_ATTENTION", "math": "MATH"}  # fmt: skip
    return {k: getattr(SDPBackend, v) for k, v in names.items() if hasattr(SDPBackend, v)}


@contextlib.contextmanager
def _kernel_choice(shipped: bool, kernel: Any) -> Iterator[None]:
    """The sdpa backend as shipped, or without its CUDA kernel restriction (PyTorch's choice,
    or ``kernel`` alone when given)."""
    from torch.nn.attention import sdpa_kernel

    if shipped:
        yield
        return
    restrict = sdpa_calls._restrict_kernels
    sdpa_calls._restrict_kernels = lambda t: False  # type: ignore[assignment]
    try:
        with sdpa_kernel([kernel]) if kernel is not None else contextlib.nullcontext():
            yield
    finally:
        sdpa_calls._restrict_kernels = restrict


def _time_layer(
    fn: Callable[..., torch.Tensor],
    lengths: list[int],
    placement: str,
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    reps: int,
    repeat_kv: bool,
) -> float:
    """Median ms of forward + backward of one layer; new lengths every repetition."""

    def make_input(rep: int) -> tuple[Any, ...]:
        lens = [n + rep for n in lengths]
        ids = list(range(len(lens)))
        place = [0 if placement == "local" else DISTRIBUTED] * len(lens)
        layout = build_rank_layout(ids, place, lens, cp_rank=0, cp_size=1)
        ctx = SkrullAttentionContext.build(layout, backend=backend, device=device)
        t = layout.num_tokens
        kv = HEADS if repeat_kv else KV_HEADS
        q, k, v = (
            torch.randn(t, h, HEAD_DIM, device=device, dtype=dtype, requires_grad=True)
            for h in (HEADS, kv, kv)
        )
        grad = torch.randn(t, HEADS, HEAD_DIM, device=device, dtype=dtype)
        return q, k, v, ctx, grad

    def step(args: tuple[Any, ...]) -> None:
        q, k, v, ctx, grad = args
        fn(q, k, v, ctx).backward(grad)

    return median_seconds(make_input, step, device, reps) * 1e3


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every row and case; returns the report."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rng = random.Random(0)
    sizes = {"Wikipedia": 64, "ChatQA2-Long-SFT": 8}
    batches = {
        name: sample_lengths(
            dataset(name),
            max(2, n // (8 if args.tiny else 1)),
            args.bucket,
            rng,
            scale=128 if args.tiny else 1,
        )
        for name, n in sizes.items()
    }
    # (label, attention, backend, shipped kernel choice, SDPA kernel, K/V repeated)
    rows: list[tuple[str, Callable[..., torch.Tensor], str, bool, Any, bool]] = []
    if device.type == "cuda" and flash_kernel() is not None:
        rows.append((f"flash ({flash_kernel()})", flash_backend.flash_attention,
                     "flash", True, None, False))  # fmt: skip
    rows.append(("sdpa", sdpa_attention, "sdpa", True, None, False))
    rows.append(("sdpa, PyTorch's choice", sdpa_attention, "sdpa", False, None, False))
    for name, kernel in _kernels().items():
        if name != "math" or args.tiny:  # math keeps the L x S scores: too big at 26K tokens
            rows.append((f"sdpa[{name}]", sdpa_attention, "sdpa", False, kernel, False))
    rows.append(("sdpa, K/V repeated", sdpa_attention, "sdpa", False, None, True))
    if args.rows:
        wanted = [w.strip() for w in args.rows.split(",")]
        rows = [r for r in rows if any(r[0] == w or r[0].startswith(w + " ") for w in wanted)]
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "lengths": batches,
        "ms_per_layer": {},
    }
    for label, fn, backend, shipped, kernel, repeat_kv in rows:
        cells: dict[str, Any] = {}
        for name, lengths in batches.items():
            for placement in ("local", "distributed"):
                key = f"{name}/{placement}"
                try:
                    with _kernel_choice(shipped, kernel):
                        cells[key] = _time_layer(fn, lengths, placement, backend, device, dtype,
                                                 args.reps, repeat_kv)  # fmt: skip
                except RuntimeError as err:
                    cells[key] = f"n/a: {str(err).splitlines()[0][:80]}"
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        report["ms_per_layer"][label] = cells
        print(label, cells, flush=True)
    return report


def table(report: dict[str, Any]) -> str:
    """The Markdown table of ms per layer."""
    cols = list(next(iter(report["ms_per_layer"].values())))
    lines = [
        f"attention, one layer fwd+bwd, ms (median), {report['device']}, torch {report['torch']}, "
        f"{report['dtype']}; tokens: "
        + ", ".join(f"{k} {sum(v)} in {len(v)} seq" for k, v in report["lengths"].items()),
        "| row | " + " | ".join(cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for label, cells in report["ms_per_layer"].items():
        vals = [f"{c:.2f}" if isinstance(c, float) else "n/a" for c in cells.values()]
        lines.append(f"| {label} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="short sequences (CPU test)")
    parser.add_argument("--bucket", type=int, default=25_984, help="longest sequence")
    parser.add_argument("--reps", type=int, default=3, help="measured repetitions")
    parser.add_argument(
        "--rows", default="", help="comma-separated row labels to run, e.g. 'flash,sdpa' (all)"
    )
    parser.add_argument("--json", type=Path, default=default_json("attention_gpu.json"))
    args = parser.parse_args(argv)
    if args.tiny:
        args.bucket = min(args.bucket, 256)
    report = run(args)
    print(table(report))
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
