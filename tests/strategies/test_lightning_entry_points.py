"""The Trainer's other entry points under every Skrull strategy: ``trainer.validate`` before any
``fit`` (the baseline loss of the pretrained model), ``trainer.test(ckpt_path="best")`` after a
fit that kept its best checkpoint on ``val_loss``, and ``trainer.fit(ckpt_path="last")`` from a
``ModelCheckpoint(save_last=True)``, the usual way to continue an interrupted run (its module
building the model in ``configure_model``, as Lightning's docs for sharded training do); and every
checkpoint the runs write (by ``ModelCheckpoint`` and by ``trainer.save_checkpoint``) loaded into
the plain LightningModule with ``load_from_checkpoint`` on one process, without lightning_skrull.

One spawn of 4 processes (DP=2 x CP=2) runs every case for DDP, ZeRO-2 and FSDP2; the shuffle
seed gives the two DP ranks different micro-batch counts in some steps (asserted). Each value is
compared with plain Hugging Face on one process: the validation loss of the initial model, the
training trajectory of the recorded global batches (SGD with momentum, so a resume that lost
the optimizer state would show), its validation loss after every step, and the test loss of the
step whose validation loss was lowest.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
import pytest
import torch
from helpers import (
    GLOBAL_BATCH,
    BatchRecorder,
    PlainLM,
    cpu_trainer,
    make_data,
    max_diff,
    mean_token_loss,
    momentum_training,
    reference_model,
    skrull_strategy,
    tiny_qwen2,
    trained_params,
)

from lightning_skrull.runtime.launch import spawn

MOMENTUM = 0.9
SEED = 6  # shuffle seed: the DP ranks run different micro-batch counts in some steps (asserted)
FIT_STEPS = 3  # one epoch of make_data()'s 24 samples in global batches of 8
RESUMED_STEPS = 4  # the resumed fit trains one more step, in epoch 1
STRATEGIES = ("ddp", "zero2", "fsdp")
PRECISIONS = ("32-true", "bf16-mixed")
CASES = [f"{name}/{precision}" for precision in PRECISIONS for name in STRATEGIES]
VAL_DATA = make_data(GLOBAL_BATCH, seed=3)
TEST_DATA = make_data(GLOBAL_BATCH, seed=4)
# float32: the packed, sharded steps sum the same token terms as the reference in another order
# (measured up to ~1e-7 in these files' parameters after 4 momentum steps); a lost momentum
# buffer or global batch moves parameters by about lr * gradient, orders of magnitude more
PARAM_ATOL = 1e-6
# a mean token loss from float32 sums in another order (measured below 1e-6 relative)
LOSS_REL = 1e-5


def _data() -> Any:
    from lightning_skrull import SkrullDataModule

    return SkrullDataModule(
        train_data=make_data(),
        val_data=VAL_DATA,
        test_data=TEST_DATA,
        global_batch_size=GLOBAL_BATCH,
        seed=SEED,
    )


class ValLosses(BatchRecorder):
    """:class:`BatchRecorder` that also keeps, after every validation of a fit, the synced
    ``val_loss`` and the parameters the validation saw."""

    def __init__(self) -> None:
        super().__init__()
        self.val_losses: list[float] = []
        self.params: list[dict[str, np.ndarray]] = []

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self.val_losses.append(float(trainer.callback_metrics["val_loss"]))
        self.params.append(trained_params(module.model, trainer.strategy))


def _checkpoints(directory: str) -> list[Any]:
    """The usual pair: the best checkpoint on ``val_loss``, and one after every step with a
    ``last.ckpt`` to continue from (Lightning 2.6 writes ``last.ckpt`` only when the callback
    saved a checkpoint in that step, so the best-on-``val_loss`` callback would leave it at the
    best step). The first decides after every validation: with ``val_check_interval=1``, which
    Lightning compares equal to ``1.0``, it would otherwise save at the epoch's end only."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    return [
        ModelCheckpoint(
            dirpath=os.path.join(directory, "best"),
            filename="{step}",
            monitor="val_loss",
            save_on_train_epoch_end=False,
        ),
        ModelCheckpoint(
            dirpath=os.path.join(directory, "every_step"),
            filename="{step}",
            every_n_train_steps=1,
            save_last=True,
        ),
    ]


class ConfiguredLM(PlainLM):
    """:class:`PlainLM` whose model is built in ``configure_model``, as Lightning's docs for
    sharded training build it (Lightning calls the hook under the strategy's and the
    precision's initialisation contexts, before the strategy's setup)."""

    def __init__(self, momentum: float = 0.0) -> None:
        super().__init__(momentum)
        self.model = None  # type: ignore[assignment]

    def configure_model(self) -> None:
        if self.model is None:
            self.model = tiny_qwen2()


def _continued(
    name: str, precision: str, directory: str, ckpt_path: str | None = "last"
) -> tuple[Any, ...]:
    """``(recorded steps, parameters)`` of a new run to step :data:`RESUMED_STEPS`, continued
    from ``ckpt_path`` (``None``: from the start), its model built in ``configure_model``."""
    recorder, strategy, module = (
        BatchRecorder(),
        skrull_strategy(name, cp_size=2, bucket_size=40),
        ConfiguredLM(momentum=MOMENTUM),
    )
    cpu_trainer(
        strategy,
        max_steps=RESUMED_STEPS,
        val_check_interval=1,
        callbacks=[recorder, *_checkpoints(directory)],
        enable_checkpointing=True,
        precision=precision,
    ).fit(module, _data(), ckpt_path=ckpt_path)
    return recorder.steps, trained_params(module.model, strategy)


def _groups_made() -> int:
    """Process groups this process holds (the default group included; Lightning's barrier
    around ``prepare_data`` makes a gloo group and destroys it, so it is not counted)."""
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map)


def _entry_points(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for precision in PRECISIONS:
        for name in STRATEGIES:
            directory = os.path.join(tmp, precision, name)
            # one Trainer: the pretrained model's loss first, then a fit that validates after
            # every step and keeps the best and the last checkpoint, then the best one tested
            module = PlainLM(momentum=MOMENTUM)
            recorder, kept = ValLosses(), _checkpoints(directory)
            strategy = skrull_strategy(name, cp_size=2, bucket_size=40)
            trainer = cpu_trainer(
                strategy,
                max_steps=FIT_STEPS,
                val_check_interval=1,
                callbacks=[recorder, *kept],
                enable_checkpointing=True,
                precision=precision,
            )
            baseline = trainer.validate(module, _data())[0]["val_loss"]
            groups = [_groups_made()]
            trainer.fit(module, _data())
            groups.append(_groups_made())
            trainer.save_checkpoint(os.path.join(directory, "manual.ckpt"))  # on every rank
            best = os.path.basename(kept[0].best_model_path)
            test_loss = trainer.test(module, _data(), ckpt_path="best")[0]["test_loss"]
            groups.append(_groups_made())
            tested = trained_params(module.model, strategy)
            resumed_steps, resumed = _continued(name, precision, directory)
            groups.append(_groups_made())
            run = {
                "baseline": float(baseline),
                "steps": recorder.steps,
                "val_losses": recorder.val_losses,
                "validated_params": recorder.params,
                "best": best,
                "test_loss": float(test_loss),
                "tested_params": tested,
                "resumed_steps": resumed_steps,
                "resumed_params": resumed,
                "groups": groups,
            }
            if precision != "32-true":  # the uninterrupted run the resumed one must equal
                whole = os.path.join(directory, "uninterrupted")
                _, run["whole_params"] = _continued(name, precision, whole, ckpt_path=None)
            out[f"{name}/{precision}"] = run
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The folder the runs write their checkpoints to (kept for the plain loads)."""
    return str(tmp_path_factory.mktemp("entry_points"))


@pytest.fixture(scope="module")
def ranks(written: str) -> list[dict[str, Any]]:
    return spawn(_entry_points, 4, written, timeout=900)


def _global_batches(runs: list[list[dict[str, Any]]]) -> list[list[int]]:
    """The sorted sample indices of each step, joined over the DP ranks (CP rank 0's copy)."""
    batches: dict[tuple[int, int], list[int]] = {}
    for steps in runs:
        for step in steps:
            if step["cp_rank"] == 0:
                batches.setdefault((step["epoch"], step["index"]), []).extend(step["samples"])
    return [sorted(samples) for _, samples in sorted(batches.items())]


@functools.cache
def reference(batches: tuple[tuple[int, ...], ...]) -> dict[str, Any]:
    """Plain HF training of ``batches`` on one process (SGD with momentum), with the validation
    and test loss after every step."""
    out: dict[str, Any] = {"baseline": mean_token_loss(reference_model(), VAL_DATA), "steps": []}
    for model in momentum_training(batches, MOMENTUM):
        out["steps"].append(
            {
                "params": {k: v.detach().numpy().copy() for k, v in model.state_dict().items()},
                "val_loss": mean_token_loss(model, VAL_DATA),
                "test_loss": mean_token_loss(model, TEST_DATA),
            }
        )
    return out


def _reference_of(ranks: list[dict[str, Any]], case: str) -> dict[str, Any]:
    runs = [out[case]["steps"] + out[case]["resumed_steps"] for out in ranks]
    batches = _global_batches(runs)
    assert len(batches) == RESUMED_STEPS
    return reference(tuple(tuple(b) for b in batches))


@functools.cache
def bf16_baseline(strategy: str) -> float:
    """The initial model's validation loss on one process in the dtypes ``strategy`` computes in
    under ``bf16-mixed`` (docs/precision.md): DDP autocasts a float32 model; ZeRO-2 (DeepSpeed
    bf16) and FSDP2 (``MixedPrecisionPolicy(param_dtype=bf16)``) run the parameters in bf16,
    the buffers (the rotary ``inv_freq``) in float32, without autocast."""
    model = reference_model()
    if strategy == "ddp":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return mean_token_loss(model, VAL_DATA)
    for parameter in model.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    return mean_token_loss(model, VAL_DATA)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_later_entry_points_reuse_the_process_groups(
    ranks: list[dict[str, Any]], case: str
) -> None:
    # validate, fit, test on one Trainer and a fit on a new Trainer: each sets the strategy up
    # anew; under NCCL every new group a rank joins would hold device memory until exit
    for out in ranks:
        groups = out[case]["groups"]
        assert groups == [groups[0]] * len(groups), groups


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_micro_batch_counts_differ_between_dp_ranks(ranks: list[dict[str, Any]], case: str) -> None:
    # processes 0, 1 are DP rank 0 and processes 2, 3 DP rank 1
    for key in ("steps", "resumed_steps"):
        counts = [[s["run"] for s in out[case][key]] for out in ranks]
        assert counts[0] == counts[1] and counts[2] == counts[3]
    fitted = [[s["planned"] for s in out[case]["steps"]] for out in ranks]
    assert fitted[0] != fitted[2]  # the plan gave the DP ranks different counts


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_validate_before_fit_gives_the_initial_models_loss(
    ranks: list[dict[str, Any]], case: str
) -> None:
    expected = _reference_of(ranks, case)["baseline"]
    for out in ranks:
        if case.endswith("32-true"):
            assert out[case]["baseline"] == pytest.approx(expected, rel=LOSS_REL)
        else:  # the 16-bit rule: within twice single-process bf16's distance from float32
            own = bf16_baseline(case.split("/")[0])
            distance = abs(out[case]["baseline"] - expected)
            assert distance <= 2 * abs(own - expected) + 1e-3, (out[case]["baseline"], own)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_test_on_the_best_checkpoint(ranks: list[dict[str, Any]], case: str) -> None:
    for out in ranks:
        run = out[case]
        best = int(np.argmin(run["val_losses"]))
        # the best step is not the last one, so testing the best checkpoint differs from testing
        # the module as the fit left it
        assert best != FIT_STEPS - 1
        assert run["best"] == f"step={best + 1}.ckpt"
        if run["tested_params"]:  # FSDP gathers the full weights on rank 0 only
            # the tested module holds exactly the weights the best step's validation saw, and
            # not the last step's
            assert max_diff(run["tested_params"], run["validated_params"][best]) == 0.0
            assert max_diff(run["tested_params"], run["validated_params"][-1]) > 1e-3
    if case.endswith("32-true"):  # and every value is one process's
        fitted = _reference_of(ranks, case)["steps"][:FIT_STEPS]
        best = int(np.argmin([step["val_loss"] for step in fitted]))
        for out in ranks:
            run = out[case]
            assert run["val_losses"] == pytest.approx(
                [step["val_loss"] for step in fitted], rel=LOSS_REL
            )
            assert run["test_loss"] == pytest.approx(fitted[best]["test_loss"], rel=LOSS_REL)
            if run["tested_params"]:
                assert max_diff(run["tested_params"], fitted[best]["params"]) < PARAM_ATOL


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_fit_from_the_last_checkpoint_continues_the_run(
    ranks: list[dict[str, Any]], case: str
) -> None:
    for out in ranks:
        run = out[case]
        # the resumed run trained only the step after the last checkpoint
        assert [(s["epoch"], s["index"]) for s in run["resumed_steps"]] == [(1, 0)]
        if not run["resumed_params"]:  # FSDP gathers the full weights on rank 0 only
            continue
        if case.endswith("32-true"):
            expected = _reference_of(ranks, case)["steps"][-1]["params"]
            assert max_diff(run["resumed_params"], expected) < PARAM_ATOL
        else:
            # the same steps in the same layout and precision as the run that never stopped;
            # only the restart lies between them (measured equal to float32 rounding)
            assert max_diff(run["resumed_params"], run["whole_params"]) < PARAM_ATOL


def _plain_checkpoint(name: str, path: str, out: str) -> str:
    """A file ``LightningModule.load_from_checkpoint`` reads: DDP writes one; ZeRO-2 and FSDP
    write folders, turned into one file as docs/lightning.md says."""
    if name == "zero2":
        from lightning.pytorch.utilities.deepspeed import (
            convert_zero_checkpoint_to_fp32_state_dict,
        )

        convert_zero_checkpoint_to_fp32_state_dict(path, out)
        return out
    if name == "fsdp":
        from lightning_skrull import SkrullFSDPStrategy

        SkrullFSDPStrategy.consolidate_checkpoint(path, out)
        return out
    return path


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_checkpoints_load_into_a_plain_module(
    ranks: list[dict[str, Any]], written: str, case: str, tmp_path: Any
) -> None:
    """``PlainLM.load_from_checkpoint`` in this process (no Trainer, no process group) gives
    exactly the trained weights, from ``trainer.save_checkpoint`` after the fit and from the
    ``ModelCheckpoint`` of the resumed run's last step (which holds the loader position and the
    calibration state too); the loaded model runs plain transformers attention."""
    import torch.distributed as dist

    name, precision = case.split("/")
    run = ranks[0][case]  # FSDP gathers the full weights on rank 0 only
    directory = os.path.join(written, precision, name)
    last = f"step={RESUMED_STEPS}.ckpt"
    assert last in os.listdir(os.path.join(directory, "every_step"))
    loads = {
        "manual.ckpt": run["validated_params"][-1],  # the fit's last step, validated
        os.path.join("every_step", last): run["resumed_params"],
    }
    for relative, trained in loads.items():
        path = _plain_checkpoint(name, os.path.join(directory, relative), str(tmp_path / "full"))
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        assert "loops" in checkpoint  # the loader's position rides along
        module = PlainLM.load_from_checkpoint(path)  # strict: no missing or extra key
        assert not dist.is_initialized()
        loaded = {k: v.detach().float().numpy() for k, v in module.model.state_dict().items()}
        if case == "zero2/bf16-mixed":
            # the file holds DeepSpeed's float32 master weights; the module trained (and was
            # recorded) on their bf16 copies
            loaded = {
                k: torch.from_numpy(v).to(torch.bfloat16).float().numpy() for k, v in loaded.items()
            }
        assert max_diff(loaded, trained) == 0.0, relative
        assert module.model.config._attn_implementation != "skrull"
    if precision == "32-true":  # inference on the loaded weights: the run's last validation loss
        assert mean_token_loss(module.model, VAL_DATA) == pytest.approx(
            _reference_of(ranks, case)["steps"][-1]["val_loss"], rel=LOSS_REL
        )
