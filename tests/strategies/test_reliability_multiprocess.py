"""Nothing lost, nothing doubled, identical plans, faults that end cleanly, exact repeats.

Real ``Trainer.fit`` runs on two CPU processes (gloo), a tiny Qwen2, 21 samples in global batches
of 8 (so every epoch ends with a partial batch of 5):

- two ranks started like ``torchrun`` does (``RANK`` / ``LOCAL_RANK`` in the environment, this
  file as the training script: ``python <this file> kill DIR``) train with a checkpoint every
  step; rank 0 is killed with SIGKILL between two steps. The other rank must exit non-zero
  within a bounded time (no hang).
- one ``spawn`` then holds every other case: each sample's every token trained exactly once per
  epoch (DP=2 with and without shuffling, CP=2 shuffled), two runs with the same seed giving
  bit-identical losses and parameters (also against the separately launched run), the killed
  run resumed from its last checkpoint ending with the parameters of the uninterrupted run,
  ranks holding different data (reordered samples, other token ids, one label masked on one
  rank only) stopped at the first step, and last, a run in which rank 1 raises in the middle of
  a step: both processes must end non-zero within a bounded time, with the original error
  shown. The results of the earlier cases are saved before that fault.

Process start-up (imports) dominates the time, so there are just these two launches.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import numpy as np
import pytest
import torch
from helpers import PlainLM, cpu_trainer, make_data

NUM_SAMPLES = 21
LONGEST = 45  # samples of 3..45 tokens
GLOBAL_BATCH = 8  # 21 samples: batches of 8, 8 and a partial 5
STEPS_PER_EPOCH = 3
EPOCHS = 2
BUCKET = 24  # CP=2: several micro-batches per step, samples of up to 45 tokens are sharded
BUCKET_DP = 48  # CP=1 holds whole samples: several micro-batches per step, the longest fits
# Runs compared bit for bit (the same seed twice, resumed against uninterrupted) pin the cost
# model: online calibration refits it from measured times, so two runs plan alike only up to
# the first refit that takes effect (batch 4 here, within the 6 steps).
CALIBRATION = "off"
KILL_AT = 4  # rank 0 is killed before step 4 starts: after epoch 0 and one step of epoch 1
FAULT_STEP, FAULT_MICRO_BATCH = 1, 1
FAULT_MESSAGE = "injected fault on rank 1 in step 1, micro-batch 1"
EXIT_BOUND_S = 60.0  # the default process-group timeout is 30 minutes: only propagation is fast
WORLD = 2
SCRIPT = Path(__file__).resolve()


class TinyLM(PlainLM):
    """The plain module of the documentation (SGD with momentum), with an optional injected
    fault."""

    def __init__(self, fault_rank: int | None = None) -> None:
        super().__init__(momentum=0.9)
        self.fault_rank = fault_rank
        self.micro_batch = 0

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.micro_batch = 0

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if (
            self.global_rank == self.fault_rank
            and self.global_step == FAULT_STEP
            and self.micro_batch == FAULT_MICRO_BATCH
        ):
            _write(_out_dir() / "fault_time", repr(time.time()))
            raise RuntimeError(FAULT_MESSAGE)
        self.micro_batch += 1
        return self.model(**batch).loss


class Recorder(L.Callback):
    """Per training step of this rank: the batch's place, every token trained, the loss."""

    def __init__(self, path: Path | None = None) -> None:
        self.steps: list[dict[str, Any]] = []
        self.path = path

    def on_train_batch_end(
        self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        rb = batch.rank_batch
        tokens = []  # (dataset index, position in the sample, token id) of every trained token
        for mb in rb.micro_batches:
            ids = mb.inputs["input_ids"][0].tolist()
            seqs, positions = mb.layout.token_sequence_ids, mb.layout.position_ids
            for token, sid, pos in zip(ids, seqs, positions, strict=True):
                if sid < len(rb.sample_indices):  # placeholders have ids past the batch
                    tokens.append([rb.sample_indices[sid], pos, token])
        step = {
            "epoch": batch.epoch,
            "index": batch.index,
            "cp_rank": rb.cp_rank,
            "samples": sorted({i for mb in rb.micro_batches for i in mb.sample_indices}),
            "tokens": tokens,
            "max_tokens": max(mb.num_tokens for mb in rb.micro_batches),
            "bucket": rb.plan.bucket_size,
            "loss": float(outputs["loss"]),
        }
        self.steps.append(step)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(step) + "\n")


class KillBeforeStep(L.Callback):
    """SIGKILL rank 0 right before step ``KILL_AT`` (its checkpoint of the step before is saved)."""

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, i: int) -> None:
        if trainer.global_step == KILL_AT and trainer.global_rank == 0:
            _write(_out_dir() / "kill_time", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)


def _out_dir() -> Path:
    return Path(os.environ["SKRULL_TEST_OUT"])


def _write(path: Path, text: str) -> None:
    path.write_text(text)


def _trainer(strategy: Any, callbacks: list[Any], **kwargs: Any) -> L.Trainer:
    # devices given: the separately launched ranks build their Trainer before a process group
    return cpu_trainer(
        strategy, **{"devices": WORLD, "max_epochs": EPOCHS, **kwargs}, callbacks=callbacks
    )


def _params(module: TinyLM) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in module.model.state_dict().items()}


def fit_cp2(
    *,
    record: Path | None = None,
    ckpt_dir: Path | None = None,
    ckpt_path: str | None = None,
    kill: bool = False,
) -> tuple[TinyLM, Recorder]:
    """DP=1 x CP=2, shuffled: the run that is killed, resumed, and run uninterrupted."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_skrull import SkrullDataModule, SkrullStrategy

    recorder = Recorder(record)
    callbacks: list[Any] = [recorder]
    if ckpt_dir is not None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=ckpt_dir, filename="{step}", every_n_train_steps=1, save_top_k=-1
            )
        )
    if kill:
        callbacks.append(KillBeforeStep())
    trainer = _trainer(
        SkrullStrategy(cp_size=2, bucket_size=BUCKET, calibration=CALIBRATION),
        callbacks,
        enable_checkpointing=ckpt_dir is not None,
    )
    module = TinyLM()
    data = SkrullDataModule(
        make_data(NUM_SAMPLES, longest=LONGEST), global_batch_size=GLOBAL_BATCH, seed=3
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return module, recorder


# ----------------------------------------------------------------------------- the spawn
def _error_of(fn: Any) -> str:
    try:
        fn()
    except Exception as err:  # the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return "no error"


def _spawn_cases(rank: int, world_size: int, killed_dir: str, out_dir: str) -> str:
    from lightning_skrull import SkrullDataModule, SkrullStrategy

    os.environ["SKRULL_TEST_OUT"] = out_dir
    out: dict[str, Any] = {}

    def fit_dp2(shuffle: bool) -> tuple[TinyLM, Recorder]:
        recorder = Recorder()
        trainer = _trainer(
            SkrullStrategy(cp_size=1, bucket_size=BUCKET_DP, calibration=CALIBRATION), [recorder]
        )
        module = TinyLM()
        data = SkrullDataModule(
            make_data(NUM_SAMPLES, longest=LONGEST), global_batch_size=GLOBAL_BATCH, shuffle=shuffle
        )
        trainer.fit(module, data)
        return module, recorder

    out["dp2_ordered"] = fit_dp2(shuffle=False)[1].steps
    module, recorder = fit_dp2(shuffle=True)
    out["dp2_shuffled"], out["dp2_shuffled_params"] = recorder.steps, _params(module)
    module, recorder = fit_dp2(shuffle=True)
    out["dp2_again"], out["dp2_again_params"] = recorder.steps, _params(module)

    module, recorder = fit_cp2()
    out["cp2_whole"], out["cp2_whole_params"] = recorder.steps, _params(module)
    ckpts = sorted(Path(killed_dir, "ckpt").glob("step=*.ckpt"), key=lambda p: int(p.stem[5:]))
    out["resumed_from"] = ckpts[-1].name  # the last checkpoint the killed run wrote
    module, recorder = fit_cp2(ckpt_path=str(ckpts[-1]))
    out["cp2_resumed"], out["cp2_resumed_params"] = recorder.steps, _params(module)

    # ranks holding different data: stopped with a clear error at the first step, no hang
    def mismatched(cp_size: int, data: list[dict[str, list[int]]]) -> str:
        strategy = SkrullStrategy(cp_size=cp_size, bucket_size=BUCKET * (3 - cp_size))
        trainer = _trainer(strategy, [], max_steps=2)
        module = TinyLM()
        dm = SkrullDataModule(data, global_batch_size=GLOBAL_BATCH, shuffle=False)
        message = _error_of(lambda: trainer.fit(module, dm))
        return f"{message} | steps done: {trainer.global_step}"

    data = make_data(NUM_SAMPLES, longest=LONGEST)
    out["reordered"] = mismatched(1, data[::-1] if rank == 1 else data)
    same_length = [{"input_ids": [(7 * i + j) % 64 for j in range(10)]} for i in range(16)]
    out["same_lengths"] = mismatched(2, same_length[::-1] if rank == 1 else same_length)
    # identical input_ids, lengths and plans; rank 1 alone masks one label of sample 3 (not its
    # first, which no token predicts): only the checksum of the labels tells the ranks apart
    labelled = [{**s, "labels": list(s["input_ids"])} for s in same_length]
    if rank == 1:
        labelled[3]["labels"][5] = -100
    out["one_label_masked"] = mismatched(2, labelled)
    with open(Path(out_dir, f"results{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)

    # last: rank 1 raises in the middle of step 1; nothing below should be reached
    trainer = _trainer(SkrullStrategy(cp_size=2, bucket_size=BUCKET), [], max_steps=3)
    trainer.fit(
        TinyLM(fault_rank=1),
        SkrullDataModule(make_data(NUM_SAMPLES, longest=LONGEST), GLOBAL_BATCH, seed=3),
    )
    return "the injected fault did not stop the run"


# ----------------------------------------------------------------------------- launches
def _launch_env(out_dir: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"SKRULL_TEST_OUT": str(out_dir), "PYTHONUNBUFFERED": "1", **extra})
    # the script imports the test support modules of tests/, one folder up
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parents[1]), env.get("PYTHONPATH", "")])
    return env


def _run_killed(out_dir: Path) -> dict[str, Any]:
    """Two ranks started like torchrun does; rank 0 kills itself before step ``KILL_AT``."""
    from lightning_skrull.runtime.launch import free_port

    port = str(free_port())
    procs, logs = [], []
    for rank in range(WORLD):
        log = (out_dir / f"rank{rank}.log").open("w")
        env = _launch_env(
            out_dir,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            WORLD_SIZE=str(WORLD),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
        )
        cmd = [sys.executable, str(SCRIPT), "kill", str(out_dir)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    codes: list[int | None] = [None] * WORLD
    exit_times: list[float | None] = [None] * WORLD
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and None in codes:
        for r, p in enumerate(procs):
            if codes[r] is None and p.poll() is not None:
                codes[r], exit_times[r] = p.returncode, time.time()
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for log in logs:
        log.close()
    return {
        "codes": codes,
        "exit_times": exit_times,
        "logs": [(out_dir / f"rank{r}.log").read_text() for r in range(WORLD)],
    }


def _main(mode: str, out_dir: str) -> None:
    """The training script of the launched runs."""
    torch.set_num_threads(1)
    os.environ["SKRULL_TEST_OUT"] = out_dir
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    _write(Path(out_dir, f"pid{rank}"), str(os.getpid()))
    if mode != "kill":
        raise SystemExit(f"unknown mode {mode!r}; use 'kill'.")
    fit_cp2(record=Path(out_dir, f"steps{rank}.jsonl"), ckpt_dir=Path(out_dir, "ckpt"), kill=True)


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def workdir() -> Any:
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


@pytest.fixture(scope="module")
def killed(workdir: Path) -> dict[str, Any]:
    out = workdir / "killed"
    out.mkdir()
    result = _run_killed(out)
    steps = []
    for r in range(WORLD):
        path = out / f"steps{r}.jsonl"
        steps.append(
            [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        )
    result["steps"] = steps
    result["dir"] = str(out)
    kill_time = out / "kill_time"
    result["kill_time"] = float(kill_time.read_text()) if kill_time.exists() else None
    return result


@pytest.fixture(scope="module")
def spawn_run(killed: dict[str, Any], workdir: Path) -> dict[str, Any]:
    from lightning_skrull.runtime.launch import DistributedRunError, spawn

    out = workdir / "spawned"
    out.mkdir()
    try:
        returned = spawn(_spawn_cases, WORLD, killed["dir"], str(out), timeout=900)
        error = f"no error; the ranks returned {returned}"
    except DistributedRunError as err:
        error = str(err)
    end = time.time()
    results = []
    for r in range(WORLD):
        with open(out / f"results{r}.pkl", "rb") as f:
            results.append(pickle.load(f))
    fault_time = out / "fault_time"
    return {
        "results": results,
        "error": error,
        "end": end,
        "fault_time": float(fault_time.read_text()) if fault_time.exists() else None,
    }


@pytest.fixture(scope="module")
def spawned(spawn_run: dict[str, Any]) -> list[dict[str, Any]]:
    return spawn_run["results"]


# ----------------------------------------------------------------------------- checks
def _epochs(steps_per_rank: list[list[dict[str, Any]]]) -> dict[int, list[tuple[int, int, int]]]:
    """Every trained token of every rank, by epoch."""
    by_epoch: dict[int, list[tuple[int, int, int]]] = {}
    for steps in steps_per_rank:
        for step in steps:
            by_epoch.setdefault(step["epoch"], []).extend(map(tuple, step["tokens"]))
    return by_epoch


def assert_every_token_once_per_epoch(steps_per_rank: list[list[dict[str, Any]]]) -> None:
    data = make_data(NUM_SAMPLES, longest=LONGEST)
    expected = sorted((i, p, t) for i, s in enumerate(data) for p, t in enumerate(s["input_ids"]))
    by_epoch = _epochs(steps_per_rank)
    assert sorted(by_epoch) == list(range(EPOCHS))
    for tokens in by_epoch.values():
        # exact: every (sample, position) once, with the sample's own token there
        assert sorted(tokens) == expected
    for steps in steps_per_rank:
        assert len(steps) == EPOCHS * STEPS_PER_EPOCH
        # the budget held at run time: no rank ever held more tokens than the bucket
        assert all(s["max_tokens"] <= s["bucket"] for s in steps)
        assert {s["bucket"] for s in steps} <= {BUCKET, BUCKET_DP}


@pytest.mark.multiprocess
def test_dp2_every_sample_once_per_epoch_in_dataset_order(spawned: list[dict[str, Any]]) -> None:
    runs = [out["dp2_ordered"] for out in spawned]
    assert_every_token_once_per_epoch(runs)
    # shuffle=False: global batch k holds samples 8k .. 8k+7, the last one the 5 left over
    for epoch in range(EPOCHS):
        for k in range(STEPS_PER_EPOCH):
            held = sorted(
                i
                for steps in runs
                for s in steps
                if (s["epoch"], s["index"]) == (epoch, k)
                for i in s["samples"]
            )
            assert held == list(range(8 * k, min(8 * k + 8, NUM_SAMPLES)))
    # both DP ranks trained in every step (GDS split each global batch)
    assert all(s["samples"] for steps in runs for s in steps)


@pytest.mark.multiprocess
def test_dp2_every_sample_once_per_epoch_shuffled(spawned: list[dict[str, Any]]) -> None:
    runs = [out["dp2_shuffled"] for out in spawned]
    assert_every_token_once_per_epoch(runs)
    first = sorted(i for steps in runs for s in steps[:1] for i in s["samples"])
    assert first != list(range(8))  # the order really was shuffled
    orders = [[s["samples"] for s in runs[0] if s["epoch"] == e] for e in range(EPOCHS)]
    assert orders[0] != orders[1]  # and differently in each epoch


@pytest.mark.multiprocess
def test_cp2_every_token_once_per_epoch(spawned: list[dict[str, Any]]) -> None:
    runs = [out["cp2_whole"] for out in spawned]
    assert_every_token_once_per_epoch(runs)
    # the two CP ranks ran the same micro-batches, each with its own share of the tokens
    for a, b in zip(*runs, strict=True):
        assert a["samples"] == b["samples"] and a["cp_rank"] != b["cp_rank"]


@pytest.mark.multiprocess
def test_same_seed_gives_bit_identical_losses_and_parameters(
    spawned: list[dict[str, Any]], killed: dict[str, Any]
) -> None:
    for out in spawned:
        # the same seed twice: every loss, and every parameter, equal bit for bit
        assert [s["loss"] for s in out["dp2_shuffled"]] == [s["loss"] for s in out["dp2_again"]]
        for name, value in out["dp2_shuffled_params"].items():
            assert np.array_equal(value, out["dp2_again_params"][name])
    # ... and in separately launched processes: the killed run's steps before the kill equal
    # the uninterrupted run's, bit for bit
    for rank, out in enumerate(spawned):
        launched = [s["loss"] for s in killed["steps"][rank]]
        assert len(launched) >= KILL_AT - 1
        assert launched == [s["loss"] for s in out["cp2_whole"][: len(launched)]]


@pytest.mark.multiprocess
def test_killed_rank_ends_every_process_without_hanging(killed: dict[str, Any]) -> None:
    codes, logs = killed["codes"], killed["logs"]
    assert codes[0] == -signal.SIGKILL, logs[0][-3000:]
    assert codes[1] not in (None, 0), logs[1][-3000:]  # the survivor fails, it does not hang
    assert killed["kill_time"] is not None
    assert killed["exit_times"][1] - killed["kill_time"] < EXIT_BOUND_S
    assert "Traceback" in logs[1]  # the survivor says why it stopped


@pytest.mark.multiprocess
def test_resume_after_a_kill_equals_the_uninterrupted_run(
    spawned: list[dict[str, Any]], killed: dict[str, Any]
) -> None:
    for rank, out in enumerate(spawned):
        assert out["resumed_from"] == f"step={KILL_AT}.ckpt"
        # two ranks: every gradient all-reduce adds two numbers, which is exact in either order,
        # and the resumed run repeats the same operations, so the parameters are bit-identical
        for name, value in out["cp2_whole_params"].items():
            assert np.array_equal(value, out["cp2_resumed_params"][name]), name
        # nothing lost, nothing doubled across the kill: the killed run's steps up to its last
        # checkpoint plus the resumed steps are the uninterrupted run's steps
        before = [
            s for s in killed["steps"][rank] if s["epoch"] * STEPS_PER_EPOCH + s["index"] < KILL_AT
        ]
        key = ("epoch", "index", "samples", "tokens")
        combined = [[s[k] for k in key] for s in before + out["cp2_resumed"]]
        assert combined == [[s[k] for k in key] for s in out["cp2_whole"]]
    steps = [
        [s for s in killed["steps"][r] if s["epoch"] * STEPS_PER_EPOCH + s["index"] < KILL_AT]
        + spawned[r]["cp2_resumed"]
        for r in range(WORLD)
    ]
    assert_every_token_once_per_epoch(steps)


@pytest.mark.multiprocess
def test_ranks_with_different_data_stop_at_the_first_step(spawned: list[dict[str, Any]]) -> None:
    for out in spawned:
        # the last two have identical plans on all ranks; the last identical input_ids too
        for case in ("reordered", "same_lengths", "one_label_masked"):
            message = out[case]
            assert message.startswith("RuntimeError: rank "), message
            assert "planned different global batches or hold different samples" in message
            assert "same data in the same order" in message
            assert message.endswith("steps done: 0")


@pytest.mark.multiprocess
def test_rank_raising_mid_step_ends_every_process_with_the_error_shown(
    spawn_run: dict[str, Any],
) -> None:
    error = spawn_run["error"]
    assert spawn_run["fault_time"] is not None, error
    # every rank raised (and so exited with status 1); none timed out or hung
    assert f"rank 1 failed:\nRuntimeError: {FAULT_MESSAGE}" in error  # the original error
    assert "rank 0 failed:" in error  # its peer stopped too, on the broken collective
    assert "timed out" not in error and "exited without a result" not in error
    assert spawn_run["end"] - spawn_run["fault_time"] < EXIT_BOUND_S


if __name__ == "__main__":
    _main(*sys.argv[1:])
