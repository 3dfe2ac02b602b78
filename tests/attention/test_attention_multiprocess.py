"""Context-parallel attention on real gloo process groups (CP = 2, 3, 4) against plain SDPA.

Each CP size is one spawn call running a batch of random micro-batches that mix local and
distributed sequences (lengths 1, primes, lengths < 2N, zero-token ranks, no distributed
sequence at all), GQA 4/2 and 4/1, float64 and float32, the distributed sequences exchanged in
one K/V group or cut into 2 or 3 (``kv_groups``, also a group in which some rank holds no
token, and a group of only such a sequence), sliding windows (transformers'
``sliding_window``: shorter than, equal to and longer than the sequences, cutting inside one
zigzag chunk and across several), values narrower than the keys (Multi-head Latent
Attention's ``v_head_dim < qk_head_dim``) with K/V groups and a window, and attention sinks
(gpt-oss's per-head ``s_aux`` logits; each rank's sink gradient comes from its own queries and
the parent sums them over the ranks, as the strategies' gradient reduction does) with K/V groups
and windows. Every rank runs the registered
``"skrull"`` attention function on its packed tokens and backpropagates a given output
gradient; the parent unpacks outputs and dq/dk/dv to whole sequences and compares them with
plain SDPA run on each whole sequence in one process (float64 reference; with transformers' own
sliding-window mask for a window; with sinks, the eager gpt-oss attention of
tests/models/test_gpt_oss.py, ``sink_reference``).

Tolerances: float64 1e-10 (the only differences are summation order in softmax and in the
reduce-scatter of dK/dV, ~1e-15 here); float32 1e-5 (float32 rounding, ~1e-7 relative, on
values of order one).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from attention_reference import sink_reference, window_reference
from helpers import count_exchanged_bytes

from lightning_skrull.attention import (
    SkrullAttentionContext,
    attention_context,
    build_rank_layout,
    build_rank_layouts,
    pack,
    skrull_attention_forward,
    unpack,
)
from lightning_skrull.runtime.launch import spawn
from lightning_skrull.scheduling.plan import DISTRIBUTED

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
HEAD_DIM = 8


@dataclasses.dataclass(frozen=True)
class Case:
    """One micro-batch: the plan, head counts, dtype, scale, and whether to break the layout."""

    lengths: tuple[int, ...]
    sequence_ids: tuple[int, ...]
    placement: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    dtype: torch.dtype
    scale: float | None
    seed: int
    broken: bool = False
    kv_groups: tuple[int, ...] = ()
    window: int | None = None
    value_dim: int = HEAD_DIM
    sink: bool = False


def _sink(case: Case) -> torch.Tensor:
    """The case's sink logits ``[Hq]`` (of the scores' order, so they matter), identical in
    every process."""
    gen = torch.Generator().manual_seed(case.seed)
    return (torch.randn(case.num_heads, generator=gen, dtype=torch.float64) * 2 + 1).to(case.dtype)


def _make_cases(cp_size: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    pool = [1, 2, 3, 5, 7, 11, 13, 17, 23, 31, 37, 2 * cp_size - 1, 2 * cp_size + 1]
    heads = [(4, 2), (4, 1), (4, 4)]
    dtypes = [torch.float64, torch.float32]
    cases = []

    def add(lengths: list[int], ids: list[int], placement: list[int], **kw: Any) -> None:
        i = len(cases)
        hq, hkv = heads[i % len(heads)]
        cases.append(
            Case(
                lengths=tuple(lengths),
                sequence_ids=tuple(ids),
                placement=tuple(placement),
                num_heads=hq,
                num_kv_heads=hkv,
                dtype=kw.pop("dtype", dtypes[(i // len(heads)) % len(dtypes)]),
                scale=kw.pop("scale", 0.3 if i % 4 == 1 else None),
                seed=seed * 1000 + i,
                **kw,
            )
        )

    for _ in range(8):  # random mixed micro-batches
        lengths = [rng.choice(pool) if rng.random() < 0.6 else rng.randint(1, 60) for _ in range(7)]
        ids = rng.sample(range(len(lengths)), rng.randint(2, len(lengths)))
        placement = [rng.choice([DISTRIBUTED, DISTRIBUTED, *range(cp_size)]) for _ in ids]
        add(lengths, ids, placement)
    # no distributed sequence: no collective at all
    add([9, 4, 6], [0, 1, 2], [0, cp_size - 1, 0])
    # a single one-token distributed sequence: every rank but rank 0 holds nothing
    add([1], [0], [DISTRIBUTED])
    # only distributed sequences shorter than 2N, plus a local one on the last rank
    add([2 * cp_size - 1, 2, 3], [2, 0, 1], [DISTRIBUTED, DISTRIBUTED, cp_size - 1])
    # rank 0 holds only distributed tokens; long sequence, several key blocks per chunk
    add([97, 5], [0, 1], [DISTRIBUTED, cp_size - 1], dtype=torch.float32)
    # deliberately wrong layout on every rank: the checker must flag it
    add([29, 6, 13], [0, 1, 2], [DISTRIBUTED, 0, DISTRIBUTED], dtype=torch.float64, broken=True)
    # K/V groups. Two groups: a long and a one-token sequence (every rank but 0 holds nothing of
    # the latter), then a sequence shorter than 2N; local sequences on the first and last rank.
    add(
        [23, 1, 9, 2 * cp_size - 1, 6],
        [0, 1, 2, 3, 4],
        [DISTRIBUTED, DISTRIBUTED, 0, DISTRIBUTED, cp_size - 1],
        dtype=torch.float64,
        kv_groups=(2, 1),
    )
    # Three groups, the middle one a single one-token sequence (ranks > 0 have no chunk in it)
    add(
        [31, 1, 5, 17, 4, 2],
        [3, 1, 0, 2, 5, 4],
        [DISTRIBUTED, DISTRIBUTED, cp_size - 1, DISTRIBUTED, 0, DISTRIBUTED],
        dtype=torch.float64,
        kv_groups=(1, 1, 2),
    )
    # Three groups of only distributed sequences, the last one shorter than N
    add(
        [13, 40, max(1, cp_size - 1), 7],
        [1, 0, 2, 3],
        [DISTRIBUTED, DISTRIBUTED, DISTRIBUTED, 0],
        dtype=torch.float64,
        kv_groups=(1, 1, 1),
        scale=0.3,
    )
    # float32, two groups, scale given
    add(
        [19, 3, 11, 8],
        [0, 1, 2, 3],
        [DISTRIBUTED, cp_size - 1, DISTRIBUTED, DISTRIBUTED],
        dtype=torch.float32,
        kv_groups=(1, 2),
        scale=0.3,
    )
    # random micro-batches with their distributed sequences cut into random groups
    for _ in range(3):
        lengths = [rng.choice(pool) if rng.random() < 0.6 else rng.randint(1, 60) for _ in range(7)]
        ids = rng.sample(range(len(lengths)), rng.randint(3, len(lengths)))
        placement = [rng.choice([DISTRIBUTED, DISTRIBUTED, *range(cp_size)]) for _ in ids]
        placement[:2] = [DISTRIBUTED, DISTRIBUTED]
        num_distributed = placement.count(DISTRIBUTED)
        cuts = sorted(rng.sample(range(1, num_distributed), rng.randint(1, num_distributed - 1)))
        groups = [b - a for a, b in zip([0, *cuts], [*cuts, num_distributed], strict=True)]
        add(lengths, ids, placement, dtype=torch.float64, kv_groups=tuple(groups))
    # Sliding windows. One long distributed sequence (chunks of 97 / 2N tokens) with a window
    # inside one chunk, one spanning a few chunks, and one equal to the longest sequence;
    # local sequences shorter and longer than the window on the first and last rank.
    for window in (3, 29, 97):
        add(
            [97, 5, 40, 2 * cp_size - 1],
            [0, 1, 2, 3],
            [DISTRIBUTED, 0, cp_size - 1, DISTRIBUTED],
            dtype=torch.float64,
            window=window,
        )
    # a window of one key (each query sees only itself), two K/V groups, float32
    add(
        [23, 1, 9, 6],
        [0, 1, 2, 3],
        [DISTRIBUTED, DISTRIBUTED, 0, cp_size - 1],
        dtype=torch.float32,
        kv_groups=(1, 1),
        window=1,
    )
    # random micro-batches with random windows, one of them longer than every sequence
    for window in (rng.randint(2, 20), 61):
        lengths = [rng.choice(pool) if rng.random() < 0.6 else rng.randint(1, 60) for _ in range(7)]
        ids = rng.sample(range(len(lengths)), rng.randint(3, len(lengths)))
        placement = [rng.choice([DISTRIBUTED, DISTRIBUTED, *range(cp_size)]) for _ in ids]
        add(lengths, ids, placement, dtype=torch.float64, window=window)
    # values 5 wide against keys 8 wide (MLA): two K/V groups, then a window, then float32
    value_cases = [
        dict(kv_groups=(2, 1)),
        dict(window=5),
        dict(dtype=torch.float32, kv_groups=(1, 2), scale=0.3),
    ]
    for extra in value_cases:
        add(
            [23, 1, 9, 2 * cp_size - 1, 6],
            [0, 1, 2, 3, 4],
            [DISTRIBUTED, DISTRIBUTED, 0, DISTRIBUTED, cp_size - 1],
            **{"dtype": torch.float64, "value_dim": 5, **extra},
        )
    # attention sinks: two K/V groups, a window inside a chunk, narrower values, float32
    sink_cases = [
        dict(kv_groups=(2, 1)),
        dict(window=3),
        dict(dtype=torch.float32, value_dim=5, scale=0.3),
    ]
    for extra in sink_cases:
        add(
            [23, 1, 9, 2 * cp_size - 1, 6],
            [0, 1, 2, 3, 4],
            [DISTRIBUTED, DISTRIBUTED, 0, DISTRIBUTED, cp_size - 1],
            **{"dtype": torch.float64, "sink": True, **extra},
        )
    return cases


def _sequence_data(case: Case, sid: int) -> dict[str, torch.Tensor]:
    """q, k, v and the output gradient of one whole sequence, identical in every process."""
    gen = torch.Generator().manual_seed(case.seed * 100 + sid)
    length = case.lengths[sid]
    shapes = {
        "q": (length, case.num_heads, HEAD_DIM),
        "k": (length, case.num_kv_heads, HEAD_DIM),
        "v": (length, case.num_kv_heads, case.value_dim),
        "grad_out": (length, case.num_heads, case.value_dim),
    }
    return {
        name: torch.randn(shape, generator=gen, dtype=torch.float64).to(case.dtype)
        for name, shape in shapes.items()
    }


def _broken(layout: Any) -> Any:
    """A layout whose index map sends distributed tokens to the wrong gathered rows."""
    return dataclasses.replace(layout, gather_index=tuple(reversed(layout.gather_index)))


def _run_all(rank: int, world_size: int, cases: dict[int, list[Case]]) -> dict[int, list[Any]]:
    """Every CP size's cases in one world: CP group = ranks ``[0, cp_size)``, as many as needed."""
    results = {}
    for cp_size, cp_cases in sorted(cases.items()):
        group = dist.new_group(list(range(cp_size)))  # every rank takes part in new_group
        if rank < cp_size:
            results[cp_size] = _run_cases(rank, cp_size, group, cp_cases)
    return results


def _run_cases(rank: int, cp_size: int, group: Any, cases: list[Case]) -> list[dict[str, Any]]:
    results = []
    with count_exchanged_bytes() as log:  # the collectives' calls, whatever torch names them
        for case in cases:
            layout = build_rank_layout(
                case.sequence_ids,
                case.placement,
                case.lengths,
                cp_rank=rank,
                cp_size=cp_size,
                kv_groups=case.kv_groups,
            )
            data = {sid: _sequence_data(case, sid) for sid in case.sequence_ids}
            packed = {
                name: pack(layout, {sid: d[name] for sid, d in data.items()})
                for name in ("q", "k", "v", "grad_out")
            }
            q, k, v = (packed[n].clone().requires_grad_() for n in ("q", "k", "v"))
            used = _broken(layout) if case.broken else layout
            ctx = SkrullAttentionContext.build(used, group=group, backend="sdpa")
            sink = _sink(case).requires_grad_() if case.sink else None
            before = log.calls
            with attention_context(ctx):
                out, weights = skrull_attention_forward(
                    None,
                    q.transpose(0, 1).unsqueeze(0),
                    k.transpose(0, 1).unsqueeze(0),
                    v.transpose(0, 1).unsqueeze(0),
                    None,
                    scaling=case.scale,
                    sliding_window=case.window,
                    s_aux=sink,
                )
            width = case.value_dim
            assert weights is None and out.shape == (1, layout.num_tokens, case.num_heads, width)
            # backward runs outside the context: the collective saved its group at forward
            out[0].backward(packed["grad_out"])
            results.append(
                {
                    "out": out[0].detach().numpy(),
                    # a rank without tokens gets no gradient at all (None): zero rows then
                    **{
                        name: (t.grad if t.grad is not None else torch.zeros_like(t)).numpy()
                        for name, t in (("dq", q), ("dk", k), ("dv", v))
                    },
                    "dsink": None
                    if sink is None
                    else (sink.grad if sink.grad is not None else torch.zeros_like(sink)).numpy(),
                    "all_gather": log.calls["all_gather"] - before["all_gather"],
                    "reduce_scatter": log.calls["reduce_scatter"] - before["reduce_scatter"],
                }
            )
    return results


def _reference(case: Case, sid: int) -> dict[str, torch.Tensor]:
    """Plain causal SDPA on the whole sequence in float64, K/V heads repeated for GQA; with a
    window, under transformers' own sliding-window causal mask."""
    d = {name: t.to(torch.float64) for name, t in _sequence_data(case, sid).items()}
    q, k, v = (d[n].clone().requires_grad_() for n in ("q", "k", "v"))
    if case.sink:
        sink = _sink(case).to(torch.float64).requires_grad_()
        out = sink_reference(q, k, v, sink, case.window, case.scale)
        out.backward(d["grad_out"])
        return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "dsink": sink.grad}
    out = window_reference(q, k, v, case.window, case.scale)
    out.backward(d["grad_out"])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _mismatches(case: Case, per_rank: list[dict[str, Any]]) -> list[str]:
    """Every (sequence, tensor) where the ranks' result differs from the reference."""
    layouts = build_rank_layouts(
        case.sequence_ids,
        case.placement,
        case.lengths,
        cp_size=len(per_rank),
        kv_groups=case.kv_groups,
    )
    tol = TOLERANCE[case.dtype]
    problems = []
    references = {sid: _reference(case, sid) for sid in case.sequence_ids}
    if case.sink:  # each rank's gradient from its queries; summed, as the strategies reduce it
        got_sink = sum(torch.from_numpy(np.asarray(r["dsink"])).double() for r in per_rank)
        want_sink = sum(references[sid]["dsink"] for sid in case.sequence_ids)
        err = (got_sink - want_sink).abs().max().item()
        if not err <= tol * max(1.0, want_sink.abs().max().item()):
            problems.append(f"sink gradient: max error {err:.3g} > {tol:g}")
    for name in ("out", "dq", "dk", "dv"):
        got = unpack(layouts, [torch.from_numpy(np.asarray(r[name])) for r in per_rank])
        for sid in case.sequence_ids:
            want = references[sid][name]
            err = (got[sid].to(torch.float64) - want).abs().max().item()
            if not err <= tol * max(1.0, want.abs().max().item()):
                problems.append(f"sequence {sid} {name}: max error {err:.3g} > {tol:g}")
    return problems


CP_SIZES = (2, 3, 4)


@pytest.fixture(scope="module")
def cp_results() -> dict[int, tuple[list[Case], list[list[dict[str, Any]]]]]:
    """One spawn of max(CP_SIZES) processes runs the cases of every CP size."""
    cases = {cp_size: _make_cases(cp_size, seed=cp_size) for cp_size in CP_SIZES}
    by_rank = spawn(_run_all, max(CP_SIZES), cases, timeout=300)
    return {
        cp_size: (cases[cp_size], [by_rank[rank][cp_size] for rank in range(cp_size)])
        for cp_size in CP_SIZES
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_context_parallel_attention_equals_sdpa_on_whole_sequences(
    cp_size: int, cp_results: dict[int, tuple[list[Case], list[list[dict[str, Any]]]]]
) -> None:
    cases, results = cp_results[cp_size]
    checked_broken = 0
    checked_groups: set[int] = set()
    windows_that_bite = 0
    for i, case in enumerate(cases):
        per_rank = [results[rank][i] for rank in range(cp_size)]
        problems = _mismatches(case, per_rank)
        if case.broken:
            assert problems, f"case {i}: the checker missed a deliberately wrong layout"
            checked_broken += 1
            continue
        assert not problems, f"case {i} ({case}):\n" + "\n".join(problems)
        # exactly one all-gather and one reduce-scatter per K/V group and rank when something
        # is distributed (one group unless kv_groups cuts them), none otherwise
        groups = len(case.kv_groups) or 1
        expected = groups if DISTRIBUTED in case.placement else 0
        for rank, r in enumerate(per_rank):
            assert (r["all_gather"], r["reduce_scatter"]) == (expected, expected), (i, rank, r)
        checked_groups.add(groups)
        if case.window is not None and case.window < max(
            case.lengths[s] for s in case.sequence_ids
        ):
            # the window changes the result here: full causal attention would be flagged
            full = dataclasses.replace(case, window=None)
            assert _mismatches(full, per_rank), f"case {i}: window {case.window} changed nothing"
            windows_that_bite += 1
    assert checked_broken == 1
    assert checked_groups >= {1, 2, 3}
    assert sum(case.value_dim != HEAD_DIM for case in cases) == 4  # MLA's narrower values
    assert sum(case.sink for case in cases) == 3
    for i, case in enumerate(cases):  # the sinks change the result: ignoring them is flagged
        if case.sink:
            per_rank = [results[rank][i] for rank in range(cp_size)]
            assert _mismatches(dataclasses.replace(case, sink=False), per_rank), i
    assert windows_that_bite >= 4
