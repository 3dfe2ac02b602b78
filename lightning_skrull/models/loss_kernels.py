"""The causal-LM loss from the final hidden states and the LM head's weight, over token chunks.

:func:`linear_cross_entropy` walks the tokens in chunks. Each chunk's logits are formed, turned
into the chunk's summed token loss (``logsumexp - logit[target]``, in float32 as transformers'
loss does), and, when a gradient will be needed, straight away into the chunk's gradients of the
hidden states and of the head (``softmax - onehot``, the same pass, so nothing is recomputed in
backward); then the chunk's logits are dropped. At most one chunk's ``[chunk, vocab]`` float32
buffer is alive at any time. The backward only scales the stored gradients by the incoming one.

The loss is exactly transformers' ``ForCausalLMLoss``: pre-shifted ``shift_labels`` (or the
shifted ``labels``, :func:`shifted_target`), ``-100`` ignored, the sum divided by
``num_items_in_batch`` when it is given (the Skrull collate gives the global batch's supervised
tokens over the world size), else by the supervised tokens here. The head's matmuls run in the
autocast dtype when autocast is on (as ``lm_head`` would under it), else in the weight's dtype;
the head's gradient accumulates over the chunks in float32 and is rounded once.

On CUDA a fused kernel does the same work in fewer, larger kernels: Liger Kernel's
``liger_fused_linear_cross_entropy`` or Apple's Cut Cross-Entropy (``cut_cross_entropy``), both
optional (``pip install "lightning-skrull[fused]"``). ``kernel="auto"`` (the default of the
routed forward) uses one when its package is installed and the hidden states are on CUDA, else
the chunked path above; :func:`resolve_loss_kernel` says which. Every kernel is given the same
thing (hidden states and head in the compute dtype, the shifted targets, ``-100`` ignored) and
returns the summed token loss, which is then normalised here exactly as above. Which models'
forwards are routed here is :mod:`lightning_skrull.models.chunked_loss`'s.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
from typing import Any, Literal, cast, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100
"""Label of a token that is not supervised (the convention of HF causal-LM losses)."""

LOGIT_ELEMENTS_PER_CHUNK = 1 << 25
"""Float32 logits one chunk may hold (128 MiB): 220 tokens of Qwen2.5's vocabulary."""

LossKernel = Literal["auto", "chunked", "liger", "cce"]
"""How :func:`linear_cross_entropy` computes the loss: ``"auto"`` (a fused CUDA kernel when one
is installed and the inputs are on CUDA, else ``"chunked"``), ``"chunked"`` (pure PyTorch, any
device), ``"liger"`` (Liger Kernel) or ``"cce"`` (Cut Cross-Entropy)."""

LOSS_KERNELS: tuple[str, ...] = get_args(LossKernel)

FUSED_KERNEL_MODULES = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}
"""The importable module of each fused kernel (PyPI: ``liger-kernel``, ``cut-cross-entropy``)."""

_PIP_NAMES = {"liger": "liger-kernel", "cce": "cut-cross-entropy"}


def installed_fused_kernels() -> tuple[str, ...]:
    """The fused kernels whose package is importable here, in :func:`resolve_loss_kernel`'s
    order of preference."""
    return tuple(name for name, module in FUSED_KERNEL_MODULES.items() if _importable(module))


def _importable(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_loss_kernel(kernel: str, installed: tuple[str, ...] | None = None) -> None:
    """Refuse an unknown kernel name, or a fused kernel whose package is not installed.

    Raises:
        ValueError: the message names the kernel and how to fix it.
    """
    if kernel not in LOSS_KERNELS:
        raise ValueError(f"loss kernel {kernel!r} is unknown; choose one of {LOSS_KERNELS}.")
    installed = installed_fused_kernels() if installed is None else installed
    if kernel in FUSED_KERNEL_MODULES and kernel not in installed:
        raise ValueError(
            f"loss kernel {kernel!r} needs the {_PIP_NAMES[kernel]} package, which is not "
            f'installed; pip install {_PIP_NAMES[kernel]} (or "lightning-skrull[fused]"), or use '
            'kernel="auto" / "chunked".'
        )


def resolve_loss_kernel(
    kernel: str,
    device_type: str,
    compute_dtype: torch.dtype,
    installed: tuple[str, ...] | None = None,
) -> Literal["chunked", "liger", "cce"]:
    """The kernel that computes the loss for inputs on ``device_type`` in ``compute_dtype``.

    ``"auto"`` picks Liger Kernel when installed, else Cut Cross-Entropy when installed and the
    compute dtype is 16-bit (its kernels take 16-bit inputs), else the chunked path; on a device
    other than CUDA always the chunked path. An explicitly named fused kernel is used as asked.

    Raises:
        ValueError: unknown or uninstalled kernel (:func:`check_loss_kernel`), or a fused
            kernel asked for inputs that are not on CUDA.
    """
    if kernel == "chunked" or (kernel == "auto" and device_type != "cuda"):
        return "chunked"  # no package lookup in every forward where none can run
    installed = installed_fused_kernels() if installed is None else installed
    check_loss_kernel(kernel, installed)
    if kernel == "auto":
        if device_type != "cuda":
            return "chunked"
        if "liger" in installed:
            return "liger"
        if "cce" in installed and compute_dtype in (torch.float16, torch.bfloat16):
            return "cce"
        return "chunked"
    if kernel in FUSED_KERNEL_MODULES and device_type != "cuda":
        raise ValueError(
            f"loss kernel {kernel!r} runs on CUDA only, but the hidden states are on "
            f'{device_type!r}; use kernel="auto" or "chunked" there.'
        )
    return cast(Literal["chunked", "liger", "cce"], kernel)


def _fused_summed_loss(
    kernel: Literal["liger", "cce"],
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    softcap: float | None = None,
) -> Tensor:
    """The summed token loss of a fused kernel (inputs already in the compute dtype)."""
    if kernel == "liger":
        functional = importlib.import_module("liger_kernel.transformers.functional")
        fused = functional.liger_fused_linear_cross_entropy
        capping = _softcap_argument(kernel, fused, softcap)
        # the head's gradient summed over the kernel's chunks in float32, as the chunked path
        # sums it (Liger's default sums in the weight's dtype: bf16 rounding per chunk)
        accumulate = {"accum_dtype": torch.float32} if _takes(fused, "accum_dtype") else {}
        loss = fused(
            hidden,
            weight,
            target,
            bias=bias,
            ignore_index=IGNORE_INDEX,
            reduction="sum",
            **accumulate,
            **capping,
        )
    else:
        cce = importlib.import_module("cut_cross_entropy")
        capping = _softcap_argument(kernel, cce.linear_cross_entropy, softcap)
        with_bias = {} if bias is None else {"bias": bias}
        loss = cce.linear_cross_entropy(
            hidden,
            weight,
            target,
            ignore_index=IGNORE_INDEX,
            reduction="sum",
            **with_bias,
            **capping,
        )
    return cast(Tensor, loss).float()


def _softcap_argument(kernel: str, function: Any, softcap: float | None) -> dict[str, float]:
    """``{"softcap": softcap}`` for a fused kernel that takes it, ``{}`` without one; raises
    when the installed kernel cannot soft-cap."""
    if softcap is None:
        return {}
    if not _takes(function, "softcap"):
        raise ValueError(
            f"loss_kernel={kernel!r}: the installed {_PIP_NAMES[kernel]} takes no softcap, and "
            f"this model soft-caps its logits (final_logit_softcapping={softcap}). Upgrade "
            f"{_PIP_NAMES[kernel]}, or pass loss_kernel='chunked'."
        )
    return {"softcap": softcap}


@functools.cache
def _takes(function: Any, name: str) -> bool:
    """Whether ``function`` accepts the keyword argument ``name`` (older package versions may
    not); cached, since the loss asks in every forward."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in parameters)


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk so one chunk's float32 logits stay within
    :data:`LOGIT_ELEMENTS_PER_CHUNK` (at least 1)."""
    return max(1, LOGIT_ELEMENTS_PER_CHUNK // max(vocab_size, 1))


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed token cross-entropy of ``hidden @ weight.T + bias``; gradients made in forward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        target: Tensor,
        chunk_tokens: int,
        compute_dtype: torch.dtype,
        need_grad: bool,
        softcap: float | None,
    ) -> Tensor:
        h = hidden.to(compute_dtype)
        w = weight.to(compute_dtype)
        b = None if bias is None else bias.to(compute_dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(h) if need_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_b = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32)
        for start in range(0, h.shape[0], chunk_tokens):
            end = min(start + chunk_tokens, h.shape[0])
            rows = h[start:end]
            logits = F.linear(rows, w, b).float()
            slope = None
            if softcap is not None:  # cap * tanh(z / cap); its derivative 1 - tanh^2
                logits = torch.tanh(logits.div_(softcap))
                slope = 1.0 - logits * logits if need_grad else None
                logits.mul_(softcap)
            t = target[start:end]
            valid = t != IGNORE_INDEX
            picked = t.clamp_min(0).unsqueeze(1)
            lse = torch.logsumexp(logits, dim=-1)
            total += torch.where(valid, lse - logits.gather(1, picked).squeeze(1), 0.0).sum()
            if not need_grad:
                continue
            # softmax - onehot, in place over the chunk's logits; ignored rows get zero
            probs = logits.sub_(lse.unsqueeze(1)).exp_()
            probs.scatter_add_(1, picked, torch.full_like(lse, -1.0).unsqueeze(1))
            probs.mul_(valid.unsqueeze(1))
            if slope is not None:
                probs.mul_(slope)
            g = probs.to(compute_dtype)
            assert grad_h is not None
            torch.mm(g, w, out=grad_h[start:end])
            if compute_dtype == torch.float32:
                grad_w.addmm_(g.t(), rows)
            else:
                grad_w += (g.t() @ rows).float()
            if grad_b is not None:
                grad_b += probs.sum(0).to(grad_b.device)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        if need_grad:
            ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.need_grad = need_grad
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor) -> tuple[Tensor | None, ...]:
        if not ctx.need_grad:
            raise RuntimeError(
                "linear_cross_entropy ran without gradients (torch.no_grad or inputs that do not "
                "require grad) and cannot be backpropagated; run it with autograd enabled."
            )
        grad_h, grad_w, grad_b = ctx.saved_tensors
        hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
        scale = grad_total.float()
        out_h = (grad_h.float() * scale).to(hidden_dtype)
        out_w = (grad_w * scale).to(weight_dtype)
        out_b = None if grad_b is None else (grad_b * scale).to(bias_dtype)
        return out_h, out_w, out_b, None, None, None, None, None


@torch.compiler.disable(
    reason="the chunked loss loops over chunks of the micro-batch's tokens in Python: compiled, "
    "it would be specialised on each micro-batch's length and compiled again for every new one"
)
def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    bias: Tensor | None = None,
    num_items_in_batch: Tensor | float | None = None,
    chunk_tokens: int | None = None,
    kernel: str = "chunked",
    softcap: float | None = None,
) -> Tensor:
    """Causal-LM loss of ``hidden`` under the head ``weight`` without materialising the logits.

    Args:
        hidden: final hidden states, ``[..., H]`` (flattened to ``[N, H]``).
        weight: the LM head's weight, ``[V, H]`` (the embedding matrix for tied heads).
        target: the already shifted target token of each position, ``[...]`` matching
            ``hidden``'s leading dimensions; ``-100`` = not supervised.
        bias: the head's bias, ``[V]``, if it has one.
        num_items_in_batch: divide the summed loss by this (transformers' meaning); ``None``
            divides by the supervised tokens here (their mean).
        chunk_tokens: tokens per chunk of the chunked path (default
            :func:`default_chunk_tokens`).
        kernel: ``"chunked"`` (default), ``"auto"``, ``"liger"`` or ``"cce"``; see
            :data:`LossKernel` and :func:`resolve_loss_kernel`.
        softcap: soft-cap the logits to ``softcap * tanh(logits / softcap)`` before the
            cross-entropy (Gemma's ``final_logit_softcapping``); ``None``: no capping.

    Returns:
        The 0-dim float32 loss, with gradients to ``hidden``, ``weight`` and ``bias``.

    Raises:
        ValueError: shapes that do not match, ``chunk_tokens < 1``, or a kernel that cannot run
            here (:func:`resolve_loss_kernel`).
    """
    if hidden.shape[-1] != weight.shape[1] or hidden.shape[:-1] != target.shape:
        raise ValueError(
            f"linear_cross_entropy got hidden {tuple(hidden.shape)}, weight "
            f"{tuple(weight.shape)} and target {tuple(target.shape)}; it needs hidden [..., H], "
            "weight [V, H] and one target per hidden row."
        )
    chunk = default_chunk_tokens(weight.shape[0]) if chunk_tokens is None else chunk_tokens
    if chunk < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be at least 1.")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap} must be positive (or None for no capping).")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = weight.dtype
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_target = target.reshape(-1).to(hidden.device)
    chosen = resolve_loss_kernel(kernel, device_type, compute_dtype)
    need_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    with torch.autocast(device_type, enabled=False):
        if chosen == "chunked":
            total = _LinearCrossEntropy.apply(
                flat_hidden, weight, bias, flat_target, chunk, compute_dtype, need_grad, softcap
            )
        else:
            total = _fused_summed_loss(
                chosen,
                flat_hidden.to(compute_dtype),
                weight.to(compute_dtype),
                None if bias is None else bias.to(compute_dtype),
                flat_target,
                softcap,
            )
    if num_items_in_batch is None:
        return total / (flat_target != IGNORE_INDEX).sum()
    if isinstance(num_items_in_batch, Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def shifted_target(labels: Tensor, shift_labels: Tensor | None) -> Tensor:
    """``shift_labels`` if given, else ``labels`` shifted left with ``-100`` appended (as
    transformers' ``ForCausalLMLoss`` does)."""
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


__all__ = [
    "FUSED_KERNEL_MODULES",
    "IGNORE_INDEX",
    "LOGIT_ELEMENTS_PER_CHUNK",
    "LOSS_KERNELS",
    "LossKernel",
    "check_loss_kernel",
    "default_chunk_tokens",
    "installed_fused_kernels",
    "linear_cross_entropy",
    "resolve_loss_kernel",
    "shifted_target",
]
