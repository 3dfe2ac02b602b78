"""Online calibration on 4 gloo processes (DP2 x CP2), from a model that thinks communication free.

One spawn runs three fits: calibration on (every rank ends with the same refitted model,
different from the start), a resume from its checkpoint (the calibrated model is restored
before any step), and calibration off (the model is left as given).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

from helpers import BUCKET, GLOBAL_BATCH, BatchRecorder, PlainLM, cpu_trainer, make_data

from lightning_skrull.runtime.launch import spawn

STEPS = 9  # refits after steps 3, 6 and 9 (the first within the first 10 steps)


def _start_model() -> Any:
    from lightning_skrull.scheduling import CostModel

    # deliberately wrong: free communication (and an H100's FLOP/s on a CPU)
    return CostModel(comm_latency_s=0.0, comm_bandwidth=1e30)


def _fit(calibration: str, steps: int, ckpt_path: str | None = None, **kwargs: Any) -> Any:
    import lightning.pytorch as L

    from lightning_skrull import SkrullDataModule, SkrullStrategy

    class ModelAtStart(L.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.model = trainer.strategy.cost_model

    recorder, at_start = BatchRecorder(), ModelAtStart()
    strategy = SkrullStrategy(
        cp_size=2, bucket_size=BUCKET, cost_model=_start_model(), calibration=calibration
    )
    trainer = cpu_trainer(strategy, max_steps=steps, callbacks=[recorder, at_start], **kwargs)
    data = SkrullDataModule(train_data=make_data(), global_batch_size=GLOBAL_BATCH, shuffle=False)
    trainer.fit(PlainLM(), data, ckpt_path=ckpt_path)
    return trainer, recorder, at_start.model


def _cases(rank: int, world_size: int, ckpt_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    trainer, recorder, _ = _fit("online", STEPS)
    strategy = trainer.strategy
    out["online"] = dataclasses.asdict(strategy.cost_model)
    out["online_steps"] = recorder.steps
    out["metrics"] = sorted(k for k in trainer.callback_metrics if "calibration" in k)
    path = os.path.join(ckpt_dir, "calibrated.ckpt")
    trainer.save_checkpoint(path)

    _, _, restored = _fit("online", STEPS + 1, ckpt_path=path)
    out["restored"] = dataclasses.asdict(restored)

    trainer, recorder, _ = _fit("off", 3)
    out["off"] = dataclasses.asdict(trainer.strategy.cost_model)
    out["off_steps"] = recorder.steps
    return out


def test_online_calibration_on_four_ranks() -> None:
    start = dataclasses.asdict(_start_model())
    with tempfile.TemporaryDirectory() as ckpt_dir:
        results = spawn(_cases, 4, ckpt_dir, timeout=600)
    # the case needs DP ranks with different micro-batch counts in its steps
    for key in ("online_steps", "off_steps"):
        uneven = [
            k
            for k in range(len(results[0][key]))
            if results[0][key][k]["planned"] != results[2][key][k]["planned"]
        ]
        assert uneven, f"{key}: every step gave both DP ranks the same micro-batch count"
    online = [r["online"] for r in results]
    assert all(m == online[0] for m in online), "ranks ended with different calibrated models"
    assert online[0] != start
    # it started learning the CPU: a refit moves a constant at most 2x, and this CPU is
    # thousands of times slower than the H100 figure, so the FLOP/s fell by the whole factor
    assert online[0]["achieved_flops"] <= start["achieved_flops"] / 2 * (1 + 1e-9)
    assert all(r["restored"] == online[0] for r in results), "resume lost the calibrated model"
    assert all(r["off"] == start for r in results)
    assert "skrull/calibration/prediction_error" in results[0]["metrics"]
    assert "skrull/calibration/achieved_tflops" in results[0]["metrics"]
