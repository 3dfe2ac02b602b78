"""Attention backend names and the choice of kernel: one definition, importing only torch.

``AttentionBackend`` is what a user asks for (``"auto"``, ``"sdpa"``, ``"flash"``);
``KernelBackend`` is what runs (``"sdpa"`` or ``"flash"``): :func:`resolve_backend` turns the
first into the second for a device. The ``flash`` backend runs flash-attn's
``flash_attn_varlen_func`` when that package is installed, else PyTorch's own
``torch.nn.attention.varlen`` (:func:`flash_kernel`); both are looked up without importing them.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from typing import Literal, get_args

import torch

log = logging.getLogger(__name__)

ATTENTION_NAME = "skrull"
"""Name of the Skrull attention function in transformers' ``AttentionInterface``."""

AttentionBackend = Literal["auto", "sdpa", "flash"]
"""Attention kernels a user can ask for: ``"auto"`` picks ``"flash"`` on CUDA when a
FlashAttention varlen kernel (flash-attn, or PyTorch's ``torch.nn.attention.varlen``) is
installed, else ``"sdpa"``."""

ATTENTION_BACKENDS: tuple[AttentionBackend, ...] = get_args(AttentionBackend)
"""The names of :data:`AttentionBackend`, in order."""

KernelBackend = Literal["sdpa", "flash"]
"""Backends an attention context runs (``"auto"`` resolved)."""

FLASH_FIX = (
    "install flash-attn (`pip install flash-attn`) or a CUDA build of PyTorch (which "
    "ships torch.nn.attention.varlen), or use backend='sdpa' (pure PyTorch, any device)"
)
"""How to get a kernel for the ``flash`` backend, for error messages."""


@functools.cache
def flash_attn_available() -> bool:
    """Whether the ``flash_attn`` package can be imported (without importing it; asked once,
    since the attention asks on every call)."""
    return importlib.util.find_spec("flash_attn") is not None


@functools.cache
def torch_varlen_available() -> bool:
    """Whether this PyTorch has ``torch.nn.attention.varlen`` (without importing it; asked once)."""
    try:
        return importlib.util.find_spec("torch.nn.attention.varlen") is not None
    except ModuleNotFoundError:  # pragma: no cover - a PyTorch without torch.nn.attention
        return False


def flash_kernel() -> str | None:
    """The kernel the ``flash`` backend would run: ``"flash-attn"`` (the package, preferred),
    ``"torch"`` (``torch.nn.attention.varlen``), or ``None`` when neither is installed."""
    if flash_attn_available():
        return "flash-attn"
    if torch_varlen_available():
        return "torch"
    return None


def require_flash_kernel() -> None:
    """Raise the error of the ``flash`` backend without a kernel (see :func:`flash_kernel`).

    Raises:
        ValueError: neither flash-attn nor ``torch.nn.attention.varlen`` is installed.
    """
    if flash_kernel() is None:
        raise ValueError(
            "attention backend 'flash' needs a FlashAttention varlen kernel (flash-attn or "
            f"torch.nn.attention.varlen), and neither is installed: {FLASH_FIX}."
        )


def resolve_backend(backend: str, device: torch.device | str) -> KernelBackend:
    """The attention backend to use on ``device``.

    Args:
        backend: ``"auto"`` (``"flash"`` on CUDA when a varlen kernel is installed, else
            ``"sdpa"``; a float32 compute dtype, i.e. float32 without autocast, still runs
            ``"sdpa"``), ``"sdpa"`` or ``"flash"`` (flash-attn's kernel, else PyTorch's;
            float16/bfloat16 compute dtype only: autocast to either, or a 16-bit model).
        device: the activations' device.

    Returns:
        ``"sdpa"`` or ``"flash"``. The choice is logged once per (request, device type).

    Raises:
        ValueError: unknown name, or ``"flash"`` without CUDA or without a varlen kernel.
    """
    device = torch.device(device)
    chosen: KernelBackend
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; use 'auto', 'sdpa' or 'flash'.")
    if backend == "flash":
        if device.type != "cuda":
            raise ValueError(
                f"attention backend 'flash' needs a CUDA device, got {device}; use "
                "backend='sdpa' (or 'auto')."
            )
        require_flash_kernel()
        chosen = "flash"
    elif backend == "sdpa":
        chosen = "sdpa"
    else:
        chosen = "flash" if device.type == "cuda" and flash_kernel() is not None else "sdpa"
    _log_choice(backend, device.type, chosen)
    return chosen


@functools.cache
def _log_choice(requested: str, device_type: str, chosen: str) -> None:
    why = f" ({flash_kernel()} kernel)" if chosen == "flash" else ""
    if requested == "auto" and chosen == "sdpa":
        why = (
            " (no varlen kernel installed)" if device_type == "cuda" else f" ({device_type} device)"
        )
    log.info("lightning-skrull attention backend: %s%s", chosen, why)
