"""Prepare a Hugging Face decoder for Skrull context parallelism, or refuse it loudly.

:func:`prepare_model` registers the ``"skrull"`` attention with transformers'
``AttentionInterface``, switches the model to it through ``set_attn_implementation`` (the public
way transformers offers; nothing in transformers is monkeypatched), makes every forward under
that attention run without a KV cache (a forward pre-hook passes ``use_cache=False``; the config
keeps the user's ``use_cache``, which ``save_pretrained`` writes), and checks that the model is
one whose result under Skrull equals its result on one process:

- a decoder-only causal LM of an allow-listed architecture (:data:`SUPPORTED_ARCHITECTURES`);
- every decoder layer's attention applies RoPE (from ``position_ids``) and then calls the
  function registered with the ``AttentionInterface``;
- causal, and without attention dropout;
- a sliding window only where each layer passes it to the attention function (the
  ``sliding_window`` keyword, which the Skrull attention applies; Qwen2-MoE does not, so its
  window still limits the sequence length, :func:`unpassed_window`);
- for a Mixture-of-Experts model, a deterministic router (no ``router_jitter_noise``), no
  router auxiliary loss (``output_router_logits`` off; :mod:`lightning_skrull.models.moe`) and
  trainable experts (gpt-oss's MXFP4-quantized ones are refused, :func:`quantized_experts`);
- attention sinks (gpt-oss) only on a backend that adds them (``"sdpa"`` or ``"auto"``, not
  ``"flash"``; :func:`has_attention_sinks`);
- a RoPE whose frequencies depend on the config only, or on the batch only beyond a length no
  sequence reaches (:mod:`lightning_skrull.models.rope`).

Anything else raises ``ValueError`` naming the model class and every reason at once.
"""

from __future__ import annotations

import inspect
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar, cast

from torch import nn

from lightning_skrull.attention.backends import (
    ATTENTION_BACKENDS,
    ATTENTION_NAME,
    require_flash_kernel,
)
from lightning_skrull.attention.context import has_attention_context
from lightning_skrull.attention.dispatch import register_skrull_attention
from lightning_skrull.attention.flash import SINK_FIX, require_window_support
from lightning_skrull.models.chunked_loss import (
    check_chunked_loss_supported,
    check_loss_kernel,
    use_chunked_loss,
    use_dense_loss,
)
from lightning_skrull.models.moe import refuse_router_aux_loss, router_problems
from lightning_skrull.models.multimodal import (
    MULTIMODAL_MODEL_TYPES,
    is_multimodal,
    language_model,
    refuse_images,
    text_config,
)
from lightning_skrull.models.rope import rope_length_limit, rope_problems

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SUPPORTED_ARCHITECTURES: MappingProxyType[str, tuple[str, ...]] = MappingProxyType(
    {
        "qwen2": ("Qwen2ForCausalLM", "Qwen2Model"),
        "qwen3": ("Qwen3ForCausalLM", "Qwen3Model"),
        "llama": ("LlamaForCausalLM", "LlamaModel"),
        "mistral": ("MistralForCausalLM", "MistralModel"),
        "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeModel"),
        "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeModel"),
        "mixtral": ("MixtralForCausalLM", "MixtralModel"),
        "gemma3_text": ("Gemma3ForCausalLM", "Gemma3TextModel"),
        "gemma3": ("Gemma3ForConditionalGeneration",),
        "mistral3": ("Mistral3ForConditionalGeneration",),
        "olmo2": ("Olmo2ForCausalLM", "Olmo2Model"),
        "olmo3": ("Olmo3ForCausalLM", "Olmo3Model"),
        "phi3": ("Phi3ForCausalLM", "Phi3Model"),
        "glm4": ("Glm4ForCausalLM", "Glm4Model"),
        "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Model"),
        "granite": ("GraniteForCausalLM", "GraniteModel"),
        "ministral": ("MinistralForCausalLM", "MinistralModel"),
        "seed_oss": ("SeedOssForCausalLM", "SeedOssModel"),
        "exaone4": ("Exaone4ForCausalLM", "Exaone4Model"),
        "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Model"),
        "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeModel"),
        "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Model"),
        "gpt_oss": ("GptOssForCausalLM", "GptOssModel"),
    }
)
"""``config.model_type`` -> model classes (or their subclasses) that Skrull runs exactly.

Qwen2.5 checkpoints use ``model_type="qwen2"``. Each of these applies RoPE to queries and keys
and then calls ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``, with
no other sequence mixing, so packing sequences and sharding them over ranks changes nothing
as long as the attention function honours the layout.

The Mixture-of-Experts ones (``qwen3_moe``, ``qwen2_moe``, ``mixtral``) replace the MLP of their
sparse layers by a top-k router and experts that compute each token from its own hidden state
alone (no capacity factor, no token dropping; Qwen2-MoE adds a sigmoid-gated shared expert, also
per token), so the same holds for them, given
:func:`~lightning_skrull.models.moe.router_problems` finds nothing. DeepSeek-V3 (also Kimi K2,
Moonlight), GLM-4-MoE (GLM-4.5 / 4.6) and DeepSeek-V2 route per token too (sigmoid or softmax
scores, group-limited top-k, shared experts; :mod:`~lightning_skrull.models.moe`). DeepSeek's
Multi-head Latent Attention builds per-head keys and values from a per-token latent, rotates a
part of q and k, and passes values narrower than the keys to the attention function, which
takes them (the K/V exchange carries both widths).

gpt-oss (``gpt_oss``, gpt-oss-20b / 120b) routes per token too (a linear router with bias, top-k
then a softmax over the chosen logits; experts with biases and a clamped GLU), alternates
sliding (128-token) and full layers, whose window it passes, and adds attention sinks: a
learned logit per head, passed to the attention function as ``s_aux``, that joins every query's
softmax as a key of value zero. The Skrull ``sdpa`` backend adds it
(:mod:`~lightning_skrull.attention.sdpa`); the ``flash`` backend has no sink term and is
refused for it. Its released checkpoints hold MXFP4-quantized experts, which train only once
dequantized (:func:`quantized_experts`).

Gemma 3's text model (``gemma3_text``) adds per-token pieces only (RMSNorms of q and k per
head, a scaled embedding, ``query_pre_attn_scalar`` as the softmax scale, a RoPE per layer
kind) and interleaves sliding and full layers, whose window it passes to the attention
function; its attention logit soft-capping and bidirectional attention are refused
(:func:`_gemma3_problems`). Gemma 3's 4B, 12B and 27B checkpoints (``gemma3``) hold that text
model beside a vision tower; they train on text only
(:mod:`lightning_skrull.models.multimodal`): every check reads ``config.text_config`` and the
text decoder's layers. Mistral Small 3.1 / 3.2 (``mistral3``) hold a Mistral text model beside
a Pixtral vision tower, trained on text only the same way.
"""


_PLAIN_ATTENTION = "_skrull_plain_attention"
"""Instance attribute where :func:`prepare_model` keeps the model's attention before it."""
_INTERFACE_CALL = "ALL_ATTENTION_FUNCTIONS.get_interface("
_ROPE_CALLS = ("apply_rotary_pos_emb(", "apply_rotary_emb(")
"""The rotary calls of the allow-listed attentions (DeepSeek-V2's is ``apply_rotary_emb``)."""
_WINDOW_ARGUMENT = "sliding_window="
_SINK_ARGUMENT = "s_aux="

QUANTIZED_EXPERTS = ("Mxfp4GptOssExperts",)
"""Class names of transformers' quantized expert modules that hold packed weights autograd
cannot train (gpt-oss's MXFP4 experts, ``transformers.integrations.mxfp4``); matched by name, so
that the check imports no quantization kernel."""

MXFP4_FIX = (
    "load the checkpoint dequantized to bf16: AutoModelForCausalLM.from_pretrained(name, "
    "dtype=torch.bfloat16, quantization_config=Mxfp4Config(dequantize=True)) "
    "(from transformers import Mxfp4Config)"
)
"""How to load gpt-oss for fine-tuning."""


def attention_window(model: nn.Module) -> int | None:
    """The sliding attention window the model applies, or ``None`` for full causal attention.

    Qwen2 / Qwen3 apply ``config.sliding_window`` to the layers that ``config.layer_types``
    marks ``"sliding_attention"`` (only when ``use_sliding_window=True``); Mistral applies
    ``config.sliding_window`` to every layer whenever it is set (its configs default to 4096).
    A window at least as long as a sequence changes nothing for that sequence. A
    vision-language model's is its text model's (``config.text_config``).
    """
    config = text_config(getattr(model, "config", None))
    window = getattr(config, "sliding_window", None)
    if not window:  # Qwen2-MoE's config sets 0 for "no window"
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _passes(cls: type, argument: str) -> bool:
    """Whether ``cls.forward`` passes ``argument`` (``"sliding_window="``, ``"s_aux="``) to its
    attention function call."""
    try:
        source = inspect.getsource(cls.forward)  # type: ignore[attr-defined]
    except (OSError, TypeError):
        return False
    call = source.find("attention_interface(")
    return call >= 0 and source.find(argument, call) >= 0


def has_attention_sinks(model: nn.Module) -> bool:
    """Whether some attention module of the text decoder passes attention sinks (``s_aux``,
    gpt-oss) to the attention function: the ``flash`` backend cannot run it."""
    return any(_passes(type(attn), _SINK_ARGUMENT) for attn in _attention_modules(model))


def quantized_experts(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` that are quantized experts (:data:`QUANTIZED_EXPERTS`).

    gpt-oss's released checkpoints store the experts in MXFP4. On a machine with transformers'
    MXFP4 kernels they load as ``Mxfp4GptOssExperts``, whose packed ``uint8`` weights have no
    gradient; elsewhere transformers dequantizes them to bf16 itself, and so does
    ``quantization_config=Mxfp4Config(dequantize=True)`` everywhere (:data:`MXFP4_FIX`).
    """
    return [
        name
        for name, module in model.named_modules()
        if any(cls.__name__ in QUANTIZED_EXPERTS for cls in type(module).__mro__)
    ]


def unpassed_window(model: nn.Module) -> int | None:
    """The model's sliding window when some attention module does not pass it to the attention
    function, else ``None``.

    The Skrull attention applies the window each layer passes as ``sliding_window`` (as
    transformers' FlashAttention integration does). A model whose window lives only in the
    mask it builds, like Qwen2-MoE (its attention keeps ``self.sliding_window`` but passes
    nothing), would silently get full attention, so its window still limits the sequences
    (:func:`sequence_length_rule`).
    """
    window = attention_window(model)
    if window is None:
        return None
    if all(_passes(type(attn), _WINDOW_ARGUMENT) for attn in _attention_modules(model)):
        return None
    return window


def sequence_length_limit(model: nn.Module) -> int | None:
    """Longest sequence the prepared model runs exactly under Skrull (``None``: no limit).

    A model with a sliding window ``W`` that its layers do not pass to the attention function
    (:func:`unpassed_window`) gives the same result only for sequences of at most ``W`` tokens.
    A ``"dynamic"`` or ``"longrope"`` RoPE keeps the frequencies one process uses only up to
    its threshold length (:func:`~lightning_skrull.models.rope.rope_length_limit`). The engine
    checks every global batch against the smaller limit.
    """
    rule = sequence_length_rule(model)
    return None if rule is None else rule[0]


def sequence_length_rule(model: nn.Module) -> tuple[int, str] | None:
    """``(limit, what sets it)`` of :func:`sequence_length_limit`, or ``None`` without a limit.

    ``what sets it`` completes "more than ...": the sliding window, or the RoPE threshold.
    """
    name = type(model).__name__
    rules: list[tuple[int, str]] = []
    window = unpassed_window(model)
    if window is not None:
        rules.append(
            (
                window,
                f"the {window}-token sliding attention window of {name}, which its layers do not "
                "pass to the attention function, so the Skrull attention would attend beyond it",
            )
        )
    rope = rope_length_limit(model)
    if rope is not None:
        rope_type, limit = rope
        rules.append(
            (
                limit,
                f"the {limit} tokens up to which the {rope_type!r} RoPE of {name} keeps its "
                "frequencies; beyond, they would depend on the other sequences of the rank",
            )
        )
    return min(rules, key=lambda rule: rule[0]) if rules else None


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """The ``self_attn`` modules of the text decoder (not a vision tower's)."""
    layers: list[nn.Module] = []
    for module in language_model(model).modules():
        attn = getattr(module, "self_attn", None)
        if isinstance(attn, nn.Module):
            layers.append(attn)
    return layers


def _attention_path_problems(model: nn.Module) -> list[str]:
    """Reasons why the attention modules do not go through the AttentionInterface."""
    problems: list[str] = []
    attns = _attention_modules(model)
    num_layers = getattr(text_config(model.config), "num_hidden_layers", None)
    if not attns:
        return ["no decoder layer with a `self_attn` module was found"]
    if num_layers is not None and len(attns) != num_layers:
        problems.append(
            f"found {len(attns)} `self_attn` modules for num_hidden_layers={num_layers}"
        )
    for cls in sorted({type(a) for a in attns}, key=lambda c: c.__qualname__):
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            problems.append(f"the source of {cls.__qualname__}.forward cannot be inspected")
            continue
        call = source.find("attention_interface(")
        if _INTERFACE_CALL not in source or call < 0:
            problems.append(
                f"{cls.__qualname__}.forward does not call the attention through transformers' "
                "AttentionInterface (ALL_ATTENTION_FUNCTIONS.get_interface)"
            )
        elif not any(0 <= source.find(rope) < call for rope in _ROPE_CALLS):
            problems.append(
                f"{cls.__qualname__}.forward does not apply RoPE (apply_rotary_pos_emb) before "
                "the attention call"
            )
    return problems


def _gemma3_problems(config: Any) -> list[str]:
    """Reasons a Gemma 3 text config cannot run exactly under the Skrull attention."""
    problems = []
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        problems.append(
            f"attn_logit_softcapping={softcap} (the Skrull attention has no soft-capping of the "
            "attention scores; Gemma 3 checkpoints set it to null)"
        )
    if getattr(config, "use_bidirectional_attention", False):
        problems.append("use_bidirectional_attention=True (the Skrull attention is causal only)")
    return problems


def check_model(model: nn.Module, *, max_sequence_length: int | None = None) -> None:
    """Check that Skrull runs ``model`` exactly; raise if not.

    Args:
        model: a Hugging Face ``PreTrainedModel``.
        max_sequence_length: longest sequence you will train on; only needed to accept a model
            with a sliding window its layers do not pass to the attention function (it must not
            exceed the window; :func:`unpassed_window`) or a ``"dynamic"`` / ``"longrope"`` RoPE
            (it must not exceed the rope's threshold length).

    Raises:
        TypeError: ``model`` is not a transformers ``PreTrainedModel``.
        ValueError: the model is not supported; the message names the class and every reason.
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"prepare_model expects a transformers PreTrainedModel (e.g. Qwen2ForCausalLM), got "
            f"{type(model).__name__}; pass the Hugging Face model itself (find_hf_model(module) "
            "finds it inside a LightningModule)."
        )
    config = model.config
    decoder = text_config(config)  # a vision-language model's text model reads its own
    field = "config.text_config" if is_multimodal(config) else "config"
    name = type(model).__name__
    reasons: list[str] = []
    model_type: str | None = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        reasons.append(
            "it is an encoder-decoder model (only decoder-only causal LMs are supported)"
        )
    if not getattr(decoder, "is_causal", True):
        reasons.append(f"its {field} sets is_causal=False (bidirectional attention)")
    if model_type is None or model_type not in SUPPORTED_ARCHITECTURES:
        reasons.append(
            f"model_type {model_type!r} is not a supported architecture (supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
        )
    else:
        allowed = SUPPORTED_ARCHITECTURES[model_type]
        if not any(cls.__name__ in allowed for cls in type(model).__mro__):
            reasons.append(
                f"it is not a causal LM of its architecture (expected {' or '.join(allowed)} or "
                "a subclass)"
            )
        reasons.extend(_attention_path_problems(model))
        text_type = getattr(decoder, "model_type", None)
        if is_multimodal(config) and text_type != MULTIMODAL_MODEL_TYPES[model_type]:
            reasons.append(
                f"its text model's model_type is {text_type!r}, not the "
                f"{MULTIMODAL_MODEL_TYPES[model_type]!r} that {model_type!r} checkpoints hold"
            )
    dropout = float(getattr(decoder, "attention_dropout", 0.0) or 0.0)
    if dropout > 0.0:
        reasons.append(
            f"attention_dropout={dropout} (the Skrull attention has no dropout; set "
            f"{field}.attention_dropout=0.0)"
        )
    window = unpassed_window(model)
    if window is not None and (max_sequence_length is None or max_sequence_length > window):
        given = (
            "no max_sequence_length was given"
            if max_sequence_length is None
            else f"max_sequence_length={max_sequence_length} exceeds it"
        )
        reasons.append(
            f"it applies a sliding attention window of {window} tokens in the mask it builds but "
            "does not pass it to the attention function (no sliding_window= argument), so the "
            f"Skrull attention cannot apply it, and {given} (promise sequences no longer than "
            f"the window with prepare_model(..., max_sequence_length<={window}), or set "
            "config.use_sliding_window=False for full attention if the checkpoint was trained so)"
        )
    reasons.extend(rope_problems(model, max_sequence_length))
    reasons.extend(router_problems(model))
    quantized = quantized_experts(model)
    if quantized:
        shown = ", ".join(quantized[:3]) + (
            f" and {len(quantized) - 3} more" if len(quantized) > 3 else ""
        )
        reasons.append(
            f"its experts are MXFP4-quantized ({shown}: packed uint8 weights without "
            f"gradients, which cannot be fine-tuned); {MXFP4_FIX}"
        )
    if model_type in ("gemma3_text", "gemma3"):
        reasons.extend(_gemma3_problems(decoder))
    if reasons:
        raise ValueError(
            f"{name} cannot be trained with Skrull context parallelism: " + "; ".join(reasons) + "."
        )


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
            (:data:`~lightning_skrull.models.chunked_loss.LossKernel`).

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
    if backend == "flash" and has_attention_sinks(model):
        raise ValueError(
            f"attention backend 'flash' cannot train {type(model).__name__}: its attention "
            f"passes attention sinks (s_aux), which the varlen kernels have no term for; "
            f"{SINK_FIX}."
        )
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
    (:func:`~lightning_skrull.models.moe.refuse_router_aux_loss`). Under any other attention
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
