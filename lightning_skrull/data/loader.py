"""The loader of Skrull global batches: one :class:`SkrullBatch` of this rank per step.

:class:`SkrullDataLoader` is a ``DataLoader`` over a :class:`GlobalBatchStream`, an
``IterableDataset``, so Lightning never injects a ``DistributedSampler``; it is *stateful*
(Lightning saves its ``state_dict`` in every checkpoint and restores it on resume), so a run
resumed mid-epoch continues with exactly the global batches (and plans) it would have had.
Lightning's ``set_epoch`` reaches the sampler through the loader's ``sampler`` attribute (an
epoch forwarder), as for any DataLoader. Persistent workers read each iteration's sampler and
cost-model schedule from an :class:`IterationSnapshot` in shared memory.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import (
    DataLoader,
    IterableDataset,
    Sampler,
    SequentialSampler,
    get_worker_info,
)

from lightning_skrull.data.batch import RankPlanner, SkrullBatch
from lightning_skrull.data.dataset import SampleView, SFTDataset
from lightning_skrull.data.sampler import GlobalBatchSampler
from lightning_skrull.scheduling import CostModelSchedule

if TYPE_CHECKING:
    from lightning.pytorch.loops.progress import _ProcessedTracker


class GlobalBatchStream(IterableDataset):
    """Iterable over this rank's :class:`SkrullBatch` of each global batch of an epoch.

    With DataLoader workers, worker ``w`` of ``n`` builds global batches ``w, w+n, ...`` (counted
    from the resume position); the DataLoader takes them round-robin, so the order is kept.

    With a cost-model ``schedule`` (online calibration), each batch is planned with the model
    the schedule gives its position. Workers hold a copy of the schedule taken when the epoch's
    iteration started; :class:`SkrullDataLoader` plans again, in the main process, any batch
    planned with another model than the live schedule's.

    Args:
        dataset: the samples.
        sampler: the global-batch sampler (position and epoch live there).
        planner: this rank's planner (``None``: set before the first iteration, by the loader's
            ``prepare``).
        schedule: which cost model plans which batch (``None``: always the planner's).
        name: the name of a validation or test set, given to every batch as
            :attr:`SkrullBatch.dataset_name` (``None``: an unnamed set, or training).
    """

    def __init__(
        self,
        dataset: SFTDataset | SampleView,
        sampler: GlobalBatchSampler,
        planner: RankPlanner | None,
        schedule: CostModelSchedule | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.dataset = dataset
        self.sampler = sampler
        self.planner = planner
        self.schedule = schedule
        self.name = name
        self.snapshot: IterationSnapshot | None = None

    def build(self, indices: Sequence[int], epoch: int, index: int) -> SkrullBatch:
        """This rank's batch of the global batch ``indices`` at position ``(epoch, index)``."""
        planner = self.planner
        if planner is None:
            raise RuntimeError("a GlobalBatchStream without a planner was iterated")
        if self.schedule is not None:
            planner = planner.with_cost_model(self.schedule.model_for(epoch, index))
        samples = [self.dataset.arrays(i) for i in indices]
        batch = planner(samples, indices, epoch, index)
        batch.dataset_name = self.name
        return batch

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[SkrullBatch]:
        worker = get_worker_info()
        if worker is not None and self.snapshot is not None:
            # a persistent worker: the sampler and schedule of this iteration, not the copies
            # it was started with
            self.sampler, self.schedule = self.snapshot.read()
        epoch = self.sampler.epoch
        for k, indices in enumerate(self.sampler):
            if worker is not None and k % worker.num_workers != worker.id:
                continue
            index = self.sampler.batches_yielded - 1  # the sampler counts before it yields
            yield self.build(indices, epoch, index)


class IterationSnapshot:
    """The sampler and cost-model schedule of the current iteration, in shared memory, for
    persistent DataLoader workers.

    A worker started for an iteration gets a copy of the stream as it is then; a persistent
    worker keeps the copy of the first iteration, whose sampler still holds its first epoch (and
    any resume position), so every later epoch would repeat the first one's batches. The loader
    writes the main process's sampler and schedule here when an iteration starts, before the
    workers are told to begin it; each worker reads them when it begins.

    Args:
        capacity: bytes the pickled pair may take (a sampler and at most 8 cost models take
            about 4 KB).
    """

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._length = torch.zeros(1, dtype=torch.int64).share_memory_()
        self._bytes = torch.zeros(capacity, dtype=torch.uint8).share_memory_()

    def write(self, sampler: GlobalBatchSampler, schedule: CostModelSchedule | None) -> None:
        """Publish this iteration's sampler and schedule (main process)."""
        data = pickle.dumps((sampler, schedule))
        if len(data) > self._bytes.numel():
            raise RuntimeError(
                f"the sampler and cost-model schedule pickle to {len(data)} bytes, more than the "
                f"{self._bytes.numel()} the persistent workers' snapshot holds; use "
                "persistent_workers=False."
            )
        self._bytes[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._length[0] = len(data)

    def read(self) -> tuple[GlobalBatchSampler, CostModelSchedule | None]:
        """This iteration's sampler and schedule (a worker)."""
        length = int(self._length[0])
        if length == 0:
            raise RuntimeError("a persistent worker began an iteration the loader did not start")
        sampler, schedule = pickle.loads(self._bytes[:length].numpy().tobytes())
        return sampler, schedule


class _EpochForwarder(Sampler[None]):
    """The loader's ``sampler`` attribute: what an iterable DataLoader iterates (``None``
    forever), plus ``set_epoch`` forwarded to the global-batch sampler, which is where Lightning
    looks for it."""

    def __init__(self, target: GlobalBatchSampler) -> None:
        self.target = target

    def __iter__(self) -> Iterator[None]:
        while True:
            yield None

    def set_epoch(self, epoch: int) -> None:
        self.target.set_epoch(epoch)


# its __iter__ yields None forever, as the unordered one's; SequentialSampler's yields ints
class _OrderedEpochForwarder(_EpochForwarder, SequentialSampler):  # type: ignore[misc]
    """The forwarder of a loader whose global batches keep dataset order. It is a
    ``SequentialSampler`` to Lightning, which (under ``Trainer(overfit_batches=...)``) otherwise
    tries to rebuild the loader with one to turn shuffling off."""

    def __init__(self, target: GlobalBatchSampler) -> None:
        super().__init__(target)
        self.data_source = target  # SequentialSampler's length: the epoch's global batches


def _forwarder(sampler: GlobalBatchSampler) -> _EpochForwarder:
    return _EpochForwarder(sampler) if sampler.shuffle else _OrderedEpochForwarder(sampler)


class SkrullDataLoader(DataLoader):
    """DataLoader of :class:`SkrullBatch` per step, with a checkpointable position.

    Lightning saves :meth:`state_dict` in checkpoints and calls :meth:`load_state_dict` when it
    resumes; ``set_epoch`` reaches the sampler through :attr:`sampler`.

    Args:
        stream: the :class:`GlobalBatchStream`.
        num_workers: worker processes that build batches ahead.
        persistent_workers: keep the workers alive from one iteration (epoch, validation run)
            to the next (no effect without workers); each iteration hands them the sampler and
            schedule through an :class:`IterationSnapshot`, so they build the batches fresh
            workers would.
        trainer: the Trainer whose progress counts the batches actually trained (Lightning
            fetches ahead of training); without it, batches handed out are counted.
        prepare: called at the start of every iteration, in the main process, before any
            worker starts it: sets what the stream plans with from the strategy's state then.
    """

    def __init__(
        self,
        stream: GlobalBatchStream,
        *,
        num_workers: int = 0,
        persistent_workers: bool = False,
        trainer: pl.Trainer | None = None,
        prepare: Callable[[], None] | None = None,
    ) -> None:
        self._forwarder = _forwarder(stream.sampler)
        persistent_workers = persistent_workers and num_workers > 0
        stream.snapshot = IterationSnapshot() if persistent_workers else None
        super().__init__(
            stream,
            batch_size=None,
            num_workers=num_workers,
            collate_fn=_identity,
            persistent_workers=persistent_workers,
        )
        self._trainer = trainer
        self._prepare = prepare
        self._handed_out: tuple[int, int] | None = None  # (epoch, batches) handed out

    # DataLoader sets ``self.sampler`` in __init__; this property keeps that value out of the
    # way and shows Lightning the forwarder, whose ``set_epoch`` it calls every epoch.
    @property  # type: ignore[override]
    def sampler(self) -> Sampler[Any]:
        return self._forwarder

    @sampler.setter
    def sampler(self, value: Sampler[Any]) -> None:
        self._base_sampler = value

    @property
    def global_batch_sampler(self) -> GlobalBatchSampler:
        """The sampler that draws the global batches."""
        return self.dataset.sampler  # type: ignore[attr-defined,no-any-return]

    # A generator over DataLoader's own iterator, not a ``_BaseDataLoaderIter`` as the stub's
    # return type says; Lightning only iterates it.
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        stream: GlobalBatchStream = self.dataset  # type: ignore[assignment]
        if self._prepare is not None:
            self._prepare()
        schedule = stream.schedule
        if stream.snapshot is not None:  # before super().__iter__() tells the workers to begin
            stream.snapshot.write(stream.sampler, schedule)
        for batch in super().__iter__():
            if schedule is not None:
                model = schedule.model_for(batch.epoch, batch.index)
                if batch.planned_with != model:  # a worker planned it with an older model
                    indices = batch.rank_batch.sample_indices
                    batch = stream.build(indices, batch.epoch, batch.index)
            self._handed_out = (batch.epoch, batch.index + 1)
            yield batch

    def _batches_trained(self) -> int | None:
        """Global batches of the current epoch trained so far (``None``: the sampler's count).

        Under a fitting Trainer, its progress counter (batches whose training step ran);
        Lightning fetches ahead, so the batches handed out would overcount. Otherwise the
        batches this loader handed out.
        """
        sampler = self.global_batch_sampler
        trainer = self._trainer
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            # Declared as the base tracker; _BatchProgress builds a _ProcessedTracker.
            progress = cast("_ProcessedTracker", trainer.fit_loop.epoch_loop.batch_progress.current)
            return min(int(progress.processed), len(sampler))
        if self._handed_out is not None and self._handed_out[0] == sampler.epoch:
            return self._handed_out[1]
        return None

    def _num_tokens(self) -> int:
        """Tokens of all the samples this loader draws from (after any truncation)."""
        stream: GlobalBatchStream = self.dataset  # type: ignore[assignment]
        return sum(stream.dataset.lengths)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state with the number of global batches trained in this epoch, and
        the samples' total token count (``num_tokens``)."""
        state = self.global_batch_sampler.state_dict(batches_consumed=self._batches_trained())
        state["num_tokens"] = self._num_tokens()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position (checked against this run's data and batch size).

        The state holds no rank or layout: a run resumed on another number of processes or
        another ``cp_size`` continues with the same global batches.

        Raises:
            ValueError: the sampler's settings differ (see
                :meth:`GlobalBatchSampler.load_state_dict`), or the samples hold another total
                of tokens than in the saved run (other data, or ``truncate=True`` under another
                ``cp_size * bucket_size``).
        """
        saved = state.get("num_tokens")  # absent from checkpoints of earlier versions
        if saved is not None and int(saved) != self._num_tokens():
            raise ValueError(
                f"Cannot resume: the saved run's training samples held {int(saved)} tokens in "
                f"all, this run's hold {self._num_tokens()}, so the remaining global batches "
                "would hold other tokens. Resume with the same data; with truncate=True, also "
                "with the same cp_size * bucket_size (the length samples are cut to)."
            )
        self.global_batch_sampler.load_state_dict(state)


def _identity(batch: Any) -> Any:
    return batch
