"""Load a pretrained Hugging Face decoder once per job: on global rank 0 only.

:func:`from_pretrained_on_rank_zero` reads the weights on the process that will be global
rank 0 and builds the same architecture on the meta device everywhere else (no memory for
weights). :class:`~lightning_skrull.SkrullFSDPStrategy` then shards the model and fills every
rank's shards from rank 0's weights, so a node holds one full copy of the model (on rank 0's
host) instead of one per process.

A LightningModule's ``__init__`` usually runs before the process group exists, so the rank is
read from the environment the launchers set (:func:`launched_as_rank_zero`); when it cannot be
known the model is loaded in full, which costs memory, never correctness.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_skrull.models.families.vision_language import is_multimodal

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

MODEL_KWARGS = ("dtype", "torch_dtype", "attn_implementation", "trust_remote_code")
"""Keyword arguments of ``from_pretrained`` that shape the model itself; the meta build on the
other ranks gets them too."""

WEIGHT_FILE_KWARGS = ("use_safetensors", "variant", "weights_only", "disable_mmap")
"""Keyword arguments that only choose how the weight files are read (rank 0's business)."""


def _int_or_none(environ: Mapping[str, str], key: str) -> int | None:
    value = environ.get(key)
    return int(value) if value not in (None, "") else None


def launched_as_rank_zero(environ: Mapping[str, str] | None = None) -> bool | None:
    """Whether this process is (or will become) global rank 0, read from the environment.

    The rule, first match wins:

    1. ``WORLD_SIZE=1``: a single process, rank 0.
    2. ``RANK`` (torchrun, torchelastic, Lightning's multi-node environments): rank 0 iff 0.
    3. ``LOCAL_RANK`` and ``NODE_RANK`` (or ``GROUP_RANK``), as Lightning's script launcher
       sets them for the processes it starts: the global rank is ``NODE_RANK * processes per
       node + LOCAL_RANK``, so it is 0 iff both are 0, and not 0 as soon as either is positive
       (``NODE_RANK`` alone suffices for the launching process of a node other than the first).
    4. ``SLURM_PROCID``, then ``JSM_NAMESPACE_RANK`` (SLURM, LSF): rank 0 iff 0.
    5. Otherwise unknown: ``None`` (a script before Lightning launched its processes, a
       notebook, a single process).

    Args:
        environ: the environment to read (default ``os.environ``).

    Returns:
        ``True`` (rank 0), ``False`` (another rank) or ``None`` (unknown).
    """
    env = os.environ if environ is None else environ
    if _int_or_none(env, "WORLD_SIZE") == 1:
        return True
    rank = _int_or_none(env, "RANK")
    if rank is not None:
        return rank == 0
    local_rank = _int_or_none(env, "LOCAL_RANK")
    node_rank = _int_or_none(env, "NODE_RANK")
    if node_rank is None:
        node_rank = _int_or_none(env, "GROUP_RANK")
    if (local_rank or 0) > 0 or (node_rank or 0) > 0:
        return False
    if local_rank == 0 and node_rank == 0:
        return True
    for key in ("SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        rank = _int_or_none(env, key)
        if rank is not None:
            return rank == 0
    return None


def loads_weights_here(environ: Mapping[str, str] | None = None) -> bool:
    """Whether :func:`from_pretrained_on_rank_zero` reads the weights in this process.

    In an initialised process group: iff this is global rank 0. Before one exists: unless the
    environment says this is another rank (:func:`launched_as_rank_zero` is ``False``).
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return launched_as_rank_zero(environ) is not False


def auto_model_class(config: PretrainedConfig) -> Any:
    """The transformers auto class that builds ``config``'s trainable model:
    ``AutoModelForImageTextToText`` for a supported vision-language checkpoint (Gemma 3,
    Mistral Small 3.x; :data:`~lightning_skrull.models.families.vision_language.MULTIMODAL_MODEL_TYPES`),
    else ``AutoModelForCausalLM``.

    ``AutoModelForCausalLM`` maps ``gemma3`` to ``Gemma3ForConditionalGeneration`` but has no
    entry for ``mistral3``; ``AutoModelForImageTextToText`` maps both to their
    ``...ForConditionalGeneration`` class, the one the package trains on text.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_multimodal(config) else AutoModelForCausalLM


def _meta_build_arguments(
    name_or_path: str | os.PathLike[str], kwargs: Mapping[str, Any]
) -> tuple[PretrainedConfig, dict[str, Any]]:
    """``(config, from_config keyword arguments)`` of the model ``from_pretrained(name_or_path,
    **kwargs)`` loads, or a ValueError for arguments a meta build cannot follow."""
    from transformers import AutoConfig, PretrainedConfig

    rest = dict(kwargs)
    model_kwargs = {k: rest.pop(k) for k in MODEL_KWARGS if k in rest}
    for key in WEIGHT_FILE_KWARGS:
        rest.pop(key, None)
    dequantizing = getattr(rest.get("quantization_config"), "dequantize", False) is True
    if dequantizing:
        # Mxfp4Config(dequantize=True): rank 0 gets the plain model, which from_config builds
        rest.pop("quantization_config")
    for key in ("dtype", "torch_dtype"):
        if model_kwargs.get(key) in ("auto", None):
            model_kwargs.pop(key, None)  # the checkpoint's dtype, the config's
    config = rest.pop("config", None)
    if not isinstance(config, PretrainedConfig):
        trust = model_kwargs.get("trust_remote_code")
        config, rest = AutoConfig.from_pretrained(
            config if config is not None else name_or_path,
            return_unused_kwargs=True,
            **({"trust_remote_code": trust} if trust is not None else {}),
            **rest,
        )
    if dequantizing and hasattr(config, "quantization_config"):
        config = copy.deepcopy(config)  # the caller's config stays as it was
        del config.quantization_config  # as from_pretrained leaves rank 0's once dequantized
    if rest:
        raise ValueError(
            f"from_pretrained_on_rank_zero cannot follow {sorted(rest)} on the ranks that build "
            "the model on the meta device: those arguments change how the weights are loaded "
            "or placed, and every rank must build the same model. Load with "
            f"{auto_model_class(config).__name__}.from_pretrained({str(name_or_path)!r}, ...) on "
            "every rank instead, or drop them (the strategy places and casts the weights)."
        )
    return config, model_kwargs


def from_pretrained_on_rank_zero(
    name_or_path: str | os.PathLike[str], **kwargs: Any
) -> PreTrainedModel:
    """``from_pretrained`` of the checkpoint's model class on global rank 0; the same model on
    the meta device on every other rank.

    The class is :func:`auto_model_class`'s: ``AutoModelForCausalLM``'s for a text model, the
    ``...ForConditionalGeneration`` class of a supported vision-language checkpoint (Gemma 3,
    Mistral Small 3.1 / 3.2), trained on text only.

    Use it in a LightningModule's ``__init__`` with
    :class:`~lightning_skrull.SkrullFSDPStrategy`: at setup the strategy shards the model and
    fills each rank's shards (and the buffers, such as the rotary embedding's) from rank 0's
    weights, so the job reads the checkpoint once and holds one full copy, on rank 0's host.
    Which process loads follows :func:`loads_weights_here`; a process that cannot tell its
    rank loads in full. In a single process it is ``from_pretrained``.

    Args:
        name_or_path: a Hugging Face model name or a local directory.
        **kwargs: ``from_pretrained``'s keyword arguments. Those that shape the model
            (:data:`MODEL_KWARGS`), choose the weight files (:data:`WEIGHT_FILE_KWARGS`), reach
            the Hub (``revision``, ``token``, ``cache_dir``, ...) or override config fields
            (``use_cache=False``) apply on every rank. A ``quantization_config`` that
            dequantizes while loading (``Mxfp4Config(dequantize=True)``) gives rank 0 the
            plain model, which the other ranks build.

    Returns:
        The model: with its weights on global rank 0, on the meta device elsewhere (in
        ``eval()`` mode on both, as ``from_pretrained`` returns it).

    Raises:
        ValueError: a keyword argument that only placing or loading weights understands
            (``device_map``, a ``quantization_config`` that keeps the weights quantized, ...):
            on every rank, so no rank is left waiting at setup.
    """
    config, model_kwargs = _meta_build_arguments(name_or_path, kwargs)
    auto_class = auto_model_class(config)
    if loads_weights_here():
        return auto_class.from_pretrained(name_or_path, **kwargs)  # type: ignore[no-any-return]
    with torch.device("meta"):
        model = auto_class.from_config(config, **model_kwargs)
    return model.eval()  # type: ignore[no-any-return]
