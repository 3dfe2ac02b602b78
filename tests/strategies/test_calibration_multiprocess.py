"""Online calibration on 4 gloo processes (DP2 x CP2), from a model that thinks communication free.

One spawn runs every case:

- calibration on, with 2 DataLoader workers and 9 global batches per epoch: every rank ends
  with the same refitted model, different from the start; batches that the workers planned
  ahead with the starting model are planned again with the refitted one; the trained weights
  equal plain HF training on one process;
- a resume from its checkpoint (the calibrated model is restored before any step);
- calibration off (the model is left as given);
- ZeRO-2 with calibration on: it refits, every rank ends with the same cost model, and the
  weights equal plain HF training on one process;
- bf16-mixed under DDP and under ZeRO-2: the first refit adopts a model that predicts the
  slower CPU, the same on every rank.

Every rank plans every batch with the model the schedule gives it, or the per-step plan-hash
check stops the run.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

import lightning.pytorch as L
import numpy as np
import torch
from helpers import (
    BUCKET,
    GLOBAL_BATCH,
    LR,
    MIN_SLOWDOWN,
    PARAM_ATOL,
    BatchRecorder,
    PlainLM,
    cpu_trainer,
    global_batches,
    make_data,
    max_diff,
    predicted_seconds,
    reference_model,
    sgd_steps,
)

from lightning_skrull.runtime.launch import spawn

STEPS = 9  # refits after steps 3, 6 and 9 (the first within the first 10 steps)
WORKER_SAMPLES = 72  # 9 global batches per epoch: the workers plan past the first adoption


def _start_model() -> Any:
    from lightning_skrull.scheduling import CostModel

    # deliberately wrong: free communication (and an H100's FLOP/s on a CPU)
    return CostModel(comm_latency_s=0.0, comm_bandwidth=1e30)


def _reference(n: int, steps: int) -> dict[str, np.ndarray]:
    """Plain HF training on one process: global batches of ``make_data(n)`` in dataset order,
    epoch after epoch, SGD of ``LR``, the mean token loss of each global batch."""
    data = make_data(n)
    batches = len(data) // GLOBAL_BATCH
    model = reference_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    cycled = global_batches(data, batches)
    for _ in sgd_steps(model, optimizer, [cycled[step % batches] for step in range(steps)]):
        pass
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


class _Watch(L.Callback):
    """The cost model at the start, and per step the position and whether the batch was
    planned with the starting model."""

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.model = trainer.strategy.cost_model
        self.with_start: list[tuple[int, int, bool]] = []

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
        self.with_start.append((batch.epoch, batch.index, batch.planned_with == self.model))


def _params(module: L.LightningModule) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy().copy() for k, v in module.model.state_dict().items()}


def _fit(
    strategy: Any,
    steps: int,
    *,
    samples: int = 24,
    num_workers: int = 0,
    ckpt_path: str | None = None,
    precision: str = "32-true",
) -> tuple[L.Trainer, BatchRecorder, _Watch, PlainLM]:
    from lightning_skrull import SkrullDataModule

    recorder, watch = BatchRecorder(), _Watch()
    # plan and calibration statistics are logged on Lightning's logging steps only (4 and 8
    # here): the refits after steps 3 and 6 are logged one and two steps later
    trainer = cpu_trainer(
        strategy,
        max_steps=steps,
        callbacks=[recorder, watch],
        log_every_n_steps=4,
        precision=precision,
    )
    data = SkrullDataModule(
        train_data=make_data(samples),
        global_batch_size=GLOBAL_BATCH,
        shuffle=False,
        num_workers=num_workers,
    )
    module = PlainLM()
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer, recorder, watch, module


def _skrull(calibration: str) -> Any:
    from lightning_skrull import SkrullStrategy

    return SkrullStrategy(
        cp_size=2, bucket_size=BUCKET, cost_model=_start_model(), calibration=calibration
    )


def _cases(rank: int, world_size: int, ckpt_dir: str) -> dict[str, Any]:
    from lightning_skrull import SkrullZero2Strategy

    out: dict[str, Any] = {}
    trainer, recorder, watch, module = _fit(
        _skrull("online"), STEPS, samples=WORKER_SAMPLES, num_workers=2
    )
    strategy = trainer.strategy
    out["online"] = dataclasses.asdict(strategy.cost_model)
    out["online_steps"] = recorder.steps
    out["online_with_start"] = watch.with_start
    out["online_params"] = _params(module)
    out["metrics"] = sorted(k for k in trainer.callback_metrics if "calibration" in k)
    path = os.path.join(ckpt_dir, "calibrated.ckpt")
    trainer.save_checkpoint(path)

    _, _, watch, _ = _fit(_skrull("online"), STEPS + 1, samples=WORKER_SAMPLES, ckpt_path=path)
    out["restored"] = dataclasses.asdict(watch.model)

    trainer, recorder, _, _ = _fit(_skrull("off"), 3)
    out["off"] = dataclasses.asdict(trainer.strategy.cost_model)
    out["off_steps"] = recorder.steps

    zero2 = SkrullZero2Strategy(cp_size=2, bucket_size=BUCKET, cost_model=_start_model())
    trainer, recorder, watch, module = _fit(zero2, STEPS)
    out["zero2"] = dataclasses.asdict(trainer.strategy.cost_model)
    out["zero2_steps"] = recorder.steps
    out["zero2_with_start"] = watch.with_start
    out["zero2_params"] = _params(module)

    # bf16-mixed, 3 steps (one refit): the timing hooks and the refit under autocast (DDP) and
    # under DeepSpeed's bf16 parameters with their float32 master copy (ZeRO-2)
    zero2 = SkrullZero2Strategy(cp_size=2, bucket_size=BUCKET, cost_model=_start_model())
    for name, strategy in (("bf16_ddp", _skrull("online")), ("bf16_zero2", zero2)):
        trainer, recorder, _, _ = _fit(strategy, 3, precision="bf16-mixed")
        out[name] = dataclasses.asdict(trainer.strategy.cost_model)
        out[f"{name}_steps"] = recorder.steps
    return out


def _uneven(results: list[dict[str, Any]], key: str) -> list[int]:
    """Steps whose plan gave the two DP ranks (ranks 0 and 2) different micro-batch counts."""
    steps = results[0][key]
    return [k for k in range(len(steps)) if steps[k]["planned"] != results[2][key][k]["planned"]]


def test_online_calibration_on_four_ranks() -> None:
    start = dataclasses.asdict(_start_model())
    with tempfile.TemporaryDirectory() as ckpt_dir:
        results = spawn(_cases, 4, ckpt_dir, timeout=900)
    # every case needs DP ranks with different micro-batch counts in its steps
    for key in ("online_steps", "off_steps", "zero2_steps", "bf16_ddp_steps", "bf16_zero2_steps"):
        assert _uneven(results, key), f"{key}: every step gave both DP ranks the same count"
    online = [r["online"] for r in results]
    assert all(m == online[0] for m in online), "ranks ended with different calibrated models"
    assert online[0] != start
    # it started learning the CPU, which is far slower than the start model says: whichever
    # constants the refits moved (FLOP/s, overhead, per-sequence cost), it now predicts more time
    assert predicted_seconds(online[0]) > MIN_SLOWDOWN * predicted_seconds(start)
    assert all(r["restored"] == online[0] for r in results), "resume lost the calibrated model"
    assert all(r["off"] == start for r in results)
    assert "skrull/calibration/prediction_error" in results[0]["metrics"]
    assert "skrull/calibration/achieved_tflops" in results[0]["metrics"]

    # DataLoader workers copy the schedule when an epoch's iteration starts (here: only the
    # starting model in epoch 0). A batch of epoch 0 planned with another model was planned
    # again in the main process after a refit; the first refit (after step 3) plans from
    # batch 4 on, so every later batch of epoch 0 was.
    for r in results:
        in_epoch_0 = [(i, same) for e, i, same in r["online_with_start"] if e == 0]
        assert [i for i, _ in in_epoch_0] == list(range(STEPS))
        assert all(same for i, same in in_epoch_0 if i < 4)
        assert not any(same for i, same in in_epoch_0 if i >= 4)

    # Float32 parity with plain HF on one process: the packed, sharded computation sums the
    # same token terms in another order and the gradients are averaged over 4 ranks, which
    # PARAM_ATOL (float32 rounding over a few SGD steps) covers.
    reference = _reference(WORKER_SAMPLES, STEPS)
    for r in results:
        assert max_diff(r["online_params"], reference) < PARAM_ATOL

    # ZeRO-2: it refitted (towards the slower CPU, as above), every
    # rank holds the same model, refitted models planned the batches from batch 4 on, and the
    # weights equal plain HF training (3 global batches per epoch, 3 epochs)
    zero2 = [r["zero2"] for r in results]
    assert all(m == zero2[0] for m in zero2), "ZeRO-2 ranks ended with different models"
    assert zero2[0] != start
    assert predicted_seconds(zero2[0]) > MIN_SLOWDOWN * predicted_seconds(start)
    for r in results:
        assert not any(same for _, i, same in r["zero2_with_start"][4:])
    reference = _reference(24, STEPS)
    for r in results:
        assert max_diff(r["zero2_params"], reference) < PARAM_ATOL

    # bf16-mixed under DDP and ZeRO-2: the first refit (after step 3) adopted a model that
    # predicts the slower CPU, the same on every rank (what bf16 does to the weights is the
    # precision matrix's subject: calibration changes only which plan a batch gets)
    for key in ("bf16_ddp", "bf16_zero2"):
        models = [r[key] for r in results]
        assert all(m == models[0] for m in models), f"{key}: ranks ended with different models"
        assert predicted_seconds(models[0]) > MIN_SLOWDOWN * predicted_seconds(start), key
