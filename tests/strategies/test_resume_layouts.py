"""A run resumed on another layout (number of processes, ``cp_size``) continues the same training.

One optimizer step is one global batch whatever the layout, and the loader's position is a
global-batch index, so a checkpoint written at one layout and resumed at another must give the
same global batches in the same order and, to float32 rounding, the same parameters as the run
that never stopped.

Two spawns:

- 2 processes write: for each strategy, 4 steps at DP=1 x CP=2 with a checkpoint after every
  step (the uninterrupted run), and 2 steps at DP=2 x CP=1 with its checkpoint, which the same
  processes then resume at DP=1 x CP=2 (``cp_size`` changed, world size kept).
- 4 processes resume the DP=1 x CP=2 checkpoint of step 2 at DP=2 x CP=2. DDP and FSDP
  (``shard="cp"`` and ``shard="world"``: the sharded checkpoint is read onto another mesh, a
  2 x 2 one for ``"cp"``, 4 ranks for ``"world"`` where it was written on 2) continue; ZeRO-2,
  whose optimizer partitions belong to the process count they were written at, is refused.
  The same processes resume the DDP file under FSDP, and give each strategy a checkpoint of
  another that it cannot read (refused, naming what wrote it and the fix).

DDP and FSDP (``shard="cp"``) run every layout in ``bf16-mixed`` too, held to the rule of
tests/strategies/test_precision_matrix.py against single-process training in their dtypes.

The uninterrupted run is compared with single-process training of the global batches it
recorded (plain Hugging Face, SGD with momentum: the momentum buffers make the optimizer state
matter). Loader-level cases (no process group) check the data position alone.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
from typing import Any

import numpy as np
import pytest
from helpers import (
    BUCKET,
    GLOBAL_BATCH,
    PARAM_ATOL,
    BatchRecorder,
    PlainLM,
    bf16_policy_training,
    cpu_trainer,
    make_data,
    max_diff,
    momentum_training,
    one_thread,
    reference_model,
    skrull_planner,
    skrull_strategy,
    trained_params,
)
from precision_rule import FLOOR, RATIO, relative_distance, update

from lightning_skrull.runtime.launch import spawn

MOMENTUM = 0.9
STEPS = 4  # 24 samples in global batches of 8: epoch 0 is steps 1-3, step 4 opens epoch 1
SEED = 6  # shuffle seed: the DP ranks run 3 and 2, then 2 and 3 micro-batches in steps 3 and 4
STRATEGIES = ("ddp", "fsdp", "fsdp_world", "zero2")
# the same layouts in bf16-mixed (ZeRO-2's refusal does not depend on the precision)
BF16_STRATEGIES = ("ddp_bf16", "fsdp_bf16")


def _strategy(name: str, cp_size: int) -> Any:
    # at cp_size=1 one rank must hold the longest sample (69 tokens) alone
    bucket_size = BUCKET * 2 // cp_size
    return skrull_strategy(name.removesuffix("_bf16"), cp_size=cp_size, bucket_size=bucket_size)


def _fit(
    name: str,
    cp_size: int,
    steps: int,
    *,
    save_to: str | None = None,
    ckpt_path: str | None = None,
) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_skrull import SkrullDataModule

    recorder = BatchRecorder()
    callbacks: list[Any] = [recorder]
    if save_to is not None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=save_to, filename="{step}", every_n_train_steps=1, save_top_k=-1
            )
        )
    strategy = _strategy(name, cp_size)
    trainer = cpu_trainer(
        strategy,
        max_steps=steps,
        callbacks=callbacks,
        enable_checkpointing=save_to is not None,
        precision="bf16-mixed" if name.endswith("_bf16") else "32-true",
    )
    module = PlainLM(momentum=MOMENTUM)
    data = SkrullDataModule(train_data=make_data(), global_batch_size=GLOBAL_BATCH, seed=SEED)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trained_params(module.model, strategy), recorder.steps


def _write(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    started = 0.0
    for name in STRATEGIES + BF16_STRATEGIES:
        if name == BF16_STRATEGIES[0]:
            started = time.perf_counter()
        # DP=2 x CP=1, 2 steps: the checkpoint these processes resume below at DP=1 x CP=2
        _fit(name, 1, 2, save_to=os.path.join(tmp, name, "dp2_cp1"))
        out[name] = {
            "whole": _fit(name, 2, STEPS, save_to=os.path.join(tmp, name, "dp1_cp2")),
            "cp_changed": _fit(
                name, 2, STEPS, ckpt_path=os.path.join(tmp, name, "dp2_cp1", "step=2.ckpt")
            ),
        }
    out["bf16_seconds"] = time.perf_counter() - started
    return out


def _resume(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    started = 0.0
    for name in STRATEGIES + BF16_STRATEGIES:
        if name == BF16_STRATEGIES[0]:
            started = time.perf_counter()
        path = os.path.join(tmp, name, "dp1_cp2", "step=2.ckpt")
        if name == "zero2":
            with pytest.raises(ValueError) as refused:
                _fit(name, 2, STEPS, ckpt_path=path)
            out[name] = str(refused.value)
        else:
            out[name] = _fit(name, 2, STEPS, ckpt_path=path)
    out["bf16_seconds"] = time.perf_counter() - started

    # another strategy's checkpoint (written at DP=1 x CP=2): SkrullFSDPStrategy resumes
    # SkrullStrategy's file; the folders, and a file given to ZeRO-2, are refused when loaded
    def written(writer: str) -> str:
        return os.path.join(tmp, writer, "dp1_cp2", "step=2.ckpt")

    out["fsdp from ddp"] = _fit("fsdp", 2, STEPS, ckpt_path=written("ddp"))
    for reader, writer in (("ddp", "fsdp"), ("ddp", "zero2"), ("fsdp", "zero2"), ("zero2", "ddp")):
        with pytest.raises(ValueError) as refused:
            _fit(reader, 2, STEPS, ckpt_path=written(writer))
        out[f"{reader} from {writer}"] = str(refused.value)
    return out


@functools.cache
def _reference(batches: tuple[tuple[int, ...], ...], kind: str = "float32") -> dict[str, Any]:
    """Plain HF training of ``batches`` (sample indices) on one process, SGD with momentum:
    ``kind`` ``"float32"``; ``"autocast"`` (the forward under ``torch.autocast("cpu",
    bfloat16)``, float32 gradients and SGD: DDP's bf16-mixed); ``"policy"`` (FSDP2's bf16
    policy, :func:`~helpers.bf16_policy_training`)."""
    if kind == "policy":
        _, after = bf16_policy_training(
            reference_model, make_data(), len(batches), batches=batches, momentum=MOMENTUM
        )
        return after
    with one_thread():
        *_, model = momentum_training(batches, MOMENTUM, autocast=kind == "autocast")
    return {k: v.detach().double().numpy() for k, v in model.state_dict().items()}


def _global_batches(runs: list[list[dict[str, Any]]]) -> list[tuple[int, int, list[int]]]:
    """``(epoch, index, sorted sample indices)`` of each step, joined over the DP ranks (the CP
    ranks of a DP rank share its micro-batches), from each rank's recorded steps."""
    batches: dict[tuple[int, int], list[int]] = {}
    for steps in runs:
        for step in steps:
            if step["cp_rank"] == 0:
                batches.setdefault((step["epoch"], step["index"]), []).extend(step["samples"])
    return [(epoch, index, sorted(samples)) for (epoch, index), samples in sorted(batches.items())]


Runs = tuple[list[dict[str, Any]], list[dict[str, Any]]]


@pytest.fixture(scope="module")
def runs() -> Runs:
    with tempfile.TemporaryDirectory() as tmp:
        written = spawn(_write, 2, tmp, timeout=900)
        resumed = spawn(_resume, 4, tmp, timeout=900)
    return written, resumed


# Float32 throughout. The layouts sum the same token terms in other orders (packing, CP shards,
# gloo's sum over 1 or 2 DP ranks), so parameters agree to float32 rounding, not bit for bit;
# the momentum carries each step's rounding into the next. Measured after 4 steps of lr 0.5,
# momentum 0.9: at most 1.2e-7 between layouts (7e-9 for DDP resumed on 4 processes) and 1.2e-7
# from the single-process reference. A resume that lost the momentum buffers or a global batch
# would move the parameters by about lr * gradient, orders of magnitude more.
LAYOUT_ATOL = 1e-6


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", STRATEGIES)
def test_uninterrupted_run_equals_single_process_training(runs: Runs, name: str) -> None:
    written, _ = runs
    batches = _global_batches([out[name]["whole"][1] for out in written])
    assert [(epoch, index) for epoch, index, _ in batches] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    # every sample once in epoch 0 (steps 1-3)
    assert sorted(i for epoch, _, samples in batches if epoch == 0 for i in samples) == list(
        range(len(make_data()))
    )
    expected = _reference(tuple(tuple(samples) for _, _, samples in batches))
    for out in written:
        params = out[name]["whole"][0]
        if params:  # FSDP gathers the full weights on rank 0 only
            assert max_diff(params, expected) < PARAM_ATOL


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["ddp", "fsdp", "fsdp_world"])
def test_resume_on_four_processes_continues_the_two_process_run(runs: Runs, name: str) -> None:
    written, resumed = runs
    whole = _global_batches([out[name]["whole"][1] for out in written])
    # written at DP=1 x CP=2 after step 2, resumed at DP=2 x CP=2: steps 3 and 4 of the run
    assert _global_batches([out[name][1] for out in resumed]) == whole[2:]
    for out in resumed:
        if out[name][0]:
            assert max_diff(out[name][0], written[0][name]["whole"][0]) < LAYOUT_ATOL
    # the resumed steps give the two DP ranks different micro-batch counts
    steps = resumed[0][name][1]
    assert len(steps) == 2 and all(s["max"] != s["min"] for s in steps)
    planned = {(s["index"], s["dp_rank"]): s["planned"] for out in resumed for s in out[name][1]}
    assert all(planned[(i, 0)] != planned[(i, 1)] for i in (2, 0))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", STRATEGIES)
def test_resume_with_another_cp_size_continues_the_run(runs: Runs, name: str) -> None:
    written, _ = runs
    # written at DP=2 x CP=1 after step 2, resumed at DP=1 x CP=2 on the same two processes
    whole = _global_batches([out[name]["whole"][1] for out in written])
    assert _global_batches([out[name]["cp_changed"][1] for out in written]) == whole[2:]
    for out in written:
        if out[name]["cp_changed"][0]:
            assert max_diff(out[name]["cp_changed"][0], out[name]["whole"][0]) < LAYOUT_ATOL


@pytest.mark.multiprocess
def test_fsdp_resumes_the_ddp_checkpoint_file(runs: Runs) -> None:
    """``SkrullFSDPStrategy`` resumes ``SkrullStrategy``'s checkpoint file (weights, momentum
    and loader position), here on 4 processes from a 2-process run: the same batches and
    parameters as the DDP run that never stopped (:data:`LAYOUT_ATOL`)."""
    written, resumed = runs
    whole = _global_batches([out["ddp"]["whole"][1] for out in written])
    assert _global_batches([out["fsdp from ddp"][1] for out in resumed]) == whole[2:]
    gathered = [out["fsdp from ddp"][0] for out in resumed if out["fsdp from ddp"][0]]
    assert gathered  # FSDP gathers the full weights on rank 0
    for params in gathered:
        assert max_diff(params, written[0]["ddp"]["whole"][0]) < LAYOUT_ATOL
    steps = resumed[0]["fsdp from ddp"][1]
    assert all(s["max"] != s["min"] for s in steps)  # the DP ranks ran different counts


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("case", "strategy", "written_by", "fix"),
    [
        (
            "ddp from fsdp",
            "SkrullStrategy",
            "a folder of torch.distributed.checkpoint shards",
            "consolidate",
        ),
        ("ddp from zero2", "SkrullStrategy", "a DeepSpeed checkpoint folder", "convert_zero"),
        ("fsdp from zero2", "SkrullFSDPStrategy", "a DeepSpeed checkpoint folder", "convert_zero"),
        ("zero2 from ddp", "SkrullZero2Strategy", "a single checkpoint file", "Resume it with"),
    ],
)
def test_another_strategys_checkpoint_is_refused_with_the_way_forward(
    runs: Runs, case: str, strategy: str, written_by: str, fix: str
) -> None:
    """A checkpoint that the strategy cannot read is refused when loaded, on every rank, with
    what wrote it and what to do (before: ``IsADirectoryError`` from ``torch.load``, or
    DeepSpeed's and Lightning's messages without the strategy that wrote it)."""
    _, resumed = runs
    for out in resumed:
        message = out[case]
        assert message.startswith(f"{strategy} cannot read the checkpoint "), message
        assert f"it is {written_by}" in message, message
        assert fix in message, message


def test_checkpoint_kinds_are_read_from_the_files(tmp_path: Any) -> None:
    from lightning_skrull.strategies.checkpoint_kinds import checkpoint_kind, refuse_other_kind

    (tmp_path / "model.ckpt").write_bytes(b"")
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "latest").write_text("checkpoint")
    (tmp_path / "other").mkdir()
    kinds = {n: checkpoint_kind(tmp_path / n) for n in ("model.ckpt", "dcp", "ds", "other")}
    assert kinds == {
        "model.ckpt": "file",
        "dcp": "distributed",
        "ds": "deepspeed",
        "other": "folder",
    }
    refuse_other_kind("SkrullStrategy", tmp_path / "model.ckpt", ("file",))
    refuse_other_kind("SkrullStrategy", tmp_path / "missing.ckpt", ("file",))  # Lightning's error
    with pytest.raises(ValueError, match=r"a folder that is neither .* Pass the checkpoint file"):
        refuse_other_kind("SkrullStrategy", tmp_path / "other", ("file",))


# bf16-mixed: docs/precision.md's rule (tests/strategies/test_precision_matrix.py). The distance of the
# 4-step update of each run (written uninterrupted at DP=1 x CP=2, resumed at DP=2 x CP=2 on 4
# processes, resumed at DP=1 x CP=2 from DP=2 x CP=1) to the float32 reference's update of the
# same global batches, relative to the latter, at most RATIO x that of single-process training
# in the run's dtypes (bf16 autocast for DDP, FSDP2's policy for FSDP) plus FLOOR. Measured
# (uninterrupted / resumed on 4 processes / resumed with cp_size 2 from 1; reference, bound):
# DDP 3.6e-3 / 3.6e-3 / 3.5e-3; 4.5e-3, 9.9e-3. FSDP 5.4e-3 / 5.4e-3 / 5.5e-3; 6.1e-3, 1.3e-2.
# Every update scaled by 1.05 lies 5.0e-2 away.


def _bf16_distances(runs: Runs, name: str) -> dict[str, Any]:
    """For ``name`` (a :data:`BF16_STRATEGIES` entry): the recorded global batches, the
    distances of each run's update to the float32 update, d(ref), and each update scaled by
    1.05's distance."""
    written, resumed = runs
    batches = _global_batches([out[name]["whole"][1] for out in written])
    key = tuple(tuple(samples) for _, _, samples in batches)
    before = {k: v.detach().double().numpy() for k, v in reference_model().state_dict().items()}
    delta_fp32 = update(before, _reference(key))
    kind = "policy" if name.startswith("fsdp") else "autocast"
    ref_distance = relative_distance(update(before, _reference(key, kind)), delta_fp32)
    cells = {
        "whole": [out[name]["whole"][0] for out in written],
        "cp_changed": [out[name]["cp_changed"][0] for out in written],
        "four_processes": [out[name][0] for out in resumed],
    }
    distances: dict[str, list[tuple[float, float]]] = {}
    for cell, params in cells.items():
        distances[cell] = []
        for p in params:
            if p:  # FSDP gathers the full weights on rank 0 only
                delta = update(before, {k: v.astype(np.float64) for k, v in p.items()})
                distances[cell].append(
                    (
                        relative_distance(delta, delta_fp32),
                        relative_distance(1.05 * delta, delta_fp32),
                    )
                )
    return {"batches": batches, "ref": ref_distance, "cells": distances}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", BF16_STRATEGIES)
def test_bf16_mixed_resume_on_other_layouts_as_close_to_float32_as_single_process(
    runs: Runs, name: str
) -> None:
    written, resumed = runs
    measured = _bf16_distances(runs, name)
    whole = measured["batches"]
    assert [(epoch, index) for epoch, index, _ in whole] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert _global_batches([out[name][1] for out in resumed]) == whole[2:]
    assert _global_batches([out[name]["cp_changed"][1] for out in written]) == whole[2:]
    assert measured["ref"] > FLOOR  # the reference's bf16 rounding shows
    bound = RATIO * measured["ref"] + FLOOR
    for cell, distances in measured["cells"].items():
        assert distances, cell
        for distance, five_percent_off in distances:
            assert distance <= bound, (cell, distance, measured["ref"])
            assert five_percent_off > bound, (cell, five_percent_off)
    # the resumed steps give the two DP ranks different micro-batch counts
    steps = resumed[0][name][1]
    assert len(steps) == 2 and all(s["max"] != s["min"] for s in steps)


@pytest.mark.multiprocess
def test_zero2_resume_on_another_process_count_is_refused(runs: Runs) -> None:
    _, resumed = runs
    for out in resumed:
        message = out["zero2"]
        assert "2 ZeRO-2 partitions" in message and "4 processes (DP=2 x CP=2)" in message
        assert "Resume on 2 processes" in message


# ----------------------------------------------------------------------------- one process
def _loader(
    dp_rank: int, cp_rank: int, dp_size: int, cp_size: int, *, max_tokens: int | None = None
) -> Any:
    from lightning_skrull.data import GlobalBatchSampler, load_sft_data
    from lightning_skrull.data.loader import GlobalBatchStream, SkrullDataLoader

    dataset = load_sft_data(make_data())
    if max_tokens is not None:
        with pytest.warns(UserWarning, match="Truncated"):
            dataset.validate(max_tokens=max_tokens, truncate=True)
    sampler = GlobalBatchSampler(len(dataset), GLOBAL_BATCH, shuffle=True, seed=SEED)
    planner = skrull_planner(
        dp_size=dp_size,
        cp_size=cp_size,
        dp_rank=dp_rank,
        cp_rank=cp_rank,
        bucket_size=BUCKET * 2 // cp_size,
    )
    return SkrullDataLoader(GlobalBatchStream(dataset, sampler, planner))


def _loader_batches(dp_size: int, cp_size: int, state: dict[str, Any] | None) -> list[Any]:
    """Global batches of every DP rank's loader (from ``state`` when given)."""
    batches: dict[tuple[int, int], list[int]] = {}
    for dp_rank in range(dp_size):
        dl = _loader(dp_rank, 0, dp_size, cp_size)
        if state is not None:
            dl.load_state_dict(state)
        for b in dl:
            samples = batches.setdefault((b.epoch, b.index), [])
            for mb in b.rank_batch.micro_batches:
                samples.extend(mb.sample_indices)
    return [(key, sorted(samples)) for key, samples in sorted(batches.items())]


def test_loader_state_holds_no_layout() -> None:
    dl = _loader(0, 1, 1, 2)
    it = iter(dl)
    next(it), next(it)
    state = dl.state_dict()
    whole = _loader_batches(1, 2, None)
    # written by a DP=1 x CP=2 rank, read by every rank of DP=4 x CP=1 and of DP=2 x CP=2
    assert _loader_batches(4, 1, state) == whole[2:]
    assert _loader_batches(2, 2, state) == whole[2:]


def test_resume_with_other_truncation_is_refused() -> None:
    # truncate=True cuts samples to cp_size * bucket_size: 64 tokens written, 32 when resumed
    state = _loader(0, 0, 1, 2, max_tokens=64).state_dict()
    _loader(0, 0, 1, 2, max_tokens=64).load_state_dict(state)  # the same cut resumes
    with pytest.raises(ValueError, match=r"held \d+ tokens in all, this run's hold \d+"):
        _loader(0, 0, 1, 1, max_tokens=32).load_state_dict(state)
