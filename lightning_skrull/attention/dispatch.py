"""The ``"skrull"`` attention function for transformers' ``AttentionInterface``.

A model whose ``config._attn_implementation`` is ``"skrull"`` calls
:func:`skrull_attention_forward` in every decoder layer. transformers 5 builds no mask for an
attention name it has no mask function for, so ``attention_mask`` arrives as ``None`` and the
per-sequence causal structure comes from the micro-batch's
:class:`~lightning_skrull.attention.context.SkrullAttentionContext` instead (no dense mask over
the packed buffer is ever built). No mask function is registered on purpose.

q, k and v are cast to one compute dtype (:func:`compute_dtype`) before the backend runs: under
``torch.autocast`` transformers' rotary embedding multiplies the 16-bit q/k projections by
float32 cos/sin, so q and k arrive in float32 and v in the autocast dtype. The cast lets the
``flash`` backend run under autocast and keeps the K/V exchange and the K/V saved for backward
in 16 bits there.

The layer's sliding window comes as transformers passes it, the ``sliding_window`` keyword
(``None`` for full-attention layers), and has transformers' meaning: the query at position ``p``
of a sequence sees keys ``[p - W + 1, p]`` (``sliding_window_causal_mask_function``). A window
no sequence of the micro-batch is longer than changes nothing and is dropped, so such a layer
runs exactly the full causal code.

A layer with attention sinks passes its per-head sink logits as the ``s_aux`` keyword (gpt-oss,
:mod:`~lightning_skrull.models.families.sinks`); the ``sdpa`` backend adds them to the softmax
of every query (the sink is a key whose value is zero;
:mod:`~lightning_skrull.attention.sdpa_calls`). The ``flash`` backend has no sink term:
``"auto"`` runs such layers on ``sdpa``, an explicit ``"flash"`` refuses them.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_skrull.attention.backends import ATTENTION_NAME
from lightning_skrull.attention.context import current_attention_context
from lightning_skrull.attention.flash import flash_attention, window_supported
from lightning_skrull.attention.schedule import LocalAttention
from lightning_skrull.attention.sdpa import local_attention_heads_first, sdpa_attention

_BACKENDS: dict[str, LocalAttention] = {"sdpa": sdpa_attention, "flash": flash_attention}
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
"""What FlashAttention kernels compute in."""
COMPILE_REASON = (
    "the Skrull attention reads its per-micro-batch layout from a context variable and runs "
    "the K/V exchange as asynchronous collectives whose backward is started and finished by "
    "two autograd nodes sharing state; it runs eagerly inside a compiled model"
)
"""Why :func:`skrull_attention_forward` is excluded from ``torch.compile`` (the graph breaks
there: the layers' projections, norms and MLPs around it are compiled)."""


def compute_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.dtype:
    """The dtype the attention computes, exchanges K/V and saves for backward in.

    transformers' own FlashAttention integration makes the same choice for float32 inputs
    (``get_target_dtype`` in ``transformers/integrations/flash_attention.py``).

    * Autocast enabled for the inputs' device type: the autocast dtype (bf16 under Lightning's
      ``"bf16-mixed"``, fp16 under ``"16-mixed"``), unless an input is float64, which autocast
      leaves alone too.
    * Otherwise, inputs that agree keep their dtype (float32 runs stay float32, ``"bf16-true"``
      stays bf16).
    * Otherwise (they disagree without autocast, e.g. float32 q/k norms in a bf16 model):
      ``value``'s dtype. The value is the v projection's output, touched by neither the rotary
      embedding nor q/k norms, so it is the dtype the attention's projection weights compute in
      (what transformers reads from the module's first ``Linear``).

    Args:
        query: the attention's queries.
        key: its keys.
        value: its values.

    Returns:
        The dtype all three are cast to.
    """
    dtypes = {query.dtype, key.dtype, value.dtype}
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type) and torch.float64 not in dtypes:
        return torch.get_autocast_dtype(device_type)
    if len(dtypes) == 1:
        return query.dtype
    return value.dtype


@torch.compiler.disable(reason=COMPILE_REASON)
def skrull_attention_forward(
    module: torch.nn.Module | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Context-parallel causal attention with transformers' attention-function signature.

    Args:
        module: the calling attention module (its ``training`` flag and ``is_causal`` are read).
        query: ``[1, Hq, T, D]`` with RoPE applied, ``T`` = this rank's packed tokens.
        key: ``[1, Hkv, T, D]`` (GQA not repeated).
        value: ``[1, Hkv, T, Dv]``; ``Dv`` may be narrower than ``D`` (Multi-head Latent
            Attention, :mod:`~lightning_skrull.models.families.mla`).
        attention_mask: must be ``None`` (what transformers passes for this attention name);
            the layout in the current attention context defines which tokens attend which.
        scaling: softmax scale; ``None`` = ``D ** -0.5``.
        dropout: attention dropout; only ``0`` is supported in training.
        **kwargs: other attention kwargs (``position_ids``, ``cu_seq_lens_q``... are ignored in
            favour of the context; ``softcap`` and ``position_bias`` must be ``None``,
            ``is_causal`` must not be ``False``; ``sliding_window``, an int ``>= 1`` or ``None``,
            is the layer's window, see :func:`layer_window`; ``s_aux``, ``None`` or a tensor of
            ``Hq`` logits, is the layer's attention sinks, see :func:`attention_sink`).

    q, k and v are cast to :func:`compute_dtype` first, so the backend, the K/V exchange and
    the K/V saved for backward all see one dtype.

    Returns:
        ``(out [1, T, Hq, Dv], None)``, ``out`` in the compute dtype.

    Raises:
        RuntimeError: called outside :func:`~lightning_skrull.attention.attention_context`.
        ValueError: unsupported input (batch size, mask, dropout, a window that is not an int
            ``>= 1``, sinks that are not ``Hq`` logits, softcap, position bias, non-causal),
            ``T`` not matching the context's layout, a window on the ``flash`` backend with a
            kernel that takes none, or sinks on the ``flash`` backend.
    """
    ctx = current_attention_context()
    _check_inputs(module, query, key, value, attention_mask, dropout, kwargs)
    sink = attention_sink(kwargs.get("s_aux"), query.shape[1])
    # every rank sees the same micro-batch maximum, so all ranks take the same path
    window = layer_window(kwargs.get("sliding_window"), ctx.layout.max_sequence_length)
    if query.shape[2] != ctx.num_tokens:
        raise ValueError(
            f"the 'skrull' attention got {query.shape[2]} tokens but CP rank {ctx.cp_rank}'s "
            f"layout holds {ctx.num_tokens}; feed the model the micro-batch the attention context "
            "was built for."
        )
    dtype = compute_dtype(query, key, value)
    backend = ctx.backend
    if backend == "flash" and dtype not in _FLASH_DTYPES:
        if not ctx.auto:
            raise ValueError(
                f"attention backend 'flash' runs float16 and bfloat16 only, but the attention "
                f"inputs are {dtype}; train in bf16 or fp16 (Trainer(precision='bf16-mixed', "
                "'bf16-true' or '16-mixed'), or model.to(torch.bfloat16); under autocast the "
                "attention computes in the autocast dtype), or use attention_backend='sdpa' or "
                "'auto'."
            )
        backend = "sdpa"  # "auto": the same context serves sdpa (its tensors are a superset)
    if backend == "flash" and window is not None and ctx.auto and not window_supported():
        backend = "sdpa"  # "auto" with a kernel that takes no window: sdpa runs this layer
    if backend == "flash" and sink is not None and ctx.auto:
        backend = "sdpa"  # "auto": sdpa adds the sink as a key; explicit flash refuses it
    # One dtype for all three (a no-op when they already have it); the cast's backward returns
    # each gradient in its input's dtype.
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if sink is not None:
        sink = sink.to(dtype)
    layout = ctx.layout
    if backend == "sdpa" and not layout.has_distributed and layout.num_local_tokens:
        # Only local sequences (always at cp_size 1): SDPA takes transformers' layout as it is.
        out = local_attention_heads_first(
            query, key, value, ctx, scale=scaling, window=window, sink=sink
        )
        return out, None
    # squeeze, not [0]: indexing's backward writes a zero-filled copy of the whole input.
    q = query.squeeze(0).transpose(0, 1)
    k = key.squeeze(0).transpose(0, 1)
    v = value.squeeze(0).transpose(0, 1)
    out = _BACKENDS[backend](q, k, v, ctx, scale=scaling, window=window, sink=sink)
    return out.unsqueeze(0), None


def layer_window(sliding_window: Any, max_sequence_length: int) -> int | None:
    """The sliding window a layer's attention applies to a micro-batch, or ``None`` (full).

    Args:
        sliding_window: the ``sliding_window`` keyword transformers passes (``None`` for a
            full-attention layer): the query at position ``p`` sees keys ``[p - W + 1, p]``.
        max_sequence_length: the micro-batch's longest sequence (all CP ranks).

    Returns:
        ``sliding_window``, or ``None`` when it is ``None`` or no sequence is longer than it
        (every query then sees its whole prefix).

    Raises:
        ValueError: a window that is not an int ``>= 1`` (0 would leave every query without a
            key; transformers' Qwen2-MoE config uses 0 for "no window" but never passes it).
    """
    if sliding_window is None:
        return None
    if (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise ValueError(
            f"the 'skrull' attention got sliding_window={sliding_window!r}; a window is an int "
            ">= 1 (the keys each query sees, itself included), or None for full causal "
            "attention; fix the model config's sliding_window."
        )
    return None if sliding_window >= max_sequence_length else sliding_window


def attention_sink(s_aux: Any, num_heads: int) -> torch.Tensor | None:
    """The layer's attention sink logits, one per query head, or ``None`` (no sinks).

    Args:
        s_aux: the ``s_aux`` keyword of the attention call (gpt-oss passes its ``sinks``
            parameter): the logit of a key with value zero that every query of the head sees.
        num_heads: the query heads ``Hq``.

    Returns:
        ``s_aux`` as a ``[Hq]`` tensor (a view), or ``None``.

    Raises:
        ValueError: ``s_aux`` is not a tensor of ``Hq`` elements.
    """
    if s_aux is None:
        return None
    if not isinstance(s_aux, torch.Tensor) or s_aux.numel() != num_heads:
        shape = tuple(s_aux.shape) if isinstance(s_aux, torch.Tensor) else type(s_aux).__name__
        raise ValueError(
            f"the 'skrull' attention got s_aux={shape}; attention sinks are one logit per query "
            f"head, a tensor of {num_heads} elements (gpt-oss's sinks parameter); fix the "
            "attention module that passes them."
        )
    return s_aux.reshape(num_heads)


def _check_inputs(
    module: torch.nn.Module | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> None:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"the 'skrull' attention expects 4-D query/key/value [batch, heads, tokens, dim], got "
            f"shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}."
        )
    if query.shape[0] != 1 or key.shape[0] != 1 or value.shape[0] != 1:
        raise ValueError(
            f"the 'skrull' attention needs batch size 1 (one packed micro-batch per rank), got "
            f"query batch {query.shape[0]}; pack the micro-batch's sequences along the token dim."
        )
    if key.shape[:3] != value.shape[:3] or key.shape[2] != query.shape[2]:
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match query "
            f"{tuple(query.shape)} in tokens (or each other in heads); the 'skrull' attention "
            "runs without a KV cache (set use_cache=False)."
        )
    if key.shape[3] != query.shape[3]:
        raise ValueError(
            f"query head dim {query.shape[3]} differs from key head dim {key.shape[3]}; the "
            "scores q k^T need one width (the value head dim may differ, as in Multi-head "
            "Latent Attention)."
        )
    if query.shape[1] % key.shape[1] != 0:
        raise ValueError(
            f"query heads {query.shape[1]} are not a multiple of key/value heads {key.shape[1]}."
        )
    if attention_mask is not None:
        raise ValueError(
            "the 'skrull' attention got an attention_mask, but it derives the causal per-sequence "
            "structure from the attention context; pass no attention_mask (or a 2-D one, which "
            "transformers drops for this attention), not a prepared 4-D mask."
        )
    training = module is None or module.training
    if dropout and dropout > 0 and training:
        raise ValueError(
            f"the 'skrull' attention does not implement attention dropout, got dropout={dropout} "
            "in training; set the model config's attention_dropout to 0."
        )
    for name in ("softcap", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"the 'skrull' attention does not support {name}; got one.")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if not is_causal:
        raise ValueError(
            "the 'skrull' attention is causal only; the calling module asked for non-causal "
            "attention (encoders / bidirectional layers are not supported)."
        )


def register_skrull_attention() -> str:
    """Register :func:`skrull_attention_forward` with transformers under ``"skrull"``.

    Idempotent. Afterwards ``model.set_attn_implementation("skrull")`` (or
    ``attn_implementation="skrull"`` at load) selects it.

    Returns:
        The registered name, ``"skrull"``.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, skrull_attention_forward)
    return ATTENTION_NAME
