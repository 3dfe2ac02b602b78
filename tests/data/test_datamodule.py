"""The data module's loaders, one process: every rank's batches are built here by looping over
the ranks (planning and collating are pure, so no process group is needed); and a world-of-one
fit whose LightningModule holds two Hugging Face models."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from helpers import (
    CONVERSATION,
    GLOBAL_BATCH,
    LR,
    PARAM_ATOL,
    PLAIN_TEMPLATE,
    TINY_QWEN2,
    PlainLM,
    cpu_trainer,
    make_data,
    make_tokenizer,
    max_diff,
    reference_loss,
    reference_training,
    skrull_planner,
)
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.utilities.data import has_iterable_dataset
from transformers import Qwen2Config, Qwen2ForCausalLM

from lightning_skrull import DataConfig, SkrullBatch, SkrullDataModule, SkrullStrategy
from lightning_skrull.config import AUTO_BUCKET
from lightning_skrull.data import GlobalBatchSampler, load_sft_data
from lightning_skrull.data.batch import plan_stats
from lightning_skrull.data.dataset import split_dataset
from lightning_skrull.data.loader import GlobalBatchStream, SkrullDataLoader
from lightning_skrull.scheduling import DISTRIBUTED, CostModel, CostModelSchedule, plan_global_batch


def make_samples(n: int = 30, seed: int = 0) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(2, 90, (1,), generator=g))
        ids = torch.randint(0, 50, (length,), generator=g).tolist()
        prompt = int(torch.randint(0, length, (1,), generator=g))
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def loader(
    dp_rank: int,
    cp_rank: int,
    *,
    dp_size: int = 2,
    cp_size: int = 2,
    global_batch_size: int = 8,
    shuffle: bool = False,
    equal: bool = False,
    num_workers: int = 0,
    persistent_workers: bool = False,
    n: int = 30,
    bucket_size: int = 50,
) -> SkrullDataLoader:
    dataset = load_sft_data(make_samples(n))
    sampler = GlobalBatchSampler(len(dataset), global_batch_size, shuffle=shuffle, seed=5)
    planner = skrull_planner(
        dp_size=dp_size,
        cp_size=cp_size,
        dp_rank=dp_rank,
        cp_rank=cp_rank,
        bucket_size=bucket_size,
        equal_micro_batches=equal,
    )
    return SkrullDataLoader(
        GlobalBatchStream(dataset, sampler, planner),
        num_workers=num_workers,
        persistent_workers=persistent_workers,
    )


def micro_batch_samples(batch: SkrullBatch) -> list[tuple[int, ...]]:
    return [mb.sample_indices for mb in batch.rank_batch.micro_batches]


def test_every_sample_of_a_global_batch_goes_to_exactly_one_dp_rank() -> None:
    ranks = {(d, c): list(loader(d, c)) for d in range(2) for c in range(2)}
    num_steps = len(ranks[0, 0])
    assert num_steps == 4  # 30 samples, 8 per step: the last, partial batch is trained
    for step in range(num_steps):
        expected = list(range(step * 8, min(step * 8 + 8, 30)))  # shuffle=False: dataset order
        seen: list[int] = []
        for d in range(2):
            batches = [ranks[d, c][step] for c in range(2)]
            # the CP ranks of a DP rank run the same micro-batches (each its own shard)
            assert micro_batch_samples(batches[0]) == micro_batch_samples(batches[1])
            seen += [i for mb in micro_batch_samples(batches[0]) for i in mb]
            assert {b.stats for b in batches} == {ranks[0, 0][step].stats}
        assert sorted(seen) == expected
        # the supervised-token count is of the whole global batch, the same on every rank
        supervised = {ranks[k][step].rank_batch.num_supervised_tokens for k in ranks}
        assert len(supervised) == 1


def test_equal_micro_batches_pads_every_dp_rank_to_the_largest_count() -> None:
    # With a 48-token bucket the second step gives the DP ranks 3 and 4 micro-batches.
    plain = [list(loader(d, 0, bucket_size=48)) for d in range(2)]
    padded = [list(loader(d, 0, equal=True, bucket_size=48)) for d in range(2)]
    uneven = 0
    for step in range(len(plain[0])):
        counts = [len(plain[d][step].rank_batch.micro_batches) for d in range(2)]
        uneven += counts[0] != counts[1]
        for d in range(2):
            assert len(padded[d][step].rank_batch.micro_batches) == max(counts)
            extra = padded[d][step].rank_batch.micro_batches[counts[d] :]
            assert all(mb.sample_indices == () and mb.num_supervised_tokens == 0 for mb in extra)
    assert uneven  # the case must contain steps where DP ranks differ


def test_plan_statistics_match_the_plan() -> None:
    samples = make_samples(12)
    lengths = [len(s["input_ids"]) for s in samples]
    model = CostModel()
    plan = plan_global_batch(lengths, dp_size=2, cp_size=2, bucket_size=50, cost_model=model)
    supervised = sum(sum(1 for x in s["labels"][1:] if x != -100) for s in samples)
    stats = plan_stats(plan, lengths, supervised, model)
    placements = [p for mbs in plan.micro_batches for mb in mbs for p in mb.placement]
    assert stats.num_sequences == 12 and stats.num_tokens == sum(lengths)
    assert stats.num_supervised_tokens == supervised
    assert stats.distributed_share == placements.count(DISTRIBUTED) / 12
    per_rank = [
        sum(model.micro_batch_seconds(mb, lengths, 2) for mb in r) for r in plan.micro_batches
    ]
    assert stats.estimated_seconds == pytest.approx(max(per_rank), rel=1e-6)
    assert stats.imbalance == pytest.approx(max(per_rank) / (sum(per_rank) / 2), rel=1e-6)
    counts = [len(r) for r in plan.micro_batches]
    assert (stats.max_micro_batches, stats.min_micro_batches) == (max(counts), min(counts))


def test_lightning_sees_an_iterable_stateful_loader_with_set_epoch() -> None:
    dl = loader(0, 0, shuffle=True)
    # Lightning injects a DistributedSampler only into map-style loaders
    assert has_iterable_dataset(dl)
    assert isinstance(dl, _Stateful)  # Lightning saves its state in checkpoints
    first = [micro_batch_samples(b) for b in dl]
    _set_sampler_epoch(dl, 1)  # what Lightning calls at every epoch start
    assert dl.global_batch_sampler.epoch == 1
    second = [micro_batch_samples(b) for b in dl]
    assert first != second  # a new seeded order
    assert all(b.epoch == 1 for b in dl)


def test_resuming_from_state_continues_with_the_same_batches() -> None:
    whole = [(b.epoch, b.index, micro_batch_samples(b)) for b in loader(1, 1, shuffle=True)]
    dl = loader(1, 1, shuffle=True)
    it = iter(dl)
    head = [next(it) for _ in range(2)]
    state = dl.state_dict()
    assert state["batches_consumed"] == 2 and state["epoch"] == 0
    resumed = loader(1, 1, shuffle=True)
    resumed.load_state_dict(state)
    _set_sampler_epoch(resumed, 0)  # Lightning sets the same epoch again: the position stays
    rest = [(b.epoch, b.index, micro_batch_samples(b)) for b in resumed]
    assert [(b.epoch, b.index, micro_batch_samples(b)) for b in head] + rest == whole


def test_resume_with_another_batch_size_is_refused() -> None:
    state = loader(0, 0).state_dict()
    other = loader(0, 0, global_batch_size=6)
    with pytest.raises(ValueError, match="global_batch_size"):
        other.load_state_dict(state)


def test_workers_keep_the_order() -> None:
    single = [micro_batch_samples(b) for b in loader(0, 1, shuffle=True)]
    workers = [micro_batch_samples(b) for b in loader(0, 1, shuffle=True, num_workers=2)]
    assert workers == single


def _epochs(dl: SkrullDataLoader, epochs: range) -> list[list[Any]]:
    """Each epoch's ``(epoch, index, micro-batch samples)`` of ``dl``, Lightning's way:
    ``set_epoch``, then a new iteration."""
    out = []
    for epoch in epochs:
        dl.sampler.set_epoch(epoch)
        out.append([(b.epoch, b.index, micro_batch_samples(b)) for b in dl])
    return out


def test_persistent_workers_draw_each_epochs_order_and_resume_exactly() -> None:
    # A persistent worker keeps the stream it was started with; without the loader handing it
    # each iteration's sampler, every epoch repeats the first one's shuffled order.
    single = _epochs(loader(0, 1, shuffle=True), range(3))
    assert single[0] != single[1]  # the shuffle differs between epochs
    dl = loader(0, 1, shuffle=True, num_workers=2, persistent_workers=True)
    assert dl.persistent_workers
    assert _epochs(dl, range(3)) == single
    # resumed mid-epoch 1 (2 of 4 batches trained), then epoch 2, by the same workers
    state = loader(0, 1, shuffle=True).global_batch_sampler.state_dict(batches_consumed=2)
    state["epoch"] = 1
    resumed = loader(0, 1, shuffle=True, num_workers=2, persistent_workers=True)
    resumed.load_state_dict(state)
    assert _epochs(resumed, range(1, 3)) == [single[1][2:], single[2]]
    # no workers, nothing to keep: a plain loader, as torch needs
    assert not loader(0, 1, persistent_workers=True).persistent_workers


def test_persistent_workers_plan_with_the_cost_model_adopted_between_epochs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Online calibration adopts cost models during a fit. The main process plans again any batch
    # a worker planned with an older model, so the batches are right either way; persistent
    # workers are handed each iteration's schedule, so they plan the next epoch with the model
    # adopted during this one and the main process plans nothing again.
    built_here: list[tuple[int, int]] = []  # build() calls of this process: re-plans
    build = GlobalBatchStream.build

    def counted(self: GlobalBatchStream, indices: Any, epoch: int, index: int) -> SkrullBatch:
        built_here.append((epoch, index))
        return build(self, indices, epoch, index)

    monkeypatch.setattr(GlobalBatchStream, "build", counted)  # workers count in their copies
    dl = loader(0, 1, shuffle=True, num_workers=2, persistent_workers=True)
    stream: GlobalBatchStream = dl.dataset  # type: ignore[assignment]
    stream.schedule = schedule = CostModelSchedule(CostModel())
    _epochs(dl, range(1))
    adopted = dataclasses.replace(CostModel(), micro_batch_overhead_s=1.0)
    schedule.adopt(adopted, 1, 0)
    dl.sampler.set_epoch(1)
    epoch_1 = list(dl)
    assert [b.planned_with for b in epoch_1] == [adopted] * len(epoch_1)
    assert built_here == []


def test_batch_moves_as_a_whole() -> None:
    batch = next(iter(loader(0, 0)))
    moved = batch.to("cpu")
    assert isinstance(moved, SkrullBatch) and moved.stats == batch.stats
    assert "micro_batches=" in repr(batch)
    for mb in moved.rank_batch.micro_batches:
        assert mb.inputs["num_items_in_batch"].dtype == torch.float32


# ----------------------------------------------------------------------------- the module
def test_data_config_checks() -> None:
    with pytest.raises(ValueError, match="global_batch_size=0"):
        DataConfig(global_batch_size=0)
    with pytest.raises(ValueError, match="val_global_batch_size=-1"):
        DataConfig(global_batch_size=4, val_global_batch_size=-1)
    with pytest.raises(ValueError, match="num_workers=-2"):
        DataConfig(global_batch_size=4, num_workers=-2)
    with pytest.raises(ValueError, match="val_split=-1"):
        DataConfig(global_batch_size=4, val_split=-1)
    with pytest.raises(TypeError, match="shuffle"):
        DataConfig(global_batch_size=4, shuffle="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="persistent_workers"):
        DataConfig(global_batch_size=4, persistent_workers=1)  # type: ignore[arg-type]
    assert DataConfig(global_batch_size=4).validation_batch_size == 4
    assert DataConfig(global_batch_size=4, val_global_batch_size=2).validation_batch_size == 2


def test_val_split_holds_out_a_seeded_disjoint_part() -> None:
    dm = SkrullDataModule(train_data=make_samples(), global_batch_size=4, val_split=6, seed=1)
    dm.setup("fit")
    assert dm.train_dataset is not None and dm.val_dataset is not None
    assert len(dm.train_dataset) == 24 and len(dm.val_dataset) == 6
    held = set(dm.val_dataset.indices)  # type: ignore[union-attr]
    assert held.isdisjoint(dm.train_dataset.indices)  # type: ignore[union-attr]
    again = SkrullDataModule(train_data=make_samples(), global_batch_size=4, val_split=6, seed=1)
    again.setup("fit")
    assert set(again.val_dataset.indices) == held  # type: ignore[union-attr]
    assert dm.val_dataset[0] == make_samples()[min(held)]
    assert dm.train_dataset.lengths == [
        len(make_samples()[i]["input_ids"]) for i in range(30) if i not in held
    ]


def test_val_split_errors() -> None:
    with pytest.raises(ValueError, match="not both"):
        SkrullDataModule(train_data=make_samples(), val_data=make_samples(), val_split=2)
    with pytest.raises(ValueError, match="val_split=30 must leave training samples"):
        split_dataset(load_sft_data(make_samples()), 30)


def test_fit_without_train_data_is_refused() -> None:
    with pytest.raises(ValueError, match=r"train_data=None\) cannot fit"):
        SkrullDataModule().setup("fit")


def test_bundled_dataset_by_name() -> None:
    dm = SkrullDataModule(train_data="bundled:mixed_tiny", global_batch_size=32)
    dm.setup("fit")
    assert dm.train_dataset is not None and len(dm.train_dataset) == 384


def test_a_strategy_other_than_skrull_is_refused() -> None:
    dm = SkrullDataModule(train_data=make_samples(), global_batch_size=4)
    dm.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    dm.setup("fit")
    with pytest.raises(TypeError, match=r"needs a Skrull strategy.*SingleDeviceStrategy"):
        dm.train_dataloader()


def test_loader_needs_the_trainer() -> None:
    dm = SkrullDataModule(train_data=make_samples(), global_batch_size=4)
    dm.setup("fit")
    with pytest.raises(RuntimeError, match="needs the Trainer"):
        dm.train_dataloader()


def test_no_validation_without_val_data() -> None:
    dm = SkrullDataModule(train_data=make_samples(), global_batch_size=4)
    dm.setup("fit")
    assert dm.val_dataloader() == []


def test_chat_samples_with_a_tokenizer_path(tmp_path: Path) -> None:
    tokenizer = make_tokenizer(PLAIN_TEMPLATE)
    tokenizer.save_pretrained(tmp_path)
    chats = [{"messages": CONVERSATION}, {"messages": CONVERSATION[:4]}]
    dm = SkrullDataModule(train_data=chats, global_batch_size=2, tokenizer=str(tmp_path))
    dm.setup("fit")
    expected = load_sft_data(chats, tokenizer=tokenizer)  # the tokenizer object itself
    assert dm.train_dataset is not None
    assert [dm.train_dataset[i] for i in range(2)] == [expected[i] for i in range(2)]
    assert any(label == -100 for label in dm.train_dataset[0]["labels"])  # prompts masked


class StudentTeacherLM(PlainLM):
    """Trains ``self.model`` (built exactly as :class:`PlainLM` builds it) beside a frozen
    ``self.teacher``, a second HF model whose 32-token vocabulary is smaller than the data's
    token ids (up to 63): checking the data against the teacher would refuse it."""

    def __init__(self) -> None:
        super().__init__()
        teacher = Qwen2ForCausalLM(Qwen2Config(**{**TINY_QWEN2, "vocab_size": 32}))
        self.teacher = teacher.requires_grad_(False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=LR)


def test_fit_finds_the_model_the_strategy_names_among_several(world_of_one: None) -> None:
    steps = 2
    module = StudentTeacherLM()
    teacher = {k: v.clone() for k, v in module.teacher.state_dict().items()}
    trainer = cpu_trainer(SkrullStrategy(bucket_size=80, model_attribute="model"), max_steps=steps)
    data = SkrullDataModule(train_data=make_data(), global_batch_size=GLOBAL_BATCH, shuffle=False)
    trainer.fit(module, data)
    assert trainer.global_step == steps
    ref, _ = reference_training(steps)
    params = {k: v.detach().numpy() for k, v in module.model.state_dict().items()}
    # see PARAM_ATOL: float32 summation order (measured 7.5e-9)
    assert max_diff(params, ref) < PARAM_ATOL
    # the teacher is neither trained nor switched to the Skrull attention
    assert all(torch.equal(v, teacher[k]) for k, v in module.teacher.state_dict().items())
    assert module.teacher.config._attn_implementation != "skrull"


# ----------------------------------------------------------------------------- named sets
def test_named_sets_keep_the_mapping_order() -> None:
    long, short = make_samples(5, seed=1), make_samples(7, seed=2)
    dm = SkrullDataModule(val_data={"long": long, "short": short}, test_data={"only": short})
    assert dm.val_set_names == ("long", "short") and dm.test_set_names == ("only",)
    dm.setup("validate")
    assert list(dm.val_datasets) == ["long", "short"] and dm.val_dataset is None
    assert dm.val_datasets["long"].lengths == [len(s["input_ids"]) for s in long]
    assert dm.val_datasets["short"].lengths == [len(s["input_ids"]) for s in short]
    assert list(dm.test_datasets) == ["only"] and dm.test_dataset is None
    # a datasets.DatasetDict is a mapping of sets too
    from datasets import Dataset, DatasetDict

    splits = DatasetDict({"b": Dataset.from_list(short), "a": Dataset.from_list(long)})
    from_dict = SkrullDataModule(val_data=splits)
    from_dict.setup("validate")
    assert list(from_dict.val_datasets) == ["b", "a"]
    assert from_dict.val_datasets["a"].lengths == [len(s["input_ids"]) for s in long]
    # one unnamed set: as before
    single = SkrullDataModule(val_data=long)
    single.setup("validate")
    assert single.val_set_names == () and single.val_datasets == {}
    assert single.val_dataset is not None and len(single.val_dataset) == 5


@pytest.mark.parametrize("argument", ["val_data", "test_data"])
def test_bad_named_sets_are_refused(argument: str) -> None:
    samples = make_samples(3)
    cases: list[tuple[object, type[Exception], str]] = [
        ({}, ValueError, rf"{argument}=\{{\}} names no set"),
        ({0: samples}, TypeError, rf"{argument} names its sets with strings.*key 0 \(int\)"),
        ({" ": samples}, ValueError, rf"{argument} has a blank set name ' '"),
        ({"a": samples, "b": []}, ValueError, rf"{argument}\['b'\] is an empty list; every set"),
        ({"a": None}, ValueError, rf"{argument}\['a'\] is None; every set needs"),
        (
            samples[0],
            ValueError,
            rf"{argument} is one sample dict \(keys \['input_ids', 'labels'\]\)",
        ),
    ]
    for value, error, message in cases:
        with pytest.raises(error, match=message):
            SkrullDataModule(**{argument: value})


def test_a_bad_sample_in_a_named_set_names_the_set() -> None:
    dm = SkrullDataModule(val_data={"short": make_samples(3), "long": [{"input_ids": []}]})
    with pytest.raises(ValueError, match=r"val_data\['long'\]: sample 0 has empty input_ids"):
        dm.setup("validate")


def test_monitoring_val_loss_with_named_sets_is_refused_at_setup() -> None:
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    sets = {"short": make_samples(3), "long": make_samples(4, seed=1)}
    for callback in (ModelCheckpoint(monitor="val_loss"), EarlyStopping(monitor="val_loss")):
        dm = SkrullDataModule(train_data=make_samples(), val_data=sets)
        dm.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[callback])
        kind = type(callback).__name__
        message = (
            rf"{kind}\(monitor='val_loss'\) cannot work with named validation sets: the strategy "
            rf"logs val_loss/short, val_loss/long .* e\.g\. {kind}\(monitor='val_loss/short'\)"
        )
        with pytest.raises(ValueError, match=message):
            dm.setup("fit")
    # a set's own key, or one unnamed set, is fine
    for val_data, monitor in ((sets, "val_loss/long"), (sets["short"], "val_loss")):
        dm = SkrullDataModule(train_data=make_samples(), val_data=val_data)
        callbacks = [ModelCheckpoint(monitor=monitor)]
        dm.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=callbacks)
        dm.setup("fit")


def _truncated(samples: list[dict[str, list[int]]], n: int) -> list[dict[str, list[int]]]:
    return [{k: v[:n] for k, v in s.items()} for s in samples]


def test_named_sets_are_checked_against_the_layout_and_need_dataloader_idx(
    world_of_one: None,
) -> None:
    from lightning_skrull.causal_lm import SkrullCausalLM

    short = make_data(5, seed=1, longest=30)
    long = make_samples(4, seed=3)  # 2..89 tokens, two of them over 40
    assert max(len(s["input_ids"]) for s in long) > 40
    sets = {"short": short, "long": long}
    strategy = SkrullStrategy(bucket_size=40)  # one process: sequences of up to 40 tokens
    # an over-long sample is refused, naming its set and the sample
    module = SkrullCausalLM(model={"model_type": "qwen2", **TINY_QWEN2})
    with pytest.raises(ValueError, match=r"val_data\['long'\]: sample \d+ has \d+ tokens"):
        cpu_trainer(strategy).validate(module, SkrullDataModule(val_data=sets))
    # truncate=True cuts it to 40 tokens, and each set's loss is that of its (cut) samples
    data = SkrullDataModule(val_data=sets, truncate=True, val_global_batch_size=3)
    results = cpu_trainer(SkrullStrategy(bucket_size=40)).validate(module, data)
    params = {k: v.detach().numpy() for k, v in module.model.state_dict().items()}
    # float32 sums in another order (packed micro-batches): 1e-5 relative
    assert results[0]["val_loss/short"] == pytest.approx(reference_loss(params, short), rel=1e-5)
    expected = reference_loss(params, _truncated(long, 40))
    assert results[1]["val_loss/long"] == pytest.approx(expected, rel=1e-5)
    # a validation_step without dataloader_idx: Lightning refuses several loaders
    with pytest.raises(RuntimeError, match=r"multiple `val_dataloader`, but no `dataloader_idx`"):
        cpu_trainer(SkrullStrategy(bucket_size=40)).validate(
            PlainLM(), SkrullDataModule(val_data=sets, truncate=True)
        )


class _EstimatingLM(PlainLM):
    """Reads ``trainer.estimated_stepping_batches`` in ``configure_optimizers``, as learning-rate
    schedules do: Lightning then builds the training loader in the middle of the strategy's
    setup."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.estimated = self.trainer.estimated_stepping_batches
        return super().configure_optimizers()


MEASURED_BUCKET = 96  # the longest of make_samples() has 86 tokens


class _AutoBucketOnCPU(SkrullStrategy):
    """``bucket_size="auto"`` as on CUDA, on the CPU: the bucket is ``"auto"`` from the start of
    setup until setup measures it (here: sets :data:`MEASURED_BUCKET`)."""

    def _check_trainer(self, trainer: L.Trainer) -> None:
        super()._check_trainer(trainer)  # built with an explicit bucket, which CPU accepts
        self._skrull_config = dataclasses.replace(self._skrull_config, bucket_size=AUTO_BUCKET)

    def _measure_bucket_size(self) -> None:
        self._skrull_config = dataclasses.replace(self._skrull_config, bucket_size=MEASURED_BUCKET)


def test_estimated_stepping_batches_before_the_auto_bucket_is_measured(
    world_of_one: None,
) -> None:
    """``trainer.estimated_stepping_batches`` in ``configure_optimizers`` with
    ``bucket_size="auto"``: the training loader Lightning builds then, before the bucket is
    measured, plans with the measured bucket (before, building it raised that the bucket was not
    measured yet); the estimate is the epoch's global batches."""
    buckets: list[int] = []

    class Buckets(L.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            buckets.append(args[1].rank_batch.plan.bucket_size)

    module = _EstimatingLM()
    trainer = cpu_trainer(_AutoBucketOnCPU(bucket_size=64), max_epochs=1, callbacks=[Buckets()])
    samples = make_samples()
    trainer.fit(module, SkrullDataModule(train_data=samples, global_batch_size=4))
    assert module.estimated == -(-len(samples) // 4) == len(buckets)
    assert set(buckets) == {MEASURED_BUCKET}
