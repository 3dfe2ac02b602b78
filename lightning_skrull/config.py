"""Configuration of the Skrull strategy and data module.

Each option is a field of a keyword-only dataclass with its own docstring; every check runs in
``__post_init__``, so a bad value fails when the config is built, not hours into a run. The
strategy and the data module build these configs from their keyword arguments, so users rarely
construct them directly; they document the knobs in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

from lightning_skrull.attention.backends import ATTENTION_BACKENDS, AttentionBackend
from lightning_skrull.scheduling import POLICIES, Policy
from lightning_skrull.scheduling.cost_model import CostModel

Calibration = Literal["online", "off"]
"""Whether the strategy refits the planner's cost model to measured micro-batch times."""
CALIBRATIONS: tuple[Calibration, ...] = ("online", "off")

AUTO_BUCKET = "auto"
"""``bucket_size="auto"``: measure the budget from peak memory at setup (CUDA only)."""


def _is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an ``int`` proper (``True``/``False`` are not counts)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_bools(**options: object) -> None:
    """Refuse an on/off option given anything but ``True`` or ``False`` (``"no"`` would be
    truthy, ``0`` / ``1`` hide a swapped argument).

    Raises:
        TypeError: naming the option and the type it got.
    """
    for name, value in options.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool (True or False), got {value!r}.")


@dataclass(kw_only=True)
class SkrullConfig:
    """What the strategy needs to plan, shard and run one global batch per optimizer step."""

    cp_size: int = 1
    """Ranks in one context-parallel (CP) group. The world (``devices * num_nodes``) must be a
    multiple of it; ``dp_size = world_size // cp_size``. CP groups are consecutive ranks."""

    bucket_size: int | Literal["auto"] | None = None
    """Token budget of one CP rank in one micro-batch (the paper's ``C``); it bounds activation
    memory and must be at least ``cp_size``. A sequence longer than ``cp_size * bucket_size``
    cannot be placed and raises ``ValueError`` naming it. ``None``: the smallest budget that
    holds the longest sequence of the data, ``ceil(longest / cp_size)``, chosen by the data
    module (no memory bound: set it for real runs). ``"auto"`` (CUDA; ``SkrullStrategy`` and
    ``SkrullFSDPStrategy``, refused by ``SkrullZero2Strategy``): measured at setup from the
    peak memory of a few probe steps, the largest budget that keeps 10% of the device free; the
    fit is logged."""

    policy: Policy = "skrull"
    """Scheduling policy: ``"skrull"`` (GDS + DACP), ``"dacp"``, ``"static"`` (every sequence
    distributed, the DeepSpeed-style baseline), ``"sorted"`` or ``"round_robin"``."""

    attention_backend: AttentionBackend = "auto"
    """Attention kernel: ``"auto"``, ``"sdpa"`` (any device, CPU too) or ``"flash"``
    (FlashAttention-2 varlen: flash-attn, else PyTorch's own; CUDA, bf16/fp16 only)."""

    cost_model: CostModel | None = None
    """Cost model the planner balances with. ``None``: built at setup from the HF model's
    config with :meth:`CostModel.from_hf_config` and the default hardware constants."""

    calibration: Calibration = "online"
    """``"online"``: every rank times its micro-batches' forward + backward, the ranks share
    the timings every few steps (one all-gather after the optimizer step) and refit the cost
    model's constants (:class:`~lightning_skrull.scheduling.OnlineCalibrator`); the refitted
    model plans from two global batches later on, is logged (``skrull/calibration/*``), saved
    in checkpoints and returned by ``strategy.cost_model``. ``"off"``: the given model, unchanged."""

    model_attribute: str | None = None
    """Dotted name of the Hugging Face model inside the LightningModule (``"model"``); needed
    only when the module holds several ``PreTrainedModel``s."""

    verify_plans: bool = True
    """Check every step, with one all-reduce of two integers, that all ranks planned the same
    global batch (a mismatch would otherwise hang in the CP collectives or train wrongly)."""

    log_stats: bool = True
    """Log the step loss and tokens per second (every step), and the supervised tokens, share of
    distributed sequences, estimated plan imbalance, micro-batches per rank and calibration
    (on Lightning's logging steps, every ``log_every_n_steps``) through the Trainer's loggers."""

    chunked_loss: bool = True
    """Compute the causal-LM loss with the chunked LM head + cross-entropy, which never holds
    the ``[tokens, vocab]`` logits (the model's output then has ``logits=None`` when it is given
    labels). ``False``: transformers' dense head and loss, with logits."""

    loss_kernel: str = "auto"
    """What computes the chunked loss: ``"auto"`` (on CUDA a fused kernel, Liger Kernel or Cut
    Cross-Entropy, when its package is installed; else the pure-PyTorch chunks), ``"chunked"``,
    ``"liger"`` or ``"cce"``. A named fused kernel that is not installed is refused when the
    strategy is built."""

    def __post_init__(self) -> None:
        if not _is_int(self.cp_size) or self.cp_size < 1:
            raise ValueError(
                f"cp_size={self.cp_size!r} is invalid; it must be an int >= 1 "
                "(1 = no context parallelism)."
            )
        if self.bucket_size is not None and self.bucket_size != AUTO_BUCKET:
            if not _is_int(self.bucket_size) or self.bucket_size < 1:
                raise ValueError(
                    f"bucket_size={self.bucket_size!r} is invalid; it is the token budget of one "
                    "CP rank in one micro-batch and must be an int >= 1 (typically the longest "
                    "sequence divided by cp_size, or more), 'auto' or None."
                )
            if self.bucket_size < self.cp_size:
                raise ValueError(
                    f"bucket_size={self.bucket_size} is smaller than cp_size={self.cp_size}; "
                    "bucket_size is the token budget of ONE CP rank, so a sequence sharded over "
                    f"the group could hold at most {self.capacity} tokens. "
                    "Give bucket_size >= cp_size (typically thousands of tokens), or check that "
                    "cp_size and bucket_size are not swapped."
                )
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} is unknown; choose one of {POLICIES}.")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend={self.attention_backend!r} is unknown; choose one of "
                f"{ATTENTION_BACKENDS}."
            )
        if self.calibration not in CALIBRATIONS:
            raise ValueError(
                f"calibration={self.calibration!r} is unknown; choose one of {CALIBRATIONS}."
            )
        if self.cost_model is not None:
            if not isinstance(self.cost_model, CostModel):
                raise TypeError(
                    f"cost_model must be a CostModel or None, got {type(self.cost_model).__name__}."
                )
        if not isinstance(self.loss_kernel, str):
            raise TypeError(f"loss_kernel must be a str, got {type(self.loss_kernel).__name__}.")
        check_bools(
            verify_plans=self.verify_plans, log_stats=self.log_stats, chunked_loss=self.chunked_loss
        )
        if self.model_attribute is not None and not isinstance(self.model_attribute, str):
            raise TypeError(
                f"model_attribute must be a str or None, got {type(self.model_attribute).__name__}."
            )

    @property
    def capacity(self) -> int:
        """The longest sequence one micro-batch can hold: ``cp_size * bucket_size`` tokens (a
        sequence sharded over the whole CP group, ``bucket_size`` tokens on each rank).

        Raises:
            RuntimeError: ``bucket_size`` is not resolved to a number of tokens yet (``"auto"``
                before the strategy's setup, or ``None`` before the data module chose it).
        """
        if not _is_int(self.bucket_size):
            raise RuntimeError(
                f"SkrullConfig.capacity is cp_size * bucket_size, but bucket_size="
                f"{self.bucket_size!r} is not a number of tokens yet: 'auto' is measured when the "
                "strategy sets up on the GPU, None is chosen by the data module from the longest "
                "sequence of the data. Read the capacity after setup, or give bucket_size as a "
                "number of tokens per rank."
            )
        return self.cp_size * self.bucket_size

    def resolve_bucket_size(self, longest_sequence: int) -> int:
        """The bucket size to plan with: the configured one, or, when it is ``None``, the
        smallest that holds ``longest_sequence`` (``ceil(longest_sequence / cp_size)``).

        Whether every sample fits ``cp_size * bucket_size`` is checked with the data (the data
        module validates it and names the first sample that does not fit).
        """
        if self.bucket_size == AUTO_BUCKET:
            raise RuntimeError(
                "bucket_size='auto' is measured when the strategy sets up on the GPU; the "
                "resolved value is in strategy.skrull_config.bucket_size after setup. Let the "
                "Trainer set up the strategy before building loaders."
            )
        if self.bucket_size is None:
            return -(-longest_sequence // self.cp_size)
        return int(self.bucket_size)


@dataclass(kw_only=True)
class DataConfig:
    """How the data module turns a dataset into global batches."""

    global_batch_size: int
    """Sequences per optimizer step, over all ranks together (one global batch = one step)."""

    val_global_batch_size: int | None = None
    """Sequences per validation step over all ranks; ``None`` = ``global_batch_size``."""

    shuffle: bool = True
    """Shuffle the training samples each epoch (seeded, identical on every rank). With
    ``False``, global batch ``k`` holds samples ``k*G .. k*G+G-1``."""

    seed: int = 0
    """Seed of the per-epoch shuffle (the epoch is mixed in, so every epoch differs)."""

    drop_last: bool = False
    """Drop the last, partial global batch of an epoch. By default it is trained."""

    num_workers: int = 0
    """DataLoader worker processes per rank that read, plan and collate global batches."""

    persistent_workers: bool = True
    """Keep the DataLoader workers alive across epochs and validation runs instead of starting
    them anew at each (nothing to keep with ``num_workers=0``). Each iteration hands the
    workers the sampler's position and the cost-model schedule, so the batches, and a resume,
    equal those of fresh workers."""

    val_split: int = 0
    """Samples of the training data held out for validation (a seeded choice, made once);
    0 = none. Use it instead of separate validation data, not with it."""

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "val_global_batch_size"):
            value: Any = getattr(self, name)
            if value is None and name == "val_global_batch_size":
                continue
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid; it must be an int >= 1.")
        if not _is_int(self.seed):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}.")
        if not _is_int(self.val_split) or self.val_split < 0:
            raise ValueError(
                f"val_split={self.val_split!r} is invalid; it is a number of held-out samples, "
                "an int >= 0."
            )
        if not _is_int(self.num_workers) or self.num_workers < 0:
            raise ValueError(
                f"num_workers={self.num_workers!r} is invalid; it must be an int >= 0."
            )
        check_bools(
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            persistent_workers=self.persistent_workers,
        )

    @property
    def validation_batch_size(self) -> int:
        """Sequences per validation step."""
        return self.val_global_batch_size or self.global_batch_size
