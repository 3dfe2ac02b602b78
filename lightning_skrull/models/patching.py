"""Prepare a Hugging Face decoder for Skrull context parallelism, or refuse it loudly.

:func:`prepare_model` registers the ``"skrull"`` attention with transformers'
``AttentionInterface``, switches the model to it through ``set_attn_implementation`` (the public
way transformers offers; nothing in transformers is monkeypatched), makes every forward under
that attention run without a KV cache (a forward pre-hook passes ``use_cache=False``; the config
keeps the user's ``use_cache``, which ``save_pretrained`` writes), and checks first that the
model is one whose result under Skrull equals its result on one process
(:func:`~lightning_skrull.models.checks.check_model`), and that the attention backend can run it
(a ``"flash"`` backend needs a varlen kernel, one that takes a window for a model with a sliding
window, and refuses attention sinks, :mod:`~lightning_skrull.models.families.sinks`).
:func:`find_hf_model` finds the Hugging Face model inside a ``LightningModule``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar, cast

from torch import nn

from lightning_skrull.attention.backends import (
    ATTENTION_BACKENDS,
    ATTENTION_NAME,
    require_flash_kernel,
)
from lightning_skrull.attention.context import has_attention_context
from lightning_skrull.attention.dispatch import register_skrull_attention
from lightning_skrull.attention.flash import require_window_support
from lightning_skrull.models.attention_modules import attention_window
from lightning_skrull.models.checks import check_model
from lightning_skrull.models.chunked_loss import (
    check_chunked_loss_supported,
    use_chunked_loss,
    use_dense_loss,
)
from lightning_skrull.models.families.moe import refuse_router_aux_loss
from lightning_skrull.models.families.sinks import refuse_flash_backend
from lightning_skrull.models.families.vision_language import is_multimodal, refuse_images
from lightning_skrull.models.loss_kernels import check_loss_kernel

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_PLAIN_ATTENTION = "_skrull_plain_attention"
"""Instance attribute where :func:`prepare_model` keeps the model's attention before it."""


ModelT = TypeVar("ModelT", bound=nn.Module)
"""The class of the model :func:`prepare_model` is given, and returns (the same object)."""


def prepare_model(
    model: ModelT,
    *,
    backend: str = "auto",
    max_sequence_length: int | None = None,
    chunked_loss: bool = False,
    chunk_tokens: int | None = None,
    loss_kernel: str = "auto",
) -> ModelT:
    """Check a Hugging Face decoder and switch it to the Skrull attention, in place.

    Registers ``"skrull"`` with transformers' ``AttentionInterface``, calls
    ``model.set_attn_implementation("skrull")``, and adds a forward pre-hook to the model and
    each ``PreTrainedModel`` inside it that passes ``use_cache=False`` while the model uses the
    Skrull attention (with a cache, transformers does not treat packed input as packed). The
    config keeps its ``use_cache``, so ``save_pretrained`` writes the user's setting; transformers
    does not save the attention name, so a saved checkpoint loads with plain transformers.
    The attention the model had before is kept on the model, and
    :func:`~lightning_skrull.models.plain_attention` switches back to it to generate.

    Args:
        model: a transformers ``PreTrainedModel`` of a supported architecture.
        backend: attention kernel the engine will use: ``"auto"``, ``"sdpa"`` or ``"flash"``
            (checked here so a missing flash-attn fails before training starts).
        max_sequence_length: longest sequence you will train on; needed only for a model with a
            sliding window its layers do not pass to the attention function or a ``"dynamic"``
            / ``"longrope"`` RoPE (see :func:`check_model`).
        chunked_loss: route the forward with ``labels`` through the chunked LM head and
            cross-entropy (:func:`~lightning_skrull.models.chunked_loss.use_chunked_loss`): the
            ``[tokens, vocab]`` logits are never held, and ``logits`` comes back ``None``.
            ``False`` leaves the forward as transformers wrote it (and undoes an earlier
            ``True``). The Skrull strategies turn it on by default.
        chunk_tokens: tokens per chunk of the chunked loss (default: 128 MiB of float32
            logits per chunk).
        loss_kernel: what computes the chunked loss: ``"auto"`` (a fused CUDA kernel, Liger
            Kernel or Cut Cross-Entropy, when installed and the model runs on CUDA; else the
            pure-PyTorch chunks), ``"chunked"``, ``"liger"`` or ``"cce"``
            (:data:`~lightning_skrull.models.loss_kernels.LossKernel`).

    Returns:
        The same model object, typed as given (``Qwen2ForCausalLM`` in, ``Qwen2ForCausalLM``
        out).

    Raises:
        TypeError: ``model`` is not a ``PreTrainedModel``.
        ValueError: unsupported model (the message names the class and why), unknown backend,
            or ``"flash"`` without a varlen kernel installed, or, for a model with a sliding
            window, with a kernel that takes no window, or for a model with attention sinks.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; use one of {ATTENTION_BACKENDS}.")
    if backend == "flash":
        require_flash_kernel()
    check_model(model, max_sequence_length=max_sequence_length)
    if backend == "flash" and attention_window(model) is not None:
        require_window_support()
    refuse_flash_backend(model, backend)
    if chunked_loss:
        check_chunked_loss_supported(model)
        check_loss_kernel(loss_kernel)
    register_skrull_attention()
    hf_model = cast("PreTrainedModel", model)  # check_model refused anything else
    before = hf_model.config._attn_implementation
    if before and before != ATTENTION_NAME:
        hf_model.__dict__[_PLAIN_ATTENTION] = before
    hf_model.set_attn_implementation(ATTENTION_NAME)
    _check_attention_selected(model)
    _run_without_cache(hf_model)
    if is_multimodal(hf_model.config) and not any(
        hook is refuse_images for hook in hf_model._forward_pre_hooks.values()
    ):
        hf_model.register_forward_pre_hook(refuse_images, with_kwargs=True)
    if chunked_loss:
        use_chunked_loss(hf_model, chunk_tokens=chunk_tokens, kernel=loss_kernel)
    else:
        use_dense_loss(hf_model)
    return model


def _check_attention_selected(model: nn.Module) -> None:
    from transformers import PreTrainedModel

    stale = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if isinstance(m, PreTrainedModel) and m.config._attn_implementation != ATTENTION_NAME
        }
    )
    if stale:
        raise ValueError(
            f"{type(model).__name__} cannot be trained with Skrull context parallelism: "
            f"set_attn_implementation('{ATTENTION_NAME}') left {', '.join(stale)} on another "
            "attention (its attention does not go through transformers' AttentionInterface)."
        )


def plain_attention_name(model: nn.Module) -> str:
    """The attention ``model`` ran before :func:`prepare_model` switched it to ``"skrull"``
    (``"sdpa"`` when unknown): what :func:`~lightning_skrull.models.plain_attention` generates
    with."""
    return str(vars(model).get(_PLAIN_ATTENTION) or "sdpa")


def _forward_without_cache(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Forward pre-hook: ``use_cache=False`` while ``module`` uses the Skrull attention.

    An explicit ``use_cache=True`` is overridden too, and ``output_router_logits=True`` (passed,
    or set in the config after :func:`prepare_model`) is refused
    (:func:`~lightning_skrull.models.families.moe.refuse_router_aux_loss`). Under any other attention
    (the user switched back to generate) the call is left as it is, and the config's ``use_cache`` applies
    again. transformers' decoders take ``use_cache`` by keyword only (their config-defaults
    decorator adds it as a keyword), so the hook sets the keyword.

    Raises:
        ValueError: ``output_router_logits=True`` under the Skrull attention (a Mixture-of-Experts
            model would add the router auxiliary loss).
        RuntimeError: ``module`` runs another attention inside a micro-batch's attention
            context: it was switched away from ``"skrull"`` (to generate) and not back, and
            would silently attend within this rank's tokens only.
    """
    config = getattr(module, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    if attention != ATTENTION_NAME:
        if has_attention_context():
            raise RuntimeError(
                f"{type(module).__name__} runs the {attention!r} attention inside a Skrull "
                f"micro-batch: it was prepared for the '{ATTENTION_NAME}' attention and switched "
                f"away (set_attn_implementation({attention!r}), e.g. to generate) without being "
                "switched back, so this forward would ignore the micro-batch's sequence layout "
                "and the other CP ranks' tokens. Switch back with model.set_attn_implementation("
                f"'{ATTENTION_NAME}'), or generate inside `with trainer.strategy.generating() as "
                "model:` (or lightning_skrull.models.plain_attention(model)), which switch back "
                "on exit."
            )
        return None
    requested = kwargs.get("output_router_logits")
    if requested is None:
        requested = getattr(config, "output_router_logits", False)
    if requested:
        refuse_router_aux_loss(module)
    kwargs["use_cache"] = False
    return args, kwargs


def _has_no_cache_hook(module: nn.Module) -> bool:
    return any(hook is _forward_without_cache for hook in module._forward_pre_hooks.values())


def _run_without_cache(model: PreTrainedModel) -> None:
    """Hook ``model`` and every ``PreTrainedModel`` inside it (once) to run without a cache."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel) and not _has_no_cache_hook(module):
            module.register_forward_pre_hook(_forward_without_cache, with_kwargs=True)


def is_prepared(model: nn.Module) -> bool:
    """Whether ``model`` runs the Skrull attention without a KV cache.

    True after :func:`prepare_model`, or after ``set_attn_implementation("skrull")`` with
    ``config.use_cache = False`` set by hand.
    """
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != ATTENTION_NAME:
        return False
    return getattr(config, "use_cache", True) is False or _has_no_cache_hook(model)


def find_hf_model(module: nn.Module, *, attribute: str | None = None) -> PreTrainedModel:
    """The Hugging Face ``PreTrainedModel`` inside ``module`` (e.g. a ``LightningModule``).

    Args:
        module: the module to search; returned as is when it is a ``PreTrainedModel``.
        attribute: dotted submodule name (``"model"``, ``"backbone.lm"``) to pick one model
            when ``module`` holds several.

    Returns:
        The outermost ``PreTrainedModel`` (a ``Qwen2ForCausalLM``, not its inner
        ``Qwen2Model``).

    Raises:
        ValueError: none found, several found and no ``attribute``, or ``attribute`` names no
            ``PreTrainedModel``.
    """
    from transformers import PreTrainedModel

    if attribute is not None:
        try:
            found = module.get_submodule(attribute)
        except AttributeError as err:
            raise ValueError(
                f"{type(module).__name__} has no submodule {attribute!r}: {err}"
            ) from None
        if not isinstance(found, PreTrainedModel):
            raise ValueError(
                f"{type(module).__name__}.{attribute} is a {type(found).__name__}, not a "
                "transformers PreTrainedModel."
            )
        return found
    if isinstance(module, PreTrainedModel):
        return module
    outermost: list[tuple[str, PreTrainedModel]] = []
    for name, sub in module.named_modules():
        if not isinstance(sub, PreTrainedModel):
            continue
        if any(name.startswith(prefix + ".") for prefix, _ in outermost):
            continue
        outermost.append((name, sub))
    if not outermost:
        raise ValueError(
            f"{type(module).__name__} holds no transformers PreTrainedModel; Skrull trains "
            "Hugging Face decoders (e.g. self.model = AutoModelForCausalLM.from_pretrained(...))."
        )
    if len(outermost) > 1:
        names = ", ".join(f"{n} ({type(m).__name__})" for n, m in outermost)
        raise ValueError(
            f"{type(module).__name__} holds several transformers models: {names}; name the one "
            "to train with attribute=... ."
        )
    return outermost[0][1]
