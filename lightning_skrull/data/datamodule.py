"""``SkrullDataModule``: global batches, planned and collated per rank, for the Skrull strategies.

Each rank's train loader yields, per optimizer step, a :class:`SkrullBatch`: this rank's
:class:`~lightning_skrull.data.collate.RankBatch` (all its micro-batches of one global batch)
plus the plan's statistics. Every rank draws the same global batch from the same
:class:`~lightning_skrull.data.sampler.GlobalBatchSampler` (seeded, no communication), plans it
with :func:`~lightning_skrull.scheduling.plan_global_batch` and keeps its own micro-batches.

The data module reads and checks the data and builds the loaders
(:class:`~lightning_skrull.data.loader.SkrullDataLoader`: stateful, so a run resumed mid-epoch
continues with exactly the global batches, and plans, it would have had).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import partial
from typing import Any, NoReturn

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_skrull.config import DataConfig, check_bools
from lightning_skrull.data.batch import (
    LOSS_KEYS,
    PlanSettings,
    RankPlanner,
    SkrullTrainingStrategy,
    is_skrull_training_strategy,
)
from lightning_skrull.data.bundled import load_bundled_dataset
from lightning_skrull.data.cache import cached_sft_data, is_cacheable
from lightning_skrull.data.chat import ChatTurns, check_chat_turns
from lightning_skrull.data.dataset import SampleView, SFTDataset, split_dataset
from lightning_skrull.data.formats import RAW_COLUMNS
from lightning_skrull.data.loader import GlobalBatchStream, SkrullDataLoader
from lightning_skrull.data.sampler import GlobalBatchSampler
from lightning_skrull.data.sources import SFTData, load_sft_data

BUNDLED_PREFIX = "bundled:"
"""``train_data="bundled:mixed_tiny"`` loads a dataset shipped with the package."""


def _is_bundled(data: SFTData) -> bool:
    return isinstance(data, str) and data.startswith(BUNDLED_PREFIX)


def named_sets(data: SFTData, argument: str) -> dict[str, SFTData] | None:
    """The sets of ``data`` given as a mapping ``name -> data``, in the mapping's order.

    Args:
        data: ``val_data`` or ``test_data`` as given to :class:`SkrullDataModule`.
        argument: its name, for the errors.

    Returns:
        ``None`` when ``data`` is not a mapping (one unnamed set, or none).

    Raises:
        ValueError: an empty mapping, a blank name, a set that is ``None`` or holds no
            sample, or one sample dict where the sets were expected.
        TypeError: a name that is not a string.
    """
    if not isinstance(data, Mapping):
        return None
    if any(key in data for key in ("input_ids", *RAW_COLUMNS)):
        raise ValueError(
            f"{argument} is one sample dict (keys {sorted(map(str, data))}); give a list of "
            f"samples, or several sets as a mapping name -> data, e.g. {argument}="
            "{'short': short_samples, 'long': long_samples}."
        )
    if not data:
        raise ValueError(
            f"{argument}={{}} names no set; give at least one name -> data, e.g. {argument}="
            "{'short': short_samples, 'long': long_samples}, or None for no set."
        )
    sets: dict[str, SFTData] = {}
    for name, value in data.items():
        if not isinstance(name, str):
            raise TypeError(
                f"{argument} names its sets with strings (they become metric names such as "
                f"val_loss/<name>); got the key {name!r} ({type(name).__name__}). Use e.g. "
                f"{str(name)!r}."
            )
        if not name.strip():
            raise ValueError(
                f"{argument} has a blank set name {name!r}; the name becomes part of metric "
                "names such as val_loss/<name>, so give each set a non-blank name."
            )
        if value is None or (_is_sized(value) and len(value) == 0):
            what = "None" if value is None else f"an empty {type(value).__name__}"
            raise ValueError(
                f"{argument}[{name!r}] is {what}; every set needs at least one sample: give it "
                "samples or leave the set out of the mapping."
            )
        sets[name] = value
    return sets


def _is_sized(value: Any) -> bool:
    return hasattr(value, "__len__") and not isinstance(value, (str, bytes, os.PathLike))


def _raise_in_set(label: str, err: Exception) -> NoReturn:
    """Raise ``err`` again with ``label`` (e.g. ``val_data['long']``) in front of its message
    when it is a plain ``ValueError`` or ``TypeError`` (other types keep their message)."""
    if type(err) not in (ValueError, TypeError):
        raise err
    raise type(err)(f"{label}: {err}") from err


class SkrullDataModule(pl.LightningDataModule):
    """SFT data as Skrull global batches: one optimizer step per global batch.

    Use it with a Skrull strategy (``Trainer(strategy="skrull")`` or
    :class:`~lightning_skrull.SkrullStrategy`); it reads the rank layout, the token budget,
    the policy and the cost model from ``trainer.strategy``.

    Args:
        train_data: samples ``{"input_ids": [...], "labels": [...]}`` (labels optional, -100 =
            not supervised); with ``tokenizer``, chat samples ``{"messages": [...]}`` or
            ShareGPT ``{"conversations": [{"from": ..., "value": ...}]}`` (either with its own
            ``tools``), text ``{"text": ...}`` or prompt-completion ``{"prompt": ..., "completion": ...}``
            samples (strings, or lists of messages; docs/data.md says what is supervised); a
            ``datasets.Dataset``, path(s) to JSONL / parquet files, an ``SFTDataset``, or
            ``"bundled:mixed_tiny"`` for the dataset shipped with the package.
        global_batch_size: sequences per optimizer step over all ranks.
        shuffle: seeded shuffle per epoch (``False``: global batch ``k`` holds samples
            ``k*G .. k*G+G-1``; the planner reorders only inside it).
        seed: shuffle seed.
        val_data: validation samples, any form ``train_data`` takes (``None``: no validation);
            or several validation sets as a mapping ``name -> data`` (e.g.
            ``{"short": chat, "long": documents}``): one validation loader per set, in the
            mapping's order (Lightning's ``dataloader_idx``), each set validated and batched
            alone, and the strategy logs ``val_loss/<name>`` per set and no plain ``val_loss``.
        val_global_batch_size: sequences per validation step (default ``global_batch_size``),
            of every validation and test set alike.
        val_split: hold out this many training samples (seeded by ``seed``) for validation,
            instead of ``val_data`` (one set).
        test_data: samples for ``trainer.test``, any form ``train_data`` takes (batched like
            validation); or several test sets as a mapping ``name -> data``, as ``val_data``
            (logged as ``test_loss/<name>``).
        drop_last: drop the last partial global batch of each training epoch.
        num_workers: DataLoader workers per rank building batches ahead.
        persistent_workers: keep those workers alive across epochs and validation runs
            rather than starting them anew at each (no effect with ``num_workers=0``). On by
            default: a restart costs every epoch and every validation run the workers' start,
            about 0.1 s with ``fork`` and about 10 s with ``spawn`` or ``forkserver`` (Python
            3.14's default on Linux; more on a busy machine), docs/data.md. The batches, and a
            resume, are those of fresh workers; ``False`` starts them anew each time.
        tokenizer: HF tokenizer (or its name / path) for chat, text and prompt-completion
            samples; chat samples are rendered with its chat template and only assistant tokens
            are supervised, prompt-completion samples only their completion.
        chat_template_kwargs: extra arguments for ``tokenizer.apply_chat_template``, for every
            sample; a sample's own ``tools`` are added to them (not both for one sample).
        chat_turns: which assistant turns of a chat sample are supervised: ``"all"``, or
            ``"last"``, only the last one (the sample then ends with it); ``"last"`` works with
            templates that render a turn differently once later turns follow (Qwen3's), which
            ``"all"`` refuses.
        truncate: cut samples longer than ``cp_size * bucket_size`` instead of raising.
        cache_dir: where data files and file-backed ``datasets.Dataset`` inputs are tokenised
            once and cached as memory-mapped arrays (default: ``$LIGHTNING_SKRULL_CACHE``, else
            ``$HF_HOME/lightning_skrull/data``,
            else ``$XDG_CACHE_HOME/lightning_skrull/data``, else
            ``~/.cache/lightning_skrull/data``). In-memory samples and ``bundled:`` data are
            never cached.
        num_proc: worker processes that tokenise while the cache is built (default: the CPUs
            available, at most 8).

    Raises:
        ValueError: a bad option (see :class:`~lightning_skrull.config.DataConfig`), or bad
            sets in ``val_data`` / ``test_data`` (see :func:`named_sets`).
        TypeError: a set name that is not a string.
    """

    def __init__(
        self,
        train_data: SFTData = None,
        global_batch_size: int = 32,
        shuffle: bool = True,
        seed: int = 0,
        *,
        val_data: SFTData = None,
        val_global_batch_size: int | None = None,
        val_split: int = 0,
        test_data: SFTData = None,
        drop_last: bool = False,
        num_workers: int = 0,
        persistent_workers: bool = True,
        tokenizer: Any = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_turns: ChatTurns = "all",
        truncate: bool = False,
        cache_dir: str | os.PathLike[str] | None = None,
        num_proc: int | None = None,
    ) -> None:
        super().__init__()
        if val_split and val_data is not None:
            raise ValueError(
                f"give val_data or val_split={val_split}, not both: val_split holds out part of "
                "train_data for validation."
            )
        self.config = DataConfig(
            global_batch_size=global_batch_size,
            val_global_batch_size=val_global_batch_size,
            val_split=val_split,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            num_workers=num_workers,
            persistent_workers=persistent_workers,
        )
        self.train_data = train_data
        self.val_data = val_data
        self.test_data = test_data
        self._val_sets = named_sets(val_data, "val_data")
        self._test_sets = named_sets(test_data, "test_data")
        self.tokenizer = tokenizer
        self.chat_template_kwargs = chat_template_kwargs
        self.chat_turns = check_chat_turns(chat_turns)
        check_bools(truncate=truncate)
        self.truncate = truncate
        if num_proc is not None and (isinstance(num_proc, bool) or not isinstance(num_proc, int)):
            raise TypeError(f"num_proc must be an int or None, got {num_proc!r}.")
        if num_proc is not None and num_proc < 1:
            raise ValueError(f"num_proc must be >= 1 (worker processes), got {num_proc}.")
        self.cache_dir = cache_dir
        self.num_proc = num_proc
        self._tokenizer_object: Any = None
        self.train_dataset: SFTDataset | SampleView | None = None
        self.val_dataset: SFTDataset | SampleView | None = None
        self.test_dataset: SFTDataset | None = None
        self.val_datasets: dict[str, SFTDataset] = {}
        self.test_datasets: dict[str, SFTDataset] = {}

    @property
    def val_set_names(self) -> tuple[str, ...]:
        """The names of the validation sets of ``val_data={name: ...}``, in loader order
        (empty for one unnamed set or none)."""
        return tuple(self._val_sets or ())

    @property
    def test_set_names(self) -> tuple[str, ...]:
        """The names of the test sets of ``test_data={name: ...}``, in loader order."""
        return tuple(self._test_sets or ())

    def _sources(self) -> list[SFTData]:
        """Every data source given: training, then each validation and test set."""
        sources = [self.train_data]
        for data, sets in ((self.val_data, self._val_sets), (self.test_data, self._test_sets)):
            sources.extend(sets.values() if sets is not None else [data])
        return [d for d in sources if d is not None]

    # ------------------------------------------------------------------ Lightning hooks
    def prepare_data(self) -> None:
        """Tokenise data files once into the cache (Lightning runs this on one process per
        node, before ``setup`` on every process); a cache that is up to date is reused."""
        for data in self._sources():
            if not _is_bundled(data) and is_cacheable(data):
                self._cached(data)

    def _tokenizer(self) -> Any:
        if self._tokenizer_object is None:
            tokenizer = self.tokenizer
            if isinstance(tokenizer, (str, os.PathLike)):
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(tokenizer)
            self._tokenizer_object = tokenizer
        return self._tokenizer_object

    def _cached(self, data: SFTData) -> SFTDataset:
        cached = cached_sft_data(
            data,
            tokenizer=self._tokenizer(),
            chat_template_kwargs=self.chat_template_kwargs,
            chat_turns=self.chat_turns,
            cache_dir=self.cache_dir,
            num_proc=self.num_proc,
        )
        rank_zero_info(cached.describe())
        return cached.dataset

    def _load(self, data: SFTData) -> SFTDataset:
        if _is_bundled(data):
            return load_bundled_dataset(data[len(BUNDLED_PREFIX) :] or "mixed_tiny")
        if is_cacheable(data):
            # prepare_data built it; a process that finds it absent (prepare_data ran on another
            # node, or not at all) builds it under the cache's lock, so it is never half-read
            return self._cached(data)
        return load_sft_data(
            data,
            tokenizer=self._tokenizer(),
            chat_template_kwargs=self.chat_template_kwargs,
            chat_turns=self.chat_turns,
        )

    def setup(self, stage: str) -> None:
        """Read (and tokenise) the data; the checks against the model come with the loaders."""
        if stage == "fit" and self.train_data is None:
            raise ValueError(
                "SkrullDataModule(train_data=None) cannot fit; give samples, a datasets.Dataset, "
                "JSONL/parquet path(s), or 'bundled:mixed_tiny'."
            )
        if self.train_data is not None and self.train_dataset is None:
            dataset = self._load(self.train_data)
            if self.config.val_split:
                self.train_dataset, self.val_dataset = split_dataset(
                    dataset, self.config.val_split, seed=self.config.seed
                )
            else:
                self.train_dataset = dataset
        if self._val_sets is not None:
            if not self.val_datasets:
                self.val_datasets = self._load_sets(self._val_sets, "val_data")
        elif self.val_data is not None and self.val_dataset is None:
            self.val_dataset = self._load(self.val_data)
        if self._test_sets is not None:
            if not self.test_datasets:
                self.test_datasets = self._load_sets(self._test_sets, "test_data")
        elif self.test_data is not None and self.test_dataset is None:
            self.test_dataset = self._load(self.test_data)
        if stage == "fit":
            self._check_monitors()

    def _load_sets(self, sets: dict[str, SFTData], argument: str) -> dict[str, SFTDataset]:
        loaded = {}
        for name, data in sets.items():
            try:
                loaded[name] = self._load(data)
            except (ValueError, TypeError) as err:
                _raise_in_set(f"{argument}[{name!r}]", err)
        return loaded

    def _check_monitors(self) -> None:
        """Refuse a callback that monitors ``val_loss`` when the validation sets are named:
        the strategy then logs ``val_loss/<name>`` per set and no ``val_loss``, and Lightning
        would find the key missing only after the first validation."""
        trainer = self.trainer
        if self._val_sets is None or trainer is None:
            return
        loss = LOSS_KEYS["validation"]
        keys = [f"{loss}/{name}" for name in self._val_sets]
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if getattr(callback, "monitor", None) == loss:
                kind = type(callback).__name__
                raise ValueError(
                    f"{kind}(monitor={loss!r}) cannot work with named validation sets: the "
                    f"strategy logs {', '.join(keys)} (one per set of val_data) and no plain "
                    f"{loss!r}. Monitor the set to decide on, e.g. {kind}(monitor={keys[0]!r}); "
                    "to decide on a combination of the sets, log it yourself under another "
                    "name (e.g. in on_validation_epoch_end) and monitor that."
                )

    def train_dataloader(self) -> SkrullDataLoader:
        """This rank's loader of training global batches."""
        if self.train_dataset is None:
            raise RuntimeError("train_dataloader() before setup('fit'); let the Trainer call it.")
        shuffle = self.config.shuffle
        overfit = getattr(self.trainer, "overfit_batches", 0)  # set by the Trainer's setup
        if shuffle and overfit:
            # what Lightning does to its own loaders: the same first batches every epoch
            rank_zero_warn(
                f"Trainer(overfit_batches={overfit}): the training global batches are drawn in "
                "dataset order (shuffle=False), so every epoch trains the same first batches."
            )
            shuffle = False
        sampler = GlobalBatchSampler(
            len(self.train_dataset),
            self.config.global_batch_size,
            shuffle=shuffle,
            seed=self.config.seed,
            drop_last=self.config.drop_last,
        )
        return self._loader(self.train_dataset, sampler, "train_dataloader")

    def val_dataloader(self) -> SkrullDataLoader | list[SkrullDataLoader]:
        """This rank's loader of validation global batches (dataset order, every sample once);
        with named sets, one loader per set in the order of ``val_data``."""
        if self.val_datasets:
            return [
                self._eval_loader(dataset, "val_dataloader", name)
                for name, dataset in self.val_datasets.items()
            ]
        if self.val_dataset is None:
            return []
        return self._eval_loader(self.val_dataset, "val_dataloader")

    def test_dataloader(self) -> SkrullDataLoader | list[SkrullDataLoader]:
        """This rank's loader of test global batches (dataset order, every sample once); with
        named sets, one loader per set in the order of ``test_data``."""
        if self.test_datasets:
            return [
                self._eval_loader(dataset, "test_dataloader", name)
                for name, dataset in self.test_datasets.items()
            ]
        if self.test_dataset is None:
            return []
        return self._eval_loader(self.test_dataset, "test_dataloader")

    def _eval_loader(
        self, dataset: SFTDataset | SampleView, hook: str, name: str | None = None
    ) -> SkrullDataLoader:
        sampler = GlobalBatchSampler(len(dataset), self.config.validation_batch_size, shuffle=False)
        return self._loader(dataset, sampler, hook, name)

    # ------------------------------------------------------------------ internals
    def _strategy(self, hook: str) -> SkrullTrainingStrategy:
        trainer = self.trainer
        if trainer is None:
            raise RuntimeError(
                f"SkrullDataModule.{hook}() needs the Trainer: pass the data module to "
                "trainer.fit(model, datamodule=...) rather than calling it directly."
            )
        strategy = trainer.strategy
        if not is_skrull_training_strategy(strategy):
            raise TypeError(
                f"SkrullDataModule needs a Skrull strategy, but the Trainer uses "
                f"{type(strategy).__name__}; pass Trainer(strategy='skrull') or "
                "Trainer(strategy=SkrullStrategy(cp_size=..., bucket_size=...))."
            )
        return strategy

    def _resolve_bucket_size(self, settings: PlanSettings) -> int:
        """The bucket to plan with: the strategy's, or (``bucket_size=None``) the smallest that
        holds the longest sequence of every set of the data module."""
        longest = 0
        if settings.config.bucket_size is None:
            datasets = [self.train_dataset, self.val_dataset, self.test_dataset]
            datasets += [*self.val_datasets.values(), *self.test_datasets.values()]
            longest = max(max(d.lengths) for d in datasets if d is not None)
        return settings.config.resolve_bucket_size(longest)

    def _validate(
        self, stream: GlobalBatchStream, strategy: SkrullTrainingStrategy, hook: str
    ) -> None:
        """Check the stream's samples against the strategy's published
        :attr:`~lightning_skrull.data.batch.SkrullTrainingStrategy.plan_settings` and give it
        its planner, once they are published (a ``bucket_size="auto"`` is measured late in
        the strategy's setup: then when an iteration starts); a training stream follows the
        strategy's cost-model schedule."""
        settings = strategy.plan_settings
        if stream.planner is None and settings is not None:
            bucket = self._resolve_bucket_size(settings)
            try:
                stream.dataset.validate(
                    max_tokens=strategy.cp_size * bucket,
                    vocab_size=settings.vocab_size,
                    truncate=self.truncate,
                    image_token_id=settings.image_token_id,
                )
            except (ValueError, TypeError) as err:
                if stream.name is None:
                    raise
                argument = "val_data" if hook == "val_dataloader" else "test_data"
                _raise_in_set(f"{argument}[{stream.name!r}]", err)
            stream.planner = RankPlanner.for_strategy(strategy, bucket_size=bucket)
        if hook == "train_dataloader":
            stream.schedule = strategy.cost_model_schedule

    def _loader(
        self,
        dataset: SFTDataset | SampleView,
        sampler: GlobalBatchSampler,
        hook: str,
        name: str | None = None,
    ) -> SkrullDataLoader:
        strategy = self._strategy(hook)
        if hook == "train_dataloader" and sampler.global_batch_size < strategy.dp_size:
            raise ValueError(
                f"global_batch_size={sampler.global_batch_size} is smaller than the "
                f"{strategy.dp_size} DP ranks (world size / cp_size): some DP ranks would get no "
                "sequence in any step and only idle. Set global_batch_size >= "
                f"{strategy.dp_size} (any number works; more sequences per DP rank balance "
                "better), or use fewer processes or a larger cp_size."
            )
        stream = GlobalBatchStream(dataset, sampler, None, None, name)
        self._validate(stream, strategy, hook)  # refuse samples that do not fit now, when known
        trainer = self.trainer if hook == "train_dataloader" else None
        return SkrullDataLoader(
            stream,
            num_workers=self.config.num_workers,
            persistent_workers=self.config.persistent_workers,
            trainer=trainer,
            prepare=partial(self._validate, stream, strategy, hook),
        )
